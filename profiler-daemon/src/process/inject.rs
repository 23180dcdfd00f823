//! System calls made by one thread of a stopped process on memprof's behalf, as CRIU's compel
//! makes them: the thread's registers saved, its instruction pointer set on a `syscall`
//! instruction of the process's vDSO and the call's number and arguments in their registers,
//! one instruction single-stepped, the result read, and everything put back as it was.
//!
//! `orig_rax = -1` keeps the kernel's restart logic away from the injected call: a thread
//! stopped inside a blocking call (read(2)) has that call's number there and `-ERESTARTSYS` in
//! `rax`; both are restored after, so that it restarts the call on release as it would have.
//! The single step ends in a SIGTRAP that ptrace holds back and memprof never delivers; the
//! kernel resets a blocked or ignored SIGTRAP's handler when it forces one, so a thread that
//! blocks it, or a process that ignores it, is not used. Neither is a process under a seccomp
//! filter, which could kill it for a call it never makes.

use std::{
    io,
    time::{Duration, Instant},
};

use crate::process::{
    freeze::{self, Frozen},
    procfs,
};

/// How long an injected call may take: these calls never block.
const CALL_DEADLINE: Duration = Duration::from_secs(1);

const SIGTRAP_BIT: u64 = 1 << (libc::SIGTRAP - 1);

#[derive(Debug, thiserror::Error)]
pub enum InjectError {
    #[error("pid {0} runs under a seccomp filter, which could kill it for a system call it does not make")]
    Seccomp(u32),
    #[error("no thread of pid {0} stopped for memprof alone, with no signal pending and SIGTRAP neither blocked nor ignored")]
    NoThread(u32),
    #[error("no syscall instruction in the vDSO of pid {0}")]
    NoSyscallInstruction(u32),
    #[error("ptrace on thread {tid}: {cause}")]
    Ptrace { tid: u32, cause: io::Error },
    #[error("thread {tid} stopped otherwise than after the injected system call")]
    UnexpectedStop { tid: u32 },
    #[error("thread {tid} did not stop after the injected system call within {CALL_DEADLINE:?}")]
    NoStop { tid: u32 },
    #[cfg(not(target_arch = "x86_64"))]
    #[error("system calls are injected on x86-64 only")]
    Unsupported,
}

/// A thread of a stopped process running system calls for memprof (which take numbers only:
/// nothing is written into the process's memory); dropping it puts back its registers, on
/// every path.
pub struct Injector<'a> {
    frozen: &'a mut Frozen,
    tid: u32,
    saved: libc::user_regs_struct,
    syscall_at: u64,
}

impl<'a> Injector<'a> {
    /// Picks a thread of `frozen` that may run calls for memprof.
    #[cfg(target_arch = "x86_64")]
    pub fn new(pid: u32, frozen: &'a mut Frozen) -> Result<Self, InjectError> {
        let tid = frozen
            .threads
            .iter()
            .filter(|t| t.interrupted())
            .map(|t| t.tid)
            .find(|&tid| quiet(pid, tid).is_ok_and(|quiet| quiet))
            .ok_or(InjectError::NoThread(pid))?;
        if seccomp(pid, tid) {
            return Err(InjectError::Seccomp(pid));
        }
        let syscall_at = syscall_instruction(pid).ok_or(InjectError::NoSyscallInstruction(pid))?;
        let saved = get_registers(tid)?;
        Ok(Self { frozen, tid, saved, syscall_at })
    }

    #[cfg(not(target_arch = "x86_64"))]
    pub fn new(_pid: u32, _frozen: &'a mut Frozen) -> Result<Self, InjectError> {
        Err(InjectError::Unsupported)
    }

    /// Runs system call `nr` with `args` in the thread; its return value (`-errno` on failure).
    #[cfg(target_arch = "x86_64")]
    pub fn syscall(&mut self, nr: libc::c_long, args: [u64; 6]) -> Result<i64, InjectError> {
        let mut regs = self.saved;
        regs.rip = self.syscall_at;
        regs.rax = nr as u64;
        regs.orig_rax = u64::MAX;
        (regs.rdi, regs.rsi, regs.rdx, regs.r10, regs.r8, regs.r9) =
            (args[0], args[1], args[2], args[3], args[4], args[5]);
        set_registers(self.tid, &regs)?;
        ptrace(libc::PTRACE_SINGLESTEP, self.tid, 0)?;
        self.wait_step()?;
        let after = get_registers(self.tid)?;
        if after.rip != self.syscall_at + 2 {
            return Err(InjectError::UnexpectedStop { tid: self.tid });
        }
        Ok(after.rax as i64)
    }

    #[cfg(not(target_arch = "x86_64"))]
    pub fn syscall(&mut self, _nr: libc::c_long, _args: [u64; 6]) -> Result<i64, InjectError> {
        Err(InjectError::Unsupported)
    }

    /// Waits for the stop the single step ends in. A signal that came meanwhile stops the thread
    /// first: it is handed back on release, the call counted as failed.
    fn wait_step(&mut self) -> Result<(), InjectError> {
        let tid = self.tid;
        let deadline = Instant::now() + CALL_DEADLINE;
        loop {
            freeze::reap(tid);
            if let Some(info) = stop_info(tid) {
                if info.si_signo == libc::SIGTRAP {
                    return Ok(());
                }
                self.frozen.hand_back(tid, info.si_signo);
                return Err(InjectError::UnexpectedStop { tid });
            }
            if Instant::now() > deadline {
                // Stopped again so that its registers can be put back.
                let _ = ptrace(libc::PTRACE_INTERRUPT, tid, 0);
                let again = Instant::now() + CALL_DEADLINE;
                while stop_info(tid).is_none() && Instant::now() < again {
                    freeze::reap(tid);
                    std::thread::sleep(Duration::from_micros(50));
                }
                return Err(InjectError::NoStop { tid });
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

impl Drop for Injector<'_> {
    fn drop(&mut self) {
        if let Err(err) = set_registers(self.tid, &self.saved) {
            tracing::warn!(tid = self.tid, %err, "cannot put back a thread's registers after injected calls");
        }
    }
}

/// The siginfo of `tid`'s ptrace stop; `None` while it runs.
fn stop_info(tid: u32) -> Option<libc::siginfo_t> {
    // SAFETY: an all-zero siginfo_t is valid; the kernel fills it.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: a valid out-pointer to a siginfo_t.
    let ok = unsafe { libc::ptrace(libc::PTRACE_GETSIGINFO, tid as libc::pid_t, 0, &mut info) } == 0;
    ok.then_some(info)
}

fn ptrace(request: libc::c_uint, tid: u32, data: usize) -> Result<(), InjectError> {
    // SAFETY: requests that take no pointer, or `data` pointing to a live register struct.
    if unsafe { libc::ptrace(request, tid as libc::pid_t, 0, data) } != 0 {
        return Err(InjectError::Ptrace { tid, cause: io::Error::last_os_error() });
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
fn get_registers(tid: u32) -> Result<libc::user_regs_struct, InjectError> {
    // SAFETY: an all-zero user_regs_struct is valid; PTRACE_GETREGS fills it.
    let mut regs: libc::user_regs_struct = unsafe { std::mem::zeroed() };
    ptrace(libc::PTRACE_GETREGS, tid, &mut regs as *mut _ as usize)?;
    Ok(regs)
}

#[cfg(target_arch = "x86_64")]
fn set_registers(tid: u32, regs: &libc::user_regs_struct) -> Result<(), InjectError> {
    ptrace(libc::PTRACE_SETREGS, tid, regs as *const _ as usize)
}

#[cfg(not(target_arch = "x86_64"))]
fn set_registers(_tid: u32, _regs: &libc::user_regs_struct) -> Result<(), InjectError> {
    Err(InjectError::Unsupported)
}

/// The address of a `syscall` instruction (0f 05) in `pid`'s vDSO: its fallbacks make the call.
fn syscall_instruction(pid: u32) -> Option<u64> {
    let vdso = procfs::regions(pid).ok()?.into_iter().find(|r| r.path == "[vdso]")?;
    let mut code = vec![0u8; (vdso.end - vdso.start) as usize];
    let local = libc::iovec { iov_base: code.as_mut_ptr().cast(), iov_len: code.len() };
    let remote = libc::iovec { iov_base: vdso.start as *mut libc::c_void, iov_len: code.len() };
    // SAFETY: `local` describes `code`, which outlives the call; the remote side is checked by
    // the kernel.
    let read = unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0) };
    if read != code.len() as isize {
        return None;
    }
    code.windows(2).position(|w| w == [0x0f, 0x05]).map(|at| vdso.start + at as u64)
}

/// A hexadecimal mask of a `/proc/PID/task/TID/status` line.
fn mask(status: &str, key: &str) -> Option<u64> {
    let value = status.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))?;
    u64::from_str_radix(value.trim(), 16).ok()
}

/// Whether thread `tid` may take a SIGTRAP that nobody sees: no signal waits for it (which the
/// single step would meet first) and SIGTRAP is neither blocked by it nor ignored.
fn quiet(pid: u32, tid: u32) -> io::Result<bool> {
    let status = procfs::read_text(format!("/proc/{pid}/task/{tid}/status"))?;
    let [Some(pending), Some(shared), Some(blocked), Some(ignored)] =
        ["SigPnd", "ShdPnd", "SigBlk", "SigIgn"].map(|key| mask(&status, key))
    else {
        return Ok(false);
    };
    Ok((pending | shared) & !blocked == 0 && (blocked | ignored) & SIGTRAP_BIT == 0)
}

/// Whether thread `tid` runs under seccomp (strict or a filter); unknown counts as yes.
fn seccomp(pid: u32, tid: u32) -> bool {
    let status = procfs::read_text(format!("/proc/{pid}/task/{tid}/status")).unwrap_or_default();
    status.lines().find_map(|l| l.strip_prefix("Seccomp:")).is_none_or(|mode| mode.trim() != "0")
}
