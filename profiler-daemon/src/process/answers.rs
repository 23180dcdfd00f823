//! Whether a file system that can leave a request unanswered answers now: root's FUSE servers
//! and network file systems, whose server may hang or be gone (an NFS hard mount then waits for
//! good, and a process waiting on FUSE may not even die of SIGKILL). One such mount must not stop
//! memprof from tracing every other process, nor from exiting. So before memprof touches a file
//! there, a child process opens and reads it, holding none of memprof's descriptors, and memprof
//! waits for the child for at most `ANSWER_TIME`. A child that gets no answer stays where it is;
//! until it ends, the mount counts as not answering, at once.

use std::{
    collections::HashMap,
    ffi::CString,
    os::{
        fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

/// How long a look at such a file may take before memprof leaves the mount alone.
pub const ANSWER_TIME: Duration = Duration::from_secs(2);
/// How long an answer is trusted before the mount is asked again.
const TRUSTED_FOR: Duration = Duration::from_secs(10);

/// One look at a mount: the child that looks, shared by every caller waiting for it.
struct Look {
    started: Instant,
    pid: libc::pid_t,
    /// The child's pidfd, readable once it has ended.
    child: OwnedFd,
}

impl Look {
    /// Whether the child ended within `wait`; reaps it then.
    fn ended_within(&self, wait: Duration) -> bool {
        let mut ready = libc::pollfd { fd: self.child.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let millis = i32::try_from(wait.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: one valid pollfd, for the length given.
        if unsafe { libc::poll(&mut ready, 1, millis) } != 1 {
            return false;
        }
        // SAFETY: reaps our own child; another waiter may have reaped it already (ECHILD).
        unsafe { libc::waitpid(self.pid, std::ptr::null_mut(), libc::WNOHANG) };
        true
    }
}

enum Mount {
    Answered(Instant),
    Looking(Arc<Look>),
}

/// The mounts asked, by device (major, minor).
static MOUNTS: Mutex<Option<HashMap<(u64, u64), Mount>>> = Mutex::new(None);

/// Whether the mount of `device` answers: a look at `path`, a file on it, ended within
/// `ANSWER_TIME` (or did within `TRUSTED_FOR`). An error is an answer.
pub fn answers(device: (u64, u64), path: &Path) -> bool {
    let look = {
        let mut mounts = MOUNTS.lock().unwrap_or_else(PoisonError::into_inner);
        let mounts = mounts.get_or_insert_with(HashMap::new);
        match mounts.get(&device) {
            Some(Mount::Answered(at)) if at.elapsed() < TRUSTED_FOR => return true,
            Some(Mount::Looking(look)) => Arc::clone(look),
            _ => match start_look(path) {
                Some(look) => {
                    mounts.insert(device, Mount::Looking(Arc::clone(&look)));
                    look
                }
                // No child to look with: the mount's files are left alone this time.
                None => return false,
            },
        }
    };
    // A look that has waited `ANSWER_TIME` already is not waited for again.
    let answered = look.ended_within(ANSWER_TIME.saturating_sub(look.started.elapsed()));
    if answered {
        let mut mounts = MOUNTS.lock().unwrap_or_else(PoisonError::into_inner);
        mounts.get_or_insert_with(HashMap::new).insert(device, Mount::Answered(Instant::now()));
    }
    answered
}

/// Forks a child that opens and reads the start of `path`, then exits.
fn start_look(path: &Path) -> Option<Arc<Look>> {
    let path = CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: the child makes only async-signal-safe system calls, then `_exit`s.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: system calls on the child's own descriptors and a buffer of its stack. It
        // closes every descriptor first: a child the file system never answers must not hold
        // memprof's listener, or a pipe its reader waits to see closed.
        unsafe {
            libc::syscall(libc::SYS_close_range, 0, u32::MAX, 0);
            // Named for what it does, for whoever finds it waiting in `ps`.
            libc::prctl(libc::PR_SET_NAME, c"memprof-look".as_ptr());
            // Not waiting for a writer, should the path name a FIFO.
            let fd = libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_NONBLOCK | libc::O_CLOEXEC);
            if fd >= 0 {
                let mut start = [0u8; 64];
                libc::read(fd, start.as_mut_ptr().cast(), start.len());
            }
            libc::_exit(0);
        }
    }
    if pid < 0 {
        tracing::debug!("no child to look at {} with: {}", path.to_string_lossy(), std::io::Error::last_os_error());
        return None;
    }
    // SAFETY: a system call on our own child's pid, which is not reaped before this.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if pidfd < 0 {
        // SAFETY: our own child, killed: without its pidfd it cannot be waited for. Reaped if it
        // is gone already (else by whoever adopts it once memprof exits).
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG);
        }
        return None;
    }
    // SAFETY: a descriptor just returned to us, owned from here on.
    let child = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
    Some(Arc::new(Look { started: Instant::now(), pid, child }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mount_that_answers_is_trusted_a_while() {
        let device = (0, u64::MAX);
        assert!(answers(device, Path::new("/proc/self/status")));
        // Trusted now: even a path that would never answer is not looked at again.
        assert!(answers(device, Path::new("/nonexistent")));
    }
}
