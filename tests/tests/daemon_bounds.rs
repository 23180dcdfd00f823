//! The daemon within its bounds whatever the traced processes and the clients do: 65,536 deep
//! stacks with 64 KiB names under the shipped unit's 1 GiB memory limit while 30 clients ask for
//! the HTML report and /metrics answers within a second; signals from its first moment; a process
//! that holds most of the live table; one user's processes that would take every unwind row.

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::TcpStream,
    path::Path,
    process::{Command, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use memprof_tests::{
    attach_with, cgroup::MemoryCgroup, fixture, fixture_cpp, fixture_musl_unnamed_mmap, fixture_with, http_get,
    memprof_bin, metric, site, socket_answer, start_heapbench, total, wait_for, Daemon, Scratch, Waiting,
    MOVES_TO_PAGES_ANYWHERE,
};

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The shipped systemd unit's `MemoryMax` and the DaemonSet's memory limit.
const MEMORY_MAX: u64 = 1 << 30;

/// `GET path`, read to the end; the status, or None.
fn fetch(port: u16, path: &str) -> Option<(u16, usize)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(120))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").ok()?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).ok()?;
    let status = String::from_utf8_lossy(&answer[..answer.len().min(20)]).split_whitespace().nth(1)?.parse().ok()?;
    Some((status, answer.len()))
}

fn inuse_objects(daemon: &Daemon) -> u64 {
    let (_, targets) = daemon.get_json("/api/v1/targets");
    targets[0]["inuse_objects"].as_u64().unwrap_or(0)
}

/// 65,536 distinct deep stacks and 30 reports of them asked for at once: the daemon stays under
/// its unit's memory limit and answers every scrape meanwhile. How fast it answers (issue 28: within
/// a second) is a time, measured by `cargo xtask bench` (BENCHMARKS.md, "The daemon at rest").
#[test]
fn sixty_five_thousand_deep_stacks_and_thirty_reports_stay_under_one_gib_and_metrics_answer_meanwhile() {
    let _serial = serial();
    let group = MemoryCgroup::new(&format!("memprof-test-{}", std::process::id()), MEMORY_MAX);
    let program = fixture("many_stacks");
    let mut many = Waiting::start(&program, &[]);
    // Every call recorded: the point is the number of distinct stacks.
    let daemon = Daemon::spawn(&["--pid", &many.pid().to_string(), "--max-rate", "1000000000"], &[]);
    group.enter(daemon.child.id());
    let port = daemon.port;
    wait_for(30, "the daemon to be ready", || (http_get(port, "/-/ready")?.0 == 200).then_some(()));
    many.go();
    let mut done = String::new();
    BufReader::new(many.child.stdout.as_mut().unwrap()).read_line(&mut done).unwrap();
    assert_eq!(done, "done\n");
    wait_for(180, "all 65,536 blocks in the daemon's report", || (inuse_objects(&daemon) == 65_536).then_some(()));

    let reporting = Arc::new(AtomicBool::new(true));
    let path = format!("/report?pid={}", many.pid());
    let reports: Vec<_> = (0..30)
        .map(|_| {
            let (path, socket) = (path.clone(), daemon.socket.clone());
            std::thread::spawn(move || socket_answer(&socket, "GET", &path).map(|a| (a.status, a.body.len())))
        })
        .collect();
    let scraper = {
        let reporting = reporting.clone();
        std::thread::spawn(move || {
            let mut scrapes = 0;
            while reporting.load(Ordering::Relaxed) || scrapes < 10 {
                assert_eq!(fetch(port, "/metrics").expect("a scrape").0, 200);
                scrapes += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
            scrapes
        })
    };
    let answers: Vec<Option<(u16, usize)>> = reports.into_iter().map(|r| r.join().unwrap()).collect();
    reporting.store(false, Ordering::Relaxed);
    let scrapes = scraper.join().unwrap();
    eprintln!(
        "30 reports: {:?}; {scrapes} scrapes answered; cgroup peak {} MiB (page cache included)",
        answers.iter().map(|a| a.map(|(status, len)| (status, len))).collect::<Vec<_>>(),
        group.peak() >> 20
    );
    assert!(answers.iter().all(|a| a.is_some_and(|(status, _)| status == 200)), "{answers:?}");
    assert_eq!(group.oom_kills(), 0, "the daemon was OOM-killed");
    assert_eq!(inuse_objects(&daemon), 65_536, "the daemon still serves the exact count");
    // The page shows the largest stacks within its budget and says how many it left out.
    let html = daemon.get(&path).unwrap().1;
    assert!(html.contains("\"stacks_not_shown\":"), "the page counts the stacks it leaves out");
    // Names are capped: a 64 KiB name is cut at 4 KiB with its marker.
    assert!(html.contains("...[61440 more bytes]"), "the long names are capped");
}

fn assert_alive_and_serving(daemon: &mut Daemon) {
    wait_for(30, "the daemon to be ready", || (http_get(daemon.port, "/-/ready")?.0 == 200).then_some(()));
    assert!(daemon.child.try_wait().unwrap().is_none(), "the daemon exited");
}

#[test]
fn sighup_and_sigterm_in_the_daemons_first_moment_are_handled() {
    let _serial = serial();
    let held = Waiting::start(&fixture("daemon_target"), &[]);
    let pid = held.pid().to_string();
    // A reload while the BPF programs load (about a second): the config is read again.
    let mut daemon = Daemon::spawn(&["--pid", &pid], &[]);
    std::thread::sleep(Duration::from_millis(100));
    daemon.signal(libc::SIGHUP);
    assert_alive_and_serving(&mut daemon);
    daemon.wait_traced(held.pid());
    daemon.signal(libc::SIGHUP);
    assert_alive_and_serving(&mut daemon);

    // A stop while starting: a clean exit, not death by the signal.
    let mut daemon = Daemon::spawn(&["--pid", &pid], &[]);
    std::thread::sleep(Duration::from_millis(100));
    daemon.signal(libc::SIGTERM);
    let status = daemon.child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "{status}");
}

/// The daemon under a memory cgroup of 512 MiB asked to inspect a process holding 700 MiB: it
/// refuses in one line before it copies anything (the room its cgroup leaves it, not the
/// host's memory, is what it checks), and lives on, serving `/metrics`.
#[test]
fn an_inspection_larger_than_the_daemons_memory_limit_is_refused_in_one_line() {
    let _serial = serial();
    let group = MemoryCgroup::new(&format!("memprof-test-inspect-{}", std::process::id()), 512 << 20);
    let mut target = start_heapbench(700);
    let pid = target.id();
    let mut daemon = Daemon::spawn(&["--pid", &pid.to_string()], &[]);
    group.enter(daemon.child.id());
    assert_alive_and_serving(&mut daemon);
    daemon.wait_traced(pid);
    let (status, body) = daemon.get(&format!("/api/v1/inspect?pid={pid}")).expect("an answer");
    assert_ne!(status, 200, "{body}");
    assert!(!body.trim_end().contains('\n'), "one line: {body}");
    assert!(
        body.contains(&format!(
            "under its cgroup's memory limit ({}) to copy them into; it was not inspected",
            group.limit_file()
        )),
        "{body}"
    );
    assert_alive_and_serving(&mut daemon);
    assert_eq!(http_get(daemon.port, "/metrics").expect("/metrics").0, 200);
    assert_eq!(group.oom_kills(), 0, "the daemon was OOM-killed");
    drop(daemon);
    drop(target.stdin.take());
    assert!(target.wait().unwrap().success());
}

/// The daemon moved into a memory cgroup of 192 MiB asked to inspect a process holding 2,000,000
/// small blocks it tracked: their copy (64 MiB) fits, but classing them would take more than the
/// rest. It refuses in one line before it stops the process, and lives on. (It was OOM-killed.)
#[test]
fn an_inspection_of_more_tracked_blocks_than_the_daemons_memory_allows_is_refused() {
    let _serial = serial();
    let mut target = Waiting::start(&fixture("small_blocks"), &["2000000", "after"]);
    let pid = target.pid();
    let mut daemon = Daemon::start(&["--pid", &pid.to_string(), "--max-live", "4194304"]);
    daemon.wait_traced(pid);
    target.go();
    let mut held = String::new();
    BufReader::new(target.child.stdout.as_mut().unwrap()).read_line(&mut held).unwrap();
    assert_eq!(held, "held\n");
    let leaks = format!("/api/v1/leaks?pid={pid}");
    wait_for(30, "the blocks", || {
        (total(&daemon.get_json(&leaks).1, "outstanding_allocations") >= 2_000_000).then_some(())
    });
    // Its maps stay charged where they were made: the cgroup holds what the inspection takes.
    let group = MemoryCgroup::new(&format!("memprof-test-classing-{}", std::process::id()), 192 << 20);
    group.enter(daemon.child.id());
    let (status, body) = daemon.get(&format!("/api/v1/inspect?pid={pid}")).expect("an answer");
    assert_ne!(status, 200, "{body}");
    assert!(!body.trim_end().contains('\n'), "one line: {body}");
    assert!(body.contains("holds 2000000 blocks memprof tracks, and classing them would take about"), "{body}");
    assert!(body.contains(&format!("under its cgroup's memory limit ({})", group.limit_file())), "{body}");
    assert_alive_and_serving(&mut daemon);
    assert_eq!(group.oom_kills(), 0, "the daemon was OOM-killed");
    let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    assert!(!state.split(") ").nth(1).unwrap().starts_with('t'), "the process is not left stopped: {state}");
    // Out of the cgroup before it is removed.
    drop(daemon);
}

/// Millions of small blocks made before the attach, their copy within memprof's memory limit but
/// not their marking as blocks: they are scanned as roots, the report says why, and memprof
/// lives.
#[test]
fn blocks_made_before_the_attach_too_many_to_mark_are_said_not_classed() {
    let _serial = serial();
    let group = MemoryCgroup::new(&format!("memprof-test-unseen-{}", std::process::id()), 512 << 20);
    let mut target = Waiting::start(&fixture("small_blocks"), &["4000000"]);
    let pid = target.pid();
    let mut memprof = Command::new("sh");
    memprof.args(["-c", r#"echo $$ > "$0" && exec "$@""#]).arg(group.procs()).arg(memprof_bin());
    let outcome = attach_with(memprof, &mut target, pid, &["--inspect", "--duration", "2"]);
    assert_eq!(group.oom_kills(), 0, "memprof was OOM-killed: {outcome:?}");
    assert!(outcome.status.success(), "{outcome:?}");
    let inspection = &outcome.final_report()["inspection"];
    assert!(inspection["untracked_blocks"].as_u64() >= Some(4_000_000), "{inspection}");
    assert!(inspection.get("untracked_classes").is_none(), "{inspection}");
    let why = inspection["untracked_not_classed"].as_str().unwrap_or_default();
    assert!(
        why.starts_with("marking them would take about ")
            && why.ends_with(&format!(
                "left to memprof under its cgroup's memory limit ({}); scanned as roots",
                group.limit_file()
            )),
        "{inspection}"
    );
    target.child.stdin.as_mut().unwrap().write_all(b"end\n").unwrap();
    assert_eq!(target.child.wait().unwrap().code(), Some(3), "the target did not end as it would alone");
}

/// Maps too large for a memory cgroup that holds the rest (a live table of 16M entries, 256 MiB
/// of buckets, under 256 MiB): the kernel refuses them, and the daemon says so in one line with
/// the limit and the flags that lower their size.
#[test]
fn a_memory_cgroup_too_small_for_the_maps_is_named_with_the_flags_that_shrink_them() {
    let _serial = serial();
    let group = MemoryCgroup::new(&format!("memprof-test-maps-{}", std::process::id()), 256 << 20);
    let procs = group.procs();
    let enter = ["sh", "-c", r#"echo $$ > "$0" && exec "$@""#, procs.to_str().unwrap()];
    let stderr = memprof_tests::refused_daemon(&enter, &["--socket", "", "--max-live", "16777216"]);
    assert!(
        stderr.starts_with("memprof: error: the kernel has no memory for memprof's maps: a memory cgroup's limit")
            && stderr.contains("lower --max-live, --max-stacks and --max-unwind-rows"),
        "{stderr}"
    );
    assert_eq!(group.oom_kills(), 0);
}

/// A memory cgroup of 96 MiB holds the maps at their default sizes (49 MiB), but not what the
/// kernel's verifier takes while it checks the programs, which Linux 6.17 and later charge to it
/// (about 45 MiB more on 6.18, which memprof asks room for with a margin). The kernel once
/// OOM-killed memprof there with nothing said (exit 137); the daemon and `run` now refuse in one
/// line, naming the cgroup and how much to raise its limit. On a kernel whose verifier charges
/// nothing, `run` starts.
#[test]
fn a_memory_cgroup_too_small_for_the_verifier_is_said_in_one_line_not_by_an_oom_kill() {
    let _serial = serial();
    let name = format!("memprof-test-verifier-{}", std::process::id());
    let group = MemoryCgroup::new(&name, 96 << 20);
    let (procs, memprof) = (group.procs(), memprof_bin());
    let enter = ["sh", "-c", r#"echo $$ > "$0" && exec "$@""#, procs.to_str().unwrap()];
    let refused = |stderr: &str| {
        stderr.starts_with("memprof: error: memprof needs about ")
            && stderr.contains(&format!(
                " MiB more memory while the kernel verifies its programs, and its memory cgroup /{name} leaves it "
            ))
            && stderr.contains(&format!(" MiB under {}: raise that limit by ", group.limit_file()))
            && stderr.contains("(systemd: MemoryMax=), or run memprof outside it")
    };
    let charged = memprof_tests::kernel_at_least(6, 17);
    if charged {
        let stderr = memprof_tests::refused_daemon(&enter, &["--socket", ""]);
        assert!(refused(&stderr), "{stderr}");
    }
    let outcome = Command::new(enter[0])
        .args(&enter[1..])
        .arg(&memprof)
        .args(["run", "--", "true"])
        .output()
        .expect("running memprof");
    let stderr = String::from_utf8_lossy(&outcome.stderr);
    if charged {
        assert_eq!(outcome.status.code(), Some(1), "{stderr}");
        assert!(stderr.lines().count() == 1 && refused(&stderr), "{stderr}");
    } else {
        assert!(outcome.status.success(), "{stderr}");
    }
    assert_eq!(group.oom_kills(), 0, "{stderr}");
}

/// A limit the maps fit under at start but not once full: memprof starts, and says at once that
/// the kernel would OOM-kill it once traced processes fill them, with the flags that shrink them.
/// Sizes whose full maps fit are not warned of.
#[test]
fn maps_that_can_outgrow_a_memory_cgroup_are_said_at_start() {
    let _serial = serial();
    let group = MemoryCgroup::new(&format!("memprof-test-room-{}", std::process::id()), 256 << 20);
    let (procs, memprof) = (group.procs(), memprof_tests::memprof_bin());
    let run = |sizes: &[&str]| {
        let enter = ["-c", r#"echo $$ > "$0" && exec "$@""#, procs.to_str().unwrap(), memprof.to_str().unwrap()];
        let outcome = std::process::Command::new("sh")
            .args(enter)
            .arg("run")
            .args(sizes)
            .args(["--", "true"])
            .output()
            .expect("running memprof");
        assert!(outcome.status.success(), "{outcome:?}");
        String::from_utf8_lossy(&outcome.stderr).into_owned()
    };
    let defaults = run(&[]);
    assert!(
        defaults.contains("memprof's BPF maps take")
            && defaults.contains("left to memprof under its cgroup's memory limit")
            && defaults.contains("lower --max-live, --max-stacks and --max-unwind-rows"),
        "{defaults}"
    );
    let small = run(&["--max-live", "65536", "--max-stacks", "4096", "--max-unwind-rows", "1048576"]);
    assert!(!small.contains("BPF maps"), "{small}");
}

/// Waits for the `crowding` fixture to say it holds its blocks.
fn said_held(fixture: &mut Waiting) {
    let mut line = String::new();
    BufReader::new(fixture.child.stdout.as_mut().expect("piped")).read_line(&mut line).expect("reading the fixture");
    assert_eq!(line, "held\n");
}

/// `crowding.c` to hold 3000 blocks and, as a guest, 2000 at each of its two steps, both traced
/// by a daemon (given `args` too) whose live table holds 4096.
fn crowded(args: &[&str]) -> (Waiting, Waiting, Daemon) {
    crowded_by(&fixture("crowding"), args)
}

/// `crowded`, the holder a build of `crowding.c`, `holder_program`.
fn crowded_by(holder_program: &Path, args: &[&str]) -> (Waiting, Waiting, Daemon) {
    let holder = Waiting::start(holder_program, &["hold", "3000"]);
    let guest = Waiting::start(&fixture("crowding"), &["guest", "2000"]);
    let (holder_pid, guest_pid) = (holder.pid().to_string(), guest.pid().to_string());
    let mut all = vec!["--pid", &holder_pid, "--pid", &guest_pid, "--max-live", "4096"];
    all.extend_from_slice(args);
    let daemon = Daemon::start(&all);
    daemon.wait_traced(holder.pid());
    daemon.wait_traced(guest.pid());
    (holder, guest, daemon)
}

/// The live table is one for every target. A process holding more than half of it is moved to
/// growth mode once another's allocations find it full; the other's are recorded whole from then
/// on, and what it lost is said. Alone past half, nobody short of room, it stays exact; under
/// `max_rate = off` too (`crowding_is_left_alone_under_max_rate_off`).
#[test]
fn a_process_crowding_the_live_table_is_moved_to_its_pages_and_the_others_are_seen_whole() {
    let _serial = serial();
    // A max_rate no process here comes near: `off` would keep every process exact.
    let (mut holder, mut guest, mut daemon) = crowded(&["--max-rate", "1000000000", MOVES_TO_PAGES_ANYWHERE]);
    let (holder_pid, guest_pid) = (holder.pid().to_string(), guest.pid().to_string());
    let leaks = |pid: &str| daemon.get_json(&format!("/api/v1/leaks?pid={pid}")).1;
    let growth = |pid: &str| metric(daemon.port, &format!("memprof_growth_mode{{pid=\"{pid}\"}}"));

    holder.go();
    said_held(&mut holder);
    wait_for(10, "the holder's blocks", || (site(&leaks(&holder_pid), "hold_site") == (300_000, 3000)).then_some(()));
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(growth(&holder_pid), Some(0), "moved while no other process was short of room");

    guest.go();
    said_held(&mut guest);
    wait_for(15, "the holder moved to its pages", || (growth(&holder_pid)? == 1).then_some(()));
    let crowded = leaks(&guest_pid);
    let lost = crowded["dropped"]["live_map_full"].as_u64().expect("live_map_full");
    assert!(lost > 0, "the guest found the table full: {crowded}");
    let (_, recorded) = site(&crowded, "first_site");
    assert_eq!(recorded + lost, 2000, "{crowded}");

    guest.go();
    said_held(&mut guest);
    let whole = wait_for(15, "the guest's second blocks", || {
        let report = leaks(&guest_pid);
        (site(&report, "second_site") == (400_000, 2000)).then_some(report)
    });
    assert_eq!(whole["dropped"]["live_map_full"], lost, "{whole}");
    assert_eq!(growth(&guest_pid), Some(0));
    let log = daemon.stopped_log();
    // Its 3000 blocks, and the fixture's own few.
    let said = "of 4096 entries), and another process's allocations found it full";
    assert!(log.contains("holds the most of the live table (300") && log.contains(said), "{log}");
}

/// Where the kernel refuses `fexit` programs, growth mode would read the mapping calls of a static
/// program whose wrappers memprof cannot find at every system call on the machine: there the
/// daemon leaves such a crowding program traced by its calls and says so once, and the other's
/// allocations that find the table full are counted. Elsewhere it moves it (as
/// `a_process_crowding_the_live_table_is_moved_to_its_pages_and_the_others_are_seen_whole`).
#[test]
fn a_crowding_program_without_mapping_wrappers_is_left_where_growth_mode_would_slow_every_system_call() {
    let _serial = serial();
    // `free` linked in: a static program that never frees gets musl's allocator that cannot,
    // which holds no allocator memprof probes.
    let flags = ["-g", "-O0", "-fno-omit-frame-pointer", "-Wl,-u,free"];
    let holder_program = fixture_musl_unnamed_mmap("crowding.c", "crowding_unnamed_mmap", &flags);
    let (mut holder, mut guest, mut daemon) = crowded_by(&holder_program, &["--max-rate", "1000000000"]);
    let (holder_pid, guest_pid) = (holder.pid().to_string(), guest.pid().to_string());
    let leaks = |pid: &str| daemon.get_json(&format!("/api/v1/leaks?pid={pid}")).1;
    let growth = |pid: &str| metric(daemon.port, &format!("memprof_growth_mode{{pid=\"{pid}\"}}"));
    holder.go();
    said_held(&mut holder);
    guest.go();
    said_held(&mut guest);
    wait_for(10, "the guest's drops", || leaks(&guest_pid)["dropped"]["live_map_full"].as_u64().filter(|&n| n > 0));
    if !memprof_tests::kernel_refuses_fexit() {
        wait_for(15, "the holder moved to its pages", || (growth(&holder_pid)? == 1).then_some(()));
        return;
    }
    // Intervals in which it could have been moved, or said again.
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(growth(&holder_pid), Some(0));
    assert_eq!(site(&leaks(&holder_pid), "hold_site"), (300_000, 3000));
    let log = daemon.stopped_log();
    let said = "left traced by its calls, not moved to growth mode: growth mode would slow every system call on this \
                host: its kernel refuses fexit programs and the process maps memory through no wrapper memprof can \
                probe";
    assert_eq!(log.matches(said).count(), 1, "{log}");
    assert!(log.contains("holds the most of the live table (300"), "{log}");
}

/// `crowding.c` holding `first` and `second` blocks, and as a guest 1500 at each of its steps,
/// traced by a daemon whose live table holds 4096, every process exact. Returns once both holders
/// hold theirs, in that order with the guest, with their pids.
fn two_holders_and_a_guest(first: u64, second: u64) -> ([Waiting; 3], Vec<String>, Daemon) {
    let [first_arg, second_arg] = [first, second].map(|n| n.to_string());
    let mut processes = [
        Waiting::start(&fixture("crowding"), &["hold", &first_arg]),
        Waiting::start(&fixture("crowding"), &["hold", &second_arg]),
        Waiting::start(&fixture("crowding"), &["guest", "1500"]),
    ];
    let pids: Vec<String> = processes.iter().map(|w| w.pid().to_string()).collect();
    let mut args = vec!["--max-live", "4096", "--max-rate", "1000000000", MOVES_TO_PAGES_ANYWHERE];
    for pid in &pids {
        args.extend(["--pid", pid.as_str()]);
    }
    let daemon = Daemon::start(&args);
    for process in &processes {
        daemon.wait_traced(process.pid());
    }
    for holder in &mut processes[..2] {
        holder.go();
        said_held(holder);
    }
    let held = |pid: &str| site(&daemon.get_json(&format!("/api/v1/leaks?pid={pid}")).1, "hold_site");
    wait_for(10, "the holders' blocks", || {
        ((held(&pids[0]), held(&pids[1])) == ((first * 100, first), (second * 100, second))).then_some(())
    });
    (processes, pids, daemon)
}

/// Two processes holding nearly half of the live table each: when a third finds it full, the
/// larger is moved to growth mode (the most of it, past a quarter), and the third is recorded
/// whole from then on.
#[test]
fn the_larger_of_two_processes_crowding_the_live_table_is_moved() {
    let _serial = serial();
    let ([_smaller, _larger, mut guest], pids, mut daemon) = two_holders_and_a_guest(1500, 1600);
    let leaks = |pid: &str| daemon.get_json(&format!("/api/v1/leaks?pid={pid}")).1;
    let growth = |pid: &str| metric(daemon.port, &format!("memprof_growth_mode{{pid=\"{pid}\"}}"));
    guest.go();
    said_held(&mut guest);
    wait_for(15, "the larger holder moved to its pages", || (growth(&pids[1])? == 1).then_some(()));
    assert_eq!(growth(&pids[0]), Some(0), "only the larger is moved");

    guest.go();
    said_held(&mut guest);
    wait_for(15, "the guest's second blocks", || {
        (site(&leaks(&pids[2]), "second_site") == (300_000, 1500)).then_some(())
    });
    let log = daemon.stopped_log();
    assert!(log.contains("holds the most of the live table (16"), "{log}");
}

/// A process that held most of the live table exits: its entries stay until the next interval
/// purges them, and a guest allocating meanwhile finds the table full. Once purged there is room
/// again, and the other holder (past a quarter of the table) is not moved for it.
#[test]
fn nobody_is_moved_for_a_table_an_exited_process_filled() {
    let _serial = serial();
    let ([mut leaving, _staying, mut guest], pids, mut daemon) = two_holders_and_a_guest(2900, 1100);
    let leaks = |pid: &str| daemon.get_json(&format!("/api/v1/leaks?pid={pid}")).1;
    let growth = |pid: &str| metric(daemon.port, &format!("memprof_growth_mode{{pid=\"{pid}\"}}"));
    leaving.child.kill().expect("killing the first holder");
    leaving.child.wait().expect("the first holder");
    guest.go();
    said_held(&mut guest);
    let first = wait_for(10, "the guest's first blocks counted", || {
        let report = leaks(&pids[2]);
        let lost = report["dropped"]["live_map_full"].as_u64()?;
        (site(&report, "first_site").1 + lost == 1500).then_some(report)
    });
    wait_for(10, "the exited holder's blocks purged", || {
        (metric(daemon.port, "memprof_bpf_map_entries{map=\"live\"}")? < 2000).then_some(())
    });
    guest.go();
    said_held(&mut guest);
    wait_for(15, "the guest's second blocks", || {
        (site(&leaks(&pids[2]), "second_site") == (300_000, 1500)).then_some(())
    });
    // Intervals after the purge, each of which could have moved it.
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(growth(&pids[1]), Some(0), "moved for room the purge made: {first}");
    assert_eq!(site(&leaks(&pids[1]), "hold_site"), (110_000, 1100));
    let log = daemon.stopped_log();
    assert!(!log.contains("holds the most of the live table"), "{log}");
}

/// The stack table is one for every target too: a process of any user could fill it with
/// distinct call paths, and the others' allocations went without stacks from then on. One
/// holding more than half of it (2048 paths, a table of 2048) is moved to growth mode once
/// another's allocations find it full; the other's stacks are recorded from then on, and what
/// went without one is said.
#[test]
fn a_process_crowding_the_stack_table_is_moved_to_its_pages_and_the_others_keep_their_stacks() {
    let _serial = serial();
    let mut holder = Waiting::start(&fixture("crowding"), &["paths", "11"]);
    let mut guest = Waiting::start(&fixture("crowding"), &["guest", "2000"]);
    let (holder_pid, guest_pid) = (holder.pid().to_string(), guest.pid().to_string());
    let args = [
        "--pid",
        &holder_pid,
        "--pid",
        &guest_pid,
        "--max-stacks",
        "2048",
        "--max-rate",
        "1000000000",
        MOVES_TO_PAGES_ANYWHERE,
    ];
    let mut daemon = Daemon::start(&args);
    daemon.wait_traced(holder.pid());
    daemon.wait_traced(guest.pid());
    let leaks = |pid: &str| daemon.get_json(&format!("/api/v1/leaks?pid={pid}")).1;
    let growth = |pid: &str| metric(daemon.port, &format!("memprof_growth_mode{{pid=\"{pid}\"}}"));

    holder.go();
    said_held(&mut holder);
    wait_for(10, "the stack table full", || {
        (metric(daemon.port, "memprof_bpf_map_entries{map=\"stacks\"}")? >= 2048).then_some(())
    });
    assert_eq!(growth(&holder_pid), Some(0), "moved while no other process was short of room");

    guest.go();
    said_held(&mut guest);
    wait_for(15, "the holder moved to its pages", || (growth(&holder_pid)? == 1).then_some(()));
    let crowded = leaks(&guest_pid);
    assert!(crowded["dropped"]["stack_table_full"].as_u64() > Some(0), "the guest found the table full: {crowded}");

    guest.go();
    said_held(&mut guest);
    wait_for(15, "the guest's second blocks, with their stack", || {
        (site(&leaks(&guest_pid), "second_site") == (400_000, 2000)).then_some(())
    });
    assert_eq!(growth(&guest_pid), Some(0));
    let log = daemon.stopped_log();
    assert!(
        log.contains("holds the most of the stack table (")
            && log.contains("another process's allocations found it full"),
        "{log}"
    );
}

/// `max_rate = off` keeps every process traced by its calls: the holder stays, and the other's
/// allocations that find the table full are counted.
#[test]
fn crowding_is_left_alone_under_max_rate_off() {
    let _serial = serial();
    let (mut holder, mut guest, daemon) = crowded(&[]);
    let (holder_pid, guest_pid) = (holder.pid().to_string(), guest.pid().to_string());
    holder.go();
    said_held(&mut holder);
    guest.go();
    said_held(&mut guest);
    let leaks = |pid: &str| daemon.get_json(&format!("/api/v1/leaks?pid={pid}")).1;
    let lost =
        wait_for(10, "the guest's drops", || leaks(&guest_pid)["dropped"]["live_map_full"].as_u64().filter(|&n| n > 0));
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(metric(daemon.port, &format!("memprof_growth_mode{{pid=\"{holder_pid}\"}}")), Some(0));
    assert_eq!(site(&leaks(&holder_pid), "hold_site"), (300_000, 3000));
    assert_eq!(site(&leaks(&guest_pid), "first_site").1 + lost, 2000);
}

/// The unwind rows are one array for every target too, each file's table shared by the processes
/// that map it and given first come, first served: one user's processes mapping large files
/// took them all, and a later process's stacks ended at the first frame in a file without a
/// table (a C++ program's at operator new, truncated). Here nobody's two processes dlopen four
/// copies of libstdc++, which would fill the rows; they are refused the tables past their share,
/// which is said and counted, and a C++ program another user starts after them keeps its whole
/// stack, exact. The rows of the files no traced process maps any more go back.
#[test]
fn one_users_processes_leave_the_unwind_rows_other_users_need() {
    let _serial = serial();
    let dir = std::env::temp_dir().join(format!("memprof-unwind-share-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Copies the users' programs may read, away from the build's directories.
    let copy = |from: &std::path::Path, name: &str| {
        let to = dir.join(name);
        std::fs::copy(from, &to).unwrap();
        to.to_str().expect("UTF-8 path").to_string()
    };
    let flags = ["-O2", "-g", "-fomit-frame-pointer"];
    let taker = copy(&fixture_with("unwind_taker.c", "unwind_taker", &flags), "unwind_taker");
    let keeper = copy(&fixture_cpp("unwind_keeper.cpp", "unwind_keeper", &flags), "unwind_keeper");
    let libraries: Vec<String> =
        (1..=4).map(|i| copy(std::path::Path::new(LIBSTDCXX), &format!("libstdcxx-copy-{i}.so"))).collect();
    let takers: Vec<Waiting> = libraries
        .chunks(2)
        .map(|two| {
            let mut command = as_user(NOBODY);
            command.arg(&taker).args(two);
            let child = command.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().expect("starting the taker");
            let mut taker = Waiting { child };
            said_held(&mut taker);
            taker
        })
        .collect();
    let rows = UNWIND_ROWS.to_string();
    let per_user = UNWIND_ROWS_PER_USER.to_string();
    let args =
        ["--comm", "^unwind_(taker|keeper)$", "--max-unwind-rows", &rows, "--max-unwind-rows-per-user", &per_user];
    let mut daemon = Daemon::start(&args);
    for taker in &takers {
        daemon.wait_traced(taker.pid());
    }
    let used = || metric(daemon.port, "memprof_unwind_rows{state=\"used\"}");
    wait_for(20, "the tables the takers were refused", || {
        (metric(daemon.port, "memprof_unwind_tables_not_loaded_total")? > 0).then_some(())
    });
    let taken = used().expect("memprof_unwind_rows");
    assert!(taken <= UNWIND_ROWS_PER_USER, "nobody's processes took {taken} rows");

    let mut keeper = Waiting::start_command({
        let mut command = as_user(OTHER_USER);
        command.args([&keeper, "--wait"]);
        command
    });
    let keeper_pid = keeper.pid().to_string();
    daemon.wait_traced(keeper.pid());
    keeper.go();
    said_held(&mut keeper);
    let report = wait_for(15, "the keeper's blocks", || {
        let (_, report) = daemon.get_json(&format!("/api/v1/leaks?pid={keeper_pid}"));
        (total(&report, "outstanding_allocations") >= 10).then_some(report)
    });
    let stacks = report["stacks"].as_array().expect("stacks");
    let stack =
        stacks.iter().find(|stack| stack["outstanding_allocations"] == 10).unwrap_or_else(|| panic!("{report}"));
    let functions: Vec<&str> =
        stack["frames"].as_array().expect("frames").iter().map(|f| f["function"].as_str().unwrap_or("?")).collect();
    assert_eq!(functions, KEEPER_STACK, "{report}");
    assert_eq!(
        (stack["outstanding_bytes"].as_u64(), stack["truncated"].as_bool()),
        (Some(400), Some(false)),
        "{report}"
    );
    assert_eq!(report["dropped"]["unwind_no_table"], 0, "{report}");

    // The takers' own program and at least one copy are theirs alone.
    let before = used().expect("memprof_unwind_rows");
    drop(takers);
    wait_for(15, "the takers' rows given back", || (used()? < before).then_some(()));
    drop(keeper);
    let log = daemon.stopped_log();
    let said = format!("user {NOBODY}'s traced processes hold");
    assert_eq!(log.matches(&said).count(), 1, "{log}");
    assert!(log.contains("raise --max-unwind-rows-per-user"), "{log}");
    assert!(!log.contains(&format!("user {OTHER_USER}'s")), "{log}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `setpriv` to run a command as `uid`, in no group but its own.
fn as_user(uid: u32) -> Command {
    let mut command = Command::new("setpriv");
    command.args([&format!("--reuid={uid}"), &format!("--regid={uid}"), "--clear-groups"]);
    command
}

/// An unwind table kept idle after its processes exited counts in a user's share when one of
/// theirs maps the file again, as a new table would: a user whose processes come and go cannot
/// gather more rows than the share from tables kept for them.
#[test]
fn an_idle_table_mapped_again_counts_in_the_users_share() {
    let _serial = serial();
    let scratch = Scratch::new("bounds", "idle-share");
    let copy = |from: &Path, name: &str| {
        let to = scratch.join(name);
        std::fs::copy(from, &to).unwrap();
        scratch.file(name)
    };
    let flags = ["-O2", "-g", "-fomit-frame-pointer"];
    let taker = copy(&fixture_with("unwind_taker.c", "unwind_taker", &flags), "unwind_taker");
    let (first, second) = (copy(Path::new(LIBSTDCXX), "libstdcxx-a.so"), copy(Path::new(LIBSTDCXX), "libstdcxx-b.so"));
    let rows = UNWIND_ROWS.to_string();
    let per_user = UNWIND_ROWS_PER_USER.to_string();
    let args = ["--comm", "^unwind_taker$", "--max-unwind-rows", &rows, "--max-unwind-rows-per-user", &per_user];
    let mut daemon = Daemon::start(&args);
    let take = |libraries: &[&str]| {
        let mut command = as_user(NOBODY);
        command.arg(&taker).args(libraries).stdin(Stdio::piped()).stdout(Stdio::piped());
        let mut taker = Waiting { child: command.spawn().expect("starting the taker") };
        daemon.wait_traced(taker.pid());
        said_held(&mut taker);
        taker
    };
    let used = || metric(daemon.port, "memprof_unwind_rows{state=\"used\"}");
    let not_loaded = || metric(daemon.port, "memprof_unwind_tables_not_loaded_total");
    // Each alone fits the share, and leaves its tables idle when it goes.
    for library in [&first, &second] {
        let taker = take(&[library]);
        wait_for(20, "the taker's tables", || (used()? > UNWIND_ROWS_PER_USER / 2).then_some(()));
        let pid = u64::from(taker.pid());
        drop(taker);
        wait_for(20, "the taker to be let go", || (!daemon.traced_pids().contains(&pid)).then_some(()));
    }
    assert_eq!(not_loaded(), Some(0));
    let built = || metric(daemon.port, "memprof_unwind_tables_built_total").expect("tables built");
    let before = built();
    // Both together do not: the second copy's table, idle, is refused as a new one would be.
    let both = take(&[&first, &second]);
    wait_for(20, "the table past the share refused", || (not_loaded()? == 1).then_some(()));
    assert_eq!(built(), before, "every table the third process maps was kept idle");
    let taken = used().expect("memprof_unwind_rows");
    assert!(taken <= UNWIND_ROWS_PER_USER, "nobody's process took {taken} rows");
    drop(both);
    let log = daemon.stopped_log();
    assert_eq!(log.matches(&format!("user {NOBODY}'s traced processes hold")).count(), 1, "{log}");
}

/// Debian 12's libstdc++ (GCC 12).
const LIBSTDCXX: &str = "/usr/lib/x86_64-linux-gnu/libstdc++.so.6";
const NOBODY: u32 = 65534;
/// A user with no name, in no group but its own.
const OTHER_USER: u32 = 65533;
/// Debian 12's files take 28,274 rows (libc), 2,397 (its dynamic linker), 6,271 (libm), 1,380
/// (libgcc_s) and 34,371 (libstdc++), 72,693 together, and the fixtures a few dozen. Four copies of
/// libstdc++ beside the others do not fit, and after nobody's share (however its tables came in
/// order) the rest holds all of the keeper's.
const UNWIND_ROWS: u64 = 160_000;
/// Room for the other files and one copy of libstdc++, not two: nobody is refused some, the
/// keeper's user none.
const UNWIND_ROWS_PER_USER: u64 = 80_000;
/// keep_site's blocks, through operator new, whose frame the report leaves out.
const KEEPER_STACK: [&str; 5] = ["keep_site", "main", "__libc_start_call_main", "__libc_start_main_impl", "_start"];
