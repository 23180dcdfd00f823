//! Every thread of a process held still for a moment (`--inspect`), without changing its fate:
//! `PTRACE_SEIZE` and `PTRACE_INTERRUPT` per thread, never `SIGSTOP` nor any signal the process
//! can see. A blocked system call is restarted on release as after any ptrace stop; a signal
//! that arrives meanwhile is handed back on release. Dropping a `Frozen` releases every thread,
//! on every path (errors and panics included).
//!
//! Every ptrace call of a `Frozen` must come from the thread that made it: the kernel knows
//! the tracer by thread.

use std::{
    fs,
    time::{Duration, Instant},
};

use super::procfs;

/// How long the threads get to stop: a thread in uninterruptible sleep (a dead NFS server) may
/// never stop, and the others must not wait for it.
const STOP_DEADLINE: Duration = Duration::from_secs(2);

/// `PTRACE_EVENT_STOP`: the stop `PTRACE_INTERRUPT` causes (linux/ptrace.h).
const PTRACE_EVENT_STOP: i32 = 128;

#[derive(Debug, thiserror::Error)]
pub enum FreezeError {
    #[error("pid {0} has exited")]
    Gone(u32),
    #[error("cannot stop thread {tid} of pid {pid} with ptrace: {cause}; another tracer (gdb, strace) may hold it, or kernel.yama.ptrace_scope forbids it")]
    Seize { pid: u32, tid: u32, cause: std::io::Error },
    #[error("thread {tid} of pid {pid} did not stop within {STOP_DEADLINE:?} (uninterruptible sleep?); it was released untouched")]
    NoStop { pid: u32, tid: u32 },
}

/// One stopped thread.
#[derive(Debug)]
pub struct Thread {
    pub tid: u32,
    /// Its general-purpose registers, as the kernel's `user_regs_struct`.
    pub registers: Vec<u64>,
    /// The signal it was about to receive when it stopped, handed back on release.
    pending_signal: i32,
}

impl Thread {
    /// Whether it stopped for memprof's interrupt alone, with no signal to hand back: only such
    /// a thread may run code for memprof (`inject`), which would swallow the signal.
    pub fn interrupted(&self) -> bool {
        self.pending_signal == 0
    }

    pub fn stack_pointer(&self) -> u64 {
        self.registers.get(STACK_POINTER).copied().unwrap_or(0)
    }
}

/// The index of the stack pointer in `user_regs_struct`.
#[cfg(target_arch = "x86_64")]
const STACK_POINTER: usize = 19;
#[cfg(target_arch = "aarch64")]
const STACK_POINTER: usize = 31;

/// A process whose threads are all stopped, until dropped.
pub struct Frozen {
    pub threads: Vec<Thread>,
    /// Threads seized, stopped or not yet: each is released once.
    seized: Vec<u32>,
}

impl Frozen {
    /// Stops every thread of `pid`, threads started meanwhile included.
    pub fn stop(pid: u32) -> Result<Self, FreezeError> {
        let mut frozen = Self { threads: Vec::new(), seized: Vec::new() };
        // Threads that exited but are listed until their process is reaped.
        let mut ended = Vec::new();
        let deadline = Instant::now() + STOP_DEADLINE;
        // A thread not yet stopped may start another: list again until a listing brings none.
        loop {
            let listed = tids(pid)?.into_iter();
            let new: Vec<u32> = listed.filter(|tid| !frozen.seized.contains(tid) && !ended.contains(tid)).collect();
            if new.is_empty() {
                break;
            }
            for &tid in &new {
                match seize(tid) {
                    Ok(()) => frozen.seized.push(tid),
                    // Exited between the listing and the seize.
                    Err(cause) if cause.raw_os_error() == Some(libc::ESRCH) => {}
                    // A zombie refuses ptrace (a main thread that called pthread_exit).
                    Err(cause) if cause.raw_os_error() == Some(libc::EPERM) && procfs::thread_ended(pid, tid) => {
                        ended.push(tid)
                    }
                    Err(cause) => return Err(FreezeError::Seize { pid, tid, cause }),
                }
            }
            for tid in new.into_iter().filter(|tid| frozen.seized.contains(tid)) {
                if let Some(thread) = wait_stopped(pid, tid, deadline)? {
                    frozen.threads.push(thread);
                }
            }
        }
        if frozen.threads.is_empty() {
            return Err(FreezeError::Gone(pid));
        }
        Ok(frozen)
    }

    /// Hands `signal` to thread `tid` on release: one it took while it ran code for memprof.
    pub fn hand_back(&mut self, tid: u32, signal: i32) {
        if let Some(thread) = self.threads.iter_mut().find(|t| t.tid == tid) {
            thread.pending_signal = signal;
        }
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        for &tid in &self.seized {
            let signal = self.threads.iter().find(|t| t.tid == tid).map_or(0, |t| t.pending_signal);
            // SAFETY: PTRACE_DETACH takes a tid and a signal number; nothing is read or written.
            unsafe { libc::ptrace(libc::PTRACE_DETACH, tid as libc::pid_t, 0, signal as libc::c_long) };
            // A stop nobody waited for would linger as a wait status.
            reap(tid);
        }
    }
}

fn tids(pid: u32) -> Result<Vec<u32>, FreezeError> {
    let dir = fs::read_dir(format!("/proc/{pid}/task")).map_err(|_| FreezeError::Gone(pid))?;
    Ok(dir.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok()).collect())
}

fn seize(tid: u32) -> std::io::Result<()> {
    // SAFETY: ptrace requests with a tid and no pointers.
    unsafe {
        if libc::ptrace(libc::PTRACE_SEIZE, tid as libc::pid_t, 0, 0) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if libc::ptrace(libc::PTRACE_INTERRUPT, tid as libc::pid_t, 0, 0) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Collects a stop of `tid`'s that nobody waited for, if there is one.
pub(super) fn reap(tid: u32) {
    let mut status = 0;
    // SAFETY: a tid and a valid out-pointer; WNOHANG never blocks.
    unsafe { libc::waitpid(tid as libc::pid_t, &mut status, libc::__WALL | libc::WNOHANG) };
}

/// Waits for `tid` to stop and reads its registers; `None` when it exited meanwhile.
///
/// A stop is known by `PTRACE_GETSIGINFO` succeeding, not by a wait status: under `memprof run`
/// the thread that waits for the command's exit may collect the leader's stop first.
fn wait_stopped(pid: u32, tid: u32, deadline: Instant) -> Result<Option<Thread>, FreezeError> {
    loop {
        reap(tid);
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: a valid out-pointer to a siginfo_t.
        let ok = unsafe { libc::ptrace(libc::PTRACE_GETSIGINFO, tid as libc::pid_t, 0, &mut info) } == 0;
        if ok {
            // A stop for a signal about to be delivered, rather than the interrupt's own: the
            // signal goes back on release.
            let pending_signal = if info.si_code >> 8 == PTRACE_EVENT_STOP { 0 } else { info.si_signo };
            return Ok(Some(Thread { tid, registers: registers(tid), pending_signal }));
        }
        if fs::metadata(format!("/proc/{pid}/task/{tid}")).is_err() {
            return Ok(None);
        }
        if Instant::now() > deadline {
            return Err(FreezeError::NoStop { pid, tid });
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// The general-purpose registers of a stopped thread (`NT_PRSTATUS`, any architecture).
fn registers(tid: u32) -> Vec<u64> {
    let mut words = [0u64; 64];
    let mut iov = libc::iovec { iov_base: words.as_mut_ptr().cast(), iov_len: std::mem::size_of_val(&words) };
    // SAFETY: iov describes `words`, which outlives the call; the kernel shortens iov_len.
    let ok = unsafe { libc::ptrace(libc::PTRACE_GETREGSET, tid as libc::pid_t, libc::NT_PRSTATUS, &mut iov) } == 0;
    if !ok {
        return Vec::new();
    }
    words[..iov.iov_len / 8].to_vec()
}
