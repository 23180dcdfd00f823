//! The API's Unix socket (`access.socket`): made when the daemon starts, removed when it stops.
//! Anyone may connect (mode 0666, as anyone reaches the loopback port): what a connection gets is
//! decided per connection from the credentials the kernel gives (`access`), not by the file's mode,
//! which a daemon running as its own user (systemd's `DynamicUser`) could not give to a group.

use std::{
    fs, io,
    os::unix::{
        fs::{FileTypeExt as _, PermissionsExt as _},
        net::UnixStream,
    },
    path::{Path, PathBuf},
};

use tokio::net::UnixListener;

/// The socket the daemon listens on; its file is removed when dropped.
pub struct Socket {
    pub listener: UnixListener,
    path: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    #[error("another process serves on the socket {0}: stop it, or give this daemon another with --socket PATH")]
    Taken(String),
    #[error("{0} exists and is not a socket: remove it, or give another path with --socket PATH")]
    NotSocket(String),
    #[error("cannot listen on the socket {0}: {1}; give another path with --socket PATH (\"\" for none)")]
    Bind(String, io::Error),
}

impl Socket {
    /// Listens on `path`, making its directory if missing and replacing the file of a daemon
    /// that died without removing it. Called on the async runtime.
    pub fn bind(path: &Path) -> Result<Self, SocketError> {
        let display = path.display().to_string();
        let fail = |err| SocketError::Bind(display.clone(), err);
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).map_err(fail)?;
        }
        match fs::symlink_metadata(path) {
            Ok(meta) if !meta.file_type().is_socket() => return Err(SocketError::NotSocket(display)),
            Ok(_) if UnixStream::connect(path).is_ok() => return Err(SocketError::Taken(display)),
            Ok(_) => fs::remove_file(path).map_err(fail)?,
            Err(err) if err.kind() == io::ErrorKind::NotFound => {}
            Err(err) => return Err(fail(err)),
        }
        let listener = std::os::unix::net::UnixListener::bind(path).map_err(fail)?;
        listener.set_nonblocking(true).map_err(fail)?;
        let socket = Self { listener: UnixListener::from_std(listener).map_err(fail)?, path: path.to_path_buf() };
        // The umask may have taken permissions away; anyone may connect (see the module's note).
        fs::set_permissions(path, fs::Permissions::from_mode(0o666)).map_err(fail)?;
        Ok(socket)
    }
}

impl Drop for Socket {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}
