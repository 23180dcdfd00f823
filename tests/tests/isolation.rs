//! Isolation: a target in a container of its own (mount and pid namespaces, its own C library),
//! and a target under a seccomp filter that kills it on any syscall it did not allow.

use std::{
    fs,
    io::Read as _,
    path::{Path, PathBuf},
    process::Command,
};

use memprof_tests::{
    assert_nothing_dropped, attach, attach_pid, fixture, one_at_a_time, own_root, site, total, wait_for, Daemon,
    Waiting,
};
use serde_json::Value;

/// A fixture run as `/NAME --wait` in new mount and pid namespaces, in a root only its mount
/// namespace sees: a tmpfs mounted over an empty directory and filled from `own_root` there, so
/// from memprof's side the files exist only through `/proc/PID/root` and `map_files`.
struct Container {
    /// `unshare`, which waits for the namespace's init; killing it kills the namespace.
    target: Waiting,
    /// The fixture's pid as memprof (in the host namespace) sees it.
    pid: u32,
    staged: PathBuf,
    mount: PathBuf,
}

impl Container {
    fn start(program: &Path, name: &str) -> Self {
        let staged = own_root(program, name);
        let mount = std::env::temp_dir().join(format!("memprof-container-{}-{name}", std::process::id()));
        fs::create_dir_all(&mount).expect("creating the mount point");
        let mut command = Command::new("unshare");
        command
            .args(["--mount", "--pid", "--fork", "--kill-child", "sh", "-c"])
            .arg(r#"mount -t tmpfs container "$0" && cp -a "$1/." "$0" && exec chroot "$0" "/$2" --wait"#)
            .args([&mount, &staged])
            .arg(name);
        let target = Waiting::start_command(command);
        // The fixture said "ready": unshare's one child has exec'd it.
        let unshare = target.pid();
        let children =
            fs::read_to_string(format!("/proc/{unshare}/task/{unshare}/children")).expect("unshare's children");
        let pid = children
            .split_whitespace()
            .next()
            .and_then(|p| p.parse().ok())
            .expect("unshare forked the namespace's init");
        assert!(!mount.join(name).exists(), "the container's files must not be visible from the host");
        Self { target, pid, staged, mount }
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.staged);
        let _ = fs::remove_dir(&self.mount);
    }
}

/// The fixture is pid 1 of its namespace.
const NS_PID: u64 = 1;

#[test]
fn a_process_in_its_own_namespaces_and_libc_is_traced_by_host_pid() {
    let _alone = one_at_a_time();
    let mut container = Container::start(&fixture("allocators"), "contained_attach");
    let pid = container.pid;
    let outcome = attach_pid(&mut container.target, pid, &["--interval", "60"]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert_eq!(report["pid"], pid, "{report}");
    assert_eq!(report["ns_pid"], NS_PID, "{report}");
    // Exact bytes per site, named from the container's own files.
    for (function, expected) in [
        ("site_malloc", (1000, 10)),
        ("site_calloc", (500, 5)),
        ("site_posix_memalign", (600, 3)),
        ("site_aligned_alloc", (256, 2)),
        ("site_memalign", (384, 4)),
        ("site_valloc", (100, 1)),
        ("site_pvalloc", (100, 1)),
    ] {
        assert_eq!(site(&report, function), expected, "{function}: {report}");
    }
    assert_eq!(total(&report, "failed_allocations"), 4, "{report}");
    assert_nothing_dropped(&report);
    let module = report["stacks"][0]["frames"][0]["module"].as_str().expect("a module path");
    assert!(module.ends_with("/contained_attach"), "{report}");
    assert!(!Path::new(module).exists(), "{module} is visible from the host: this test proves nothing");
}

#[test]
fn the_daemon_exports_the_namespace_pid_of_a_contained_process() {
    let _alone = one_at_a_time();
    let daemon = Daemon::start(&["--comm", "^contained_daemo"]);
    let mut container = Container::start(&fixture("daemon_target"), "contained_daemon");
    let pid = container.pid;
    daemon.wait_traced(pid);
    container.target.go();
    let leaks = format!("/api/v1/leaks?pid={pid}");
    let report: Value =
        wait_for(20, "its allocations", || Some(daemon.get_json(&leaks).1).filter(|r| site(r, "hold_site").1 == 50));
    assert_eq!(site(&report, "hold_site"), (50_000, 50), "{report}");
    assert_eq!((report["pid"].as_u64(), report["ns_pid"].as_u64()), (Some(pid.into()), Some(NS_PID)), "{report}");
    let (_, metrics) = memprof_tests::http_get(daemon.port, "/metrics").expect("scraping /metrics");
    let info = format!("memprof_target_attached{{pid=\"{pid}\",comm=\"contained_daemo\",ns_pid=\"{NS_PID}\"}}");
    assert_eq!(memprof_tests::sample(&metrics, &info), Some(1), "{metrics}");
    // Only the per-target series carries it: every other series keeps its labels.
    let inuse = format!("memprof_heap_inuse_bytes{{pid=\"{pid}\",comm=\"contained_daemo\"}}");
    assert!(memprof_tests::sample(&metrics, &inuse).is_some(), "{metrics}");
    assert_eq!(metrics.matches("ns_pid=").count(), 1, "{metrics}");
}

/// Runs the seccomp fixture (filtered when `strict`) under `attach`, checks it behaved as
/// unprobed (printed "done", exited 0) and returns memprof's final report.
fn traced_under_seccomp(strict: bool) -> Value {
    let program = fixture("seccomp_strict");
    let mut target = Waiting::start(&program, if strict { &["--strict"] } else { &[] });
    let status = fs::read_to_string(format!("/proc/{}/status", target.pid())).expect("the fixture's status");
    let mode = status.lines().find_map(|line| line.strip_prefix("Seccomp:")).map(str::trim);
    assert_eq!(mode, Some(if strict { "2" } else { "0" }), "the filter is (not) installed: {status}");
    let outcome = attach(&mut target, &["--interval", "60"]);
    assert!(outcome.status.success(), "{outcome:?}");
    let exit = target.child.wait().expect("waiting for the fixture");
    let mut printed = String::new();
    target.child.stdout.take().expect("piped").read_to_string(&mut printed).expect("reading the fixture");
    assert!(exit.success() && printed == "done\n", "the target changed under the probes: {exit}, {printed:?}");
    outcome.final_report()
}

fn assert_counted_exactly(report: &Value) {
    assert_eq!(site(report, "hold_site"), (1000, 10), "{report}");
    assert_eq!(site(report, "calloc_site"), (500, 5), "{report}");
    assert_eq!(site(report, "grow_site"), (300, 1), "{report}");
    assert_eq!(site(report, "churn_site"), (0, 0), "{report}");
    // malloc(10) + realloc, 20 churn blocks: everything allocated is either held or freed.
    assert_eq!(total(report, "allocations"), 10 + 5 + 2 + 20, "{report}");
    assert_eq!(total(report, "frees"), 1 + 20, "{report}");
    assert_eq!(total(report, "outstanding_bytes"), 1800, "{report}");
    assert_nothing_dropped(report);
}

/// The filter allows neither the `uretprobe` syscall that the kernel's return trampoline makes on
/// x86_64 nor anything else the probes might need; the kernel lets its own trampoline through
/// (Linux 6.14+), so the target runs and is counted as without a filter.
#[test]
fn a_target_under_a_strict_seccomp_filter_keeps_working_and_is_counted_exactly() {
    assert_counted_exactly(&traced_under_seccomp(true));
}

#[test]
fn the_same_target_without_a_filter_is_counted_the_same() {
    assert_counted_exactly(&traced_under_seccomp(false));
}
