//! `cargo xtask pause`: how long `memprof run --inspect` holds a process still against the size of
//! its live heap, with the memory copied in the stop and with the soft-dirty pre-copy, idle and
//! while a thread writes; writes `## The pause of `--inspect`` in BENCHMARKS.md.

use std::{
    fmt::Write as _,
    io::Read as _,
    path::Path,
    process::{Command, Stdio},
};

use anyhow::{bail, Context as _};
use serde_json::Value;

use crate::{build_memprof, root};

pub const TITLE: &str = "## The pause of `--inspect`";

/// Live heaps (MiB), and blocks the workload's writer thread rewrites a millisecond.
const CASES: [(u64, u64); 5] = [(16, 0), (64, 0), (256, 0), (1024, 0), (1024, 100)];
/// Runs per case and method; the row is the one with the median pause.
const RUNS: usize = 3;

/// One inspection, as its report says.
struct Run {
    blocks: u64,
    method: String,
    live_read_in_pause: bool,
    pause_ms: f64,
    copied_in_pause: u64,
    stages: Value,
}

pub fn run() -> anyhow::Result<()> {
    let memprof = build_memprof()?;
    let dir = root().join("target/pause");
    std::fs::create_dir_all(&dir)?;
    let heapbench = dir.join("heapbench");
    crate::compile_c(&root().join("bench/heapbench.c"), &heapbench, &["-O2", "-pthread"])?;
    let load_before = load_average()?;
    let mut rows = Vec::new();
    for (mib, writes) in CASES {
        for precopy in ["never", "always", "write-protect"] {
            let mut runs = (0..RUNS)
                .map(|_| inspect(&memprof, &heapbench, mib, writes, precopy))
                .collect::<anyhow::Result<Vec<Run>>>()?;
            runs.sort_by(|a, b| a.pause_ms.total_cmp(&b.pause_ms));
            let median = runs.swap_remove(RUNS / 2);
            eprintln!("xtask pause: {mib} MiB, {writes} writes/ms, {}: {:.1} ms", median.method, median.pause_ms);
            rows.push((mib, writes, median));
        }
    }
    let report = render(&rows, &load_before, &load_average()?, &kernel()?);
    println!("{report}");
    crate::benchmarks::write_section(&root().join("BENCHMARKS.md"), TITLE, &report)?;
    eprintln!("xtask pause: written to BENCHMARKS.md");
    Ok(())
}

/// `memprof run --inspect` on heapbench once; the blocks it classed and its inspection.
fn inspect(memprof: &Path, heapbench: &Path, mib: u64, writes: u64, precopy: &str) -> anyhow::Result<Run> {
    // Long enough for heapbench to build its heap under the probes first.
    let duration = (3 + mib / 64).to_string();
    let mut child = Command::new(memprof)
        .args(["run", "--json", "--inspect", "--inspect-precopy", precopy, "--duration", &duration])
        .args(["--interval", &duration, "--"])
        .arg(heapbench)
        .args([mib.to_string(), writes.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("starting memprof")?;
    let stdin = child.stdin.take().expect("piped");
    // heapbench holds the pipe until its stdin closes: read as it comes, in a thread.
    let mut out = child.stdout.take().expect("piped");
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        out.read_to_string(&mut text).map(|_| text)
    });
    let status = child.wait()?;
    drop(stdin);
    let text = reader.join().expect("the reader does not panic")?;
    if !status.success() {
        bail!("memprof run --inspect on heapbench {mib} failed ({status})");
    }
    let report: Value = text
        .lines()
        .rfind(|l| l.starts_with('{'))
        .context("no report from memprof")
        .and_then(|line| Ok(serde_json::from_str(line)?))?;
    let inspection = &report["inspection"];
    let blocks = inspection["totals"]["reachable_blocks"].as_u64().context("no inspection in the report")?;
    if blocks < mib * 256 {
        bail!("heapbench {mib} had made {blocks} blocks by --duration {duration}: not built yet, raise it");
    }
    Ok(Run {
        blocks,
        method: inspection["method"].as_str().unwrap_or_default().to_string(),
        live_read_in_pause: inspection["live_read_in_pause"].as_bool().unwrap_or_default(),
        pause_ms: inspection["pause_ms"].as_f64().unwrap_or_default(),
        copied_in_pause: inspection["bytes_copied_in_pause"].as_u64().unwrap_or_default(),
        stages: inspection["stages"].clone(),
    })
}

fn load_average() -> anyhow::Result<String> {
    let text = std::fs::read_to_string("/proc/loadavg")?;
    Ok(text.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}

/// The kernel's release.
fn kernel() -> anyhow::Result<String> {
    Ok(std::fs::read_to_string("/proc/sys/kernel/osrelease")?.trim().to_string())
}

fn render(rows: &[(u64, u64, Run)], load_before: &str, load_after: &str, kernel: &str) -> String {
    let mut out = format!("{TITLE}\n\n");
    let _ = writeln!(
        out,
        "Written by `cargo xtask pause`: `memprof run --inspect --inspect-precopy never|always|write-protect --duration S -- heapbench MiB WRITES` \
         (bench/heapbench.c, `-O2`): a list of 4 KiB blocks holding MiB in all, filled with small numbers, reachable from a global; \
         with WRITES, a thread rewrites one word of WRITES random blocks every millisecond meanwhile. Each row is the median of {RUNS} \
         runs by pause. `never` copies the process's writable memory (the pages in memory) while it is held still \
         (`single_stop`); `always` (what the default, `auto`, does above 16 MiB) copies it first while it runs and, in the stop, \
         reads again only the pages written since where the kernel keeps soft-dirty bits (`soft_dirty`), or every page into the \
         warm copy where it keeps none (`recopy`); `write-protect` does the same but, without soft-dirty bits, reads again the pages \
         of its anonymous memory written since as userfaultfd's write protection tells (`write_protect`: a call injected into the \
         process in a first brief stop opens it) and its other mappings whole. Stages, in ms: \
         `stop` (every thread stopped), `LIVE` (its heap figures compared with those read before the stop; its tracked blocks \
         read from the kernel again only if they changed), `copy` (mappings listed, memory or written pages read, threads released) \
         make the pause; `before the stop` (`LIVE` read, and the pre-copy) and `marking` (after it, on the copy) do not hold the \
         process. 2-core VM shared with other builds, Linux {kernel} ({}): load average {load_before} before, {load_after} \
         after.",
        if rows.iter().any(|(_, _, run)| run.method == "soft_dirty") { "soft-dirty bits kept" } else { "no soft-dirty bits" }
    );
    out.push_str(
        "\n| live heap | writes/ms | blocks | method | pause | stop | `LIVE` | copy | read in pause | before the stop | marking |\n",
    );
    out.push_str("|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for (mib, writes, run) in rows {
        let stage = |name: &str| run.stages[name].as_f64().unwrap_or_default();
        let _ = writeln!(
            out,
            "| {mib} MiB | {writes} | {} | {} | {:.1} ms | {:.1} | {:.1}{} | {:.1} | {:.1} MiB | {:.0} | {:.0} |",
            run.blocks,
            run.method,
            run.pause_ms,
            stage("stop_ms"),
            stage("live_ms"),
            if run.live_read_in_pause { " (read again)" } else { "" },
            stage("copy_ms"),
            run.copied_in_pause as f64 / (1u64 << 20) as f64,
            stage("before_stop_ms"),
            stage("mark_ms"),
        );
    }
    out
}
