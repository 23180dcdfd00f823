//! The last close of probe links, made by child processes.
//!
//! Closing a uprobe's last link has the kernel take its breakpoints out of every process that
//! maps the file. That walk gives up when the closing thread has a SIGKILL pending: the kernel
//! logs "failed to unregister, leaking uprobe", keeps the uprobe for good, and leaves its
//! breakpoints in the traced processes, which then trap at every call with no program to run.
//! memprof may be killed at any moment (the OOM killer, a stop timeout, `kill -9`), so it never
//! makes that last close itself: children forked for it hold copies of the links, and their
//! copies close as they exit, which no signal interrupts. If memprof dies first, they exit all
//! the same, at the end of their pipe.

use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd};

/// Children holding copies of links, each until `release`.
pub struct Holders {
    children: Vec<libc::pid_t>,
    /// Its closing ends the children's wait.
    pipe: OwnedFd,
}

impl Holders {
    /// Forks up to `most` children, which share out `links` (descriptors the caller owns) and
    /// hold nothing else. None when no child could be made: the caller then closes the links
    /// itself.
    pub fn fork(links: &[RawFd], most: usize) -> Option<Self> {
        let (read, write) = pipe()?;
        let children = most.min(links.len()).max(1);
        let shares: Vec<Vec<RawFd>> = (0..children)
            .map(|child| {
                let mut keep: Vec<RawFd> = links.iter().copied().skip(child).step_by(children).collect();
                keep.push(read.as_raw_fd());
                keep.sort_unstable();
                keep
            })
            .collect();
        let mut forked = Vec::with_capacity(children);
        for keep in &shares {
            // SAFETY: fork has no preconditions. The child of this multi-threaded process calls
            // only async-signal-safe system calls on memory prepared before the fork (`hold`).
            match unsafe { libc::fork() } {
                0 => hold(keep, read.as_raw_fd()),
                -1 => break,
                child => forked.push(child),
            }
        }
        drop(read);
        if forked.len() < shares.len() {
            // A share without its child: every child lets go, and the caller closes the links.
            Self { children: forked, pipe: write }.release();
            return None;
        }
        Some(Self { children: forked, pipe: write })
    }

    /// Once the caller has closed its own copies: lets the children exit, and returns when they
    /// have, and with them the links.
    pub fn release(self) {
        drop(self.pipe);
        for child in self.children {
            loop {
                // SAFETY: waits for a child this process forked; no status is read.
                let waited = unsafe { libc::waitpid(child, std::ptr::null_mut(), 0) };
                if waited >= 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                    break;
                }
            }
        }
    }
}

/// The child: closes every descriptor but `keep` (sorted), waits until the pipe `read` ends,
/// and exits. Only system calls: the memory it reads was made before the fork.
fn hold(keep: &[RawFd], read: RawFd) -> ! {
    let mut from: u32 = 0;
    for &fd in keep {
        let fd = fd as u32;
        if fd > from {
            // SAFETY: close_range only closes descriptors of this (child) process.
            unsafe { libc::syscall(libc::SYS_close_range, from, fd - 1, 0) };
        }
        from = fd + 1;
    }
    // SAFETY: as above, up to the last descriptor there can be.
    unsafe { libc::syscall(libc::SYS_close_range, from, u32::MAX, 0) };
    let mut byte = 0u8;
    loop {
        // SAFETY: reads at most one byte into a byte on this stack.
        let read = unsafe { libc::read(read, (&raw mut byte).cast(), 1) };
        // SAFETY: reading errno of this thread.
        if read >= 0 || unsafe { *libc::__errno_location() } != libc::EINTR {
            break;
        }
    }
    // SAFETY: ends the child without running anything of the parent's (no atexit, no flush).
    unsafe { libc::_exit(0) }
}

fn pipe() -> Option<(OwnedFd, OwnedFd)> {
    let mut ends = [0 as RawFd; 2];
    // SAFETY: pipe2 writes two descriptors into the array it is given.
    if unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return None;
    }
    // SAFETY: two descriptors the kernel just gave this process, owned by nothing else.
    Some(unsafe { (OwnedFd::from_raw_fd(ends[0]), OwnedFd::from_raw_fd(ends[1])) })
}
