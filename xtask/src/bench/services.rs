//! Real services: Debian's redis-server (jemalloc) under `redis-benchmark -t set`, untraced and
//! under memprof attached to it (exact, at its defaults, sampled and growth mode), under the
//! daemon at its defaults, and heaptrack (restarted under it); and Debian's python3 building a
//! dict, untraced and under `memprof run` in each mode and heaptrack. The runs interleaved so that
//! a change in the machine's load falls on every mode alike.
//! PostgreSQL follows (`postgres`), in rounds of its own.

use std::{
    fmt::Write as _,
    io::BufRead as _,
    net::TcpStream,
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _};

use super::Size;

pub const TITLE: &str = "## Real services";

/// The port the bench's redis-server listens on (loopback only).
const PORT: &str = "6389";

struct Mode {
    name: &'static str,
    how: How,
}

enum How {
    Untraced,
    /// `memprof attach` with these options, after the warm-up.
    Attached(&'static [&'static str]),
    /// `memprof attach` at its defaults, timed once `SETTLING_REQUESTS` have run traced: the
    /// switches it makes in its first seconds are behind it.
    AttachedSettled,
    /// `memprof attach` with these options on a process that sleeps, not on the server: what
    /// memprof's programs cost a process it does not trace.
    Elsewhere(&'static [&'static str]),
    /// `memprof daemon` at its defaults tracing the server, timed once it has moved it out of
    /// exact tracing (to growth mode, or sampling where that would slow every system call).
    Daemon,
    /// The server started under heaptrack.
    Heaptrack,
}

/// The port the bench's `memprof daemon` serves `/metrics` on.
const DAEMON_PORT: u16 = 19465;

/// Requests run traced before `How::AttachedSettled` is timed: more than its first two seconds
/// (traced by its calls, then sampled) take on this machine.
const SETTLING_REQUESTS: u64 = 300_000;

/// `attach` samples a process above 50,000 calls a second unless told `--max-rate off`, and
/// moves it on to growth mode when sampling still costs too much: its defaults have rows of their
/// own, and only `--max-rate off` is exact throughout.
const MODES: [Mode; 9] = [
    Mode { name: "none", how: How::Untraced },
    Mode { name: "memprof attach --max-rate off (exact)", how: How::Attached(&["--max-rate", "off"]) },
    Mode { name: "memprof attach (defaults)", how: How::Attached(&[]) },
    Mode { name: "memprof attach (defaults), timed after its first 300,000 SETs", how: How::AttachedSettled },
    Mode { name: "memprof attach --sample-bytes 524288", how: How::Attached(&["--sample-bytes", "524288"]) },
    Mode { name: "memprof attach --growth", how: How::Attached(&["--growth"]) },
    Mode { name: "memprof attach --growth on a sleeping process, not on redis", how: How::Elsewhere(&["--growth"]) },
    Mode { name: "memprof daemon (defaults), timed once it has moved redis out of exact tracing", how: How::Daemon },
    Mode { name: "heaptrack (LD_PRELOAD, restarted)", how: How::Heaptrack },
];

/// python3's modes: `memprof run` with these options, or none (untraced), or heaptrack.
const PYTHON_MODES: [(&str, Option<&[&str]>); 5] = [
    ("none", None),
    ("memprof run (exact)", Some(&[])),
    ("memprof run --sample-bytes 524288", Some(&["--sample-bytes", "524288"])),
    ("memprof run --growth", Some(&["--growth"])),
    ("heaptrack", None),
];

/// The dict's build, timed by python itself (memprof's start is not in it), written to argv[1].
const PYTHON_SCRIPT: &str = "import sys, time\n\
t = time.perf_counter()\n\
d = {str(i): str(i) * 3 for i in range(200000)}\n\
open(sys.argv[1], 'w').write(str(time.perf_counter() - t))\n";

pub struct Measured {
    /// SET requests a second, each mode's runs in order.
    runs: Vec<Vec<f64>>,
    /// What the daemon moved redis to in each of its runs: "growth mode" or "sampling".
    daemon_moves: Vec<&'static str>,
    /// python3's seconds, each mode's runs in order.
    python: Vec<Vec<f64>>,
    requests: u64,
    /// When, as `date -u` prints it.
    date: String,
    load_before: String,
    load_after: String,
    postgres: super::postgres::Measured,
}

/// Interleaved runs of every mode: A B C D A B C D ...
pub fn measure(memprof: &Path, dir: &Path, size: Size) -> anyhow::Result<Measured> {
    let requests = if size.quick { 20_000 } else { 200_000 };
    let date = Command::new("date").args(["-u", "+%Y-%m-%d %H:%M UTC"]).output()?;
    let date = String::from_utf8_lossy(&date.stdout).trim().to_string();
    let load_before = load_average();
    let mut runs = vec![Vec::new(); MODES.len()];
    let mut daemon_moves = Vec::new();
    let mut python = vec![Vec::new(); PYTHON_MODES.len()];
    for _ in 0..size.runs {
        for (mode, runs) in MODES.iter().zip(&mut runs) {
            let (rate, moved) =
                one_run(mode, memprof, dir, requests).with_context(|| format!("redis under {}", mode.name))?;
            daemon_moves.extend(moved);
            eprintln!("xtask bench: redis SET under {:<40} {rate:>9.0} requests/s", mode.name);
            runs.push(rate);
        }
        for (index, seconds) in python.iter_mut().enumerate() {
            let (name, _) = PYTHON_MODES[index];
            let took = python_run(index, memprof, dir).with_context(|| format!("python3 under {name}"))?;
            eprintln!("xtask bench: python3's dict under {name:<40} {took:>9.3} s");
            seconds.push(took);
        }
    }
    let load_after = load_average();
    let postgres = super::postgres::measure(memprof, dir, size)?;
    Ok(Measured { runs, daemon_moves, python, requests, date, load_before, load_after, postgres })
}

/// One run of python3's dict under `PYTHON_MODES[index]`: the build's seconds.
fn python_run(index: usize, memprof: &Path, dir: &Path) -> anyhow::Result<f64> {
    let script = dir.join("dict.py");
    std::fs::write(&script, PYTHON_SCRIPT)?;
    let out = dir.join("dict.seconds");
    let _ = std::fs::remove_file(&out);
    let python = ["/usr/bin/python3".to_string(), script.display().to_string(), out.display().to_string()];
    let mut command = match PYTHON_MODES[index] {
        ("heaptrack", _) => {
            let mut command = Command::new("heaptrack");
            command.args(["-o", &dir.join("heaptrack.python").display().to_string()]);
            command
        }
        (_, Some(options)) => {
            let mut command = Command::new(memprof);
            command.args(["run", "--interval", "60", "--output", "/dev/null"]).args(options).arg("--");
            command
        }
        // Untraced: `env` runs it as it is.
        _ => Command::new("env"),
    };
    let status = command.args(&python).stdout(Stdio::null()).stderr(Stdio::null()).status()?;
    read_seconds(status, &out)
}

fn read_seconds(status: std::process::ExitStatus, out: &Path) -> anyhow::Result<f64> {
    if !status.success() {
        bail!("exited with {status}");
    }
    let text = std::fs::read_to_string(out).with_context(|| format!("reading {}", out.display()))?;
    text.trim().parse().with_context(|| format!("python3 wrote `{text}`"))
}

pub(super) fn load_average() -> String {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    text.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
}

/// Kills the child when dropped: a failed run leaves no server behind.
pub(super) struct Killed(Child);

impl Killed {
    /// Stops a `memprof attach` or `memprof daemon` as Ctrl-C does; fails when it did not end well.
    pub(super) fn stop(mut self) -> anyhow::Result<()> {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGINT) };
        let status = self.0.wait()?;
        if !status.success() {
            bail!("memprof attach exited with {status}");
        }
        Ok(())
    }
}

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// SET requests a second under `mode`, and, under the daemon, what it moved redis to.
fn one_run(mode: &Mode, memprof: &Path, dir: &Path, requests: u64) -> anyhow::Result<(f64, Option<&'static str>)> {
    let mut server = match mode.how {
        How::Heaptrack => {
            let mut command = Command::new("heaptrack");
            command.args(["-o", &dir.join("heaptrack.redis").display().to_string(), "/usr/bin/redis-server"]);
            command
        }
        _ => Command::new("/usr/bin/redis-server"),
    };
    server.args(["--port", PORT, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]);
    let mut server =
        Killed(server.stdout(Stdio::null()).stderr(Stdio::null()).spawn().context("starting redis-server")?);
    wait_for_port()?;
    // The warm-up fills the server's tables and the allocator's caches before any tracing.
    benchmark(20_000)?;
    let sleeper = match mode.how {
        How::Elsewhere(_) => Some(Killed(Command::new("sleep").arg("3600").spawn().context("starting sleep")?)),
        _ => None,
    };
    let traced = match (&mode.how, &sleeper) {
        (How::Attached(options), _) => Some((server.0.id(), *options)),
        (How::AttachedSettled, _) => Some((server.0.id(), &[][..])),
        (How::Elsewhere(options), Some(sleeper)) => Some((sleeper.0.id(), *options)),
        _ => None,
    };
    let tracer = traced.map(|(pid, options)| attach(memprof, pid, Path::new("/dev/null"), options)).transpose()?;
    if let How::AttachedSettled = mode.how {
        benchmark(SETTLING_REQUESTS)?;
    }
    let (daemon, moved) = match mode.how {
        How::Daemon => {
            let (daemon, moved) = daemon_moved(memprof, server.0.id())?;
            (Some(daemon), Some(moved))
        }
        _ => (None, None),
    };
    let rate = benchmark(requests)?;
    if let Some(tracer) = tracer {
        tracer.stop()?;
    }
    if let Some(daemon) = daemon {
        daemon.stop()?;
    }
    // Asked to stop rather than killed: under heaptrack the server is a child of its script,
    // which a kill would leave running on the port.
    let _ = Command::new("redis-cli").args(["-p", PORT, "shutdown", "nosave"]).output();
    server.0.wait()?;
    Ok((rate, moved))
}

/// `memprof daemon` at its defaults tracing `pid`, returned once it has moved the server out of
/// exact tracing, with what it moved it to: SETs run meanwhile, as its rate guard needs calls to
/// count.
fn daemon_moved(memprof: &Path, pid: u32) -> anyhow::Result<(Killed, &'static str)> {
    let daemon = Command::new(memprof)
        .args(["daemon", "--pid", &pid.to_string(), "--listen", &format!("127.0.0.1:{DAEMON_PORT}"), "--socket", ""])
        .stderr(Stdio::null())
        .spawn()
        .context("starting memprof daemon")?;
    let daemon = Killed(daemon);
    super::daemon::wait_traced(DAEMON_PORT, &[pid])?;
    let set = |metrics: &str, series: &str| metrics.lines().any(|l| l.starts_with(series) && !l.ends_with(" 0"));
    for _ in 0..30 {
        benchmark(50_000)?;
        let metrics = super::daemon::http_get(DAEMON_PORT, "/metrics").unwrap_or_default();
        if set(&metrics, "memprof_growth_mode{") {
            return Ok((daemon, "growth mode"));
        }
        if set(&metrics, "memprof_sample_bytes{") {
            return Ok((daemon, "sampling"));
        }
    }
    bail!("memprof daemon did not move redis out of exact tracing within 1,500,000 SETs")
}

fn wait_for_port() -> anyhow::Result<()> {
    let start = Instant::now();
    while TcpStream::connect(format!("127.0.0.1:{PORT}")).is_err() {
        if start.elapsed() > Duration::from_secs(30) {
            bail!("redis-server did not listen on port {PORT} within 30 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// `memprof attach` on `pid` with `options`, its report written to `output`, once it says it
/// traces. Its interval is a minute unless `options` say: no report is read before the end.
pub(super) fn attach(memprof: &Path, pid: u32, output: &Path, options: &[&str]) -> anyhow::Result<Killed> {
    let interval: &[&str] = if options.contains(&"--interval") { &[] } else { &["--interval", "60"] };
    let mut tracer = Command::new(memprof)
        .args(["attach", "--pid", &pid.to_string(), "--output"])
        .arg(output)
        .args(interval)
        .args(options)
        .stderr(Stdio::piped())
        .spawn()
        .context("starting memprof attach")?;
    let mut stderr = std::io::BufReader::new(tracer.stderr.take().expect("piped"));
    let mut line = String::new();
    while !line.contains("tracing pid") {
        line.clear();
        if stderr.read_line(&mut line)? == 0 {
            bail!("memprof attach ended before tracing");
        }
    }
    // Its later lines are not read: a thread drains them so that it never blocks on a full pipe.
    std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
    Ok(Killed(tracer))
}

/// SET requests a second over `requests` requests of 100 bytes on 100,000 random keys.
fn benchmark(requests: u64) -> anyhow::Result<f64> {
    let output = Command::new("redis-benchmark")
        .args(["-p", PORT, "-t", "set", "-r", "100000", "-d", "100", "-q", "-n", &requests.to_string()])
        .output()
        .context("running redis-benchmark")?;
    let text = String::from_utf8_lossy(&output.stdout);
    // -q prints progress lines ending in \r, then "SET: N requests per second, p50=...".
    text.rsplit(['\r', '\n'])
        .filter_map(|line| line.strip_prefix("SET: "))
        .find_map(|rest| rest.split_whitespace().next()?.parse().ok())
        .with_context(|| format!("redis-benchmark printed no SET rate: {text}"))
}

pub(super) fn median(runs: &[f64]) -> f64 {
    let mut sorted = runs.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

pub fn render(measured: &Measured) -> String {
    let mut out = format!("{TITLE}\n\n");
    let _ = writeln!(
        out,
        "Debian's redis-server (jemalloc) under `redis-benchmark -t set -r 100000 -d 100 -n {}` (50 clients), \
         after a warm-up of 20,000 requests: untraced, with `memprof attach` started after the warm-up, and \
         restarted under heaptrack. `attach` at its defaults records every call for about a second, then \
         samples one allocation in every 64 KiB (its `--max-rate`); a second later, when sampling still costs \
         more than a tenth of a core, it traces the server by its pages (growth mode), unless that would slow \
         every system call on the host (a kernel that refuses `fexit` programs, as this VM's, and a server \
         whose wrappers of its mapping calls memprof cannot find; redis's are its C library's). \
         `--max-rate off` keeps it exact. Its defaults have two rows: timed from the attach, and timed after \
         {SETTLING_REQUESTS} SETs traced, its switches behind it. The modes' runs interleaved, {} rounds; the \
         median of each. Measured {}, load average {} before, {} after (2 cores shared with other work: \
         compare the ratios).\n",
        measured.requests,
        measured.runs[0].len(),
        measured.date,
        measured.load_before,
        measured.load_after,
    );
    out.push_str("| mode | SET requests/s (runs) | median | traced ÷ untraced |\n|---|---|---:|---:|\n");
    let untraced = median(&measured.runs[0]);
    for (mode, runs) in MODES.iter().zip(&measured.runs) {
        let list: Vec<String> = runs.iter().map(|r| format!("{r:.0}")).collect();
        let median = median(runs);
        let _ = writeln!(out, "| {} | {} | {median:.0} | {:.2} |", mode.name, list.join(", "), median / untraced);
    }
    let median_of = |wanted: fn(&How) -> bool| {
        let at = MODES.iter().position(|mode| wanted(&mode.how)).expect("a mode of each kind");
        median(&measured.runs[at])
    };
    let growth = median_of(|how| matches!(how, How::Attached(["--growth"])))
        / median_of(|how| matches!(how, How::Elsewhere(["--growth"])));
    let _ = writeln!(
        out,
        "\nThe row on a sleeping process is what memprof costs a process it does not trace while growth mode is \
         on: its programs at every page fault on the machine and, on a kernel that takes `fexit` programs, at \
         the five mapping calls. On a kernel that refuses them, as this VM's, the mapping calls are read by \
         probes in the traced process's own C library, which no other process runs (the docs' limits, \
         \"Mappings\"). Growth mode on redis ran {growth:.2} times as many SETs a second as that row: what it \
         costs redis beyond that is its own."
    );
    let _ = writeln!(
        out,
        "\nThe daemon's row: `memprof daemon --pid PID` at its defaults (5 s interval, `max_rate` 50,000), \
         started after the warm-up, SETs run in batches of 50,000 until its metrics said it had moved redis out \
         of exact tracing, then timed. It moves a busy process to growth mode, or samples it where that would \
         slow every system call on the host (a kernel that refuses `fexit` programs, and a process whose wrappers \
         of its mapping calls memprof cannot find). It moved redis to: \
         {} (each run in order).",
        measured.daemon_moves.join(", ")
    );
    out.push_str(
        "\nDebian's python3 building a dict of 200,000 strings (`{str(i): str(i) * 3 ...}`), timed by \
         python itself (memprof's start and report are not in it), in the same rounds.\n\n",
    );
    out.push_str("| mode | seconds (runs) | median | untraced ÷ traced |\n|---|---|---:|---:|\n");
    let untraced = median(&measured.python[0]);
    for ((name, _), runs) in PYTHON_MODES.iter().zip(&measured.python) {
        let list: Vec<String> = runs.iter().map(|r| format!("{r:.3}")).collect();
        let median = median(runs);
        let _ = writeln!(out, "| {name} | {} | {median:.3} | {:.2} |", list.join(", "), untraced / median);
    }
    out.push_str(&super::postgres::render(&measured.postgres));
    out
}
