//! `--usdt`: only what the allocator's own sampler reports through its `otel_memory` probes,
//! each sample counted at its weight, and no allocator probe (the fixture's unreported blocks
//! are not seen).

use memprof_tests::{
    attach, fixture, fixture_with, map_capacity, memprof, metric, run, site, total, wait_for, Daemon, Waiting,
};
use serde_json::Value;

/// (bytes, allocations) outstanding at each reported site: 3 samples of 512 KiB for 128-byte
/// blocks, 2 samples of 1 MiB for 4096-byte blocks (see the fixture).
const SMALL: (u64, u64) = (3 * 512 * 1024, 3 * 4096);
const LARGE: (u64, u64) = (2 * 1024 * 1024, 2 * 256);

fn assert_the_samples_alone(report: &Value) {
    assert_eq!(site(report, "reported_small"), SMALL, "{report}");
    assert_eq!(site(report, "reported_large"), LARGE, "{report}");
    assert_eq!(site(report, "unreported"), (0, 0), "a block no probe reported: {report}");
    assert_eq!(report["usdt_samples"], 7, "{report}");
    assert_eq!(report["sample_bytes"], 0, "{report}");
    assert_eq!(total(report, "unknown_frees"), 0, "{}", report["totals"]);
    assert_eq!(total(report, "freed_bytes"), 512 * 1024 + 1024 * 1024, "{}", report["totals"]);
}

/// At -O2 the probes' arguments are a register and constants.
#[test]
fn run_counts_each_sample_at_its_weight() {
    let fixture = fixture_with("usdt_sites.c", "usdt_sites_o2", &["-g", "-O2", "-fno-omit-frame-pointer"]);
    let outcome = run(&["--usdt", "--interval", "60"], &[fixture.to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    assert!(outcome.stderr.contains("otel_memory probes, the allocator's own sampler"), "{}", outcome.stderr);
    assert_the_samples_alone(&outcome.final_report());
}

/// At -O0 the probes' arguments are in memory, at offsets from the frame pointer.
#[test]
fn attach_counts_each_sample_at_its_weight() {
    let mut target = Waiting::start(&fixture("usdt_sites"), &[]);
    let outcome = attach(&mut target, &["--usdt", "--interval", "60"]);
    assert!(outcome.status.success(), "{outcome:?}");
    assert_the_samples_alone(&outcome.final_report());
}

/// The daemon with `--usdt`: the samples in its metrics and its report.
#[test]
fn the_daemon_exports_the_samples() {
    let mut target = Waiting::start(&fixture("usdt_sites"), &["hold"]);
    let pid = target.pid();
    let daemon = Daemon::start(&["--pid", &pid.to_string(), "--usdt"]);
    daemon.wait_traced(pid);
    target.go();
    let series = format!("memprof_usdt_samples_total{{pid=\"{pid}\",comm=\"usdt_sites\"}}");
    wait_for(15, "the samples in the metrics", || (metric(daemon.port, &series)? == 7).then_some(()));
    let (_, report) = daemon.get_json(&format!("/api/v1/leaks?pid={pid}"));
    assert_the_samples_alone(&report);
    // The weights' table is as large as the live table's default (`max_live`).
    assert_eq!(map_capacity(daemon.child.id(), "USDT_WEIGHTS"), Some(1 << 20));
}

/// Without usdt the weights' table takes a sixteenth of `max_live`'s buckets, for the Go programs
/// the daemon traces through their runtime's sampler; so a reload cannot turn usdt on: it says
/// so, and the sampling settings stay as they were.
#[test]
fn without_usdt_its_table_is_empty_and_a_reload_cannot_turn_it_on() {
    let config = std::env::temp_dir().join(format!("memprof-usdt-reload-{}.toml", std::process::id()));
    std::fs::write(&config, "comms = [\"^usdt_sites$\"]\n").unwrap();
    let mut target = Waiting::start(&fixture("usdt_sites"), &["hold"]);
    let mut daemon = Daemon::start_at_default_rate(&["--config", config.to_str().unwrap()]);
    daemon.wait_traced(target.pid());
    assert_eq!(map_capacity(daemon.child.id(), "USDT_WEIGHTS"), Some(1 << 16));

    std::fs::write(&config, "comms = [\"^usdt_sites$\"]\nusdt = true\n").unwrap();
    let scans = metric(daemon.port, "memprof_discovery_scans_total").unwrap();
    daemon.signal(libc::SIGHUP);
    // A reload scans /proc at once.
    wait_for(15, "a scan after the reload", || {
        metric(daemon.port, "memprof_discovery_scans_total").filter(|n| *n > scans)
    });
    // A process that starts after the reload is traced by its allocator's probes, as before it:
    // every block, reported or not (half of the 100 unreported blocks of 1000 bytes are freed).
    // Under usdt its unreported blocks would not be seen.
    let mut later = Waiting::start(&fixture("usdt_sites"), &["hold"]);
    daemon.wait_traced(later.pid());
    later.go();
    target.go();
    let leaks = format!("/api/v1/leaks?pid={}", later.pid());
    wait_for(15, "the unreported blocks in a report", || {
        (site(&daemon.get_json(&leaks).1, "unreported") == (50 * 1000, 50)).then_some(())
    });
    let _ = std::fs::remove_file(&config);
    let log = daemon.stopped_log();
    let warning = "read at start, kept as they were until the next start: usdt (with the other sampling settings)";
    assert_eq!(log.lines().filter(|line| line.contains(warning)).count(), 1, "{log}");
}

#[test]
fn the_table_says_which_mode_made_it() {
    let fixture = fixture("usdt_sites");
    let outcome = memprof(&["run", "--usdt", "--interval", "60", "--", fixture.to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    assert!(
        outcome.stdout.contains(
            "usdt: the allocator's own sampler (otel_memory probes, or Go's runtime), 7 samples; counts and bytes are estimates"
        ),
        "{}",
        outcome.stdout
    );
}

/// A process without the probes is refused in one line naming the fix, before anything is traced.
#[test]
fn a_process_without_the_probes_is_refused() {
    let plain = fixture("sampled_sites");
    let outcome = memprof(&["run", "--usdt", "--", plain.to_str().unwrap()]);
    assert!(!outcome.status.success(), "{outcome:?}");
    let errors: Vec<&str> = outcome.stderr.lines().filter(|line| line.contains("otel_memory")).collect();
    assert_eq!(errors.len(), 1, "{}", outcome.stderr);
    assert!(errors[0].contains("no otel_memory USDT probes and no Go runtime in the files of"), "{}", outcome.stderr);
    assert!(errors[0].contains("leave out --usdt"), "{}", outcome.stderr);

    let mut target = Waiting::start(&plain, &[]);
    let pid = target.pid().to_string();
    let outcome = memprof(&["attach", "--pid", &pid, "--usdt"]);
    assert!(!outcome.status.success(), "{outcome:?}");
    assert!(
        outcome.stderr.contains(&format!("no otel_memory USDT probes and no Go runtime in the files of pid {pid}")),
        "{}",
        outcome.stderr
    );
    target.go();
}

/// (bytes, allocations) outstanding at the semaphore fixture's site: 6 samples of 64 KiB for
/// 256-byte blocks.
const GUARDED: (u64, u64) = (6 * 64 * 1024, 6 * 256);

fn assert_the_guarded_samples(outcome: &memprof_tests::Outcome) {
    let report = outcome.final_report();
    assert_eq!(site(&report, "guarded_alloc"), GUARDED, "{report}");
    assert_eq!(report["usdt_samples"], 8, "{report}");
    assert_eq!(total(&report, "freed_bytes"), 2 * 64 * 1024, "{}", report["totals"]);
    assert_eq!(total(&report, "unknown_frees"), 0, "{}", report["totals"]);
}

/// Probes guarded by semaphores fire only while the kernel, which memprof gives the semaphores'
/// offsets, holds them up: untraced the fixture sees both at 0, traced at 1.
#[test]
fn probes_with_semaphores_are_enabled_while_traced() {
    let fixture = fixture("usdt_semaphore");
    let alone = std::process::Command::new(&fixture).output().expect("running the fixture");
    let alone = memprof_tests::Outcome::from(alone);
    assert_eq!(alone.stderr_number("alloc semaphore:"), 0, "{}", alone.stderr);

    let outcome = run(&["--usdt", "--interval", "60"], &[fixture.to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    assert_eq!(outcome.stderr_number("alloc semaphore:"), 1, "{}", outcome.stderr);
    assert_eq!(outcome.stderr_number("free semaphore:"), 1, "{}", outcome.stderr);
    assert_the_guarded_samples(&outcome);

    let mut target = Waiting::start(&fixture, &["hold"]);
    let outcome = attach(&mut target, &["--usdt", "--interval", "60", "--duration", "2"]);
    assert!(outcome.status.success(), "{outcome:?}");
    assert_the_guarded_samples(&outcome);
    // Detached, memprof has let the kernel put them back: the probes cost nothing again.
    assert_eq!(semaphores(&fixture, target.pid()), (0, 0));
}

/// The fixture's two semaphores, read from the memory of its process `pid`.
fn semaphores(fixture: &std::path::Path, pid: u32) -> (u16, u16) {
    use std::os::unix::fs::FileExt;
    let symbols = std::process::Command::new("nm").arg(fixture).output().expect("nm (binutils)");
    let symbols = String::from_utf8_lossy(&symbols.stdout);
    let offset = |name: &str| {
        let line = symbols.lines().find(|line| line.ends_with(&format!(" {name}"))).expect(name);
        u64::from_str_radix(line.split(' ').next().unwrap(), 16).unwrap()
    };
    // A PIE: symbols are offsets from the mapping of the file's start.
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let path = fixture.canonicalize().unwrap();
    let start = maps
        .lines()
        .find(|line| line.ends_with(path.to_str().unwrap()) && line.split_whitespace().nth(2) == Some("00000000"))
        .and_then(|line| u64::from_str_radix(line.split('-').next()?, 16).ok())
        .unwrap_or_else(|| panic!("{} is not mapped in {pid}: {maps}", path.display()));
    let mem = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
    let read = |name: &str| {
        let mut value = [0u8; 2];
        mem.read_exact_at(&mut value, start + offset(name)).unwrap();
        u16::from_ne_bytes(value)
    };
    (read("otel_memory_alloc_semaphore"), read("otel_memory_free_semaphore"))
}
