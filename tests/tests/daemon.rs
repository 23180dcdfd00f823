//! `memprof daemon`: discovery, the HTTP API, reloads and shutdown (tests/prometheus.rs: a real
//! Prometheus server scraping it).

use std::{
    path::PathBuf,
    process::Command,
    time::{Duration, Instant},
};

use memprof_tests::{
    array_sum, fixture, fixture_with, http_get, metric, metric_f64,
    probe_links::{self, ProbeLink},
    sample, site, wait_for, Daemon, Scratch, Waiting,
};

/// These tests run one at a time: a daemon matching by command name would also trace another
/// test's fixtures, and detaching probes serializes in the kernel, which would skew the timing.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn target() -> Waiting {
    Waiting::start(&fixture("daemon_target"), &[])
}

/// A file's probes as memprof attaches them where the kernel has uprobe_multi links, all held by
/// `holder`: one link per program, for free, the dynamic linker's hook, and the allocation
/// functions: one uprobe session link for their entries and returns (Linux 6.13+, as here), or
/// an entry link and a return link.
fn assert_one_link_per_program(links: &[ProbeLink], holder: u32) {
    assert!(links.iter().all(|link| link.multi && link.holder == holder), "{links:?}");
    let functions = links.iter().map(|link| link.probes).max().unwrap_or(0);
    assert!(functions >= 2, "malloc and more: {links:?}");
    let mut shapes: Vec<(bool, usize)> = links.iter().map(|link| (link.at_return, link.probes)).collect();
    shapes.sort();
    let session = [(false, 1), (false, 1), (false, functions)];
    let entry_and_return = [(false, 1), (false, 1), (false, functions), (true, functions)];
    assert!(shapes == session || shapes == entry_and_return, "{links:?}");
}

/// `--top-stacks 0` exports no stack series at all, `stack="other"` included, while the
/// process's own series stay.
#[test]
fn no_stack_series_with_top_stacks_zero() {
    let _serial = serial();
    let mut held = target();
    let daemon = Daemon::start(&["--pid", &held.pid().to_string(), "--top-stacks", "0"]);
    daemon.wait_traced(held.pid());
    held.go();
    let inuse = format!("memprof_heap_inuse_bytes{{pid=\"{}\"}}", held.pid());
    let metrics = wait_for(20, "the held blocks in the metrics", || {
        let metrics = http_get(daemon.port, "/metrics")?.1;
        (sample(&metrics, &inuse)? >= 50_000).then_some(metrics)
    });
    assert!(!metrics.contains("memprof_stack_inuse_bytes{"), "{metrics}");
}

#[test]
fn the_leak_api_names_the_leaking_site_exactly() {
    let _serial = serial();
    let mut held = target();
    let daemon = Daemon::start(&["--pid", &held.pid().to_string()]);
    daemon.wait_traced(held.pid());
    held.go();
    let path = format!("/api/v1/leaks?pid={}", held.pid());
    let report = wait_for(20, "the held blocks in the report", || {
        let (_, report) = daemon.get_json(&path);
        (site(&report, "hold_site") == (50_000, 50)).then_some(report)
    });
    assert_eq!(report["final"], true);
    assert_eq!(report["comm"], "daemon_target");
    assert_eq!(site(&report, "churn_site"), (0, 0));

    assert_eq!(daemon.get_json("/api/v1/leaks").0, 400);
    assert_eq!(daemon.get_json("/api/v1/leaks?pid=abc").0, 400);
    let (status, body) = daemon.get_json("/api/v1/leaks?pid=1");
    assert_eq!(status, 404);
    assert!(body["error"].as_str().unwrap().contains("not traced"));
    assert_eq!(daemon.get_json("/no/such/path").0, 404);
    assert_eq!(daemon.get_json("/api/v1/leaks?pid=%zz&&").0, 400, "a malformed query gets the JSON error too");
    assert_eq!(daemon.get_json("/debug/pprof/heap?pid").0, 400, "a pid without its value, not the host's profile");
    let encoded: String = held.pid().to_string().bytes().map(|digit| format!("%{digit:02X}")).collect();
    assert_eq!(site(&daemon.get_json(&format!("/api/v1/leaks?pid={encoded}")).1, "hold_site"), (50_000, 50));
    let (status, body) = memprof_tests::http(daemon.port, "POST", "/metrics").unwrap();
    assert_eq!(status, 405);
    assert!(body.contains("\"error\""), "{body}");
    let (status, page) = daemon.get("/").unwrap();
    assert_eq!(status, 200);
    assert!(page.contains(&format!("/api/v1/leaks?pid={}", held.pid())), "{page}");
    assert_eq!(http_get(daemon.port, "/-/healthy").unwrap().0, 200);
}

#[test]
fn processes_that_match_later_are_traced_and_those_that_exit_disappear() {
    let _serial = serial();
    // Its tables are given back with it, not kept for another process.
    let daemon = Daemon::start(&["--comm", "^daemon_target$", "--keep-unwind-tables", "0"]);
    let mut late = target();
    daemon.wait_traced(late.pid());
    // At the defaults, one process: links of its own, one per program, and none for every process.
    assert_one_link_per_program(&probe_links::probing(late.pid()), daemon.child.id());
    assert_eq!(probe_links::shared(daemon.child.id()), [], "no link for every process");
    let metrics = http_get(daemon.port, "/metrics").unwrap().1;
    let attached = format!("memprof_target_attached{{pid=\"{}\",comm=\"daemon_target\"}}", late.pid());
    assert_eq!(sample(&metrics, &attached), Some(1), "{metrics}");
    late.go();
    let leaks = format!("/api/v1/leaks?pid={}", late.pid());
    wait_for(20, "its allocations", || (site(&daemon.get_json(&leaks).1, "hold_site").1 == 50).then_some(()));
    // The live table's filter counts its blocks (a churned one may be live too).
    assert!((50..=51).contains(&array_sum(daemon.child.id(), "LIVE_FILTER")));
    let rows_used = metric(daemon.port, "memprof_unwind_rows{state=\"used\"}").unwrap_or(0);
    assert!(rows_used > 0, "its files' unwind tables are in the kernel");
    assert!(metric(daemon.port, "memprof_unwind_kernel_bytes").unwrap_or(0) > 0);
    assert_eq!(metric(daemon.port, "memprof_unwind_tables_not_loaded_total"), Some(0));
    let pid = late.pid() as u64;
    let _ = late.child.kill();
    let _ = late.child.wait();
    wait_for(20, "the exited process to disappear", || (!daemon.traced_pids().contains(&pid)).then_some(()));
    // None of its links is left behind (a dead process's links show pid 0 in fdinfo: counted by holder).
    let held = || probe_links::all().into_iter().filter(|(link, _)| link.holder == daemon.child.id()).count();
    wait_for(5, "the probes to be detached", || (held() == 0).then_some(()));
    let metrics = http_get(daemon.port, "/metrics").unwrap().1;
    assert!(!metrics.contains(&format!("pid=\"{pid}\"")), "its series are gone: {metrics}");
    assert!(!metrics.contains("comm=\"daemon_target\""), "its series are gone: {metrics}");
    // Its kernel state is purged at the next interval.
    for map in ["live", "stack_stats", "stacks", "free_stacks"] {
        let series = format!("memprof_bpf_map_entries{{map=\"{map}\"}}");
        wait_for(20, &format!("{map} purged"), || (metric(daemon.port, &series)? == 0).then_some(()));
    }
    // The daemon took its purged blocks out of the filter, no more and no fewer.
    assert_eq!(array_sum(daemon.child.id(), "LIVE_FILTER"), 0);
    // Its tables, and the shards that held them, are given back.
    for series in ["memprof_unwind_rows{state=\"used\"} 0\n", "memprof_unwind_kernel_bytes 0\n"] {
        assert!(metrics.contains(series), "{series}: {metrics}");
    }
}

/// A program started again while its files' tables are kept (`--keep-unwind-tables`) has none
/// built again, and its stacks are whole on them; a file written in place since has its table
/// built anew. With no process left to map them, the tables and their shards are given back
/// once that time is up.
#[test]
fn a_program_started_again_finds_its_tables_kept_and_they_go_after_their_time() {
    let _serial = serial();
    let scratch = Scratch::new("daemon", "kept-tables");
    let program = scratch.join("daemon_target");
    std::fs::copy(fixture("daemon_target"), &program).unwrap();
    let daemon = Daemon::start(&["--comm", "^daemon_target$", "--keep-unwind-tables", "15"]);
    let rows = |state: &str| metric(daemon.port, &format!("memprof_unwind_rows{{state=\"{state}\"}}"));
    let built = || metric(daemon.port, "memprof_unwind_tables_built_total").expect("tables built");
    let run_once = || {
        let mut running = Waiting::start(&program, &[]);
        daemon.wait_traced(running.pid());
        running.go();
        let leaks = format!("/api/v1/leaks?pid={}", running.pid());
        let report = wait_for(20, "its held blocks", || {
            let report = daemon.get_json(&leaks).1;
            (site(&report, "hold_site") == (50_000, 50)).then_some(report)
        });
        let stacks = report["stacks"].as_array().expect("stacks");
        let stack = stacks.iter().find(|stack| stack["frames"][0]["function"] == "hold_site");
        let stack = stack.unwrap_or_else(|| panic!("{report}"));
        assert_eq!(stack["frames"][1]["function"], "main", "{report}");
        assert_eq!(stack["truncated"], false, "{report}");
        assert_eq!(report["dropped"]["unwind_no_table"], 0, "{report}");
        let pid = u64::from(running.pid());
        drop(running);
        wait_for(20, "the program to be let go", || (!daemon.traced_pids().contains(&pid)).then_some(()));
    };
    run_once();
    let first = built();
    assert!(first >= 3, "the program, the C library and the dynamic linker: {first}");
    assert_eq!(rows("used"), Some(0));
    assert!(rows("idle").expect("idle rows") > 0, "its tables are kept");
    run_once();
    assert_eq!(built(), first, "no table built again");
    // The same bytes, written over the same inode: its table is not trusted.
    std::fs::write(&program, std::fs::read(&program).unwrap()).unwrap();
    run_once();
    assert_eq!(built(), first + 1, "the program's table built again, the libraries' not");
    wait_for(40, "the idle tables given back", || {
        (rows("idle")? == 0 && metric(daemon.port, "memprof_unwind_kernel_bytes")? == 0).then_some(())
    });
    assert_eq!(rows("used"), Some(0));
}

/// A process the daemon found at its exec but could not attach to yet (it has no allocator),
/// and attached to at its next exec, is traced: it is not also counted missed once it exits.
#[test]
fn a_process_attached_at_its_second_exec_is_not_counted_missed_when_it_exits() {
    let _serial = serial();
    let scratch = Scratch::new("daemon", "second-exec");
    let flags = ["-nostdlib", "-static", "-O2", "-fno-stack-protector"];
    let named = scratch.join("daemon_target");
    std::fs::copy(fixture_with("exec_later.c", "exec_later", &flags), &named).unwrap();
    let mut daemon = Daemon::start(&["--comm", "^daemon_target$"]);
    let mut command = Command::new(&named);
    command.arg(fixture("daemon_target")).arg("--wait");
    let running = Waiting::start_command(command);
    daemon.wait_traced(running.pid());
    // The tries of the first program back off while it is traced: past a second apart by now.
    std::thread::sleep(Duration::from_secs(2));
    let pid = u64::from(running.pid());
    drop(running);
    wait_for(20, "the program to be let go", || (!daemon.traced_pids().contains(&pid)).then_some(()));
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(metric(daemon.port, "memprof_targets_missed_total"), Some(0), "{}", daemon.stopped_log());
}

/// Under systemd (`Type=notify`), the daemon says when it serves, reloads and stops: `systemctl
/// start` returns once it serves, and a reload right after start waits for that.
#[test]
fn the_daemon_tells_systemd_when_it_serves_reloads_and_stops() {
    let _serial = serial();
    let dir = std::env::temp_dir().join(format!("memprof-notify-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("notify.sock");
    let _ = std::fs::remove_file(&path);
    let systemd = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
    systemd.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let next = || {
        let mut message = [0u8; 256];
        let n = systemd.recv(&mut message).expect("a message to systemd");
        String::from_utf8_lossy(&message[..n]).into_owned()
    };
    let held = target();
    let pid = held.pid().to_string();
    let daemon = Daemon::spawn(&["--pid", &pid], &[("NOTIFY_SOCKET", path.to_str().unwrap())]);
    assert_eq!(next(), "READY=1");
    assert_eq!(http_get(daemon.port, "/-/healthy").map(|answer| answer.0), Some(200), "serving once ready");
    daemon.signal(libc::SIGHUP);
    assert!(next().starts_with("RELOADING=1\nMONOTONIC_USEC="));
    assert_eq!(next(), "READY=1");
    daemon.signal(libc::SIGTERM);
    assert_eq!(next(), "STOPPING=1");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sighup_with_a_broken_config_keeps_serving_and_sigterm_detaches_everything() {
    let _serial = serial();
    let config: PathBuf = std::env::temp_dir().join(format!("memprof-test-{}.toml", std::process::id()));
    std::fs::write(&config, "comms = [\"^daemon_target$\"]\n").unwrap();
    let held = target();
    let mut daemon = Daemon::start(&["--config", config.to_str().unwrap()]);
    daemon.wait_traced(held.pid());

    std::fs::write(&config, "comms = [\"(unclosed\"\nnot toml at all").unwrap();
    daemon.signal(libc::SIGHUP);
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(http_get(daemon.port, "/-/ready").unwrap().0, 200, "still serving");
    assert!(daemon.traced_pids().contains(&(held.pid() as u64)), "the old rules still apply");
    let _ = std::fs::remove_file(&config);

    let stopping = Instant::now();
    daemon.signal(libc::SIGTERM);
    let status = daemon.child.wait().unwrap();
    assert!(status.success(), "{status}");
    // Reported, not asserted (no test asserts a wall-clock time): a target's links take about
    // 0.1 s to detach (its 18 perf-event uprobes took 1.6 s), and targets are detached together.
    eprintln!("the daemon stopped {:?} after SIGTERM", stopping.elapsed());
    let stderr = daemon.log();
    assert!(stderr.contains("keeping the old configuration: invalid config file"), "{stderr}");
    // No perf event with a BPF program is left on the target's allocator.
    let perf = Command::new("bpftool").args(["perf", "list"]).output().expect("bpftool (installed by xtask setup)");
    let perf = String::from_utf8_lossy(&perf.stdout);
    assert!(!perf.contains("uprobe"), "probes left after SIGTERM:\n{perf}");
    assert_eq!(probe_links::probing(held.pid()), [], "links left after SIGTERM");
    assert!(unsafe { libc::kill(held.pid() as i32, 0) } == 0, "the target keeps running");
}

/// The shipped config (deploy/memprof.toml, the package's /etc/memprof/memprof.toml) has no rule:
/// the daemon starts, scans /proc, traces no process, and says in one line, at start and at each
/// reload that leaves it so, how to give it a rule.
#[test]
fn the_shipped_config_traces_nothing_and_says_how_to_add_a_rule() {
    let _serial = serial();
    let config = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/memprof.toml");
    let config = config.to_str().unwrap();
    let held = target();
    let mut daemon = Daemon::start(&["--config", config]);
    let scanned = |scans: u64| {
        wait_for(20, "a scan of /proc", || metric(daemon.port, "memprof_discovery_scans_total").filter(|n| *n >= scans))
    };
    scanned(1);
    assert_eq!(daemon.traced_pids(), Vec::<u64>::new(), "no rule, no target (pid {} runs)", held.pid());
    let metrics = http_get(daemon.port, "/metrics").unwrap().1;
    assert_eq!(sample(&metrics, "memprof_target_attached"), None, "{metrics}");
    daemon.signal(libc::SIGHUP);
    scanned(2);
    assert_eq!(daemon.traced_pids(), Vec::<u64>::new());

    let log = daemon.stopped_log();
    let notice = format!(
        "no rule is configured, so no process is traced: add one to {config} (comms = [\"^my-service$\"], or cgroups, pids, all = true) and reload (systemctl reload memprof, or SIGHUP)"
    );
    assert_eq!(log.lines().filter(|line| line.contains("no rule")).count(), 2, "{log}");
    assert_eq!(log.lines().filter(|line| line.ends_with(&notice)).count(), 2, "{log}");
}

/// `MEMPROF_UPROBE_MULTI=0`, the troubleshooting switch, attaches one perf-event uprobe per probe,
/// as on a kernel without uprobe_multi links, and the counts stay exact.
#[test]
fn with_uprobe_multi_switched_off_each_probe_is_a_perf_event_uprobe() {
    let _serial = serial();
    let mut held = target();
    let pid = held.pid();
    let mut daemon = Daemon::start_with_env(&["--pid", &pid.to_string()], &[("MEMPROF_UPROBE_MULTI", "0")]);
    daemon.wait_traced(pid);
    let links = probe_links::probing(pid);
    assert!(links.iter().all(|link| !link.multi && link.holder == daemon.child.id()), "{links:?}");
    let functions = links.iter().filter(|link| link.at_return).count();
    assert!(functions >= 2, "malloc and more: {links:?}");
    assert_eq!(links.len(), 2 * functions + 2, "entries and returns, free, the dynamic linker: {links:?}");

    held.go();
    let leaks = format!("/api/v1/leaks?pid={pid}");
    wait_for(20, "the held blocks", || (site(&daemon.get_json(&leaks).1, "hold_site") == (50_000, 50)).then_some(()));
    drop(held);
    // About 90 ms a probe, in the background.
    wait_for(20, "its probes to be detached", || probe_links::probing(pid).is_empty().then_some(()));
    let stderr = daemon.stopped_log();
    assert!(stderr.contains("MEMPROF_UPROBE_MULTI=0: attaching perf-event uprobes"), "{stderr}");
}

/// `MEMPROF_UPROBE_SESSION=0` makes memprof attach an entry link and a return link for the
/// allocation functions, as on a kernel with uprobe_multi links but no uprobe sessions (Linux
/// 6.10 to 6.12), and the counts stay exact.
#[test]
fn with_uprobe_sessions_switched_off_allocations_get_entry_and_return_links() {
    let _serial = serial();
    let mut held = target();
    let pid = held.pid();
    let mut daemon = Daemon::start_with_env(&["--pid", &pid.to_string()], &[("MEMPROF_UPROBE_SESSION", "0")]);
    daemon.wait_traced(pid);
    // A lone traced process has links of its own (`--probe-links auto`).
    let links = probe_links::probing(pid);
    assert_one_link_per_program(&links, daemon.child.id());
    assert_eq!(links.len(), 4, "entry and return links, free, the dynamic linker: {links:?}");

    held.go();
    let leaks = format!("/api/v1/leaks?pid={pid}");
    wait_for(20, "the held blocks", || (site(&daemon.get_json(&leaks).1, "hold_site") == (50_000, 50)).then_some(()));
    assert_eq!(site(&daemon.get_json(&leaks).1, "churn_site"), (0, 0));
    drop(held);
    let stderr = daemon.stopped_log();
    assert!(stderr.contains("no uprobe sessions (MEMPROF_UPROBE_SESSION=0)"), "{stderr}");
}

#[test]
fn the_peak_and_resident_memory_are_exported() {
    let _serial = serial();
    let mut target = target();
    let daemon = Daemon::start(&["--comm", "^daemon_target$"]);
    daemon.wait_traced(target.pid());
    target.go();
    let series = |name: &str| format!("{name}{{pid=\"{}\",comm=\"daemon_target\"}}", target.pid());
    // 50 x 1000 bytes held, then 64 bytes allocated and freed again and again: 50,064 at most.
    let peak = series("memprof_heap_peak_bytes");
    wait_for(30, "the peak", || (metric(daemon.port, &peak)? == 50_064).then_some(()));
    let temporary = series("memprof_temporary_allocations_total");
    wait_for(30, "temporary allocations", || (metric(daemon.port, &temporary)? > 0).then_some(()));
    let rss = metric(daemon.port, &series("memprof_rss_anon_bytes")).expect("memprof_rss_anon_bytes");
    assert!(rss >= 50_000, "its 50,000 bytes held are resident: {rss}");
    let body = http_get(daemon.port, "/metrics").expect("a scrape").1;
    assert!(body.contains("# HELP memprof_rss_anon_minus_heap_bytes "), "{body}");
    // Its labels as the other per-process series' (exe and cgroup after comm and slot).
    let difference = "memprof_rss_anon_minus_heap_bytes{comm=\"daemon_target\",slot=\"0\",exe=";
    assert!(body.contains(difference), "{body}");
    // The pages pinned by few live bytes: daemon_target's 50 blocks of 1000 bytes lie side by
    // side, 4 to a page, so at most the two pages at their ends can be (checked exactly on
    // resident.c in tests/tests/peaks.rs).
    let pinned = metric(daemon.port, &series("memprof_heap_pinned_bytes")).expect("memprof_heap_pinned_bytes");
    assert!(pinned <= 2 * 4096, "{pinned}");
    // The daemon's own memory: its ring buffers are mapped only while it reads them, so of its
    // maps' read-only pages only each ring's producer page stays resident (the 16 MiB deferred-walk
    // ring, mapped whole, made 32 MiB of its resident memory: ring.rs).
    let rings = mapped_bpf_kib(daemon.child.id(), "r--s");
    assert!(rings <= 4 * 4, "{rings} KiB of ring pages resident");
}

/// Resident KiB of `pid`'s mappings of BPF maps with permissions `perms` (as /proc/PID/maps
/// writes them).
fn mapped_bpf_kib(pid: u32, perms: &str) -> u64 {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).expect("the daemon's smaps");
    let mut total = 0;
    let mut counted = false;
    for line in smaps.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        match fields.as_slice() {
            ["Rss:", kib, "kB"] if counted => total += kib.parse::<u64>().expect("a number"),
            [range, p, ..] if range.contains('-') && !range.ends_with(':') => {
                counted = *p == perms && line.ends_with("anon_inode:bpf-map");
            }
            _ => {}
        }
    }
    total
}

/// The cgroup v2 mount point (`/sys/fs/cgroup`, or `/sys/fs/cgroup/unified` on a hybrid system).
fn cgroup2_mount() -> PathBuf {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    let line = mounts.lines().find(|l| l.split_whitespace().nth(2) == Some("cgroup2")).expect("a cgroup2 mount");
    PathBuf::from(line.split_whitespace().nth(1).unwrap())
}

#[test]
fn every_process_in_a_cgroup_is_traced_and_no_other() {
    let _serial = serial();
    let mount = cgroup2_mount();
    let group = mount.join(format!("memprof-test-{}", std::process::id()));
    std::fs::create_dir_all(&group).unwrap();
    let mut inside = target();
    let outside = target();
    std::fs::write(group.join("cgroup.procs"), inside.pid().to_string()).expect("moving the fixture into the cgroup");
    let daemon = Daemon::start(&["--cgroup", group.to_str().unwrap()]);
    daemon.wait_traced(inside.pid());
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(daemon.traced_pids(), vec![inside.pid() as u64], "only the process in the cgroup");
    drop(daemon);
    let _ = outside;
    let _ = inside.child.kill();
    let _ = inside.child.wait();
    let _ = std::fs::remove_dir(&group);
}

/// Under a cgroup rule, the kernel keeps back the execs and forks in a cgroup the daemon found no
/// rule contains, from the first one it reported there; a process that moves into the rule's
/// cgroup and execs is still traced at once, not at the next scan of /proc (60 s on).
#[test]
fn a_cgroup_rule_keeps_other_cgroups_from_the_daemon_and_finds_its_own_at_once() {
    let _serial = serial();
    let group = cgroup2_mount().join(format!("memprof-test-kept-{}", std::process::id()));
    std::fs::create_dir_all(&group).unwrap();
    let daemon = Daemon::start(&["--cgroup", group.to_str().unwrap()]);
    let reported = || metric(daemon.port, "memprof_discovery_events_total");
    let run_true =
        |times: usize| (0..times).for_each(|_| assert!(Command::new("/bin/true").status().unwrap().success()));
    // The first exec in the test's cgroup tells the daemon that no rule contains it.
    let first = wait_for(20, "an exec reported", || {
        run_true(1);
        reported().filter(|&n| n >= 1)
    });
    run_true(200);
    // Two reads of the kernel's events later, any exec above reported is counted.
    let read_at = || metric_f64(daemon.port, "memprof_last_read_timestamp_seconds").unwrap_or(0.0);
    let after_runs = read_at();
    wait_for(20, "two more reads", || (read_at() >= after_runs + 2.0).then_some(()));
    let kept_back = reported().unwrap() - first;
    assert!(kept_back < 20, "{kept_back} of 200 execs and their forks reported");
    let script =
        format!("echo $$ > {}/cgroup.procs && exec {} --wait", group.display(), fixture("daemon_target").display());
    let mut command = Command::new("sh");
    command.args(["-c", &script]);
    let inside = Waiting::start_command(command);
    daemon.wait_traced(inside.pid());
    drop(inside);
    drop(daemon);
    let _ = std::fs::remove_dir(&group);
}

#[test]
fn processes_beyond_max_targets_are_refused_and_counted() {
    let _serial = serial();
    let first = target();
    let second = target();
    let daemon = Daemon::start(&["--comm", "^daemon_target$", "--max-targets", "1"]);
    wait_for(20, "one process traced", || (daemon.traced_pids().len() == 1).then_some(()));
    std::thread::sleep(Duration::from_secs(1));
    let traced = daemon.traced_pids();
    assert_eq!(traced.len(), 1);
    assert!(traced.contains(&(first.pid() as u64)) || traced.contains(&(second.pid() as u64)));
    let metrics = http_get(daemon.port, "/metrics").unwrap().1;
    assert!(metrics.contains("memprof_targets_refused_total 1"), "{metrics}");
}

/// `memprof_last_read_timestamp_seconds` is the Unix time of the last read of the maps and moves
/// at each interval: a scrape tells a view that stands still from a daemon held up.
#[test]
fn the_last_read_time_moves_at_each_interval() {
    let daemon = Daemon::start(&["--comm", "^no-process-is-named-so$"]);
    let read_at = || metric_f64(daemon.port, "memprof_last_read_timestamp_seconds").filter(|&at| at > 0.0);
    let first = wait_for(20, "a read", read_at);
    let now = std::time::UNIX_EPOCH.elapsed().unwrap().as_secs_f64();
    assert!((now - first).abs() < 3600.0, "not Unix time: {first} (now {now})");
    wait_for(20, "the next read", || read_at().filter(|&at| at > first));
}

/// A target still for a leak window and two intervals is settled: its stacks are not read again,
/// its view is brought up to date (the ages grow), and its first allocation after that is in the
/// next report, exact.
#[test]
fn a_still_target_settles_and_its_next_allocation_is_seen_exactly() {
    let _serial = serial();
    let mut held = Waiting::start(&fixture("settle"), &[]);
    let daemon = Daemon::start(&["--pid", &held.pid().to_string(), "--leak-window", "2"]);
    daemon.wait_traced(held.pid());
    held.go();
    let path = format!("/api/v1/leaks?pid={}", held.pid());
    wait_for(20, "the target settled", || (metric(daemon.port, "memprof_settled_targets") == Some(1)).then_some(()));
    let age = |report: &serde_json::Value| {
        let stacks = report["stacks"].as_array().expect("stacks");
        let first = stacks.iter().find(|s| s["frames"][0]["function"] == "first_site").expect("first_site");
        first["oldest_age_s"].as_f64().expect("age")
    };
    let settled = daemon.get_json(&path).1;
    assert_eq!(site(&settled, "first_site"), (10_000, 10));
    let later = wait_for(10, "a later view", || {
        let report = daemon.get_json(&path).1;
        (report["duration_s"].as_f64() > settled["duration_s"].as_f64()).then_some(report)
    });
    assert_eq!(site(&later, "first_site"), (10_000, 10));
    let grown = later["duration_s"].as_f64().unwrap() - settled["duration_s"].as_f64().unwrap();
    assert!((age(&later) - age(&settled) - grown).abs() < 0.002, "ages grow with the report's time: {settled} {later}");
    assert_eq!(later["totals"]["allocations"], 10);

    held.go();
    let moved = wait_for(20, "the second allocations", || {
        let report = daemon.get_json(&path).1;
        (site(&report, "second_site") == (10_000, 5)).then_some(report)
    });
    assert_eq!(site(&moved, "first_site"), (10_000, 10));
    assert_eq!(moved["totals"]["allocations"], 15);
    assert_eq!(moved["totals"]["outstanding_bytes"], 20_000);
    wait_for(20, "settled again", || (metric(daemon.port, "memprof_settled_targets") == Some(1)).then_some(()));
    let again = daemon.get_json(&path).1;
    assert_eq!((site(&again, "first_site"), site(&again, "second_site")), ((10_000, 10), (10_000, 5)));
}

/// A target that comes or goes is shown at once, whatever the interval. The snapshots that show
/// it count as no interval: a still target beside processes that come and go settles no sooner
/// (a leak window of 2 and two intervals: 4 intervals, 240 s here, not 4 snapshots).
#[test]
fn targets_coming_and_going_show_at_once_and_settle_no_one_sooner() {
    let _serial = serial();
    let still = Waiting::start(&fixture("settle"), &[]);
    let daemon = Daemon::start(&["--comm", "^(settle|daemon_target)$", "--interval", "60", "--leak-window", "2"]);
    daemon.wait_traced(still.pid());
    for _ in 0..5 {
        let passing = target();
        let pid = passing.pid() as u64;
        daemon.wait_traced(passing.pid());
        drop(passing);
        wait_for(20, "the passing target gone from the view", || (!daemon.traced_pids().contains(&pid)).then_some(()));
    }
    assert_eq!(daemon.traced_pids(), vec![still.pid() as u64]);
    assert_eq!(metric(daemon.port, "memprof_settled_targets"), Some(0));
}

/// Processes of one program share the daemon's descriptor of each file they map, and so blazesym's
/// parse of it (which holds a descriptor of its own): two per file, not one per mapping of each
/// process.
#[test]
fn processes_of_one_program_share_one_descriptor_per_mapped_file() {
    let _serial = serial();
    let daemon = Daemon::start(&["--comm", "^daemon_target$"]);
    let mut targets: Vec<Waiting> = (0..3).map(|_| target()).collect();
    for held in &mut targets {
        daemon.wait_traced(held.pid());
        held.go();
        let leaks = format!("/api/v1/leaks?pid={}", held.pid());
        wait_for(20, "its symbolized site", || (site(&daemon.get_json(&leaks).1, "hold_site").1 == 50).then_some(()));
    }
    let program = std::fs::canonicalize(fixture("daemon_target")).unwrap();
    let descriptors = |file: &dyn Fn(&PathBuf) -> bool| {
        let dir = format!("/proc/{}/fd", daemon.child.id());
        let open = std::fs::read_dir(dir).unwrap().filter_map(|entry| std::fs::read_link(entry.ok()?.path()).ok());
        open.filter(|path| file(path)).count()
    };
    assert!(descriptors(&|path| *path == program) <= 2, "the program");
    let libc = |path: &PathBuf| path.file_name().is_some_and(|name| name.to_string_lossy().starts_with("libc.so"));
    assert!(descriptors(&libc) <= 2, "the C library");
}

/// Processes that come and go are shown within moments (the daemon here takes a snapshot each
/// second), but those extra snapshots are not
/// intervals: a steady target's timeline, and the leak rule's window, gain one point per
/// interval (`leak_window` intervals of 12 x 5 s: a minute) whatever else comes and goes. They
/// gained one per snapshot, and a window shrank to a few seconds on a host with short-lived
/// matching processes.
#[test]
fn targets_that_come_and_go_do_not_add_intervals_to_a_steady_targets_timeline() {
    let _serial = serial();
    let daemon = Daemon::start(&["--comm", "^daemon_target$"]);
    let held = target();
    daemon.wait_traced(held.pid());
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(5) {
        let passing = target();
        std::thread::sleep(Duration::from_millis(250));
        drop(passing);
    }
    let (_, report) = daemon.get_json(&format!("/api/v1/leaks?pid={}", held.pid()));
    let points = report["timeline"]["time_s"].as_array().expect("a timeline").len() as u64;
    let intervals = started.elapsed().as_secs() + 2;
    assert!(points <= intervals, "{points} points in about {intervals} intervals: {}", report["timeline"]);
}

/// A pid or a cgroup the rules name that does not exist is said at start: a typo would otherwise
/// trace nothing, quietly.
#[test]
fn rules_naming_a_missing_pid_or_cgroup_are_said() {
    let _serial = serial();
    let mut daemon = Daemon::start(&["--pid", "4194303", "--cgroup", "/memprof-no-such-cgroup"]);
    let log = daemon.stopped_log();
    assert!(log.contains("the rules name pid 4194303, and no such process runs"), "{log}");
    assert!(log.contains("the rules name cgroup /memprof-no-such-cgroup, and /sys/fs/cgroup has no such"), "{log}");
}

/// A double free is logged with its three sites, though the process aborts on it. (A free made
/// while the probes go in is not taken for a first one: that moment cannot be forced here.)
#[test]
fn a_double_free_is_logged_with_its_three_sites() {
    let _serial = serial();
    let mut held = Waiting::start(&fixture("lifecycle"), &["double-free"]);
    let pid = held.pid();
    let mut daemon = Daemon::start(&["--pid", &pid.to_string()]);
    daemon.wait_traced(pid);
    held.go();
    let status = held.child.wait().expect("the fixture's exit");
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(libc::SIGABRT), "glibc aborts on it");
    wait_for(20, "the process let go", || (!daemon.traced_pids().contains(&u64::from(pid))).then_some(()));
    let log = daemon.stopped_log();
    let line = log.lines().find(|line| line.contains("double free of")).unwrap_or_else(|| panic!("{log}"));
    for site in ["allocated at df_alloc", "freed at df_first_free", "freed again at df_second_free"] {
        assert!(line.contains(site), "{site}: {line}");
    }
    assert_eq!(log.matches("double free of").count(), 1, "{log}");
}
