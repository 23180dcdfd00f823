//! Sampled mode on a process with known truth: estimates within 10% for sites with 100,000
//! allocations, frees that take off exactly what was added, and the --max-rate switch (to
//! sampling under `run`, to growth mode in the daemon).

use std::path::Path;

use memprof_tests::{
    fixture, fixture_musl, fixture_musl_unnamed_mmap, fixture_with, probe_links, run, site, total, wait_for, Daemon,
    Waiting,
};

fn within_10_percent(estimate: u64, truth: u64, what: &str) {
    let error = (estimate as f64 - truth as f64).abs() / truth as f64;
    assert!(error <= 0.10, "{what}: estimated {estimate}, truth {truth} ({:.1}% off)", error * 100.0);
}

#[test]
fn sampled_estimates_are_within_10_percent() {
    let outcome = run(&["--sample-bytes", "4096", "--interval", "60"], &[fixture("sampled_sites").to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert_eq!(report["sample_bytes"], 4096);
    let (small_bytes, small_count) = site(&report, "keep_small");
    within_10_percent(small_bytes, 100_000 * 64, "keep_small bytes");
    within_10_percent(small_count, 100_000, "keep_small allocations");
    let (medium_bytes, medium_count) = site(&report, "keep_medium");
    within_10_percent(medium_bytes, 100_000 * 200, "keep_medium bytes");
    within_10_percent(medium_count, 100_000, "keep_medium allocations");
    // Every churn block was freed: a free takes off exactly what its allocation added.
    assert_eq!(site(&report, "churn"), (0, 0));
    let churned = report["stacks"].as_array().unwrap().iter().find(|s| s["frames"][0]["function"] == "churn");
    assert!(churned.is_none(), "nothing outstanding at churn: {report}");
    within_10_percent(total(&report, "allocations"), 400_000, "all allocations");
    assert_eq!(total(&report, "unknown_frees"), 0, "unrecorded blocks' frees are expected, not unknown");
}

/// glibc's memalign, realloc(NULL, n) and reallocarray(NULL, ...) call malloc inside them: the
/// call and its malloc are one allocation, drawn once (each was estimated about twice, three
/// times through reallocarray).
#[test]
fn a_call_that_calls_malloc_inside_is_drawn_once() {
    let outcome = run(&["--sample-bytes", "4096", "--interval", "60"], &[fixture("sampled_nesting").to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    for function in ["keep_memalign", "keep_realloc_null", "keep_reallocarray_null"] {
        let (bytes, count) = site(&report, function);
        within_10_percent(bytes, 100_000 * 64, &format!("{function} bytes"));
        within_10_percent(count, 100_000, &format!("{function} allocations"));
    }
    within_10_percent(total(&report, "allocations"), 300_000, "all allocations");
}

#[test]
fn the_table_says_it_is_sampled() {
    let fixture = fixture("sampled_sites");
    let output = std::process::Command::new(memprof_tests::memprof_bin())
        .args(["run", "--sample-bytes", "4096", "--interval", "60", "--", fixture.to_str().unwrap()])
        .output()
        .expect("starting memprof");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("sampled: one allocation in every 4.0 KiB recorded; counts and bytes are estimates"),
        "{stdout}"
    );
}

#[test]
fn a_process_above_max_rate_switches_to_sampling() {
    let outcome = run(&["--max-rate", "1000", "--interval", "0.1"], &[fixture("sampled_sites").to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    assert!(
        outcome.stderr.contains("more than --max-rate: sampling one in every 65536 bytes from now on"),
        "{}",
        outcome.stderr
    );
    let report = outcome.final_report();
    assert_eq!(report["sample_bytes"], 65536);
    let early = &outcome.reports()[0];
    assert_eq!(early["sample_bytes"], 0, "every call is recorded until the rate is measured: {early}");
    // A sample of blocks would make their pages look emptier than they are: not read, and no age
    // says a reading was made.
    let reports = outcome.reports();
    let sampled: Vec<_> = reports.iter().filter(|r| r["sample_bytes"] == 65536 && r["memory"].is_object()).collect();
    assert!(!sampled.is_empty(), "{}", outcome.stdout);
    assert!(sampled.iter().all(|r| r["memory"].get("pinned_age_s").is_none()), "{}", outcome.stdout);
}

/// The daemon's guard: a process above `max_rate` is traced by its pages from then on (growth
/// mode, whose cost does not follow its calls), and its metrics and reports say so.
#[test]
fn the_daemon_traces_a_process_above_max_rate_by_its_pages() {
    let mut target = memprof_tests::Waiting::start(&fixture("leak_kinds"), &["2"]);
    let pid = target.pid();
    let args = ["--pid", &pid.to_string(), "--max-rate", "20", memprof_tests::MOVES_TO_PAGES_ANYWHERE];
    let daemon = memprof_tests::Daemon::start(&args);
    daemon.wait_traced(pid);
    target.go();
    let series = format!("memprof_growth_mode{{pid=\"{pid}\",comm=\"leak_kinds\"}}");
    memprof_tests::wait_for(15, "the process to be traced by its pages", || {
        (memprof_tests::metric(daemon.port, &series)? == 1).then_some(())
    });
    let (_, report) = daemon.get_json(&format!("/api/v1/leaks?pid={pid}"));
    assert_eq!(report["sample_bytes"], 0, "{report}");
    assert!(report["growth"].is_object(), "{report}");
}

/// The daemon at `--max-rate 1000` on a busy build of `malloc_loop.c`, `program`, whose comm is
/// `comm`: whether it moved the loop to its pages (else it sampled it), the loop, and the daemon.
fn busy_loop_moved_or_sampled(program: &Path, comm: &str) -> (bool, Waiting, Daemon) {
    let mut target = Waiting::start(program, &["--pairs=1000000000"]);
    let pid = target.pid();
    let daemon = Daemon::start(&["--pid", &pid.to_string(), "--max-rate", "1000"]);
    daemon.wait_traced(pid);
    target.go();
    let growth = format!("memprof_growth_mode{{pid=\"{pid}\",comm=\"{comm}\"}}");
    let sampled = format!("memprof_sample_bytes{{pid=\"{pid}\",comm=\"{comm}\"}}");
    let moved = wait_for(30, "the busy loop to be sampled or traced by its pages", || {
        if memprof_tests::metric(daemon.port, &growth)? == 1 {
            return Some(true);
        }
        (memprof_tests::metric(daemon.port, &sampled)? == 65536).then_some(false)
    });
    (moved, target, daemon)
}

/// Where the kernel refuses `fexit` programs, growth mode reads a process's mapping calls by
/// probes of its own at its wrappers of them: its C library's, or a static program's own copy.
/// The daemon moves a busy program to its pages there too, and nothing runs at other processes'
/// system calls for it.
#[test]
fn the_daemon_moves_a_busy_process_to_its_pages_reading_its_mapping_calls_at_its_own_wrappers() {
    let static_loop = fixture_musl("malloc_loop.c", "static_loop", &["-g", "-O0", "-fno-omit-frame-pointer"]);
    for (program, comm) in [(fixture("malloc_loop"), "malloc_loop"), (static_loop, "static_loop")] {
        let (moved, target, mut daemon) = busy_loop_moved_or_sampled(&program, comm);
        assert!(moved, "{comm}: sampled, not moved");
        let [faults, system_calls, fexit] = daemon.machine_wide_links();
        assert_eq!((faults, system_calls), (1, 0), "{comm}: {:?}", probe_links::descriptions(daemon.child.id()));
        let said = |at: &str| daemon.machine_wide_programs(at);
        assert_eq!(said("system_calls"), Some(0), "{comm}");
        if memprof_tests::kernel_refuses_fexit() {
            assert_eq!((fexit, said("mapping_calls")), (0, Some(0)), "{comm}");
        }
        let (_, report) = daemon.get_json(&format!("/api/v1/leaks?pid={}", target.pid()));
        assert!(report["growth"].is_object(), "{comm}: {report}");
        let log = daemon.stopped_log();
        assert!(!log.contains("this kernel refuses fexit programs ("), "{comm}: {log}");
    }
}

/// Where the kernel refuses `fexit` programs, growth mode would read the mapping calls of a
/// static program whose wrappers memprof cannot find at every system call on the machine: there
/// the daemon samples it above `max_rate` instead, says so once with what moves it all the same,
/// and attaches nothing that runs for other processes. Elsewhere it moves it to its pages.
#[test]
fn the_daemon_samples_a_busy_program_without_mapping_wrappers_where_growth_mode_would_slow_every_system_call() {
    let flags = ["-g", "-O0", "-fno-omit-frame-pointer"];
    let program = fixture_musl_unnamed_mmap("malloc_loop.c", "unnamed_mmap_loop", &flags);
    let (moved, target, mut daemon) = busy_loop_moved_or_sampled(&program, "unnamed_mmap_lo");
    let pid = target.pid();
    if moved {
        assert!(!memprof_tests::kernel_refuses_fexit(), "moved to its pages on a kernel that refuses fexit programs");
        return;
    }
    assert!(memprof_tests::kernel_refuses_fexit(), "sampled on a kernel that takes fexit programs");
    // Intervals in which it could have been moved, or said again.
    std::thread::sleep(std::time::Duration::from_secs(2));
    let growth = format!("memprof_growth_mode{{pid=\"{pid}\",comm=\"unnamed_mmap_lo\"}}");
    assert_eq!(memprof_tests::metric(daemon.port, &growth), Some(0));
    assert_eq!(daemon.machine_wide_links(), [0, 0, 0], "{:?}", probe_links::descriptions(daemon.child.id()));
    for at in ["page_faults", "mapping_calls", "system_calls"] {
        assert_eq!(daemon.machine_wide_programs(at), Some(0), "{at}");
    }
    let (_, report) = daemon.get_json(&format!("/api/v1/leaks?pid={pid}"));
    assert_eq!(report["sample_bytes"], 65536, "{report}");
    assert!(report["growth"].is_null(), "{report}");
    let log = daemon.stopped_log();
    let said = "above max_rate: sampled one in every 65536 bytes from now on, not moved to growth mode: growth mode \
                would slow every system call on this host: its kernel refuses fexit programs and the process maps \
                memory through no wrapper memprof can probe";
    assert_eq!(log.matches(said).count(), 1, "{log}");
}

/// The daemon given no `max_rate` moves a process making more than its default rate of allocator
/// calls to growth mode, as on a busy service; its metrics and reports say so, and say the 4 MiB
/// the process held at the switch, which growth mode cannot see into.
#[test]
fn the_daemons_default_rate_moves_a_busy_process_to_its_pages() {
    // About a billion pairs: far more than the default rate while traced call by call, and still
    // running when the test looks, long after the switch. 4 MiB held first, after the attach.
    let args = ["--pairs=1000000000", "--hold=4194304"];
    let mut target = memprof_tests::Waiting::start(&fixture("malloc_loop"), &args);
    let pid = target.pid();
    let args = ["--pid", &pid.to_string(), memprof_tests::MOVES_TO_PAGES_ANYWHERE];
    let mut daemon = memprof_tests::Daemon::start_at_default_rate(&args);
    daemon.wait_traced(pid);
    target.go();
    // Each view until the switch names its stacks: the one built as the switch takes them too.
    let report = memprof_tests::wait_for(30, "the busy process to be traced by its pages", || {
        let (_, report) = daemon.get_json(&format!("/api/v1/leaks?pid={pid}"));
        if report["growth"].is_object() {
            return Some(report);
        }
        let unnamed = report["stacks"].as_array()?.iter().any(|s| s["frames"].as_array().is_none_or(|f| f.is_empty()));
        assert!(!unnamed, "a stack without frames: {report}");
        std::thread::sleep(std::time::Duration::from_millis(20));
        None
    });
    let series = format!("memprof_growth_mode{{pid=\"{pid}\",comm=\"malloc_loop\"}}");
    assert_eq!(memprof_tests::metric(daemon.port, &series), Some(1));
    assert_eq!(report["sample_bytes"], 0, "{report}");
    assert!(report["growth"].is_object(), "{report}");
    // What it held at the switch, not at the attach (under 1 MiB: no blind spot then).
    let spots = report["blind_spots"].as_array().expect("blind_spots");
    let [spot] = &spots[..] else { panic!("one blind spot: {report}") };
    assert_eq!(spot["kind"], "held_before_pages", "{spot}");
    assert!((4 << 20..5 << 20).contains(&memprof_tests::held_before_bytes(&report)), "{spot}");
    // Its blocks are no longer kept: an inspection says so, not that it holds none.
    let socket = daemon.socket.to_str().unwrap().to_string();
    let inspect = memprof_tests::memprof(&["inspect", "-p", &pid.to_string(), "--daemon", &socket]);
    assert_eq!(inspect.status.code(), Some(1), "{inspect:?}");
    assert_eq!(inspect.stderr.lines().count(), 1, "{}", inspect.stderr);
    assert!(
        inspect.stderr.contains(&format!(
            "pid {pid} has no blocks to inspect: it is traced by the pages it touches (growth mode)"
        )),
        "{}",
        inspect.stderr
    );
    // The switch's line in the log says it too.
    let log = daemon.stopped_log();
    assert!(log.contains("(growth mode); not seen: up to 4."), "{log}");
}

/// A process the daemon moved to its pages stays so through an exec: its new program is traced
/// by the pages it touches from its start. `growth` keeps 100 blocks of 64 KiB in `leak_pages`,
/// written whole: that many bytes, give or take the pages its blocks share with others (a page or
/// two of block headers).
#[test]
fn a_process_the_daemon_moved_to_its_pages_stays_so_through_an_exec() {
    const LEAKED: u64 = 100 * 64 * 1024;
    const SLACK: u64 = 3 * 4096;
    let growth = fixture("growth");
    let loop_args = ["--pairs=0", "--seconds=5", "--exec", growth.to_str().unwrap(), "--wait", "stay"];
    let mut target = Waiting::start(&fixture("malloc_loop"), &loop_args);
    let pid = target.pid();
    let args = ["--pid", &pid.to_string(), "--max-rate", "20", memprof_tests::MOVES_TO_PAGES_ANYWHERE];
    let daemon = memprof_tests::Daemon::start(&args);
    daemon.wait_traced(pid);
    target.go();
    let leaks = format!("/api/v1/leaks?pid={pid}");
    wait_for(30, "the loop to be traced by its pages", || {
        daemon.get_json(&leaks).1["growth"].is_object().then_some(())
    });
    // The loop execs `growth`, which waits until it is traced.
    wait_for(30, "growth's program to be traced by its pages", || {
        let (_, report) = daemon.get_json(&leaks);
        let exe = report["exe"].as_str().unwrap_or_default();
        (exe.ends_with("/growth") && report["growth"].is_object()).then_some(())
    });
    target.go();
    while target.next_line() != "leaked" {}
    let report = wait_for(30, "the leak to be seen", || {
        let (_, report) = daemon.get_json(&leaks);
        let (leaked, _) = memprof_tests::through(&report, "leak_pages");
        (leaked >= LEAKED - SLACK).then_some(report)
    });
    assert!(report["growth"].is_object(), "{report}");
    let (leaked, _) = memprof_tests::through(&report, "leak_pages");
    assert!(leaked <= LEAKED + SLACK, "leak_pages holds {leaked} bytes: {report}");
}

/// A switch to growth mode takes a running process's allocator probes away. Its frees must go
/// first: a free seen once its allocations no longer are finds an address it reused meanwhile
/// among the recent frees, and passes for a double free. Four busy loops, each switched: none
/// has one, in its report or in the daemon's log.
#[test]
fn a_switch_to_growth_mode_finds_no_double_free() {
    let mut targets: Vec<Waiting> =
        (0..4).map(|_| Waiting::start(&fixture("malloc_loop"), &["--pairs=1000000000"])).collect();
    let pids: Vec<String> = targets.iter().map(|target| target.pid().to_string()).collect();
    let mut args: Vec<&str> = pids.iter().flat_map(|pid| ["--pid", pid.as_str()]).collect();
    args.extend(["--max-rate", "1000", memprof_tests::MOVES_TO_PAGES_ANYWHERE]);
    let mut daemon = Daemon::start(&args);
    for target in &mut targets {
        daemon.wait_traced(target.pid());
        target.go();
    }
    for pid in &pids {
        let series = format!("memprof_growth_mode{{pid=\"{pid}\",comm=\"malloc_loop\"}}");
        wait_for(30, "each loop to be traced by its pages", || {
            (memprof_tests::metric(daemon.port, &series)? == 1).then_some(())
        });
    }
    // Two intervals more: the double-free events of the switch are read by then.
    std::thread::sleep(std::time::Duration::from_secs(2));
    for pid in &pids {
        let (_, report) = daemon.get_json(&format!("/api/v1/leaks?pid={pid}"));
        assert_eq!(report["double_frees"], serde_json::json!([]), "pid {pid}");
    }
    let log = daemon.stopped_log();
    assert!(!log.contains("double free"), "{log}");
}

/// With links shared per file, a process switched to growth mode still takes their traps (they
/// fire in every process that maps the file), but they record its calls no more: its call totals
/// stand still. Another traced process keeps the links in use.
#[test]
fn shared_links_stop_recording_a_process_switched_to_growth_mode() {
    let mut busy = Waiting::start(&fixture("malloc_loop"), &["--pairs=1000000000"]);
    let idle = Waiting::start(&fixture("malloc_loop"), &[]);
    let pids = [busy.pid().to_string(), idle.pid().to_string()];
    let daemon = Daemon::start(&[
        "--pid",
        &pids[0],
        "--pid",
        &pids[1],
        "--probe-links",
        "shared",
        "--max-rate",
        "1000",
        memprof_tests::MOVES_TO_PAGES_ANYWHERE,
    ]);
    daemon.wait_traced(busy.pid());
    daemon.wait_traced(idle.pid());
    busy.go();
    let series = format!("memprof_growth_mode{{pid=\"{}\",comm=\"malloc_loop\"}}", pids[0]);
    wait_for(30, "the busy loop to be traced by its pages", || {
        (memprof_tests::metric(daemon.port, &series)? == 1).then_some(())
    });
    let allocations = || {
        let (_, report) = daemon.get_json(&format!("/api/v1/leaks?pid={}", pids[0]));
        report["totals"]["allocations"].as_u64().unwrap()
    };
    // An interval for what the switch left, then two more to count again.
    std::thread::sleep(std::time::Duration::from_secs(1));
    let before = allocations();
    std::thread::sleep(std::time::Duration::from_secs(2));
    assert_eq!(allocations(), before, "its calls are still recorded");
}

/// The programs growth mode runs for every process on the machine (at each page fault, and at the
/// mapping calls, or at every system call where the kernel refuses `fexit` programs) are attached
/// only while a process is traced by its pages: they go when the busy process switched to them
/// exits, and come back for the next one.
#[test]
fn growth_modes_programs_for_the_whole_machine_go_with_its_last_process() {
    let loop_program = fixture_with("malloc_loop.c", "wholehost_loop", &["-g", "-O0", "-fno-omit-frame-pointer"]);
    // A low rate, so that the loop is switched even where traps are slow (an emulated kernel).
    // Where the kernel refuses `fexit` programs, the move needs `--mappings`, whose programs at
    // every system call then stay: those at the page faults still come and go.
    let refused = memprof_tests::kernel_refuses_fexit();
    let mut args = vec!["--comm", "wholehost_loop", "--max-rate", "1000"];
    args.extend(refused.then_some(memprof_tests::MOVES_TO_PAGES_ANYWHERE));
    let daemon = Daemon::start(&args);
    // Links of the page-fault tracepoints, and of the system-call tracepoint and the `fexit` programs.
    let machine_wide = || {
        let [faults, system_calls, fexit] = daemon.machine_wide_links();
        (faults, system_calls + fexit)
    };
    for round in ["first", "second"] {
        let mut target = Waiting::start(&loop_program, &["--pairs=1000000000"]);
        let pid = target.pid();
        daemon.wait_traced(pid);
        target.go();
        let series = format!("memprof_growth_mode{{pid=\"{pid}\",comm=\"wholehost_loop\"}}");
        wait_for(30, "the busy process to be traced by its pages", || {
            (memprof_tests::metric(daemon.port, &series)? == 1).then_some(())
        });
        let (faults, mapping_calls) = machine_wide();
        assert!(
            faults == 1 && mapping_calls >= 1,
            "{round} process: {faults} fault links, {mapping_calls} mapping-call links"
        );
        let said = |at: &str| daemon.machine_wide_programs(at);
        wait_for(30, "/metrics to say the programs at the page faults", || (said("page_faults")? == 1).then_some(()));
        drop(target);
        wait_for(30, "the machine-wide programs to go with the last process traced by its pages", || {
            (machine_wide() == (0, usize::from(refused))).then_some(())
        });
        wait_for(30, "/metrics to say they went", || {
            let running = ["page_faults", "mapping_calls", "system_calls"].map(said);
            (running == [Some(0), Some(0), Some(u64::from(refused))]).then_some(())
        });
    }
}

/// Resizes of recorded blocks into blocks not drawn are neither failures nor unknown frees, and
/// the blocks they free come off exactly (8 threads, each resizing and freeing its own block).
#[test]
fn sampled_resizes_are_not_failures() {
    let outcome = run(&["--sample-bytes", "4096", "--interval", "60"], &[fixture("sampled_realloc").to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert_eq!(total(&report, "failed_allocations"), 0, "{}", report["totals"]);
    assert_eq!(total(&report, "unknown_frees"), 0, "{}", report["totals"]);
    assert_eq!(site(&report, "resize"), (0, 0), "every resized block was freed");
    assert!(total(&report, "allocations") > 0, "some resizes were drawn: {}", report["totals"]);
}

/// Two sampling processes whose pids share a slot of the programs' rate array (pid mod 4096):
/// the one that does not hold the slot reads its rate from the hash, before and after the holder
/// exits. A process that read no rate would be recorded whole: its sites' bytes would not be a
/// multiple of the rate, which each sample of a block smaller than it counts for.
#[test]
fn processes_whose_pids_share_a_rate_slot_both_sample() {
    let fixture = fixture("sampled_sites");
    let mut first = Waiting::start(&fixture, &["hold"]);
    let mut second = colliding(&fixture, first.pid());
    let pids = [first.pid().to_string(), second.pid().to_string()];
    let daemon = Daemon::start(&["--pid", &pids[0], "--pid", &pids[1], "--sample-bytes", "4096"]);
    daemon.wait_traced(first.pid());
    daemon.wait_traced(second.pid());
    let sampled_whole = |pid: u32| {
        let path = format!("/api/v1/leaks?pid={pid}");
        wait_for(30, "the kept sites' estimates", || {
            let (_, report) = daemon.get_json(&path);
            let (small, medium) = (site(&report, "keep_small"), site(&report, "keep_medium"));
            let near = |estimate: u64, truth: u64| estimate.abs_diff(truth) * 10 <= truth;
            (near(small.0, 100_000 * 64) && near(medium.0, 100_000 * 200)).then_some((report, small, medium))
        })
    };
    first.go();
    let (report, small, medium) = sampled_whole(first.pid());
    assert_eq!((small.0 % 4096, medium.0 % 4096), (0, 0), "{report}");
    assert_eq!(total(&report, "unknown_frees"), 0, "{report}");
    // The first leaves; the slot's holder, or the process the slot counts as collided, is gone.
    let gone = first.pid() as u64;
    drop(first);
    wait_for(20, "the first process to be purged", || (!daemon.traced_pids().contains(&gone)).then_some(()));
    second.go();
    let (report, small, medium) = sampled_whole(second.pid());
    assert_eq!((small.0 % 4096, medium.0 % 4096), (0, 0), "{report}");
    assert_eq!(total(&report, "unknown_frees"), 0, "{report}");
}

/// `fixture`, waiting, as a process whose pid is `pid` mod 4096: the kernel gives the next
/// process the pid after `ns_last_pid` (other processes may start meanwhile: tried again).
fn colliding(fixture: &std::path::Path, pid: u32) -> Waiting {
    let pid_max: u32 = std::fs::read_to_string("/proc/sys/kernel/pid_max").unwrap().trim().parse().unwrap();
    for attempt in 1..=20 {
        let wanted = (pid + 4096 * (attempt % 4 + 1)) % pid_max.max(8192);
        if wanted < 300 {
            continue;
        }
        std::fs::write("/proc/sys/kernel/ns_last_pid", (wanted - 1).to_string()).unwrap();
        let started = Waiting::start(fixture, &["hold"]);
        if started.pid() % 4096 == pid % 4096 {
            return started;
        }
    }
    panic!("no process got a pid equal to {pid} mod 4096 in 20 tries");
}
