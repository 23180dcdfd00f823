//! pprof profiles read by the reference reader, `go tool pprof`: written by `memprof run`, served
//! by the daemon, compared with `-base`; `memprof snapshot` and `memprof diff`. The fixture
//! `pprof_sites.c` knows its bytes and objects per site.

use std::{
    collections::HashMap,
    io::{BufRead, BufReader},
    path::Path,
    process::{Command, Stdio},
};

use memprof_tests::{
    fixture, fixture_with, memprof, memprof_bin, released, site, wait_for, web_config_user, Daemon, Outcome, Scratch,
    Waiting,
};
use serde_json::Value;

/// `go tool pprof ARGS`, run as root with its caches and downloads in `scratch`.
fn go_pprof(scratch: &Scratch, args: &[&str]) -> String {
    let go = Path::new("/usr/bin/go");
    assert!(
        go.exists(),
        "go is missing: `cargo xtask setup` installs golang-go, whose `go tool pprof` these tests use"
    );
    let output = Command::new(go)
        .args(["tool", "pprof"])
        .args(args)
        .env("HOME", scratch.path())
        .env("GOCACHE", scratch.join("gocache"))
        .env("PPROF_TMPDIR", scratch.path())
        .env("GOFLAGS", "")
        .stdin(Stdio::null())
        .output()
        .expect("starting go tool pprof");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "go tool pprof {args:?} failed: {}{stdout}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// What `go tool pprof -top -unit=B` prints: the sample type and each function's flat and
/// cumulative values, in bytes or objects.
#[derive(Debug)]
struct Top {
    sample_type: String,
    /// The value of the nodes shown: of the samples `-tagfocus` kept (the profile's total counts
    /// them all).
    shown: i64,
    functions: HashMap<String, (i64, i64)>,
}

impl Top {
    fn read(scratch: &Scratch, args: &[&str]) -> Self {
        let all: Vec<&str> = ["-top", "-unit=B"].iter().chain(args).copied().collect();
        let text = go_pprof(scratch, &all);
        let sample_type = text.lines().find_map(|l| l.strip_prefix("Type: ")).unwrap_or_else(|| panic!("{text}"));
        let rows = text.lines().skip_while(|l| !l.trim_start().starts_with("flat")).skip(1);
        let value = |v: &str| v.trim_end_matches('B').parse::<i64>().unwrap_or_else(|_| panic!("`{v}` in {text}"));
        // "Showing nodes accounting for 50000B, 70.26% of 71166B total"
        let shown = text
            .lines()
            .find_map(|l| l.strip_prefix("Showing nodes accounting for ")?.split(',').next())
            .map_or_else(|| panic!("no total in {text}"), value);
        let functions = rows
            .map(|row| {
                let columns: Vec<&str> = row.split_whitespace().collect();
                (columns[5..].join(" "), (value(columns[0]), value(columns[3])))
            })
            .collect();
        Self { sample_type: sample_type.to_string(), shown, functions }
    }

    /// A function's own (flat) value; 0 when pprof does not list it.
    fn flat(&self, function: &str) -> i64 {
        self.functions.get(function).map_or(0, |v| v.0)
    }

    fn cum(&self, function: &str) -> i64 {
        self.functions.get(function).map_or(0, |v| v.1)
    }
}

/// Phase one's (sample type, function, value), as `pprof_sites.c` describes it. site_d's
/// blocks are allocated in the function inlined into it.
const PHASE_ONE: [(&str, &str, i64); 14] = [
    ("inuse_space", "site_a", 10_000),
    ("inuse_space", "site_b", 4500),
    ("inuse_space", "site_c", 0),
    ("inuse_space", "inlined_alloc (inline)", 6666),
    ("inuse_objects", "site_a", 10),
    ("inuse_objects", "site_b", 15),
    ("inuse_objects", "inlined_alloc (inline)", 3),
    ("alloc_space", "site_a", 10_000),
    ("alloc_space", "site_b", 6000),
    ("alloc_space", "site_c", 777),
    ("alloc_space", "inlined_alloc (inline)", 6666),
    ("alloc_objects", "site_b", 20),
    ("alloc_objects", "site_c", 7),
    ("alloc_objects", "inlined_alloc (inline)", 3),
];

fn assert_phase_one(scratch: &Scratch, source: &str) {
    for (sample_type, function, expected) in PHASE_ONE {
        let top = Top::read(scratch, &[&format!("-sample_index={sample_type}"), source]);
        assert_eq!(top.flat(function), expected, "{sample_type} of {function}: {top:?}");
    }
    let top = Top::read(scratch, &["-sample_index=inuse_space", source]);
    assert_eq!(top.cum("site_d"), 6666, "site_d holds what its inlined function allocated: {top:?}");
    assert_eq!(top.cum("phase_one"), 10_000 + 4500 + 6666, "{top:?}");
}

/// The GNU build id of an ELF file, as `readelf -n` prints it.
fn build_id(file: &Path) -> String {
    let notes = Command::new("readelf").arg("-n").arg(file).output().expect("starting readelf");
    let text = String::from_utf8_lossy(&notes.stdout).into_owned();
    text.lines().find_map(|l| l.trim().strip_prefix("Build ID: ")).unwrap_or_else(|| panic!("{text}")).to_string()
}

#[test]
fn memprof_run_writes_a_profile_go_tool_pprof_reads_exactly() {
    let scratch = Scratch::new("pprof", "run");
    let program = fixture("pprof_sites");
    let profile = scratch.file("run.pb.gz");
    let recording = scratch.file("run.rec");
    let outcome = memprof(&[
        "run",
        "--format",
        "pprof",
        "--output",
        &profile,
        "--record",
        &recording,
        "--interval",
        "3600",
        "--",
        program.to_str().unwrap(),
    ]);
    assert!(outcome.status.success(), "{outcome:?}");
    assert!(outcome.stdout.is_empty(), "the profile goes to the file only");
    assert_phase_one(&scratch, &profile);

    // The same profile rendered from the recording, to the byte (its time is the run's).
    let rendered = scratch.file("rendered.pb.gz");
    let render = memprof(&["report", &recording, "--format", "pprof", "--output", &rendered]);
    assert!(render.status.success(), "{render:?}");
    assert_eq!(std::fs::read(&rendered).unwrap(), std::fs::read(&profile).unwrap());

    // Labels for -tagfocus: the leak state, the process; the run's context in the comments.
    let pid = outcome.stderr.split("tracing pid ").nth(1).and_then(|s| s.split(' ').next()).unwrap();
    let tags = go_pprof(&scratch, &["-tags", &profile]);
    for tag in
        ["leak: Total", "warming_up", &format!("{pid}\n"), "pid: Total", "comm: Total", "pprof_sites\n", "exe: Total"]
    {
        assert!(tags.contains(tag), "no {tag:?} in {tags}");
    }
    let focused = Top::read(&scratch, &["-sample_index=inuse_space", "-tagfocus=leak=warming_up", &profile]);
    assert_eq!(focused.flat("site_a"), 10_000, "{focused:?}");
    let comments = go_pprof(&scratch, &["-comments", &profile]);
    assert!(comments.contains(&format!("memprof: pid {pid} (pprof_sites)")), "{comments}");
    let started = comments.lines().find(|l| l.starts_with("started ")).unwrap_or_else(|| panic!("{comments}"));
    assert!(started.contains(&format!(" by memprof {}: ", env!("CARGO_PKG_VERSION"))), "{started}");
    assert!(started.ends_with(&format!("--interval 3600 -- {}", program.display())), "{started}");
    assert_eq!(Top::read(&scratch, &[&profile]).sample_type, "inuse_space", "a heap profile shows in-use bytes first");

    let raw = go_pprof(&scratch, &["-raw", &profile]);
    assert!(
        raw.contains("alloc_objects/count alloc_space/bytes inuse_objects/count inuse_space/bytes[dflt]"),
        "Go's heap sample types in Go's order: {raw}"
    );
    let mapping = raw
        .lines()
        .skip_while(|l| *l != "Mappings")
        .find(|l| l.contains(program.to_str().unwrap()))
        .unwrap_or_else(|| panic!("no mapping of the fixture: {raw}"));
    assert!(mapping.contains(&build_id(&program)), "the mapping carries the ELF's build id: {mapping}");
    // The inlined function and the one it sits in are two lines of one location.
    let inlined = raw.lines().position(|l| l.contains(" inlined_alloc pprof_sites.c:")).expect("inlined_alloc's line");
    assert!(raw.lines().nth(inlined + 1).unwrap().trim().starts_with("site_d pprof_sites.c:"), "{raw}");
}

/// A line the fixture prints when a phase is done.
/// memprof's own sample types after Go's four: each stack's high-water mark and temporary
/// allocations (`peaks.c`), and the resident bytes its blocks pin (`resident.c`, whose 2,500
/// survivors of 40,000 blocks pin the pages they are on: it says how many).
#[test]
fn the_peak_temporary_and_pinned_sample_types_read_exactly() {
    let scratch = Scratch::new("pprof", "memprof-types");
    let profile = scratch.file("peaks.pb.gz");
    let peaks = fixture("peaks");
    let outcome = memprof(&["run", "--format", "pprof", "--output", &profile, "--", peaks.to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    let top = Top::read(&scratch, &["-sample_index=max_inuse_space", &profile]);
    assert_eq!(top.sample_type, "max_inuse_space");
    for (function, max) in [("hold_a", 10_000), ("hold_b", 10_000), ("after_peak", 3_000)] {
        assert_eq!(top.flat(function), max, "{function}: {top:?}");
    }
    let top = Top::read(&scratch, &["-sample_index=temporary_objects", &profile]);
    assert_eq!((top.flat("temp_loop_alloc"), top.flat("pair_second"), top.flat("pair_first")), (100, 0, 0), "{top:?}");

    let profile = scratch.file("resident.pb.gz");
    let resident = fixture("resident");
    let outcome = memprof(&[
        "run",
        "--format",
        "pprof",
        "--output",
        &profile,
        "--interval",
        "0.2",
        "--",
        resident.to_str().unwrap(),
    ]);
    assert!(outcome.status.success(), "{outcome:?}");
    let pages = outcome.stderr_number("survivor pages: ") as i64;
    let top = Top::read(&scratch, &["-sample_index=pinned_space", &profile]);
    assert_eq!(top.flat("small_block"), pages * 4096, "{top:?}");
    assert_eq!(top.shown, pages * 4096, "nothing else pins a page: {top:?}");
}

fn wait_line(target: &mut Waiting, expected: &str) {
    let mut line = String::new();
    BufReader::new(target.child.stdout.as_mut().expect("piped")).read_line(&mut line).expect("reading the fixture");
    assert_eq!(line.trim(), expected);
}

/// The host's profile of two traced processes: `-tagfocus` on a process's pid, command or
/// executable gives exactly that process's samples, and each sample says its cgroup and whether
/// its stack is a leak candidate.
#[test]
fn the_host_profile_labels_each_process_for_tagfocus() {
    let scratch = Scratch::new("pprof", "host");
    let mut sites = Waiting::start(&fixture("pprof_sites"), &[]);
    let mut holder = Waiting::start(&fixture("daemon_target"), &[]);
    let (sites_pid, holder_pid) = (sites.pid(), holder.pid());
    // go tool pprof reaches the port, which serves profiles only with a password.
    let web = web_config_user(scratch.path(), "pprof", "pprof-secret");
    let web = web.to_str().unwrap();
    let daemon =
        Daemon::start(&["--pid", &sites_pid.to_string(), "--pid", &holder_pid.to_string(), "--web-config-file", web]);
    daemon.wait_traced(sites_pid);
    daemon.wait_traced(holder_pid);
    sites.go();
    holder.go();
    wait_line(&mut sites, "one");
    let inuse =
        |pid: u32| daemon.get_json(&format!("/api/v1/leaks?pid={pid}")).1["totals"]["outstanding_bytes"].as_i64();
    let url = format!("http://pprof:pprof-secret@127.0.0.1:{}", daemon.port);
    let heap = format!("{url}/debug/pprof/heap");
    let top =
        |tagfocus: &str| Top::read(&scratch, &["-sample_index=inuse_space", &format!("-tagfocus={tagfocus}"), &heap]);
    // Each pid's samples are its report's bytes, once both reports and the profile show the same
    // interval (the holder's churn frees what it allocates at once).
    let (sites_top, holder_top) = wait_for(30, "the host profile to agree with both reports", || {
        let (sites_top, holder_top) = (top(&format!("pid={sites_pid}")), top(&format!("pid={holder_pid}")));
        let agree = sites_top.flat("site_a") == 10_000
            && holder_top.flat("hold_site") == 50_000
            && Some(sites_top.shown) == inuse(sites_pid)
            && Some(holder_top.shown) == inuse(holder_pid);
        agree.then_some((sites_top, holder_top))
    });
    assert_eq!(sites_top.flat("site_b"), 4500, "{sites_top:?}");
    assert_eq!(sites_top.flat("inlined_alloc (inline)"), 6666, "{sites_top:?}");
    assert_eq!(sites_top.flat("hold_site"), 0, "the other process's samples are left out: {sites_top:?}");
    assert_eq!(holder_top.flat("site_a"), 0, "{holder_top:?}");
    let all = Top::read(&scratch, &[&heap]);
    assert_eq!(all.sample_type, "inuse_space");
    assert_eq!((all.flat("site_a"), all.flat("hold_site")), (10_000, 50_000), "{all:?}");
    for (label, kept, left_out) in
        [("comm=^daemon_target$", "hold_site", "site_a"), ("exe=/pprof_sites", "site_a", "hold_site")]
    {
        let top = top(label);
        assert!(top.flat(kept) > 0 && top.flat(left_out) == 0, "{label}: {top:?}");
    }
    assert_eq!(Top::read(&scratch, &[&format!("{url}/debug/pprof/allocs")]).sample_type, "alloc_space");

    // `-raw` prints each sample's text labels on one line, its numeric ones on the next.
    let raw = go_pprof(&scratch, &["-raw", &heap]);
    for (pid, comm) in [(sites_pid, "pprof_sites"), (holder_pid, "daemon_target")] {
        let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("the fixture's cgroup");
        let cgroup = cgroup.lines().find_map(|l| l.strip_prefix("0::")).expect("a unified cgroup hierarchy");
        // As the report names it: another test that builds the fixture again leaves this one's
        // executable ` (deleted)`.
        let report = daemon.get_json(&format!("/api/v1/leaks?pid={pid}")).1;
        let exe = report["exe"].as_str().expect("the report's exe");
        assert!(exe.contains(&format!("/{comm}")), "{exe}");
        let labels = format!("cgroup:[{cgroup}] comm:[{comm}] exe:[{exe}] leak:[");
        let line =
            raw.lines().position(|l| l.trim().starts_with(&labels)).unwrap_or_else(|| panic!("{labels} in {raw}"));
        assert_eq!(raw.lines().nth(line + 1).map(str::trim), Some(format!("pid:[{pid}]").as_str()), "{raw}");
    }
}

/// `memprof snapshot ARGS`; its stderr must say where the report came from.
fn snapshot(args: &[&str], from: &str) -> Outcome {
    let all: Vec<&str> = ["snapshot"].iter().chain(args).copied().collect();
    let outcome = memprof(&all);
    assert!(outcome.status.success(), "{outcome:?}");
    assert!(outcome.stderr.contains(from), "{}", outcome.stderr);
    outcome
}

/// The sites of `memprof diff --format json` by their allocating function and its caller:
/// (old bytes, new bytes, delta bytes, old objects, new objects, delta objects).
fn diff_sites(old: &str, new: &str) -> HashMap<String, [i64; 6]> {
    let outcome = memprof(&["diff", old, new, "--format", "json"]);
    assert!(outcome.status.success(), "{outcome:?}");
    let diff: Value = serde_json::from_str(&outcome.stdout).expect("diff --format json prints JSON");
    let number = |site: &Value, key: &str| site[key].as_i64().unwrap_or_else(|| panic!("{key} in {site}"));
    diff["sites"]
        .as_array()
        .expect("sites")
        .iter()
        .map(|site| {
            let name = |i: usize| site["frames"][i]["function"].as_str().unwrap_or("").to_string();
            let keys = ["old_bytes", "new_bytes", "delta_bytes", "old_objects", "new_objects", "delta_objects"];
            (format!("{} < {}", name(0), name(1)), keys.map(|k| number(site, k)))
        })
        .collect()
}

#[test]
fn the_daemon_serves_profiles_and_snapshots_leave_the_target_running_and_traced() {
    let scratch = Scratch::new("pprof", "daemon");
    let mut target = Waiting::start(&fixture("pprof_sites"), &[]);
    let pid = target.pid().to_string();
    // go tool pprof reaches the port, which serves profiles only with a password.
    let web = web_config_user(scratch.path(), "pprof", "pprof-secret");
    let daemon = Daemon::start(&["--pid", &pid, "--web-config-file", web.to_str().unwrap()]);
    daemon.wait_traced(target.pid());
    target.go();
    wait_line(&mut target, "one");
    let leaks = format!("/api/v1/leaks?pid={pid}");
    let shows = |sites: &[(&str, (u64, u64))]| {
        let report = daemon.get_json(&leaks).1;
        sites.iter().all(|(function, held)| site(&report, function) == *held).then_some(())
    };
    let phase_one = [("site_a", (10_000, 10)), ("site_b", (4500, 15)), ("inlined_alloc", (6666, 3))];
    wait_for(20, "phase one in the daemon's report", || shows(&phase_one));

    let url = format!("http://pprof:pprof-secret@127.0.0.1:{}", daemon.port);
    let heap = format!("{url}/debug/pprof/heap?pid={pid}");
    assert_phase_one(&scratch, &heap);
    assert_eq!(Top::read(&scratch, &[&heap]).sample_type, "inuse_space");
    let allocs = Top::read(&scratch, &[&format!("{url}/debug/pprof/allocs?pid={pid}")]);
    assert_eq!(allocs.sample_type, "alloc_space");
    assert_eq!(allocs.flat("site_c"), 777, "a site that freed everything still counts its allocations: {allocs:?}");
    for (path, status) in
        [("/debug/pprof/heap?pid=", 400), ("/debug/pprof/heap?pid=x", 400), ("/debug/pprof/allocs?pid=1", 404)]
    {
        let (answered, body) = daemon.get(path).expect("the daemon answers");
        assert_eq!(answered, status, "{path}: {body}");
        assert!(body.starts_with("{\"error\":"), "{path}: {body}");
    }

    // Over the daemon's socket, as root: no password.
    let socket = daemon.socket.to_str().unwrap();
    let from_daemon = format!("is traced by the daemon at {socket}");
    let [old_pb, old_json, new_pb, new_json] =
        ["old.pb.gz", "old.json", "new.pb.gz", "new.json"].map(|f| scratch.file(f));
    for file in [&old_pb, &old_json] {
        snapshot(&["--pid", &pid, "-o", file, "--daemon", socket], &from_daemon);
    }
    target.go();
    wait_line(&mut target, "two");
    let phase_two = [("site_a", (15_000, 15)), ("site_b", (3000, 10)), ("site_e", (200, 4))];
    wait_for(20, "phase two in the daemon's report", || shows(&phase_two));
    for file in [&new_pb, &new_json] {
        snapshot(&["--pid", &pid, "-o", file, "--daemon", socket], &from_daemon);
    }
    assert!(target.child.try_wait().unwrap().is_none(), "the target still runs");
    assert!(daemon.traced_pids().contains(&(target.pid() as u64)), "and is still traced");

    // Phase two: site_a +5000 B / +5 (from phase_two), site_b -1500 B / -5, site_e +200 B / +4.
    for (old, new) in [(&old_pb, &new_pb), (&old_json, &new_json), (&old_json, &new_pb)] {
        let sites = diff_sites(old, new);
        assert_eq!(sites["site_a < phase_two"], [0, 5000, 5000, 0, 5, 5], "{old} -> {new}: {sites:?}");
        assert_eq!(sites["site_e < phase_two"], [0, 200, 200, 0, 4, 4]);
        assert_eq!(sites["site_b < phase_one"], [4500, 3000, -1500, 15, 10, -5]);
        assert_eq!(sites["site_a < phase_one"], [10_000, 10_000, 0, 10, 10, 0]);
        assert_eq!(sites["inlined_alloc < site_d"], [6666, 6666, 0, 3, 3, 0]);
        assert_eq!(sites.len(), 5, "site_c holds nothing in either: {sites:?}");
    }
    let table = memprof(&["diff", &old_pb, &new_pb]);
    let first = table.stdout.lines().nth(2).unwrap_or_default();
    assert!(
        first.contains("+5000") && first.contains("site_a (pprof_sites.c:"),
        "the most grown first: {}",
        table.stdout
    );

    let base = Top::read(&scratch, &["-sample_index=inuse_space", "-base", &old_pb, &new_pb]);
    assert_eq!((base.flat("site_a"), base.flat("site_b"), base.flat("site_e")), (5000, -1500, 200), "{base:?}");
    assert_eq!(base.flat("inlined_alloc (inline)"), 0, "{base:?}");
}

#[test]
fn without_a_daemon_snapshot_attaches_for_its_duration_and_detaches() {
    let scratch = Scratch::new("pprof", "attach");
    let mut target = Waiting::start(&fixture("pprof_sites"), &[]);
    let pid = target.pid().to_string();
    let output = scratch.file("attached.json");
    let (outcome, nobody) = snapshot_without_a_daemon(&mut target, &output, "3", |_| {});
    assert!(outcome.status.success(), "{outcome:?}");
    let said = &outcome.stderr;
    assert!(said.contains(&format!("no memprof daemon answers at {nobody}")), "{said}");
    assert!(said.contains(&format!("attaching to pid {pid} for 3 s")), "{said}");
    assert!(said.contains(&format!("memprof: wrote {output}\n")), "{said}");
    assert!(
        said.ends_with(&format!("memprof: pid {pid} keeps running; the snapshot's probes are detached\n")),
        "{said}"
    );

    let report: Value = serde_json::from_str(&std::fs::read_to_string(&output).unwrap()).expect("one JSON report");
    assert_eq!(report["final"], true);
    assert_eq!(site(&report, "site_a"), (10_000, 10));
    assert_eq!(site(&report, "site_b"), (4500, 15));
    assert_eq!(site(&report, "inlined_alloc"), (6666, 3));
    // Still running after memprof detached: it does phase two when asked.
    target.go();
    wait_line(&mut target, "two");
}

/// `memprof snapshot` of `target` (`pprof_sites`, waiting) into `output` for `duration` s, with
/// no daemon to answer it (a port nothing listens on, returned): `then` runs once memprof traces
/// the fixture and the fixture has done its first phase.
fn snapshot_without_a_daemon(
    target: &mut Waiting,
    output: &str,
    duration: &str,
    mut then: impl FnMut(&mut std::process::Child),
) -> (Outcome, String) {
    let pid = target.pid().to_string();
    let nobody = format!("http://127.0.0.1:{}", memprof_tests::free_port());
    let mut memprof = Command::new(memprof_bin());
    memprof
        .args(["snapshot", "--pid", &pid, "-o", output, "--daemon", &nobody, "--duration", duration])
        .stdin(Stdio::null());
    let outcome = released(memprof, &[format!("memprof: tracing pid {pid} ")], |memprof| {
        target.go();
        wait_line(target, "one");
        then(memprof);
    });
    (outcome, nobody)
}

/// A process that exits during the snapshot: memprof says it exited, and nothing of it running on.
#[test]
fn a_snapshot_of_a_process_that_exits_says_it_exited() {
    let scratch = Scratch::new("pprof", "exits");
    let mut target = Waiting::start(&fixture("pprof_sites"), &[]);
    let pid = target.pid();
    let output = scratch.file("exits.json");
    let nobody = format!("http://127.0.0.1:{}", memprof_tests::free_port());
    let mut memprof = Command::new(memprof_bin());
    memprof
        .args(["snapshot", "--pid", &pid.to_string(), "-o", &output, "--daemon", &nobody, "--duration", "600"])
        .stdin(Stdio::null());
    let outcome = released(memprof, &[format!("memprof: tracing pid {pid} ")], |_| {
        target.go();
        wait_line(&mut target, "one");
        // Its stdin closed, the fixture exits.
        drop(target.child.stdin.take());
    });
    assert!(outcome.status.success(), "{outcome:?}");
    let said = &outcome.stderr;
    assert!(said.contains(&format!("memprof: pid {pid} (pprof_sites) exited")), "{said}");
    assert!(!said.contains("keeps running"), "{said}");
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&output).unwrap()).expect("one JSON report");
    assert_eq!(report["exited"], true, "{report}");
}

/// A snapshot cut short by Ctrl-C still writes its report, and says it covers less than asked.
#[test]
fn a_snapshot_stopped_by_ctrl_c_says_how_much_it_covers() {
    let scratch = Scratch::new("pprof", "stopped");
    let mut target = Waiting::start(&fixture("pprof_sites"), &[]);
    let output = scratch.file("stopped.json");
    let (outcome, _) = snapshot_without_a_daemon(&mut target, &output, "600", |memprof| {
        // SAFETY: kill takes a pid and a signal; the pid is our own unreaped child's.
        unsafe { libc::kill(memprof.id() as libc::pid_t, libc::SIGINT) };
    });
    assert!(outcome.status.success(), "{outcome:?}");
    let said = &outcome.stderr;
    assert!(said.contains("memprof: stopped by a signal after "), "{said}");
    assert!(said.contains(" s of the 600 s asked (--duration): the report covers "), "{said}");
    assert!(said.contains(&format!("memprof: wrote {output}\n")), "{said}");
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&output).unwrap()).expect("one JSON report");
    assert_eq!(site(&report, "site_a"), (10_000, 10));
}

/// A failing command's error: one line, naming the problem.
fn assert_fails(outcome: &Outcome, says: &str) {
    assert!(!outcome.status.success(), "{outcome:?}");
    assert_eq!(outcome.stderr.lines().count(), 1, "one line: {}", outcome.stderr);
    assert!(outcome.stderr.starts_with("memprof: error: ") && outcome.stderr.contains(says), "{}", outcome.stderr);
}

#[test]
fn bad_input_is_a_one_line_error() {
    let scratch = Scratch::new("pprof", "bad");
    let missing = scratch.file("missing.json");
    assert_fails(&memprof(&["diff", &missing, &missing]), "cannot read");
    let not_a_profile = scratch.file("notes.txt");
    std::fs::write(&not_a_profile, "heap notes\n").unwrap();
    assert_fails(
        &memprof(&["diff", &not_a_profile, &not_a_profile]),
        "neither a memprof JSON report nor a pprof profile",
    );
    let gzipped = scratch.file("other.gz");
    let gzip = Command::new("gzip").arg(&not_a_profile).status().expect("starting gzip");
    assert!(gzip.success());
    std::fs::rename(format!("{not_a_profile}.gz"), &gzipped).unwrap();
    assert_fails(&memprof(&["diff", &gzipped, &gzipped]), "not a profile.proto");
    let not_a_report = scratch.file("other.json");
    std::fs::write(&not_a_report, "{\"hello\": 1}\n").unwrap();
    assert_fails(&memprof(&["diff", &not_a_report, &not_a_report]), "is not a memprof JSON report");
    // Counts no process holds, which the sums and differences would wrap.
    let edited = scratch.file("edited.json");
    let stack = |id: &str| {
        format!(
            r#"{{"stack_id":"{id}","outstanding_bytes":18446744073709551615,"outstanding_allocations":1,"frames":[]}}"#
        )
    };
    std::fs::write(&edited, format!("{{\"stacks\":[{},{}]}}\n", stack("1"), stack("2"))).unwrap();
    assert_fails(&memprof(&["diff", &edited, &edited]), "edited.json says its stacks hold more than 2^63 bytes");
    assert_fails(&memprof(&["snapshot", "--pid", "1", "-o", &scratch.file("heap.txt")]), "end it in .pb.gz or .json");

    // Binary to a terminal: `script` gives memprof one.
    let command = format!("{} run --format pprof -- /bin/true", memprof_bin().display());
    let on_terminal = Command::new("script").args(["-qec", &command, "/dev/null"]).output().expect("starting script");
    let said = String::from_utf8_lossy(&on_terminal.stdout);
    assert!(!on_terminal.status.success(), "{said}");
    assert!(said.contains("--format pprof writes binary data") && said.contains("--output FILE"), "{said}");
}

/// An inspected process's profile has the bytes of each reachability class as sample types:
/// `reachability.c`'s sites, as memcheck classes them (tests/tests/inspect.rs), in `go tool pprof
/// -sample_index=CLASS`.
#[test]
fn an_inspection_gives_each_class_a_sample_type() {
    let scratch = Scratch::new("pprof", "inspect");
    let profile = scratch.file("inspected.pb.gz");
    let program = fixture_with("reachability.c", "reachability", &["-g", "-O2", "-fomit-frame-pointer", "-pthread"]);
    let mut target = Waiting::start(&program, &[]);
    let pid = target.pid().to_string();
    let mut memprof = Command::new(memprof_bin());
    memprof.args(["attach", "--pid", &pid, "--max-rate", "off", "--format", "pprof", "-o", &profile, "--inspect"]);
    memprof.args(["--duration", "2", "--interval", "1"]).stdin(Stdio::null());
    let outcome = released(memprof, &[format!("memprof: tracing pid {pid} ")], |_| target.go());
    assert!(outcome.status.success(), "{outcome:?}");
    let expected = [
        ("definitely_lost", "lost_overwritten", 160),
        ("definitely_lost", "list_head", 64),
        ("definitely_lost", "cycle_first", 48),
        ("indirectly_lost", "list_node", 160),
        ("indirectly_lost", "cycle_second", 56),
        ("possibly_lost", "interior", 128),
        ("reachable", "from_global", 80),
        ("reachable", "from_stack", 96),
        ("reachable", "from_register", 112),
    ];
    for (sample_type, function, bytes) in expected {
        let top = Top::read(&scratch, &[&format!("-sample_index={sample_type}"), &profile]);
        assert_eq!(top.sample_type, sample_type);
        assert_eq!(top.cum(function), bytes, "{sample_type} of {function}: {top:?}");
    }
}

/// What a profile's numbers miss is in its comments, as in the table: here the allocations a
/// live table of 4 had no room for.
#[test]
fn a_profiles_comments_say_what_was_dropped() {
    let scratch = Scratch::new("pprof", "dropped");
    let profile = scratch.file("heap.pb.gz");
    let program = fixture("short_prog");
    let args = ["run", "--format", "pprof", "--output", &profile, "--max-live", "4", "--", program.to_str().unwrap()];
    let outcome = memprof(&args);
    assert!(outcome.status.success(), "{outcome:?}");
    let comments = go_pprof(&scratch, &["-comments", &profile]);
    let dropped = comments.lines().find(|l| l.starts_with("dropped: ")).unwrap_or_else(|| panic!("{comments}"));
    assert!(dropped.contains("live_map_full="), "{dropped}");
}
