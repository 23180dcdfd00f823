//! The daemon at rest (issue 28): `memprof daemon --comm` at its defaults tracing (a) 1,000 idle
//! processes, each blocked before its first allocation, and (b) one process holding 65,536
//! distinct deep stacks (tests/fixtures/many_stacks.c, about 122 frames each, every call recorded
//! as in the `daemon_bounds` test); its CPU time while its targets settle (the daemon stops
//! reading targets still for a leak window), then once they have: its CPU time, resident memory
//! and its slowest `/metrics` answer; in (b), also while 30 reports are asked for at once (issue
//! 28's bound: a scrape within a second meanwhile).

use std::{
    fmt::Write as _,
    io::{BufRead as _, BufReader, Read as _, Write as _},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::Context as _;

use super::{
    daemon::{cpu_and_rss, http_get, stop},
    Size,
};
use crate::root;

/// The section's title line in BENCHMARKS.md.
pub(super) const TITLE: &str = "## The daemon at rest";

const IDLE_PROCESSES: usize = 1_000;
const STACKS: u64 = 65_536;
/// Reports asked for at once in (b), as the `daemon_bounds` test does.
const REPORTS: usize = 30;

pub(super) struct AtRest {
    case: String,
    target: &'static str,
    settling_s: u64,
    /// The CPU share while the targets settled.
    settling_cpu_share: f64,
    seconds: f64,
    cpu_share: f64,
    rss_kib: u64,
    slowest_scrape_s: f64,
    /// (b): the slowest `/metrics` answer while `REPORTS` reports were built.
    slowest_scrape_under_reports_s: Option<f64>,
    load: (String, String),
}

pub(super) fn measure(memprof: &Path, dir: &Path, size: Size) -> anyhow::Result<Vec<AtRest>> {
    Ok(vec![idle(memprof, dir, size)?, stacks(memprof, dir, size)?])
}

/// Compiles the test fixture `name` under the name `as_name` (the daemon's rule matches it).
fn fixture(dir: &Path, name: &str, as_name: &str) -> anyhow::Result<PathBuf> {
    let out = dir.join(as_name);
    let source = root().join(format!("tests/fixtures/{name}.c"));
    crate::compile_c(&source, &out, &["-g", "-O0", "-fno-omit-frame-pointer", "-pthread"])?;
    Ok(out)
}

/// Starts a fixture with `--wait`: it says "ready" and allocates nothing until told to go.
fn start_waiting(program: &Path) -> anyhow::Result<Child> {
    let mut child = Command::new(program)
        .arg("--wait")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", program.display()))?;
    let mut ready = String::new();
    BufReader::new(child.stdout.as_mut().expect("piped")).read_line(&mut ready)?;
    Ok(child)
}

fn idle(memprof: &Path, dir: &Path, size: Size) -> anyhow::Result<AtRest> {
    let program = fixture(dir, "daemon_target", "rest_idle")?;
    let mut children = Vec::new();
    let result = (|| {
        for _ in 0..IDLE_PROCESSES {
            children.push(start_waiting(&program)?);
        }
        let daemon = Daemon::start(memprof, dir, "^rest_idle$", &[])?;
        daemon.wait_for(|metrics| objects(metrics).len() >= IDLE_PROCESSES)?;
        let measured = daemon.at_rest(size);
        let case = "(a) 1,000 idle traced processes".to_string();
        measured.map(|m| AtRest { case, target: "2% of a core", ..m })
    })();
    for child in &mut children {
        stop(child);
    }
    result
}

fn stacks(memprof: &Path, dir: &Path, size: Size) -> anyhow::Result<AtRest> {
    let program = fixture(dir, "many_stacks", "rest_stacks")?;
    let mut child = start_waiting(&program)?;
    let result = (|| {
        let daemon = Daemon::start(memprof, dir, "^rest_stacks$", &["--max-rate", "1000000000"])?;
        daemon.wait_for(|metrics| !objects(metrics).is_empty())?;
        writeln!(child.stdin.as_mut().expect("piped"), "go")?;
        daemon.wait_for(|metrics| objects(metrics) == [STACKS])?;
        let held = daemon.at_rest(size)?;
        let under_reports = daemon.slowest_scrape_under_reports(child.id())?;
        let case = "(b) one process holding 65,536 stacks".to_string();
        Ok(AtRest {
            case,
            target: "5% of a core, 256 MiB, 1 s",
            slowest_scrape_under_reports_s: Some(under_reports),
            ..held
        })
    })();
    stop(&mut child);
    result
}

/// The targets' in-use objects, from the daemon's metrics.
fn objects(metrics: &str) -> Vec<u64> {
    let lines = metrics.lines().filter(|line| line.starts_with("memprof_heap_inuse_objects{"));
    lines.filter_map(|line| line.rsplit_once(' ')?.1.parse().ok()).collect()
}

struct Daemon {
    child: Child,
    port: u16,
    /// Its socket, where root asks for reports.
    socket: PathBuf,
}

impl Daemon {
    fn start(memprof: &Path, dir: &Path, comm: &str, extra: &[&str]) -> anyhow::Result<Self> {
        let port = 19465;
        let listen = format!("127.0.0.1:{port}");
        let socket = dir.join("rest.sock");
        let child = Command::new(memprof)
            .args(["daemon", "--comm", comm, "--listen", &listen, "--socket"])
            .arg(&socket)
            .args(extra)
            .stderr(Stdio::null())
            .spawn()
            .context("starting the daemon")?;
        Ok(Self { child, port, socket })
    }

    fn wait_for(&self, done: impl Fn(&str) -> bool) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(300);
        while !done(&http_get(self.port, "/metrics").unwrap_or_default()) {
            anyhow::ensure!(Instant::now() < deadline, "the daemon did not get there within 5 minutes");
            thread::sleep(Duration::from_millis(500));
        }
        Ok(())
    }

    /// Settles, then measures over whole intervals, scraping `/metrics` every 5 s.
    fn at_rest(&self, size: Size) -> anyhow::Result<AtRest> {
        // A leak window and two intervals at the defaults (see the daemon's `settled`), and 5 s.
        let settling = Duration::from_secs(if size.quick { 5 } else { 45 });
        let scrapes = if size.quick { 2 } else { 12 };
        let (cpu_settling, _) = cpu_and_rss(self.child.id())?;
        thread::sleep(settling);
        let load_before = load();
        let (cpu_before, _) = cpu_and_rss(self.child.id())?;
        let settling_cpu_share = (cpu_before - cpu_settling) / settling.as_secs_f64();
        let start = Instant::now();
        let mut slowest_scrape_s: f64 = 0.0;
        for _ in 0..scrapes {
            let asked = Instant::now();
            http_get(self.port, "/metrics").context("scraping the daemon")?;
            slowest_scrape_s = slowest_scrape_s.max(asked.elapsed().as_secs_f64());
            thread::sleep(Duration::from_secs(5));
        }
        let (cpu_after, rss_kib) = cpu_and_rss(self.child.id())?;
        let seconds = start.elapsed().as_secs_f64();
        Ok(AtRest {
            case: String::new(),
            target: "",
            settling_s: settling.as_secs(),
            settling_cpu_share,
            seconds,
            cpu_share: (cpu_after - cpu_before) / seconds,
            rss_kib,
            slowest_scrape_s,
            slowest_scrape_under_reports_s: None,
            load: (load_before, load()),
        })
    }

    /// Asks for `REPORTS` reports of `pid` at once over the socket, scraping `/metrics` every
    /// 100 ms until all are answered (10 scrapes at least): the slowest scrape, in seconds.
    fn slowest_scrape_under_reports(&self, pid: u32) -> anyhow::Result<f64> {
        let path = format!("/report?pid={pid}");
        let reports: Vec<_> = (0..REPORTS)
            .map(|_| {
                let (socket, path) = (self.socket.clone(), path.clone());
                thread::spawn(move || socket_get(&socket, &path))
            })
            .collect();
        let mut slowest: f64 = 0.0;
        let mut scrapes = 0;
        while scrapes < 10 || reports.iter().any(|report| !report.is_finished()) {
            let asked = Instant::now();
            http_get(self.port, "/metrics").context("scraping the daemon while it builds reports")?;
            slowest = slowest.max(asked.elapsed().as_secs_f64());
            scrapes += 1;
            thread::sleep(Duration::from_millis(100));
        }
        for report in reports {
            report.join().expect("a report's thread")?;
        }
        Ok(slowest)
    }
}

/// `GET path` over the daemon's socket, read to the end; fails unless answered 200.
fn socket_get(socket: &Path, path: &str) -> anyhow::Result<()> {
    let mut stream = UnixStream::connect(socket).with_context(|| format!("connecting to {}", socket.display()))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer)?;
    let head = String::from_utf8_lossy(&answer[..answer.len().min(20)]).into_owned();
    anyhow::ensure!(head.split_whitespace().nth(1) == Some("200"), "{path} answered {head:?}");
    Ok(())
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // SIGTERM: the daemon detaches its probes before it exits.
        // SAFETY: kill has no memory preconditions; the pid is our child's, not yet waited for.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

/// The one-minute load average.
fn load() -> String {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    text.split_whitespace().next().unwrap_or("?").to_string()
}

pub(super) fn render(rows: &[AtRest]) -> String {
    let mut out = format!("\n{TITLE}\n\n");
    let _ = writeln!(
        out,
        "`memprof daemon --comm REGEX` at its defaults (5 s interval, 60 s resync): (a) idle processes \
         blocked before their first allocation (tests/fixtures/daemon_target.c), (b) one process holding \
         65,536 distinct stacks of about 122 frames (tests/fixtures/many_stacks.c, with `--max-rate \
         1000000000` so that every call is recorded). Once the targets are traced, the daemon's CPU over \
         {} s while they settle (it stops reading a target still for a leak window and two intervals: \
         40 s at the defaults), then over {:.0} s at rest: its CPU, its resident memory at the end and \
         its slowest `/metrics` answer (scraped every 5 s); in (b), then, its slowest `/metrics` \
         answer (scraped every 100 ms) while {REPORTS} reports of the process are asked for at once \
         over its socket; the machine's one-minute load average before and after.\n",
        rows.first().map_or(0, |r| r.settling_s),
        rows.first().map_or(0.0, |r| r.seconds),
    );
    out.push_str(
        "| case | CPU while settling | CPU at rest, share of one core | resident memory | slowest `/metrics` \
         | slowest `/metrics` during 30 reports | load | target |\n",
    );
    out.push_str("|---|---:|---:|---:|---:|---:|---:|---|\n");
    for row in rows {
        let _ = writeln!(
            out,
            "| {} | {:.2}% | {:.2}% | {:.0} MiB | {:.3} s | {} | {} to {} | {} |",
            row.case,
            row.settling_cpu_share * 100.0,
            row.cpu_share * 100.0,
            row.rss_kib as f64 / 1024.0,
            row.slowest_scrape_s,
            row.slowest_scrape_under_reports_s.map_or("-".to_string(), |s| format!("{s:.3} s")),
            row.load.0,
            row.load.1,
            row.target,
        );
    }
    out
}
