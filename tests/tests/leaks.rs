//! The leak rule on a real process: a leak is flagged, a cache, a pool freed in bulk and churn
//! are not; the timeline, lifetimes, filters and the CI gate.

use memprof_tests::{fixture, http_get, metric, run, sample, site, total, wait_for, Daemon, Waiting};
use serde_json::Value;

const RULE: [&str; 4] = ["--interval", "0.25", "--leak-window", "4"];

fn stack<'a>(report: &'a Value, function: &str) -> Option<&'a Value> {
    report["stacks"].as_array()?.iter().find(|s| s["frames"][0]["function"] == function)
}

fn candidate(report: &Value, function: &str) -> bool {
    stack(report, function).is_some_and(|s| s["leak"]["candidate"] == true)
}

#[test]
fn only_the_leak_is_flagged() {
    let outcome = run(&RULE, &[fixture("leak_kinds").to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    let reports = outcome.reports();
    let last = outcome.final_report();
    assert_eq!(site(&last, "leak_steady"), (36_000, 36));
    assert_eq!(site(&last, "cache_fill"), (64 * 512, 64));
    assert_eq!(site(&last, "pool_alloc"), (0, 0));
    assert_eq!(site(&last, "churn"), (128, 1));
    let leak = &stack(&last, "leak_steady").unwrap()["leak"];
    assert!(candidate(&last, "leak_steady"), "{leak}");
    assert!(leak["score"].as_f64().unwrap() >= 0.5, "{leak}");
    // The final point may come just after the last interval's: then it did not grow in that one.
    assert!(leak["reason"].as_str().unwrap().starts_with("leak candidate: grew in "), "{leak}");
    assert!(leak["reason"].as_str().unwrap().contains("still holds 100% of what it held"), "{leak}");
    for kind in ["cache_fill", "churn"] {
        let verdict = &stack(&last, kind).unwrap()["leak"];
        assert_eq!(verdict["candidate"], false, "{kind}: {verdict}");
        assert!(verdict["reason"].as_str().unwrap().starts_with("not a leak candidate"), "{kind}: {verdict}");
    }
    // Flagged within a few intervals of the window filling, and never the churn.
    let first_flagged = reports.iter().find(|r| candidate(r, "leak_steady")).expect("the leak is flagged");
    assert!(first_flagged["duration_s"].as_f64().unwrap() <= 2.0, "flagged late: {first_flagged}");
    assert!(reports.iter().all(|r| !candidate(r, "churn")), "churn is never a leak candidate");
    assert!(reports.iter().all(|r| !candidate(r, "pool_alloc") || r["duration_s"].as_f64().unwrap() < 1.6));
}

#[test]
fn the_final_report_has_the_timeline_and_lifetimes() {
    let outcome = run(&RULE, &[fixture("leak_kinds").to_str().unwrap()]);
    let last = outcome.final_report();
    let timeline = &last["timeline"];
    let times = timeline["time_s"].as_array().unwrap();
    let totals = timeline["outstanding_bytes"].as_array().unwrap();
    assert!(times.len() >= 12, "one point per interval: {timeline}");
    assert_eq!(times.len(), totals.len());
    assert_eq!(totals.last().unwrap().as_u64().unwrap(), total(&last, "outstanding_bytes"));
    let leak_id = &stack(&last, "leak_steady").unwrap()["stack_id"];
    let series =
        timeline["stacks"].as_array().unwrap().iter().find(|s| &s["stack_id"] == leak_id).expect("leak series");
    let values: Vec<u64> =
        series["outstanding_bytes"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert!(values.windows(2).all(|w| w[0] <= w[1]), "{values:?}");
    assert_eq!(*values.last().unwrap(), 36_000);
    assert_eq!(series["first"].as_u64().unwrap() as usize + values.len(), times.len());
    // Every free seen has its lifetime counted: the pool's 100 and churn's 359.
    let lifetimes: u64 = last["lifetimes"].as_array().unwrap().iter().map(|b| b["count"].as_u64().unwrap()).sum();
    assert_eq!(lifetimes, total(&last, "frees"));
    assert_eq!(total(&last, "frees"), 459);
    assert_eq!(last["thread_pairs"].as_array().unwrap().len(), 0, "one thread allocates and frees");
}

#[test]
fn filters_pick_and_fold_stacks() {
    let command = [fixture("leak_kinds").to_str().unwrap().to_string()];
    let command: Vec<&str> = command.iter().map(String::as_str).collect();
    let focused = run(&["--interval", "60", "--focus", "^leak_steady$"], &command).final_report();
    assert_eq!(focused["stacks"].as_array().unwrap().len(), 1);
    assert_eq!(site(&focused, "leak_steady"), (36_000, 36));
    let ignored = run(&["--interval", "60", "--ignore", "leak_steady|churn", "--min-bytes", "1000"], &command);
    let ignored = ignored.final_report();
    assert_eq!(ignored["stacks"].as_array().unwrap().len(), 2, "the cache's two call sites: {ignored}");
    assert_eq!(site(&ignored, "cache_fill"), (64 * 512, 64));
    let folded = run(&["--interval", "60", "--max-depth", "1"], &command).final_report();
    let stacks = folded["stacks"].as_array().unwrap();
    assert_eq!(stacks.len(), 1, "every stack starts at _start: {folded}");
    assert_eq!(stacks[0]["frames"].as_array().unwrap().len(), 1);
    assert_eq!(stacks[0]["outstanding_bytes"].as_u64().unwrap(), total(&folded, "outstanding_bytes"));
    // A table whose filters leave no stack says so, not that nothing is outstanding.
    let none = memprof_tests::memprof(
        &[&["run", "--interval", "60", "--focus", "^no_such_site$", "--"][..], &command].concat(),
    );
    assert!(none.stdout.contains("no stack with outstanding allocations passes the filters given"), "{}", none.stdout);
    assert!(!none.stdout.contains("no outstanding allocations"), "{}", none.stdout);
}

#[test]
fn the_ci_gate_fails_on_leaks_over_the_limit() {
    let fixture = fixture("leak_kinds");
    let command = [fixture.to_str().unwrap()];
    let over = run(&[&RULE[..], &["--fail-on-leak-bytes", "1000"]].concat(), &command);
    assert_eq!(over.status.code(), Some(100), "{over:?}");
    assert!(
        over.stderr.contains("leak candidates hold 36000 bytes, more than --fail-on-leak-bytes 1000"),
        "{}",
        over.stderr
    );
    assert!(over.final_report()["stacks"].as_array().is_some(), "the report is still written");
    let under = run(&[&RULE[..], &["--fail-on-leak-bytes", "36000"]].concat(), &command);
    assert_eq!(under.status.code(), Some(0), "{under:?}");
}

/// The leak verdict wins over the command's own exit code, as valgrind's --error-exitcode and
/// LeakSanitizer's do: a command that leaks and exits 7 makes memprof exit 100.
#[test]
fn the_ci_gate_s_code_wins_over_the_command_s() {
    let script = format!("{}; exit 7", fixture("leak_kinds").display());
    let failed = run(&[&RULE[..], &["--fail-on-leak-bytes", "1000"]].concat(), &["sh", "-c", &script]);
    assert_eq!(failed.status.code(), Some(100), "{failed:?}");
    let passed = run(&[&RULE[..], &["--fail-on-leak-bytes", "36000"]].concat(), &["sh", "-c", &script]);
    assert_eq!(passed.status.code(), Some(7), "{passed:?}");
}

/// A command that ends before the rule has watched enough intervals has no verdict: the gate
/// says so and does not pass, where it used to pass in silence.
#[test]
fn the_ci_gate_does_not_pass_a_command_the_rule_could_not_judge() {
    let leak_kinds = fixture("leak_kinds");
    let unjudged = run(&["--interval", "60", "--fail-on-leak-bytes", "1000"], &[leak_kinds.to_str().unwrap()]);
    assert_eq!(unjudged.status.code(), Some(1), "{unjudged:?}");
    assert!(
        unjudged.stderr.contains("--fail-on-leak-bytes could not be judged: ")
            && unjudged
                .stderr
                .contains("held by processes the leak rule has no verdict on yet (it needs 6 intervals of 60 s")
            && unjudged.stderr.contains("give a shorter --interval or --leak-window: exiting with 1"),
        "{}",
        unjudged.stderr
    );
    assert!(unjudged.final_report()["stacks"].as_array().is_some(), "the report is still written");
    // A stack first seen as a judged process ends is no leak yet: the gate passes it.
    let late = fixture("late_block");
    let judged = run(&[&RULE[..], &["--fail-on-leak-bytes", "0"]].concat(), &[late.to_str().unwrap()]);
    assert_eq!(judged.status.code(), Some(0), "{judged:?}");
    assert_eq!(site(&judged.final_report(), "late_block"), (100, 1), "held at exit, without a verdict");
}

/// The daemon applies the same rule: `memprof_leak_candidate_bytes` counts the leak only.
#[test]
fn the_daemon_exports_the_leak_candidates() {
    let mut target = Waiting::start(&fixture("leak_kinds"), &["3"]);
    let pid = target.pid();
    let daemon = Daemon::start(&["--pid", &pid.to_string(), "--leak-window", "3"]);
    daemon.wait_traced(pid);
    target.go();
    let process = format!("{{pid=\"{pid}\",comm=\"leak_kinds\"}}");
    let (series, warming_up) =
        (format!("memprof_leak_candidate_bytes{process}"), format!("memprof_leak_rule_warming_up{process}"));
    // Until the rule has watched 3 intervals it has no verdict: no 0 that would read "no leak".
    let (_, metrics) = http_get(daemon.port, "/metrics").expect("a scrape");
    assert_eq!((sample(&metrics, &warming_up), sample(&metrics, &series)), (Some(1), None), "{metrics}");
    // The pool grows like a leak until it is freed at 4.5 s; then only the 1000-byte leak blocks count.
    wait_for(20, "only the leak to be flagged", || {
        let bytes = metric(daemon.port, &series)?;
        (bytes > 0 && bytes.is_multiple_of(1000)).then_some(bytes)
    });
    assert_eq!(metric(daemon.port, &warming_up), Some(0));
    let (_, report) = daemon.get_json(&format!("/api/v1/leaks?pid={pid}"));
    assert!(candidate(&report, "leak_steady"), "{report}");
    assert!(!candidate(&report, "cache_fill") && !candidate(&report, "churn"), "{report}");
}

/// Which thread allocates what another thread frees, per pair.
#[test]
fn frees_by_another_thread_are_counted_per_thread_pair() {
    let outcome = run(&["--interval", "60"], &[fixture("thread_pairs").to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    let tids: Vec<u64> = outcome.stderr.lines().last().unwrap().split(' ').map(|t| t.parse().unwrap()).collect();
    let report = outcome.final_report();
    let pairs = report["thread_pairs"].as_array().unwrap();
    let pair = pairs.iter().find(|p| p["alloc_tid"] == tids[0]).unwrap_or_else(|| panic!("{tids:?}: {report}"));
    assert_eq!(pair["free_tid"], tids[1]);
    assert_eq!(pair["frees"], 100);
    assert_eq!(pair["freed_bytes"], 6400);
}
