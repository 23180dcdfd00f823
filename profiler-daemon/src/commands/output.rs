//! Where a session's reports go: standard output, or a file that only a complete report replaces.
//!
//! A report file is written beside its destination, unnamed (`O_TMPFILE`) where the file system
//! allows it, and renamed over it once a report is complete, so an existing file stays as it was
//! until then: a mistyped pid or a memprof killed midway leaves the previous report whole, never
//! an empty or half-written one, and (unnamed) no leftover either. Streamed formats (table,
//! JSON) go on appending through the same descriptor after the rename; a report a write error
//! cuts short is taken back (not one a SIGKILL cuts, nor one written to a device or a pipe).

use std::{
    ffi::CString,
    fs::{self, File, OpenOptions},
    io::{self, BufWriter, Seek as _, SeekFrom, Write},
    os::{
        fd::AsRawFd as _,
        unix::ffi::OsStrExt as _,
        unix::fs::{FileTypeExt as _, MetadataExt as _, OpenOptionsExt as _},
    },
    path::{Path, PathBuf},
};

use crate::{
    console::Waiting,
    error::{InProc, UserError},
    format::{self, Flame, Format},
    heap::report::Report,
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
    /// The bytes of the reports written whole (a file's: what a device got is not taken back).
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

    /// Writes one complete report (a streamed format's next one, or the only one) in `format`,
    /// its flame graph of what `flame` measures, and, for a file, puts it in place.
    pub fn write_report(&mut self, report: &Report, format: Format, flame: Flame) -> Result<(), UserError> {
        let write = |out: &mut dyn Write| format::write(report, format, flame, out);
        match self {
            Self::Stdout { closed: true } => Ok(()),
            Self::Stdout { closed } => {
                *closed = !print_with(write)?;
                Ok(())
            }
            Self::File(file) => {
                file.append_with(write).map_err(|cause| UserError::Output { path: file.path.clone(), cause })
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
    print_with(|out| out.write_all(text))
}

/// `print`, of what `write` writes.
fn print_with(write: impl FnOnce(&mut dyn Write) -> io::Result<()>) -> Result<bool, UserError> {
    let stdout = io::stdout();
    let fd = stdout.as_raw_fd();
    match buffered(Waiting { out: stdout.lock(), fd }, write) {
        Ok(()) => Ok(true),
        Err(err) if err.kind() == io::ErrorKind::BrokenPipe => Ok(false),
        Err(cause) => Err(UserError::Stdout(cause)),
    }
}

impl ReportFile {
    /// Opens the temporary file beside `path`; `path` itself is not touched yet.
    pub fn create(path: &Path) -> io::Result<Self> {
        // `/dev/stdout` and its kin name a descriptor memprof was given: it is written as given
        // (a pipe, a terminal, a file opened for appending, a file since deleted), never
        // reopened by a path, nor replaced.
        if let Some(fd) = given_descriptor(path) {
            let given = GIVEN.get().is_none_or(|given| given.contains(&fd));
            // SAFETY: fcntl duplicates a descriptor number; an unopened one is an error.
            let copy = if given { unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) } } else { -1 };
            if copy < 0 {
                return Err(io::Error::new(io::ErrorKind::NotFound, format!("memprof was given no descriptor {fd}")));
            }
            // SAFETY: `copy` is a new descriptor this file alone owns.
            let file = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(copy) };
            return Ok(Self::device(path, file));
        }
        // A symbolic link is followed only when its owner is who runs memprof (or root), and its
        // target can be named: another user's link could lead root's output onto a disk's
        // device. Its target is then written: a rename over the link would replace the link.
        let resolved;
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
                resolved = fs::canonicalize(path).map_err(|err| {
                    io::Error::new(
                        err.kind(),
                        format!("a symbolic link whose target memprof cannot name ({err}); give the file's path"),
                    )
                })?;
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
                return Ok(Self::device(path, open_device(path)?));
            }
        }
        let directory = match path.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent,
            _ => Path::new("."),
        };
        // /proc makes no files: the errors it gives (ENOENT for a new name, EACCES or EIO for
        // its own files) would read as a missing directory or a permission.
        if on_procfs(directory) {
            return Err(io::Error::other(InProc));
        }
        let temporary = temporary_name(path)?;
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
            if unreplaceable(path) {
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    "an immutable or append-only file, which nothing can replace (lsattr shows it; chattr -i -a lifts it)",
                ));
            }
            let mode = file.metadata()?.mode() & old.mode() & 0o777;
            file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(mode))?;
        }
        Ok(Self { path: path.to_path_buf(), temporary, file, unnamed, placed: false, device: false, length: 0 })
    }

    /// `file`, a device, a pipe or a descriptor memprof was given, written to where it is.
    fn device(path: &Path, file: File) -> Self {
        let path = path.to_path_buf();
        Self { path, temporary: PathBuf::new(), file, unnamed: false, placed: true, device: true, length: 0 }
    }

    /// Appends a complete report (or record) and puts the file in place.
    pub fn append(&mut self, report: &[u8]) -> io::Result<()> {
        self.append_with(|out| out.write_all(report))
    }

    /// `append`, of what `write` writes: a report written as it is made (JSON) is never held
    /// whole in memory.
    pub fn append_with(&mut self, write: impl FnOnce(&mut dyn Write) -> io::Result<()>) -> io::Result<()> {
        // On disk before it replaces the old file: a full disk fails here, not after the rename.
        // A device or pipe may be non-blocking (a descriptor given as whoever opened it set it):
        // the write waits while it is full.
        let written = if self.device {
            buffered(Waiting { out: &self.file, fd: self.file.as_raw_fd() }, write)
        } else {
            buffered(&self.file, write).and_then(|()| self.file.sync_data())
        };
        if let Err(err) = written {
            if !self.device {
                // A report cut short is taken back: the file ends with the last one written
                // whole, and the next one is written there.
                let _ = self.file.set_len(self.length);
                let _ = (&self.file).seek(SeekFrom::Start(self.length));
            }
            return Err(err);
        }
        if !self.device {
            self.length = (&self.file).stream_position()?;
        }
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

/// Runs `write` into `out` through a buffer, flushed at its end; after an error, what the buffer
/// holds is dropped unwritten.
fn buffered(out: impl Write, write: impl FnOnce(&mut dyn Write) -> io::Result<()>) -> io::Result<()> {
    let mut buffer = BufWriter::with_capacity(WRITE_BUFFER_BYTES, out);
    let written = write(&mut buffer).and_then(|()| buffer.flush());
    if written.is_err() {
        let _ = buffer.into_parts();
    }
    written
}

/// How much of a report is gathered before a write: serde_json writes token by token.
const WRITE_BUFFER_BYTES: usize = 1 << 20;

/// The descriptors open when memprof started, before it opened any of its own (see
/// `given_descriptor`).
static GIVEN: std::sync::OnceLock<Vec<i32>> = std::sync::OnceLock::new();

/// Notes the descriptors memprof was given: `-o /dev/fd/N` names one of them, never one of
/// memprof's own. Called in `main` before memprof opens anything.
pub fn note_given_descriptors() {
    let open = fs::read_dir("/proc/self/fd")
        .map(|dir| dir.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok()).collect::<Vec<i32>>());
    // The listing's own descriptor is among them, closed since: it is no output.
    let _ = GIVEN.set(open.unwrap_or_default());
}

/// The descriptor a path names that memprof was given: `/dev/stdout`, `/dev/stderr`,
/// `/dev/fd/N` and `/proc/self/fd/N` (a shell's `>(...)`), however spelt (`/dev//stdout`).
fn given_descriptor(path: &Path) -> Option<i32> {
    let parts: Vec<&str> = path
        .components()
        .filter(|part| *part != std::path::Component::CurDir)
        .map(|part| part.as_os_str().to_str())
        .collect::<Option<_>>()?;
    let fd = match parts.as_slice() {
        ["/", "dev", "stdout"] => 1,
        ["/", "dev", "stderr"] => 2,
        ["/", "dev", "fd", n] | ["/", "proc", "self", "fd", n] => n.parse().ok()?,
        _ => return None,
    };
    Some(fd)
}

/// The device or pipe at `path`, opened for writing. What was checked by its path is checked
/// again on the file itself: another user may swap the path meanwhile (a FIFO of theirs in /tmp
/// for a link to a disk or to root's file). So the path is first taken without opening the file
/// and without following a link (`O_PATH | O_NOFOLLOW`), the file it names is checked, then
/// opened through that handle. Only a terminal, `/dev/null` or a FIFO is written: a FIFO the
/// caller's or root's, as another user's would hand them the report, or keep memprof waiting
/// for a reader that never comes.
/// Whether the file at `path` is immutable or append-only (`chattr +i`, `+a`): a rename over it
/// fails. False where its file system keeps no such flags.
fn unreplaceable(path: &Path) -> bool {
    /// `FS_IOC_GETFLAGS`, `_IOR('f', 1, long)`, and its immutable and append-only flags.
    const GET_FLAGS: libc::c_ulong = 0x8008_6601;
    const IMMUTABLE_OR_APPEND: libc::c_long = 0x10 | 0x20;
    let Ok(file) = OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path) else { return false };
    let mut flags: libc::c_long = 0;
    // SAFETY: the ioctl writes one long into `flags`, which outlives the call.
    let read = unsafe { libc::ioctl(file.as_raw_fd(), GET_FLAGS, &mut flags as *mut libc::c_long) };
    read == 0 && flags & IMMUTABLE_OR_APPEND != 0
}

fn open_device(path: &Path) -> io::Result<File> {
    let handle = OpenOptions::new().read(true).custom_flags(libc::O_PATH | libc::O_NOFOLLOW).open(path)?;
    let meta = handle.metadata()?;
    let kind = meta.file_type();
    if kind.is_block_device() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "a block device; give a file"));
    }
    if !(kind.is_char_device() || kind.is_fifo() || kind.is_socket()) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "it changed while memprof opened it; give it again"));
    }
    // Checked before the open: opening some devices acts (a watchdog's arms it; /dev/ptmx makes
    // a terminal nobody reads), and opening another user's FIFO would wait for its reader.
    if kind.is_char_device() {
        let (major, minor) = (libc::major(meta.rdev()), libc::minor(meta.rdev()));
        let null = (major, minor) == (1, 3);
        // /dev/tty and the console; virtual consoles and serial lines; pseudo-terminals.
        let terminal = (major == 5 && minor <= 1) || major == 4 || (136..=143).contains(&major);
        if !null && !terminal {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a device other than a terminal or /dev/null; give a file",
            ));
        }
    } else if kind.is_fifo() {
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if meta.uid() != me && meta.uid() != 0 {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "a pipe another user owns; give a file, or a pipe of yours",
            ));
        }
    } else {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "a socket, which no file opens; give a file"));
    }
    // The very file checked, whatever its path names now; a terminal without becoming memprof's
    // controlling one, and a serial line without waiting for its carrier. Non-blocking stays:
    // `append` waits while a device is full, as for a descriptor given so.
    OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NOCTTY | libc::O_NONBLOCK)
        .open(format!("/proc/self/fd/{}", handle.as_raw_fd()))
}

/// Whether `directory` is on a proc file system.
fn on_procfs(directory: &Path) -> bool {
    let Ok(name) = CString::new(directory.as_os_str().as_bytes()) else { return false };
    // SAFETY: statfs writes at most one `statfs` into the zeroed one given.
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `name` is a C string that outlives the call.
    unsafe { libc::statfs(name.as_ptr(), &mut stat) == 0 && stat.f_type == libc::PROC_SUPER_MAGIC }
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
            let err = open_device(path).unwrap_err();
            assert!(err.to_string().contains("it changed while memprof opened it"), "{err}");
        }
        assert_eq!(fs::read_to_string(&file).unwrap(), "root's");
        assert!(open_device(Path::new("/dev/null")).is_ok());
        let err = open_device(Path::new("/dev/zero")).unwrap_err();
        assert!(err.to_string().contains("a device other than a terminal or /dev/null"), "{err}");
        fs::remove_dir_all(&dir).unwrap();
    }
}
