//! memprof's standard output and error, written whole. The command `memprof run` starts shares
//! them and may make them non-blocking (node does): a full pipe then answers EAGAIN, which is no
//! reason to stop, nor to panic as `eprintln!` does on any error.

use std::{
    fmt, io,
    os::fd::{AsRawFd, RawFd},
};

use crate::text::printable;

/// `text` with its control characters written out but for its line breaks.
fn written_out(text: &str) -> String {
    text.split('\n').map(printable).collect::<Vec<_>>().join("\n")
}

/// Writes a line to standard error, waiting while it is full; a reader gone or a closed
/// descriptor loses the line, never the session.
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::console::say_line(format_args!($($arg)*))
    };
}
pub(crate) use say;

/// `say!`'s body: the line formatted once, then written whole. Control characters are written
/// out (see `text::printable`), line breaks kept: lines name paths that traced processes chose,
/// and an escape sequence among them would drive the user's terminal.
pub fn say_line(line: fmt::Arguments<'_>) {
    let mut text = written_out(&line.to_string());
    text.push('\n');
    let stderr = io::stderr();
    let fd = stderr.as_raw_fd();
    let _ = write_waiting(&mut stderr.lock(), fd, text.as_bytes());
}

/// Standard error for the log, written as `say!` writes.
pub struct Stderr;

impl io::Write for Stderr {
    fn write(&mut self, text: &[u8]) -> io::Result<usize> {
        let stderr = io::stderr();
        let fd = stderr.as_raw_fd();
        write_waiting(&mut stderr.lock(), fd, text)?;
        Ok(text.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// `write_all` then `flush` to `out`, descriptor `fd`, waiting while it is full.
pub fn write_waiting(out: &mut impl io::Write, fd: RawFd, text: &[u8]) -> io::Result<()> {
    let mut waiting = Waiting { out, fd };
    io::Write::write_all(&mut waiting, text)?;
    io::Write::flush(&mut waiting)
}

/// `out`, descriptor `fd`, whose writes and flushes wait while it is full.
pub struct Waiting<W> {
    pub out: W,
    pub fd: RawFd,
}

impl<W: io::Write> io::Write for Waiting<W> {
    fn write(&mut self, text: &[u8]) -> io::Result<usize> {
        loop {
            match self.out.write(text) {
                Err(err) => wait_if_full(self.fd, err)?,
                written => return written,
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        loop {
            match self.out.flush() {
                Ok(()) => return Ok(()),
                Err(err) => wait_if_full(self.fd, err)?,
            }
        }
    }
}

/// Returns once `fd` takes more when `err` says it was full (or a signal came first); `err`
/// otherwise.
fn wait_if_full(fd: RawFd, err: io::Error) -> io::Result<()> {
    match err.kind() {
        io::ErrorKind::Interrupted => Ok(()),
        io::ErrorKind::WouldBlock => {
            let mut full = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
            // SAFETY: one pollfd, valid for the call's duration.
            unsafe { libc::poll(&mut full, 1, -1) };
            Ok(())
        }
        _ => Err(err),
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::{FromRawFd, OwnedFd};

    use super::*;

    #[test]
    fn escape_sequences_are_written_out_and_line_breaks_kept() {
        assert_eq!(
            written_out("tracing /tmp/\x1b]0;owned\x07lib.so\nnext"),
            "tracing /tmp/\\x1b]0;owned\\x07lib.so\nnext"
        );
    }

    /// A pipe whose writing end is non-blocking, as node leaves the one it shares.
    fn non_blocking_pipe() -> (std::fs::File, std::fs::File) {
        let mut fds = [0; 2];
        // SAFETY: pipe2 fills the two descriptors, which are then owned by the files below.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK) }, 0);
        // SAFETY: descriptors just made and owned by nothing else.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        (read.into(), write.into())
    }

    #[test]
    fn a_full_non_blocking_pipe_is_waited_for_not_an_error() {
        let (mut read, mut write) = non_blocking_pipe();
        let text = vec![b'x'; 1 << 20];
        let reader = std::thread::spawn(move || {
            let mut all = Vec::new();
            let mut chunk = [0u8; 65536];
            while all.len() < 1 << 20 {
                match io::Read::read(&mut read, &mut chunk) {
                    Ok(n) => all.extend_from_slice(&chunk[..n]),
                    Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                        std::thread::sleep(std::time::Duration::from_millis(1))
                    }
                    Err(err) => panic!("{err}"),
                }
            }
            all.len()
        });
        let fd = write.as_raw_fd();
        write_waiting(&mut write, fd, &text).expect("written whole");
        assert_eq!(reader.join().unwrap(), 1 << 20);
    }
}
