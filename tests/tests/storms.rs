//! Storms: `--max-live` and `--max-stacks` set tiny while threads allocate hard from many stacks.
//! Every lost event is counted, the reports stay consistent, and tracing recovers once the
//! pressure ends.

use std::io::{BufRead as _, BufReader};

use memprof_tests::{attach, fixture, fixture_with, metric, site, total, wait_for, Daemon, Waiting};
use serde_json::Value;

/// tests/fixtures/storms.c's constants.
const RECOVERED: u64 = 100;
/// recovered_site's block freed before the kept ones.
const RECOVERED_FREED: u64 = 1;
const RECOVERED_SIZE: u64 = 100;
const OLD: u64 = 2 * 40;
const OLD_SIZE: u64 = 32;
/// late_site's one block, after the storm.
const LATE: u64 = 1;

/// Blocks and bytes of the storm of `threads` threads making `blocks` blocks each.
fn storm(threads: u64, blocks: u64) -> (u64, u64) {
    (threads * blocks, (0..threads).map(|t| blocks * (16 + 8 * t)).sum())
}

fn dropped(report: &Value, reason: &str) -> u64 {
    report["dropped"][reason].as_u64().unwrap_or_else(|| panic!("dropped.{reason} missing in {report}"))
}

/// Every drop counter but `allowed` is zero.
fn assert_only_dropped(report: &Value, allowed: &[&str]) {
    for (reason, count) in report["dropped"].as_object().expect("dropped is an object") {
        if !allowed.contains(&reason.as_str()) {
            assert_eq!(count, 0, "dropped {reason}: {report}");
        }
    }
}

/// No count in the report is negative or exceeds what was allocated, in the totals or any stack.
fn assert_consistent(report: &Value) {
    let totals = &report["totals"];
    let field = |v: &Value, name: &str| v[name].as_u64().unwrap_or_else(|| panic!("{name} is not a count: {v}"));
    assert!(field(totals, "outstanding_bytes") <= field(totals, "allocated_bytes"), "{totals}");
    assert!(field(totals, "outstanding_allocations") <= field(totals, "allocations"), "{totals}");
    assert!(field(totals, "frees") <= field(totals, "allocations"), "{totals}");
    assert!(field(totals, "freed_bytes") <= field(totals, "allocated_bytes"), "{totals}");
    assert_eq!(
        field(totals, "outstanding_allocations"),
        field(totals, "allocations") - field(totals, "frees"),
        "{totals}"
    );
    for stack in report["stacks"].as_array().expect("stacks") {
        assert!(field(stack, "outstanding_bytes") <= field(stack, "allocated_bytes"), "{stack}");
        assert!(field(stack, "outstanding_allocations") <= field(stack, "allocations"), "{stack}");
    }
}

/// Outstanding allocations of the stacks with no frames, where allocations whose stack was lost go.
fn frameless(report: &Value) -> u64 {
    let stacks = report["stacks"].as_array().expect("stacks");
    stacks
        .iter()
        .filter(|s| s["frames"].as_array().is_some_and(Vec::is_empty))
        .map(|s| s["outstanding_allocations"].as_u64().unwrap())
        .sum()
}

#[test]
fn a_full_live_table_counts_every_lost_allocation_and_recovers_once_it_has_room() {
    let (threads, blocks, max_live) = (8, 2_000, 1_000);
    let mut target = Waiting::start(&fixture("storms"), &["free", &threads.to_string(), &blocks.to_string()]);
    let outcome = attach(&mut target, &["--max-live", &max_live.to_string(), "--interval", "60"]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    let (stormed, _) = storm(threads, blocks);
    let lost = dropped(&report, "live_map_full");
    let recorded = total(&report, "allocations") - RECOVERED - RECOVERED_FREED;
    // The kernel checks a table without preallocation for room, then counts the new entry: each
    // other CPU inserting at that moment may take one entry more.
    let racing = std::thread::available_parallelism().map_or(1, |n| n.get() as u64) - 1;
    assert!(lost + racing >= stormed - max_live, "at most --max-live blocks are held: {report}");
    assert_eq!(recorded + lost, stormed, "every storm allocation is recorded or counted lost: {report}");
    assert!(recorded <= max_live + racing, "{report}");
    let said = outcome
        .stderr
        .matches(&format!("the table of live allocations is full: {lost} allocations not recorded"))
        .count();
    assert_eq!(said, 1, "said once, with the flag to give: {}", outcome.stderr);
    // A lost allocation's free is a free of an address memprof never saw.
    assert_eq!(total(&report, "unknown_frees"), lost, "{report}");
    assert_eq!(total(&report, "frees"), recorded + RECOVERED_FREED, "{report}");
    assert_eq!(total(&report, "failed_allocations"), 0);
    // The storm is over and its blocks freed: the table has room, and counts are exact again.
    assert_eq!(site(&report, "recovered_site"), (RECOVERED * RECOVERED_SIZE, RECOVERED), "{report}");
    assert_eq!(total(&report, "outstanding_allocations"), RECOVERED);
    assert_eq!(total(&report, "outstanding_bytes"), RECOVERED * RECOVERED_SIZE);
    assert_consistent(&report);
    // A walk that begins while a walk preempted on its busy CPU holds the CPU's scratch loses its
    // stack, not its counts.
    assert_only_dropped(&report, &["live_map_full", "stack_preempted"]);
}

#[test]
fn a_full_stack_table_counts_new_stacks_and_keeps_the_old_ones_exact() {
    let (threads, blocks, max_stacks) = (4, 256, 8);
    let mut target = Waiting::start(&fixture("storms"), &["keep", &threads.to_string(), &blocks.to_string()]);
    let outcome = attach(&mut target, &["--max-stacks", &max_stacks.to_string(), "--interval", "60"]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    let (stormed, stormed_bytes) = storm(threads, blocks);
    // old_site's four stacks were stored before the storm; its later calls find them again.
    assert_eq!(site(&report, "old_site"), (OLD * OLD_SIZE, OLD), "{report}");
    // Nothing is freed: every allocation is counted, whether its stack was kept or not.
    assert_eq!(total(&report, "allocations"), OLD + stormed + LATE, "{report}");
    assert_eq!(total(&report, "allocated_bytes"), (OLD + LATE) * OLD_SIZE + stormed_bytes, "{report}");
    assert_eq!(total(&report, "outstanding_allocations"), OLD + stormed + LATE, "{report}");
    let full = dropped(&report, "stack_table_full");
    assert!(full > 0, "32 storm stacks do not fit beside old_site's 4 in 8: {report}");
    // An allocation whose stack was not stored is counted under the stack with no frames.
    let lost_stacks = full + dropped(&report, "stack_preempted") + dropped(&report, "stack_collision");
    assert_eq!(frameless(&report), lost_stacks, "{report}");
    let stored = report["stacks"].as_array().unwrap().iter().filter(|s| s["frames"] != Value::Array(vec![])).count();
    assert!(stored <= max_stacks, "{stored} stacks in a table of {max_stacks}: {report}");
    assert_consistent(&report);
    // A walk that begins while a preempted one holds its CPU's scratch is counted too.
    assert_only_dropped(&report, &["stack_table_full", "stack_preempted"]);
}

/// The fixture's "done", after its last allocation.
fn wait_done(target: &mut Waiting) {
    let mut line = String::new();
    BufReader::new(target.child.stdout.as_mut().expect("piped")).read_line(&mut line).expect("reading the fixture");
    assert_eq!(line, "done\n", "the fixture failed");
}

#[test]
fn the_daemon_counts_a_storm_in_its_metrics_and_frees_a_full_live_table_when_the_target_exits() {
    let max_live = 1_000;
    let storms = fixture_with("storms.c", "storms_daemon", &["-g", "-O0", "-fno-omit-frame-pointer", "-pthread"]);
    let daemon = Daemon::start(&["--comm", "^storms_daemon$", "--max-live", &max_live.to_string()]);
    let live_entries = "memprof_bpf_map_entries{map=\"live\"}";
    // Every process's drops together: each reason from 0, and kept once its process is gone.
    let all_dropped = "memprof_all_events_dropped_total{reason=\"live_map_full\"}";
    assert_eq!(metric(daemon.port, all_dropped), Some(0));

    // A storm that is never freed fills the table, and its process exits holding it.
    let (threads, blocks) = (4, 500);
    let mut first = Waiting::start(&storms, &["keep", &threads.to_string(), &blocks.to_string(), "hold"]);
    daemon.wait_traced(first.pid());
    first.go();
    wait_done(&mut first);
    let path = format!("/api/v1/leaks?pid={}", first.pid());
    let (stormed, _) = storm(threads, blocks);
    let report = wait_for(20, "the whole storm in the report", || {
        let (_, report) = daemon.get_json(&path);
        (total(&report, "allocations") + dropped(&report, "live_map_full") == OLD + stormed + LATE).then_some(report)
    });
    // A full map took one entry more than its capacity once in 4 runs here (1,001 of 1,000):
    // the kernel's check of a map's size races between CPUs. At most one more per other CPU.
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let recorded = total(&report, "allocations");
    assert!((max_live..max_live + cpus).contains(&recorded), "the table is full: {report}");
    assert_consistent(&report);
    let lost = dropped(&report, "live_map_full");
    let series = format!(
        "memprof_events_dropped_total{{pid=\"{}\",comm=\"storms_daemon\",reason=\"live_map_full\"}}",
        first.pid()
    );
    assert_eq!(metric(daemon.port, &series), Some(lost), "the process's own drops");
    assert_eq!(metric(daemon.port, all_dropped), Some(lost));
    assert_eq!(metric(daemon.port, "memprof_unattributed_events_dropped_total{reason=\"live_map_full\"}"), Some(0));
    assert_eq!(metric(daemon.port, live_entries), Some(recorded));
    assert_eq!(metric(daemon.port, "memprof_bpf_map_capacity{map=\"live\"}"), Some(max_live));
    drop(first);
    assert_purged(&daemon);
    assert_eq!(metric(daemon.port, &series), None, "gone with its process");
    assert_eq!(metric(daemon.port, all_dropped), Some(lost), "kept");

    // The next process is traced exactly: the table has room again.
    let (threads, blocks) = (4, 200);
    let mut second = Waiting::start(&storms, &["free", &threads.to_string(), &blocks.to_string(), "hold"]);
    daemon.wait_traced(second.pid());
    second.go();
    wait_done(&mut second);
    let path = format!("/api/v1/leaks?pid={}", second.pid());
    let report = wait_for(20, "the recovered blocks in the report", || {
        let (_, report) = daemon.get_json(&path);
        (site(&report, "recovered_site") == (RECOVERED * RECOVERED_SIZE, RECOVERED)).then_some(report)
    });
    let (stormed, _) = storm(threads, blocks);
    assert_eq!(total(&report, "allocations"), stormed + RECOVERED + RECOVERED_FREED, "{report}");
    assert_eq!(total(&report, "frees"), stormed + RECOVERED_FREED, "{report}");
    assert_eq!(total(&report, "unknown_frees"), 0, "{report}");
    assert_eq!(dropped(&report, "live_map_full"), 0, "its own drops: none, whatever the first lost: {report}");
    assert_consistent(&report);
    assert_eq!(metric(daemon.port, live_entries), Some(RECOVERED));
    let inuse = format!("memprof_heap_inuse_bytes{{pid=\"{}\",comm=\"storms_daemon\"}}", second.pid());
    assert_eq!(metric(daemon.port, &inuse), Some(RECOVERED * RECOVERED_SIZE));

    // Once it exits, nothing of it is left in the kernel, not even the stack of a free whose
    // address was allocated again (which no recent free refers to any more).
    drop(second);
    assert_purged(&daemon);
}

#[test]
fn a_full_per_stack_table_counts_every_allocation_outside_it() {
    // Two stacks stored, four per-stack rows for all processes: the first process fills both
    // with its own stacks and its stackless row, the second takes the last row, and the third
    // has none left.
    let storms = fixture_with("storms.c", "storms_stats", &["-g", "-O0", "-fno-omit-frame-pointer", "-pthread"]);
    let daemon = Daemon::start(&["--comm", "^storms_stats$", "--max-stacks", "2"]);
    let (threads, blocks) = (2, 50);
    let mut targets: Vec<Waiting> =
        (0..3).map(|_| Waiting::start(&storms, &["keep", &threads.to_string(), &blocks.to_string(), "hold"])).collect();
    for target in &mut targets {
        daemon.wait_traced(target.pid());
        target.go();
        wait_done(target);
    }
    let (stormed, _) = storm(threads, blocks);
    let each = OLD + stormed + LATE;
    let reports = wait_for(20, "every allocation in the reports or counted", || {
        let reports: Vec<Value> =
            targets.iter().map(|t| daemon.get_json(&format!("/api/v1/leaks?pid={}", t.pid())).1).collect();
        let counted: u64 = reports.iter().map(|r| total(r, "allocations") + dropped(r, "stats_map_full")).sum();
        (counted == 3 * each).then_some(reports)
    });
    // Each process counts its own: the third's allocations found no row.
    assert!(dropped(&reports[2], "stats_map_full") > 0, "the third process has no row: {reports:?}");
    assert_eq!(dropped(&reports[0], "stats_map_full"), 0, "the first's rows were its own: {reports:?}");
    for report in &reports {
        assert!(total(report, "allocations") <= each, "{report}");
        assert_consistent(report);
    }
    assert_eq!(metric(daemon.port, "memprof_bpf_map_entries{map=\"stack_stats\"}"), Some(4));
    assert_eq!(metric(daemon.port, "memprof_bpf_map_capacity{map=\"stack_stats\"}"), Some(4));
    drop(targets);
    assert_purged(&daemon);
}

/// The kernel holds nothing of any process any more: no block, no stack (not even one whose every
/// allocation was lost to a full table), no counts.
fn assert_purged(daemon: &Daemon) {
    for map in ["live", "stacks", "free_stacks", "stack_stats"] {
        let series = format!("memprof_bpf_map_entries{{map=\"{map}\"}}");
        wait_for(20, &format!("{map} purged"), || (metric(daemon.port, &series)? == 0).then_some(()));
    }
}
