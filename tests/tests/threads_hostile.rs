//! Threads under hostile conditions: thousands allocating at once, threads cancelled inside the
//! allocator, and a signal handler that longjmps out of malloc, calloc or the memalign family.

use std::{
    io::{BufRead as _, BufReader},
    process::Command,
    thread,
};

use memprof_tests::{assert_nothing_dropped, attach, fixture, one_at_a_time, run, site, total, Waiting};
use serde_json::Value;

/// All allocations (outstanding or not) of the stacks whose innermost frame is `function`.
fn allocations_at(report: &Value, function: &str) -> u64 {
    let stacks = report["stacks"].as_array().expect("stacks is an array");
    stacks.iter().filter(|s| s["frames"][0]["function"] == function).map(|s| s["allocations"].as_u64().unwrap()).sum()
}

fn dropped(report: &Value, reason: &str) -> u64 {
    report["dropped"][reason].as_u64().unwrap_or_else(|| panic!("dropped.{reason} missing: {report}"))
}

/// Every drop counter but `inflight_missing` is zero.
fn assert_only_inflight_missing(report: &Value) {
    for (reason, count) in report["dropped"].as_object().expect("dropped is an object") {
        assert!(reason == "inflight_missing" || count == 0, "dropped {reason}: {report}");
    }
}

/// 2,000 threads alive at once, all allocating: far fewer than the 16,384 calls the kernel side
/// keeps in flight, so nothing is dropped and every byte is counted.
#[test]
fn two_thousand_threads_allocating_at_once_are_counted_exactly() {
    let _alone = one_at_a_time();
    let outcome = run(&["--interval", "60"], &[fixture("threads_storm").to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert_eq!(site(&report, "storm_site"), (2000 * 3 * 100, 2000 * 3), "{report}");
    assert_eq!(site(&report, "churn_site"), (2000 * 64, 2000), "{report}");
    assert_eq!(allocations_at(&report, "churn_site"), 2000 * 50, "{report}");
    assert_nothing_dropped(&report);
}

/// Entries the kernel side keeps for threads of process `tgid` other than its main thread, in
/// every memprof's `INFLIGHT` map (read with bpftool; the key is the thread id, the value's `tgid`
/// is at offset 24 of `Inflight`). A living thread keeps an idle entry between calls.
fn inflight_entries_of_other_threads(tgid: u32) -> usize {
    let tool = |args: &[&str]| {
        let output = Command::new("bpftool").args(args).output().expect("starting bpftool (cargo xtask setup)");
        assert!(output.status.success(), "bpftool {args:?}: {}", String::from_utf8_lossy(&output.stderr));
        serde_json::from_slice::<Value>(&output.stdout).expect("bpftool prints JSON")
    };
    let maps = tool(&["map", "show", "-j"]);
    let ids = maps.as_array().unwrap().iter().filter(|m| m["name"] == "INFLIGHT").map(|m| m["id"].to_string());
    let byte = |v: &Value| u8::from_str_radix(v.as_str().unwrap().trim_start_matches("0x"), 16).unwrap();
    ids.map(|id| {
        let entries = tool(&["map", "dump", "id", &id, "-j"]);
        let bytes = |e: &Value, field: &str| -> Vec<u8> { e[field].as_array().unwrap().iter().map(byte).collect() };
        let word = |bytes: &[u8], at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
        let entries = entries.as_array().unwrap().iter().map(|e| (word(&bytes(e, "key"), 0), bytes(e, "value")));
        entries.filter(|(tid, value)| word(value, 24) == tgid && *tid != tgid).count()
    })
    .sum()
}

/// Threads cancelled asynchronously while they loop on malloc/free: some die inside malloc, whose
/// return never comes. Each such call is counted as it dies and leaves no state behind; the
/// report stays consistent and the main thread's allocations after them are exact.
#[test]
fn threads_cancelled_inside_the_allocator_leave_the_report_consistent() {
    let _alone = one_at_a_time();
    let mut target = Waiting::start(&fixture("threads_cancel"), &["--hold"]);
    let pid = target.pid();
    let mut stdout = BufReader::new(target.child.stdout.take().expect("piped"));
    let looked = thread::spawn(move || {
        let mut line = String::new();
        stdout.read_line(&mut line).expect("reading the fixture");
        assert_eq!(line, "joined\n", "the fixture did not join its threads");
        let left = inflight_entries_of_other_threads(pid);
        // SAFETY: signalling the fixture, our own child.
        unsafe { libc::kill(pid as i32, libc::SIGUSR1) };
        left
    });
    let outcome = attach(&mut target, &["--interval", "60"]);
    assert!(outcome.status.success(), "{outcome:?}");
    // Every cancelled worker ran its cleanup handler, as without probes.
    assert!(target.child.wait().expect("waiting for the fixture").success(), "the fixture failed");
    assert_eq!(looked.join().expect("the looking thread"), 0, "in-flight state of dead threads is left behind");
    let report = outcome.final_report();
    assert_eq!(site(&report, "after_site"), (10 * 500, 10), "{report}");
    // A worker cancelled between malloc's return and its free leaves its block outstanding.
    let (bytes, blocks) = site(&report, "cancel_site");
    assert_eq!(bytes, blocks * 48, "{report}");
    let workers = 20 * 16;
    assert!(blocks <= workers, "at most one block per worker: {report}");
    // Each worker dies in at most one call, counted as it dies.
    let unfinished = dropped(&report, "inflight_missing");
    assert!(unfinished > 0 && unfinished <= workers, "{unfinished} unfinished calls: {report}");
    assert!(total(&report, "frees") <= total(&report, "allocations"), "{report}");
    assert_only_inflight_missing(&report);
}

/// A timer signal's handler siglongjmps out of `function` again and again; the abandoned calls'
/// in-flight state must not swallow the thread's later calls, at the same depth or deeper, nor
/// break the calls that nest for real (memalign jumps to malloc, posix_memalign calls it).
fn a_longjmp_out_of_the_allocator_leaves_the_threads_next_calls_exact(function: &str) {
    let _alone = one_at_a_time();
    let outcome = run(&["--interval", "60"], &[fixture("longjmp_signal").to_str().unwrap(), function]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert_eq!(site(&report, "after_site"), (10 * 300, 10), "{report}");
    assert_eq!(site(&report, "deeper_site"), (5 * 40, 5), "{report}");
    // Each jump out of a call the entry probe saw left it unfinished, counted when the thread's
    // next call found it; the loop's frees all matched their blocks. The probe sits past the
    // function's first instructions (placement: the first one the kernel emulates), so a jump
    // from before it leaves nothing in flight: at most one a jump, and some.
    let jumps =
        outcome.stderr.lines().find_map(|line| line.strip_prefix("jumps ")).expect("the fixture counts its jumps");
    let jumps: u64 = jumps.parse().expect("a number");
    assert!(jumps > 0, "no signal landed in {function}: this test proves nothing\n{}", outcome.stderr);
    let unfinished = dropped(&report, "inflight_missing");
    assert!(unfinished > 0 && unfinished <= jumps, "{unfinished} unfinished calls for {jumps} jumps: {report}");
    assert_eq!(total(&report, "unknown_frees"), 0, "{report}");
    assert_eq!(total(&report, "outstanding_bytes"), 10 * 300 + 5 * 40, "{report}");
    assert_only_inflight_missing(&report);
}

#[test]
fn a_longjmp_out_of_malloc_does_not_corrupt_the_threads_next_calls() {
    a_longjmp_out_of_the_allocator_leaves_the_threads_next_calls_exact("malloc");
}

#[test]
fn a_longjmp_out_of_calloc_does_not_corrupt_the_threads_next_calls() {
    a_longjmp_out_of_the_allocator_leaves_the_threads_next_calls_exact("calloc");
}

#[test]
fn a_longjmp_out_of_memalign_does_not_corrupt_the_threads_next_calls() {
    a_longjmp_out_of_the_allocator_leaves_the_threads_next_calls_exact("memalign");
}

#[test]
fn a_longjmp_out_of_posix_memalign_does_not_corrupt_the_threads_next_calls() {
    a_longjmp_out_of_the_allocator_leaves_the_threads_next_calls_exact("posix_memalign");
}
