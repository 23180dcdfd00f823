//! The system calls that put a uprobe's breakpoints in, made in a process apart from memprof's.
//!
//! Attaching a uprobe has the kernel write its breakpoints into the processes it is for. A SIGKILL
//! pending in the thread that attaches has the kernel give up that walk, fail to take out the
//! breakpoints it had put in, and keep the uprobe for good ("failed to unregister, leaking
//! uprobe"), as at a last close (see `release`). memprof attaches all the time while it follows a
//! forking server, so a SIGKILL of memprof (`kill -9`, a timeout that kills its process) often
//! lands in an attach.
//!
//! So the call is made by a process that shares memprof's memory and descriptor table but is not
//! one of its threads (`clone` with `CLONE_VM | CLONE_FILES`): a SIGKILL of memprof does not reach
//! it. The calling thread waits for it (`CLONE_VFORK`), as it would for the call. If memprof dies
//! meanwhile, the process finishes the call, and its exit makes the last close of what memprof
//! held, links included, with no signal pending.
//!
//! Two kills still reach it: the OOM killer's, which kills every process sharing its victim's
//! memory, and a kill of memprof's whole cgroup (a systemd stop timeout, a container's end).

use std::{io, sync::Once};

/// The process's stack: it only makes the call.
const STACK_BYTES: usize = 64 << 10;

/// A system call and its outcome, shared with the process that makes it.
struct Call {
    number: libc::c_long,
    args: [libc::c_long; 5],
    result: libc::c_long,
    errno: i32,
}

/// Where a system call is made: apart for those that put a uprobe's breakpoints in, here (in the
/// calling thread) for the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Made {
    Here,
    Apart,
}

/// `syscall(number, args...)`, made where `made` says (see the module's comment). Where no
/// process can be made apart, memprof says so once and makes the call itself.
///
/// # Safety
/// As for `libc::syscall(number, args...)`: the memory the arguments point at must be valid for
/// the call. It stays mapped until the call returns, even if memprof is killed meanwhile.
pub unsafe fn syscall(made: Made, number: libc::c_long, args: [libc::c_long; 5]) -> io::Result<libc::c_long> {
    let mut call = Call { number, args, result: -1, errno: 0 };
    match made {
        Made::Here => make_call(&mut call),
        Made::Apart => make_apart(&mut call),
    }
    if call.result < 0 {
        return Err(io::Error::from_raw_os_error(call.errno));
    }
    Ok(call.result)
}

fn make_apart(call: &mut Call) {
    let mut stack = vec![0u8; STACK_BYTES];
    // SAFETY: one past the end of `stack`, which lives until the process has exited (below).
    let top = unsafe { stack.as_mut_ptr().add(STACK_BYTES) };
    let top = (top as usize & !15) as *mut libc::c_void;
    let flags = libc::CLONE_VM | libc::CLONE_FILES | libc::CLONE_VFORK;
    // SAFETY: `make` runs on `stack` with `call`, both alive until the process exits, which
    // CLONE_VFORK waits for. It sends its parent no signal at exit (no exit signal in `flags`).
    let pid = unsafe { libc::clone(make, top, flags, (call as *mut Call).cast()) };
    if pid < 0 {
        let err = io::Error::last_os_error();
        static SAID: Once = Once::new();
        SAID.call_once(|| tracing::warn!("memprof cannot attach probes from a process apart ({err}): it attaches them itself, and a SIGKILL at that moment leaks the kernel's uprobe"));
        make_call(call);
        return;
    }
    // It has exited (CLONE_VFORK): reaped here. __WCLONE: it sends no SIGCHLD.
    let mut status = 0;
    // SAFETY: waits for this process's own child.
    while unsafe { libc::waitpid(pid, &mut status, libc::__WCLONE) } < 0
        && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted
    {}
    drop(stack);
}

/// The process's body: the call, then exit (the clone wrapper's `exit`, not `exit_group`).
extern "C" fn make(call: *mut libc::c_void) -> libc::c_int {
    // SAFETY: the `Call` `syscall` gave, which outlives this process (its caller waits).
    make_call(unsafe { &mut *call.cast::<Call>() });
    0
}

fn make_call(call: &mut Call) {
    let [a, b, c, d, e] = call.args;
    // SAFETY: as `syscall`'s caller promised.
    call.result = unsafe { libc::syscall(call.number, a, b, c, d, e) };
    if call.result < 0 {
        call.errno = io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO);
    }
}
