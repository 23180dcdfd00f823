//! Files memprof is given to read: recordings, snapshots, settings, rules, certificates. Their
//! paths may name a FIFO. One is opened without waiting for a writer, where a plain open would
//! wait for ever when nobody writes: it then reads as empty at once. `<(zcat rec.gz)` still
//! works, as its writer is there.

use std::{
    fs::{File, OpenOptions},
    io::{self, Read as _},
    os::{fd::AsRawFd as _, unix::fs::OpenOptionsExt as _},
    path::Path,
};

/// `path`, opened for reading without waiting on a FIFO; reads wait for data as usual.
pub fn open(path: &Path) -> io::Result<File> {
    let file = OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)?;
    wait_as_usual(&file)?;
    Ok(file)
}

/// Takes `O_NONBLOCK` off `file`, opened with it so as not to wait for a pipe's other end: its
/// reads and writes then wait as usual.
fn wait_as_usual(file: &File) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor `file` owns, with flags it returned.
    let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 || unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The text of the file at `path`, refused past `limit` bytes: a config file, a list of rules or
/// a certificate that large is none, and a path such as `/dev/zero` would take all the memory
/// there is.
pub fn read_text(path: &Path, limit: u64) -> io::Result<String> {
    let mut text = String::new();
    open(path)?.take(limit.saturating_add(1)).read_to_string(&mut text)?;
    if text.len() as u64 > limit {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("larger than {} KiB: not such a file", limit >> 10),
        ));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fifo_nobody_writes_reads_as_empty_at_once() {
        let dir = std::env::temp_dir().join(format!("memprof-input-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo");
        let name = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        assert_eq!(read_text(&fifo, 1024).unwrap(), "");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_past_the_limit_is_refused() {
        let err = read_text(Path::new("/dev/zero"), 4096).unwrap_err();
        assert!(err.to_string().contains("larger than 4 KiB"), "{err}");
    }
}
