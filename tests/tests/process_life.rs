//! Process life under real probes: a traced process that execs another program (dynamic or
//! static) is re-probed and its report describes the new program only; children are followed,
//! by `run`, `attach` and the daemon.

use std::{
    io::{BufRead, BufReader, Write},
    process::{Command, Stdio},
};

use memprof_tests::{
    assert_nothing_dropped, fixture, fixture_with, http_get, memprof, memprof_bin, metric, metric_f64, probe_links,
    released, site, total, wait_for, Daemon, Outcome, Waiting,
};
use serde_json::Value;

fn dynamic() -> String {
    fixture("process_life").display().to_string()
}

fn static_binary() -> String {
    let flags = ["-static", "-g", "-O0", "-fno-omit-frame-pointer"];
    fixture_with("process_life.c", "process_life_static", &flags).display().to_string()
}

/// `memprof ARGS`, writing "go" to its stdin (which the command inherits) once its stderr has
/// shown a line containing `after`.
fn run_released(args: &[&str], after: &str) -> Outcome {
    let mut memprof = Command::new(memprof_bin());
    memprof.args(args).stdin(Stdio::piped());
    released(memprof, &[after.to_string()], |memprof| {
        memprof.stdin.as_mut().expect("piped").write_all(b"go\n").expect("releasing the fixture");
    })
}

fn children(report: &Value) -> &Vec<Value> {
    report["children"].as_array().unwrap_or_else(|| panic!("no children in {report}"))
}

/// `memprof run` of the dynamic fixture, which `how` ("exec", or "thread-exec" from a second
/// thread) execs `target`. The command is not stopped at its exec: its new program waits until
/// memprof has probed it, then allocates new_image_alloc's 7 blocks and exits. Returns the final
/// report, checked to hold those blocks and none of the old program's, and memprof's stderr.
fn report_after_exec(how: &str, target: &str) -> (Value, String) {
    let program = dynamic();
    let args = ["run", "--json", "--", &program, how, target, "--wait", "new-image"];
    let mut outcome = run_released(&args, " runs ");
    assert!(outcome.status.success(), "{outcome:?}");
    outcome.stdout = outcome.stdout.lines().filter(|l| l.starts_with('{')).map(|l| format!("{l}\n")).collect();
    let report = outcome.final_report();
    assert_eq!(site(&report, "new_image_alloc"), (7 * 512, 7), "{report}");
    assert_eq!(site(&report, "old_image_alloc"), (0, 0), "the old program's blocks are gone: {report}");
    // The old program's walks still unread at the exec are not the new one's drops.
    assert_nothing_dropped(&report);
    (report, outcome.stderr)
}

#[test]
fn after_exec_into_a_dynamic_program_the_report_holds_the_new_program_only() {
    let (report, stderr) = report_after_exec("exec", &dynamic());
    assert_eq!(total(&report, "outstanding_bytes"), 7 * 512);
    assert_eq!(total(&report, "unknown_frees"), 0);
    assert!(stderr.contains("runs "), "the exec is announced: {stderr}");
}

/// The new program allocates and exits at once, often before memprof has read `/proc` for it:
/// it is named by the path its exec ran, as the kernel names it.
#[test]
fn a_program_gone_right_after_its_exec_is_named_by_the_path_it_ran() {
    let program = dynamic();
    let outcome = memprof_tests::memprof(&["run", "--json", "--", &program, "exec", &program, "new-image"]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert_eq!(site(&report, "new_image_alloc"), (7 * 512, 7), "{report}");
    assert_eq!(report["comm"], "process_life", "{report}");
}

/// A thread other than the main one execs: on kernels where the probes followed the main
/// thread's task, they no longer fire, and the new program is probed anew.
#[test]
fn after_an_exec_by_another_thread_the_new_program_is_probed() {
    report_after_exec("thread-exec", &dynamic());
}

#[test]
fn after_exec_into_a_static_binary_its_own_allocator_is_probed() {
    let target = static_binary();
    let (report, stderr) = report_after_exec("exec", &target);
    assert_eq!(report["comm"], "process_life_st", "the comm is the new program's");
    assert_eq!(report["exe"], target.as_str());
    assert!(stderr.contains(&format!("probes in {target}")), "{stderr}");
}

#[test]
fn attach_follows_an_exec() {
    let program = dynamic();
    let mut target =
        memprof_tests::Waiting::start(&fixture("process_life"), &["exec", &program, "--wait", "new-image"]);
    let pid = target.pid().to_string();
    // The first "go" goes to the fixture once memprof traces it, the second once memprof has
    // probed the program it exec'd (which says "ready" again and waits).
    let mut memprof = Command::new(memprof_bin());
    memprof.args(["attach", "--pid", &pid, "--max-rate", "off", "--json", "--interval", "0.2"]);
    let markers = [format!("memprof: tracing pid {pid} "), format!("memprof: pid {pid} (")];
    let outcome = released(memprof, &markers, |_| target.go());
    let report = outcome.final_report();
    assert_eq!(site(&report, "new_image_alloc"), (7 * 512, 7), "{report}");
    assert_eq!(site(&report, "old_image_alloc"), (0, 0), "{report}");
    assert_eq!(report["exe"], program.as_str());
}

/// A process `attach` traces that is killed: memprof says so, with the signal, and its final
/// report is marked exited. Not reaped until memprof has ended: a zombie tells its status on
/// every kernel (a reaped one only through its pidfd, on Linux 6.15 and later).
#[test]
fn attach_says_when_its_process_is_killed() {
    let mut sleeper = Command::new("sleep").arg("60").spawn().expect("starting sleep");
    wait_for_c_library(sleeper.id());
    let pid = sleeper.id().to_string();
    let mut memprof = Command::new(memprof_bin());
    memprof.args(["attach", "--pid", &pid, "--json", "--interval", "0.2"]);
    let outcome = released(memprof, &[format!("memprof: tracing pid {pid} ")], |_| {
        // SAFETY: kill takes a pid and a signal; the pid is our own unreaped child's.
        unsafe { libc::kill(sleeper.id() as libc::pid_t, libc::SIGKILL) };
    });
    let _ = sleeper.wait();
    assert!(outcome.status.success(), "{outcome:?}");
    assert!(
        outcome.stderr.contains(&format!("memprof: pid {pid} (sleep) exited (killed by SIGKILL) after ")),
        "{}",
        outcome.stderr
    );
    assert_eq!(outcome.final_report()["exited"], true);
}

/// A process its parent reaps the moment it dies (a shell's `wait`) leaves no zombie to read:
/// its status comes from the pidfd memprof opened at attach, on Linux 6.15 and later. Before,
/// memprof can only say it exited.
#[test]
fn attach_says_how_a_process_its_parent_reaped_ended() {
    let mut shell = Command::new("sh")
        .args(["-c", "sleep 60 & echo $!; wait"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting sh");
    let mut line = String::new();
    BufReader::new(shell.stdout.take().expect("piped")).read_line(&mut line).expect("the shell says its child");
    let pid: i32 = line.trim().parse().expect("a pid");
    // Attached once the shell's child is sleep, not still the shell between its fork and exec.
    let comm = format!("/proc/{pid}/comm");
    wait_for(10, "the shell's child to exec sleep", || std::fs::read_to_string(&comm).ok().filter(|c| c == "sleep\n"));
    wait_for_c_library(pid as u32);
    let mut memprof = Command::new(memprof_bin());
    memprof.args(["attach", "--pid", &pid.to_string(), "--json", "--interval", "0.2"]);
    let outcome = released(memprof, &[format!("memprof: tracing pid {pid} ")], |_| {
        // SAFETY: kill takes a pid and a signal; the pid is the shell's child, which the shell
        // has not reaped: it is still running.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    });
    let _ = shell.wait();
    assert!(outcome.status.success(), "{outcome:?}");
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("the kernel's release");
    let mut numbers = release.split(['.', '-']).map(|n| n.parse::<u32>().unwrap_or(0));
    let tells_status = (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0)) >= (6, 15);
    let said = if tells_status { " exited (killed by SIGKILL) after " } else { " exited after " };
    assert!(outcome.stderr.contains(&format!("memprof: pid {pid} (sleep){said}")), "{}", outcome.stderr);
    assert_eq!(outcome.final_report()["exited"], true);
}

/// A Ctrl-C (or SIGTERM) while the programs load (most of attach's first second) stops attach
/// before any probe is attached, at once: nothing is traced, no link is left, no file written,
/// and the exit code is the signal's (128+N).
#[test]
fn a_stop_signal_during_the_load_attaches_nothing() {
    let mut sleeper = Command::new("sleep").arg("60").spawn().expect("starting sleep");
    wait_for_c_library(sleeper.id());
    let pid = sleeper.id().to_string();
    let dir = std::env::temp_dir().join(format!("memprof-stopped-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (report, recording) = (dir.join("report.json"), dir.join("session.rec"));
    for signal in [libc::SIGINT, libc::SIGTERM] {
        let mut memprof = Command::new(memprof_bin());
        memprof.args(["attach", "--pid", &pid, "--json", "-o"]).arg(&report).arg("--record").arg(&recording);
        let said = stopped_while_loading(memprof, signal);
        assert!(
            said.ends_with(&format!("memprof: stopped before tracing pid {pid} began: no probe was attached to it\n")),
            "{said}"
        );
        assert!(!said.contains("memprof: tracing pid"), "{said}");
        assert_eq!(probe_links::probing(sleeper.id()), [], "no probe left on pid {pid}");
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|entry| entry.unwrap().file_name()).collect();
        assert!(left.is_empty(), "nothing written, not even an empty file: {left:?}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
    let _ = sleeper.kill();
    let _ = sleeper.wait();
}

/// A Ctrl-C while `run` loads its programs: the command is not started.
#[test]
fn a_ctrl_c_during_the_load_runs_nothing() {
    let ran = std::env::temp_dir().join(format!("memprof-stopped-run-{}", std::process::id()));
    let mut memprof = Command::new(memprof_bin());
    memprof.args(["run", "--", "touch"]).arg(&ran);
    let said = stopped_while_loading(memprof, libc::SIGINT);
    let last = said.lines().last().unwrap_or_default();
    assert!(last.starts_with("memprof: stopped before starting ") && last.ends_with("touch: it was not run"), "{said}");
    assert!(!ran.exists(), "the command ran");
}

/// Waits until process `pid` has mapped its C library: the exec names the program before its
/// dynamic linker maps that, and memprof finds no allocator in a process caught between.
fn wait_for_c_library(pid: u32) {
    let maps = format!("/proc/{pid}/maps");
    wait_for(10, "the process to map its C library", || {
        std::fs::read_to_string(&maps).ok().filter(|maps| maps.contains("/libc.so")).map(drop)
    });
}

/// Starts `memprof`, sends it `signal` once it catches it (its handlers are set up in its first
/// milliseconds, well before the load ends, most of a second), and returns what it said, once
/// it has exited with the signal's code.
fn stopped_while_loading(mut memprof: Command, signal: libc::c_int) -> String {
    let memprof = memprof.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("starting memprof");
    let status = format!("/proc/{}/status", memprof.id());
    wait_for(10, "memprof to catch the signal", || {
        let status = std::fs::read_to_string(&status).ok()?;
        let caught = status.lines().find_map(|l| l.strip_prefix("SigCgt:"))?.trim().to_string();
        (u64::from_str_radix(&caught, 16).ok()? & 1 << (signal - 1) != 0).then_some(())
    });
    // SAFETY: kill takes a pid and a signal; the pid is our own unreaped child's.
    unsafe { libc::kill(memprof.id() as libc::pid_t, signal) };
    let ended = memprof.wait_with_output().expect("waiting for memprof");
    let said = String::from_utf8_lossy(&ended.stderr).into_owned();
    assert_eq!(ended.status.code(), Some(128 + signal), "{said}");
    said
}

#[test]
fn run_follows_a_forked_child_whose_inherited_blocks_are_unknown_to_it() {
    let program = dynamic();
    let outcome = run_released(&["run", "--json", "--", &program, "fork"], "child of pid");
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    // The parent's five blocks stay the parent's: the child's frees of its copies are not theirs.
    assert_eq!(site(&report, "parent_alloc"), (500, 5), "{report}");
    assert_eq!(total(&report, "frees"), 0);
    let child = &children(&report)[0];
    assert_eq!(child["parent"], report["pid"]);
    assert_eq!(child["exited"], true);
    assert_eq!(site(child, "child_alloc"), (3 * 64, 3), "{child}");
    assert_eq!(total(child, "unknown_frees"), 5, "the inherited blocks are unknown to the child");
    assert_eq!(total(child, "frees"), 0, "never negative, never the parent's");
    assert_eq!(report["forks"]["followed"], 1);
    assert_eq!(report["forks"]["missed"], 0);
    let unseen = report["forks"]["unseen_after_fork_ns"].as_u64().unwrap();
    assert!(unseen > 0, "the child ran unseen until its probes were attached: {report}");
}

/// `diff` of two sessions that followed a fork compares their children's sites too, whatever
/// the children's pids: in JSON a child has a report of its own, in pprof its samples sit under a
/// frame `comm (pid N)`.
#[test]
fn diff_compares_the_children_of_two_sessions_by_site_whatever_their_pids() {
    let program = dynamic();
    let dir = std::env::temp_dir().join(format!("memprof-fork-diff-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (format, extension) in [("json", "json"), ("pprof", "pb.gz")] {
        let sessions: Vec<String> = (0..2)
            .map(|i| {
                let path = dir.join(format!("session{i}.{extension}")).to_str().unwrap().to_string();
                let outcome =
                    run_released(&["run", "--format", format, "-o", &path, "--", &program, "fork"], "child of pid");
                assert!(outcome.status.success(), "{outcome:?}");
                path
            })
            .collect();
        let outcome = memprof(&["diff", "--format", "json", &sessions[0], &sessions[1]]);
        assert!(outcome.status.success(), "{outcome:?}");
        let diff: Value = serde_json::from_str(&outcome.stdout).unwrap();
        let child_sites: Vec<&Value> = diff["sites"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|site| site["frames"][0]["function"] == "child_alloc")
            .collect();
        assert_eq!(child_sites.len(), 1, "{format}: one site for both children: {diff}");
        let site = child_sites[0];
        let bytes = |key: &str| site[key].as_i64().unwrap_or_else(|| panic!("{format}: no {key} in {site}"));
        assert_eq!((bytes("old_bytes"), bytes("new_bytes"), bytes("delta_bytes")), (3 * 64, 3 * 64, 0), "{format}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn attach_follows_a_child_that_allocates_and_frees_from_its_fork_exactly() {
    // The parent forks once traced; the child churns while memprof attaches to it, then leaks
    // once told to (the second "go").
    let report = attach_following_its_child(Waiting::start(&fixture("process_life"), &["fork-churn"]));
    let child = &children(&report)[0];
    assert_eq!(site(child, "child_leak"), (10 * 1000, 10), "{child}");
    assert_eq!(site(child, "churn_alloc"), (0, 0), "every churned block was freed: {child}");
    assert_eq!(total(child, "outstanding_bytes"), 10 * 1000, "{child}");
    // A free seen twice (two probes at one address) would be a double free; one unseen, a
    // missed free when its address came back.
    assert_nothing_dropped(child);
    assert_eq!(child["double_frees"], serde_json::json!([]), "{child}");
    assert!(total(child, "frees") > 0, "the churn was traced: {child}");
}

/// A parent and the child it forks, each traced by probes of its own (`--follow-forks`), both
/// calling once the child's are in place: each counts its own calls, and only those. Linux 6.1
/// runs a perf-event uretprobe's program in every process where another consumer asked for the
/// return: each process's return program also fired at the other's returns, 20000 drops each
/// (`cargo xtask kernels` runs this there).
#[test]
fn a_parent_and_its_followed_child_each_count_only_their_own_returns() {
    let report = attach_following_its_child(Waiting::start(&fixture("fork_pair"), &[]));
    for process in [&report, &children(&report)[0]] {
        assert_eq!(total(process, "allocations"), 20_000, "{process}");
        assert_eq!(total(process, "frees"), 20_000, "{process}");
        assert_nothing_dropped(process);
    }
}

/// `memprof attach --follow-forks` (exact) to `target`, which forks one child once traced: the
/// final report, its child followed.
fn attach_following_its_child(mut target: Waiting) -> serde_json::Value {
    let pid = target.pid().to_string();
    let mut memprof = Command::new(memprof_bin());
    memprof.args(["attach", "--pid", &pid, "--max-rate", "off", "--follow-forks", "--json", "--interval", "0.2"]);
    let markers = [format!("memprof: tracing pid {pid} "), format!("child of pid {pid}")];
    let outcome = released(memprof, &markers, |_| target.go());
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert_eq!(report["forks"]["followed"], 1, "{report}");
    report
}

/// `attach --follow-forks` follows the children and grandchildren the process has at attach
/// (they were skipped without a word), each exact from then on.
#[test]
fn attach_follows_the_children_that_exist_at_attach() {
    let mut target = Waiting::start(&fixture("process_life"), &["forked-before"]);
    let pid = target.pid().to_string();
    let mut memprof = Command::new(memprof_bin());
    // The duration only ends a memprof that never follows them, which would leave the test
    // waiting for their lines: it ends with the fixture otherwise.
    memprof.args([
        "attach",
        "--pid",
        &pid,
        "--max-rate",
        "off",
        "--follow-forks",
        "--json",
        "--interval",
        "0.2",
        "--duration",
        "60",
    ]);
    // Released once both are traced: the child's line, then the grandchild's.
    let markers = [format!("child of pid {pid}"), "child of pid ".to_string()];
    let mut seen = 0;
    let outcome = released(memprof, &markers, |_| {
        seen += 1;
        if seen == markers.len() {
            target.go();
        }
    });
    assert!(outcome.status.success(), "{outcome:?}");
    assert_eq!(outcome.stderr.matches("child of pid").count(), 2, "{}", outcome.stderr);
    let report = outcome.final_report();
    assert_eq!(site(&report, "parent_alloc"), (5 * 100, 5), "{report}");
    assert_eq!(report["forks"]["followed"], 2, "{report}");
    assert_eq!(report["forks"]["at_attach"], 2, "{report}");
    assert_eq!(report["forks"]["missed"], 0, "{report}");
    assert_eq!(report["forks"]["unseen_after_fork_ns"], 0, "they forked before the session: {report}");
    let children = children(&report);
    assert_eq!(children.len(), 2, "{report}");
    for child in children {
        assert_eq!(site(child, "child_alloc"), (3 * 64, 3), "{child}");
        assert_nothing_dropped(child);
    }
}

#[test]
fn each_followed_process_counts_its_own_drops() {
    let program = dynamic();
    // Room for the parent's five blocks and one of the child's three: the child drops two.
    let outcome = run_released(&["run", "--json", "--max-live", "6", "--", &program, "fork"], "child of pid");
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert_nothing_dropped(&report);
    let child = &children(&report)[0];
    assert_eq!(child["dropped"]["live_map_full"], 2, "{child}");
    assert_eq!(total(child, "allocations"), 1, "{child}");
    assert!(report.get("unattributed_dropped").is_none(), "{report}");
}

#[test]
fn run_follows_no_fork_with_follow_forks_false() {
    let program = dynamic();
    let outcome = run_released(&["run", "--json", "--follow-forks=false", "--", &program, "fork"], "tracing pid");
    let report = outcome.final_report();
    assert!(report.get("children").is_none() && report.get("forks").is_none(), "{report}");
    assert_eq!(site(&report, "parent_alloc"), (500, 5));
}

#[test]
fn a_vforked_child_that_execs_is_traced_in_its_new_program() {
    let (program, target) = (dynamic(), static_binary());
    // The new program says "ready" (on stdout, left out of the reports) and waits until memprof
    // has probed it: a child that is not ptraced runs on while memprof attaches.
    let args = ["run", "--json", "--", &program, "vfork-exec", &target, "--wait", "new-image"];
    let mut outcome = run_released(&args, " runs ");
    assert!(outcome.status.success(), "{outcome:?}");
    outcome.stdout = outcome.stdout.lines().filter(|l| l.starts_with('{')).map(|l| format!("{l}\n")).collect();
    let report = outcome.final_report();
    assert_eq!(report["forks"]["followed"], 1, "{report}");
    let child = &children(&report)[0];
    assert_eq!(child["exe"], target.as_str());
    assert_eq!(site(child, "new_image_alloc"), (7 * 512, 7), "{child}");
}

#[test]
fn a_fork_storm_counts_every_child_and_leaves_the_parent_exact() {
    let program = dynamic();
    let outcome = run_released(&["run", "--json", "--", &program, "storm", "1000"], "tracing pid");
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert_eq!(site(&report, "parent_alloc"), (96, 2), "{report}");
    let forks = &report["forks"];
    let (followed, missed) = (forks["followed"].as_u64().unwrap(), forks["missed"].as_u64().unwrap());
    assert_eq!(followed + missed, 1000, "every child is followed or counted missed: {forks}");
    assert_eq!(forks["events_lost"], 0);
    // Under load every child may die before it is attached: then none is listed.
    for child in report["children"].as_array().into_iter().flatten() {
        assert!(total(child, "outstanding_bytes") <= 32, "{child}");
    }
}

/// The daemon's Prometheus series of `pid` for `metric`, one line each: those of its comm and
/// slot, as `memprof_target_attached` names them.
fn series(daemon: &Daemon, metric: &str, pid: u32) -> Vec<String> {
    let metrics = http_get(daemon.port, "/metrics").expect("scraping the daemon").1;
    let pid_label = format!(",pid=\"{pid}\"");
    let Some(identity) = metrics.lines().find_map(|l| {
        let labels = l.strip_prefix("memprof_target_attached{")?;
        labels.contains(&pid_label).then(|| labels.split(",exe=").next().unwrap_or_default().to_string())
    }) else {
        return Vec::new();
    };
    let name = format!("{metric}{{{identity},");
    metrics.lines().filter(|l| l.starts_with(&name)).map(String::from).collect()
}

#[test]
fn the_daemon_follows_an_exec_into_another_program() {
    let new_program = fixture("daemon_target");
    let new_path = new_program.display().to_string();
    let mut target = Waiting::start(&fixture("process_life"), &["exec", &new_path, "--wait"]);
    let pid = target.pid();
    let daemon = Daemon::start(&["--pid", &pid.to_string()]);
    daemon.wait_traced(pid);
    target.go();
    // The new program says "ready" once it runs; it waits until its allocator is probed.
    assert_eq!(target.next_line(), "ready");
    let attached = format!("memprof_target_attached{{pid=\"{pid}\",comm=\"daemon_target\"}}");
    wait_for(20, "the new program to be probed", || {
        (memprof_tests::metric(daemon.port, &attached)? == 1).then_some(())
    });
    target.go();
    let leaks = format!("/api/v1/leaks?pid={pid}");
    let report = wait_for(20, "the new program's blocks", || {
        let report = daemon.get_json(&leaks).1;
        (site(&report, "hold_site") == (50 * 1000, 50)).then_some(report)
    });
    assert_eq!(site(&report, "old_image_alloc"), (0, 0), "the old image's blocks are gone: {report}");
    assert_eq!((report["comm"].as_str(), report["exe"].as_str()), (Some("daemon_target"), Some(new_path.as_str())));
    // The metrics describe the new program only: its comm, and the report's bytes.
    let inuse = series(&daemon, "memprof_heap_inuse_bytes", pid);
    let outstanding = total(&report, "outstanding_bytes");
    assert_eq!(inuse.len(), 1, "{inuse:?}");
    let named = format!("memprof_heap_inuse_bytes{{comm=\"daemon_target\",exe=\"{new_path}\"}}");
    assert_eq!(memprof_tests::sample(&inuse[0], &named), Some(outstanding), "{inuse:?}");
}

/// A program the daemon's target execs is recorded from its first call: the probes on the C
/// library, which both programs map, stay through the exec. short_prog allocates within a
/// millisecond of its start, before the daemon could probe it anew.
#[test]
fn the_daemon_records_a_program_exec_d_from_its_first_call() {
    let short_prog = fixture("short_prog").display().to_string();
    let mut target = Waiting::start(&fixture("process_life"), &["exec", &short_prog, "--wait"]);
    let pid = target.pid();
    let daemon = Daemon::start(&["--pid", &pid.to_string()]);
    daemon.wait_traced(pid);
    target.go();
    assert_eq!(target.next_line(), "ready");
    let leaks = format!("/api/v1/leaks?pid={pid}");
    let report = wait_for(20, "the new program's report", || {
        let report = daemon.get_json(&leaks).1;
        (report["exe"].as_str() == Some(short_prog.as_str()) && site(&report, "first_site") != (0, 0)).then_some(report)
    });
    // short_prog.c's truth, as `run` sees it (exec_chains.rs).
    for (function, outstanding) in [("first_site", (48, 1)), ("kept_site", (1000, 10)), ("zeroed_site", (500, 5))] {
        assert_eq!(site(&report, function), outstanding, "{function}: {report}");
    }
    assert_eq!(site(&report, "old_image_alloc"), (0, 0), "{report}");
    assert_eq!((total(&report, "allocations"), total(&report, "frees")), (16 + 20, 20), "{report}");
    assert_eq!(total(&report, "unknown_frees"), 0, "{report}");
}

/// A matching process that starts while the daemon runs is attached from its exec: the time it
/// ran before its probes, its calls unseen, is counted, as a followed child's is.
#[test]
fn the_daemon_counts_the_time_a_new_process_ran_before_its_probes() {
    let program = fixture_with("process_life.c", "daemon_newcomer", &["-g", "-O0"]);
    let daemon = Daemon::start(&["--comm", "^daemon_newcomer$"]);
    let seconds = |series| metric_f64(daemon.port, series).unwrap_or_else(|| panic!("{series} missing from /metrics"));
    assert_eq!(seconds("memprof_targets_unseen_after_start_seconds_total"), 0.0);
    let target = Waiting::start(&program, &["fork-hold"]);
    daemon.wait_traced(target.pid());
    let unseen = wait_for(20, "the time counted", || {
        Some(seconds("memprof_targets_unseen_after_start_seconds_total")).filter(|&unseen| unseen > 0.0)
    });
    assert_eq!(seconds("memprof_longest_target_unseen_after_start_seconds"), unseen, "one process");
    assert_eq!(seconds("memprof_children_unseen_after_fork_seconds_total"), 0.0, "no child");
}

/// A matching program that exits within a millisecond of its exec is gone before any attach
/// could end: each run is counted missed, not lost in silence. Found by its exec, and named by
/// the path it ran (its /proc entry is gone when the daemon reads the event).
#[test]
fn the_daemon_counts_the_matching_processes_gone_before_it_could_attach() {
    let program = fixture_with("short_prog.c", "short_missed", &["-g", "-O0"]);
    let daemon = Daemon::start(&["--comm", "^short_missed$"]);
    const RUNS: u64 = 20;
    for _ in 0..RUNS {
        assert!(Command::new(&program).status().expect("running the program").success());
    }
    wait_for(20, "every run counted missed", || {
        (metric(daemon.port, "memprof_targets_missed_total") == Some(RUNS)).then_some(())
    });
    assert_eq!(metric(daemon.port, "memprof_children_missed_total"), Some(0), "none is a traced process's child");
}

#[test]
fn the_daemon_follows_a_matching_child_and_forgets_it_when_it_exits() {
    // A name of its own, for a rule that matches this test's processes only.
    let program = fixture_with("process_life.c", "daemon_forker", &["-g", "-O0"]);
    let mut target = Waiting::start(&program, &["fork-hold"]);
    let parent = target.pid();
    let daemon = Daemon::start(&["--comm", "^daemon_forker$"]);
    daemon.wait_traced(parent);
    target.go();
    let child = wait_for(20, "the child to be traced", || {
        daemon.traced_pids().into_iter().find(|&pid| pid != parent as u64).map(|pid| pid as u32)
    });
    // The child frees its five inherited blocks and allocates its own.
    target.go();
    assert_eq!(target.next_line(), "child done");
    let leaks = format!("/api/v1/leaks?pid={child}");
    let report = wait_for(20, "the child's blocks", || {
        let report = daemon.get_json(&leaks).1;
        (site(&report, "child_alloc") == (3 * 64, 3)).then_some(report)
    });
    assert_eq!(total(&report, "unknown_frees"), 5, "the inherited blocks are unknown to the child: {report}");
    assert_eq!(total(&report, "frees"), 0, "{report}");
    assert_eq!(site(&report, "parent_alloc"), (0, 0), "the parent's blocks are not the child's: {report}");
    let parents = daemon.get_json(&format!("/api/v1/leaks?pid={parent}")).1;
    assert_eq!(site(&parents, "parent_alloc"), (500, 5), "{parents}");
    assert_eq!(metric(daemon.port, "memprof_children_followed_total"), Some(1));
    let seconds = |series| metric_f64(daemon.port, series).unwrap_or_else(|| panic!("{series} missing from /metrics"));
    let unseen = seconds("memprof_children_unseen_after_fork_seconds_total");
    let longest = seconds("memprof_longest_child_unseen_after_fork_seconds");
    assert!(unseen > 0.0, "the child ran unseen until its probes were attached: {unseen} s");
    assert_eq!(longest, unseen, "one child followed");

    // Both exit: nothing of either is left, in the daemon or in the kernel.
    target.go();
    let _ = target.child.wait();
    wait_for(20, "both to disappear", || daemon.traced_pids().is_empty().then_some(()));
    let held = || probe_links::all().into_iter().filter(|(link, _)| link.holder == daemon.child.id()).count();
    wait_for(5, "the probes to be detached", || (held() == 0).then_some(()));
    for pid in [parent, child] {
        assert_eq!(series(&daemon, "memprof_heap_inuse_bytes", pid), Vec::<String>::new());
    }
    // Purged at the next interval, with any other process gone meanwhile.
    let maps = ["live", "stack_stats", "stacks", "free_stacks"];
    wait_for(20, "their kernel state to be purged", || {
        let metrics = http_get(daemon.port, "/metrics").unwrap().1;
        maps.iter().all(|map| metrics.contains(&format!("memprof_bpf_map_entries{{map=\"{map}\"}} 0\n"))).then_some(())
    });
}

#[test]
fn after_a_fork_storm_the_daemon_holds_nothing_of_the_dead_children() {
    let program = fixture_with("process_life.c", "daemon_stormer", &["-g", "-O0"]);
    // Children that live 20 ms: long enough for some to be attached before they exit.
    let mut target = Waiting::start(&program, &["storm", "200", "20"]);
    let parent = target.pid();
    let daemon = Daemon::start(&["--comm", "^daemon_stormer$"]);
    daemon.wait_traced(parent);
    target.go();
    let (followed, missed) = wait_for(60, "every child followed or counted missed", || {
        let count = |name| metric(daemon.port, name).unwrap_or_else(|| panic!("{name} missing from /metrics"));
        let counts = (count("memprof_children_followed_total"), count("memprof_children_missed_total"));
        (counts.0 + counts.1 == 200).then_some(counts)
    });
    // Reported: how many children lived long enough to be attached depends on the machine's load.
    eprintln!("children followed {followed}, missed {missed}");
    wait_for(20, "the dead children to be gone", || (daemon.traced_pids() == [parent as u64]).then_some(()));
    let parents = daemon.get_json(&format!("/api/v1/leaks?pid={parent}")).1;
    assert_eq!(site(&parents, "parent_alloc"), (96, 2), "{parents}");
    // The kernel's live-allocation table holds the parent's blocks and nothing of its children.
    let live_of_parent = total(&parents, "outstanding_allocations");
    let entries = format!("memprof_bpf_map_entries{{map=\"live\"}} {live_of_parent}\n");
    wait_for(20, "the children's blocks purged", || {
        http_get(daemon.port, "/metrics").unwrap().1.contains(&entries).then_some(())
    });
    // The daemon's links are the parent's own, or shared by every process it traces (pid 0, if
    // 32 children were traced at once), one per program: the dead children left none.
    wait_for(20, "the dead children's links detached", || {
        let links: Vec<_> =
            probe_links::all().into_iter().filter(|(link, _)| link.holder == daemon.child.id()).collect();
        (links.iter().all(|(_, probed)| *probed == 0 || *probed == parent) && links.len() <= 8).then_some(())
    });
}

/// A traced process exits and its pid goes to a new process (which execs daemon_target) within a
/// millisecond, inside one discovery period: the daemon traces the new process from its exec,
/// with none of the old one's stacks, counts or mappings, and counts its allocations exactly.
#[test]
fn a_pid_reused_between_two_discovery_passes_is_a_new_process() {
    let program = fixture("daemon_target");
    let mut fixture = Command::new(fixture("pid_reuse"))
        .arg(&program)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting pid_reuse");
    let mut said = BufReader::new(fixture.stdout.take().expect("piped"));
    let next = |said: &mut BufReader<_>| {
        let mut line = String::new();
        said.read_line(&mut line).expect("reading pid_reuse");
        line.trim().to_string()
    };
    let old = next(&mut said);
    let pid: u32 = old.strip_prefix("old ").and_then(|p| p.parse().ok()).unwrap_or_else(|| panic!("{old}"));
    let daemon = Daemon::start(&["--comm", "^(reuse_target|daemon_target)$"]);
    daemon.wait_traced(pid);
    let mut tell = |command: &str| {
        let stdin = fixture.stdin.as_mut().expect("piped");
        stdin.write_all(format!("{command}\n").as_bytes()).expect("driving pid_reuse");
    };
    tell("hold");
    assert_eq!(next(&mut said), "held");
    let leaks = format!("/api/v1/leaks?pid={pid}");
    wait_for(10, "the old process's blocks", || {
        (site(&daemon.get_json(&leaks).1, "old_site") == (30_000, 10)).then_some(())
    });
    let attached = |daemon: &Daemon| {
        let (_, targets) = daemon.get_json("/api/v1/targets");
        let target = targets.as_array().unwrap().iter().find(|t| t["pid"] == pid).cloned();
        target.map(|t| t["attached_at"].as_f64().unwrap())
    };
    let old_attached = attached(&daemon).expect("the old process listed");

    tell("reuse");
    // The new process's "ready" and its maker's line, in either order.
    let mut lines = [next(&mut said), next(&mut said)];
    lines.sort();
    assert_eq!(lines, [format!("new {pid}"), "ready".to_string()], "the new process has the old one's pid");
    // Its exe and cgroup labels follow comm and slot.
    let attached_series = "memprof_target_attached{comm=\"daemon_target\",slot=\"0\",";
    wait_for(20, "the new program to be probed", || {
        let lines = series(&daemon, "memprof_target_attached", pid);
        lines.iter().any(|line| line.starts_with(attached_series) && line.ends_with(" 1")).then_some(())
    });
    tell("go");
    // daemon_target holds 50 x 1000 bytes from hold_site, then frees what it allocates.
    let report = wait_for(20, "the new process's report", || {
        let report = daemon.get_json(&leaks).1;
        let settled = report["exe"] == program.to_str().unwrap()
            && site(&report, "hold_site") == (50_000, 50)
            && total(&report, "outstanding_bytes") == 50_000;
        settled.then_some(report)
    });
    assert_eq!(site(&report, "old_site"), (0, 0), "the old process's blocks are not the new one's");
    let allocations = total(&report, "allocations");
    assert_eq!(total(&report, "frees"), allocations - 50, "{report}");
    assert_eq!(total(&report, "allocated_bytes"), 50_000 + 64 * (allocations - 50), "{report}");
    assert_eq!(total(&report, "unknown_frees"), 0, "{report}");
    assert_nothing_dropped(&report);
    assert!(attached(&daemon).expect("the new process listed") > old_attached, "traced since its exec");
    drop(fixture.stdin.take());
    assert!(fixture.wait().expect("waiting for pid_reuse").success());
}

/// A program under valgrind runs its code translated, breakpoints included: a breakpoint of
/// memprof's would stop it with SIGTRAP. `attach` refuses it in one line, and it runs on to its
/// end as if memprof had not been asked; `run` refuses to start valgrind.
#[test]
fn a_program_under_valgrind_is_refused_and_runs_on() {
    let mut valgrind = Command::new("valgrind");
    valgrind.args(["-q", "--leak-check=no"]).arg(fixture("short_prog")).arg("--wait");
    let mut target = Waiting::start_command(valgrind);
    let pid = target.pid().to_string();
    let outcome = memprof(&["attach", "--pid", &pid, "--duration", "1"]);
    assert_eq!(outcome.status.code(), Some(1), "{outcome:?}");
    assert!(
        outcome.stderr.trim_end().ends_with(&format!("pid {pid} runs under valgrind, which runs its code translated: memprof's breakpoints would stop it (SIGTRAP); it is not traced, valgrind's own leak check is the tool for it")),
        "{}",
        outcome.stderr
    );
    target.go();
    let status = target.child.wait().unwrap();
    assert!(status.success(), "{status}");
    // Nor is valgrind started under `run`: the probes kept through its exec would stop it.
    let outcome = memprof(&["run", "--", "valgrind", "-q", "true"]);
    assert_eq!(outcome.status.code(), Some(1), "{outcome:?}");
    assert!(outcome.stderr.contains("is valgrind, which runs its program translated"), "{}", outcome.stderr);
}
