//! `--growth`: the heap traced by the pages it grows into, on a fixture with known truth, on
//! glibc and on jemalloc, under `run` and `attach`. The mode's stated error: a stack holds the
//! pages it touched first, so a site's bytes are its blocks' bytes in whole pages, give or take
//! the pages its blocks share with others (here a page or two of block headers), and with the
//! pages the allocator touched for them (its own metadata: none on glibc here, 105 pages for
//! jemalloc's 100 extents).

use std::{
    io::{BufRead, BufReader},
    time::Duration,
};

use memprof_tests::{
    attach, fixture, fixture_go, fixture_go_pure, fixture_go_stripped, fixture_musl, fixture_musl_unnamed_mmap,
    fixture_with, held_before_bytes, run, through, wait_for, Daemon, Outcome, Waiting,
};
use serde_json::Value;

const PAGE: u64 = 4096;
/// `leak_pages` keeps 100 blocks of 64 KiB, written whole.
const LEAKED: u64 = 100 * 64 * 1024;
/// What the mode's stated error allows here: the pages shared with others, and a tenth more for
/// the allocator's metadata.
const SLACK: u64 = 3 * PAGE;
const METADATA: u64 = LEAKED / 10;

fn jemalloc_fixture() -> std::path::PathBuf {
    let flags = ["-g", "-O2", "-fno-omit-frame-pointer", "-Wl,--no-as-needed", "-ljemalloc"];
    fixture_with("growth.c", "growth_jemalloc", &flags)
}

/// What a process attached while it runs may have held before, growth mode cannot see into: the
/// leak may show that much less (jemalloc's arena holds 6 MiB of huge pages before its first
/// block where they are always on, as on Debian's kernels), and the report says how much. A
/// fault answered with a huge page counts its whole 2 MiB, blocks or not: the leak may show as
/// much more as the huge pages the process gained meanwhile, which the fixture writes among
/// `fixture_output`.
fn assert_growth(outcome: &Outcome, fixture_output: &str) {
    assert!(outcome.status.success(), "{outcome:?}");
    let huge_gained: u64 = fixture_output
        .lines()
        .find_map(|line| line.strip_prefix("leak huge bytes: ")?.parse().ok())
        .unwrap_or_else(|| panic!("the fixture's truth is not in {fixture_output:?}"));
    let report = outcome.final_report();
    assert!(report["growth"]["outside_pages"].is_u64(), "the report says its mode: {report}");
    let (leaked, pages) = through(&report, "leak_pages");
    let fewest = LEAKED - SLACK - held_before_bytes(&report).min(LEAKED - SLACK);
    let allowed = fewest..=LEAKED + SLACK + METADATA + huge_gained;
    let truth = format!("truth {LEAKED}, {huge_gained} bytes of huge pages gained");
    assert!(allowed.contains(&leaked), "leak_pages holds {leaked} bytes, {truth}: {report}");
    assert_eq!(pages * PAGE, leaked, "a count is a page");
    let (churned, _) = through(&report, "churn");
    assert!(churned <= 2 * PAGE, "churn reuses its page: it holds {churned} bytes");
    let top: &Value = &report["stacks"][0];
    let frames = top["frames"].as_array().expect("frames");
    assert!(frames.iter().any(|f| f["function"] == "leak_pages"), "the top stack is the leak's: {top}");
    // Its first frame is the code that touched the pages: the fixture fills each block with memset.
    let touched_by = frames[0]["function"].as_str().unwrap_or_default();
    assert!(touched_by.contains("memset") && frames[1]["function"] == "leak_pages", "{top}");
    assert_eq!(report["totals"]["unknown_frees"], 0);
}

/// A block a new thread fills lies just above the thread's stack (glibc maps the stack below it):
/// every page it touches is counted, none taken for the stack's.
#[test]
fn pages_a_new_thread_fills_just_above_its_stack_are_counted() {
    let outcome = run(&["--growth", "--interval", "60"], &[fixture("growth").to_str().unwrap(), "threads"]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert_eq!(through(&report, "thread_fill"), (4 << 20, 1024), "{report}");
}

/// Traced from its exec, the process held nothing before: no blind spot.
#[test]
fn run_sees_the_leaking_site_on_glibc() {
    let outcome = run(&["--growth", "--interval", "60"], &[fixture("growth").to_str().unwrap()]);
    assert_growth(&outcome, &outcome.stdout);
    // Its mapping calls are read at its C library, found before it runs: nothing runs at every
    // system call on the host for it, whose attach would say so.
    assert!(!outcome.stderr.contains("this kernel refuses fexit programs ("), "{}", outcome.stderr);
    let report = outcome.final_report();
    assert_eq!(report["blind_spots"], serde_json::json!([]), "{report}");
    // Pages have no totals per stack: none of the walks deferred before the program's libraries
    // were known is counted under two ids (each was, by a build that took the early id's missing
    // entry for a split).
    assert_eq!(report["unwind_tables"]["deferred_split"], 0, "{}", report["unwind_tables"]);
}

#[test]
fn run_sees_the_leaking_site_on_jemalloc() {
    let outcome = run(&["--growth", "--interval", "60"], &[jemalloc_fixture().to_str().unwrap()]);
    assert_growth(&outcome, &outcome.stdout);
}

/// A Go program's heap, which its runtime maps by system calls of its own: `grow` makes 64 blocks
/// of 1 MiB and writes each of their pages, 16,384 first touches in a few milliseconds, four
/// times what the events' ring holds. Read as the kernel wakes memprof for them, none is lost,
/// and the stacks through `grow` hold its 64 MiB: the pages its own code touched first, and those
/// the runtime zeroed for it (a span it reused). The runtime's metadata for the blocks is touched
/// under `grow` too: 2 MiB here, allowed 4. Built without cgo, stripped of its symbols, and linked
/// by the system's linker, which maps the C library too: its runtime's calls are read all the
/// same.
#[test]
fn a_go_programs_heap_is_held_by_the_function_that_grew_it() {
    for program in [fixture_go_pure("go_heap"), fixture_go_stripped("go_heap"), fixture_go("go_heap")] {
        let outcome = run(&["--growth", "--interval", "60"], &[program.to_str().unwrap()]);
        assert!(outcome.status.success(), "{outcome:?}");
        // Its mapping calls are read at its runtime's own wrappers: nothing runs at every system
        // call on the host for it, whose attach would say so.
        assert!(!outcome.stderr.contains("this kernel refuses fexit programs ("), "{}", outcome.stderr);
        let report = outcome.final_report();
        assert_eq!(report["dropped"]["fault_event_lost"], 0, "{}", report["dropped"]);
        let grown = 64 << 20;
        let (held, _) = through(&report, "main.grow");
        let name = program.display();
        assert!((grown..=grown + (4 << 20)).contains(&held), "{name}: main.grow holds {held} bytes: {report}");
    }
}

/// One fault the kernel answers with a transparent huge page maps 2 MiB, and no other fault
/// follows there: each of its pages is held by the stack that touched it.
#[test]
fn a_transparent_huge_page_is_held_whole() {
    let (_, report, truth) = attach_to_huge_pages("huge", 4 << 20);
    let resident = truth[0];
    assert_eq!(through(&report, "huge_pages"), (resident, resident / PAGE), "{report}");
    // Touched by a function's first instruction: named after it, not after the one before.
    assert_eq!(through(&report, "write_first_byte"), (resident / 2, resident / 2 / PAGE), "{report}");
}

/// A huge page split before memprof reads its fault (part of it given back at once, as jemalloc
/// purges): the fault still mapped 2 MiB, and the stack that touched it holds what stays in
/// memory of them, not one page.
#[test]
fn a_huge_page_split_at_once_is_held_as_its_fault_mapped_it() {
    let (_, report, truth) = attach_to_huge_pages("split", 2 << 20);
    let [_, resident] = truth[..] else { panic!("the fixture's truth: {truth:?}") };
    assert_eq!(resident, 1 << 20, "{truth:?}");
    assert_eq!(through(&report, "touch_huge_page"), (resident, resident / PAGE), "{report}");
    assert_eq!(report["dropped"]["fault_size_unknown"], 0, "{}", report["dropped"]);
}

/// A huge page resident before the attach, as an allocator's arena is on a kernel with huge
/// pages always on: a block placed there later touches no new page and is not counted, and the
/// report (and a line at the start) says how much memory that may be (the 2 MiB page and the
/// little else the fixture held); the pages it maps after are counted.
#[test]
fn memory_held_before_the_attach_is_said() {
    let (outcome, report, _) = attach_to_huge_pages("held", 2 << 20);
    assert_eq!(through(&report, "place_in_new"), (64 * PAGE, 64), "{report}");
    assert_eq!(through(&report, "place_in_held"), (0, 0), "{report}");
    let spots = report["blind_spots"].as_array().expect("blind_spots");
    let [spot] = &spots[..] else { panic!("one blind spot: {spots:?}") };
    assert_eq!(spot["kind"], "held_before_pages", "{spot}");
    assert!((2 << 20..3 << 20).contains(&held_before_bytes(&report)), "{spot}");
    assert!(spot["advice"].as_str().expect("advice").contains("memprof run --growth"), "{spot}");
    // Said at the start too, in one line.
    let said: Vec<&str> =
        outcome.stderr.lines().filter(|line| line.contains("before memprof traced its pages")).collect();
    assert!(matches!(&said[..], [line] if line.starts_with("memprof: not seen in pid ")), "{}", outcome.stderr);
}

/// `attach --growth` for 2 s to the fixture `growth MODE`: its outcome, its final report and
/// the numbers in the line of truth the fixture prints once memprof has gone. The first is the
/// huge pages' bytes the fixture got, which must be `huge` (as the kernel's THP setting allows).
fn attach_to_huge_pages(mode: &str, huge: u64) -> (Outcome, Value, Vec<u64>) {
    let mut target = Waiting::start(&fixture("growth"), &[mode]);
    let outcome = attach(&mut target, &["--growth", "--interval", "60", "--duration", "2"]);
    assert!(outcome.status.success(), "{outcome:?}");
    let mut truth = String::new();
    BufReader::new(target.child.stdout.as_mut().unwrap()).read_line(&mut truth).unwrap();
    let numbers: Vec<u64> = truth.split_whitespace().filter_map(|word| word.parse().ok()).collect();
    let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    assert_eq!(
        numbers.first(),
        Some(&huge),
        "the kernel gave the fixture fewer huge pages than asked (THP: {thp}): {truth}"
    );
    let report = outcome.final_report();
    (outcome, report, numbers)
}

#[test]
fn attach_sees_the_leaking_site_on_glibc_and_jemalloc() {
    for fixture in [fixture("growth"), jemalloc_fixture()] {
        let mut target = Waiting::start(&fixture, &[]);
        let outcome = attach(&mut target, &["--growth", "--interval", "60"]);
        assert_growth(&outcome, &target.next_line());
    }
}

#[test]
fn the_table_says_what_growth_mode_sees() {
    let output = std::process::Command::new(memprof_tests::memprof_bin())
        .args(["run", "--growth", "--interval", "60", "--", fixture("growth").to_str().unwrap()])
        .output()
        .expect("starting memprof");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("growth: pages of anonymous memory by the stack that first touched each"), "{stdout}");
}

#[test]
fn growth_and_sampling_do_not_mix() {
    let outcome = memprof_tests::memprof(&["run", "--growth", "--sample-bytes", "4096", "--", "true"]);
    assert_eq!(outcome.status.code(), Some(2), "{outcome:?}");
    assert!(outcome.stderr.contains("cannot be used with"), "{}", outcome.stderr);
}

/// A forked child is traced from its fork, as a process attached while it runs: the pages it
/// inherited are its parent's first touches, and its copies of them on write are not growth.
/// Only the pages it maps and touches itself are.
#[test]
fn a_forked_child_grows_by_its_own_pages_not_its_copies_of_its_parents() {
    let program = fixture("growth");
    let mut memprof = std::process::Command::new(memprof_tests::memprof_bin());
    memprof.args(["run", "--json", "--growth", "--interval", "60", "--", program.to_str().unwrap(), "fork"]);
    memprof.stdin(std::process::Stdio::piped());
    let outcome = memprof_tests::released(memprof, &["child of pid".to_string()], |memprof| {
        use std::io::Write as _;
        memprof.stdin.as_mut().expect("piped").write_all(b"go\n").expect("releasing the child");
    });
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert_eq!(through(&report, "parent_pages"), (64 * PAGE, 64), "{report}");
    let child = &report["children"][0];
    assert_eq!(through(child, "child_pages"), (32 * PAGE, 32), "{child}");
    // Its 64 copies on write held no page: nothing but its own pages.
    assert_eq!(child["totals"]["outstanding_bytes"], 32 * PAGE, "{child}");
}

/// Where the kernel refuses `fexit` programs, a static program whose wrappers memprof cannot find
/// has its mapping calls read at every system call when traced by its pages, and a dynamic one
/// beside it by probes of its own at its C library: each call of the dynamic one is read once, or
/// the second read of its `mremap` would take the moved range from it. Its pages are all held, by
/// the stacks that touched them.
#[test]
fn a_range_moved_by_mremap_keeps_its_pages_beside_a_program_read_at_every_system_call() {
    let flags = ["-g", "-O0", "-fno-omit-frame-pointer"];
    let resting = Waiting::start(&fixture_musl_unnamed_mmap("malloc_loop.c", "growth_unnamed_mmap", &flags), &[]);
    let moving = Waiting::start(&fixture("growth_remap"), &[]);
    let (resting_pid, moving_pid) = (resting.pid().to_string(), moving.pid().to_string());
    let daemon = Daemon::start(&["--growth", "--pid", &resting_pid, "--pid", &moving_pid]);
    daemon.wait_traced(resting.pid());
    daemon.wait_traced(moving.pid());
    if memprof_tests::kernel_refuses_fexit() {
        assert_eq!(daemon.machine_wide_programs("system_calls"), Some(1), "the unnamed one's calls are read so");
    }
    moved_range_held(moving, &daemon, Duration::ZERO);
}

/// A daemon under `--growth` runs nothing for every process on the machine until it has a process
/// to trace by its pages: the programs at every page fault come with its first target.
#[test]
fn a_growth_daemon_runs_nothing_for_every_process_before_its_first_target() {
    let daemon = Daemon::start(&["--growth", "--comm", "^gwfirst_"]);
    assert_eq!(daemon.machine_wide_links(), [0, 0, 0]);
    assert_eq!(daemon.machine_wide_programs("page_faults"), Some(0));
    let remap = fixture_with("growth_remap.c", "gwfirst_remap", &["-g", "-O0", "-fno-omit-frame-pointer", "-pthread"]);
    let first = Waiting::start(&remap, &[]);
    daemon.wait_traced(first.pid());
    wait_for(20, "the first target to bring them", || {
        (daemon.machine_wide_programs("page_faults") == Some(1)).then_some(())
    });
    assert_eq!(daemon.machine_wide_links()[0], 1, "no link at the page faults");
    moved_range_held(first, &daemon, Duration::ZERO);
}

/// The programs that read every process's mapping calls go with the last process traced by its
/// pages that needs them, and those at every page fault with the last process traced by its
/// pages, under `--growth` too. Where the kernel refuses `fexit` programs, a static program whose
/// wrappers memprof cannot find has every system call on the host read while it is traced; once
/// it exits, that program goes, and the dynamic one beside it, whose own probes read its calls,
/// keeps its ranges and pages. Where the kernel takes them, they read the dynamic one's calls
/// too, and stay. Once the dynamic one exits too, nothing runs for every process; the next one
/// traced brings them back.
#[test]
fn machine_wide_programs_go_with_the_last_process_that_needs_them() {
    // Names of their own: the daemon's rule must match no other test's process.
    let flags = ["-g", "-O0", "-fno-omit-frame-pointer"];
    let unnamed = fixture_musl_unnamed_mmap("malloc_loop.c", "gwlast_static", &flags);
    let remap = fixture_with("growth_remap.c", "gwlast_remap", &["-g", "-O0", "-fno-omit-frame-pointer", "-pthread"]);
    let resting = Waiting::start(&unnamed, &[]);
    let moving = Waiting::start(&remap, &[]);
    let daemon = Daemon::start(&["--growth", "--comm", "^gwlast_"]);
    daemon.wait_traced(resting.pid());
    daemon.wait_traced(moving.pid());
    let refused = memprof_tests::kernel_refuses_fexit();
    let calls_at = if refused { "system_calls" } else { "mapping_calls" };
    // Links of the system-call tracepoint and the `fexit` programs, and of the page faults.
    let call_links = || daemon.machine_wide_links()[1..].iter().sum::<usize>();
    let fault_links = || daemon.machine_wide_links()[0];
    wait_for(20, "/metrics to say the machine-wide programs", || {
        (daemon.machine_wide_programs(calls_at) == Some(1) && daemon.machine_wide_programs("page_faults") == Some(1))
            .then_some(())
    });
    assert!(call_links() >= 1, "no link reads the mapping calls");
    let gone = resting.pid() as u64;
    drop(resting);
    wait_for(20, "the static program to be let go", || (!daemon.traced_pids().contains(&gone)).then_some(()));
    wait_for(20, "the programs for every process's calls to go, or stay for the dynamic one", || {
        (daemon.machine_wide_programs(calls_at) == Some(u64::from(!refused))).then_some(())
    });
    assert_eq!(call_links() == 0, refused, "{} links read the mapping calls", call_links());
    // The static program's entries are purged at the next interval, likely while the dynamic
    // one's page events wait in their ring: their stacks must stay.
    moved_range_held(moving, &daemon, Duration::from_secs(3));
    wait_for(20, "every machine-wide program to go with the last process", || {
        (daemon.machine_wide_programs(calls_at) == Some(0) && daemon.machine_wide_programs("page_faults") == Some(0))
            .then_some(())
    });
    assert_eq!((call_links(), fault_links()), (0, 0));
    let next = Waiting::start(&remap, &[]);
    daemon.wait_traced(next.pid());
    wait_for(20, "the next process to bring them back", || {
        (daemon.machine_wide_programs("page_faults") == Some(1)).then_some(())
    });
    moved_range_held(next, &daemon, Duration::ZERO);
}

/// A static program's mapping calls are read at its own copy of its C library's wrappers, where
/// the kernel refuses `fexit` programs: nothing runs at other processes' system calls for it, and
/// the range it moves by `mremap` keeps its pages.
#[test]
fn a_static_programs_mapping_calls_are_read_at_its_own_wrappers() {
    // An allocator linked in: the daemon traces a process with one it knows.
    let program = fixture_musl("growth_remap.c", "growth_remap_static", &["-g", "-O0", "-Wl,-u,malloc,-u,free"]);
    let moving = Waiting::start(&program, &[]);
    let daemon = Daemon::start(&["--growth", "--pid", &moving.pid().to_string()]);
    daemon.wait_traced(moving.pid());
    assert_eq!(daemon.machine_wide_programs("system_calls"), Some(0));
    moved_range_held(moving, &daemon, Duration::ZERO);
}

/// Lets `growth_remap.c`, traced by its pages by `daemon`, touch 2 pages, move their range by
/// `mremap` and touch 4 more: each stack holds its own, and none was touched outside the ranges.
/// The report is read `settled` after the pages are touched.
fn moved_range_held(mut moving: Waiting, daemon: &Daemon, settled: Duration) {
    let pid = moving.pid();
    moving.go();
    let mut line = String::new();
    BufReader::new(moving.child.stdout.as_mut().expect("piped")).read_line(&mut line).expect("reading the fixture");
    assert_eq!(line, "held\n");
    std::thread::sleep(settled);
    let report = wait_for(10, "the moved range's pages in a report", || {
        let (_, report) = daemon.get_json(&format!("/api/v1/leaks?pid={pid}"));
        (through(&report, "grow_and_touch").1 > 0).then_some(report)
    });
    assert_eq!(through(&report, "first_touch"), (2 * PAGE, 2), "{report}");
    assert_eq!(through(&report, "grow_and_touch"), (4 * PAGE, 4), "{report}");
    assert_eq!(report["growth"]["outside_pages"], 0, "{report}");
}
