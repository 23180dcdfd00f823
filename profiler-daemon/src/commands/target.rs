//! The traced process: waiting for a running one to exit, or starting one under `memprof run`.

use std::{
    ffi::{CString, OsString},
    io,
    os::{
        fd::{FromRawFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::{Path, PathBuf},
    thread,
    time::Duration,
};

use tokio::{io::unix::AsyncFd, sync::oneshot};

use crate::{error::UserError, symbolize::SymbolizerHandle};

/// Tells when the target is gone and with which exit code.
pub enum ExitWatch {
    /// A process memprof attached to: a pidfd becomes readable when it exits.
    Attached(AsyncFd<OwnedFd>),
    /// A child memprof started: its tracer thread sends the exit code.
    Child(oneshot::Receiver<i32>),
}

impl ExitWatch {
    pub fn attached(pid: u32) -> io::Result<Self> {
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the fd was just created, is owned by nobody else and is not closed while registered.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let fd = unsafe { AsyncFd::register(fd) }.map_err(|err| err.into_parts().1)?;
        Ok(Self::Attached(fd))
    }

    /// After Ctrl-C or SIGTERM: a child memprof started got the signal too (it shares the terminal's
    /// process group, or was sent it alongside); give it two seconds to exit and report its code.
    pub async fn settle(&mut self) -> Option<i32> {
        match self {
            Self::Attached(_) => None,
            Self::Child(_) => tokio::time::timeout(Duration::from_secs(2), self.exited()).await.ok().flatten(),
        }
    }

    /// Resolves when the target has exited: with its exit code when memprof started it.
    pub async fn exited(&mut self) -> Option<i32> {
        match self {
            Self::Attached(fd) => {
                let _ = fd.readable().await;
                None
            }
            Self::Child(code) => Some(code.await.unwrap_or(1)),
        }
    }
}

/// Asks the session, from the thread that ptraces the child, to read the child's new mappings;
/// the child stays stopped until the answer. The answer says whether the stop was memprof's own
/// (see `Loaded::take_mapping_stop`).
pub struct MappingRequest {
    pub pid: u32,
    pub reply: std::sync::mpsc::Sender<bool>,
}

pub type MappingRequests = tokio::sync::mpsc::UnboundedSender<MappingRequest>;

fn request_mappings(requests: &MappingRequests, pid: u32) -> bool {
    let (reply, answer) = std::sync::mpsc::channel();
    if requests.send(MappingRequest { pid, reply }).is_err() {
        return false;
    }
    // The session answers between reports; a stuck session must not hang the child for good.
    answer.recv_timeout(Duration::from_secs(10)).unwrap_or(false)
}

/// `si_code` of a signal the kernel sent, as a BPF program's `bpf_send_signal_thread` does.
const SI_KERNEL: i32 = 0x80;

/// A child forked and waiting for `release` before it execs the command.
pub struct Child {
    pub pid: u32,
    release: OwnedFd,
}

impl Child {
    /// Lets the child exec its command; call once every probe is attached.
    pub fn release(self) {
        // Dropping the write end makes the child's blocking read return 0.
        drop(self.release);
    }
}

/// Finds `command[0]` the way a shell does: as a path when it has a slash, else on `PATH`.
pub fn resolve_program(name: &OsString) -> Result<PathBuf, UserError> {
    let not_found = |what: &str| UserError::Spawn {
        command: name.to_string_lossy().into_owned(),
        cause: io::Error::new(io::ErrorKind::NotFound, what.to_string()),
    };
    let candidate = Path::new(name);
    if name.as_bytes().contains(&b'/') {
        return if is_executable(candidate) {
            Ok(candidate.to_path_buf())
        } else {
            Err(not_found("no such executable"))
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    std::env::split_paths(&path)
        .map(|dir| dir.join(candidate))
        .find(|p| is_executable(p))
        .ok_or_else(|| not_found("not found on PATH"))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata().map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0).unwrap_or(false)
}

/// Forks a child that execs `program` with `args` once released.
///
/// The child is ptraced (seized, so it runs normally) only to be stopped at its exit while its
/// memory maps still exist: the symbolizer reads them there, so even a short-lived command gets
/// symbolized stacks. Returns the child and a receiver for its exit code.
pub fn spawn(
    program: PathBuf,
    args: &[OsString],
    symbolizer: SymbolizerHandle,
    mappings: MappingRequests,
) -> Result<(Child, oneshot::Receiver<i32>), UserError> {
    let spawn_error = |cause| UserError::Spawn { command: program.display().to_string(), cause };
    let c_program = CString::new(program.as_os_str().as_bytes()).map_err(|e| spawn_error(e.into()))?;
    let c_args: Vec<CString> =
        args.iter().map(|a| CString::new(a.as_bytes())).collect::<Result<_, _>>().map_err(|e| spawn_error(e.into()))?;
    let (pid_tx, pid_rx) = std::sync::mpsc::channel();
    let (code_tx, code_rx) = oneshot::channel();
    // ptrace requests must come from the thread that attached, so this thread forks, seizes and waits.
    thread::Builder::new()
        .name("tracee".into())
        .spawn(move || {
            let result = fork_stopped(&c_program, &c_args);
            let pid = result.as_ref().map(|(pid, _)| *pid).ok();
            let _ = pid_tx.send(result);
            if let Some(pid) = pid {
                let _ = code_tx.send(wait_for_exit(pid, &symbolizer, &mappings));
            }
        })
        .map_err(spawn_error)?;
    let (pid, release) =
        pid_rx.recv().map_err(|_| spawn_error(io::Error::other("tracer thread died")))?.map_err(spawn_error)?;
    Ok((Child { pid: pid as u32, release }, code_rx))
}

fn fork_stopped(program: &CString, args: &[CString]) -> io::Result<(libc::pid_t, OwnedFd)> {
    let mut argv: Vec<*const libc::c_char> = args.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    let mut fds = [0; 2];
    // SAFETY: fds has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds were just created and are owned here.
    let (read_end, write_end) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: the child only calls async-signal-safe functions (close, read, execv, _exit) and
    // does not allocate, so forking a multi-threaded process is sound.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        unsafe {
            libc::close(fds[1]);
            let mut byte = 0u8;
            // Blocks until memprof closes the write end; allocations before exec would be memprof's.
            while libc::read(fds[0], (&mut byte as *mut u8).cast(), 1) < 0 {}
            libc::execv(program.as_ptr(), argv.as_ptr());
            libc::_exit(127);
        }
    }
    drop(read_end);
    // No PTRACE_O_EXITKILL: when memprof ends before the command (--duration), the command is
    // detached and goes on, as it would without memprof. The exec stop is where the command's own
    // executable gets its unwind table, before it runs. Every thread is traced: any of them may
    // load a library, and its SIGTRAP (see `Loaded::stop_on_mapping_change`) must stop it for
    // memprof, not reach the program.
    let options = libc::PTRACE_O_TRACEEXIT | libc::PTRACE_O_TRACEEXEC | libc::PTRACE_O_TRACECLONE;
    // SAFETY: seizing our own child; failure leaves it untraced, which only costs symbolization
    // of libraries it loads late.
    unsafe { libc::ptrace(libc::PTRACE_SEIZE, pid, 0, options as libc::c_ulong) };
    Ok((pid, write_end))
}

/// Runs the child to its end: reads its mappings at its exec, at every change to its libraries
/// and at its exit stop. Returns a shell-style exit code.
fn wait_for_exit(pid: libc::pid_t, symbolizer: &SymbolizerHandle, mappings: &MappingRequests) -> i32 {
    loop {
        let mut status = 0;
        // Any thread of the child (all are traced); __WNOTHREAD: only this thread's tracees and
        // children, which are the child and its threads.
        // SAFETY: waiting with a valid out-pointer.
        let tid = unsafe { libc::waitpid(-1, &mut status, libc::__WALL | libc::__WNOTHREAD) };
        if tid < 0 {
            return 1;
        }
        // The leader's end is the process's, reported once every other thread is gone.
        if libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
            if tid != pid {
                continue;
            }
            return if libc::WIFEXITED(status) { libc::WEXITSTATUS(status) } else { 128 + libc::WTERMSIG(status) };
        }
        if !libc::WIFSTOPPED(status) {
            continue;
        }
        let event = status >> 16;
        // SAFETY: ptrace requests on our own stopped tracee.
        unsafe {
            if event == libc::PTRACE_EVENT_EXIT {
                // The process's mappings stay until its last thread is gone: read them at the
                // leader's exit stop.
                if tid == pid {
                    symbolizer.refresh(pid as u32);
                }
                libc::ptrace(libc::PTRACE_CONT, tid, 0, 0);
            } else if event == libc::PTRACE_EVENT_EXEC {
                request_mappings(mappings, pid as u32);
                libc::ptrace(libc::PTRACE_CONT, tid, 0, 0);
            } else if event == libc::PTRACE_EVENT_STOP && libc::WSTOPSIG(status) != libc::SIGTRAP {
                // A group stop (SIGSTOP and friends): stay stopped until SIGCONT, as without memprof.
                libc::ptrace(libc::PTRACE_LISTEN, tid, 0, 0);
            } else if event == libc::PTRACE_EVENT_STOP || event == libc::PTRACE_EVENT_CLONE {
                // A new thread's first stop (it is traced from its start), or its creator's.
                libc::ptrace(libc::PTRACE_CONT, tid, 0, 0);
            } else {
                // A signal on its way to the thread: deliver it unchanged, unless it is the SIGTRAP
                // memprof's probe sent when the process's libraries changed.
                let signal = libc::WSTOPSIG(status);
                let ours = signal == libc::SIGTRAP && sent_by_kernel(tid) && request_mappings(mappings, pid as u32);
                libc::ptrace(libc::PTRACE_CONT, tid, 0, if ours { 0 } else { signal as libc::c_ulong });
            }
        }
    }
}

/// Whether the signal the stopped thread is about to get came from the kernel.
fn sent_by_kernel(tid: libc::pid_t) -> bool {
    // SAFETY: siginfo_t is plain data; PTRACE_GETSIGINFO fills it for our stopped tracee.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    let got = unsafe { libc::ptrace(libc::PTRACE_GETSIGINFO, tid, 0, &mut info as *mut libc::siginfo_t) };
    got == 0 && info.si_code == SI_KERNEL
}
