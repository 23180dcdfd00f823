//! What unwinding costs: time per frame walked (bench/deep.c at two depths, untraced and under
//! each unwinding mode), and the memory of the unwind tables per MiB of the code they cover, on
//! real programs.

use std::{
    fmt::Write as _,
    io::Read as _,
    path::Path,
    process::{Command, Stdio},
    thread,
    time::Duration,
};

use anyhow::{bail, Context as _};

use super::{median, memprof_run, Size, Tool};
use crate::root;

/// Frames above main of the two runs: 68 and 8 frames with main and the 3 below it, all kept.
const DEPTHS: [u32; 2] = [4, 64];
const MODES: [&str; 2] = ["cfi", "fp"];

/// The cost of one unwound frame in one mode.
pub struct FrameCost {
    mode: &'static str,
    /// ns per pair at each of `DEPTHS`, (untraced, traced).
    per_depth: [(f64, f64); 2],
}

impl FrameCost {
    /// Each pair walks two stacks (malloc's return, free's entry), each `DEPTHS[1] - DEPTHS[0]`
    /// frames deeper in the second run; what the loop itself costs more there is not memprof's.
    fn ns_per_frame(&self) -> f64 {
        let [(untraced_low, traced_low), (untraced_high, traced_high)] = self.per_depth;
        let frames = 2.0 * f64::from(DEPTHS[1] - DEPTHS[0]);
        ((traced_high - traced_low) - (untraced_high - untraced_low)) / frames
    }
}

pub fn frame_costs(memprof: &Path, dir: &Path, size: Size) -> anyhow::Result<Vec<FrameCost>> {
    let deep = dir.join("deep");
    // Frame pointers kept: both modes then walk the same frames, down to main.
    crate::compile_c(&root().join("bench/deep.c"), &deep, &["-O2", "-fno-omit-frame-pointer"])?;
    let workload = |depth: u32| [deep.display().to_string(), size.pairs.to_string(), depth.to_string()];
    let none = Tool { name: "none", how: "", command: vec![], workload_in_one_arg: false };
    let mut untraced = [0.0; 2];
    for (slot, depth) in untraced.iter_mut().zip(DEPTHS) {
        *slot = median(&none, &workload(depth), size)?.ns_per_pair;
    }
    let mut costs = Vec::new();
    for mode in MODES {
        let tool = Tool {
            name: "memprof",
            how: "",
            command: memprof_run(memprof, &["--unwind", mode]),
            workload_in_one_arg: false,
        };
        let mut per_depth = [(0.0, 0.0); 2];
        for (i, depth) in DEPTHS.into_iter().enumerate() {
            per_depth[i] = (untraced[i], median(&tool, &workload(depth), size)?.ns_per_pair);
        }
        let cost = FrameCost { mode, per_depth };
        eprintln!("xtask bench: --unwind {mode}: {:.1} ns per unwound frame", cost.ns_per_frame());
        costs.push(cost);
    }
    Ok(costs)
}

pub fn render_frame_costs(costs: &[FrameCost], size: Size) -> String {
    let [low, high] = DEPTHS;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n## Cost per unwound frame\n\n\
         bench/deep.c runs {} pairs like the loop above, {low} and then {high} frames above main (`-O2`, frame\n\
         pointers kept so that both modes walk the same frames); memprof walks each pair's stack twice, at\n\
         malloc's return and at free's entry. Cost per frame = (traced difference − untraced difference)\n\
         / (2 × {}), the median of {} runs each.\n",
        size.pairs,
        high - low,
        size.runs
    );
    let _ = writeln!(
        out,
        "| `--unwind` | untraced, {low} / {high} deep | traced, {low} deep | traced, {high} deep | ns per frame |\n|---|---:|---:|---:|---:|"
    );
    for cost in costs {
        let [(untraced_low, traced_low), (untraced_high, traced_high)] = cost.per_depth;
        let _ = writeln!(
            out,
            "| {} | {untraced_low:.1} / {untraced_high:.1} | {traced_low:.1} | {traced_high:.1} | {:.1} |",
            cost.mode,
            cost.ns_per_frame()
        );
    }
    out
}

/// The unwind tables of one program's files, as memprof's registry counts them.
pub struct TableMemory {
    program: &'static str,
    files: u64,
    rows: u64,
    kernel_bytes: u64,
    text_bytes: u64,
    held_bytes: u64,
    /// memprof's anonymous resident memory with `--unwind cfi` minus with `fp` (no tables),
    /// while the program runs, and the same of its peak resident memory, in KiB.
    rss_anon_delta_kib: i64,
    hwm_delta_kib: i64,
}

/// A C++ program: libstdc++, libm and libgcc_s besides the C library.
const CPP_SOURCE: &str = "#include <chrono>\n#include <iostream>\n#include <map>\n#include <string>\n#include <thread>\n\
int main(int argc, char **argv) {\n  std::map<std::string, int> seen;\n  for (int i = 0; i < argc; i++) seen[argv[i]] = i;\n  \
std::this_thread::sleep_for(std::chrono::seconds(3));\n  std::cout << seen.size() << std::endl;\n}\n";

pub fn table_memory(memprof: &Path, dir: &Path) -> anyhow::Result<Vec<TableMemory>> {
    let cpp = dir.join("sleeper_cpp");
    std::fs::write(dir.join("sleeper_cpp.cpp"), CPP_SOURCE)?;
    let status = Command::new("g++").args(["-O2", "-o"]).arg(&cpp).arg(dir.join("sleeper_cpp.cpp")).status()?;
    if !status.success() {
        bail!("compiling the C++ program failed");
    }
    let cpp = cpp.display().to_string();
    // Each runs 3 s, idle after start-up: memprof's memory is read meanwhile.
    let programs: [(&'static str, Vec<&str>); 3] = [
        ("perl", vec!["/usr/bin/perl", "-e", "sleep 3"]),
        ("python3", vec!["/usr/bin/python3", "-c", "import time; time.sleep(3)"]),
        ("C++ (g++ -O2)", vec![&cpp]),
    ];
    let mut all = Vec::new();
    for (program, command) in programs {
        let cfi = traced_run(memprof, "cfi", &command)?;
        let fp = traced_run(memprof, "fp", &command)?;
        let tables =
            tables_in_use(&cfi.log).with_context(|| format!("memprof logged no unwind tables for {program}"))?;
        let memory = TableMemory {
            program,
            rss_anon_delta_kib: cfi.rss_anon_kib - fp.rss_anon_kib,
            hwm_delta_kib: cfi.hwm_kib - fp.hwm_kib,
            ..tables
        };
        eprintln!("xtask bench: {program}: {} rows for {:.1} MiB of text", memory.rows, memory.text_bytes as f64 / MIB);
        all.push(memory);
    }
    Ok(all)
}

const MIB: f64 = 1024.0 * 1024.0;

/// What one `memprof run` logged, and its memory while the command ran.
struct TracedRun {
    log: String,
    rss_anon_kib: i64,
    hwm_kib: i64,
}

fn traced_run(memprof: &Path, mode: &str, command: &[&str]) -> anyhow::Result<TracedRun> {
    let mut child = Command::new(memprof)
        .args(["run", "--unwind", mode, "--interval", "3600", "--output", "/dev/null", "--"])
        .args(command)
        .env("MEMPROF_LOG", "memprof::unwind=debug")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting memprof")?;
    let mut stderr = child.stderr.take().expect("piped");
    let log = thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    // Past start-up (libraries loaded, tables built), before the command's 3 s are up.
    thread::sleep(Duration::from_millis(2000));
    let status = std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap_or_default();
    let field = |name: &str| {
        status.lines().find_map(|line| line.strip_prefix(name)?.trim().strip_suffix("kB")?.trim().parse::<i64>().ok())
    };
    let (rss_anon_kib, hwm_kib) = (field("RssAnon:"), field("VmHWM:"));
    let exit = child.wait()?;
    let log = log.join().expect("stderr reader");
    if !exit.success() {
        bail!("memprof run {command:?} failed ({exit}): {log}");
    }
    let (Some(rss_anon_kib), Some(hwm_kib)) = (rss_anon_kib, hwm_kib) else {
        bail!("memprof ended before its memory was read: {log}");
    };
    Ok(TracedRun { log, rss_anon_kib, hwm_kib })
}

/// The last of the registry's "unwind tables in use" lines with tables: once the program has
/// loaded its libraries. (The first is of memprof's own fork, before it execs the program.)
fn tables_in_use(log: &str) -> Option<TableMemory> {
    log.lines()
        .rev()
        .filter(|line| line.contains("unwind tables in use"))
        .filter_map(|line| {
            let field = |name: &str| {
                line.split_whitespace().find_map(|word| word.strip_prefix(name)?.strip_prefix('=')?.parse::<u64>().ok())
            };
            Some(TableMemory {
                program: "",
                files: field("files")?,
                rows: field("rows")?,
                kernel_bytes: field("kernel_bytes")?,
                text_bytes: field("text_bytes")?,
                held_bytes: field("held_bytes")?,
                rss_anon_delta_kib: 0,
                hwm_delta_kib: 0,
            })
        })
        .find(|tables| tables.rows > 0)
}

pub fn render_table_memory(tables: &[TableMemory]) -> String {
    let mut out = String::from(
        "\n## Unwind table memory\n\n\
         Under `memprof run`, once each program has started: its files with CFI, their executable\n\
         segments (text), and the rows of their tables (16 bytes each, in 1 MiB shards: the kernel column\n\
         counts whole shards, created as tables need them). memprof\n\
         itself keeps only a record per file and per process (computed); its resident memory with\n\
         `--unwind cfi` minus `--unwind fp` (no tables) is measured, anonymous and peak.\n\n\
         | program | files | text | rows | kernel | kernel per MiB of text | memprof's records | memprof RSS, anon / peak |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for t in tables {
        let text_mib = t.text_bytes as f64 / MIB;
        let _ = writeln!(
            out,
            "| {} | {} | {:.1} MiB | {} | {:.2} MiB | {:.0} KiB | {:.1} KiB | {:+} / {:+} KiB |",
            t.program,
            t.files,
            text_mib,
            t.rows,
            t.kernel_bytes as f64 / MIB,
            t.kernel_bytes as f64 / 1024.0 / text_mib,
            t.held_bytes as f64 / 1024.0,
            t.rss_anon_delta_kib,
            t.hwm_delta_kib
        );
    }
    out
}
