//! Attaching to running processes: allocations made before attach, exits, double frees, reuse.

use std::process::Command;

use memprof_tests::{
    assert_nothing_dropped, attach, attach_with, fixture, memprof_bin, run, run_with_env, site, total, wait_for,
    Daemon, Waiting,
};

#[test]
fn allocations_from_before_attach_freed_after_are_unknown_frees() {
    let mut target = Waiting::start(&fixture("lifecycle"), &["prior"]);
    let outcome = attach(&mut target, &["--interval", "60"]);
    assert!(outcome.status.success(), "memprof exits 0 when its target exits: {outcome:?}");
    let report = outcome.final_report();
    assert_eq!(total(&report, "unknown_frees"), 100);
    assert_eq!(total(&report, "internal_frees"), 0, "the program freed them, not the C library");
    assert_eq!(site(&report, "after_attach"), (320, 10));
    assert_eq!(site(&report, "before_attach"), (0, 0));
    assert_eq!(total(&report, "outstanding_bytes"), 320);
    assert_eq!(total(&report, "frees"), 0, "frees of unknown blocks are not charged to any stack");
    assert_nothing_dropped(&report);
}

/// By default the first free keeps only its caller; the allocation and the second free are
/// walked whole.
#[test]
fn a_double_free_is_reported_with_three_stacks_even_when_glibc_aborts() {
    let df = double_free(&[]);
    assert_eq!(df["first_free"]["frames"].as_array().unwrap().len(), 1, "only the caller of free: {df}");
    assert_eq!(df["first_free"]["truncated"], true, "{df}");
    assert_eq!(df["first_free"]["caller_only"], true, "{df}");
    for which in ["alloc", "second_free"] {
        assert_eq!(df[which]["frames"][1]["function"], "main", "{which}: {df}");
        assert!(df[which].get("caller_only").is_none(), "{which}: {df}");
    }
}

#[test]
fn full_free_stacks_show_the_first_free_whole() {
    let df = double_free(&["--full-free-stacks"]);
    for which in ["alloc", "first_free", "second_free"] {
        assert_eq!(df[which]["frames"][1]["function"], "main", "{which}: {df}");
    }
}

/// The lifecycle fixture's double free under `memprof run ARGS`: its one report, checked for
/// what every mode shows.
fn double_free(args: &[&str]) -> serde_json::Value {
    let outcome = run(args, &[fixture("lifecycle").to_str().unwrap(), "double-free"]);
    assert_eq!(outcome.status.code(), Some(128 + 6), "memprof exits like its command (SIGABRT): {outcome:?}");
    the_one_double_free(&outcome.final_report())
}

/// A followed child that aborts on a double free has its report read as it exits, before the
/// end: the double free is in it, with its three stacks (the event comes just before the exit).
#[test]
fn a_childs_double_free_is_in_its_report_when_it_aborts_on_it() {
    let outcome = run(&["--interval", "60"], &[fixture("lifecycle").to_str().unwrap(), "child-double-free"]);
    assert!(outcome.status.success(), "the child aborted: {outcome:?}");
    let report = outcome.final_report();
    let child = &report["children"][0];
    assert_eq!(child["exited"], true, "{report}");
    the_one_double_free(child);
}

/// A double free just before an exec is a fact of the process: it stays in `run`'s report of
/// the program exec'd, with the frames of the program that made it; the daemon logs it so and
/// keeps it.
#[test]
fn a_double_free_just_before_an_exec_stays_in_the_report() {
    let preload = ("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libmimalloc.so.2.0");
    let outcome = run_with_env(&[preload], &[], &[fixture("lifecycle").to_str().unwrap(), "double-free-exec"]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert!(report["exe"].as_str().is_some_and(|exe| exe.ends_with("/sleep")), "{report}");
    the_one_double_free(&report);

    // The daemon logs it with the same frames.
    let mut command = std::process::Command::new(fixture("lifecycle"));
    command.env(preload.0, preload.1).args(["--wait", "double-free-exec"]);
    let mut target = Waiting::start_command(command);
    let mut daemon = Daemon::start(&["--pid", &target.pid().to_string()]);
    daemon.wait_traced(target.pid());
    target.go();
    // The program exec'd keeps it.
    wait_for(30, "sleep to be traced with the double free", || {
        let (_, targets) = daemon.get_json("/api/v1/targets");
        let sleep = targets.as_array()?.iter().find(|t| t["comm"] == "sleep")?.clone();
        (sleep["double_frees"] == 1).then_some(())
    });
    assert!(target.child.wait().unwrap().success());
    wait_for(30, "the daemon to let the program go", || {
        (!daemon.traced_pids().contains(&u64::from(target.pid()))).then_some(())
    });
    let log = daemon.stopped_log();
    let line = log.lines().find(|line| line.contains("double free of")).unwrap_or_else(|| panic!("{log}"));
    for site in ["allocated at df_alloc", "freed at df_first_free", "freed again at df_second_free"] {
        assert!(line.contains(site), "{site}: {line}");
    }
}

/// The one double free of the lifecycle fixture in `report`, checked for what every mode shows.
fn the_one_double_free(report: &serde_json::Value) -> serde_json::Value {
    let double_frees = report["double_frees"].as_array().unwrap();
    assert_eq!(double_frees.len(), 1, "{report}");
    let df = double_frees[0].clone();
    assert_eq!(df["size"], 48);
    assert_eq!(df["alloc"]["frames"][0]["function"], "df_alloc");
    assert_eq!(df["first_free"]["frames"][0]["function"], "df_first_free");
    assert_eq!(df["second_free"]["frames"][0]["function"], "df_second_free");
    for which in ["alloc", "first_free", "second_free"] {
        assert!(df[which]["tid"].as_u64().unwrap() > 0);
    }
    let times: Vec<f64> =
        ["alloc", "first_free", "second_free"].iter().map(|w| df[w]["time_s"].as_f64().unwrap()).collect();
    assert!(times[0] <= times[1] && times[1] <= times[2], "{times:?}");
    df
}

/// A program that frees many blocks twice (on an allocator that does not abort) has its first
/// 100 double frees kept and the rest counted, in the report and its text, in `run` as in the
/// daemon, whose log names the first 100 and then says it stops.
#[test]
fn double_frees_past_the_first_100_are_counted_not_kept() {
    let preload = ("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libmimalloc.so.2.0");
    let program = fixture("lifecycle");
    let outcome = run_with_env(&[preload], &[], &[program.to_str().unwrap(), "double-frees"]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert_eq!(report["double_frees"].as_array().unwrap().len(), 100, "{report}");
    // A few second frees find their slot of recent frees taken by another block's first free.
    let not_kept = report["double_frees_not_kept"].as_u64().unwrap();
    assert!((150..=200).contains(&not_kept), "{not_kept}");
    let text = std::process::Command::new(memprof_tests::memprof_bin())
        .args(["run", "--", program.to_str().unwrap(), "double-frees"])
        .env(preload.0, preload.1)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert_eq!(text.matches("DOUBLE FREE of").count(), 100, "{text}");
    assert!(text.contains("more double frees, counted, not kept"), "{text}");
    // A first free keeps its caller by design: said so, not sent to the drop counters.
    assert_eq!(text.matches("[its caller only: --full-free-stacks walks").count(), 100, "{text}");
    assert!(!text.contains("[truncated: see dropped]"), "{text}");

    let mut command = std::process::Command::new(&program);
    command.env(preload.0, preload.1).args(["--wait", "double-frees"]);
    let mut target = Waiting::start_command(command);
    let pid = target.pid().to_string();
    let mut daemon = Daemon::start(&["--pid", &pid]);
    daemon.wait_traced(target.pid());
    target.go();
    assert!(target.child.wait().unwrap().success());
    wait_for(30, "the daemon to let the program go", || {
        (!daemon.traced_pids().contains(&u64::from(target.pid()))).then_some(())
    });
    let log = daemon.stopped_log();
    assert_eq!(log.matches("double free of").count(), 100, "{log}");
    assert_eq!(log.matches("more than 100 double frees").count(), 1, "{log}");
}

#[test]
fn address_reuse_is_never_a_double_free() {
    let outcome = run(&[], &[fixture("lifecycle").to_str().unwrap(), "reuse"]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert_eq!(report["double_frees"].as_array().unwrap().len(), 0, "{report}");
    assert_eq!(site(&report, "reuse_alloc"), (0, 0));
    assert_eq!(total(&report, "allocations"), 100 + 100);
    assert_eq!(total(&report, "frees"), 100);
    assert_nothing_dropped(&report);
}

#[test]
fn a_target_exiting_mid_trace_ends_the_session_with_its_outstanding_memory() {
    let mut target = Waiting::start(&fixture("lifecycle"), &["linger"]);
    let outcome = attach(&mut target, &["--interval", "1"]);
    assert!(outcome.status.success(), "{outcome:?}");
    let reports = outcome.reports();
    assert!(reports.len() >= 3, "interval reports, then the final one: {}", outcome.stdout);
    assert!(reports[..reports.len() - 1].iter().all(|r| r["final"] == false));
    let last = outcome.final_report();
    assert_eq!(site(&last, "linger_leak"), (30 * 4096, 30));
    // Interval reports grow as the target leaks.
    let growth: Vec<u64> = reports.iter().map(|r| site(r, "linger_leak").0).collect();
    assert!(growth.windows(2).all(|w| w[0] <= w[1]), "{growth:?}");
}

#[test]
fn run_exits_with_the_commands_exit_code_and_covers_its_whole_life() {
    let outcome = run(&["--interval", "1"], &[fixture("lifecycle").to_str().unwrap(), "linger"]);
    assert_eq!(outcome.status.code(), Some(3), "{outcome:?}");
    let report = outcome.final_report();
    // Allocated before main's work began: memprof run sees them too.
    assert_eq!(site(&report, "before_attach"), (6400, 100));
    assert_eq!(site(&report, "linger_leak"), (30 * 4096, 30));
    assert_eq!(report["comm"], "lifecycle");
    assert_eq!(total(&report, "unknown_frees"), 0);
}

#[test]
fn min_age_keeps_only_old_allocations() {
    let outcome = run(&["--min-age", "1.5"], &[fixture("lifecycle").to_str().unwrap(), "linger"]);
    let report = outcome.final_report();
    // The 100 early blocks are 3 s old at exit. Of the pages leaked every 100 ms over 3 s, only
    // the older ones count: some, not all (how many depends on scheduling, so no exact number).
    assert_eq!(site(&report, "before_attach"), (6400, 100));
    let (bytes, count) = site(&report, "linger_leak");
    assert!((1..30).contains(&count), "{count} of 30 pages older than 1.5 s");
    assert_eq!(bytes, count * 4096);
    assert_eq!(total(&report, "outstanding_allocations"), 130, "totals ignore --min-age");
}

/// An allocator preloaded into the command is the one `memprof run` probes.
#[test]
fn run_probes_an_allocator_the_command_preloads() {
    let library = memprof_tests::fixture_with("preload_alloc.c", "libpreload_alloc.so", &["-shared", "-fPIC", "-O1"]);
    let output = std::process::Command::new(memprof_tests::memprof_bin())
        .args(["run", "--json", "--", fixture("lifecycle").to_str().unwrap(), "prior"])
        .env("LD_PRELOAD", &library)
        .output()
        .expect("starting memprof");
    let outcome = memprof_tests::Outcome::from(output);
    assert!(outcome.stderr.contains(&format!("probes in {}", library.display())), "{}", outcome.stderr);
    let report = outcome.final_report();
    assert_eq!(site(&report, "after_attach"), (320, 10));
    assert_eq!(site(&report, "before_attach"), (0, 0), "allocated and freed under the probes");
}

/// Where a function's return probe is attached before its entry probe (perf-event uprobes, and
/// `uprobe_multi` links before Linux 6.13's sessions, which attach both at once), a call that
/// entered in between returns without its entry recorded. It began before tracing did, as a
/// block allocated before: no drop (there were about a hundred an attach to a busy loop), and its
/// block, freed, is an unknown free. Attached twice to the same running loop: with the kernel's
/// own kind of links, then with perf-event uprobes.
#[test]
fn calls_in_flight_while_the_probes_attach_are_no_drops() {
    let mut target = Waiting::start(&fixture("malloc_loop"), &["--seconds=60"]);
    target.go();
    let pid = target.pid();
    for env in [&[][..], &[("MEMPROF_UPROBE_MULTI", "0")][..]] {
        let mut memprof = Command::new(memprof_bin());
        memprof.envs(env.iter().copied());
        // (The loop runs already: the "go" the helper writes once attached is left unread.)
        let outcome = attach_with(memprof, &mut target, pid, &["--duration", "2", "--interval", "60"]);
        assert!(outcome.status.success(), "{env:?}: {outcome:?}");
        let report = outcome.final_report();
        // A call preempted inside the allocator for as long as the last probes take to attach
        // could still straddle their end: a rare one, where there were a hundred.
        let missing = report["dropped"]["inflight_missing"].as_u64().expect("inflight_missing");
        assert!(missing <= 1, "{env:?}: {missing} calls in flight at attach counted as drops: {}", report["dropped"]);
        // (Its blocks freed are unknown frees: none where the loop did not run between the
        // links, as on a one-CPU machine with `uprobe_multi` links.)
        assert!(total(&report, "allocations") > 0, "{env:?}: the loop ran: {report}");
    }
}
