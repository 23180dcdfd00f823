//! `memprof run` never changes what its command does: the command is not traced (no ptrace, no
//! signal from memprof), so memprof's death, its end and a debugger check in the command leave
//! the command's output and exit status as they are without memprof.

use std::{
    io::Read as _,
    path::Path,
    process::{Command, Stdio},
    thread,
    time::Duration,
};

use memprof_tests::{fixture, fixture_compiled, fixture_lib, fixture_with, memprof_bin, released, run};

fn path(p: &Path) -> &str {
    p.to_str().expect("UTF-8 path")
}

/// The command's output and exit code when it runs alone.
fn alone(command: &[&str]) -> (String, i32) {
    let output = Command::new(command[0]).args(&command[1..]).stdin(Stdio::null()).output().expect("running alone");
    (String::from_utf8_lossy(&output.stdout).into_owned(), output.status.code().unwrap_or(-1))
}

/// Makes this test process the reaper of orphans: a command whose memprof died is then ours to
/// wait for, with its exit status.
fn become_subreaper() {
    // SAFETY: a plain prctl on this process.
    assert_eq!(unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) }, 0, "PR_SET_CHILD_SUBREAPER");
}

/// The pid memprof says it traces ("memprof: tracing pid N ...").
fn traced_pid(stderr: &str) -> Option<libc::pid_t> {
    stderr.lines().find_map(|line| line.strip_prefix("memprof: tracing pid ")?.split(' ').next()?.parse().ok())
}

/// A loop of 600 dlopens (about 200 a second) under `memprof run`, memprof killed with SIGKILL
/// at three different moments while the libraries come and go: each time the command prints all
/// it prints alone and exits with its own status (7). Before, the command died of the SIGTRAP
/// memprof's probe sent it for the next library (3 of 3 runs).
#[test]
fn the_command_outlives_memprof_killed_during_a_dlopen_loop() {
    let lib = fixture_lib("unwind_plugin.c", "libunwind_plugin_loop.so", &["-O2", "-g"]);
    let program = fixture_with("dlopen_loop.c", "dlopen_loop", &["-O2", "-g"]);
    let command = [path(&program), path(&lib), "600"];
    let (expected, code) = alone(&command);
    assert_eq!(code, 7, "the fixture alone: {expected}");
    assert!(expected.ends_with("round 600\ndone\n"), "{expected}");
    become_subreaper();
    let report = std::env::temp_dir().join(format!("memprof-run-harmless-{}.json", std::process::id()));
    for delay_ms in [300, 900, 1800] {
        let mut memprof = Command::new(memprof_bin());
        memprof
            .args(["run", "--json", "--interval", "0.2", "--output", path(&report), "--"])
            .args(command)
            .stdin(Stdio::null());
        // The command still writes to the pipe memprof's stdout was: what `released` returns is
        // read to its end, the command's exit.
        let outcome = released(memprof, &["memprof: tracing pid ".to_string()], |memprof| {
            thread::sleep(Duration::from_millis(delay_ms));
            memprof.kill().expect("SIGKILL to memprof");
        });
        let pid = traced_pid(&outcome.stderr).expect("the pid memprof traced");
        let printed = outcome.stdout;
        let mut status = 0;
        // SAFETY: waiting for an orphan reparented to this process, with a valid out-pointer.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid, "the command was not reparented here");
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 7,
            "memprof killed after {delay_ms} ms: the command ended with status {status:#x}, not exit 7"
        );
        assert_eq!(printed, expected, "memprof killed after {delay_ms} ms changed the command's output");
    }
    let _ = std::fs::remove_file(report);
}

/// A LeakSanitizer build refuses to run under ptrace ("LeakSanitizer does not work under
/// ptrace") and exited 1 under `memprof run`: now it exits 0 when it frees everything, and its
/// own leak report still works (exit 1, the leaked block named) when it leaks. memprof sees the
/// allocations through the sanitizer's allocator and the C library's.
#[test]
fn a_leak_sanitizer_build_runs_under_run_as_it_runs_alone() {
    let program = fixture_compiled("cc", "lsan_clean.c", "lsan_clean", &["-fsanitize=address", "-g", "-O1"]);
    let clean = run(&["--interval", "3600"], &[path(&program)]);
    assert_eq!(clean.status.code(), Some(0), "{clean:?}");
    assert!(!clean.stderr.contains("LeakSanitizer"), "{}", clean.stderr);
    assert!(clean.stdout.contains("finished"), "the command's own output: {}", clean.stdout);
    let leaking = run(&["--interval", "3600"], &[path(&program), "leak"]);
    assert_eq!(leaking.status.code(), Some(1), "{leaking:?}");
    assert!(
        leaking.stderr.contains("SUMMARY: AddressSanitizer: 4242 byte(s) leaked in 1 allocation(s)."),
        "{}",
        leaking.stderr
    );
}

/// `--duration` ends memprof, not the command: memprof exits 0 with its report, and the command
/// runs on to its end (its output complete, its status its own).
#[test]
fn a_duration_end_leaves_the_command_running() {
    let lib = fixture_lib("unwind_plugin.c", "libunwind_plugin_loop.so", &["-O2", "-g"]);
    let program = fixture_with("dlopen_loop.c", "dlopen_loop", &["-O2", "-g"]);
    let command = [path(&program), path(&lib), "300"];
    let (expected, _) = alone(&command);
    become_subreaper();
    let report = std::env::temp_dir().join(format!("memprof-run-duration-{}.json", std::process::id()));
    let mut memprof = Command::new(memprof_bin())
        .args(["run", "--json", "--duration", "0.5", "--output", path(&report), "--"])
        .args(command)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting memprof");
    let status = memprof.wait().expect("memprof's end");
    let mut stderr = String::new();
    memprof.stderr.take().expect("stderr").read_to_string(&mut stderr).expect("memprof's stderr");
    assert!(status.success(), "memprof at its --duration end: {status:?}\n{stderr}");
    let pid = traced_pid(&stderr).expect("the traced pid");
    let written = std::fs::read_to_string(&report).expect("the report");
    assert!(written.contains("\"final\":true"), "{written}");
    let mut printed = String::new();
    memprof.stdout.take().expect("stdout").read_to_string(&mut printed).expect("the command's output");
    let mut code = 0;
    // SAFETY: as above.
    assert_eq!(unsafe { libc::waitpid(pid, &mut code, 0) }, pid);
    assert!(libc::WIFEXITED(code) && libc::WEXITSTATUS(code) == 7, "status {code:#x}");
    assert_eq!(printed, expected);
    let _ = std::fs::remove_file(report);
}

/// A tmpfs of 1 MiB, filled, unmounted when dropped; `name` tells apart the tests running at once.
struct FullDisk(std::path::PathBuf);

impl FullDisk {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("memprof-full-disk-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mounted = Command::new("mount").args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"]).arg(&dir).status();
        assert!(mounted.is_ok_and(|s| s.success()), "mounting a tmpfs on {}", dir.display());
        let disk = Self(dir);
        // Filled to its last block: a write there fails with ENOSPC.
        let filler = std::fs::write(disk.0.join("filler"), vec![1u8; 2 << 20]);
        assert_eq!(filler.unwrap_err().raw_os_error(), Some(libc::ENOSPC));
        disk
    }
}

impl Drop for FullDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// `run -o FILE` on a full disk: memprof cannot write its first report, says so in one line and
/// lets the command run on untraced, waits for it and exits with its exit code (7), the
/// command's output complete.
#[test]
fn run_on_a_full_disk_exits_with_the_commands_code() {
    let disk = FullDisk::new("continue");
    let report = disk.0.join("report.json");
    let program = fixture_with("dlopen_loop.c", "dlopen_loop", &["-O2", "-g"]);
    let lib = fixture_lib("unwind_plugin.c", "libunwind_plugin_loop.so", &["-O2", "-g"]);
    let command = [path(&program), path(&lib), "300"];
    let (expected, _) = alone(&command);
    let outcome = Command::new(memprof_bin())
        .args(["run", "--json", "--interval", "0.2", "--output", path(&report), "--"])
        .args(command)
        .stdin(Stdio::null())
        .output()
        .expect("running memprof");
    let stderr = String::from_utf8_lossy(&outcome.stderr);
    assert_eq!(outcome.status.code(), Some(7), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&outcome.stdout), expected);
    let said: Vec<&str> = stderr.lines().filter(|l| l.contains("cannot go on")).collect();
    assert_eq!(said.len(), 1, "{stderr}");
    assert!(said[0].contains("No space left on device"), "{stderr}");
    assert!(said[0].contains("the command runs on untraced"), "{stderr}");
}

/// `run --fail-on-leak-bytes` on a full disk: memprof cannot go on, so the CI gate is not judged,
/// and a command that exits 0 does not pass it: memprof exits 1.
#[test]
fn a_ci_gate_memprof_cannot_judge_does_not_pass() {
    let disk = FullDisk::new("gate");
    let report = disk.0.join("report.json");
    let outcome = Command::new(memprof_bin())
        .args(["run", "--json", "--interval", "0.2", "--fail-on-leak-bytes", "0", "--output", path(&report), "--"])
        .args(["sleep", "1"])
        .stdin(Stdio::null())
        .output()
        .expect("running memprof");
    let stderr = String::from_utf8_lossy(&outcome.stderr);
    assert_eq!(outcome.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("--fail-on-leak-bytes could not be judged"), "{stderr}");
}

/// An output path that cannot be written is refused before the command starts, with the reason
/// the path itself gives: a directory, a file of /proc (where no file can be made), an immutable
/// file (which no rename can replace).
#[test]
fn an_output_path_that_cannot_be_written_is_refused_at_once_with_its_reason() {
    let dir = std::env::temp_dir();
    let immutable = dir.join(format!("memprof-immutable-{}.json", std::process::id()));
    std::fs::write(&immutable, "previous").unwrap();
    let chattr = |flag: &str| Command::new("chattr").args([flag, path(&immutable)]).status().unwrap().success();
    assert!(chattr("+i"), "chattr +i {}", immutable.display());
    for (output, reason) in [
        (path(&dir), "Is a directory"),
        ("/proc/version", "no file can be made there; give --output a path outside /proc"),
        (path(&immutable), "an immutable or append-only file, which nothing can replace"),
    ] {
        let outcome = Command::new(memprof_bin())
            .args(["run", "--output", output, "--", "true"])
            .stdin(Stdio::null())
            .output()
            .expect("running memprof");
        let stderr = String::from_utf8_lossy(&outcome.stderr);
        assert_eq!(outcome.status.code(), Some(1), "{stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(stderr.contains(reason), "{output}: {stderr}");
    }
    assert!(chattr("-i"));
    assert_eq!(std::fs::read_to_string(&immutable).unwrap(), "previous");
    std::fs::remove_file(&immutable).unwrap();
}

/// `run --on-error stop -o FILE` on a full disk: memprof cannot write its first report, says so
/// in one line, stops the command (which would leak for 3 s and exit 3) with SIGTERM, and exits
/// with the code its death by that signal gives (143), at once rather than after the command.
#[test]
fn run_on_error_stop_stops_the_command_and_exits_with_its_code() {
    let disk = FullDisk::new("stop");
    let report = disk.0.join("report.json");
    let program = fixture("lifecycle");
    let outcome = Command::new(memprof_bin())
        .args(["run", "--json", "--interval", "0.2", "--on-error", "stop", "--output", path(&report), "--"])
        .args([path(&program), "linger"])
        .stdin(Stdio::null())
        .output()
        .expect("running memprof");
    let stderr = String::from_utf8_lossy(&outcome.stderr);
    assert_eq!(outcome.status.code(), Some(128 + libc::SIGTERM), "{stderr}");
    let said: Vec<&str> = stderr.lines().filter(|l| l.contains("cannot go on")).collect();
    assert_eq!(said.len(), 1, "{stderr}");
    assert!(said[0].contains("No space left on device"), "{stderr}");
    assert!(said[0].contains("stopping the command with SIGTERM"), "{stderr}");
}

/// Ctrl-C to a command that takes 3 s to shut down (memprof and it in one process group, as in a
/// terminal): memprof traces it to its exit, saying after 2 s that it waits, and exits with its
/// code (3), its final report written after. Before, memprof exited 0 after 2 s, the command
/// still running.
#[test]
fn ctrl_c_waits_for_a_command_that_takes_its_time_to_stop() {
    use std::{io::BufRead as _, os::unix::process::CommandExt as _};
    let mut memprof = Command::new(memprof_bin())
        .args([
            "run",
            "--json",
            "--",
            "sh",
            "-c",
            "trap 'sleep 3; exit 3' INT; echo trapped >&2; while :; do sleep 0.2; done",
        ])
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting memprof");
    let mut stdout = memprof.stdout.take().expect("stdout");
    let report = thread::spawn(move || {
        let mut report = String::new();
        stdout.read_to_string(&mut report).expect("memprof's report");
        report
    });
    let mut stderr = std::io::BufReader::new(memprof.stderr.take().expect("stderr"));
    let mut said = String::new();
    // Its trap set: a signal before would kill it at once.
    while !said.lines().any(|line| line == "trapped") {
        assert!(stderr.read_line(&mut said).unwrap() > 0, "memprof ended before its command's trap: {said}");
    }
    // SAFETY: a plain kill(2) of the process group memprof leads.
    assert_eq!(unsafe { libc::kill(-(memprof.id() as libc::pid_t), libc::SIGINT) }, 0);
    stderr.read_to_string(&mut said).expect("memprof's stderr");
    let report = report.join().expect("the report's reader");
    let status = memprof.wait().expect("memprof's end");
    assert_eq!(status.code(), Some(3), "{said}");
    assert!(said.contains(" (sh) still runs 2 s after SIGINT: traced until it exits"), "{said}");
    assert!(!said.contains("runs on untraced"), "{said}");
    assert!(report.contains("\"final\":true"), "{report}");
}
