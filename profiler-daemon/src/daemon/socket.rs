//! The API's Unix socket (`access.socket`): made when the daemon starts, removed when it stops.
//! Anyone may connect (mode 0666, as anyone reaches the loopback port): what a connection gets is
//! decided per connection from the credentials the kernel gives (`access`), not by the file's mode,
//! which a daemon running as its own user (systemd's `DynamicUser`) could not give to a group.

use std::{
    fs, io,
    os::unix::{
        ffi::OsStrExt as _,
        fs::{FileTypeExt as _, MetadataExt as _},
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
    #[error(
        "the socket's directory {0} can be written by another user (owner uid {1}, mode {2:o}), who could take the socket's name first or replace it: give a directory only root writes with --socket PATH (by default /run/memprof/api.sock)"
    )]
    UnsafeDirectory(String, u32, u32),
}

impl Socket {
    /// Listens on `path`, making its directory if missing and replacing the file of a daemon
    /// that died without removing it. Called on the async runtime.
    pub fn bind(path: &Path) -> Result<Self, SocketError> {
        let display = path.display().to_string();
        let fail = |err| SocketError::Bind(display.clone(), err);
        if let Some(dir) = path.parent().filter(|dir| !dir.as_os_str().is_empty()) {
            fs::create_dir_all(dir).map_err(fail)?;
            check_directory(dir, &display)?;
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
        // Not through a symbolic link: only the daemon's own socket gets this mode.
        let c_path = std::ffi::CString::new(path.as_os_str().as_bytes())
            .map_err(|err| fail(io::Error::new(io::ErrorKind::InvalidInput, err)))?;
        // SAFETY: a NUL-terminated path, a mode and flags.
        if unsafe { libc::fchmodat(libc::AT_FDCWD, c_path.as_ptr(), 0o666, libc::AT_SYMLINK_NOFOLLOW) } != 0 {
            return Err(fail(io::Error::last_os_error()));
        }
        Ok(socket)
    }
}

/// Refuses `dir` unless only the daemon's user (or root) can change the names in it: else
/// another user could replace the socket between two steps of `bind`, or later. The sticky bit
/// (/tmp) is not enough: it keeps others from removing the daemon's socket, not from binding its
/// name first, which kept the daemon from starting. `socket`: the socket's path, for the error.
fn check_directory(dir: &Path, socket: &str) -> Result<(), SocketError> {
    let meta = fs::metadata(dir).map_err(|err| SocketError::Bind(socket.to_string(), err))?;
    let (uid, mode) = (meta.uid(), meta.mode() & 0o7777);
    // SAFETY: geteuid has no arguments and cannot fail.
    let owned = uid == 0 || uid == unsafe { libc::geteuid() };
    let others_write = mode & 0o022 != 0;
    if owned && !others_write {
        return Ok(());
    }
    Err(SocketError::UnsafeDirectory(dir.display().to_string(), uid, mode))
}

impl Drop for Socket {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}
