//! `cargo xtask soak --minutes N`: `memprof daemon` tracing churning processes for N minutes, one
//! of them restarted every few seconds (so targets are attached and purged all along), with
//! /metrics scraped every second. It samples the daemon's resident memory, its open descriptors
//! and the BPF maps' entries, says whether they stayed flat, and writes `## Soak` in BENCHMARKS.md.

use std::{
    fmt::Write as _,
    path::Path,
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicBool, AtomicU64, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _};

use crate::{
    bench::daemon::{cpu_and_rss, http_get, release, start_holder, stop, wait_traced},
    build_memprof, root,
};

const PORT: u16 = 19465;
/// Long-lived processes: blocks held and replaced a second, each.
const STEADY: usize = 3;
const STEADY_HELD: u64 = 20_000;
const STEADY_RATE: u64 = 1_000;
/// The restarted process: killed and started again every `RESTART_EVERY`, which is not a multiple
/// of the daemon's 5 s interval, so that its snapshots catch the process in every phase.
const RESTARTED_HELD: u64 = 5_000;
const RESTARTED_RATE: u64 = 2_000;
const RESTART_EVERY: Duration = Duration::from_secs(7);
/// Samples before this are start-up, not compared.
const SETTLING: Duration = Duration::from_secs(60);
/// The last quarter's mean may exceed the first's by this share plus the measure's own slack.
const TOLERANCE: f64 = 0.10;

/// One second's sample.
#[derive(Default)]
struct Sample {
    rss_kib: u64,
    fds: u64,
    /// `memprof_bpf_map_entries` by map, as scraped.
    maps: Vec<(String, u64)>,
    targets: u64,
}

pub fn run(args: &[String]) -> anyhow::Result<()> {
    let minutes: u64 = match args {
        [flag, n] if flag == "--minutes" => n.parse().context("--minutes takes a whole number of minutes")?,
        _ => bail!("usage: cargo xtask soak --minutes N"),
    };
    anyhow::ensure!(minutes >= 4, "--minutes must be at least 4 (one settling minute, then quarters to compare)");
    let memprof = build_memprof()?;
    let dir = root().join("target/soak");
    std::fs::create_dir_all(&dir)?;
    // Named so that the daemon's `--comm` rule finds them, and nothing else.
    let (steady, restarted) = (dir.join("soak_steady"), dir.join("soak_restart"));
    crate::compile_c(&root().join("bench/holder.c"), &steady, &["-O2"])?;
    // A new file, not overwritten in place: a leftover from an interrupted soak may still run it.
    let _ = std::fs::remove_file(&restarted);
    std::fs::copy(&steady, &restarted)?;

    let mut daemon = Command::new(&memprof)
        .args(["daemon", "--listen", &format!("127.0.0.1:{PORT}"), "--socket", "", "--comm", "^soak_"])
        .stderr(std::fs::File::create(dir.join("daemon.log"))?)
        .stdout(Stdio::null())
        .spawn()
        .context("starting the daemon")?;
    let mut holders = Vec::new();
    let result = (|| {
        for _ in 0..STEADY {
            holders.push(start_holder(&steady, STEADY_HELD, STEADY_RATE)?);
        }
        wait_traced(PORT, &holders.iter().map(Child::id).collect::<Vec<_>>())?;
        for holder in &mut holders {
            release(holder)?;
        }
        soak(&daemon, &restarted, &dir.join("samples.tsv"), Duration::from_secs(minutes * 60))
    })();
    for holder in &mut holders {
        stop(holder);
    }
    // SIGTERM, as systemd stops it: the daemon must still detach and exit cleanly after the soak.
    // SAFETY: kill has no memory-safety preconditions; the pid is our child's.
    unsafe { libc::kill(daemon.id() as i32, libc::SIGTERM) };
    let exit = daemon.wait()?;
    let (samples, restarts, scrape_failures) = result?;
    let report = render(minutes, &samples, restarts, scrape_failures, exit.success());
    println!("{report}");
    crate::benchmarks::write_section(&root().join("BENCHMARKS.md"), "## Soak", &report)?;
    eprintln!("xtask soak: written to BENCHMARKS.md (the daemon's log: {})", dir.join("daemon.log").display());
    Ok(())
}

/// Samples the daemon every second for `length` while another thread restarts a target.
fn soak(daemon: &Child, restarted: &Path, log: &Path, length: Duration) -> anyhow::Result<(Vec<Sample>, u64, u64)> {
    let done = AtomicBool::new(false);
    let restarts = AtomicU64::new(0);
    thread::scope(|scope| {
        let restarter = scope.spawn(|| restart_loop(restarted, &done, &restarts));
        let sampled = sample_loop(daemon.id(), log, length);
        done.store(true, Ordering::Relaxed);
        let restarted = restarter.join().expect("the restarting thread does not panic");
        let (samples, failures) = sampled?;
        restarted?;
        Ok((samples, restarts.load(Ordering::Relaxed), failures))
    })
}

/// Starts the restarted target, lets it churn once traced, kills it; again until `done`.
fn restart_loop(program: &Path, done: &AtomicBool, restarts: &AtomicU64) -> anyhow::Result<()> {
    while !done.load(Ordering::Relaxed) {
        let mut child = start_holder(program, RESTARTED_HELD, RESTARTED_RATE)?;
        let traced = wait_traced(PORT, &[child.id()]).and_then(|()| release(&mut child));
        if traced.is_ok() {
            thread::sleep(RESTART_EVERY);
        }
        stop(&mut child);
        traced?;
        restarts.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// One sample a second for `length`, each also a line in `log`; also returns how many scrapes failed.
fn sample_loop(pid: u32, log: &Path, length: Duration) -> anyhow::Result<(Vec<Sample>, u64)> {
    use std::io::Write as _;
    let mut log = std::fs::File::create(log)?;
    let start = Instant::now();
    let mut samples = Vec::new();
    let mut failures = 0;
    let mut next = start;
    while start.elapsed() < length {
        next += Duration::from_secs(1);
        thread::sleep(next.saturating_duration_since(Instant::now()));
        let Some(metrics) = http_get(PORT, "/metrics") else {
            failures += 1;
            continue;
        };
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).context("the daemon exited")?.count() as u64;
        let maps = metrics
            .lines()
            .filter_map(|line| {
                let rest = line.strip_prefix("memprof_bpf_map_entries{map=\"")?;
                let (name, value) = rest.split_once("\"} ")?;
                Some((name.to_string(), value.trim().parse().ok()?))
            })
            .collect();
        let targets = metrics.lines().filter(|l| l.starts_with("memprof_target_attached{")).count() as u64;
        let sample = Sample { rss_kib: cpu_and_rss(pid)?.1, fds, maps, targets };
        writeln!(log, "{}\t{}\t{}\t{}\t{:?}", samples.len(), sample.rss_kib, sample.fds, sample.targets, sample.maps)?;
        samples.push(sample);
        if samples.len().is_multiple_of(60) {
            eprintln!("xtask soak: {} of {} min", samples.len() / 60, length.as_secs() / 60);
        }
    }
    Ok((samples, failures))
}

/// A measure over the run: its means over the first and last quarters after settling.
struct Trend {
    what: String,
    first: f64,
    last: f64,
    max: u64,
    slack: f64,
}

impl Trend {
    fn of(what: String, values: &[u64], slack: f64) -> Self {
        let quarter = (values.len() / 4).max(1);
        let mean = |v: &[u64]| v.iter().sum::<u64>() as f64 / v.len().max(1) as f64;
        Trend {
            what,
            first: mean(&values[..quarter.min(values.len())]),
            last: mean(&values[values.len().saturating_sub(quarter)..]),
            max: values.iter().copied().max().unwrap_or(0),
            slack,
        }
    }

    fn flat(&self) -> bool {
        self.last <= self.first * (1.0 + TOLERANCE) + self.slack
    }
}

fn trends(samples: &[Sample]) -> Vec<Trend> {
    let settled = &samples[(SETTLING.as_secs() as usize).min(samples.len())..];
    let series = |f: &dyn Fn(&Sample) -> u64| settled.iter().map(f).collect::<Vec<_>>();
    let mut out = vec![
        Trend::of("resident memory (KiB)".into(), &series(&|s| s.rss_kib), 1024.0),
        Trend::of("open descriptors".into(), &series(&|s| s.fds), 4.0),
        Trend::of("traced processes".into(), &series(&|s| s.targets), 1.0),
    ];
    let names: Vec<String> =
        settled.last().map(|s| s.maps.iter().map(|(n, _)| n.clone()).collect()).unwrap_or_default();
    for name in names {
        let entries = series(&|s| s.maps.iter().find(|(n, _)| *n == name).map_or(0, |(_, v)| *v));
        out.push(Trend::of(format!("BPF map `{name}`, entries"), &entries, 64.0));
    }
    out
}

fn render(minutes: u64, samples: &[Sample], restarts: u64, scrape_failures: u64, clean_exit: bool) -> String {
    let trends = trends(samples);
    let flat = trends.iter().all(Trend::flat);
    let mut out = String::from("## Soak\n\n");
    let _ = writeln!(
        out,
        "Written by `cargo xtask soak --minutes {minutes}`: `memprof daemon` (default settings, `--comm ^soak_`) \
         tracing {STEADY} processes that each hold {STEADY_HELD} blocks and replace {STEADY_RATE} a second \
         (bench/holder.c), and one more holding {RESTARTED_HELD} and replacing {RESTARTED_RATE} a second that is \
         killed and started again every {} s ({restarts} restarts: each attached, then detached and purged). \
         /metrics was scraped every second ({} samples, {scrape_failures} failed scrapes). Flat means the last \
         quarter's mean is at most the first quarter's plus {:.0}% and a small slack (1 MiB, 4 descriptors, \
         1 process, 64 map entries), after {} s of settling. After the soak the daemon {}.\n",
        RESTART_EVERY.as_secs(),
        samples.len(),
        TOLERANCE * 100.0,
        SETTLING.as_secs(),
        if clean_exit { "exited 0 on SIGTERM" } else { "did NOT exit cleanly on SIGTERM" },
    );
    out.push_str("| measure | first quarter, mean | last quarter, mean | max | flat |\n|---|---:|---:|---:|---|\n");
    for t in &trends {
        let _ = writeln!(
            out,
            "| {} | {:.1} | {:.1} | {} | {} |",
            t.what,
            t.first,
            t.last,
            t.max,
            if t.flat() { "yes" } else { "**no**" }
        );
    }
    let _ =
        writeln!(out, "\nVerdict: {}.", if flat && clean_exit { "flat" } else { "NOT flat: see the rows marked no" });
    out
}
