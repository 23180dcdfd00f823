//! The traced process: waiting for a running one to exit, or starting one under `memprof run`.

use std::{
    ffi::{CString, OsString},
    io,
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::{Path, PathBuf},
    thread,
    time::Duration,
};

use tokio::{io::unix::AsyncFd, sync::oneshot};

use crate::{error::UserError, process::procfs};

/// Tells when the target is gone and with which exit code.
pub enum ExitWatch {
    /// A process memprof attached to: a pidfd becomes readable when it exits.
    Attached(AsyncFd<OwnedFd>, u32),
    /// A child memprof started: its waiting thread sends the exit code, kept once received.
    Child(oneshot::Receiver<i32>, Option<i32>),
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
        Ok(Self::Attached(fd, pid))
    }

    /// After Ctrl-C or SIGTERM: a child memprof started got the signal too (it shares the terminal's
    /// process group, or was sent it alongside); give it two seconds to exit and report its code.
    pub async fn settle(&mut self) -> Option<i32> {
        match self {
            Self::Attached(..) => None,
            Self::Child(..) => tokio::time::timeout(Duration::from_secs(2), self.exited()).await.ok().flatten(),
        }
    }

    /// Resolves when the target has exited: with its exit code when memprof started it. May be
    /// asked again once it has resolved.
    /// Whether the exit is known already (a child's code received).
    pub fn ended(&mut self) -> bool {
        match self {
            Self::Attached(..) => false,
            Self::Child(_, Some(_)) => true,
            Self::Child(receiver, kept) => match receiver.try_recv() {
                Ok(code) => {
                    *kept = Some(code);
                    true
                }
                Err(oneshot::error::TryRecvError::Empty) => false,
                Err(oneshot::error::TryRecvError::Closed) => true,
            },
        }
    }

    pub async fn exited(&mut self) -> Option<i32> {
        match self {
            Self::Attached(fd, _) => {
                let _ = fd.readable().await;
                None
            }
            Self::Child(_, Some(code)) => Some(*code),
            Self::Child(receiver, kept) => Some(*kept.insert(receiver.await.unwrap_or(1))),
        }
    }

    /// How a process memprof attached to ended, once `exited` resolved: "exit code N" or
    /// "killed by SIGNAME". The kernel tells while the process is a zombie, and after its parent
    /// reaped it through the pidfd (Linux 6.15 and later); None when neither tells any more.
    pub fn how_it_ended(&self) -> Option<String> {
        let Self::Attached(fd, pid) = self else { return None };
        let status = reaped_status(fd.get_ref())
            .or_else(|| procfs::stat(*pid).filter(|stat| stat.zombie).map(|stat| stat.wait_status))
            // Reaped between the two reads.
            .or_else(|| reaped_status(fd.get_ref()))?;
        Some(describe_wait_status(status))
    }
}

/// `struct pidfd_info` as Linux 6.15 first defined it (`PIDFD_INFO_SIZE_VER0`).
#[repr(C)]
#[derive(Default)]
struct PidfdInfo {
    mask: u64,
    cgroupid: u64,
    ids: [u32; 11],
    exit_code: i32,
}

/// `PIDFD_GET_INFO`: `_IOWR(0xFF, 11, struct pidfd_info)`.
const PIDFD_GET_INFO: libc::c_ulong =
    0xC000_0000 | ((std::mem::size_of::<PidfdInfo>() as libc::c_ulong) << 16) | 0xFF0B;
const PIDFD_INFO_EXIT: u64 = 1 << 3;

/// The wait status the kernel keeps with a pidfd once its process is reaped (Linux 6.15+).
fn reaped_status(pidfd: &OwnedFd) -> Option<i32> {
    let mut info = PidfdInfo { mask: PIDFD_INFO_EXIT, ..Default::default() };
    // SAFETY: the ioctl writes at most size_of::<PidfdInfo>() bytes (encoded in its number) into `info`.
    let done = unsafe { libc::ioctl(pidfd.as_raw_fd(), PIDFD_GET_INFO, &mut info as *mut PidfdInfo) };
    (done == 0 && info.mask & PIDFD_INFO_EXIT != 0).then_some(info.exit_code)
}

/// Linux's signal names on x86-64, from 1, without their "SIG".
const SIGNALS: &str =
    "HUP INT QUIT ILL TRAP ABRT BUS FPE KILL USR1 SEGV USR2 PIPE ALRM TERM STKFLT CHLD CONT STOP TSTP TTIN TTOU URG XCPU XFSZ VTALRM PROF WINCH IO PWR SYS";

/// "exit code N" or "killed by SIGNAME" (", core dumped" when it did), from a wait status.
fn describe_wait_status(status: i32) -> String {
    let signal = status & 0x7f;
    if signal == 0 {
        return format!("exit code {}", (status >> 8) & 0xff);
    }
    let core = if status & 0x80 != 0 { ", core dumped" } else { "" };
    format!("killed by {}{core}", signal_name(signal))
}

/// "SIGNAME" for signal number `signal`, "signal N" for one without a name.
pub fn signal_name(signal: i32) -> String {
    let name = usize::try_from(signal).ok().and_then(|signal| SIGNALS.split(' ').nth(signal.checked_sub(1)?));
    name.map_or_else(|| format!("signal {signal}"), |name| format!("SIG{name}"))
}

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
        if is_executable(candidate) {
            return Ok(candidate.to_path_buf());
        }
        return match std::fs::metadata(candidate) {
            Ok(meta) if meta.is_dir() => Err(not_found("a directory, not a program")),
            Ok(_) => Err(not_found("not executable: give it the execute permission (chmod +x)")),
            Err(_) => Err(not_found("no such file")),
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    std::env::split_paths(&path)
        .map(|dir| dir.join(candidate))
        .find(|p| is_executable(p))
        .ok_or_else(|| not_found("not found on PATH"))
}

/// What a shell starts for `command`, whose program is `program`: the program itself, or `/bin/sh`
/// with it when the file is neither a binary nor a `#!` script. The kernel refuses such a file,
/// and shells (and `execvp`) run it as a shell script.
pub fn as_a_shell_starts(program: PathBuf, command: &[OsString]) -> (PathBuf, Vec<OsString>) {
    use std::io::Read as _;
    let mut head = [0u8; 4];
    let read = std::fs::File::open(&program).and_then(|mut file| file.read(&mut head));
    let runs_itself = read.map_or(true, |n| head[..n].starts_with(b"#!") || head[..n] == *b"\x7fELF");
    if runs_itself {
        return (program, command.to_vec());
    }
    let shell = PathBuf::from("/bin/sh");
    let args =
        [shell.clone().into_os_string(), program.into_os_string()].into_iter().chain(command[1..].iter().cloned());
    (shell, args.collect())
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata().map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0).unwrap_or(false)
}

/// Forks a child that execs `program` with `args`, and memprof's environment with `extra_env`
/// (`NAME=value` entries) added, once released.
///
/// The child is not traced: memprof only waits for its exit code, as a shell would, on a thread
/// of its own. Whatever memprof does or suffers after the release (killed, stopped, its output
/// stalled), the command runs as it would without it. Returns the child and a receiver for its
/// exit code.
pub fn spawn(
    program: PathBuf,
    args: &[OsString],
    extra_env: &[&str],
) -> Result<(Child, oneshot::Receiver<i32>), UserError> {
    let spawn_error = |cause| UserError::Spawn { command: program.display().to_string(), cause };
    let c_program = CString::new(program.as_os_str().as_bytes()).map_err(|e| spawn_error(e.into()))?;
    let c_strings = |strings: Vec<Vec<u8>>| {
        strings.into_iter().map(CString::new).collect::<Result<Vec<_>, _>>().map_err(|e| spawn_error(e.into()))
    };
    let c_args = c_strings(args.iter().map(|a| a.as_bytes().to_vec()).collect())?;
    // Built before the fork: the child may not allocate.
    let inherited = std::env::vars_os().map(|(name, value)| [name.as_bytes(), b"=", value.as_bytes()].concat());
    let c_env = c_strings(inherited.chain(extra_env.iter().map(|entry| entry.as_bytes().to_vec())).collect())?;
    let (pid, release) = fork_waiting(&c_program, &c_args, &c_env).map_err(spawn_error)?;
    let (code_tx, code_rx) = oneshot::channel();
    thread::Builder::new()
        .name("command".into())
        .spawn(move || {
            let _ = code_tx.send(wait_for_exit(pid));
        })
        .map_err(spawn_error)?;
    Ok((Child { pid: pid as u32, release }, code_rx))
}

fn fork_waiting(program: &CString, args: &[CString], env: &[CString]) -> io::Result<(libc::pid_t, OwnedFd)> {
    let mut argv: Vec<*const libc::c_char> = args.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    let mut envp: Vec<*const libc::c_char> = env.iter().map(|e| e.as_ptr()).collect();
    envp.push(std::ptr::null());
    let mut fds = [0; 2];
    // SAFETY: fds has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds were just created and are owned here.
    let (read_end, write_end) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: the child only calls async-signal-safe functions (close, read, sigprocmask, signal,
    // execve, _exit) and does not allocate, so forking a multi-threaded process is sound.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        unsafe {
            libc::close(fds[1]);
            // memprof's handlers of its stop signals would swallow them until the exec: a Ctrl-C
            // meanwhile ends the command, as it would once it runs.
            for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
                libc::signal(signal, libc::SIG_DFL);
            }
            let mut byte = 0u8;
            // Blocks until memprof closes the write end, once its probes are attached (or it died:
            // the command then runs untraced). Allocations before exec would be memprof's.
            while libc::read(fds[0], (&mut byte as *mut u8).cast(), 1) < 0 {}
            // The command starts as a shell would start it: no signal blocked, and SIGPIPE back
            // to its default (Rust ignores it in memprof, and exec keeps ignored signals ignored).
            let mut none: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut none);
            libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
            libc::execve(program.as_ptr(), argv.as_ptr(), envp.as_ptr());
            libc::_exit(127);
        }
    }
    drop(read_end);
    Ok((pid, write_end))
}

/// Waits for the child's end; returns a shell-style exit code.
fn wait_for_exit(pid: libc::pid_t) -> i32 {
    let mut status = 0;
    loop {
        // SAFETY: waiting for our own child with a valid out-pointer.
        if unsafe { libc::waitpid(pid, &mut status, 0) } == pid {
            // `--inspect`'s ptrace stop of the command is reported to every thread of memprof.
            if libc::WIFSTOPPED(status) {
                continue;
            }
            break;
        }
        if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return 1;
        }
    }
    if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        128 + libc::WTERMSIG(status)
    }
}

#[cfg(test)]
mod tests {
    use super::describe_wait_status;

    #[test]
    fn a_wait_status_reads_as_an_exit_code_or_a_signal() {
        assert_eq!(describe_wait_status(3 << 8), "exit code 3");
        assert_eq!(describe_wait_status(libc::SIGKILL), "killed by SIGKILL");
        assert_eq!(describe_wait_status(libc::SIGSYS), "killed by SIGSYS");
        assert_eq!(describe_wait_status(libc::SIGSEGV | 0x80), "killed by SIGSEGV, core dumped");
        assert_eq!(describe_wait_status(40), "killed by signal 40");
    }
}
