//! `run` through programs that exec the one to trace (`env`, `sh -c 'exec ...'`, a preloaded
//! allocator set on the way): a program that is over within a millisecond is seen from its first
//! call, exactly as when run directly.

use std::{
    io::Write,
    process::{Command, Stdio},
};

use memprof_tests::{fixture, run, run_with_env, site, total, wait_for, Daemon, Outcome};
use serde_json::Value;

/// The fixture's truth (see short_prog.c): outstanding (bytes, allocations) per site.
const SITES: [(&str, (u64, u64)); 3] = [("first_site", (48, 1)), ("kept_site", (1000, 10)), ("zeroed_site", (500, 5))];

fn short_prog() -> String {
    fixture("short_prog").to_str().unwrap().to_string()
}

/// The report of the exec'd program, with its sites and counts exact and no free unknown.
fn traced_exactly(outcome: &Outcome) -> Value {
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert!(report["exe"].as_str().is_some_and(|exe| exe.ends_with("/short_prog")), "{report}");
    for (function, outstanding) in SITES {
        // memprof's stderr too: which files it probed, and what it said of the execs.
        assert_eq!(site(&report, function), outstanding, "{function}: {report}\n{}", outcome.stderr);
    }
    assert_eq!(total(&report, "unknown_frees"), 0, "{report}");
    assert_eq!(total(&report, "failed_allocations"), 0, "{report}");
    report
}

/// On the C library, every allocation and free is the fixture's own.
fn glibc_truth(report: &Value) {
    assert_eq!(total(report, "allocations"), 16 + 20, "{report}");
    assert_eq!(total(report, "frees"), 20, "{report}");
    assert_eq!(total(report, "freed_bytes"), 20 * 300, "{report}");
    assert_eq!(total(report, "outstanding_bytes"), 1548, "{report}");
}

#[test]
fn a_program_env_runs_is_traced_from_its_first_call() {
    let report = traced_exactly(&run(&[], &["env", &short_prog()]));
    glibc_truth(&report);
}

#[test]
fn a_program_a_shell_execs_is_traced_from_its_first_call() {
    let report = traced_exactly(&run(&[], &["sh", "-c", &format!("exec {}", short_prog())]));
    glibc_truth(&report);
}

#[test]
fn two_execs_in_a_row_leave_only_the_last_program() {
    let report = traced_exactly(&run(&[], &["env", "env", &short_prog()]));
    glibc_truth(&report);
}

/// `env LD_PRELOAD=lib prog`: the allocator the exec'd program preloads is probed from its first
/// call, and the counts equal those of the same program run directly with it preloaded.
#[test]
fn a_program_exec_d_with_a_preloaded_allocator_is_traced_from_its_first_call() {
    for lib in ["/usr/lib/x86_64-linux-gnu/libmimalloc.so.2", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"] {
        let preload = format!("LD_PRELOAD={lib}");
        let chained = traced_exactly(&run(&[], &["env", &preload, &short_prog()]));
        let direct = traced_exactly(&run_with_env(&[("LD_PRELOAD", lib)], &[], &[&short_prog()]));
        for name in ["allocations", "allocated_bytes", "frees", "freed_bytes", "outstanding_bytes"] {
            assert_eq!(total(&chained, name), total(&direct, name), "{lib}: {name}: {chained}\n{direct}");
        }
    }
}

/// A python that the command execs later (through a shell, as a pyenv shim does) starts with
/// `PYTHONMALLOC=malloc` too: its small objects pass through malloc, and there is no blind spot.
#[test]
fn a_python_exec_d_later_gets_pythonmalloc_too() {
    let command = "exec /usr/bin/python3 -c 'x = [str(i) for i in range(100000)]'";
    let outcome = run(&[], &["sh", "-c", command]);
    assert!(outcome.status.success(), "{outcome:?}");
    assert!(!outcome.stderr.contains("not seen"), "{}", outcome.stderr);
    let report = outcome.final_report();
    assert!(report["exe"].as_str().is_some_and(|exe| exe.contains("python3")), "{report}");
    assert_eq!(report["blind_spots"].as_array().unwrap().len(), 0, "{report}");
    // Each of the 100,000 strings is a malloc of its own.
    assert!(total(&report, "allocations") > 100_000, "{report}");
}

/// A shell that execs valgrind: valgrind reads the code of the program it runs, so the probes
/// the shell kept through the exec go at once, before it runs that code (a breakpoint there
/// stopped the program with SIGTRAP); memprof says so, and the program ends as without memprof.
#[test]
fn a_program_that_execs_valgrind_is_let_go_before_valgrind_runs_its_program() {
    let outcome = ran_valgrind_unharmed("sleep 0.3; exec valgrind -q --error-exitcode=9 {}");
    assert!(
        outcome.stderr.contains(
            "runs valgrind (/usr/bin/valgrind): no longer traced (memprof's breakpoints would stop its program)"
        ),
        "{}",
        outcome.stderr
    );
}

/// A shell that runs valgrind in children it forks, as a test suite does: memprof follows the
/// shell's children, and lets go of each one that runs valgrind, however late it hears of it.
#[test]
fn children_that_run_valgrind_are_let_go() {
    let outcome = ran_valgrind_unharmed("for k in 1 2 3; do valgrind -q --error-exitcode=9 {} || exit 1; done");
    let said = outcome.stderr.lines().filter(|line| line.contains("runs valgrind (")).count();
    assert!(said >= 3, "{}", outcome.stderr);
}

/// The daemon, tracing a shell by its name, lets it go when it execs valgrind, as `run` does:
/// the program valgrind runs meets no breakpoint of memprof's, and the daemon says so.
#[test]
fn the_daemon_lets_go_of_a_traced_process_that_execs_valgrind() {
    let dir = std::env::temp_dir().join(format!("memprof-test-vgshell-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let shell = dir.join("vgshell");
    let _ = std::fs::remove_file(&shell);
    std::os::unix::fs::symlink("/bin/sh", &shell).unwrap();
    let mut daemon = Daemon::start(&["--comm", "^vgshell$"]);
    let script = format!("read go; exec valgrind -q --error-exitcode=9 {}", short_prog());
    let mut child =
        Command::new(&shell).args(["-c", &script]).stdin(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let pid = child.id();
    daemon.wait_traced(pid);
    writeln!(child.stdin.take().unwrap(), "go").unwrap();
    let ended = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&ended.stderr);
    assert!(!stderr.contains("SIGTRAP"), "{stderr}");
    assert!(ended.status.success(), "{:?}: {stderr}", ended.status);
    wait_for(20, "the daemon to let the process go", || (!daemon.traced_pids().contains(&(pid as u64))).then_some(()));
    let log = daemon.stopped_log();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(log.contains("runs valgrind: no longer traced"), "{log}");
    assert!(log.contains(&format!("pid={pid}")), "{log}");
}

/// `run` of `sh -c SCRIPT`, `{}` in it the fixture: valgrind met no breakpoint and found no error.
fn ran_valgrind_unharmed(script: &str) -> Outcome {
    let outcome = run(&[], &["sh", "-c", &script.replace("{}", &short_prog())]);
    assert!(!outcome.stderr.contains("SIGTRAP"), "{}", outcome.stderr);
    assert!(outcome.status.success(), "{outcome:?}");
    outcome
}
