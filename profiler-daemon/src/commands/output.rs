//! Where a session's reports go: standard output, or a file that only a complete report replaces.
//!
//! A report file is written beside its destination, unnamed (`O_TMPFILE`) where the file system
//! allows it, and renamed over it once a report is complete, so an existing file stays as it was
//! until then: a mistyped pid or a memprof killed midway leaves the previous report whole, never
//! an empty or half-written one, and (unnamed) no leftover either. Streamed formats (table,
//! JSON) go on appending through the same descriptor after the rename, each report whole or not
//! at all.

use std::{
    ffi::CString,
    fs::{self, File, OpenOptions},
    io::{self, Write as _},
    os::{
        fd::AsRawFd as _,
        unix::ffi::OsStrExt as _,
        unix::fs::{FileTypeExt as _, MetadataExt as _, OpenOptionsExt as _},
    },
    path::{Path, PathBuf},
};

use crate::{
    console,
    error::UserError,
    format::{self, Format},
};

pub enum ReportOutput {
    /// Standard output; `closed` once its reader has gone (`| head -1`).
    Stdout {
        closed: bool,
    },
    File(ReportFile),
}

pub struct ReportFile {
    path: PathBuf,
    temporary: PathBuf,
    file: File,
    /// The file has no name yet (`O_TMPFILE`): it gets `temporary` when it is placed.
    unnamed: bool,
    /// Renamed over `path`: a report is in it.
    placed: bool,
    /// `path` is a device or a pipe, written to directly.
    device: bool,
    /// The bytes of the reports written whole.
    length: u64,
}

impl ReportOutput {
    /// Checks the destination and opens the temporary file; `path` itself is not touched yet.
    pub fn open(format: Format, path: Option<&Path>) -> Result<Self, UserError> {
        // `-o -` is standard output, as for most tools.
        let path = path.filter(|path| path.as_os_str() != "-");
        format::check_destination(format, path)?;
        let Some(path) = path else { return Ok(Self::Stdout { closed: false }) };
        ReportFile::create(path).map(Self::File).map_err(|cause| UserError::Output { path: path.to_path_buf(), cause })
    }

    /// The file reports go to, when not standard output.
    pub fn path(&self) -> Option<&Path> {
        match self {
            Self::Stdout { .. } => None,
            Self::File(file) => Some(&file.path),
        }
    }

    /// Writes one complete report (a streamed format's next one, or the only one) and, for a
    /// file, puts it in place.
    pub fn write_report(&mut self, report: &[u8]) -> Result<(), UserError> {
        match self {
            Self::Stdout { closed: true } => Ok(()),
            Self::Stdout { closed } => {
                *closed = !print(report)?;
                Ok(())
            }
            Self::File(file) => {
                file.append(report).map_err(|cause| UserError::Output { path: file.path.clone(), cause })
            }
        }
    }

    /// Whether someone still reads the reports: false once standard output's reader has gone,
    /// which ends a session as `--duration` does.
    pub fn is_read(&self) -> bool {
        !matches!(self, Self::Stdout { closed: true })
    }
}

/// Writes `text` to standard output; returns false when its reader has gone (`| head -1`), which
/// is not an error: whoever read it has what they wanted.
pub fn print(text: &[u8]) -> Result<bool, UserError> {
    let stdout = io::stdout();
    let fd = stdout.as_raw_fd();
    match console::write_waiting(&mut stdout.lock(), fd, text) {
        Ok(()) => Ok(true),
        Err(err) if err.kind() == io::ErrorKind::BrokenPipe => Ok(false),
        Err(cause) => Err(UserError::Stdout(cause)),
    }
}

impl ReportFile {
    /// Opens the temporary file beside `path`; `path` itself is not touched yet.
    pub fn create(path: &Path) -> io::Result<Self> {
        // A symbolic link is followed only when its owner is who runs memprof (or root, as
        // `/dev/stdout`'s is): another user's link could lead root's output onto a disk's device.
        // Its target is then written: a rename over the link would replace `/dev/stdout` itself.
        let resolved;
        let mut through_link = false;
        let path = match fs::symlink_metadata(path) {
            Ok(meta) if meta.file_type().is_symlink() => {
                // SAFETY: geteuid has no preconditions.
                let me = unsafe { libc::geteuid() };
                if meta.uid() != me && meta.uid() != 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::PermissionDenied,
                        "a symbolic link another user owns; give the path it leads to",
                    ));
                }
                resolved = fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
                through_link = true;
                &resolved
            }
            _ => path,
        };
        // A device or a pipe (`/dev/null`, a FIFO) is written to, never replaced by a file: a
        // rename over /dev/null leaves the host with a regular file there.
        if let Ok(kind) = fs::metadata(path).map(|meta| meta.file_type()) {
            if kind.is_dir() {
                return Err(io::Error::from_raw_os_error(libc::EISDIR));
            }
            if !kind.is_file() {
                let file = open_device(path, through_link)?;
                let path = path.to_path_buf();
                return Ok(Self {
                    path,
                    temporary: PathBuf::new(),
                    file,
                    unnamed: false,
                    placed: true,
                    device: true,
                    length: 0,
                });
            }
        }
        let temporary = temporary_name(path)?;
        let directory = match path.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent,
            _ => Path::new("."),
        };
        let unnamed = OpenOptions::new().write(true).mode(0o666).custom_flags(libc::O_TMPFILE).open(directory);
        let (file, unnamed) = match unnamed {
            Ok(file) => (file, true),
            // A file system without O_TMPFILE: a named temporary file.
            Err(_) => match OpenOptions::new().write(true).create_new(true).open(&temporary) {
                Ok(file) => (file, false),
                // The report replaces the file whole, so it needs a new file beside it first.
                Err(err) => {
                    let why = format!("no file can be made beside it in {}: {err}", directory.display());
                    return Err(io::Error::new(err.kind(), why));
                }
            },
        };
        // A file kept from others (0600) stays so: its replacement gets no permission the old
        // file lacked, and none it did not have by the umask either.
        if let Some(old) = fs::symlink_metadata(path).ok().filter(|meta| meta.is_file()) {
            let mode = file.metadata()?.mode() & old.mode() & 0o777;
            file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(mode))?;
        }
        Ok(Self { path: path.to_path_buf(), temporary, file, unnamed, placed: false, device: false, length: 0 })
    }

    /// Appends a complete report (or record) and puts the file in place.
    pub fn append(&mut self, report: &[u8]) -> io::Result<()> {
        // On disk before it replaces the old file: a full disk fails here, not after the rename.
        let written =
            self.file.write_all(report).and_then(|()| if self.device { Ok(()) } else { self.file.sync_data() });
        if let Err(err) = written {
            if !self.device {
                // A report cut short is taken back: the file ends with the last one written whole.
                let _ = self.file.set_len(self.length);
            }
            return Err(err);
        }
        self.length += report.len() as u64;
        if !self.placed {
            if self.unnamed {
                self.name()?;
            }
            fs::rename(&self.temporary, &self.path)?;
            self.placed = true;
        }
        Ok(())
    }

    /// Gives the unnamed file its temporary name (a link cannot replace a file; a rename can).
    fn name(&mut self) -> io::Result<()> {
        let from = CString::new(format!("/proc/self/fd/{}", self.file.as_raw_fd()))?;
        // A name another process took meanwhile (anyone may create files in /tmp): another.
        for _ in 0..16 {
            let to = CString::new(self.temporary.as_os_str().as_bytes())?;
            // SAFETY: two NUL-terminated paths that outlive the call.
            let linked = unsafe {
                libc::linkat(libc::AT_FDCWD, from.as_ptr(), libc::AT_FDCWD, to.as_ptr(), libc::AT_SYMLINK_FOLLOW)
            };
            if linked == 0 {
                self.unnamed = false;
                return Ok(());
            }
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::AlreadyExists {
                return Err(err);
            }
            self.temporary = temporary_name(&self.path)?;
        }
        Err(io::Error::new(io::ErrorKind::AlreadyExists, "every temporary name tried beside it was taken"))
    }
}

impl Drop for ReportFile {
    fn drop(&mut self) {
        if !self.placed && !self.unnamed {
            let _ = fs::remove_file(&self.temporary);
        }
    }
}

/// The device or pipe at `path`, opened for writing. What was checked by its path is checked
/// again on the file itself: another user may swap the path meanwhile (a FIFO of theirs in /tmp
/// for a link to a disk or to root's file). So the path is first taken without opening the file
/// (`O_PATH`), following no link unless `through_link` (the path came through a link the caller
/// or root owns), and the file it names is checked, then opened through that handle. A pipe must
/// be the caller's or root's: another user's would hand them the report, or keep memprof
/// waiting for a reader that never comes.
fn open_device(path: &Path, through_link: bool) -> io::Result<File> {
    let no_follow = if through_link { 0 } else { libc::O_NOFOLLOW };
    let handle = OpenOptions::new().read(true).custom_flags(libc::O_PATH | no_follow).open(path)?;
    let meta = handle.metadata()?;
    let kind = meta.file_type();
    if kind.is_block_device() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "a block device; give a file"));
    }
    if !(kind.is_char_device() || kind.is_fifo() || kind.is_socket()) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "it changed while memprof opened it; give it again"));
    }
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if !kind.is_char_device() && meta.uid() != me && meta.uid() != 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "a pipe another user owns; give a file, or a pipe of yours",
        ));
    }
    // The very file checked, whatever its path names now.
    OpenOptions::new().write(true).open(format!("/proc/self/fd/{}", handle.as_raw_fd()))
}

/// `.NAME.memprof-RANDOM` in the destination's directory: a rename within one file system, under
/// a name no one can take first.
fn temporary_name(path: &Path) -> io::Result<PathBuf> {
    let name = path.file_name().ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "not a file name"))?;
    let mut random = [0u8; 8];
    // SAFETY: getrandom writes at most the buffer's length into it.
    if unsafe { libc::getrandom(random.as_mut_ptr().cast(), random.len(), 0) } != random.len() as isize {
        return Err(io::Error::last_os_error());
    }
    let mut temporary = std::ffi::OsString::from(".");
    temporary.push(name);
    temporary.push(format!(".memprof-{:016x}", u64::from_ne_bytes(random)));
    Ok(path.with_file_name(temporary))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What another user may swap in between the check of a path and its open is refused on the
    /// file opened: a link, or a regular file where a pipe was.
    #[test]
    fn a_device_path_swapped_for_a_link_or_a_file_is_refused() {
        let dir = std::env::temp_dir().join(format!("memprof-output-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let file = dir.join("file");
        fs::write(&file, "root's").unwrap();
        let link = dir.join("link");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        for path in [&link, &file] {
            let err = open_device(path, false).unwrap_err();
            assert!(err.to_string().contains("it changed while memprof opened it"), "{err}");
        }
        assert_eq!(fs::read_to_string(&file).unwrap(), "root's");
        assert!(open_device(Path::new("/dev/null"), false).is_ok());
        fs::remove_dir_all(&dir).unwrap();
    }
}
