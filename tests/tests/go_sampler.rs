//! `--usdt` on a Go program: the samples Go's runtime takes of its own heap, read at
//! `runtime.mProf_Malloc` and `runtime.freeSpecial`, each counted at its weight, with no
//! allocator probe. The fixture keeps 1,000 blocks of 1 KiB at `main.keep` and has the collector
//! free 1,000 blocks of 4 KiB from `main.churn`.

use memprof_tests::{
    attach, fixture, fixture_go, fixture_go_cgo_stripped, fixture_go_pure, fixture_go_release_stripped,
    fixture_go_stripped, metric, run, site, total, wait_for, Daemon, Outcome, Waiting,
};
use serde_json::Value;
use std::io::{BufRead as _, BufReader};

/// (bytes, allocations) `main.keep` holds.
const KEPT: (u64, u64) = (1000 * 1024, 1000);

/// Every allocation sampled (the fixture's `every`): the sites are exact.
fn assert_every_sample(report: &Value) {
    assert_eq!(site(report, "main.keep"), KEPT, "{report}");
    // churn's blocks, all freed by the collector (the runtime's own samples before the program
    // set its rate stand for 512 KiB each: some of them are freed too).
    assert_eq!(site(report, "main.churn"), (0, 0), "{report}");
    assert!(total(report, "freed_bytes") >= 1000 * 4096, "{}", report["totals"]);
    // Each sample seen once: a probe on the stack check that opens the runtime's functions
    // would fire again for a call that grows its stack.
    assert_eq!(report["dropped"]["missed_free"], 0, "{}", report["dropped"]);
    let spots = report["blind_spots"].as_array().unwrap();
    assert!(spots.iter().all(|spot| spot["heap"] != "Go's heap"), "Go's heap is seen: {spots:?}");
}

#[test]
fn run_reads_each_sample_of_a_go_program() {
    let program = fixture_go_pure("go_sampler");
    let outcome = run(&["--usdt", "--interval", "60"], &[program.to_str().unwrap(), "every"]);
    assert!(outcome.status.success(), "{outcome:?}");
    assert!(outcome.stderr.contains("with Go's runtime sampler"), "{}", outcome.stderr);
    let report = outcome.final_report();
    assert_every_sample(&report);
    // Traced from its first instruction: every block freed was seen allocated.
    assert_eq!(total(&report, "unknown_frees"), 0, "{}", report["totals"]);
}

#[test]
fn attach_reads_each_sample_of_a_go_program() {
    let mut target = Waiting::start(&fixture_go_pure("go_sampler"), &["every"]);
    let outcome = attach(&mut target, &["--usdt", "--interval", "60"]);
    assert!(outcome.status.success(), "{outcome:?}");
    assert_every_sample(&outcome.final_report());
}

/// `attach` to the Go fixture `program`, then `run` it, given no mode; each samples every
/// allocation.
fn attached_and_ran(program: &std::path::Path) -> [Outcome; 2] {
    let mut target = Waiting::start(program, &["every"]);
    let attached = attach(&mut target, &["--interval", "60"]);
    [attached, run(&["--interval", "60"], &[program.to_str().unwrap(), "every"])]
}

/// The line `attach` and `run` say when they choose a Go program's sampler themselves.
const CHOSE_THE_SAMPLER: &str = "is a Go program without cgo: tracing it through its runtime's own sampler";

/// Given no mode, `attach` and `run` trace a Go program without cgo through its runtime's sampler,
/// the only way they see its heap by stack, and say so; a Go program with cgo by its calls to the
/// C library's allocator, and its Go heap through that sampler beside them.
#[test]
fn attach_and_run_read_a_go_programs_heap_through_its_sampler_by_themselves() {
    for outcome in attached_and_ran(&fixture_go_pure("go_sampler")) {
        assert!(outcome.status.success(), "{outcome:?}");
        let said: Vec<&str> = outcome.stderr.lines().filter(|line| line.contains(CHOSE_THE_SAMPLER)).collect();
        assert_eq!(said.len(), 1, "{}", outcome.stderr);
        assert!(outcome.stderr.contains("with Go's runtime sampler"), "{}", outcome.stderr);
        let report = outcome.final_report();
        assert_every_sample(&report);
        assert!(report["usdt_samples"].as_u64().unwrap() >= 1000, "{}", report["usdt_samples"]);
    }
    for outcome in attached_and_ran(&fixture_go("go_sampler")) {
        assert!(outcome.status.success(), "{outcome:?}");
        assert!(!outcome.stderr.contains(CHOSE_THE_SAMPLER), "{}", outcome.stderr);
        assert!(outcome.stderr.contains("is a Go program with cgo: reading its Go heap"), "{}", outcome.stderr);
        let report = outcome.final_report();
        assert_every_sample(&report);
        assert_eq!(report["usdt_beside_calls"], true, "{report}");
    }
}

/// At Go's default rate (one sample in every 512 KiB on average) a site holding B bytes is
/// estimated within about sqrt(512 KiB / B) of them, one standard deviation (docs: guide/usdt.md):
/// 64 MiB in blocks of 1 KiB, about 128 samples, 9%. Asserted within four.
#[test]
fn at_gos_default_rate_a_site_is_estimated_within_its_sampling_error() {
    let program = fixture_go_pure("go_sampler");
    let outcome = run(&["--usdt", "--interval", "60"], &[program.to_str().unwrap(), "many"]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    let (bytes, _) = site(&report, "main.keep");
    let truth = 64u64 << 20;
    let error = bytes.abs_diff(truth) as f64 / truth as f64;
    assert!(error < 4.0 * (512.0 * 1024.0 / truth as f64).sqrt(), "{bytes} bytes estimated for {truth}: {report}");
    assert!(report["usdt_samples"].as_u64().unwrap() > 64, "{}", report["usdt_samples"]);
}

/// The daemon with `--usdt` traces a Go program through its runtime's sampler.
#[test]
fn the_daemon_exports_a_go_programs_samples() {
    let mut target = Waiting::start(&fixture_go_pure("go_sampler"), &["every", "hold"]);
    let pid = target.pid();
    let daemon = Daemon::start(&["--pid", &pid.to_string(), "--usdt"]);
    daemon.wait_traced(pid);
    target.go();
    let series = format!("memprof_usdt_samples_total{{pid=\"{pid}\",comm=\"go_sampler-pure\"}}");
    wait_for(15, "the samples in the metrics", || (metric(daemon.port, &series)? >= 2000).then_some(()));
    let (_, report) = daemon.get_json(&format!("/api/v1/leaks?pid={pid}"));
    assert_eq!(site(&report, "main.keep"), KEPT, "{report}");
}

/// Without `--usdt`, the daemon traces a Go program built without cgo through its runtime's
/// sampler, the only way it sees its heap, and a C program beside it by its calls: each exact,
/// each report saying what it was made from.
#[test]
fn without_usdt_the_daemon_reads_a_pure_go_programs_sampler_and_a_c_programs_calls() {
    let mut c = Waiting::start(&fixture("daemon_target"), &[]);
    let c_pid = c.pid();
    let daemon = Daemon::start(&["--pid", &c_pid.to_string(), "--comm", "^go_sampler-pure$"]);
    // Found as it starts, from its exec.
    let mut go = Waiting::start(&fixture_go_pure("go_sampler"), &["every", "hold"]);
    let go_pid = go.pid();
    daemon.wait_traced(go_pid);
    daemon.wait_traced(c_pid);
    go.go();
    c.go();
    let samples = |pid: u32, comm: &str| format!("memprof_usdt_samples_total{{pid=\"{pid}\",comm=\"{comm}\"}}");
    let go_samples = samples(go_pid, "go_sampler-pure");
    wait_for(15, "the Go samples in the metrics", || (metric(daemon.port, &go_samples)? >= 2000).then_some(()));
    let (_, report) = daemon.get_json(&format!("/api/v1/leaks?pid={go_pid}"));
    assert_eq!(site(&report, "main.keep"), KEPT, "{report}");
    assert!(report["usdt_samples"].as_u64().unwrap() >= 2000, "{}", report["usdt_samples"]);
    let spots = report["blind_spots"].as_array().unwrap();
    assert!(spots.iter().all(|spot| spot["heap"] != "Go's heap"), "Go's heap is seen: {spots:?}");
    let report = wait_for(20, "the C program's held blocks", || {
        let (_, report) = daemon.get_json(&format!("/api/v1/leaks?pid={c_pid}"));
        (site(&report, "hold_site") == (50_000, 50)).then_some(report)
    });
    assert!(report["usdt_samples"].is_null(), "traced by its calls: {report}");
    assert_eq!(metric(daemon.port, &samples(c_pid, "daemon_target")), Some(0));
}

/// Without `--usdt`, the daemon traces a Go program with cgo by its calls to the C library's
/// allocator, and its Go heap through its runtime's sampler beside them: `main.keep` exact, the
/// report saying so. The samples' estimated counts are no calls: a `--max-rate` far below them
/// leaves it as it is, not switched to growth mode.
#[test]
fn without_usdt_the_daemon_reads_a_cgo_programs_go_heap_beside_its_calls() {
    let mut go = Waiting::start(&fixture_go("go_sampler"), &["every", "hold"]);
    let pid = go.pid();
    let mut daemon = Daemon::start(&["--pid", &pid.to_string(), "--max-rate", "1000"]);
    daemon.wait_traced(pid);
    go.go();
    let series = format!("memprof_usdt_samples_total{{pid=\"{pid}\",comm=\"go_sampler\"}}");
    wait_for(15, "the Go samples in the metrics", || (metric(daemon.port, &series)? >= 2000).then_some(()));
    // Two intervals more: the rate guard has seen the samples.
    std::thread::sleep(std::time::Duration::from_secs(3));
    let (_, report) = daemon.get_json(&format!("/api/v1/leaks?pid={pid}"));
    assert_eq!(site(&report, "main.keep"), KEPT, "{report}");
    assert_eq!(report["usdt_beside_calls"], true, "{report}");
    assert!(report["growth"].is_null(), "switched to growth mode: {report}");
    let spots = report["blind_spots"].as_array().unwrap();
    assert!(spots.iter().all(|spot| spot["heap"] != "Go's heap"), "Go's heap is seen: {spots:?}");
    let log = daemon.stopped_log();
    assert!(!log.contains("above max_rate"), "{log}");
}

/// A traced process that execs a Go program is traced on through the program's sampler, beside
/// its calls when it has cgo: a shell, traced by its calls, execs the fixture, which waits to be
/// let go.
#[test]
fn the_daemon_traces_a_go_program_a_traced_process_execs_through_its_sampler() {
    for (program, comm) in
        [(fixture_go_pure("go_sampler"), "go_sampler-pure"), (fixture_go("go_sampler"), "go_sampler")]
    {
        let mut command = std::process::Command::new("sh");
        command.args(["-c", &format!("echo ready; read line; exec {} --wait every hold", program.display())]);
        let mut shell = Waiting::start_command(command);
        let pid = shell.pid();
        let daemon = Daemon::start(&["--pid", &pid.to_string()]);
        daemon.wait_traced(pid);
        shell.go();
        let mut ready = String::new();
        BufReader::new(shell.child.stdout.as_mut().unwrap()).read_line(&mut ready).unwrap();
        assert_eq!(ready, "ready\n", "the Go program did not start");
        let leaks = format!("/api/v1/leaks?pid={pid}");
        wait_for(20, "the Go program traced through its sampler", || {
            let (_, report) = daemon.get_json(&leaks);
            (report["comm"] == comm && report["usdt_samples"].is_u64()).then_some(())
        });
        shell.go();
        let report = wait_for(20, "main.keep's blocks", || {
            let (_, report) = daemon.get_json(&leaks);
            (site(&report, "main.keep") == KEPT).then_some(report)
        });
        assert_eq!(report["usdt_beside_calls"].as_bool().unwrap_or(false), comm == "go_sampler", "{report}");
    }
}

/// A Go program traced through its sampler (alone, or beside its calls with cgo) that execs a C
/// program has the C program traced by its calls alone: the sampler's probes and its mark go with
/// the old program.
#[test]
fn the_daemon_traces_a_c_program_a_sampled_go_program_execs_by_its_calls() {
    let c_program = fixture("daemon_target");
    for go_program in [fixture_go_pure("go_sampler"), fixture_go("go_sampler")] {
        let mut go = Waiting::start(&go_program, &["exec", c_program.to_str().unwrap()]);
        let pid = go.pid();
        let daemon = Daemon::start(&["--pid", &pid.to_string()]);
        let leaks = format!("/api/v1/leaks?pid={pid}");
        wait_for(20, "the Go program traced through its sampler", || {
            daemon.get_json(&leaks).1["usdt_samples"].is_u64().then_some(())
        });
        go.go();
        let mut ready = String::new();
        BufReader::new(go.child.stdout.as_mut().unwrap()).read_line(&mut ready).unwrap();
        assert_eq!(ready, "ready\n", "the C program did not start");
        wait_for(20, "the C program traced by its calls", || {
            let (_, report) = daemon.get_json(&leaks);
            (report["comm"] == "daemon_target" && report["usdt_samples"].is_null()).then_some(())
        });
        go.go();
        let report = wait_for(20, "the C program's held blocks", || {
            let (_, report) = daemon.get_json(&leaks);
            (site(&report, "hold_site") == (50_000, 50)).then_some(report)
        });
        assert!(report["usdt_samples"].is_null(), "{}: {report}", go_program.display());
        assert!(report["usdt_beside_calls"].is_null(), "{report}");
    }
}

/// A Go program without cgo whose runtime starts with its sampling off (it links no heap profile)
/// would show nothing through its sampler: the daemon leaves it untraced, and says why and what to
/// do when the rules name it.
#[test]
fn the_daemon_leaves_a_go_program_that_samples_nothing_untraced() {
    let mut target = Waiting::start(&fixture_go_pure("go_unprofiled"), &[]);
    let pid = target.pid();
    // Older than the 5 s a new process is given to map its allocator: refused at the first try.
    std::thread::sleep(std::time::Duration::from_secs(6));
    let mut daemon = Daemon::start(&["--pid", &pid.to_string()]);
    wait_for(15, "the daemon's first scan", || {
        metric(daemon.port, "memprof_discovery_scans_total").filter(|n| *n >= 1)
    });
    assert!(!daemon.traced_pids().contains(&u64::from(pid)));
    target.go();
    let log = daemon.stopped_log();
    let said = format!("pid={pid}");
    let refusal =
        log.lines().find(|line| line.contains("not traced, though the rules name it") && line.contains(&said));
    assert!(refusal.is_some_and(|line| line.contains("whose runtime samples nothing")), "{log}");
    assert!(!log.contains("starts with its heap sampling off"), "said only where it is traced: {log}");
}

/// A stripped Go program, pure or linked by the system's linker (cgo), has no symbol table and no
/// CFI for its Go code: its runtime's functions are found, and its frames named and unwound, by
/// its own function table (`.gopclntab`) and its frame pointers. Go 1.24's and 1.27's runtimes pass
/// a sample's pointer and size in other registers than Go 1.19's, keep a special record's kind at
/// another offset and with other values, and set the rate elsewhere; from Go 1.26 the table no
/// longer says where its code starts.
#[test]
fn a_stripped_go_program_is_read_by_its_function_table() {
    let programs = [
        fixture_go_stripped("go_sampler"),
        fixture_go_cgo_stripped("go_sampler"),
        fixture_go_release_stripped("go_sampler", "1.24"),
        fixture_go_release_stripped("go_sampler", "1.27"),
    ];
    for program in programs {
        let outcome = run(&["--usdt", "--interval", "60"], &[program.to_str().unwrap(), "every"]);
        assert!(outcome.status.success(), "{outcome:?}");
        let report = outcome.final_report();
        assert_every_sample(&report);
        let stacks = report["stacks"].as_array().unwrap();
        let keep = stacks.iter().find(|stack| stack["frames"][0]["function"] == "main.keep").unwrap();
        let frames: Vec<(&str, &str, u64)> = keep["frames"]
            .as_array()
            .unwrap()
            .iter()
            .map(|frame| {
                (
                    frame["function"].as_str().unwrap(),
                    frame["file"].as_str().unwrap_or(""),
                    frame["line"].as_u64().unwrap_or(0),
                )
            })
            .collect();
        assert!(frames.len() >= 3 && frames[0].1.ends_with("/main.go") && frames[0].2 > 0, "{frames:?}");
        let functions: Vec<&str> = frames.iter().map(|frame| frame.0).collect();
        assert_eq!(functions[..3], ["main.keep", "main.main", "runtime.main"], "{}", program.display());
        assert_eq!(keep["truncated"], false, "{keep}");
    }
}

/// A Go program that links no heap profile starts with its runtime's sampling off: said in one
/// line, found by the symbol table or, stripped, where the runtime clears the rate.
#[test]
fn a_go_program_that_samples_nothing_is_said_to() {
    for program in [fixture_go_pure("go_unprofiled"), fixture_go_release_stripped("go_unprofiled", "1.27")] {
        let outcome = run(&["--usdt", "--interval", "60"], &[program.to_str().unwrap()]);
        assert!(outcome.status.success(), "{outcome:?}");
        let said = outcome.stderr.lines().filter(|line| line.contains("starts with its heap sampling off")).count();
        assert_eq!(said, 1, "{}: {}", program.display(), outcome.stderr);
    }
}

/// A Go program with cgo whose runtime samples nothing is traced by its calls alone: its Go heap
/// is a blind spot whose advice says why, and names what shows it instead of `--usdt`, which
/// would show nothing.
#[test]
fn a_cgo_program_that_samples_nothing_is_told_what_shows_its_go_heap() {
    let program = fixture_go("go_unprofiled");
    let outcome = run(&["--interval", "60"], &[program.to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    assert!(!outcome.stderr.contains("reading its Go heap"), "{}", outcome.stderr);
    let report = outcome.final_report();
    assert!(report.get("usdt_beside_calls").is_none(), "{report}");
    let spots = report["blind_spots"].as_array().unwrap();
    let go_heap = spots.iter().find(|spot| spot["heap"] == "Go's heap").unwrap_or_else(|| panic!("{spots:?}"));
    let advice = go_heap["advice"].as_str().unwrap();
    assert!(advice.starts_with("its runtime samples nothing"), "{advice}");
    assert!(advice.contains("set runtime.MemProfileRate") && advice.contains("--growth"), "{advice}");
    assert!(!advice.contains("--usdt"), "{advice}");
}
