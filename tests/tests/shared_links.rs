//! Links shared per allocator file (issue 18): the daemon attaching to a thousand processes and
//! letting them go, what it leaves behind, and a process whose main thread has exited.

use std::{
    collections::HashSet,
    io::{BufRead as _, BufReader, Read as _, Write as _},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use memprof_tests::{
    attach, attach_with, fixture, metric, one_at_a_time, probe_links, released, site, total, wait_for, Daemon, Waiting,
};
use serde_json::Value;

/// A process whose main thread called pthread_exit while a worker allocates: the kernel's pid
/// filter cannot name it (it compares the exited leader's memory), shared links with the map of
/// traced processes can, and /proc is read through the live thread.
#[test]
fn a_process_whose_main_thread_exited_is_traced_exactly() {
    let _serial = one_at_a_time();
    let mut target = Waiting::start(&fixture("leader_exit"), &[]);
    let outcome = attach(&mut target, &["--interval", "60"]);
    assert!(outcome.status.success(), "{}", outcome.stderr);
    let report = outcome.final_report();
    assert_eq!(site(&report, "hold_site"), (21_000, 7), "{report:#}");
    assert_eq!(report["totals"]["allocations"], 18, "{report:#}");
    assert_eq!(report["totals"]["frees"], 11, "{report:#}");
    assert_eq!(report["totals"]["freed_bytes"], 1_100, "{report:#}");
}

/// The same process traced by perf-event uprobes, as on a kernel without uprobe_multi links
/// (Linux 6.1): the kernel refuses an event on the exited main thread (`No such process`), and
/// fires one opened on a live thread in every thread of the process.
#[test]
fn a_process_whose_main_thread_exited_is_traced_exactly_by_perf_event_uprobes() {
    let _serial = one_at_a_time();
    let mut target = Waiting::start(&fixture("leader_exit"), &[]);
    let pid = target.pid();
    let mut memprof = Command::new(memprof_tests::memprof_bin());
    memprof.env("MEMPROF_UPROBE_MULTI", "0");
    let outcome = attach_with(memprof, &mut target, pid, &["--interval", "60"]);
    assert!(outcome.status.success(), "{}", outcome.stderr);
    let report = outcome.final_report();
    assert_eq!(site(&report, "hold_site"), (21_000, 7), "{report:#}");
    assert_eq!(report["totals"]["allocations"], 18, "{report:#}");
    assert_eq!(report["totals"]["frees"], 11, "{report:#}");
}

/// What memprof says once a process's perf-event uprobes are open again on a thread that stays.
const OPEN_AGAIN: &str = "they are open again on thread";

/// `run` of that process, whose main thread exits while memprof traces it by perf-event uprobes
/// (Linux 6.1's way): the kernel fires those only in threads whose memory is the thread's they
/// were opened on, which an exited thread has none of. memprof opens them again on the worker,
/// says so and counts the gap; the worker allocates once it has (its go line is sent then), and
/// every call is seen: the 26 allocations (26,506 bytes) valgrind counts, hold_site's 7 blocks
/// and the 12 frees of the rest (churn_site's 11 and one of 8 bytes).
#[test]
fn run_traces_on_when_the_main_thread_exits_under_perf_event_uprobes() {
    let _serial = one_at_a_time();
    let mut memprof = Command::new(memprof_tests::memprof_bin());
    memprof.env("MEMPROF_UPROBE_MULTI", "0").args(["run", "--json", "--"]).arg(fixture("leader_exit"));
    memprof.stdin(Stdio::piped());
    let mut outcome = released(memprof, &[OPEN_AGAIN.to_string()], |memprof| {
        memprof.stdin.as_mut().expect("piped").write_all(b"go\n").expect("releasing the fixture");
    });
    assert!(outcome.status.success(), "{}", outcome.stderr);
    // The fixture says "ready" on the same stdout.
    outcome.stdout = outcome.stdout.lines().filter(|l| l.starts_with('{')).map(|l| format!("{l}\n")).collect();
    let report = outcome.final_report();
    assert_eq!(site(&report, "hold_site"), (21_000, 7), "{report:#}");
    assert_every_call_past_the_gap(&report);
}

/// The daemon, tracing that process by perf-event uprobes from before its main thread exits:
/// as `run`, it opens them again on the worker and counts the gap in the process's drops; every
/// block made after is seen, as valgrind counts them (see the test above).
#[test]
fn the_daemon_traces_on_when_the_main_thread_exits_under_perf_event_uprobes() {
    let _serial = one_at_a_time();
    let mut target = Waiting::start(&fixture("leader_exit"), &["hold", "late"]);
    let pid = target.pid();
    let daemon = Daemon::start_with_env(&["--pid", &pid.to_string()], &[("MEMPROF_UPROBE_MULTI", "0")]);
    daemon.wait_traced(pid);
    // The main thread starts the worker and exits; the worker says so.
    target.go();
    assert_eq!(target.next_line(), "ready");
    let gaps = format!("memprof_events_dropped_total{{pid=\"{pid}\",reason=\"probe_thread_exited\"}}");
    wait_for(20, "the gap counted", || (metric(daemon.port, &gaps)? == 1).then_some(()));
    target.go();
    assert_eq!(target.next_line(), "held");
    let leaks = format!("/api/v1/leaks?pid={pid}");
    let report = wait_for(20, "the held blocks", || {
        let report = daemon.get_json(&leaks).1;
        (site(&report, "hold_site") == (21_000, 7)).then_some(report)
    });
    assert_every_call_past_the_gap(&report);
}

/// The fixture's every call, as valgrind counts them, past one gap: its 26 allocations (26,506
/// bytes) and 12 frees (1,108 bytes).
fn assert_every_call_past_the_gap(report: &Value) {
    assert_eq!((total(report, "frees"), total(report, "freed_bytes")), (12, 1_108), "{report:#}");
    assert_eq!((total(report, "allocations"), total(report, "allocated_bytes")), (26, 26_506), "{report:#}");
    assert_eq!(report["dropped"]["probe_thread_exited"], 1, "{}", report["dropped"]);
}

/// `--probe-links per-process`: the daemon gives its target links of its own, filtered by its pid,
/// and none for every process; the counts are the same.
#[test]
fn the_daemon_can_give_each_process_links_of_its_own() {
    let _serial = one_at_a_time();
    let mut held = Waiting::start(&fixture("daemon_target"), &[]);
    let pid = held.pid();
    let daemon = Daemon::start(&["--pid", &pid.to_string(), "--probe-links", "per-process"]);
    daemon.wait_traced(pid);
    let own = probe_links::probing(pid);
    assert!(own.len() >= 3 && own.iter().all(|link| link.multi && link.holder == daemon.child.id()), "{own:?}");
    assert_eq!(probe_links::shared(daemon.child.id()), [], "no link for every process");
    held.go();
    let leaks = format!("/api/v1/leaks?pid={pid}");
    wait_for(20, "the held blocks", || (site(&daemon.get_json(&leaks).1, "hold_site") == (50_000, 50)).then_some(()));
}

/// Processes started by the test, killed when it ends.
struct Processes(Vec<Child>);

impl Drop for Processes {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
        }
        for child in &mut self.0 {
            let _ = child.wait();
        }
    }
}

/// Whether `pid` catches SIGUSR1 (bit 10 of `SigCgt`): the fixture has installed its handler.
fn catches_usr1(pid: u32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("SigCgt:"))
        .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        .is_some_and(|mask| mask & (1 << (libc::SIGUSR1 - 1)) != 0)
}

/// The ids of the BPF programs, maps and links `pid` holds, from its descriptors' fdinfo.
fn bpf_objects(pid: u32) -> Vec<(&'static str, u32)> {
    let mut objects = Vec::new();
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().flatten() {
        let Ok(info) = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{}", fd.file_name().to_string_lossy()))
        else {
            continue;
        };
        for (field, kind) in [("prog_id:", "prog"), ("map_id:", "map"), ("link_id:", "link")] {
            if let Some(id) = info.lines().find_map(|line| line.strip_prefix(field)) {
                objects.push((kind, id.trim().parse().unwrap()));
            }
        }
    }
    objects
}

/// CPU time the kernel spent in system mode, all CPUs (`/proc/stat`), and `pid`'s user and system
/// time (`/proc/PID/stat`), in seconds.
fn cpu_seconds(pid: u32) -> (f64, f64) {
    // SAFETY: sysconf has no preconditions.
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let stat = std::fs::read_to_string("/proc/stat").unwrap();
    let system: f64 = stat.lines().next().unwrap().split_whitespace().nth(3).unwrap().parse().unwrap();
    let own = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<f64> =
        own.rsplit_once(')').unwrap().1.split_whitespace().skip(11).take(2).map(|f| f.parse().unwrap()).collect();
    (system / tick, (fields[0] + fields[1]) / tick)
}

/// `pid`'s resident memory and the memory of the BPF maps it holds (fdinfo's `memlock`), in MiB.
fn memory_mib(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let rss_kib: f64 =
        status.lines().find_map(|l| l.strip_prefix("VmRSS:")).unwrap().trim().trim_end_matches(" kB").parse().unwrap();
    let mut maps = 0.0;
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().flatten() {
        let info = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{}", fd.file_name().to_string_lossy()));
        let info = info.unwrap_or_default();
        if info.contains("map_id:") {
            maps +=
                info.lines().find_map(|l| l.strip_prefix("memlock:")).map_or(0.0, |m| m.trim().parse().unwrap_or(0.0));
        }
    }
    (rss_kib / 1024.0, maps / (1024.0 * 1024.0))
}

/// Whether the kernel still has BPF object `kind` (`prog`, `map`, `link`) number `id`.
fn bpf_object_exists(kind: &str, id: u32) -> bool {
    let id = id.to_string();
    let shown =
        Command::new("bpftool").args([kind, "show", "id", &id]).output().expect("bpftool (installed by xtask setup)");
    shown.status.success()
}

/// The daemon traces N processes (1,000 unless `MEMPROF_SCALE_N` says otherwise) that its rule
/// matches, each making 10 allocations a second: all are listed within 10 s (the target),
/// a sample of them counted exactly, a process it does not trace runs on, and SIGTERM ends it
/// within 5 s (the target) with none of its programs, maps or links left. The times are
/// printed for BENCHMARKS.md ("Scale").
#[test]
fn a_thousand_processes_are_traced_and_let_go() {
    let _serial = one_at_a_time();
    let n: usize = std::env::var("MEMPROF_SCALE_N").ok().and_then(|n| n.parse().ok()).unwrap_or(1_000);
    let program = fixture("scale_target");
    let processes = Processes((0..n).map(|_| start(&program)).collect());
    let pids: Vec<u32> = processes.0.iter().map(Child::id).collect();
    wait_for(60, "every process to be started", || pids.iter().all(|&pid| catches_usr1(pid)).then_some(()));
    // Not traced (its name does not match): started before the daemon, run while it traces.
    let mut untraced = Waiting::start(&fixture("malloc_loop"), &["--pairs=100000"]);

    let started = Instant::now();
    let system_before = cpu_seconds(std::process::id()).0;
    let mut daemon = Daemon::start(&["--comm", "^scale_target$", "--max-targets", &n.to_string()]);
    let wanted: HashSet<u64> = pids.iter().map(|&pid| pid as u64).collect();
    wait_for(60, "every process to be listed", || {
        wanted.is_subset(&daemon.traced_pids().into_iter().collect()).then_some(())
    });
    let attached = started.elapsed();
    let (system_attached, daemon_attached) = cpu_seconds(daemon.child.id());
    // At rest: every target attached, each making its 10 allocations a second.
    std::thread::sleep(Duration::from_secs(5));
    let daemon_rest = cpu_seconds(daemon.child.id()).1 - daemon_attached;
    let (rss, maps) = memory_mib(daemon.child.id());

    let sample: Vec<u32> = pids.iter().step_by((n / 5).max(1)).copied().collect();
    for &pid in &sample {
        // SAFETY: signalling a child of ours.
        unsafe { libc::kill(pid as i32, libc::SIGUSR1) };
    }
    for &pid in &sample {
        let path = format!("/api/v1/leaks?pid={pid}");
        wait_for(20, &format!("pid {pid}'s held blocks"), || {
            (site(&daemon.get_json(&path).1, "hold_site") == (5_000, 5)).then_some(())
        });
    }

    untraced.go();
    let mut output = String::new();
    untraced.child.stdout.as_mut().unwrap().read_to_string(&mut output).unwrap();
    assert!(untraced.child.wait().unwrap().success(), "the untraced process ran to its end");
    assert!(output.starts_with("ns_per_pair "), "{output}");

    let objects = bpf_objects(daemon.child.id());
    assert!(objects.iter().any(|&(kind, _)| kind == "link"), "{objects:?}");
    let stopping = Instant::now();
    let system_stopping = cpu_seconds(std::process::id()).0;
    daemon.signal(libc::SIGTERM);
    let status = daemon.child.wait().unwrap();
    let stopped = stopping.elapsed();
    let system_stopped = cpu_seconds(std::process::id()).0;
    let log = daemon.log();
    assert!(status.success(), "{status}: {log}");
    eprintln!(
        "scale: {n} processes listed {:.1} s after the daemon started (system CPU {:.1} s, the daemon's {:.1} s); \
         SIGTERM to exit {:.2} s (system CPU {:.2} s); at rest the daemon used {:.1}% of a core, {rss:.0} MiB \
         resident, BPF maps {maps:.1} MiB (fdinfo memlock); an untraced process: {}",
        attached.as_secs_f64(),
        system_attached - system_before,
        daemon_attached,
        stopped.as_secs_f64(),
        system_stopped - system_stopping,
        daemon_rest / 5.0 * 100.0,
        output.trim()
    );
    // The kernel frees a map from a work queue once its last reference is gone: soon, not at once.
    wait_for(10, "the daemon's BPF objects to be gone", || {
        let left: Vec<_> = objects.iter().filter(|&&(kind, id)| bpf_object_exists(kind, id)).collect();
        left.is_empty().then_some(())
    });
    assert!(pids.iter().all(|&pid| unsafe { libc::kill(pid as i32, 0) } == 0), "the targets keep running");
    assert!(attached < Duration::from_secs(10), "{n} processes took {attached:?} to be listed");
    assert!(stopped < Duration::from_secs(5), "exiting took {stopped:?}");
}

/// Hundreds of traced processes that exit together, beside one that holds 600,000 blocks in the
/// live table: what the maps hold of them is purged in one walk of the table, not one walk each,
/// so a process started just after is traced at once and seen whole. (Each walk took about 0.3 s
/// at this table's size: one per exit held the daemon for a minute and a half, and any local user
/// whose processes a rule by name matches could do that.)
#[test]
fn processes_that_exit_together_do_not_hold_the_daemon_up() {
    let _serial = one_at_a_time();
    let mut holder = Waiting::start(&fixture("crowding"), &["hold", "600000"]);
    let program = fixture("scale_target");
    let exiting = Processes((0..300).map(|_| start(&program)).collect());
    let pids: Vec<u32> = exiting.0.iter().map(Child::id).collect();
    wait_for(60, "every process to be started", || pids.iter().all(|&pid| catches_usr1(pid)).then_some(()));
    let daemon = Daemon::start(&["--comm", "^(crowding|scale_target|daemon_target)$", "--max-targets", "400"]);
    daemon.wait_traced(holder.pid());
    holder.go();
    let mut line = String::new();
    BufReader::new(holder.child.stdout.as_mut().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(line, "held\n");
    let wanted: HashSet<u64> = pids.iter().map(|&pid| pid as u64).collect();
    wait_for(60, "every process to be listed", || {
        wanted.is_subset(&daemon.traced_pids().into_iter().collect()).then_some(())
    });
    let leaks = format!("/api/v1/leaks?pid={}", holder.pid());
    wait_for(60, "the held blocks", || {
        (site(&daemon.get_json(&leaks).1, "hold_site") == (60_000_000, 600_000)).then_some(())
    });
    // Killed together, then waited for (see `Processes`).
    drop(exiting);

    let mut late = Waiting::start(&fixture("daemon_target"), &[]);
    daemon.wait_traced(late.pid());
    late.go();
    let path = format!("/api/v1/leaks?pid={}", late.pid());
    wait_for(20, "its held blocks", || (site(&daemon.get_json(&path).1, "hold_site") == (50_000, 50)).then_some(()));
}

fn start(program: &std::path::Path) -> Child {
    Command::new(program).stdin(Stdio::null()).stdout(Stdio::null()).spawn().expect("starting")
}
