//! The capabilities the book documents (docs: install.md#permissions), and the unit and the DaemonSet grant:
//! memprof run as a user other than root holding exactly them traces a root process whose
//! executable only root may read, exactly; without any one of them it says which is missing.

use std::{
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::Command,
};

use memprof_tests::{attach_with, fixture, memprof_bin, site, total, wait_for, Daemon, Outcome, Waiting};

/// The documented set, as setpriv names them.
const CAPABILITIES: [&str; 3] = ["sys_admin", "sys_ptrace", "dac_read_search"];

/// Their bits in /proc/PID/status (linux/capability.h: 21, 19 and 2).
const CAP_EFF: &str = "0000000000280004";

/// `setpriv` running a program as nobody with exactly `capabilities`: ambient, so they survive
/// the exec without file capabilities, and the bounding set holds no other.
fn as_nobody_with(capabilities: &[&str]) -> Command {
    let set: String = std::iter::once("-all".to_string())
        .chain(capabilities.iter().map(|c| format!("+{c}")))
        .collect::<Vec<_>>()
        .join(",");
    let mut command = Command::new("setpriv");
    command.args([
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        &format!("--inh-caps={set}"),
        &format!("--ambient-caps={set}"),
        &format!("--bounding-set={set}"),
    ]);
    command
}

fn memprof_as_nobody_with(capabilities: &[&str]) -> Command {
    let mut command = as_nobody_with(capabilities);
    command.arg(memprof_bin());
    command
}

/// A copy of a fixture in a directory only root may enter, as a service's files often are
/// (reading it takes CAP_DAC_READ_SEARCH); removed when dropped.
struct Private {
    dir: PathBuf,
}

impl Private {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("memprof-private-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        Self { dir }
    }

    fn copy(&self, program: &Path) -> PathBuf {
        let to = self.dir.join(program.file_name().unwrap());
        std::fs::copy(program, &to).unwrap();
        std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o700)).unwrap();
        to
    }
}

impl Drop for Private {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn attach_with_exactly_the_documented_capabilities() {
    let out = as_nobody_with(&CAPABILITIES).args(["grep", "^CapEff:", "/proc/self/status"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).split_whitespace().nth(1), Some(CAP_EFF), "{out:?}");

    let private = Private::new("attach");
    let mut target = Waiting::start(&private.copy(&fixture("lifecycle")), &["prior"]);
    let pid = target.pid();
    let outcome = attach_with(memprof_as_nobody_with(&CAPABILITIES), &mut target, pid, &["--duration", "2"]);
    assert!(outcome.status.success(), "{outcome:?}");
    assert!(!outcome.stderr.contains("cannot read"), "every file read: {}", outcome.stderr);
    let report = outcome.final_report();
    assert_eq!(site(&report, "after_attach"), (320, 10), "{report}");
    assert_eq!(total(&report, "unknown_frees"), 100);
    assert_eq!(report["stacks"][0]["frames"][0]["file"], "lifecycle.c", "symbolized from the private file");
}

#[test]
fn each_missing_capability_is_named() {
    let target = Waiting::start(&fixture("lifecycle"), &["prior"]);
    let pid = target.pid().to_string();
    for missing in CAPABILITIES {
        let held: Vec<&str> = CAPABILITIES.iter().copied().filter(|c| *c != missing).collect();
        // The daemon says it before it binds its socket, whose directory is root's.
        for command in [vec!["attach", "-p", &pid], vec!["daemon", "--pid", &pid]] {
            let out = memprof_as_nobody_with(&held).args(&command).output().unwrap();
            let outcome = Outcome::from(out);
            assert_eq!(outcome.status.code(), Some(1), "{command:?}: {outcome:?}");
            let name = format!("missing CAP_{}", missing.to_uppercase());
            assert_eq!(outcome.stderr.lines().count(), 1, "{command:?}, one line: {}", outcome.stderr);
            assert!(
                outcome.stderr.starts_with("memprof: error: missing privileges: ") && outcome.stderr.contains(&name),
                "{command:?}, {name}: {}",
                outcome.stderr
            );
        }
    }
}

/// The daemon, as the unit and the DaemonSet run it, and what it logs by default: one line when
/// it starts tracing a process and one when it stops, without colours in a pipe.
#[test]
fn the_daemon_with_exactly_the_documented_capabilities() {
    let private = Private::new("daemon");
    let mut held = Waiting::start(&private.copy(&fixture("daemon_target")), &[]);
    let pid = held.pid();
    let mut daemon =
        Daemon::ready(Daemon::spawn_with(memprof_as_nobody_with(&CAPABILITIES), &["--pid", &pid.to_string()], &[]));
    daemon.wait_traced(pid);
    held.go();
    let path = format!("/api/v1/leaks?pid={pid}");
    wait_for(20, "the held blocks in the daemon's report", || {
        (site(&daemon.get_json(&path).1, "hold_site") == (50_000, 50)).then_some(())
    });
    drop(held);
    wait_for(20, "the exited target to be dropped", || (!daemon.traced_pids().contains(&(pid as u64))).then_some(()));
    daemon.signal(libc::SIGTERM);
    let status = daemon.child.wait().unwrap();
    let log = daemon.log();
    assert!(status.success(), "{status}: {log}");
    assert!(!log.contains('\x1b'), "no colours in a pipe: {log}");
    let about = |what: &str| log.lines().filter(|l| l.contains(&format!("pid={pid}")) && l.contains(what)).count();
    assert_eq!(
        (
            about("INFO memprof::daemon::tracer::targets: tracing"),
            about("INFO memprof::daemon::tracer::targets: no longer traced")
        ),
        (1, 1),
        "{log}"
    );
}
