//! The helper's side: makes the attaches memprof asks for, holds the copies of links memprof gives
//! it, and closes them when told or when memprof has gone.

use std::{
    ffi::OsStr,
    os::fd::{BorrowedFd, OwnedFd},
};

use super::{attach, close_together, rights, ATTACH, CLOSE, CLOSED, HOLD};
use crate::console::say;

/// memprof's first argument when it is started as the helper. Not a command: `main` checks it
/// before the command line is parsed.
pub const ARGUMENT: &str = "__helper";

/// Runs the helper when memprof was started as one; returns its exit code.
pub fn run_if_asked() -> Option<u8> {
    (std::env::args_os().nth(1).as_deref() == Some(OsStr::new(ARGUMENT))).then(serve)
}

fn serve() -> u8 {
    // Only the socket (standard input) stays: a link inherited by mistake would be held open.
    // SAFETY: close_range closes descriptors of this process only, none of which is in use.
    unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0) };
    // However many links memprof gives at once: a descriptor past the limit would be closed on
    // arrival, before memprof's own copy.
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit read and write the struct given, nothing else.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
    // The OOM killer, the host's or a memory cgroup's, never picks the helper: a SIGKILL in the
    // middle of its attach or close is the leak it exists to prevent. It holds little memory.
    // Refused without CAP_SYS_RESOURCE, where it is only as safe as any process.
    let _ = std::fs::write("/proc/self/oom_score_adj", "-1000");
    // Ctrl-C at memprof's terminal reaches the helper too; it ends when memprof has.
    for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT] {
        // SAFETY: ignoring a signal installs no handler.
        unsafe { libc::signal(signal, libc::SIG_IGN) };
    }
    // SAFETY: standard input, open for as long as this process runs.
    let socket = unsafe { BorrowedFd::borrow_raw(0) };
    let mut held: Vec<OwnedFd> = Vec::new();
    loop {
        let answered = match rights::receive(socket) {
            Ok(Some(message)) if message.tag == HOLD => {
                held.extend(message.fds);
                Ok(())
            }
            Ok(Some(message)) if message.tag == CLOSE => {
                close_together(std::mem::take(&mut held));
                rights::send(socket, CLOSED, &[], &[])
            }
            Ok(Some(message)) if message.tag == ATTACH => attach::serve(socket, message),
            Err(err) if err.raw_os_error() == Some(libc::ENOTSOCK) => {
                say!("memprof: error: {ARGUMENT} is memprof's own helper, which memprof starts itself; run memprof --help for its commands");
                return 2;
            }
            Ok(Some(_) | None) | Err(_) => break,
        };
        if answered.is_err() {
            break;
        }
    }
    close_together(held);
    0
}
