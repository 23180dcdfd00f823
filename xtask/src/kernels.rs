//! `cargo xtask kernels`: the core of the end-to-end tests on the kernels servers run, Debian's
//! 6.1 and the 6.12 LTS, each booted under QEMU over this machine's root file system. The tests
//! are the suite's own binaries, run in the guest against the memprof built here.

mod debian;
mod guest;

use std::{
    collections::HashMap,
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _};

use crate::{build_memprof, root, setup};
use debian::{path_str, Kernel, Series, SERIES};

/// QEMU; kmod, whose depmod vng runs over an unpacked kernel's modules (Debian builds the 9p file
/// system the guest's root is shared over as a module); busybox, which vng builds its initramfs
/// from; Python's venv, which virtme-ng is installed into.
const PACKAGES: &[&str] = &["qemu-system-x86", "kmod", "busybox-static", "python3-venv"];

/// (test binary, test) run on each kernel: each loads the programs the kernel's features pick.
const TESTS: [(&str, &str); 23] = [
    // `run`, exact, every allocation function of glibc.
    ("allocators", "every_allocator_function_is_counted_exactly"),
    // Two processes traced by their own probes: on 6.1 a perf-event uretprobe fires in both.
    ("process_life", "a_parent_and_its_followed_child_each_count_only_their_own_returns"),
    // `attach`, exact, to a process that allocated before.
    ("lifecycle", "allocations_from_before_attach_freed_after_are_unknown_frees"),
    // `attach` to a busy loop: a return probe attached before its entry probe is no drop.
    ("lifecycle", "calls_in_flight_while_the_probes_attach_are_no_drops"),
    // The daemon's /metrics.
    ("daemon", "the_peak_and_resident_memory_are_exported"),
    // The daemon's inspection: the live blocks' changes noted while it lists them.
    ("inspect_daemon", "a_busy_process_beside_many_blocks_has_only_its_changes_read_in_the_stop"),
    // An allocator that wraps no other (mimalloc, preloaded): each free counted once.
    ("allocator_families", "cxx_new_on_jemalloc_and_mimalloc_when_preloaded"),
    // jemalloc's fast path recorded in one trap, with bpftrace's perf-event uretprobe on malloc
    // taking each call's return address first (the kernel's list read for it).
    ("allocator_families", "jemalloc_sites_stay_exact_under_another_tools_return_probe"),
    // malloc's fast and slow paths on glibc, jemalloc and mimalloc, whose malloc, calloc and
    // realloc move their arguments to other registers (the probe's cookie names them).
    ("allocator_families", "fast_and_slow_paths_and_moved_arguments_are_exact_on_every_allocator"),
    // Sampled mode.
    ("sampling", "sampled_estimates_are_within_10_percent"),
    // Growth mode: the page-fault program.
    ("growth", "run_sees_the_leaking_site_on_glibc"),
    // Growth mode's huge pages: one split before memprof reads its fault counts as the fault
    // mapped it, by the page allocator's programs.
    ("growth", "a_huge_page_split_at_once_is_held_as_its_fault_mapped_it"),
    // Growth mode attached to jemalloc, whose arena holds huge pages before its first block where
    // they are always on (Debian's kernels): the leak, less what the report says it cannot see.
    ("growth", "attach_sees_the_leaking_site_on_glibc_and_jemalloc"),
    // The daemon's switch to growth mode: the machine-wide programs detached and attached again.
    ("sampling", "growth_modes_programs_for_the_whole_machine_go_with_its_last_process"),
    // The machine-wide programs kept for the processes that need them under `--growth`, and the
    // pages a purge of another process meets in their ring.
    ("growth", "machine_wide_programs_go_with_the_last_process_that_needs_them"),
    // `attach`'s move of a process sampling costs too much to growth mode, where growth mode
    // slows no other process's system calls (Debian's kernels take `fexit` programs).
    ("price", "attach_samples_a_busy_process_then_traces_its_pages_and_says_how_not_to"),
    // The move kept through an exec.
    ("price", "a_process_moved_to_its_pages_is_traced_by_them_after_an_exec"),
    // `--mappings`: the system calls' fexit programs, exact.
    ("mappings", "the_mapping_calls_are_read_where_no_other_system_call_pays"),
    ("mappings", "mappings_and_the_break_are_held_by_the_stacks_that_asked_exactly"),
    // `--usdt`: the otel_memory probes' programs, perf-event uprobes on every kernel.
    ("usdt", "run_counts_each_sample_at_its_weight"),
    // Go's runtime sampler: its samples' weights, and the rate read beside the probe.
    ("go_sampler", "run_reads_each_sample_of_a_go_program"),
    // Perf-event uprobes opened again on a thread that stays when their thread exits alone.
    ("shared_links", "run_traces_on_when_the_main_thread_exits_under_perf_event_uprobes"),
    ("shared_links", "the_daemon_traces_on_when_the_main_thread_exits_under_perf_event_uprobes"),
];

/// How long one test may take in the guest: loading the programs is slow under emulation
/// (docs: performance.md#measurements-behind-design-choices).
const TEST_LIMIT: Duration = Duration::from_secs(600);
/// The harness's waits in the guest, times this (`MEMPROF_TEST_TIME_SCALE`).
const TIME_SCALE: u32 = 10;
/// Booting and shutting down, on top of the tests' limits.
const BOOT_LIMIT: Duration = Duration::from_secs(300);

pub fn run() -> anyhow::Result<()> {
    setup::debian_packages(PACKAGES)?;
    let vng = guest::vng()?;
    let memprof = build_memprof()?;
    let binaries = test_binaries()?;
    let dir = root().join("target/kernels");
    let kernels =
        SERIES.iter().map(|series| Ok((series, debian::newest(series, &dir)?))).collect::<anyhow::Result<Vec<_>>>()?;
    // The guest builds the tests' fixtures here (the Go ones with their caches); its writes stay
    // in the guest.
    let scratch: Vec<PathBuf> =
        ["target/fixtures", "target/go-cache", "target/go-path"].iter().map(|dir| root().join(dir)).collect();
    for dir in &scratch {
        fs::create_dir_all(dir)?;
    }
    let on_kernel = |kernel: &Kernel| {
        let out = dir.join("results").join(&kernel.release);
        let boot = Matrix { vng: &vng, memprof: &memprof, binaries: &binaries, scratch: &scratch, out: &out };
        boot.run(kernel)
    };
    // Side by side: an emulated CPU each, one per core.
    let verdicts: Vec<_> = std::thread::scope(|scope| {
        let runs: Vec<_> = kernels.iter().map(|(_, kernel)| scope.spawn(|| on_kernel(kernel))).collect();
        runs.into_iter().map(|run| run.join().expect("a kernel's thread panicked")).collect()
    });
    let mut summary = String::new();
    let mut failed = false;
    for ((series, kernel), verdict) in kernels.iter().zip(verdicts) {
        let verdict = verdict.with_context(|| format!("running the tests on {}", kernel.release))?;
        for failure in &verdict.failed {
            eprintln!("---- {} on {}: {}", failure.test, kernel.release, failure.log.display());
            eprintln!("{}", tail(&failure.log));
        }
        failed |= !verdict.failed.is_empty();
        writeln!(summary, "{}", verdict.line(series, kernel))?;
    }
    print!("{summary}");
    if failed {
        bail!("memprof failed on a kernel servers run (logs above; results in {})", dir.join("results").display());
    }
    Ok(())
}

/// The test binaries of `TESTS`, built, by name.
fn test_binaries() -> anyhow::Result<HashMap<String, PathBuf>> {
    let mut cargo = Command::new("cargo");
    cargo.args([
        "test",
        "--release",
        "--package",
        "memprof-tests",
        "--no-run",
        "--message-format=json-render-diagnostics",
    ]);
    for (binary, _) in TESTS {
        cargo.args(["--test", binary]);
    }
    let messages = crate::output(cargo.current_dir(root()))?;
    let mut binaries = HashMap::new();
    for line in messages.lines() {
        let message: serde_json::Value = serde_json::from_str(line).context("cargo's JSON message")?;
        if let (Some(name), Some(executable)) = (message["target"]["name"].as_str(), message["executable"].as_str()) {
            binaries.insert(name.to_string(), PathBuf::from(executable));
        }
    }
    Ok(binaries)
}

/// What one kernel's boot needs.
struct Matrix<'a> {
    vng: &'a Path,
    memprof: &'a Path,
    binaries: &'a HashMap<String, PathBuf>,
    scratch: &'a [PathBuf],
    /// The guest's results.
    out: &'a Path,
}

impl Matrix<'_> {
    fn run(&self, kernel: &Kernel) -> anyhow::Result<Verdict> {
        let _ = fs::remove_dir_all(self.out);
        fs::create_dir_all(self.out)?;
        let script = self.out.join("guest.sh");
        fs::write(&script, self.script()?)?;
        fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
        let start = Instant::now();
        let boot = guest::Boot {
            vng: self.vng,
            vmlinuz: &kernel.vmlinuz,
            out: self.out,
            scratch: self.scratch,
            script: &script,
            limit: BOOT_LIMIT + TEST_LIMIT * TESTS.len() as u32,
        };
        let ended = boot.run()?;
        let seconds = start.elapsed().as_secs();
        let booted = fs::read_to_string(self.out.join("booted")).unwrap_or_default();
        let vng_log = self.out.join("vng.log");
        if booted.trim() != kernel.release {
            let test = "booting".to_string();
            let reason = format!("the guest never ran its script (it said {:?}); vng's output follows", booted.trim());
            return Ok(Verdict { passed: 0, failed: vec![Failure { test, reason, log: vng_log }], seconds });
        }
        let mut verdict = Verdict { passed: 0, failed: Vec::new(), seconds };
        for (binary, test) in TESTS {
            let log = self.out.join(format!("{binary}.{test}.log"));
            let status = fs::read_to_string(self.out.join(format!("{binary}.{test}.status"))).unwrap_or_default();
            let output = fs::read_to_string(&log).unwrap_or_default();
            let test = format!("{binary}::{test}");
            match status.trim() {
                "0" if output.contains("test result: ok. 1 passed") => verdict.passed += 1,
                "0" => verdict.failed.push(Failure { test, reason: "no test of that name ran".into(), log }),
                "" => {
                    let why = if ended { "the guest ended before it" } else { "the machine was killed at its limit" };
                    verdict.failed.push(Failure {
                        test,
                        reason: format!("did not finish: {why}"),
                        log: vng_log.clone(),
                    })
                }
                "124" | "137" => {
                    let reason = format!("killed after {} s", TEST_LIMIT.as_secs());
                    verdict.failed.push(Failure { test, reason, log })
                }
                _ => verdict.failed.push(Failure { test, reason: reason(&output), log }),
            }
        }
        Ok(verdict)
    }

    /// The guest's script: each test binary filtered to one test, one at a time, its output and
    /// exit code into files. `MEMPROF_TEST_FEXIT`: Debian's kernels take `fexit` programs, so the
    /// tests expect memprof to read the mapping calls with them.
    fn script(&self) -> anyhow::Result<String> {
        let out = quote(self.out)?;
        let mut script = format!(
            "#!/bin/sh\n# Written by `cargo xtask kernels`: run by the guest.\ncd {root} || exit 1\nexport PATH={path} \
             HOME=/root CI=true RUST_BACKTRACE=0 MEMPROF_BIN={memprof} MEMPROF_TEST_TIME_SCALE={TIME_SCALE} \
             MEMPROF_TEST_FEXIT=1\nuname -r > \
             {out}/booted\n",
            root = quote(&root())?,
            path = quote(Path::new(&std::env::var("PATH").unwrap_or_default()))?,
            memprof = quote(self.memprof)?,
        );
        for (binary, test) in TESTS {
            let executable =
                self.binaries.get(binary).with_context(|| format!("cargo built no test binary {binary}"))?;
            writeln!(
                script,
                "timeout -k 10 {limit} {executable} --exact {test} --test-threads=1 > {out}/{binary}.{test}.log 2>&1\necho \
                 $? > {out}/{binary}.{test}.status",
                limit = TEST_LIMIT.as_secs(),
                executable = quote(executable)?,
            )?;
        }
        Ok(script)
    }
}

/// `path` quoted for the shell.
fn quote(path: &Path) -> anyhow::Result<String> {
    Ok(format!("'{}'", path_str(path)?.replace('\'', r"'\''")))
}

/// One kernel's results.
struct Verdict {
    passed: usize,
    failed: Vec<Failure>,
    seconds: u64,
}

struct Failure {
    /// `binary::test`.
    test: String,
    /// Its reason in one line.
    reason: String,
    log: PathBuf,
}

impl Verdict {
    fn line(&self, series: &Series, kernel: &Kernel) -> String {
        let mut line = format!(
            "{} ({}, {}): {} passed, {} failed, {} s",
            kernel.release,
            series.name,
            series.runs_it,
            self.passed,
            self.failed.len(),
            self.seconds
        );
        for failure in &self.failed {
            let _ = write!(line, "\n  {}: {}", failure.test, failure.reason);
        }
        line
    }
}

/// A failed test's reason in one line: memprof's error if it gave one (a program the verifier
/// rejected, with the verifier's verdict), else what the test panicked with.
fn reason(output: &str) -> String {
    // The test's panic message holds memprof's output as a debug string: its lines are "\n".
    let lines: Vec<&str> = output.lines().flat_map(|line| line.split("\\n")).collect();
    let error = lines.iter().find_map(|line| line.find("memprof: error").map(|at| &line[at..]));
    let panic = lines.iter().position(|line| line.contains("panicked at")).and_then(|at| lines.get(at + 1).copied());
    let line = error.or(panic).map_or("no panic message: see the log", str::trim);
    line.chars().take(300).collect()
}

/// The end of a log, its long lines cut.
fn tail(log: &Path) -> String {
    let text = fs::read_to_string(log).unwrap_or_else(|e| format!("(unreadable: {e})"));
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.len().saturating_sub(60);
    lines[start..].iter().map(|line| line.chars().take(400).collect::<String>()).collect::<Vec<_>>().join("\n")
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_reason_is_memprofs_error_with_the_verifiers_verdict() {
        let log = "thread 'x' (112) panicked at tests/tests/allocators.rs:8:5:\nOutcome { stderr: \"WARN no uprobe_multi\\nmemprof: error: loading program alloc_return: Verifier output: combined stack size of 5 calls is 608. Too large\\nverification time 1 usec\\n\" }\n";
        assert_eq!(
            super::reason(log),
            "memprof: error: loading program alloc_return: Verifier output: combined stack size of 5 calls is 608. Too large"
        );
        assert_eq!(super::reason("panicked at a.rs:1:1:\nassertion failed\n"), "assertion failed");
    }
}
