//! Memory outside malloc: anonymous `mmap`, `munmap`, `mremap` and `brk` with their stacks, on a C
//! fixture whose truth is known (tests/fixtures/mappings.c) and on a Go program, whose heap the Go
//! runtime maps itself (tests/fixtures/go_heap).

use memprof_tests::{
    assert_nothing_dropped, fixture, fixture_go, fixture_go_pure, memprof, metric, probe_links, run, wait_for, Daemon,
    Waiting,
};
use serde_json::Value;

const PAGE: u64 = 4096;

/// The report's mapping stacks with a frame in `function`.
fn mapped_in<'a>(report: &'a Value, function: &str) -> Vec<&'a Value> {
    report["mappings"]["stacks"]
        .as_array()
        .unwrap_or_else(|| panic!("no mappings in {report}"))
        .iter()
        .filter(|stack| stack["frames"].as_array().unwrap().iter().any(|f| f["function"] == function))
        .collect()
}

/// (bytes, ranges) of the one mapping stack through `function`, made outside the allocator.
fn held_by(report: &Value, function: &str) -> (u64, u64) {
    let stacks = mapped_in(report, function);
    assert_eq!(stacks.len(), 1, "one stack through {function}: {}", report["mappings"]);
    assert_eq!(stacks[0]["in_allocator"], false, "{}", stacks[0]);
    (stacks[0]["outstanding_bytes"].as_u64().unwrap(), stacks[0]["ranges"].as_u64().unwrap())
}

#[test]
fn mappings_and_the_break_are_held_by_the_stacks_that_asked_exactly() {
    let program = fixture("mappings");
    let outcome = run(&["--mappings", "--interval", "0.2"], &[program.to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert_nothing_dropped(&report);

    assert_eq!(held_by(&report, "map_kept"), (3 * PAGE, 1));
    assert!(mapped_in(&report, "map_freed").is_empty(), "unmapped in full: {}", report["mappings"]);
    assert_eq!(held_by(&report, "map_split"), (6 * PAGE, 2), "cut in two by a munmap of 2 of its 8 pages");
    assert_eq!(held_by(&report, "map_moved"), (2 * PAGE, 1), "moved by mremap with its stack");
    assert_eq!(held_by(&report, "grow_moved"), (4 * PAGE, 1), "mremap's growth is its own");
    assert_eq!(held_by(&report, "grow_brk"), (3 * PAGE, 1), "5 pages of break grown, 2 given back");
    assert!(mapped_in(&report, "shrink_brk").is_empty(), "{}", report["mappings"]);
    // Neither the shared mapping nor the PROT_NONE reservation main made.
    let in_main: Vec<&Value> = mapped_in(&report, "main")
        .into_iter()
        .filter(|s| s["frames"][1]["function"] == "main" && s["in_allocator"] == false)
        .collect();
    assert!(in_main.is_empty(), "{in_main:?}");

    // malloc's 1 MiB block: glibc maps it itself, inside the probed call. The heap counts it;
    // the mappings mark it as the allocator's, not in their own total.
    let big = report["stacks"].as_array().unwrap().iter().find(|s| s["frames"][0]["function"] == "big_block");
    assert_eq!(big.expect("big_block's allocation")["outstanding_bytes"], 1 << 20);
    let by_allocator = mapped_in(&report, "big_block");
    assert!(!by_allocator.is_empty() && by_allocator.iter().all(|s| s["in_allocator"] == true), "{by_allocator:?}");
    let allocator_bytes: u64 = by_allocator.iter().map(|s| s["outstanding_bytes"].as_u64().unwrap()).sum();
    assert!(allocator_bytes > 1 << 20, "the block and its header's page: {allocator_bytes}");
    assert!(report["mappings"]["allocator_bytes"].as_u64().unwrap() >= allocator_bytes);
    let outside: u64 = report["mappings"]["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["in_allocator"] == false)
        .map(|s| s["outstanding_bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(report["mappings"]["outstanding_bytes"], outside);

    let table = memprof(&["run", "--mappings", "--", program.to_str().unwrap()]);
    assert!(table.status.success(), "{table:?}");
    assert!(table.stdout.contains("mapped (anonymous mmap, mremap, brk; apart from the heap): "), "{}", table.stdout);
    assert!(table.stdout.contains(&format!("{:>12} {:>9}  ", 6 * PAGE, 2)), "{}", table.stdout);
    assert!(table.stdout.contains("map_split (mappings.c:"), "{}", table.stdout);
}

#[test]
fn a_go_programs_heap_shows_through_its_mappings() {
    assert_go_heap_mapped(&run(&["--mappings", "--interval", "0.5"], &[fixture_go("go_heap").to_str().unwrap()]));
}

/// Most Go services are built without cgo: no C library, no allocator memprof probes. This one
/// links no heap profile, so its runtime's sampler shows nothing: refused without --mappings (the
/// error says so, and to use it or --growth), traced by its mappings with it.
#[test]
fn a_pure_go_programs_heap_shows_through_its_mappings() {
    let program = fixture_go_pure("go_heap");
    let program = program.to_str().unwrap();
    let refused = memprof(&["run", "--", program]);
    assert_eq!(refused.status.code(), Some(1), "{refused:?}");
    assert!(
        refused.stderr.contains("is a Go program without cgo whose runtime samples nothing")
            && refused.stderr.contains("--growth (the pages it touches)")
            && refused.stderr.contains("--mappings (where it maps its memory)"),
        "{}",
        refused.stderr
    );
    let outcome = run(&["--mappings", "--interval", "0.5"], &[program]);
    assert!(outcome.stderr.contains("by the memory it maps and touches only"), "{}", outcome.stderr);
    assert_go_heap_mapped(&outcome);
    let spots = outcome.final_report()["blind_spots"].clone();
    assert_eq!(spots[0]["heap"], "Go's heap", "{spots}");

    // One whose runtime samples is traced by its mappings alone too: it has no calls for its
    // sampler to be read beside.
    let sampling = fixture_go_pure("go_sampler");
    let outcome = run(&["--mappings", "--interval", "0.5"], &[sampling.to_str().unwrap()]);
    assert!(outcome.stderr.contains("by the memory it maps and touches only"), "{}", outcome.stderr);
    assert!(!outcome.stderr.contains("with cgo"), "{}", outcome.stderr);
    assert_eq!(outcome.final_report()["usdt_samples"], Value::Null, "{}", outcome.stderr);
}

/// The Go fixture's 64 MiB live heap shows through the runtime's mappings, not through malloc.
fn assert_go_heap_mapped(outcome: &memprof_tests::Outcome) {
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    // 64 MiB kept live, in blocks the Go runtime carves from the arenas it maps.
    let kept = 64 << 20;
    let runtime_stacks: Vec<&Value> = report["mappings"]["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| {
            s["frames"].as_array().unwrap().iter().any(|f| {
                let function = f["function"].as_str().unwrap_or("");
                function.starts_with("runtime.(*mheap).") || function == "runtime.sysMap" || function == "main.grow"
            })
        })
        .collect();
    let held: u64 = runtime_stacks.iter().map(|s| s["outstanding_bytes"].as_u64().unwrap()).sum();
    assert!(held >= kept, "the Go heap's stacks hold {held} bytes: {}", report["mappings"]);
    assert!(report["mappings"]["outstanding_bytes"].as_u64().unwrap() >= kept);
    assert!(report["totals"]["outstanding_bytes"].as_u64().unwrap() < 1 << 20, "not through malloc");
}

/// The daemon with `mappings` exports what each process holds from its own mappings: mmap_only
/// maps 64 chunks of 1 MiB outside any allocator, one every 20 ms (exact per site under `run`
/// above; here, whole chunks whenever the daemon's interval reads them).
#[test]
fn the_daemon_exports_the_mapped_bytes() {
    let mut target = Waiting::start(&fixture("mmap_only"), &[]);
    let pid = target.pid();
    let daemon = Daemon::start(&["--mappings", "--pid", &pid.to_string()]);
    daemon.wait_traced(pid);
    target.go();
    let series = format!("memprof_mmap_outstanding_bytes{{pid=\"{pid}\",comm=\"mmap_only\"}}");
    let mapped = wait_for(20, "the chunks mapped", || metric(daemon.port, &series).filter(|&bytes| bytes > 0));
    assert!(mapped % (1 << 20) == 0 && mapped <= 64 << 20, "whole chunks of 1 MiB: {mapped}");
    let allocator = format!("memprof_mmap_allocator_bytes{{pid=\"{pid}\",comm=\"mmap_only\"}}");
    assert_eq!(metric(daemon.port, &allocator), Some(0));
}

/// A target traced exactly gives memory back with `madvise` all the time (jemalloc purges so):
/// only growth mode needs those calls, and the kernel sends none of them for it. What the
/// daemon learns of a target by its mappings counts in whether it is still, so the target,
/// which allocates and maps nothing after its one range, settles (a purge sent would keep it
/// moving at every interval), and its range stays held whole.
#[test]
fn an_exact_targets_purges_are_not_sent_and_it_settles() {
    let mut target = Waiting::start(&fixture("madvise_purge"), &[]);
    let pid = target.pid();
    let daemon = Daemon::start(&["--mappings", "--pid", &pid.to_string(), "--leak-window", "2"]);
    daemon.wait_traced(pid);
    target.go();
    let series = format!("memprof_mmap_outstanding_bytes{{pid=\"{pid}\",comm=\"madvise_purge\"}}");
    wait_for(20, "the range mapped", || metric(daemon.port, &series).filter(|&bytes| bytes > 0));
    wait_for(30, "the purging target settled", || {
        (metric(daemon.port, "memprof_settled_targets") == Some(1)).then_some(())
    });
    assert_eq!(metric(daemon.port, &series), Some(16 * PAGE), "the range stays mapped: madvise keeps it");
}

/// The mapping calls are read where no other system call pays: one `fexit` link per call. A
/// kernel that refuses `fexit` programs gets the `sys_exit` tracepoint, which every system call on
/// the host pays for, and memprof says so. `cargo xtask kernels` sets `MEMPROF_TEST_FEXIT=1` on
/// Debian's kernels, which take `fexit` programs.
#[test]
fn the_mapping_calls_are_read_where_no_other_system_call_pays() {
    let child = std::process::Command::new(memprof_tests::memprof_bin())
        .args(["run", "--mappings", "--", "sleep", "3"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    // The mapping programs are attached before the command starts, the uprobes after.
    let links = wait_for(60, "memprof's uprobe links", || {
        let links: Vec<(String, String)> = probe_links::descriptions(pid)
            .iter()
            .map(|info| {
                (probe_links::field(info, "link_type").to_string(), probe_links::field(info, "tp_name").to_string())
            })
            .collect();
        links.iter().any(|(kind, _)| kind.contains("uprobe") || kind == "perf").then_some(links)
    });
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let at_every_call = links.iter().filter(|(_, tracepoint)| tracepoint == "sys_exit").count();
    let at_functions = links.iter().filter(|(kind, _)| kind == "tracing").count();
    let warned = stderr.contains("this kernel refuses fexit programs")
        && stderr.contains("slows every system call on this host")
        && stderr.contains("docs: reference/limits.md#mappings");
    if std::env::var_os("MEMPROF_TEST_FEXIT").is_some() || at_functions > 0 {
        assert_eq!((at_functions, at_every_call, warned), (5, 0, false), "{links:?}\n{stderr}");
    } else {
        assert_eq!((at_every_call, warned), (1, true), "{links:?}\n{stderr}");
    }
}
