//! The helper process, which makes the system calls on probe links that a SIGKILL of memprof
//! must not interrupt: the attaches that put a uprobe's breakpoints in (`attach`) and the last
//! closes that take them out (`release`).
//!
//! The kernel writes a uprobe's breakpoints into the processes it is for as the link is made, and
//! takes them out at the link's last close. A SIGKILL pending in the thread that makes either call
//! has the kernel give up that walk: it logs "failed to unregister, leaking uprobe", keeps the
//! uprobe for good, and leaves its breakpoints in the traced processes, which then trap at every
//! call with no program to run. memprof may be killed at any moment (the OOM killer, `kill -9`, a
//! timeout that kills its process), and while it follows a forking server it attaches all the
//! time. So it makes neither call itself: the helper makes them and passes the links over a Unix
//! socket (`rights`). If memprof dies meanwhile, the helper finishes the call, and closes what it
//! holds at the end of its socket.
//!
//! The helper is memprof started again (`serve::ARGUMENT`): it shares none of memprof's memory, so
//! the OOM killer, which kills every process that shares its victim's, does not kill it with
//! memprof; where memprof has `CAP_SYS_RESOURCE`, it never picks the helper itself (`serve`). It
//! is started at the first attach or detach and kept for the next. A kill of memprof's whole
//! cgroup (a systemd stop timeout, a container's end) still reaches it.

mod attach;
mod release;
mod rights;
mod serve;

use std::{
    io,
    os::fd::{AsFd as _, FromRawFd as _, OwnedFd, RawFd},
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        Mutex,
    },
};

pub use attach::{make, Request};
pub use release::{close_together, Holder};
pub use serve::run_if_asked;

/// What memprof sends the helper, and the helper's answers (each a message's tag).
const HOLD: u8 = 1;
const CLOSE: u8 = 2;
const CLOSED: u8 = 3;
const ATTACH: u8 = 4;
const ATTACHED: u8 = 5;
const FAILED: u8 = 6;

/// Helpers waiting for work: as many as there were attaches and detaches at the same time.
static IDLE: Mutex<Vec<Helper>> = Mutex::new(Vec::new());

/// Says once what went wrong with the helpers: a host where none can start would otherwise say
/// it at every attach and detach.
fn warn_once(what: &str) {
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        tracing::warn!("memprof's helper that attaches and closes probe links: {what}; memprof makes those calls itself, and a SIGKILL at that moment leaks the kernel's uprobe");
    }
}

/// A helper process and memprof's end of its socket.
struct Helper {
    child: Child,
    socket: OwnedFd,
}

impl Helper {
    /// Serves `ask` with a kept helper, or failing that a new one: `ask`'s answer, or None when no
    /// helper could serve it (said in a warning). A helper that fails (killed since, say) is let go.
    fn serve<T>(ask: impl Fn(&Self) -> io::Result<T>) -> Option<(Self, T)> {
        while let Some(helper) = Self::idle() {
            match ask(&helper) {
                Ok(answer) => return Some((helper, answer)),
                Err(_) => helper.end(),
            }
        }
        let helper = Self::start().inspect_err(|err| warn_once(&format!("starting it: {err}"))).ok()?;
        match ask(&helper) {
            Ok(answer) => Some((helper, answer)),
            Err(err) => {
                warn_once(&err.to_string());
                helper.end();
                None
            }
        }
    }

    /// A kept helper, if one is left. Kept ones that were killed are reaped here, whichever one
    /// is taken: none stays a zombie until its turn.
    fn idle() -> Option<Self> {
        let mut idle = IDLE.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        idle.retain_mut(|helper| !matches!(helper.child.try_wait(), Ok(Some(_))));
        idle.pop()
    }

    /// Keeps the helper for the next attach or detach.
    fn keep(self) {
        IDLE.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(self);
    }

    fn start() -> io::Result<Self> {
        let (ours, theirs) = seqpacket_pair()?;
        let child = Command::new("/proc/self/exe")
            .arg(serve::ARGUMENT)
            .stdin(Stdio::from(theirs))
            // Nobody reading memprof's output waits for the helper.
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        Ok(Self { child, socket: ours })
    }

    fn send(&self, tag: u8, payload: &[u8], fds: &[RawFd]) -> io::Result<()> {
        rights::send(self.socket.as_fd(), tag, payload, fds)
    }

    /// The helper's next message.
    fn answer(&self) -> io::Result<rights::Message> {
        rights::receive(self.socket.as_fd())?.ok_or_else(|| io::Error::other("it has ended"))
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
