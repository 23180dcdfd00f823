//! Harness for the end-to-end tests: compiles C fixtures, runs the real `memprof` binary against
//! them under real probes, and reads its JSON reports.
//!
//! These tests need root (BPF and uprobes). They never skip: without root they fail and say so.

use std::{
    io::{BufRead, BufReader, Read, Write},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::{mpsc, Mutex},
    thread,
};

use serde_json::Value;

mod bpf_maps;
pub mod cgroup;
pub mod chromium;
mod daemon;
mod fixtures;
mod http;
pub mod inspection;
pub mod probe_links;
pub mod prometheus;
mod report;
mod scrape;
mod scratch;

pub use bpf_maps::*;
pub use daemon::*;
pub use fixtures::*;
pub use http::*;
pub use report::*;
pub use scrape::*;
pub use scratch::*;

pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ is in the workspace").to_path_buf()
}

/// The memprof binary under test: `MEMPROF_BIN` (set by `cargo xtask test`) or the release build.
pub fn memprof_bin() -> PathBuf {
    let bin = std::env::var_os("MEMPROF_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/release/memprof"));
    assert!(bin.exists(), "{} does not exist: build it with `cargo xtask test`", bin.display());
    require_root();
    bin
}

/// Whether the running kernel is at least `major`.`minor` (its release, as `uname -r` says it).
pub fn kernel_at_least(major: u32, minor: u32) -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("the kernel's release");
    let mut numbers = release.trim().split(['.', '-']).map(|n| n.parse::<u32>().unwrap_or(0));
    (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0)) >= (major, minor)
}

fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "the end-to-end tests attach real uprobes and need root: run `sudo cargo xtask test`");
}

static HEAVY: Mutex<()> = Mutex::new(());

/// Held by tests that must not run beside the others of their file: a daemon, thousands of
/// threads, a signal storm (on a loaded 2-core machine they starve each other's timeouts).
pub fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    HEAVY.lock().unwrap_or_else(|e| e.into_inner())
}

/// What one memprof run printed.
#[derive(Debug)]
pub struct Outcome {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Outcome {
    /// The number a fixture printed to stderr after `prefix` (a count it made of itself).
    pub fn stderr_number(&self, prefix: &str) -> u64 {
        let line = self.stderr.lines().find_map(|line| line.strip_prefix(prefix));
        let line = line.unwrap_or_else(|| panic!("no {prefix:?} line from the fixture: {}", self.stderr));
        line.trim().parse().unwrap_or_else(|_| panic!("{prefix:?} is not followed by a number: {line}"))
    }

    /// Every JSON report, in order.
    pub fn reports(&self) -> Vec<Value> {
        self.each_report().collect()
    }

    /// Every JSON report, in order, each parsed as it is reached: a run with many large reports
    /// (a short interval) would hold gigabytes as parsed values.
    pub fn each_report(&self) -> impl Iterator<Item = Value> + '_ {
        self.stdout.lines().map(|line| self.parsed(line))
    }

    fn parsed(&self, line: &str) -> Value {
        serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}\nstderr: {}", self.stderr))
    }

    /// The last report, which must be the final one.
    pub fn final_report(&self) -> Value {
        let last = self.stdout.lines().last();
        let report =
            last.map(|line| self.parsed(line)).unwrap_or_else(|| panic!("no report printed; stderr: {}", self.stderr));
        assert_eq!(report["final"], true, "the last report is not final: {report}");
        report
    }
}

/// `memprof run --json ARGS -- COMMAND...`
pub fn run(args: &[&str], command: &[&str]) -> Outcome {
    let all: Vec<&str> = ["run", "--json"].iter().chain(args).chain(&["--"]).chain(command).copied().collect();
    memprof(&all)
}

/// `memprof run --json ARGS -- COMMAND...` with `env` added to memprof's environment, which the
/// command inherits (`LD_PRELOAD`).
pub fn run_with_env(env: &[(&str, &str)], args: &[&str], command: &[&str]) -> Outcome {
    let all: Vec<&str> = ["run", "--json"].iter().chain(args).chain(&["--"]).chain(command).copied().collect();
    let mut memprof = Command::new(memprof_bin());
    memprof.args(&all).envs(env.iter().copied()).stdin(Stdio::null());
    memprof.output().expect("starting memprof").into()
}

/// `command`'s exit code, its stderr and its peak resident memory (wait4's `ru_maxrss`).
#[expect(clippy::zombie_processes, reason = "reaped by wait4, which gives its peak memory too")]
pub fn peak_memory(command: &mut Command) -> (Option<i32>, String, u64) {
    let mut child =
        command.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("starting memprof");
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value for wait4 to fill.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waiting for our own child with valid out-pointers; `child` is not waited for again.
    let waited = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut usage) };
    assert_eq!(waited, child.id() as i32);
    let code = <ExitStatus as std::os::unix::process::ExitStatusExt>::from_raw(status).code();
    (code, stderr, usage.ru_maxrss as u64 * 1024)
}

/// Runs memprof with `args` and no target set-up (for error cases).
pub fn memprof(args: &[&str]) -> Outcome {
    Command::new(memprof_bin()).args(args).stdin(Stdio::null()).output().expect("starting memprof").into()
}

impl From<std::process::Output> for Outcome {
    fn from(output: std::process::Output) -> Self {
        Self { status: output.status, stdout: lossy(output.stdout), stderr: lossy(output.stderr) }
    }
}

fn lossy(bytes: Vec<u8>) -> String {
    String::from_utf8_lossy(&bytes).into_owned()
}

/// A fixture started with `--wait`: it has said "ready" and blocks until `go`.
pub struct Waiting {
    pub child: Child,
}

/// Spawns `command`, again while its program is busy (ETXTBSY): a fixture a test has just copied
/// stays open for writing in any child another test forked meanwhile, until that child execs.
fn spawn_when_not_busy(command: &mut Command) -> Child {
    for _ in 0..100 {
        match command.spawn() {
            Err(err) if err.raw_os_error() == Some(libc::ETXTBSY) => {
                thread::sleep(std::time::Duration::from_millis(10))
            }
            started => return started.expect("starting the fixture"),
        }
    }
    panic!("the fixture stayed busy (ETXTBSY) for a second: {command:?}");
}

impl Waiting {
    pub fn start(fixture: &Path, args: &[&str]) -> Self {
        let mut command = Command::new(fixture);
        command.arg("--wait").args(args);
        Self::start_command(command)
    }

    /// Starts `command`, which must run a fixture with `--wait`.
    pub fn start_command(mut command: Command) -> Self {
        let mut child = spawn_when_not_busy(command.stdin(Stdio::piped()).stdout(Stdio::piped()));
        let mut ready = String::new();
        BufReader::new(child.stdout.as_mut().expect("piped")).read_line(&mut ready).expect("reading the fixture");
        assert_eq!(ready, "ready\n", "the fixture did not get ready");
        Self { child }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The fixture's next line on stdout, read a byte at a time: a buffered reader dropped here
    /// could swallow the line after it.
    pub fn next_line(&mut self) -> String {
        let mut line = String::new();
        let stdout = self.child.stdout.as_mut().expect("piped");
        let mut byte = [0u8];
        while stdout.read(&mut byte).expect("reading the fixture") == 1 && byte[0] != b'\n' {
            line.push(byte[0] as char);
        }
        line
    }

    /// Lets the fixture do its work.
    pub fn go(&mut self) {
        self.child.stdin.as_mut().expect("piped").write_all(b"go\n").expect("writing to the fixture");
    }

    /// Ends a loop run with `--until-stop`.
    pub fn stop(&mut self) {
        self.child.stdin.as_mut().expect("piped").write_all(b"stop\n").expect("writing to the fixture");
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `memprof attach --pid PID --json ARGS` on a waiting fixture: releases the fixture once every
/// probe is attached, then waits for memprof to end.
pub fn attach(target: &mut Waiting, args: &[&str]) -> Outcome {
    let pid = target.pid();
    attach_pid(target, pid, args)
}

/// `attach` to `pid`, a process that `target` started (in a container, say) and that waits with it.
pub fn attach_pid(target: &mut Waiting, pid: u32, args: &[&str]) -> Outcome {
    attach_with(Command::new(memprof_bin()), target, pid, args)
}

/// `attach_pid` with memprof started by `memprof`: an installed copy, or memprof under `setpriv`.
/// Every call is recorded (`--max-rate off`) unless `args` choose: the tests check exact
/// counts, which attach's default would sample away on a busy fixture.
pub fn attach_with(mut memprof: Command, target: &mut Waiting, pid: u32, args: &[&str]) -> Outcome {
    let pid = pid.to_string();
    memprof.args(["attach", "--pid", &pid, "--json"]);
    every_call_unless_chosen(&mut memprof, args);
    memprof.args(args).stdin(Stdio::null());
    released(memprof, &[format!("memprof: tracing pid {pid} ")], |_| target.go())
}

/// `--max-rate off` unless `args` choose a rate, growth mode or usdt mode.
fn every_call_unless_chosen(memprof: &mut Command, args: &[&str]) {
    if !args.iter().any(|arg| ["--max-rate", "--growth", "--usdt"].contains(arg)) {
        memprof.args(["--max-rate", "off"]);
    }
}

/// How long `released` waits for each marker, times `time_scale`: a memprof that never says it
/// (an old binary, say) would otherwise hang the test, its command waiting for the release.
const MARKER_WAIT_SECONDS: u64 = 120;

/// Runs `memprof`; each time its stderr shows a line containing the next of `markers`, calls
/// `release` (which may signal memprof to end). Returns once memprof has exited, with all it
/// printed. Fails, memprof killed, when a marker does not come within `MARKER_WAIT_SECONDS`.
pub fn released(memprof: Command, markers: &[String], release: impl FnMut(&mut Child)) -> Outcome {
    let contains: Vec<_> = markers.iter().map(|marker| move |line: &str| line.contains(marker.as_str())).collect();
    let markers: Vec<Marker> = markers.iter().zip(&contains).map(|(name, test)| (name.as_str(), test as _)).collect();
    released_when(memprof, &markers, release)
}

/// A line `released_when` waits for: what it is, and whether a line is it.
pub type Marker<'a> = (&'a str, &'a dyn Fn(&str) -> bool);

/// `released`, with markers that are tests of a line.
pub fn released_when(mut memprof: Command, markers: &[Marker], mut release: impl FnMut(&mut Child)) -> Outcome {
    let mut memprof = memprof.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("starting memprof");
    let stdout = collect(memprof.stdout.take().expect("piped"));
    let lines = lines_of(memprof.stderr.take().expect("piped"));
    let mut seen = String::new();
    for (marker, is_marker) in markers {
        let wait = std::time::Duration::from_secs(MARKER_WAIT_SECONDS * time_scale());
        let deadline = std::time::Instant::now() + wait;
        loop {
            match lines.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now())) {
                Ok(line) => {
                    seen.push_str(&line);
                    if is_marker(&line) {
                        break;
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let _ = memprof.kill();
                    let _ = memprof.wait();
                    panic!("memprof did not say `{marker}` within {} s: {seen}", wait.as_secs());
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = memprof.wait().expect("waiting for memprof");
                    panic!("memprof ended ({status}) before `{marker}`: {seen}");
                }
            }
        }
        release(&mut memprof);
    }
    let rest: String = lines.iter().collect();
    let status = memprof.wait().expect("waiting for memprof");
    Outcome { status, stdout: stdout.join().expect("stdout reader"), stderr: seen + &rest }
}

/// The lines `from` gives, each as it comes, until its end.
fn lines_of(from: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (send, lines) = mpsc::channel();
    thread::spawn(move || {
        let mut from = BufReader::new(from);
        let mut line = Vec::new();
        while from.read_until(b'\n', &mut line).is_ok_and(|read| read > 0) {
            if send.send(String::from_utf8_lossy(&line).into_owned()).is_err() {
                break;
            }
            line.clear();
        }
    });
    lines
}

fn collect(mut from: impl Read + Send + 'static) -> thread::JoinHandle<String> {
    thread::spawn(move || {
        let mut text = String::new();
        let _ = from.read_to_string(&mut text);
        text
    })
}

/// How many times longer than on the build machine every wait of the harness lasts:
/// `MEMPROF_TEST_TIME_SCALE`, 1 unless set. `cargo xtask kernels` sets it: under software
/// emulation loading the programs alone takes a minute.
pub fn time_scale() -> u64 {
    std::env::var("MEMPROF_TEST_TIME_SCALE").ok().and_then(|scale| scale.parse().ok()).unwrap_or(1).max(1)
}

/// Polls `check` every 200 ms until it returns Some, or panics after `seconds` (times
/// `time_scale`) with `what`.
pub fn wait_for<T>(seconds: u64, what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let seconds = seconds * time_scale();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(seconds);
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(std::time::Instant::now() < deadline, "timed out after {seconds} s waiting for {what}");
        thread::sleep(std::time::Duration::from_millis(200));
    }
}
