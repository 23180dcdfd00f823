//! The daemon at its defaults spares the processes it does not trace (issue 28): no breakpoint
//! of memprof's in their code, the dynamic linker's included, while few processes map a file;
//! and a file whose traced processes pass the crossover moves to shared links with every count
//! exact. A traced process's children that memprof does not trace lose the breakpoints their
//! fork copied.

use std::{
    fs,
    io::{BufRead as _, BufReader, Read as _, Seek as _, SeekFrom},
    os::unix::process::ExitStatusExt as _,
    process::{Child, Command, Stdio},
};

use memprof_tests::{
    fixture, memprof_bin, metric, one_at_a_time, own_root, probe_links, released, site, wait_for, Daemon, Waiting,
};

/// The executable mapping of the C library in `pid`: its start, length, file offset and path.
fn libc_text(pid: u32) -> (u64, u64, u64, String) {
    let maps = fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    find_libc_text(&maps).unwrap_or_else(|| panic!("no libc text in pid {pid}'s maps:\n{maps}"))
}

/// Whether `pid` has mapped its C library's code yet (a program just exec'd has not).
fn maps_libc_text(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/maps")).is_ok_and(|maps| find_libc_text(&maps).is_some())
}

fn find_libc_text(maps: &str) -> Option<(u64, u64, u64, String)> {
    maps.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_ascii_whitespace().collect();
        let path = *fields.get(5)?;
        if !fields[1].contains('x') || !path.rsplit('/').next()?.starts_with("libc.so") {
            return None;
        }
        let (start, end) = fields[0].split_once('-')?;
        let (start, end) = (u64::from_str_radix(start, 16).ok()?, u64::from_str_radix(end, 16).ok()?);
        Some((start, end - start, u64::from_str_radix(fields[2], 16).ok()?, path.to_string()))
    })
}

/// Whether `pid`'s C library code, read through `/proc/PID/mem`, is its file's, byte for byte.
fn libc_code_is_the_files(pid: u32) -> bool {
    let (start, len, offset, path) = libc_text(pid);
    let mut memory = vec![0; len as usize];
    let mut mem = fs::File::open(format!("/proc/{pid}/mem")).unwrap();
    mem.seek(SeekFrom::Start(start)).unwrap();
    mem.read_exact(&mut memory).unwrap();
    let file = fs::read(format!("/proc/{pid}/root{path}")).unwrap();
    let end = (offset + len).min(file.len() as u64) as usize;
    memory[..end - offset as usize] == file[offset as usize..end]
}

/// The daemon at its defaults traces one process by `--comm`: beside it, valgrind runs a program
/// to its end, a program finds its own code unchanged, and an untraced process's C library is
/// its file's, byte for byte, while the traced one's has the probes' breakpoints.
#[test]
fn untraced_processes_run_as_if_memprof_were_not_there() {
    let _serial = one_at_a_time();
    let mut traced = Waiting::start(&fixture("daemon_target"), &[]);
    let untraced = Waiting::start(&fixture("malloc_loop"), &["--pairs=1000"]);
    let daemon = Daemon::start(&["--comm", "^daemon_target$"]);
    daemon.wait_traced(traced.pid());
    traced.go();
    let held = format!("/api/v1/leaks?pid={}", traced.pid());
    wait_for(20, "the held blocks", || (site(&daemon.get_json(&held).1, "hold_site") == (50_000, 50)).then_some(()));

    assert!(!libc_code_is_the_files(traced.pid()), "the traced process's C library has the probes' breakpoints");
    assert!(libc_code_is_the_files(untraced.pid()), "no breakpoint in the untraced process's C library");
    assert_eq!(probe_links::shared(daemon.child.id()), [], "no link for every process");

    let valgrind = Command::new("valgrind")
        .args(["-q", "/bin/echo", "run under valgrind"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .expect("valgrind (installed by xtask setup)");
    let stderr = String::from_utf8_lossy(&valgrind.stderr);
    assert_eq!(valgrind.status.code(), Some(0), "valgrind: {stderr}");
    assert_eq!(String::from_utf8_lossy(&valgrind.stdout), "run under valgrind\n", "{stderr}");

    let own_text = Command::new(fixture("own_text")).output().expect("running own_text");
    assert_eq!(String::from_utf8_lossy(&own_text.stdout).split(' ').take(2).collect::<Vec<_>>(), ["text", "unchanged"]);
    assert!(own_text.status.success(), "{own_text:?}");
    assert_eq!(metric(daemon.port, "memprof_untraced_processes_sharing_probes"), Some(0));
}

/// A process that starts after the daemon and matches its `--comm` rule is traced from its exec,
/// found by the kernel's exec event, not by a scan of /proc (the daemon's one scan is at start):
/// every block it then allocates is counted; and it is let go at its exit, again without a scan.
#[test]
fn a_process_started_later_is_found_from_its_exec_without_a_scan() {
    let _serial = one_at_a_time();
    let daemon = Daemon::start(&["--comm", "^daemon_target$", "--resync-interval", "100000"]);
    let scans = || metric(daemon.port, "memprof_discovery_scans_total");
    assert_eq!(scans(), Some(1), "the scan at start");
    let mut target = Waiting::start(&fixture("daemon_target"), &[]);
    daemon.wait_traced(target.pid());
    target.go();
    let held = format!("/api/v1/leaks?pid={}", target.pid());
    wait_for(20, "the held blocks", || (site(&daemon.get_json(&held).1, "hold_site") == (50_000, 50)).then_some(()));
    let pid = u64::from(target.pid());
    drop(target);
    wait_for(20, "the exited process let go", || (!daemon.traced_pids().contains(&pid)).then_some(()));
    assert_eq!(scans(), Some(1), "found and let go without a scan");
}

/// With the crossover set to 3, the daemon gives the first two processes its rule matches links
/// of their own and the rest links shared per file, switching while they run: each process's
/// blocks are counted once, none missed, whichever links it has; the switch is logged once, and
/// the untraced processes it costs a trap per call are counted.
#[test]
fn a_file_moves_to_shared_links_with_every_count_exact() {
    let _serial = one_at_a_time();
    let mut daemon = Daemon::start_with_env(&["--comm", "^daemon_target$"], &[("MEMPROF_SHARE_FROM", "3")]);
    let mut targets = Vec::new();
    for n in 0..5 {
        let target = Waiting::start(&fixture("daemon_target"), &[]);
        daemon.wait_traced(target.pid());
        let own = probe_links::probing(target.pid());
        assert_eq!(own.is_empty(), n >= 2, "process {n}'s own links: {own:?}");
        let shared = probe_links::shared(daemon.child.id());
        assert_eq!(shared.is_empty(), n < 2, "shared links with process {n}: {shared:?}");
        if n < 2 {
            assert_eq!(metric(daemon.port, "memprof_untraced_processes_sharing_probes"), Some(0));
        }
        targets.push(target);
    }
    for target in &mut targets {
        target.go();
    }
    for target in &targets {
        let held = format!("/api/v1/leaks?pid={}", target.pid());
        wait_for(20, &format!("pid {}'s held blocks", target.pid()), || {
            (site(&daemon.get_json(&held).1, "hold_site") == (50_000, 50)).then_some(())
        });
    }
    // This test's own process maps the C library, and is not traced.
    wait_for(10, "the untraced processes sharing probes", || {
        (metric(daemon.port, "memprof_untraced_processes_sharing_probes")? >= 1).then_some(())
    });
    for target in &targets {
        let (_, report) = daemon.get_json(&format!("/api/v1/leaks?pid={}", target.pid()));
        let dropped = report["dropped"].as_object().expect("dropped");
        assert!(dropped.values().all(|count| count == 0), "pid {}: {dropped:?}", target.pid());
    }
    let log = daemon.stopped_log();
    assert_eq!(log.matches("its probes are shared from now on").count(), 2, "libc and ld.so, once each: {log}");
}

/// The daemon's first scan finds, with the crossover at 3, three processes in a root of their
/// own (each with its own copy of the C library) and one on the host's: the copy's links are
/// shared, said once with the copy's path, but the host's C library, which one traced process
/// maps, keeps links of its own, and this untraced test process's code stays its file's. The
/// scan counted every process it found as mapping every file, and shared them all.
#[test]
fn a_first_scan_shares_only_the_files_enough_of_its_processes_map() {
    let _serial = one_at_a_time();
    let program = fixture("daemon_target");
    let root = own_root(&program, "daemon_target");
    let mut targets: Vec<Waiting> = (0..3)
        .map(|_| {
            let mut chrooted = Command::new("chroot");
            chrooted.arg(&root).args(["/daemon_target", "--wait"]);
            Waiting::start_command(chrooted)
        })
        .collect();
    targets.push(Waiting::start(&program, &[]));
    let mut daemon = Daemon::start_with_env(&["--comm", "^daemon_target$"], &[("MEMPROF_SHARE_FROM", "3")]);
    for target in &targets {
        daemon.wait_traced(target.pid());
    }
    let host = targets.last().expect("the host's process").pid();
    assert!(!probe_links::probing(host).is_empty(), "the host's C library keeps links of its own");
    assert!(libc_code_is_the_files(std::process::id()), "this untraced process's C library is its file's");
    daemon.signal(libc::SIGTERM);
    assert!(daemon.child.wait().unwrap().success());
    let _ = fs::remove_dir_all(&root);
    let log = daemon.log();
    let copy = root.join("lib/x86_64-linux-gnu/libc.so.6");
    assert!(log.contains(&format!("map {}: its probes are shared", copy.display())), "{log}");
    assert!(!log.contains("map_files"), "{log}");
}

/// The child's pid, which `forker` writes once it has forked.
fn forked_child(forker: &mut Waiting) -> u32 {
    let mut line = String::new();
    BufReader::new(forker.child.stdout.as_mut().unwrap()).read_line(&mut line).unwrap();
    line.trim().strip_prefix("child ").and_then(|pid| pid.parse().ok()).unwrap_or_else(|| panic!("{line}"))
}

/// `attach` without `--follow-forks`: the child its target forks has copies of the target's
/// breakpoints, where it would trap at every call though nothing records it. memprof has the
/// kernel take them out at its next interval, while the target keeps its own.
#[test]
fn a_child_attach_does_not_follow_loses_its_parents_breakpoints() {
    let mut forker = Waiting::start(&fixture("forker"), &[]);
    let outcome = attach_until_the_child_is_swept(&mut forker, &[]);
    assert!(outcome.status.success(), "{outcome:?}");
}

/// `attach --interval 0.5` to `forker`, released: its child's C library code is its file's within
/// 20 s, while `forker` and the processes `also_traced` keep their breakpoints. Returns once
/// memprof has ended (SIGINT).
fn attach_until_the_child_is_swept(forker: &mut Waiting, also_traced: &[u32]) -> memprof_tests::Outcome {
    let pid = forker.pid();
    let mut memprof = Command::new(memprof_bin());
    memprof.args(["attach", "--pid", &pid.to_string(), "--interval", "0.5", "-o", "/dev/null"]);
    released(memprof, &[format!("memprof: tracing pid {pid} ")], |memprof| {
        forker.go();
        let child = forked_child(forker);
        wait_for(20, "the child's C library code to be its file's", || libc_code_is_the_files(child).then_some(()));
        assert!(!libc_code_is_the_files(pid), "the traced process keeps its breakpoints");
        for &other in also_traced {
            assert!(!libc_code_is_the_files(other), "pid {other}, traced, keeps its breakpoints");
        }
        // SAFETY: signalling our own child.
        unsafe { libc::kill(memprof.id() as i32, libc::SIGINT) };
    })
}

/// `attach` without `--follow-forks` to a process that has children, as a forking server does:
/// its probes are perf-event uprobes, which the kernel takes out of a child it forks at the
/// child's first trap at each, long before memprof's next interval (a minute here). A child that
/// lives for milliseconds pays a trap a probe, not one a call.
#[test]
fn a_forking_servers_child_drops_each_breakpoint_at_its_first_call() {
    // Not beside a daemon whose links are shared: they put breakpoints in every process.
    let _serial = one_at_a_time();
    let mut forker = Waiting::start(&fixture("forker"), &["server"]);
    let pid = forker.pid();
    let mut memprof = Command::new(memprof_bin());
    memprof.args(["attach", "--pid", &pid.to_string(), "--interval", "60", "-o", "/dev/null"]);
    let mut seen = (false, false);
    let outcome = released(memprof, &[format!("memprof: tracing pid {pid} ")], |memprof| {
        forker.go();
        // It wrote its pid after one call to each probed function.
        let child = forked_child(&mut forker);
        seen = (libc_code_is_the_files(child), libc_code_is_the_files(pid));
        // SAFETY: signalling our own child.
        unsafe { libc::kill(memprof.id() as i32, libc::SIGINT) };
    });
    assert_eq!(seen, (true, false), "the child's C library code is its file's, the target's is not: {outcome:?}");
    assert!(outcome.status.success(), "{outcome:?}");
    assert!(outcome.stderr.contains(&format!("memprof: pid {pid} has children")), "{outcome:?}");
}

/// The same forking server, with the daemon tracing another process: the daemon's link on each
/// probed function keeps every breakpoint a fork copies (the kernel takes one out of a process
/// only when every probe on it agrees), so memprof takes them out of the child at its next
/// interval, as it does for its own links; the daemon's target keeps its breakpoints.
#[test]
fn a_forking_servers_child_beside_the_daemons_links_loses_its_breakpoints_at_the_interval() {
    let _serial = one_at_a_time();
    let mut other = Waiting::start(&fixture("daemon_target"), &[]);
    let daemon = Daemon::start(&["--comm", "^daemon_target$"]);
    daemon.wait_traced(other.pid());
    let mut forker = Waiting::start(&fixture("forker"), &["server"]);
    let outcome = attach_until_the_child_is_swept(&mut forker, &[other.pid()]);
    assert!(outcome.status.success(), "{outcome:?}");
    assert!(outcome.stderr.contains(&format!("memprof: pid {} has children", forker.pid())), "{outcome:?}");
    other.go();
}

/// A target that execs into a program whose name the rules do not match is let go at its exec,
/// its breakpoints with it, not at the daemon's next scan of `/proc` (a minute later).
#[test]
fn a_target_that_execs_out_of_the_rules_loses_its_breakpoints_at_once() {
    let _serial = one_at_a_time();
    let mut target = Waiting::start(&fixture("process_life"), &["exec", "/usr/bin/sleep", "1000"]);
    let pid = target.pid();
    let daemon = Daemon::start(&["--comm", "^process_life$"]);
    daemon.wait_traced(pid);
    target.go();
    wait_for(10, "the exec'd program's C library code to be its file's", || {
        // The dynamic linker maps the C library a moment after the exec.
        (procfs_comm(pid) == "sleep" && maps_libc_text(pid) && libc_code_is_the_files(pid)).then_some(())
    });
}

fn procfs_comm(pid: u32) -> String {
    fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default().trim().to_string()
}

/// The daemon traces a process by its name; the child it forks under another name is not
/// traced, and loses the breakpoints its fork copied.
#[test]
fn a_child_the_daemons_rules_leave_out_loses_its_parents_breakpoints() {
    let _serial = one_at_a_time();
    let mut forker = Waiting::start(&fixture("forker"), &[]);
    let daemon = Daemon::start(&["--comm", "^forker$"]);
    daemon.wait_traced(forker.pid());
    forker.go();
    let child = forked_child(&mut forker);
    wait_for(20, "the child's C library code to be its file's", || libc_code_is_the_files(child).then_some(()));
    assert!(!libc_code_is_the_files(forker.pid()), "the traced process keeps its breakpoints");
}

/// memprof killed as it closes its first probe link (the OOM killer, `kill -9` or a stop timeout
/// at the end of a session): the kernel takes the breakpoints out of the target all the same and
/// leaks no uprobe. A SIGKILL pending in the thread that makes a uprobe's last close has the
/// kernel give up its walk of the target's memory ("failed to unregister, leaking uprobe"):
/// bpftrace sends it at memprof's close of a link on the target.
#[test]
fn memprof_killed_as_it_closes_its_links_leaves_no_breakpoint_and_no_uprobe_behind() {
    let _serial = one_at_a_time();
    let target = Waiting::start(&fixture("daemon_target"), &[]);
    let pid = target.pid();
    let mut memprof = Command::new(memprof_bin());
    memprof.args(["attach", "--pid", &pid.to_string(), "--interval", "60", "-o", "/dev/null"]);
    let (mut bpftrace, mut leaks_before) = (None, 0);
    let outcome = released(memprof, &[format!("memprof: tracing pid {pid} ")], |memprof| {
        bpftrace = Some(kill_at_link_close(memprof.id(), pid));
        leaks_before = kernel_leaked_uprobes();
        // SAFETY: signalling our own child.
        unsafe { libc::kill(memprof.id() as i32, libc::SIGINT) };
    });
    if let Some(mut bpftrace) = bpftrace {
        let _ = bpftrace.kill();
        let _ = bpftrace.wait();
    }
    assert_eq!(
        outcome.status.signal(),
        Some(libc::SIGKILL),
        "bpftrace killed memprof at its close of a link: {outcome:?}"
    );
    wait_for(10, "no process to hold links on the target", || probe_links::probing(pid).is_empty().then_some(()));
    // The last link's release, in the killed process's exit, may still be taking the breakpoints
    // out when its descriptors are gone (seen once in a full run).
    wait_for(10, "no breakpoint left in the target's C library", || libc_code_is_the_files(pid).then_some(()));
    assert_eq!(kernel_leaked_uprobes(), leaks_before, "the kernel leaked a uprobe");
}

/// bpftrace, its probe attached, sending SIGKILL to `memprof` when it closes a link on `target`.
fn kill_at_link_close(memprof: u32, target: u32) -> Child {
    let links = probe_links::descriptors(memprof, target);
    assert!(!links.is_empty(), "memprof holds links on pid {target}");
    let closing_one: Vec<String> = links.iter().map(|fd| format!("args->fd == {fd}")).collect();
    let us = std::process::id();
    // One probe both answers this test's close of a descriptor it does not have (bpftrace's BEGIN
    // fires before its probes are attached) and kills memprof.
    let program = format!(
        "tracepoint:syscalls:sys_enter_close /pid == {us} || pid == {memprof}/ {{ \
           if (pid == {us} && args->fd == {NOT_OPEN}) {{ printf(\"armed\\n\"); }} \
           else if (pid == {memprof} && ({})) {{ signal(\"SIGKILL\"); exit(); }} }}",
        closing_one.join(" || ")
    );
    let (bpftrace, said_armed) = bpftrace_saying(&program, "armed");
    wait_for(30, "bpftrace's probe to be attached", || {
        // SAFETY: closes a descriptor this process does not have (EBADF), for the probe to see.
        unsafe { libc::close(NOT_OPEN) };
        said_armed.recv_timeout(std::time::Duration::from_millis(50)).ok()
    });
    bpftrace
}

/// A descriptor number no process here has open.
const NOT_OPEN: i32 = 1_000_000;

/// How many times the kernel's log says it leaked a uprobe.
fn kernel_leaked_uprobes() -> usize {
    let log = Command::new("dmesg").output().expect("dmesg");
    String::from_utf8_lossy(&log.stdout).matches("leaking uprobe").count()
}

/// memprof SIGKILLed with the forking shell it follows, at moments spread over its attaches to
/// the shell's children: the kernel leaks no uprobe. An attach puts breakpoints in, and a SIGKILL
/// pending in the thread that attaches had the kernel give up and leak the uprobe, in 1 kill in
/// 10 to 1 in 3; memprof's helper now makes those calls (`kernel::helper`).
#[test]
fn memprof_killed_while_it_attaches_leaks_no_uprobe() {
    let _serial = one_at_a_time();
    let leaks_before = kernel_leaked_uprobes();
    for round in 0..15 {
        let (memprof, shell) = memprof_following_a_shell("while :; do /bin/true; sleep 0.03; done", Stdio::null());
        std::thread::sleep(std::time::Duration::from_millis(500 + round * 61 % 500));
        drop(shell);
        drop(memprof);
    }
    assert_eq!(kernel_leaked_uprobes(), leaks_before, "the kernel leaked a uprobe");
}

/// memprof SIGKILLed as the OOM killer kills it, with every process that shares its memory, at
/// the moment one of its attaches puts breakpoints in: the kernel leaks no uprobe. bpftrace kills
/// the process that makes the attach's system call if it shares memprof's memory, and the test
/// kills memprof when bpftrace says the call began. memprof made those calls from a process that
/// shared its memory, and the kernel leaked the uprobe; now its helper makes them.
#[test]
fn memprof_killed_as_the_oom_killer_kills_while_it_attaches_leaks_no_uprobe() {
    let _serial = one_at_a_time();
    let leaks_before = kernel_leaked_uprobes();
    for _ in 0..4 {
        // Children that live long enough for memprof to put breakpoints in them.
        let (memprof, _shell) = memprof_following_a_shell("while :; do sleep 0.3; done", Stdio::null());
        let (mut bpftrace, attaching) = kill_at_attach(memprof.0.id());
        let began = attaching.recv_timeout(std::time::Duration::from_secs(30));
        drop(memprof);
        let _ = bpftrace.kill();
        let _ = bpftrace.wait();
        assert!(began.is_ok(), "memprof attached to a child of its shell");
    }
    assert_eq!(kernel_leaked_uprobes(), leaks_before, "the kernel leaked a uprobe");
}

/// bpftrace, at the next uprobe_multi link (`bpf(BPF_LINK_CREATE)`) made by a child of
/// `memprof`'s: it SIGKILLs that process if it shares memprof's memory, and says so on the
/// channel returned. memprof attaches to each child its shell forks: the next comes at once.
fn kill_at_attach(memprof: u32) -> (Child, std::sync::mpsc::Receiver<()>) {
    // The tests on `curtask` are in the body: bpftrace drops a predicate that holds one.
    let program = format!(
        "tracepoint:syscalls:sys_enter_bpf /args->cmd == {BPF_LINK_CREATE}/ {{ \
           if (curtask->real_parent->tgid == {memprof}) {{ \
             if (curtask->mm == curtask->real_parent->mm) {{ signal(\"SIGKILL\"); }} \
             printf(\"attaching\\n\"); exit(); }} }}"
    );
    bpftrace_saying(&program, "attaching")
}

/// bpftrace running `program`, and what tells when it first prints `line`.
fn bpftrace_saying(program: &str, line: &'static str) -> (Child, std::sync::mpsc::Receiver<()>) {
    let mut bpftrace = Command::new("bpftrace")
        .args(["--unsafe", "-e", program])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("bpftrace (installed by xtask setup)");
    let lines = BufReader::new(bpftrace.stdout.take().unwrap()).lines();
    let (said, saying) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        if lines.map_while(Result::ok).any(|printed| printed == line) {
            let _ = said.send(());
        }
    });
    (bpftrace, saying)
}

/// `BPF_LINK_CREATE` of the kernel's `enum bpf_cmd`.
const BPF_LINK_CREATE: u32 = 28;

/// The helper that attaches probes and makes the links' last closes (`memprof __helper`,
/// started at the first attach and kept) is not the OOM killer's pick, never outlives memprof and
/// is never left a zombie: killed, it is reaped and replaced at the next attach or detach, whose
/// calls memprof does not make itself; memprof SIGKILLed, it ends at the end of its socket.
#[test]
fn memprofs_helper_is_replaced_when_killed_and_ends_with_memprof() {
    let _serial = one_at_a_time();
    let log = std::env::temp_dir().join(format!("memprof-helper-{}.log", std::process::id()));
    // Each `true` is a child followed and detached at its exit. The shell outlives memprof's
    // SIGKILL, as a target should, but not the test.
    let log_file = fs::File::create(&log).expect("a log file");
    let (memprof, _shell) = memprof_following_a_shell("while :; do /bin/true; sleep 0.1; done", log_file.into());
    let memprof_pid = memprof.0.id();
    let first = wait_for(20, "memprof's helper", || helper_of(memprof_pid));
    // Only a root with CAP_SYS_RESOURCE may lower it; the VM this project's CI runs on has none.
    if has_capability(CAP_SYS_RESOURCE) {
        let oom_score_adj = fs::read_to_string(format!("/proc/{first}/oom_score_adj")).unwrap_or_default();
        assert_eq!(oom_score_adj.trim(), "-1000", "the OOM killer never picks the helper");
    }
    // SAFETY: signalling a process this test found as memprof's child.
    unsafe { libc::kill(first as i32, libc::SIGKILL) };
    // Two detaches at once keep two helpers: the one not killed may serve the next detach.
    wait_for(20, "the killed helper reaped, not left memprof's zombie", || {
        (parent_of(first) != Some(memprof_pid)).then_some(())
    });
    let second = wait_for(20, "a helper after it", || helper_of(memprof_pid).filter(|&helper| helper != first));
    drop(memprof);
    wait_for(10, "the helper to end with memprof", || ended_or_zombie(second).then_some(()));
    let said = fs::read_to_string(&log).unwrap_or_default();
    let _ = fs::remove_file(&log);
    // The helper may have been killed in the middle of a detach: its exit closed that one's links.
    assert!(!said.contains("memprof makes those calls itself"), "{said}");
}

/// `memprof run --follow-forks` of a shell running `script` (memprof's standard error to
/// `stderr`), and the shell, once memprof has started it.
fn memprof_following_a_shell(script: &str, stderr: Stdio) -> (Reaped, KilledAtTheEnd) {
    let memprof = Command::new(memprof_bin())
        .args(["run", "--follow-forks", "--interval", "60", "-o", "/dev/null", "--", "sh", "-c", script])
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .expect("starting memprof");
    let memprof_pid = memprof.id();
    let memprof = Reaped(memprof);
    let shell =
        wait_for(20, "memprof's command", || children_of(memprof_pid).into_iter().find(|&c| procfs_comm(c) == "sh"));
    (memprof, KilledAtTheEnd(shell))
}

/// A child of the test's, SIGKILLed and reaped when dropped, however the test ends.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A process the test started that is not its child, SIGKILLed when the test ends.
struct KilledAtTheEnd(u32);

impl Drop for KilledAtTheEnd {
    fn drop(&mut self) {
        // SAFETY: signalling a process only this test ends (no other ends it, so its pid is not
        // reused before).
        unsafe { libc::kill(self.0 as i32, libc::SIGKILL) };
    }
}

/// The capability's bit, from linux/capability.h.
const CAP_SYS_RESOURCE: u32 = 24;

/// Whether this process has `capability` in its effective set.
fn has_capability(capability: u32) -> bool {
    let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
    let effective = status.lines().find_map(|line| line.strip_prefix("CapEff:"));
    effective.and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok()).is_some_and(|set| set & (1 << capability) != 0)
}

/// The processes whose parent is `pid`.
fn children_of(pid: u32) -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&child| parent_of(child) == Some(pid))
        .collect()
}

/// `pid`'s parent, from `/proc/PID/stat` (after the command's name, which may hold spaces).
fn parent_of(pid: u32) -> Option<u32> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
}

/// memprof's child that runs its helper.
fn helper_of(memprof: u32) -> Option<u32> {
    children_of(memprof).into_iter().find(|&child| {
        fs::read(format!("/proc/{child}/cmdline"))
            .is_ok_and(|cmdline| cmdline.split(|&byte| byte == 0).any(|argument| argument == b"__helper"))
    })
}

/// Gone, or a zombie waiting for its parent (init, once memprof has gone).
fn ended_or_zombie(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .map_or(true, |stat| stat.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')))
}
