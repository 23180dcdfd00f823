//! Where the memory is beyond what is in use now: the process's peak and the stacks that held it,
//! each stack's own high, and temporary allocations (freed by their thread before it allocated
//! anything else), on a fixture whose truth is known (tests/fixtures/peaks.c).

use memprof_tests::{assert_nothing_dropped, fixture, run, total};
use serde_json::Value;

/// `(function of the allocation site, value of field)` for each entry of `list`.
fn by_site(list: &Value, field: &str) -> Vec<(String, u64)> {
    let mut sites: Vec<(String, u64)> = list
        .as_array()
        .expect("an array")
        .iter()
        .map(|entry| {
            let function = entry["frames"][0]["function"].as_str().expect("a symbolized frame").to_string();
            (function, entry[field].as_u64().expect("a count"))
        })
        .collect();
    sites.sort();
    sites
}

fn stack<'a>(report: &'a Value, function: &str) -> &'a Value {
    report["stacks"]
        .as_array()
        .expect("stacks")
        .iter()
        .find(|s| s["frames"][0]["function"] == function)
        .unwrap_or_else(|| panic!("no stack at {function}: {report}"))
}

#[test]
fn the_peak_its_stacks_and_temporary_allocations_are_exact() {
    let program = fixture("peaks");
    let outcome = run(&["--interval", "0.2"], &[program.to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert_nothing_dropped(&report);

    // Nothing else in the process allocates: the peak is hold_a's 10,000 and hold_b's 10,000.
    let peak = &report["peak"];
    assert_eq!(peak["bytes"], 20_000, "{peak}");
    assert_eq!(by_site(&peak["stacks"], "bytes"), [("hold_a".into(), 10_000), ("hold_b".into(), 10_000)]);
    let at_s = peak["at_s"].as_f64().expect("at_s");
    assert!(at_s >= 0.0 && at_s <= report["duration_s"].as_f64().unwrap(), "{peak}");

    for (function, now, max) in [("hold_a", 5_000, 10_000), ("hold_b", 2_000, 10_000), ("after_peak", 3_000, 3_000)] {
        let stack = stack(&report, function);
        assert_eq!(stack["outstanding_bytes"], now, "{function}: {stack}");
        assert_eq!(stack["max_outstanding_bytes"], max, "{function}: {stack}");
        assert_eq!(stack["temporary_allocations"], 0, "{function}: {stack}");
    }

    // temp_loop's 100 are temporary. No pair is: pair_first's were freed after pair_second
    // allocated, pair_second's after pair_first's were freed (heaptrack counts none either).
    assert_eq!(by_site(&report["temporary_stacks"], "temporary_allocations"), [("temp_loop_alloc".into(), 100)]);
    assert_eq!(by_site(&report["temporary_stacks"], "allocations"), [("temp_loop_alloc".into(), 100)]);
    assert_eq!(total(&report, "temporary_allocations"), 100);
    assert_eq!(total(&report, "allocations"), 218);
}

/// Four threads reach the peak together, allocating at the same moments: the peak is every byte
/// held then, not a lower value one of them saw (tests/fixtures/peaks_threads.c). Run a few times,
/// as the moment two threads raise the peak at once is rare.
#[test]
fn a_peak_threads_reach_together_is_exact() {
    let program = fixture("peaks_threads");
    for _ in 0..5 {
        let outcome = run(&[], &[program.to_str().unwrap()]);
        assert!(outcome.status.success(), "{outcome:?}");
        let report = outcome.final_report();
        assert_nothing_dropped(&report);
        // After the climb, only frees: what is held at exit beside the climb's last 512 bytes
        // (the threads' own blocks) was held at the peak too, with the climb's 128,000.
        let peak = &report["peak"];
        let held_at_exit = report["totals"]["outstanding_bytes"].as_u64().expect("outstanding_bytes");
        assert_eq!(peak["bytes"], 128_000 + held_at_exit - 512, "{peak}");
        let climb = by_site(&peak["stacks"], "bytes").into_iter().find(|(site, _)| site == "climb_site");
        assert_eq!(climb, Some(("climb_site".into(), 128_000)), "{peak}");
        let climb = stack(&report, "climb_site");
        assert_eq!(
            (&climb["outstanding_bytes"], &climb["max_outstanding_bytes"]),
            (&512.into(), &128_000.into()),
            "{climb}"
        );
    }
}

/// heaptrack (Debian's) counts the same temporary allocations on the same binary.
#[test]
fn the_temporary_allocations_are_heaptracks() {
    let program = fixture("peaks");
    let data = std::env::temp_dir().join(format!("memprof-heaptrack-{}", std::process::id()));
    let recorded = std::process::Command::new("heaptrack")
        .arg("-o")
        .arg(&data)
        .arg(&program)
        .output()
        .expect("heaptrack (Debian's heaptrack, installed by `cargo xtask setup`)");
    assert!(recorded.status.success(), "{recorded:?}");
    let printed = std::process::Command::new("heaptrack_print")
        .arg("-f")
        .arg(data.with_extension("zst"))
        .output()
        .expect("heaptrack_print");
    let _ = std::fs::remove_file(data.with_extension("zst"));
    let printed = String::from_utf8_lossy(&printed.stdout);
    let theirs: u64 = (printed.lines())
        .find_map(|line| line.strip_prefix("temporary memory allocations: "))
        .and_then(|rest| rest.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no count of temporary allocations in {printed}"));
    let outcome = run(&[], &[program.to_str().unwrap()]);
    assert_eq!(total(&outcome.final_report(), "temporary_allocations"), theirs);
}

#[test]
fn the_table_names_the_peak_and_the_temporary_allocations() {
    let program = fixture("peaks");
    let outcome = memprof_tests::memprof(&["run", "--", program.to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    let table = &outcome.stdout;
    assert!(table.contains("peak: 19.5 KiB in use at "), "{table}");
    assert!(table.contains("100 temporary allocations (45.9% of all)"), "{table}");
    assert!(table.contains("temporary: 100 of 100 allocations  temp_loop_alloc (peaks.c:"), "{table}");
    assert!(table.contains("held at the peak:        10000  hold_a (peaks.c:"), "{table}");
}

/// The `memory` of the reports: (rss_anon_bytes, heap_inuse_bytes, difference_bytes).
fn memory(report: &Value) -> (u64, u64, i64) {
    let memory = &report["memory"];
    let field = |name: &str| memory[name].as_i64().unwrap_or_else(|| panic!("memory.{name} in {report}"));
    (field("rss_anon_bytes") as u64, field("heap_inuse_bytes") as u64, field("difference_bytes"))
}

#[test]
fn resident_memory_is_set_against_the_heap() {
    let program = fixture("resident");
    let outcome = run(&["--interval", "0.2"], &[program.to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    let readings: Vec<(u64, u64, i64)> = outcome.reports().iter().map(memory).collect();
    for &(rss, heap, difference) in &readings {
        assert_eq!(difference, rss as i64 - heap as i64);
    }
    // 32 MiB in blocks mapped one by one: resident and in use alike, within the pages of the
    // program's own stacks and data and the blocks' headers.
    let big = 32 << 20;
    let &(rss, _, difference) = readings.iter().find(|r| r.1 == big).expect("a reading while the 32 MiB were held");
    assert!(rss >= big && difference < 1 << 20, "rss_anon {rss}, difference {difference}");
    // Then 2,500 blocks of 256 bytes in use, the 37,500 freed between them still resident.
    let &(rss, _, difference) =
        readings.iter().rfind(|r| r.1 == 640_000).expect("a reading with the 2,500 survivors held");
    assert!(difference >= 37_500 * 256, "rss_anon {rss}: the freed blocks' pages are still resident ({difference})");
}

/// `(pinned_pages, pinned_bytes)` of the stack at `function`.
fn pinned(report: &Value, function: &str) -> (u64, u64) {
    let stack = stack(report, function);
    (stack["pinned_pages"].as_u64().expect("pinned_pages"), stack["pinned_bytes"].as_u64().expect("pinned_bytes"))
}

#[test]
fn the_survivors_stack_is_named_with_the_pages_it_pins() {
    let program = fixture("resident");
    let recording = std::env::temp_dir().join(format!("memprof-pinned-{}.rec", std::process::id()));
    let recorded = recording.to_str().unwrap();
    let outcome = run(&["--interval", "0.2", "--record", recorded], &[program.to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    // The fixture counts the pages its 2,500 survivors are on from their addresses: each holds
    // at most 256 of its 4096 bytes live (survivors are 16 chunks of 272 bytes apart), and the
    // freed blocks around them leave them resident.
    let pages: u64 = outcome.stderr_number("survivor pages: ");
    assert!((2_500..=2_500 + 2_500 / 16 + 1).contains(&pages), "{pages}");
    let page = 4096;
    let reports = outcome.reports();
    let held = reports
        .iter()
        .rfind(|r| !r["final"].as_bool().unwrap() && r["totals"]["outstanding_bytes"] == 640_000)
        .expect("a report with the 2,500 survivors held");
    assert_eq!(pinned(held, "small_block"), (pages, pages * page), "{held}");
    assert_eq!(held["memory"]["pinned_pages"], pages, "{}", held["memory"]);
    assert_eq!(held["memory"]["pinned_bytes"], pages * page, "{}", held["memory"]);
    // The final report comes after the fixture's exit: it keeps the last reading.
    let last = outcome.final_report();
    assert_eq!(pinned(&last, "small_block"), (pages, pages * page), "{last}");

    // Read back from the recording, and in the table: its PINNED column and resident line.
    let rendered = memprof_tests::memprof(&["report", recorded, "--format", "json"]);
    let table = memprof_tests::memprof(&["report", recorded, "--format", "table"]);
    std::fs::remove_file(&recording).unwrap();
    assert!(rendered.status.success(), "{rendered:?}");
    assert_eq!(pinned(&rendered.final_report(), "small_block"), (pages, pages * page));
    let small = stack(&last, "small_block");
    let field = |name: &str| small[name].as_u64().unwrap();
    // The last block made is temporary: freed before its thread allocated or freed anything else.
    let row = format!(
        "{:>12} {:>9} {:>12} {:>9} {:>12}",
        640_000,
        2_500,
        field("max_outstanding_bytes"),
        field("temporary_allocations"),
        pages * page
    );
    let table = table.stdout;
    assert!(table.contains(&row), "`{row}` in {table}");
    assert!(table.contains(&format!("; {pages} pages (")), "{table}");
}

/// A stack whose first walks the kernel deferred to memprof (the program's first moments under
/// `run`, before memprof knows its libraries) keeps one high, over its allocations before and
/// after memprof finished those walks (tests/fixtures/early_site.c). Exact unless the report
/// counts the stack under two ids (`deferred_split`), where the ids' highs are added
/// (docs: guide/peaks.md): a walk sent in the moment between memprof taking the walks and
/// giving the kernel the list, which no run here should meet more than once. memprof is not
/// always late: some run must have had a deferred walk.
#[test]
fn a_stack_first_walked_before_its_libraries_were_known_keeps_one_high() {
    let program = fixture("early_site");
    let (mut deferred_runs, mut split_runs) = (0, 0);
    for _ in 0..6 {
        let outcome = run(&[], &[program.to_str().unwrap()]);
        assert!(outcome.status.success(), "{outcome:?}");
        let report = outcome.final_report();
        assert_nothing_dropped(&report);
        let early = stack(&report, "early_site");
        assert_eq!((&early["allocations"], &early["outstanding_bytes"]), (&200.into(), &512.into()), "{early}");
        // The fixture's one allocation site: a deferred walk is early_site's.
        let tables = &report["unwind_tables"];
        let (deferred, split) =
            (tables["deferred_walks"].as_u64().unwrap(), tables["deferred_split"].as_u64().unwrap());
        let high = early["max_outstanding_bytes"].as_u64().expect("max_outstanding_bytes");
        assert!(high >= 512 && high <= 512 * (split + 1), "{deferred} deferred walks, {split} split: {early}");
        if split == 0 {
            assert_eq!(high, 512, "{deferred} deferred walks: {early}");
        }
        deferred_runs += u32::from(deferred > 0);
        split_runs += u32::from(split > 0);
    }
    assert!(deferred_runs > 0, "no run had a deferred walk: the case is not tested");
    assert!(split_runs <= 1, "{split_runs} of 6 runs counted the stack under two ids");
}
