//! A `memprof daemon` started for a test.

use std::{
    path::PathBuf,
    process::{Child, Command, Stdio},
    thread,
};

use serde_json::Value;

use crate::{collect, every_call_unless_chosen, free_port, memprof_bin, socket_answer, wait_for, HttpAnswer};

/// Lets a daemon move a process to growth mode (`max_rate`, a crowded table) on any kernel. Where
/// the kernel refuses `fexit` programs (this project's VM), the daemon otherwise leaves the
/// process off growth mode, whose programs would run at every system call on the machine.
pub const MOVES_TO_PAGES_ANYWHERE: &str = "--mappings";

/// Whether this kernel refuses `fexit` programs, as memprof finds and says it (asked once), or
/// no when `cargo xtask kernels` says it takes them (`MEMPROF_TEST_FEXIT`), which spares an
/// emulated guest a load of memprof's programs.
pub fn kernel_refuses_fexit() -> bool {
    static REFUSES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if std::env::var_os("MEMPROF_TEST_FEXIT").is_some() {
        return false;
    }
    *REFUSES.get_or_init(|| {
        let outcome = crate::memprof(&["run", "--mappings", "--json", "--", "true"]);
        assert!(outcome.status.success(), "{outcome:?}");
        outcome.stderr.contains("this kernel refuses fexit programs")
    })
}

/// A `memprof daemon` on a free loopback port and a socket of its own, reporting every second;
/// killed when dropped.
pub struct Daemon {
    pub child: Child,
    pub port: u16,
    /// Its API socket, which serves root everything (the port serves anyone `/metrics` only).
    pub socket: PathBuf,
    /// Whether the socket is in a directory made for it.
    socket_dir: bool,
    /// Its stderr, read as it comes: it logs a line per process it attaches and detaches, which
    /// would fill a pipe nobody reads and block it.
    log: Option<thread::JoinHandle<String>>,
}

impl Daemon {
    pub fn start(args: &[&str]) -> Self {
        Self::start_with_env(args, &[])
    }

    /// `start` with the environment variables `env` set for the daemon.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Self {
        Self::ready(Self::spawn(args, env))
    }

    /// `start` with the daemon's own default `max_rate`, as users run it: the tests' daemons
    /// otherwise record every call (see `every_call_unless_chosen`).
    pub fn start_at_default_rate(args: &[&str]) -> Self {
        Self::ready(Self::spawn_choosing(Command::new(memprof_bin()), args, &[], false))
    }

    /// Waits until `daemon` is ready; fails at once with its log if it exits first (a kernel that
    /// refuses its programs, say).
    pub fn ready(mut daemon: Self) -> Self {
        // On the socket: the port asks for a password when the daemon has a web config.
        wait_for(20, "the daemon to be ready", || {
            if let Ok(Some(status)) = daemon.child.try_wait() {
                panic!("the daemon exited ({status}) before it was ready: {}", daemon.log());
            }
            (daemon.get("/-/ready")?.0 == 200).then_some(())
        });
        daemon
    }

    /// Starts the daemon without waiting for it to be ready (for a listener that plain HTTP
    /// cannot reach).
    pub fn spawn(args: &[&str], env: &[(&str, &str)]) -> Self {
        Self::spawn_with(Command::new(memprof_bin()), args, env)
    }

    /// `spawn` with memprof started by `memprof` (memprof under `setpriv`, say).
    pub fn spawn_with(memprof: Command, args: &[&str], env: &[(&str, &str)]) -> Self {
        Self::spawn_choosing(memprof, args, env, true)
    }

    /// `spawn_with`; `every_call`: `--max-rate off` unless `args` choose.
    fn spawn_choosing(mut memprof: Command, args: &[&str], env: &[(&str, &str)], every_call: bool) -> Self {
        let port = free_port();
        let listen = format!("127.0.0.1:{port}");
        // A socket of its own, unless `args` name one.
        let named = args.iter().position(|arg| *arg == "--socket").and_then(|at| args.get(at + 1));
        let socket = match named {
            Some(path) => PathBuf::from(path),
            None => std::env::temp_dir().join(format!("memprof-daemon-{}-{port}/api.sock", std::process::id())),
        };
        if named.is_none() {
            memprof.arg("daemon").arg("--socket").arg(&socket);
        } else {
            memprof.arg("daemon");
        }
        if every_call {
            every_call_unless_chosen(&mut memprof, args);
        }
        memprof.args(["--listen", &listen]);
        // Reads each second, unless `args` choose.
        if !args.contains(&"--interval") {
            memprof.args(["--interval", "1"]);
        }
        let mut child = memprof
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting memprof daemon");
        let log = Some(collect(child.stderr.take().expect("piped")));
        Self { child, port, socket, socket_dir: named.is_none(), log }
    }

    /// `GET path` on the daemon's socket, as root; None when it does not answer.
    pub fn get(&self, path: &str) -> Option<(u16, String)> {
        self.answer(path).map(|answer| (answer.status, answer.body))
    }

    /// `GET path` on the daemon's socket, as root, with the answer's headers.
    pub fn answer(&self, path: &str) -> Option<HttpAnswer> {
        socket_answer(&self.socket, "GET", path)
    }

    /// What the daemon wrote to stderr, once it has exited (`child.wait()`).
    pub fn log(&mut self) -> String {
        self.log.take().expect("the log is read once").join().expect("stderr reader")
    }

    /// `GET path` on the daemon's socket, as root, and its JSON answer.
    pub fn get_json(&self, path: &str) -> (u16, Value) {
        let (status, body) = self.get(path).unwrap_or_else(|| panic!("GET {path} failed"));
        (status, serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {path}: not JSON ({e}): {body}")))
    }

    /// How many of the daemon's links run for every process: at page faults, at `sys_exit`, and
    /// `fexit` programs.
    pub fn machine_wide_links(&self) -> [usize; 3] {
        let links = crate::probe_links::descriptions(self.child.id());
        ["page_fault_user", "tp_name:\tsys_exit", "link_type:\ttracing"]
            .map(|at| links.iter().filter(|link| link.contains(at)).count())
    }

    /// `memprof_machine_wide_programs` at `at`: `page_faults`, `mapping_calls` or `system_calls`.
    pub fn machine_wide_programs(&self, at: &str) -> Option<u64> {
        crate::metric(self.port, &format!("memprof_machine_wide_programs{{at=\"{at}\"}}"))
    }

    pub fn traced_pids(&self) -> Vec<u64> {
        let (_, targets) = self.get_json("/api/v1/targets");
        targets.as_array().unwrap().iter().map(|t| t["pid"].as_u64().unwrap()).collect()
    }

    pub fn wait_traced(&self, pid: u32) {
        wait_for(20, &format!("pid {pid} to be traced"), || self.traced_pids().contains(&(pid as u64)).then_some(()));
    }

    pub fn signal(&self, signal: i32) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, signal) };
    }

    /// Stops the daemon as systemd does (SIGTERM), asserts it exited well, and returns its log.
    pub fn stopped_log(&mut self) -> String {
        self.signal(libc::SIGTERM);
        let status = self.child.wait().unwrap();
        assert!(status.success(), "{status}");
        self.log()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // The daemon removes its socket when it stops; a killed one leaves it.
        let _ = std::fs::remove_file(&self.socket);
        if self.socket_dir {
            let _ = std::fs::remove_dir(self.socket.parent().expect("a directory of its own"));
        }
    }
}

/// `memprof daemon --comm ^none$ --listen 127.0.0.1:0 ARGS`, started through `wrapper` (a
/// command that execs the rest; none: memprof itself), which must refuse to start: asserted to
/// exit 1 with one line on stderr, which is returned.
pub fn refused_daemon(wrapper: &[&str], args: &[&str]) -> String {
    let memprof = memprof_bin();
    let daemon = ["timeout", "60", memprof.to_str().expect("a UTF-8 path"), "daemon"];
    let rest = ["--comm", "^none$", "--listen", "127.0.0.1:0"];
    let command: Vec<&str> = wrapper.iter().chain(&daemon).chain(&rest).chain(args).copied().collect();
    let outcome = Command::new(command[0]).args(&command[1..]).output().expect("running memprof");
    let stderr = String::from_utf8_lossy(&outcome.stderr).into_owned();
    assert_eq!(outcome.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    stderr
}
