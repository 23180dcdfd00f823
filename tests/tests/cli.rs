//! The command line: report formats and every kind of bad input.

use std::process::{Command, Stdio};

use memprof_tests::{fixture, fixture_with, memprof, memprof_bin, run, Waiting};

/// A bad input ends with one line on stderr naming the problem, a non-zero exit and no panic.
fn assert_one_line_error(outcome: &memprof_tests::Outcome, expected: &str) {
    assert!(!outcome.status.success(), "{outcome:?}");
    let lines: Vec<&str> = outcome.stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line expected: {}", outcome.stderr);
    assert!(lines[0].starts_with("memprof: error: "), "{}", lines[0]);
    assert!(lines[0].contains(expected), "`{expected}` not in: {}", lines[0]);
    assert!(!outcome.stderr.contains("panicked"), "{}", outcome.stderr);
}

#[test]
fn json_reports_follow_the_documented_schema() {
    let outcome = run(&[], &[fixture("lifecycle").to_str().unwrap(), "double-free"]);
    let report = outcome.final_report();
    for key in ["final", "pid", "comm", "duration_s", "totals", "dropped", "stacks", "double_frees"] {
        assert!(report.get(key).is_some(), "missing {key}: {report}");
    }
    for key in [
        "outstanding_bytes",
        "outstanding_allocations",
        "allocations",
        "allocated_bytes",
        "frees",
        "freed_bytes",
        "unknown_frees",
        "failed_allocations",
    ] {
        assert!(report["totals"][key].is_u64(), "totals.{key}: {report}");
    }
    for key in [
        "live_map_full",
        "stack_table_full",
        "stack_collision",
        "unwind_no_table",
        "inflight_missing",
        "double_free_event_lost",
    ] {
        assert!(report["dropped"][key].is_u64(), "dropped.{key}: {report}");
    }
    let stack = &report["stacks"][0];
    for key in [
        "stack_id",
        "outstanding_bytes",
        "outstanding_allocations",
        "allocations",
        "allocated_bytes",
        "oldest_age_s",
        "frames",
    ] {
        assert!(stack.get(key).is_some(), "stacks[0].{key}: {stack}");
    }
    let frame = &stack["frames"][0];
    assert!(frame["address"].as_str().unwrap().starts_with("0x"));
    assert_eq!(frame["file"], "lifecycle.c");
    assert!(frame["line"].as_u64().unwrap() > 0);
    assert!(frame["module"].as_str().unwrap().ends_with("/lifecycle"));
    assert_eq!(frame["inlined"], false);
    let df = &report["double_frees"][0];
    assert!(df["address"].as_str().unwrap().starts_with("0x"));
    for which in ["alloc", "first_free", "second_free"] {
        assert!(df[which]["tid"].is_u64() && df[which]["time_s"].is_f64() && df[which]["frames"].is_array());
    }
    assert!(report["pid"].as_u64().unwrap() > 0);
}

#[test]
fn the_table_names_function_file_line_and_module() {
    let out = Command::new(memprof_bin())
        .args(["run", "--top", "1", "--", fixture("lifecycle").to_str().unwrap(), "linger"])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("final report"), "{table}");
    assert!(table.contains("linger_leak (lifecycle.c:"), "{table}");
    assert!(table.contains("[lifecycle]"), "{table}");
    assert!(!table.contains("before_attach"), "--top 1 shows only the largest stack: {table}");
}

#[test]
fn output_goes_to_the_file_given() {
    let path = std::env::temp_dir().join(format!("memprof-output-{}.json", std::process::id()));
    let outcome = run(&["--output", path.to_str().unwrap()], &[fixture("lifecycle").to_str().unwrap(), "reuse"]);
    assert!(outcome.status.success(), "{outcome:?}");
    assert!(outcome.stdout.is_empty());
    let text = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let last: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(last["final"], true);
}

#[test]
fn a_pid_that_does_not_exist() {
    assert_one_line_error(&memprof(&["attach", "--pid", "999999999"]), "no process with pid 999999999");
}

#[test]
fn a_kernel_thread() {
    assert_one_line_error(&memprof(&["attach", "--pid", "2"]), "kernel thread");
}

#[test]
fn a_process_without_an_allocator() {
    let program = fixture_with("no_allocator.c", "no_allocator", &["-nostdlib", "-static"]);
    let mut child = Command::new(program).stdout(Stdio::null()).spawn().unwrap();
    let outcome = memprof(&["attach", "--pid", &child.id().to_string()]);
    let _ = child.kill();
    let _ = child.wait();
    assert_one_line_error(&outcome, "no allocator found");
}

#[test]
fn missing_privileges_name_what_is_needed() {
    let mut target = Waiting::start(&fixture("lifecycle"), &["reuse"]);
    // setpriv drops to nobody with no capabilities at all.
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"])
        .arg(memprof_bin())
        .args(["attach", "--pid", &target.pid().to_string()])
        .output()
        .expect("setpriv (util-linux) runs memprof unprivileged");
    target.go();
    let outcome = memprof_tests::Outcome::from(out);
    assert_one_line_error(&outcome, "CAP_SYS_ADMIN + CAP_BPF + CAP_PERFMON");
}

#[test]
fn an_unwritable_output_file() {
    let outcome = memprof(&["run", "--output", "/nonexistent-dir/report.json", "--", "/bin/true"]);
    assert_one_line_error(&outcome, "cannot write the output file /nonexistent-dir/report.json");
}

#[test]
fn a_command_that_does_not_exist() {
    let outcome = memprof(&["run", "--", "/no/such/program"]);
    assert_one_line_error(&outcome, "cannot start /no/such/program");
    let outcome = memprof(&["run", "--", "no-such-program-on-path"]);
    assert_one_line_error(&outcome, "cannot start no-such-program-on-path: not found on PATH");
    assert_eq!(outcome.stderr.matches("not found on PATH").count(), 1, "said once: {}", outcome.stderr);
}

#[test]
fn usage_errors_exit_2() {
    for args in [
        &["attach"][..],
        &["attach", "--pid", "0"],
        &["attach", "--pid", "1", "--interval", "0"],
        &["attach", "--pid", "1", "--min-age", "-1"],
        &["run"],
        &["frobnicate"],
    ] {
        let outcome = memprof(args);
        assert_eq!(outcome.status.code(), Some(2), "{args:?}: {outcome:?}");
        assert!(!outcome.stderr.contains("panicked"));
    }
}

/// A script runs its interpreter: `run` finds the allocator there (`#!/usr/bin/env sh` included)
/// and follows the exec into the program the script starts.
#[test]
fn a_script_is_run_through_its_interpreter() {
    let script = std::env::temp_dir().join(format!("memprof-script-{}.sh", std::process::id()));
    let program = fixture("reports");
    std::fs::write(&script, format!("#!/usr/bin/env sh\nexec {}\n", program.display())).unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let outcome = run(&[], &[script.to_str().unwrap()]);
    std::fs::remove_file(&script).unwrap();
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert!(report["totals"]["allocations"].as_u64().unwrap() > 0, "{report}");
    assert_eq!(report["comm"], "reports", "{report}");
}
