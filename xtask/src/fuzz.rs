//! `cargo xtask fuzz --seconds N`: each cargo-fuzz target in fuzz/ for N seconds, its corpus
//! seeded with real ELF files; writes `## Fuzzing` at the end of BENCHMARKS.md.
//!
//! The config file and the command-line values are covered by bounded proptest properties in the
//! normal test suite instead (profiler-daemon's `cli` and `daemon::config` tests): they are
//! cheap enough to run on every `cargo test`.

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _};

use crate::{root, setup};

/// The targets, and what each feeds arbitrary bytes to.
const TARGETS: [(&str, &str); 2] = [
    ("unwind_table", "the unwind-table builder (`unwind/table.rs`: ELF sections, `.eh_frame`/`.debug_frame` CFI)"),
    ("symbolize_elf", "the symbolizer's reading of a mapped file (blazesym's ELF and DWARF source, the build id)"),
];

/// Real files to start from: executables with and without debug info, and the C library.
const SEEDS: [&str; 4] = [
    "/usr/bin/true",
    "/usr/bin/env",
    "/usr/lib/x86_64-linux-gnu/libc.so.6",
    "/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
];

/// Inputs are cut at this size: mutating a whole C library makes runs too slow to explore.
const MAX_LEN: usize = 256 * 1024;

/// Panics found while fuzzing (by the targets, the properties, or the odd values tried beside
/// them), and fixed, each with a regression test.
const FIXED: &[&str] = &["`--interval 1e-300` (any positive number of seconds under a nanosecond) passed the \
     value parser and made tokio's interval panic on a zero period; now refused with a one-line error \
     (`cli::tests::the_shortest_interval_is_not_a_zero_period`)."];

struct Run {
    target: &'static str,
    what: &'static str,
    runs: u64,
    seconds: u64,
    corpus: usize,
    crash: Option<PathBuf>,
}

pub fn run(args: &[String]) -> anyhow::Result<()> {
    let seconds: u64 = match args {
        [flag, n] if flag == "--seconds" => n.parse().context("--seconds takes a whole number of seconds")?,
        _ => bail!("usage: cargo xtask fuzz --seconds N"),
    };
    setup::cargo_fuzz()?;
    let fuzz = root().join("fuzz");
    let mut runs = Vec::new();
    for (target, what) in TARGETS {
        let corpus = fuzz.join("corpus").join(target);
        seed(&corpus)?;
        eprintln!("xtask fuzz: {target} for {seconds} s");
        let output = Command::new("cargo")
            .args(["+nightly", "fuzz", "run", "--release", target])
            .arg(&corpus)
            .args(["--", &format!("-max_total_time={seconds}"), &format!("-max_len={MAX_LEN}"), "-print_final_stats=1"])
            .current_dir(&fuzz)
            .output()
            .context("starting cargo fuzz")?;
        let log = String::from_utf8_lossy(&output.stderr);
        std::fs::write(fuzz.join(format!("{target}.log")), log.as_bytes())?;
        let stat = |name: &str| {
            log.lines().find_map(|l| l.strip_prefix(name)?.trim_start_matches(':').trim().parse::<u64>().ok())
        };
        let crash = (!output.status.success()).then(|| newest_artifact(&fuzz.join("artifacts").join(target)));
        let runs_done = stat("stat::number_of_executed_units").unwrap_or(0);
        if crash.is_none() && runs_done == 0 {
            bail!("cargo fuzz run {target} ran nothing; see fuzz/{target}.log");
        }
        runs.push(Run {
            target,
            what,
            runs: runs_done,
            seconds,
            corpus: std::fs::read_dir(&corpus)?.count(),
            crash: crash.flatten(),
        });
    }
    let report = render(&runs);
    println!("{report}");
    crate::benchmarks::write_section(&root().join("BENCHMARKS.md"), "## Fuzzing", &report)?;
    if let Some(run) = runs.iter().find(|r| r.crash.is_some()) {
        bail!("{} crashed: reproduce with `cd fuzz && cargo +nightly fuzz run {} {}`", run.target, run.target, {
            run.crash.as_ref().map(|p| p.display().to_string()).unwrap_or_default()
        });
    }
    Ok(())
}

/// Copies the seed files into `corpus` (once), and memprof's own test fixtures when built.
fn seed(corpus: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(corpus)?;
    let fixtures = root().join("target/fixtures");
    let mut files: Vec<PathBuf> = SEEDS.iter().map(PathBuf::from).filter(|p| p.is_file()).collect();
    if let Ok(entries) = std::fs::read_dir(&fixtures) {
        files.extend(entries.flatten().map(|e| e.path()).filter(|p| p.is_file()).take(8));
    }
    for file in files {
        let name = format!("seed-{}", file.display().to_string().replace('/', "_"));
        if !corpus.join(&name).exists() {
            std::fs::copy(&file, corpus.join(name)).with_context(|| format!("seeding from {}", file.display()))?;
        }
    }
    Ok(())
}

fn newest_artifact(dir: &Path) -> Option<PathBuf> {
    let entries = std::fs::read_dir(dir).ok()?.flatten();
    entries.max_by_key(|e| e.metadata().and_then(|m| m.modified()).ok()).map(|e| e.path())
}

fn render(runs: &[Run]) -> String {
    let mut out = String::from("## Fuzzing\n\n");
    let _ = writeln!(
        out,
        "Written by `cargo xtask fuzz --seconds N`: each cargo-fuzz target (fuzz/, libFuzzer with \
         AddressSanitizer) runs for N seconds on one core, its corpus seeded with real ELF files \
         (coreutils, the C library, memprof's test fixtures) and inputs cut at {} KiB. A crash is any \
         panic or memory error. The config file and every command-line value are covered by \
         proptest properties in `cargo test` (512 cases each), and the table builder also by one on \
         mutated and truncated ELF files (256 cases).\n",
        MAX_LEN / 1024
    );
    out.push_str(
        "| target | what it feeds | seconds | runs | runs/s | corpus | crashes |\n|---|---|---:|---:|---:|---:|---|\n",
    );
    for r in runs {
        let crash = r.crash.as_ref().map_or("none".to_string(), |p| format!("**{}**", p.display()));
        let _ = writeln!(
            out,
            "| `{}` | {} | {} | {} | {} | {} | {} |",
            r.target,
            r.what,
            r.seconds,
            r.runs,
            r.runs / r.seconds.max(1),
            r.corpus,
            crash
        );
    }
    out.push_str("\nFound and fixed:\n\n");
    for fixed in FIXED {
        let _ = writeln!(out, "- {fixed}");
    }
    out
}
