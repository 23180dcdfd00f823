//! Harness for the end-to-end tests: compiles C fixtures, runs the real `memprof` binary against
//! them under real probes, and reads its JSON reports.
//!
//! These tests need root (BPF and uprobes). They never skip: without root they fail and say so.

use std::{
    io::{BufRead, BufReader, Read, Write},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::Mutex,
    thread,
};

use serde_json::Value;

pub mod cgroup;
pub mod chromium;
pub mod inspection;
pub mod probe_links;
pub mod prometheus;

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

fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "the end-to-end tests attach real uprobes and need root: run `sudo cargo xtask test`");
}

static COMPILE: Mutex<()> = Mutex::new(());

static HEAVY: Mutex<()> = Mutex::new(());

/// Held by tests that must not run beside the others of their file: a daemon, thousands of
/// threads, a signal storm (on a loaded 2-core machine they starve each other's timeouts).
pub fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    HEAVY.lock().unwrap_or_else(|e| e.into_inner())
}

/// Compiles `tests/fixtures/NAME.c` and returns the executable.
pub fn fixture(name: &str) -> PathBuf {
    fixture_with(&format!("{name}.c"), name, &["-g", "-O0", "-fno-omit-frame-pointer", "-pthread"])
}

/// Compiles the fixture source `file` with the flags given into the executable `name` (each
/// build its own name: tests run side by side).
pub fn fixture_with(file: &str, name: &str, flags: &[&str]) -> PathBuf {
    fixture_compiled("cc", file, name, flags)
}

/// Compiles the fixture source `file` with `musl-gcc -static` and the flags given: musl's libc
/// is built without unwind tables.
pub fn fixture_musl(file: &str, name: &str, flags: &[&str]) -> PathBuf {
    let flags: Vec<&str> = ["-static"].iter().chain(flags).copied().collect();
    fixture_compiled("musl-gcc", file, name, &flags)
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
        self.stdout
            .lines()
            .map(|line| {
                serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}\nstderr: {}", self.stderr))
            })
            .collect()
    }

    /// The last report, which must be the final one.
    pub fn final_report(&self) -> Value {
        let report = self.reports().pop().unwrap_or_else(|| panic!("no report printed; stderr: {}", self.stderr));
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

    /// Lets the fixture do its work.
    pub fn go(&mut self) {
        self.child.stdin.as_mut().expect("piped").write_all(b"go\n").expect("writing to the fixture");
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

/// Runs `memprof`; each time its stderr shows a line containing the next of `markers`, calls
/// `release` (which may signal memprof to end). Returns once memprof has exited, with all it
/// printed.
pub fn released(mut memprof: Command, markers: &[String], mut release: impl FnMut(&mut Child)) -> Outcome {
    let mut memprof = memprof.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("starting memprof");
    let stdout = collect(memprof.stdout.take().expect("piped"));
    let mut stderr = BufReader::new(memprof.stderr.take().expect("piped"));
    let mut seen = String::new();
    for marker in markers {
        loop {
            let mut line = String::new();
            if stderr.read_line(&mut line).expect("reading memprof's stderr") == 0 {
                let status = memprof.wait().expect("waiting for memprof");
                panic!("memprof ended ({status}) before `{marker}`: {seen}");
            }
            seen.push_str(&line);
            if line.contains(marker.as_str()) {
                break;
            }
        }
        release(&mut memprof);
    }
    let rest = collect(stderr.into_inner());
    let status = memprof.wait().expect("waiting for memprof");
    Outcome {
        status,
        stdout: stdout.join().expect("stdout reader"),
        stderr: seen + &rest.join().expect("stderr reader"),
    }
}

fn collect(mut from: impl Read + Send + 'static) -> thread::JoinHandle<String> {
    thread::spawn(move || {
        let mut text = String::new();
        let _ = from.read_to_string(&mut text);
        text
    })
}

/// Outstanding (bytes, allocations) of the stacks whose innermost frame is `function`.
pub fn site(report: &Value, function: &str) -> (u64, u64) {
    let mut total = (0, 0);
    for stack in report["stacks"].as_array().expect("stacks is an array") {
        if stack["frames"][0]["function"] == function {
            total.0 += stack["outstanding_bytes"].as_u64().expect("bytes");
            total.1 += stack["outstanding_allocations"].as_u64().expect("count");
        }
    }
    total
}

/// Outstanding (bytes, allocations) of the stacks that pass through `function` anywhere: for
/// sites reached through library code (C++'s containers, Rust's `Vec`).
pub fn through(report: &Value, function: &str) -> (u64, u64) {
    let mut total = (0, 0);
    for stack in report["stacks"].as_array().expect("stacks is an array") {
        if stack["frames"].as_array().expect("frames").iter().any(|f| f["function"] == function) {
            total.0 += stack["outstanding_bytes"].as_u64().expect("bytes");
            total.1 += stack["outstanding_allocations"].as_u64().expect("count");
        }
    }
    total
}

/// The report's totals as (name, value) for assertions.
pub fn total(report: &Value, name: &str) -> u64 {
    report["totals"][name].as_u64().unwrap_or_else(|| panic!("totals.{name} missing in {report}"))
}

/// Every drop counter must be zero in a clean run. Under emulation (`time_scale` above 1) but
/// `age_generation_missed`: it loses no event, it counts memprof's reads coming more than two
/// intervals apart, and there each read's work takes the emulator's many times longer.
pub fn assert_nothing_dropped(report: &Value) {
    for (reason, count) in report["dropped"].as_object().expect("dropped is an object") {
        if reason == "age_generation_missed" && time_scale() > 1 {
            continue;
        }
        assert_eq!(count, 0, "dropped {reason}: {report}");
    }
}

/// A free TCP port on loopback (bound and released), never one given to another test of this
/// binary: the kernel may hand a released port out again at once, and two servers of tests
/// running side by side then share it (a client of one talking to the other's).
pub fn free_port() -> u16 {
    static GIVEN: Mutex<std::collections::BTreeSet<u16>> = Mutex::new(std::collections::BTreeSet::new());
    loop {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binding loopback");
        let port = listener.local_addr().expect("local address").port();
        if GIVEN.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(port) {
            return port;
        }
    }
}

/// `GET path` from a server on loopback; returns (status, body).
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    http(port, "GET", path)
}

/// `METHOD path` from a server on loopback; returns (status, body).
pub fn http(port: u16, method: &str, path: &str) -> Option<(u16, String)> {
    http_answer(port, method, path).map(|answer| (answer.status, answer.body))
}

/// What a server answered.
pub struct HttpAnswer {
    pub status: u16,
    /// The header lines, as sent.
    pub headers: String,
    pub body: String,
}

impl HttpAnswer {
    /// The value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.lines().find_map(|line| {
            let (key, value) = line.split_once(':')?;
            key.eq_ignore_ascii_case(name).then_some(value.trim())
        })
    }
}

/// `METHOD path` from a server on loopback. HTTP/1.0 keeps bodies unchunked.
pub fn http_answer(port: u16, method: &str, path: &str) -> Option<HttpAnswer> {
    use std::net::TcpStream;
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(std::time::Duration::from_secs(10 * time_scale()))).ok()?;
    write!(stream, "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let (headers, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    Some(HttpAnswer { status, headers: headers.to_string(), body: body.to_string() })
}

/// A web config file in `dir` giving the daemon's listener the user `user` with `password`
/// (bcrypt at its lowest cost: a test's).
pub fn web_config_user(dir: &Path, user: &str, password: &str) -> PathBuf {
    std::fs::create_dir_all(dir).expect("creating the web config's directory");
    let hash = bcrypt::hash(password, 4).expect("hashing the password");
    let web = dir.join("web.yml");
    std::fs::write(&web, format!("basic_auth_users:\n  {user}: '{hash}'\n")).expect("writing the web config");
    web
}

/// `METHOD path` on the daemon's API socket at `socket`, as the caller's user.
pub fn socket_answer(socket: &Path, method: &str, path: &str) -> Option<HttpAnswer> {
    let mut stream = std::os::unix::net::UnixStream::connect(socket).ok()?;
    stream.set_read_timeout(Some(std::time::Duration::from_secs(300))).ok()?;
    write!(stream, "{method} {path} HTTP/1.0\r\nHost: localhost\r\nContent-Length: 0\r\n\r\n").ok()?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).ok()?;
    // A profile's body is binary: its text is only looked into.
    let response = String::from_utf8_lossy(&response);
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let (headers, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    Some(HttpAnswer { status, headers: headers.to_string(), body: body.to_string() })
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
        let mut child = memprof
            .args(["--listen", &listen, "--interval", "1"])
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

/// What bpftool says of the BPF map `name` that process `pid` holds (its `id`, `max_entries`...),
/// found by its descriptors; None when it holds no map of that name.
pub fn map_info(pid: u32, name: &str) -> Option<Value> {
    let ids: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fdinfo"))
        .ok()?
        .flatten()
        .filter_map(|fd| {
            let info = std::fs::read_to_string(fd.path()).ok()?;
            info.lines().find_map(|line| line.strip_prefix("map_id:")).map(|id| id.trim().to_string())
        })
        .collect();
    ids.iter().find_map(|id| {
        let shown = Command::new("bpftool").args(["map", "show", "id", id, "-j"]).output().ok()?;
        let map: Value = serde_json::from_slice(&shown.stdout).ok()?;
        (map["name"] == name).then_some(map)
    })
}

/// The capacity (`max_entries`) of the BPF map `name` that process `pid` holds.
pub fn map_capacity(pid: u32, name: &str) -> Option<u64> {
    map_info(pid, name)?["max_entries"].as_u64()
}

/// The sum of the slots of the mappable array of u64 `name` that process `pid` holds, read
/// through a mapping of it (bpftool would print each of its slots).
pub fn array_sum(pid: u32, name: &str) -> u64 {
    let map = map_info(pid, name).unwrap_or_else(|| panic!("pid {pid} holds no map {name}"));
    let (id, slots) = (map["id"].as_u64().unwrap() as u32, map["max_entries"].as_u64().unwrap() as usize);
    // BPF_MAP_GET_FD_BY_ID: union bpf_attr's map_id, next_id and open_flags.
    let attr = [id, 0, 0];
    // SAFETY: the attr lives across the call, and its size is given.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, 14, attr.as_ptr(), size_of_val(&attr)) };
    assert!(fd >= 0, "opening map {name} ({id}): {}", std::io::Error::last_os_error());
    let fd = fd as i32;
    let bytes = slots * size_of::<u64>();
    // SAFETY: a read-only shared mapping of the map's memory, unmapped below.
    let address = unsafe { libc::mmap(std::ptr::null_mut(), bytes, libc::PROT_READ, libc::MAP_SHARED, fd, 0) };
    assert_ne!(address, libc::MAP_FAILED, "mapping {name}: {}", std::io::Error::last_os_error());
    // SAFETY: `slots` u64s are mapped at `address`; `address` and `fd` are ours to release.
    unsafe {
        let sum = std::slice::from_raw_parts(address.cast::<u64>(), slots).iter().fold(0u64, |a, b| a.wrapping_add(*b));
        libc::munmap(address, bytes);
        libc::close(fd);
        sum
    }
}

/// The value of the sample `series` (see `sample`) in the daemon's /metrics at `port`; None when
/// it is missing or the scrape fails.
pub fn metric(port: u16, series: &str) -> Option<u64> {
    sample(&http_get(port, "/metrics")?.1, series)
}

/// The value of the first sample in the text `metrics` that `series` names: `name{a="x",b="y"}`
/// matches the samples of `name` that have these labels, whatever others they have (a process's
/// exe and cgroup, say); a bare name matches any of its samples. A process's series carry no pid:
/// `pid="N"` stands for its identity, the comm and slot that `memprof_target_attached` gives pid N.
pub fn sample(metrics: &str, series: &str) -> Option<u64> {
    sample_as(metrics, series)
}

/// `metric` for a series whose value has a fraction (seconds, say).
pub fn metric_f64(port: u16, series: &str) -> Option<f64> {
    sample_as(&http_get(port, "/metrics")?.1, series)
}

fn sample_as<T: std::str::FromStr>(metrics: &str, series: &str) -> Option<T> {
    let (name, mut wanted) = parse_series(series)?;
    if name != "memprof_target_attached" {
        if let Some(at) = wanted.iter().position(|(key, _)| key == "pid") {
            let pid = wanted.remove(at);
            let identity = samples(metrics).find_map(|(found, labels, _)| {
                (found == "memprof_target_attached" && labels.contains(&pid))
                    .then(|| labels.into_iter().filter(|(key, _)| key == "comm" || key == "slot").collect::<Vec<_>>())
            })?;
            wanted.extend(identity);
        }
    }
    samples(metrics).find_map(|(found, labels, value)| {
        (found == name && wanted.iter().all(|label| labels.contains(label))).then(|| value.parse().ok())?
    })
}

/// The samples of the text `metrics`: name, labels and value.
fn samples(metrics: &str) -> impl Iterator<Item = (&str, Vec<(String, String)>, &str)> {
    metrics.lines().filter(|line| !line.starts_with('#')).filter_map(|line| {
        let (series, value) = line.rsplit_once(' ')?;
        let (name, labels) = parse_series(series)?;
        Some((name, labels, value))
    })
}

/// A sample's name and labels, label values unescaped.
fn parse_series(series: &str) -> Option<(&str, Vec<(String, String)>)> {
    let Some((name, mut rest)) = series.split_once('{') else { return Some((series, Vec::new())) };
    let mut labels = Vec::new();
    while let Some((key, after)) = rest.split_once("=\"") {
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next()? {
                (_, '\\') => value.push(match chars.next()?.1 {
                    'n' => '\n',
                    escaped => escaped,
                }),
                (i, '"') => break i,
                (_, c) => value.push(c),
            }
        };
        labels.push((key.trim_start_matches(',').to_string(), value));
        rest = &after[end + 1..];
    }
    Some((name, labels))
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

/// A root directory of its own for `program`, as a container has: copies of the C library, the
/// dynamic loader and the program (as `/NAME`). Copies, not links: each is a different inode from
/// the host's file, as a container's libc is, so probes must be placed through the process's view.
/// The caller removes it.
pub fn own_root(program: &Path, name: &str) -> PathBuf {
    let root = std::env::temp_dir().join(format!("memprof-root-{}-{name}", std::process::id()));
    for (from, to) in [
        (Path::new("/lib/x86_64-linux-gnu/libc.so.6"), "lib/x86_64-linux-gnu/libc.so.6"),
        (Path::new("/lib64/ld-linux-x86-64.so.2"), "lib64/ld-linux-x86-64.so.2"),
        (program, name),
    ] {
        let to = root.join(to);
        std::fs::create_dir_all(to.parent().expect("a file under the root")).expect("creating the root's directories");
        std::fs::copy(from, &to).unwrap_or_else(|e| panic!("copying {} into the root: {e}", from.display()));
    }
    root
}

/// Compiles the fixture source `file` with `compiler` (`cc`, `g++`, `rustc`) and `flags` into
/// `target/fixtures/NAME` (an executable, or a shared library with `-shared`).
pub fn fixture_compiled(compiler: &str, file: &str, name: &str, flags: &[&str]) -> PathBuf {
    compiled(compiler, &workspace().join("tests/fixtures").join(file), name, flags)
}

/// Compiles `bench/FILE`, a workload `cargo xtask` measures memprof with, with `cc FLAGS` into
/// the executable `name`: for a test that needs the same workload.
pub fn bench_program(file: &str, name: &str, flags: &[&str]) -> PathBuf {
    compiled("cc", &workspace().join("bench").join(file), name, flags)
}

/// `bench/heapbench.c` holding `mib` MiB of live blocks, once it says it has built them. It waits
/// for its stdin to close, so it ends with the test that holds it, whatever happens.
pub fn start_heapbench(mib: u64) -> Child {
    let heapbench = bench_program("heapbench.c", "heapbench", &["-O2", "-pthread"]);
    let mut target = Command::new(&heapbench)
        .arg(mib.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting heapbench");
    let mut built = String::new();
    BufReader::new(target.stdout.as_mut().expect("piped")).read_line(&mut built).expect("reading heapbench");
    assert_eq!(built, "built\n");
    target
}

/// Compiles `source` with `compiler` and `flags` into `target/fixtures/NAME`, unless it was built
/// so already and no fixture source changed since: built again, it would be renamed over the file
/// a test running beside this one executes (whose exe then reads "(deleted)", and whose probes,
/// placed by path, would land on the new file).
fn compiled(compiler: &str, source: &Path, name: &str, flags: &[&str]) -> PathBuf {
    let _guard = COMPILE.lock().unwrap_or_else(|e| e.into_inner());
    let dir = workspace().join("target/fixtures");
    std::fs::create_dir_all(&dir).expect("creating target/fixtures");
    // Several test binaries compile at once: one at a time, across processes too.
    let lock = std::fs::File::create(dir.join(".lock")).expect("creating target/fixtures/.lock");
    lock.lock().expect("locking target/fixtures");
    let out = dir.join(name);
    let stamp = dir.join(format!(".{name}.command"));
    let command = format!("{compiler} {} {}", flags.join(" "), source.display());
    if is_built(&out, &stamp, &command, source) {
        return out;
    }
    let partial = dir.join(format!(".{name}.{}", std::process::id()));
    let status = Command::new(compiler)
        .args(flags)
        .arg("-o")
        .arg(&partial)
        .arg(source)
        .status()
        .unwrap_or_else(|e| panic!("starting {compiler}: {e}"));
    assert!(status.success(), "compiling {} with {compiler} failed", source.display());
    std::fs::rename(&partial, &out).expect("moving the fixture into place");
    std::fs::write(&stamp, &command).expect("writing the fixture's command");
    out
}

/// Whether `out` was built by `command` after the last change to `source` and the files beside
/// it (the headers it includes).
fn is_built(out: &Path, stamp: &Path, command: &str, source: &Path) -> bool {
    let modified = |path: &Path| std::fs::metadata(path).and_then(|m| m.modified()).ok();
    let Some(built) = modified(out) else { return false };
    let sources = source.parent().and_then(|dir| std::fs::read_dir(dir).ok()).into_iter().flatten().flatten();
    let newest = sources.filter(|e| e.path().is_file()).filter_map(|e| modified(&e.path())).max();
    std::fs::read_to_string(stamp).is_ok_and(|was| was == command) && newest.is_some_and(|newest| newest <= built)
}

/// Builds the Rust fixture crate `tests/fixtures/NAME` (its own crates from crates.io, in release
/// mode as a service ships) and returns its binary `bin`.
pub fn fixture_crate(name: &str, bin: &str) -> PathBuf {
    let _guard = COMPILE.lock().unwrap_or_else(|e| e.into_inner());
    let target = workspace().join("target/fixtures").join(name);
    let manifest = workspace().join("tests/fixtures").join(name).join("Cargo.toml");
    let status = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
        .args(["build", "--release", "--quiet", "--locked", "--manifest-path"])
        .arg(&manifest)
        .arg("--target-dir")
        .arg(&target)
        .status()
        .unwrap_or_else(|e| panic!("starting cargo: {e}"));
    assert!(status.success(), "building {} failed", manifest.display());
    target.join("release").join(bin)
}

/// Builds the Go fixture module `tests/fixtures/NAME` with Debian's `go` into
/// `target/fixtures/NAME`, linked by the system's linker (so that it maps the C library, as a Go
/// program using cgo or the system's resolver does), its build cache under `target/go-cache` (a
/// rebuild is a cache hit), offline: the fixtures use the standard library only.
pub fn fixture_go(name: &str) -> PathBuf {
    build_go(name, name, &["-ldflags=-linkmode=external"], "1")
}

/// `fixture_go` built as most Go services are, without cgo: a static binary with no C library,
/// into `target/fixtures/NAME-pure`.
pub fn fixture_go_pure(name: &str) -> PathBuf {
    build_go(name, &format!("{name}-pure"), &[], "0")
}

fn build_go(name: &str, out_name: &str, flags: &[&str], cgo: &str) -> PathBuf {
    let _guard = COMPILE.lock().unwrap_or_else(|e| e.into_inner());
    let target = workspace().join("target");
    let out = target.join("fixtures").join(out_name);
    let status = Command::new("go")
        .arg("build")
        .args(flags)
        .arg("-o")
        .arg(&out)
        .arg(".")
        .current_dir(workspace().join("tests/fixtures").join(name))
        .env("GOCACHE", target.join("go-cache"))
        .env("GOPATH", target.join("go-path"))
        .env("GOPROXY", "off")
        .env("GOFLAGS", "-mod=mod")
        .env("CGO_ENABLED", cgo)
        .status()
        .unwrap_or_else(|e| panic!("starting go (Debian's golang-go, installed by `cargo xtask setup`): {e}"));
    assert!(status.success(), "building the Go fixture {name} failed");
    out
}

/// Compiles the C++ fixture `file` with `g++ FLAGS` into the executable `name`.
pub fn fixture_cpp(file: &str, name: &str, flags: &[&str]) -> PathBuf {
    fixture_compiled("g++", file, name, flags)
}

/// Compiles the Rust fixture `file` (a crate root) with `rustc FLAGS` into the executable `name`.
pub fn fixture_rust(file: &str, name: &str, flags: &[&str]) -> PathBuf {
    fixture_compiled("rustc", file, name, flags)
}

/// Compiles the C fixture `file` with `cc -shared -fPIC FLAGS` into the shared library `name`.
pub fn fixture_lib(file: &str, name: &str, flags: &[&str]) -> PathBuf {
    let all: Vec<&str> = ["-shared", "-fPIC"].iter().chain(flags).copied().collect();
    fixture_compiled("cc", file, name, &all)
}

/// `cargo xtask WHAT --out OUT` on the binary under test (packaged as it is, not built again):
/// what it prints, the path of what it made.
pub fn xtask_package(what: &str, out: &Path) -> String {
    let mut command = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    command.args(["xtask", what, "--out"]).arg(out).env("MEMPROF_BIN", memprof_bin());
    succeeds(&mut command).trim().to_string()
}

/// Runs `command`, which must succeed: its standard output.
pub fn succeeds(command: &mut Command) -> String {
    let out = command.output().unwrap_or_else(|e| panic!("starting {command:?}: {e}"));
    assert!(out.status.success(), "{command:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}
