//! Who may ask the daemon what (docs: daemon/securing.md#securing-the-listener): anyone the port reaches gets
//! `/metrics` and health only; what names a process's code or data, or acts on it, is for root
//! (or the configured group) on the daemon's socket, as the kernel says, or for a user of the web
//! config. `memprof inspect` and `snapshot` ask on the socket unless told otherwise, and say so
//! when the daemon dies while they wait.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    thread,
    time::Duration,
};

use memprof_tests::{
    fixture, memprof, memprof_bin, metric, site, socket_answer, start_heapbench, wait_for, web_config_user, Daemon,
    Outcome, Waiting,
};

/// A private directory for one test's files.
fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memprof-access-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The paths anyone the listener reaches is served.
const PUBLIC: [&str; 3] = ["/metrics", "/-/healthy", "/-/ready"];

/// Every path that shows a traced process's code or data, or acts on it, for `pid`.
fn protected(pid: u32) -> Vec<String> {
    let mut paths =
        vec!["/".to_string(), "/api/v1/targets".into(), "/debug/pprof/heap".into(), "/debug/pprof/allocs".into()];
    for path in [
        "/api/v1/leaks",
        "/api/v1/inspect",
        "/api/v1/flamegraph",
        "/report",
        "/debug/pprof/heap",
        "/debug/pprof/allocs",
    ] {
        paths.push(format!("{path}?pid={pid}"));
    }
    paths
}

/// `setpriv` running a program as nobody, in no group but its own, or also in `group`.
fn as_nobody(group: Option<u32>) -> Command {
    let mut command = Command::new("setpriv");
    command.args(["--reuid=65534", "--regid=65534"]);
    match group {
        Some(gid) => command.arg(format!("--groups={gid}")),
        None => command.arg("--clear-groups"),
    };
    command
}

/// Where a request goes.
enum Over<'a> {
    Port(u16),
    Socket(&'a Path),
}

/// The status curl, run as nobody (or in `group`), gets for `GET path`.
fn status_as_nobody(group: Option<u32>, over: &Over, path: &str) -> u16 {
    let mut curl = as_nobody(group);
    curl.args(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "300"]);
    match over {
        Over::Port(port) => curl.arg(format!("http://127.0.0.1:{port}{path}")),
        Over::Socket(socket) => curl.arg("--unix-socket").arg(socket).arg(format!("http://localhost{path}")),
    };
    let out = curl.output().expect("setpriv and curl");
    String::from_utf8_lossy(&out.stdout).parse().unwrap_or_else(|_| panic!("curl {path}: {out:?}"))
}

/// The held blocks of `daemon_target` in the daemon's report of `pid`.
fn wait_held(daemon: &Daemon, pid: u32) {
    let leaks = format!("/api/v1/leaks?pid={pid}");
    wait_for(20, "the held blocks", || (site(&daemon.get_json(&leaks).1, "hold_site") == (50_000, 50)).then_some(()));
}

/// As nobody, on the port and on the socket: `/metrics` and health answer, every other path is
/// refused (403, counted), and `memprof inspect` says so in one line. In the configured group, on
/// the socket, and as root, everything answers.
#[test]
fn nobody_gets_the_metrics_only_and_root_or_the_group_everything() {
    const GROUP: u32 = 4242;
    let dir = scratch("nobody");
    let config = dir.join("memprof.toml");
    std::fs::write(&config, format!("[access]\ngroup = \"{GROUP}\"\n")).unwrap();
    let mut target = Waiting::start(&fixture("daemon_target"), &[]);
    let pid = target.pid();
    let daemon = Daemon::start(&["--pid", &pid.to_string(), "--config", config.to_str().unwrap()]);
    daemon.wait_traced(pid);
    target.go();
    wait_held(&daemon, pid);
    let (port, socket) = (Over::Port(daemon.port), Over::Socket(&daemon.socket));

    for over in [&port, &socket] {
        for path in PUBLIC {
            assert_eq!(status_as_nobody(None, over, path), 200, "{path}");
        }
        for path in protected(pid) {
            assert_eq!(status_as_nobody(None, over, &path), 403, "{path}");
        }
    }
    let mut inspect = as_nobody(None);
    inspect.arg(memprof_bin()).args(["inspect", "--pid", &pid.to_string(), "--daemon"]).arg(&daemon.socket);
    let refused: Outcome = inspect.stdin(Stdio::null()).output().unwrap().into();
    assert_eq!(refused.status.code(), Some(1), "{refused:?}");
    assert_eq!(refused.stderr.lines().count(), 1, "{}", refused.stderr);
    assert!(refused.stderr.contains("refused: this path shows or acts on traced processes"), "{}", refused.stderr);
    let forbidden = 2 * protected(pid).len() as u64 + 1;
    assert_eq!(metric(daemon.port, "memprof_http_refused_total{reason=\"forbidden\"}"), Some(forbidden));

    for path in protected(pid) {
        assert_eq!(status_as_nobody(Some(GROUP), &socket, &path), 200, "{path} for the group on the socket");
        assert_eq!(status_as_nobody(Some(GROUP), &port, &path), 403, "{path} for the group on the port");
        assert_eq!(daemon.get(&path).map(|(status, _)| status), Some(200), "{path} for root on the socket");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// At the socket's default place, `memprof inspect` and `snapshot` ask without being told where
/// and need no password as root; on the port, `snapshot` logs in with `--daemon-user`.
#[test]
fn inspect_and_snapshot_ask_the_socket_by_default_and_log_in_on_the_port() {
    let dir = scratch("default");
    let web = web_config_user(&dir, "oncall", "snapshot-secret");
    let mut target = Waiting::start(&fixture("daemon_target"), &[]);
    let pid = target.pid().to_string();
    let daemon = Daemon::start(&[
        "--pid",
        &pid,
        "--socket",
        "/run/memprof/api.sock",
        "--web-config-file",
        web.to_str().unwrap(),
    ]);
    daemon.wait_traced(target.pid());
    target.go();
    wait_held(&daemon, target.pid());

    let inspected = memprof(&["inspect", "--pid", &pid, "--json"]);
    assert!(inspected.status.success(), "{inspected:?}");
    let said = format!("memprof: pid {pid} inspected by the daemon at /run/memprof/api.sock");
    assert!(inspected.stderr.contains(&said), "{}", inspected.stderr);
    assert_eq!(site(&inspected.final_report(), "hold_site"), (50_000, 50));

    let output = dir.join("heap.json");
    let output = output.to_str().unwrap();
    let snapshot = memprof(&["snapshot", "--pid", &pid, "-o", output]);
    assert!(snapshot.status.success(), "{snapshot:?}");
    assert!(snapshot.stderr.contains("is traced by the daemon at /run/memprof/api.sock"), "{}", snapshot.stderr);

    let url = format!("http://127.0.0.1:{}", daemon.port);
    let anonymous = memprof(&["snapshot", "--pid", &pid, "-o", output, "--daemon", &url]);
    assert_eq!(anonymous.status.code(), Some(1), "{anonymous:?}");
    assert_eq!(anonymous.stderr.lines().count(), 1, "{}", anonymous.stderr);
    assert!(anonymous.stderr.contains("give --daemon-user USER"), "{}", anonymous.stderr);
    let mut login = Command::new(memprof_bin());
    login.args(["snapshot", "--pid", &pid, "-o", output, "--daemon", &url, "--daemon-user", "oncall"]);
    let refused: Outcome = login.env("MEMPROF_DAEMON_PASSWORD", "not-the-secret").output().unwrap().into();
    assert_eq!(refused.status.code(), Some(1), "{refused:?}");
    assert!(refused.stderr.contains("refused the login of oncall"), "{}", refused.stderr);
    let logged_in: Outcome = login.env("MEMPROF_DAEMON_PASSWORD", "snapshot-secret").output().unwrap().into();
    assert!(logged_in.status.success(), "{logged_in:?}");
    assert!(logged_in.stderr.contains(&format!("is traced by the daemon at {url}")), "{}", logged_in.stderr);
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(output).unwrap()).unwrap();
    assert_eq!(site(&report, "hold_site"), (50_000, 50));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `inspect = false` in `[access]`: no inspection for anyone, the rest served.
#[test]
fn inspection_can_be_switched_off() {
    let dir = scratch("off");
    let config = dir.join("memprof.toml");
    std::fs::write(&config, "[access]\ninspect = false\n").unwrap();
    let target = Waiting::start(&fixture("daemon_target"), &[]);
    let pid = target.pid();
    let daemon = Daemon::start(&["--pid", &pid.to_string(), "--config", config.to_str().unwrap()]);
    daemon.wait_traced(pid);
    let (status, body) = daemon.get_json(&format!("/api/v1/inspect?pid={pid}"));
    assert_eq!(status, 403, "{body}");
    assert!(body["error"].as_str().unwrap().contains("inspection through the daemon is switched off"), "{body}");
    assert_eq!(daemon.get_json(&format!("/api/v1/leaks?pid={pid}")).0, 200);
    let socket = daemon.socket.to_str().unwrap();
    let refused = memprof(&["inspect", "--pid", &pid.to_string(), "--daemon", socket]);
    assert_eq!(refused.status.code(), Some(1), "{refused:?}");
    assert_eq!(refused.stderr.lines().count(), 1, "{}", refused.stderr);
    assert!(refused.stderr.contains("switched off (inspect = false"), "{}", refused.stderr);
    let _ = std::fs::remove_dir_all(&dir);
}

/// heapbench's heap: its inspection takes long enough (about a second) to be caught under way.
const HEAP_MIB: u64 = 256;

/// The daemon killed while `memprof inspect` waits for its inspection: one line saying the daemon
/// closed the connection, not that no daemon traces the process.
#[test]
fn inspect_says_so_when_the_daemon_dies_mid_inspection() {
    for _ in 0..5 {
        let mut target = start_heapbench(HEAP_MIB);
        let pid = target.id();
        let daemon = Daemon::start(&["--pid", &pid.to_string()]);
        daemon.wait_traced(pid);
        let mut inspect = Command::new(memprof_bin());
        inspect.args(["inspect", "--pid", &pid.to_string(), "--json", "--daemon"]).arg(&daemon.socket);
        let waiting = inspect.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
        // Under way once a second request for the pid is refused as such (not a timing assertion:
        // a try whose inspection ends first is spoiled, and another made).
        let path = format!("/api/v1/inspect?pid={pid}");
        let under_way = (0..50).any(|_| {
            thread::sleep(Duration::from_millis(20));
            socket_answer(&daemon.socket, "GET", &path).is_some_and(|answer| answer.status == 409)
        });
        if under_way {
            daemon.signal(libc::SIGKILL);
        }
        let outcome: Outcome = waiting.wait_with_output().unwrap().into();
        drop(target.stdin.take());
        let _ = target.wait();
        if !under_way || outcome.status.success() {
            continue;
        }
        assert_eq!(outcome.status.code(), Some(1), "{outcome:?}");
        assert_eq!(outcome.stderr.lines().count(), 1, "{}", outcome.stderr);
        assert!(outcome.stderr.contains("closed the connection before answering"), "{}", outcome.stderr);
        assert!(!outcome.stderr.contains("traces pid"), "{}", outcome.stderr);
        return;
    }
    panic!("in 5 tries, no inspection was under way when the daemon was killed");
}

/// A socket in a directory another user can write could be replaced by that user (between the
/// daemon's bind and its chmod, or later under root's `memprof inspect`): refused in one line.
/// So is one with the sticky bit (/tmp): another user could bind the socket's name first, and
/// the daemon would not start.
#[test]
fn a_socket_directory_another_user_can_write_is_refused() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = scratch("unsafe-socket-dir");
    let socket = dir.join("api.sock");
    for mode in [0o777, 0o1777] {
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).unwrap();
        let stderr = memprof_tests::refused_daemon(&[], &["--socket", socket.to_str().unwrap()]);
        assert!(
            stderr.contains(&format!(
                "the socket's directory {} can be written by another user (owner uid 0, mode {mode:o})",
                dir.display()
            )) && stderr.contains("give a directory only root writes with --socket PATH"),
            "{stderr}"
        );
        assert!(!socket.exists(), "nothing was bound");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
