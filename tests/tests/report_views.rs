//! `memprof report` as a place to work a leak without running anything again: the session's
//! filters, a moment (`--at`), and flame graphs of other counts, from one recording of
//! tests/fixtures/peaks.c, whose truth is known (see it and peaks.rs):
//! - at the end: hold_a 5,000 bytes in 5 blocks, hold_b 2,000 in 1, after_peak 3,000 in 3;
//! - at the peak: 20,000 bytes, hold_a 10,000 and hold_b 10,000;
//! - allocations made: temp_loop_alloc 100, pair_first 50, pair_second 50, hold_a 10, hold_b 5,
//!   after_peak 3 (218, and nothing else in the process allocates);
//! - temporary allocations: temp_loop_alloc 100.

use std::{path::PathBuf, sync::OnceLock};

use memprof_tests::{fixture, memprof, run, Outcome};
use serde_json::Value;

static RECORDING: OnceLock<PathBuf> = OnceLock::new();

/// The recording, made once for every test here and removed when they end.
fn recording() -> &'static str {
    RECORDING
        .get_or_init(|| {
            let path = std::env::temp_dir().join(format!("memprof-report-views-{}.rec", std::process::id()));
            let program = fixture("peaks");
            let outcome = run(&["--interval", "0.2", "--record", path.to_str().unwrap()], &[program.to_str().unwrap()]);
            assert!(outcome.status.success(), "{outcome:?}");
            // SAFETY: a function of no arguments that only removes a file, called once at exit.
            unsafe { libc::atexit(remove_recording) };
            path
        })
        .to_str()
        .unwrap()
}

extern "C" fn remove_recording() {
    if let Some(path) = RECORDING.get() {
        let _ = std::fs::remove_file(path);
    }
}

/// `memprof report RECORDING ARGS`.
fn report(args: &[&str]) -> Outcome {
    let all: Vec<&str> = ["report", recording()].iter().chain(args).copied().collect();
    memprof(&all)
}

/// The last JSON report `memprof report --json ARGS` writes.
fn json(args: &[&str]) -> Value {
    let all: Vec<&str> = ["--json"].iter().chain(args).copied().collect();
    let outcome = report(&all);
    assert!(outcome.status.success(), "{outcome:?}");
    outcome.reports().pop().expect("a report")
}

/// `(allocation site, bytes in use)` of each stack, by site.
fn sites(report: &Value) -> Vec<(String, u64)> {
    let mut sites: Vec<(String, u64)> = report["stacks"]
        .as_array()
        .expect("stacks")
        .iter()
        .map(|s| (s["frames"][0]["function"].as_str().unwrap().to_string(), s["outstanding_bytes"].as_u64().unwrap()))
        .collect();
    sites.sort();
    sites
}

/// `(innermost function, value)` of each folded line `memprof report --format folded ARGS`
/// writes, by function.
fn folded(args: &[&str]) -> Vec<(String, u64)> {
    let all: Vec<&str> = ["--format", "folded"].iter().chain(args).copied().collect();
    let outcome = report(&all);
    assert!(outcome.status.success(), "{outcome:?}");
    let mut lines: Vec<(String, u64)> = outcome
        .stdout
        .lines()
        .map(|line| {
            let (path, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("not `path value`: {line}"));
            let function = path.rsplit(';').next().unwrap().to_string();
            (function, value.parse().unwrap_or_else(|_| panic!("not a number: {line}")))
        })
        .collect();
    lines.sort();
    lines
}

fn owned(sites: &[(&str, u64)]) -> Vec<(String, u64)> {
    sites.iter().map(|&(f, n)| (f.to_string(), n)).collect()
}

/// A failure said in one line, naming `what`.
fn refused(outcome: &Outcome, what: &str) {
    assert!(!outcome.status.success(), "{outcome:?}");
    assert_eq!(outcome.stderr.lines().count(), 1, "one line: {}", outcome.stderr);
    assert!(outcome.stderr.contains(what), "`{what}` in {}", outcome.stderr);
    assert!(!outcome.stderr.contains("panicked"), "{}", outcome.stderr);
}

#[test]
fn the_sessions_filters_pick_exactly_the_expected_sites() {
    let end = [("after_peak", 3_000), ("hold_a", 5_000), ("hold_b", 2_000)];
    assert_eq!(sites(&json(&["--at", "final"])), owned(&end));
    assert_eq!(sites(&json(&["--focus", "^hold_"])), owned(&[("hold_a", 5_000), ("hold_b", 2_000)]));
    assert_eq!(sites(&json(&["--ignore", "^hold_a$"])), owned(&[("after_peak", 3_000), ("hold_b", 2_000)]));
    assert_eq!(sites(&json(&["--min-bytes", "3000"])), owned(&[("after_peak", 3_000), ("hold_a", 5_000)]));
    // One frame, the outermost, which every stack shares: the three merged into one.
    let merged = json(&["--max-depth", "1"]);
    let stacks = merged["stacks"].as_array().unwrap();
    assert_eq!(stacks.len(), 1, "{merged}");
    assert_eq!(stacks[0]["frames"].as_array().unwrap().len(), 1);
    assert_eq!((&stacks[0]["outstanding_bytes"], &stacks[0]["outstanding_allocations"]), (&10_000.into(), &9.into()));
    // Every format: folded stacks and the table too.
    assert_eq!(folded(&["--focus", "hold_b"]), owned(&[("hold_b", 2_000)]));
    let table = report(&["--ignore", "hold_", "--at", "final"]).stdout;
    assert!(table.contains("after_peak (peaks.c:") && !table.contains("hold_a (peaks.c:"), "{table}");
}

#[test]
fn at_the_peak_each_site_holds_its_exact_bytes_then() {
    let peak = json(&["--at", "peak"]);
    assert_eq!(peak["at_peak"], true, "{peak}");
    assert_eq!(peak["totals"]["outstanding_bytes"], 20_000);
    assert_eq!(peak["duration_s"], peak["peak"]["at_s"]);
    assert_eq!(sites(&peak), owned(&[("hold_a", 10_000), ("hold_b", 10_000)]));
    assert_eq!(sites(&json(&["--at", "peak", "--min-bytes", "10001"])), []);
    assert_eq!(folded(&["--flame", "peak", "--ignore", "hold_a"]), owned(&[("hold_b", 10_000)]));
    let table = report(&["--at", "peak"]).stdout;
    assert!(table.contains(") at its peak, ") && table.contains(": 19.5 KiB in use;"), "{table}");
    let row = table.lines().find(|l| l.contains("hold_a (peaks.c:")).unwrap_or_else(|| panic!("{table}"));
    assert!(row.starts_with(&format!("  {:>12} ", 10_000)), "{table}");
}

#[test]
fn a_moment_past_the_end_or_not_kept_is_refused_in_one_line() {
    let end = json(&["--at", "final"])["duration_s"].as_f64().unwrap();
    let first = json(&["--at", "0"]);
    assert!(first["duration_s"].as_f64().unwrap() <= end);
    // The end as a report shows it, to a tenth, can be asked for.
    let shown = (end * 10.0).ceil() / 10.0;
    assert!(report(&["--at", &format!("{shown:.1}")]).status.success());
    refused(&report(&["--at", "100000"]), &format!("--at 100000 is past its end at {shown:.1} s"));
    refused(&report(&["--at=-1"]), "`-1` is not a number of seconds from 0");
    refused(&report(&["--at", "soon"]), "`soon` is none of peak, final or a number of seconds");
    refused(&report(&["--at", "peak", "--flame", "allocations"]), "the peak keeps bytes only");
    refused(&report(&["--at", "1", "--flame", "peak"]), "--flame peak draws the peak");
    refused(&report(&["--flame", "temporary", "--format", "json"]), "give --format flamegraph or folded");
    refused(&report(&["--flame", "bytes", "--format", "table"]), "--format table is not one");
}

/// `diff` of the peak against the end: the peak keeps bytes and no counts, and its sites
/// count by their bytes.
#[test]
fn diff_compares_the_peak_with_the_end_by_bytes() {
    let dir = std::env::temp_dir();
    let (peak, end) = (
        dir.join(format!("memprof-views-peak-{}.json", std::process::id())),
        dir.join(format!("memprof-views-end-{}.json", std::process::id())),
    );
    for (path, at) in [(&peak, "peak"), (&end, "final")] {
        let outcome = report(&["--json", "--at", at, "-o", path.to_str().unwrap()]);
        assert!(outcome.status.success(), "{outcome:?}");
    }
    let diff = memprof(&["diff", peak.to_str().unwrap(), end.to_str().unwrap(), "--format", "json"]);
    assert!(diff.status.success(), "{diff:?}");
    let diff: Value = serde_json::from_str(&diff.stdout).unwrap();
    assert_eq!((&diff["old_counts_objects"], &diff["new_counts_objects"]), (&false.into(), &true.into()));
    let mut bytes: Vec<(String, u64, u64)> = diff["sites"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let function = s["frames"][0]["function"].as_str().unwrap().to_string();
            (function, s["old_bytes"].as_u64().unwrap(), s["new_bytes"].as_u64().unwrap())
        })
        .collect();
    bytes.sort();
    let expected = [("after_peak", 0, 3_000), ("hold_a", 10_000, 5_000), ("hold_b", 10_000, 2_000)];
    assert_eq!(bytes, expected.map(|(f, old, new)| (f.to_string(), old, new)));
    let table = memprof(&["diff", peak.to_str().unwrap(), end.to_str().unwrap()]).stdout;
    assert!(table.contains("in use 20000 -> 10000 bytes") && table.contains("at its process's peak"), "{table}");
    let _ = (std::fs::remove_file(&peak), std::fs::remove_file(&end));
}

/// The recording is the session's one copy: a report does not write over it, by its name or
/// through a link.
#[test]
fn a_report_never_replaces_its_recording() {
    let copy = std::env::temp_dir().join(format!("memprof-views-copy-{}.rec", std::process::id()));
    let link = copy.with_extension("link");
    std::fs::copy(recording(), &copy).unwrap();
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&copy, &link).unwrap();
    let before = std::fs::read(&copy).unwrap();
    for output in [&copy, &link] {
        let outcome = memprof(&["report", link.to_str().unwrap(), "--format", "html", "-o", output.to_str().unwrap()]);
        refused(&outcome, "names the recording itself");
        assert_eq!(outcome.status.code(), Some(2));
    }
    assert_eq!(std::fs::read(&copy).unwrap(), before);
    let _ = (std::fs::remove_file(&link), std::fs::remove_file(&copy));
}

#[test]
fn flame_graphs_of_allocations_and_temporary_allocations_count_exactly() {
    let made = [
        ("after_peak", 3),
        ("hold_a", 10),
        ("hold_b", 5),
        ("pair_first", 50),
        ("pair_second", 50),
        ("temp_loop_alloc", 100),
    ];
    assert_eq!(folded(&["--flame", "allocations"]), owned(&made));
    assert_eq!(folded(&["--flame", "temporary"]), owned(&[("temp_loop_alloc", 100)]));
    assert_eq!(folded(&["--flame", "bytes"]), owned(&[("after_peak", 3_000), ("hold_a", 5_000), ("hold_b", 2_000)]));
    assert_eq!(folded(&["--flame", "allocations", "--focus", "^pair_"]), owned(&made[3..5]));

    let svg = report(&["--flame", "allocations"]);
    assert!(svg.status.success(), "{svg:?}");
    let svg = svg.stdout;
    assert!(svg.contains("<title>temp_loop_alloc (100 allocations, "), "{svg}");
    assert!(svg.contains(">218 allocations of "), "{svg}");
    let svg = report(&["--flame", "temporary"]).stdout;
    assert!(svg.contains("<title>temp_loop_alloc (100 allocations, "), "{svg}");
    assert!(
        svg.contains(">100 of 218 allocations freed by their thread before it allocated or freed anything else<"),
        "{svg}"
    );
    let svg = report(&["--flame", "peak"]).stdout;
    assert!(svg.contains("<title>hold_b (10,000 bytes, 50.00%)</title>"), "{svg}");
    assert!(svg.contains(">20000 bytes (the peak keeps no counts)<"), "{svg}");
}

/// Each stack by its depth in tests/fixtures/peak_stacks.c (the frames of held_at it has) and
/// its bytes in use.
fn by_depth(report: &Value) -> Vec<(u64, u64)> {
    let mut held: Vec<(u64, u64)> = report["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let depth = s["frames"].as_array().unwrap().iter().filter(|f| f["function"] == "held_at").count();
            (depth as u64, s["outstanding_bytes"].as_u64().unwrap())
        })
        .collect();
    held.sort();
    held
}

/// A peak held by more stacks than a report lists (tests/fixtures/peak_stacks.c): the recording
/// keeps them all, and `--at peak` shows each with its exact bytes; `--at SECONDS` shows the
/// interval report nearest them, in either phase of the fixture.
#[test]
fn the_peak_keeps_every_stack_and_seconds_pick_each_phase() {
    let path = std::env::temp_dir().join(format!("memprof-peak-stacks-{}.rec", std::process::id()));
    let recorded = path.to_str().unwrap();
    let program = fixture("peak_stacks");
    let outcome = run(&["--interval", "0.2", "--record", recorded], &[program.to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    let live = outcome.reports();
    let at = |moment: &str| {
        let outcome = memprof(&["report", recorded, "--json", "--at", moment]);
        assert!(outcome.status.success(), "{outcome:?}");
        outcome.reports().pop().expect("a report")
    };
    let (peak, end) = (at("peak"), at("final"));
    // An interval report of each phase, asked for by its time.
    let of_phase = |bytes: u64| {
        let report = live
            .iter()
            .find(|r| r["final"] == false && r["totals"]["outstanding_bytes"] == bytes)
            .unwrap_or_else(|| panic!("no interval report with {bytes} bytes in use"));
        (report, at(&report["duration_s"].to_string()))
    };
    let (held, held_at) = of_phase(127_260);
    let (after, after_at) = of_phase(10);
    std::fs::remove_file(&path).unwrap();

    let each_depth: Vec<(u64, u64)> = (1..=120).map(|depth| (depth, 1000 + depth)).collect();
    assert_eq!(peak["totals"]["outstanding_bytes"], 127_260, "{}", peak["totals"]);
    assert_eq!(by_depth(&peak), each_depth);
    // At the peak, before the first interval, the leak rule had seen none of them (the end's
    // report lists none of them, and says nothing of them).
    for stack in peak["stacks"].as_array().unwrap() {
        assert_eq!(stack["leak"]["warming_up"]["seen"], 0, "{stack}");
    }
    // The reports list the largest, as the live session did.
    assert_eq!(end["peak"]["stacks"].as_array().unwrap().len(), 100);
    assert_eq!(end["peak"], live.last().unwrap()["peak"]);
    assert_eq!(sites(&end), owned(&[("last_block", 10)]));

    assert_eq!((&held_at["duration_s"], &held_at["totals"]), (&held["duration_s"], &held["totals"]));
    assert_eq!(by_depth(&held_at), each_depth);
    assert_eq!((&after_at["duration_s"], &after_at["totals"]), (&after["duration_s"], &after["totals"]));
    assert_eq!(sites(&after_at), owned(&[("last_block", 10)]));
}

/// Folded stacks have no place for drops or blind spots: memprof says them beside the file. A
/// flame graph says them under its title. The suppressions fixture makes 72 allocations and
/// frees none: a table of 16 leaves 56 unrecorded.
#[test]
fn folded_stacks_and_flame_graphs_say_what_was_dropped() {
    let program = fixture("suppressions");
    let dir = std::env::temp_dir().join(format!("memprof-views-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (format, file) in [("folded", "heap.folded"), ("flamegraph", "heap.svg")] {
        let path = dir.join(file);
        let path = path.to_str().unwrap();
        let args = ["run", "--max-live", "16", "--format", format, "-o", path, "--", program.to_str().unwrap()];
        let outcome = memprof(&args);
        assert!(outcome.status.success(), "{outcome:?}");
        let written = std::fs::read_to_string(path).unwrap();
        if format == "folded" {
            assert!(
                outcome.stderr.contains("memprof: the folded stacks leave out: dropped: live_map_full=56\n"),
                "{}",
                outcome.stderr
            );
            assert!(!written.contains("dropped"), "{written}");
        } else {
            assert!(written.contains("in 16 allocations; dropped: live_map_full=56</text>"), "{written}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The table's lists at the peak (and of temporary allocations and mappings) show `--top` of
/// each, as the session's own table did: a recording keeps them all.
#[test]
fn the_tables_lists_show_top_of_each() {
    let held = |args: &[&str]| {
        let outcome = report(args);
        assert!(outcome.status.success(), "{outcome:?}");
        outcome.stdout.matches("held at the peak:").count()
    };
    assert_eq!(held(&["--at", "final"]), 2, "hold_a and hold_b");
    assert_eq!(held(&["--at", "final", "--top", "1"]), 1);
}
