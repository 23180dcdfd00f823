//! The daemon's own cost: 10 processes that replace 5,000 blocks a second each (50,000
//! allocations a second together) while holding 1,000,000 blocks, traced by `memprof daemon` for
//! a minute: its CPU time and resident memory.

use std::{
    fmt::Write as _,
    io::Write as _,
    io::{BufRead as _, BufReader},
    path::Path,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::Context as _;

use super::Size;
use crate::root;

/// The section's title line in BENCHMARKS.md.
pub(super) const TITLE: &str = "## The daemon's own cost";

const PROCESSES: usize = 10;
const HELD_EACH: u64 = 100_000;
const REPLACED_PER_SECOND_EACH: u64 = 5_000;

pub(super) struct DaemonCost {
    settling_s: u64,
    seconds: f64,
    /// CPU time of the daemon over the measurement, as a share of one core.
    cpu_share: f64,
    max_rss_kib: u64,
    live: u64,
}

pub(super) fn measure(memprof: &Path, dir: &Path, size: Size) -> anyhow::Result<DaemonCost> {
    let holder = dir.join("holder");
    crate::compile_c(&root().join("bench/holder.c"), &holder, &["-O2"])?;
    let mut holders: Vec<Child> = Vec::new();
    for _ in 0..PROCESSES {
        holders.push(start_holder(&holder, HELD_EACH, REPLACED_PER_SECOND_EACH)?);
    }
    let result = trace(memprof, &mut holders, size);
    for mut child in holders {
        stop(&mut child);
    }
    result
}

/// Starts bench/holder.c (compiled at `holder`) and waits until it is ready: it allocates
/// nothing until `release` tells it to go, so that a tracer can attach before its first block.
pub fn start_holder(holder: &Path, held: u64, replaced_per_second: u64) -> anyhow::Result<Child> {
    let mut child = Command::new(holder)
        .args([held.to_string(), replaced_per_second.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the holder")?;
    let mut ready = String::new();
    BufReader::new(child.stdout.as_mut().expect("piped")).read_line(&mut ready)?;
    Ok(child)
}

/// Lets a holder started by `start_holder` begin allocating.
pub fn release(holder: &mut Child) -> anyhow::Result<()> {
    writeln!(holder.stdin.as_mut().expect("piped"), "go").context("releasing the holder")
}

pub fn stop(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Waits until the daemon at `port` traces every process in `pids` (its `/metrics`, which the
/// port serves anyone; the API is root's, on the daemon's socket).
pub fn wait_traced(port: u16, pids: &[u32]) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let body = http_get(port, "/metrics").unwrap_or_default();
        let attached: Vec<&str> = body.lines().filter(|line| line.starts_with("memprof_target_attached{")).collect();
        // The `pid` label, not `ns_pid`, whatever the labels' order.
        let has_pid =
            |line: &str, pid: &u32| ["{", ","].iter().any(|before| line.contains(&format!("{before}pid=\"{pid}\"")));
        if pids.iter().all(|pid| attached.iter().any(|line| has_pid(line, pid))) {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "the daemon did not trace {pids:?} within a minute");
        thread::sleep(Duration::from_millis(200));
    }
}

/// Traces the holders from before their first block, lets them settle, then measures.
fn trace(memprof: &Path, holders: &mut [Child], size: Size) -> anyhow::Result<DaemonCost> {
    let port = 19464;
    let mut args =
        vec!["daemon".to_string(), "--listen".into(), format!("127.0.0.1:{port}"), "--socket".into(), String::new()];
    for child in holders.iter() {
        args.extend(["--pid".to_string(), child.id().to_string()]);
    }
    let mut daemon = Command::new(memprof).args(&args).stderr(Stdio::null()).spawn().context("starting the daemon")?;
    // Stopped on every path, an error's included.
    let cost = measure_traced(&daemon, port, holders, size);
    stop(&mut daemon);
    cost
}

/// `trace`'s measurement of the running `daemon`, serving `/metrics` on `port`.
fn measure_traced(daemon: &Child, port: u16, holders: &mut [Child], size: Size) -> anyhow::Result<DaemonCost> {
    let pids: Vec<u32> = holders.iter().map(Child::id).collect();
    wait_traced(port, &pids)?;
    for child in holders.iter_mut() {
        release(child)?;
    }
    let warm_up = Duration::from_secs(if size.quick { 5 } else { 20 });
    let measured = Duration::from_secs(if size.quick { 10 } else { 60 });
    thread::sleep(warm_up);
    let (cpu_before, _) = cpu_and_rss(daemon.id())?;
    let start = Instant::now();
    let mut max_rss_kib = 0;
    while start.elapsed() < measured {
        thread::sleep(Duration::from_secs(1));
        max_rss_kib = max_rss_kib.max(cpu_and_rss(daemon.id())?.1);
    }
    let (cpu_after, _) = cpu_and_rss(daemon.id())?;
    let seconds = start.elapsed().as_secs_f64();
    let live = live_allocations(port).unwrap_or(0);
    Ok(DaemonCost {
        settling_s: warm_up.as_secs(),
        seconds,
        cpu_share: (cpu_after - cpu_before) / seconds,
        max_rss_kib,
        live,
    })
}

/// CPU seconds used so far (user + system) and resident KiB of `pid`.
pub fn cpu_and_rss(pid: u32) -> anyhow::Result<(f64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name, which may hold spaces, closed by the last ')'.
    let fields: Vec<&str> = stat.rsplit_once(')').context("malformed stat")?.1.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>()? + fields[12].parse::<f64>()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    Ok((ticks / hz, rss))
}

/// Outstanding allocations of all targets, from the daemon's metrics.
fn live_allocations(port: u16) -> Option<u64> {
    let body = http_get(port, "/metrics")?;
    let counts = body.lines().filter(|line| line.starts_with("memprof_heap_inuse_objects{"));
    Some(counts.filter_map(|line| line.rsplit_once(' ')?.1.parse::<u64>().ok()).sum())
}

pub fn http_get(port: u16, path: &str) -> Option<String> {
    use std::io::{Read as _, Write as _};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    Some(response.split_once("\r\n\r\n")?.1.to_string())
}

pub(super) fn render(cost: &DaemonCost) -> String {
    let mut out = format!("\n{TITLE}\n\n");
    let _ = writeln!(
        out,
        "`memprof daemon` (default settings, 5 s interval) tracing {PROCESSES} processes that each hold \
         {HELD_EACH} blocks and replace {REPLACED_PER_SECOND_EACH} of them a second ({} allocations and as many \
         frees a second together), attached before their first block and measured for {:.0} s after {} s \
         of settling; {} allocations outstanding at the end.\n",
        PROCESSES as u64 * REPLACED_PER_SECOND_EACH,
        cost.seconds,
        cost.settling_s,
        cost.live,
    );
    out.push_str("| what | measured | target |\n|---|---:|---:|\n");
    let _ = writeln!(out, "| CPU, share of one core | {:.2}% | 2% |", cost.cpu_share * 100.0);
    let _ = writeln!(out, "| resident memory, peak | {:.1} MiB | 64 MiB |", cost.max_rss_kib as f64 / 1024.0);
    out
}
