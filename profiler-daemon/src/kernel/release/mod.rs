//! The last close of probe links, made by a helper process.
//!
//! Closing a uprobe's last link has the kernel take its breakpoints out of every process that
//! maps the file. That walk gives up when the closing thread has a SIGKILL pending: the kernel
//! logs "failed to unregister, leaking uprobe", keeps the uprobe for good, and leaves its
//! breakpoints in the traced processes, which then trap at every call with no program to run.
//! memprof may be killed at any moment (the OOM killer, `kill -9`), so it never
//! makes that last close itself: it gives a helper copies of the links, closes its own, and
//! then has the helper close its copies. If memprof dies first, the helper closes them at the
//! end of its socket.
//!
//! The helper is memprof started again (`helper::ARGUMENT`), so it holds none of memprof's
//! memory; it is started at the first detach and kept for the next. A child forked for each
//! detach copied memprof's page tables, and made each page memprof wrote meanwhile a copy.

mod helper;
mod rights;

use std::{
    io,
    os::fd::{AsFd as _, FromRawFd as _, OwnedFd, RawFd},
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        Mutex,
    },
};

pub use helper::run_if_asked;

/// What memprof sends the helper, and the helper's answer (each a message's one byte).
const HOLD: u8 = 1;
const CLOSE: u8 = 2;
const CLOSED: u8 = 3;

/// Threads that close links together. A fixed few: each close of a uprobe_multi link walks every
/// process that maps the file under the kernel's locks, so more threads only wait on each other
/// (threads per process and per link made the daemon run 1,270 threads, 926 of them blocked there).
const CLOSERS: usize = 8;

/// Helpers waiting for work: as many as there were detaches at the same time.
static IDLE: Mutex<Vec<Helper>> = Mutex::new(Vec::new());

/// Copies of links a helper holds, until `release`.
pub struct Holder(Helper);

impl Holder {
    /// Gives a helper copies of `links` (descriptors the caller owns). None when no helper could
    /// take them (said in a warning): the caller then closes the links itself.
    pub fn give(links: &[RawFd]) -> Option<Self> {
        // A helper kept from an earlier detach may have been killed since: then the next.
        while let Some(helper) = Helper::idle() {
            match helper.hold(links) {
                Ok(()) => return Some(Self(helper)),
                Err(_) => helper.end(),
            }
        }
        let helper = Helper::start().inspect_err(|err| warn_once(&format!("starting it: {err}"))).ok()?;
        match helper.hold(links) {
            Ok(()) => Some(Self(helper)),
            Err(err) => {
                warn_once(&format!("giving it links: {err}"));
                helper.end();
                None
            }
        }
    }

    /// Once the caller has closed its own copies: has the helper close its copies, and returns
    /// when it has.
    pub fn release(self) {
        let helper = self.0;
        match helper.send(CLOSE, &[]).and_then(|()| helper.closed()) {
            Ok(()) => IDLE.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(helper),
            // Killed meanwhile, say: its exit closed them.
            Err(err) => {
                tracing::warn!("memprof's helper that closes probe links ended before it said it closed them: {err}");
                helper.end();
            }
        }
    }
}

/// Says once what went wrong with the helpers: a host where none can start would otherwise say
/// it at every detach.
fn warn_once(what: &str) {
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        tracing::warn!("memprof's helper that closes probe links: {what}; memprof closes them itself, and a SIGKILL at that moment leaks the kernel's uprobe");
    }
}

/// Closes (drops) `items` on at most `CLOSERS` threads, and returns when all are closed:
/// uprobe_multi links closed at once share their grace periods, and perf-event uprobes, which
/// each wait for theirs under a kernel-wide mutex, at least leave the waiting to the threads.
pub fn close_together<T: Send>(items: Vec<T>) {
    let count = items.len();
    let queue = Mutex::new(items);
    let next = || queue.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).pop();
    std::thread::scope(|scope| {
        for _ in 0..CLOSERS.min(count) {
            scope.spawn(|| {
                while let Some(item) = next() {
                    drop(item);
                }
            });
        }
    });
}

/// A helper process and memprof's end of its socket.
struct Helper {
    child: Child,
    socket: OwnedFd,
}

impl Helper {
    /// A kept helper, if one is left. Kept ones that were killed are reaped here, whichever one
    /// is taken: none stays a zombie until its turn.
    fn idle() -> Option<Self> {
        let mut idle = IDLE.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        idle.retain_mut(|helper| !matches!(helper.child.try_wait(), Ok(Some(_))));
        idle.pop()
    }

    fn start() -> io::Result<Self> {
        let (ours, theirs) = seqpacket_pair()?;
        let child = Command::new("/proc/self/exe")
            .arg(helper::ARGUMENT)
            .stdin(Stdio::from(theirs))
            // Nobody reading memprof's output waits for the helper.
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        Ok(Self { child, socket: ours })
    }

    /// Gives the helper copies of `links`.
    fn hold(&self, links: &[RawFd]) -> io::Result<()> {
        links.chunks(rights::MOST_PER_MESSAGE).try_for_each(|chunk| self.send(HOLD, chunk))
    }

    fn send(&self, tag: u8, fds: &[RawFd]) -> io::Result<()> {
        rights::send(self.socket.as_fd(), tag, fds)
    }

    /// Waits for the helper's word that it closed what it held.
    fn closed(&self) -> io::Result<()> {
        match rights::receive(self.socket.as_fd())? {
            Some((CLOSED, _)) => Ok(()),
            Some((tag, _)) => Err(io::Error::other(format!("it answered {tag}"))),
            None => Err(io::Error::other("it has ended")),
        }
    }

    /// Lets the helper go (it exits at the end of its socket), and reaps it.
    fn end(self) {
        let Self { mut child, socket } = self;
        drop(socket);
        let _ = child.wait();
    }
}

/// A pair of connected sequenced-packet sockets (messages keep their bounds, as datagrams do,
/// and a closed end is seen), closed on exec.
fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut ends = [0 as RawFd; 2];
    // SAFETY: socketpair writes two descriptors into the array it is given.
    if unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0, ends.as_mut_ptr()) } != 0
    {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: two descriptors the kernel just gave this process, owned by nothing else.
    Ok(unsafe { (OwnedFd::from_raw_fd(ends[0]), OwnedFd::from_raw_fd(ends[1])) })
}
