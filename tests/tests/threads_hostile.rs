//! Threads under hostile conditions: thousands allocating at once, threads cancelled inside the
//! allocator, and a signal handler that longjmps out of malloc.

use memprof_tests::{assert_nothing_dropped, fixture, one_at_a_time, run, site, total};
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

/// Threads cancelled asynchronously while they loop on malloc/free: some die inside malloc, whose
/// return never comes. The report stays consistent, the main thread's allocations after them
/// are exact, and every call left unfinished is counted.
#[test]
fn threads_cancelled_inside_the_allocator_leave_the_report_consistent() {
    let _alone = one_at_a_time();
    let outcome = run(&["--interval", "60"], &[fixture("threads_cancel").to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert_eq!(site(&report, "after_site"), (10 * 500, 10), "{report}");
    // A worker cancelled between malloc's return and its free leaves its block outstanding.
    let (bytes, blocks) = site(&report, "cancel_site");
    assert_eq!(bytes, blocks * 48, "{report}");
    assert!(blocks <= 20 * 16, "at most one block per worker: {report}");
    assert!(total(&report, "frees") <= total(&report, "allocations"), "{report}");
    eprintln!("inflight_missing {}", dropped(&report, "inflight_missing"));
}

/// A timer signal's handler siglongjmps out of malloc again and again; the abandoned calls'
/// in-flight state must not swallow the thread's later calls, at the same depth or deeper.
#[test]
fn a_longjmp_out_of_malloc_does_not_corrupt_the_threads_next_calls() {
    let _alone = one_at_a_time();
    let outcome = run(&["--interval", "60"], &[fixture("longjmp_signal").to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert_eq!(site(&report, "after_site"), (10 * 300, 10), "{report}");
    assert_eq!(site(&report, "deeper_site"), (5 * 40, 5), "{report}");
    // Each jump left one malloc unfinished, counted when the thread's next call found it; the
    // loop's frees all matched their blocks.
    let jumps =
        outcome.stderr.lines().find_map(|line| line.strip_prefix("jumps ")).expect("the fixture counts its jumps");
    let jumps: u64 = jumps.parse().expect("a number");
    assert!(jumps > 0, "no signal landed in malloc: this test proves nothing\n{}", outcome.stderr);
    assert_eq!(dropped(&report, "inflight_missing"), jumps, "{report}");
    assert_eq!(total(&report, "unknown_frees"), 0, "{report}");
    assert_eq!(total(&report, "outstanding_bytes"), 10 * 300 + 5 * 40, "{report}");
    assert_only_inflight_missing(&report);
}
