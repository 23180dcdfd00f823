//! The command line: report formats and every kind of bad input.

use std::{
    io::{BufRead as _, BufReader, Read as _},
    process::{Command, Stdio},
};

use memprof_tests::{fixture, fixture_lib, fixture_with, memprof, memprof_bin, run, site, wait_for, Waiting};

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
    assert_one_line_error(&memprof(&["attach", "--pid", "4194303"]), "no process with pid 4194303");
}

#[test]
fn a_kernel_thread() {
    assert_one_line_error(&memprof(&["attach", "--pid", "2"]), "kernel thread");
}

/// /proc answers for a thread's id too: memprof says whose thread it is.
#[test]
fn a_thread_of_a_process() {
    // SAFETY: gettid takes nothing and cannot fail.
    let thread = unsafe { libc::gettid() };
    let process = std::process::id();
    assert_ne!(thread as u32, process, "tests run on threads of their own");
    let outcome = memprof(&["attach", "--pid", &thread.to_string()]);
    assert_one_line_error(
        &outcome,
        &format!("{thread} is a thread of pid {process}, not a process: give the process's pid (-p {process})"),
    );
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
    assert_one_line_error(&outcome, "CAP_SYS_ADMIN + CAP_SYS_PTRACE + CAP_DAC_READ_SEARCH; missing CAP_SYS_ADMIN");
}

#[test]
fn an_unwritable_output_file() {
    let outcome = memprof(&["run", "--output", "/nonexistent-dir/report.json", "--", "/bin/true"]);
    assert_one_line_error(&outcome, "cannot write the output file /nonexistent-dir/report.json");
    assert_eq!(outcome.stderr.matches("No such file or directory").count(), 1, "said once: {}", outcome.stderr);
}

/// Without --format or --json, the output file's name picks the format, as for `snapshot`: a
/// table written into heap.pb.gz would be read by no tool.
#[test]
fn the_output_file_s_name_picks_the_format() {
    let dir = std::env::temp_dir().join(format!("memprof-named-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let program = fixture("lifecycle");
    for (name, starts) in [("heap.pb.gz", &b"\x1f\x8b"[..]), ("heap.html", b"<!doctype html>")] {
        let path = dir.join(name);
        let outcome = memprof(&["run", "-o", path.to_str().unwrap(), "--", program.to_str().unwrap(), "reuse"]);
        assert!(outcome.status.success(), "{outcome:?}");
        let written = std::fs::read(&path).unwrap_or_default();
        assert!(
            written.starts_with(starts),
            "{name}: {:?}",
            String::from_utf8_lossy(&written[..written.len().min(80)])
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Each of these errors names its real cause and the fix for it.
#[test]
fn hints_name_the_real_problem() {
    for output in ["/proc/x.json", "/proc/self/status"] {
        let outcome = memprof(&["run", "-o", output, "--", "/bin/true"]);
        assert_one_line_error(&outcome, "/proc holds the kernel's view of processes, and no file can be made there; give --output a path outside /proc");
    }
    let outcome = memprof(&[
        "snapshot",
        "-p",
        "1",
        "-o",
        "/tmp/memprof-hint.json",
        "--daemon",
        "http://nosuchhost.invalid:18310",
    ]);
    assert_one_line_error(&outcome, "the host name nosuchhost.invalid does not resolve");
    let outcome = memprof(&["attach", "-p", "1", "--fail-on-leak-bytes", "0"]);
    assert_one_line_error(&outcome, "--fail-on-leak-bytes is an option of `memprof run` only, not of `memprof attach`");
    assert!(!outcome.stderr.contains("--sample-bytes"), "{}", outcome.stderr);
    let outcome = memprof(&["inspect", "-p", "4194303"]);
    assert_one_line_error(&outcome, "no process with pid 4194303");
    let outcome = memprof(&["attach", "10318"]);
    assert_one_line_error(&outcome, "give the process id as -p 10318");
}

/// A zombie has exited: it has no memory to trace, and memprof says so rather than "no process".
#[test]
fn a_zombie() {
    // sh's background child exits a second later, when sh is the exec'd sleep, which never reaps
    // it (a child that ended before the exec could be reaped by sh: the test once waited 10 s).
    let mut parent =
        Command::new("sh").args(["-c", "sleep 1 & echo $!; exec sleep 30"]).stdout(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(parent.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let zombie = line.trim().to_string();
    wait_for(10, "the child to become a zombie", || {
        let stat = std::fs::read_to_string(format!("/proc/{zombie}/stat")).ok()?;
        (stat.rsplit(')').next()?.split_whitespace().next()? == "Z").then_some(())
    });
    let outcome = memprof(&["attach", "-p", &zombie]);
    let _ = parent.kill();
    let _ = parent.wait();
    assert_one_line_error(&outcome, &format!("pid {zombie} is a zombie: it has exited"));
}

/// perf, strace and gdb's `-p PID`, `-o FILE`, and `run CMD ARGS` without `--`: the command's
/// own flags are the command's.
#[test]
fn short_flags_and_a_command_without_dashes() {
    let path = std::env::temp_dir().join(format!("memprof-short-{}.json", std::process::id()));
    let out = Command::new(memprof_bin())
        .args(["run", "--json", "-o", path.to_str().unwrap(), "sh", "-c", "exit 3"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "sh got -c: {}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.lines().last().unwrap().contains("\"final\":true"), "{text}");

    let mut target = Waiting::start(&fixture("lifecycle"), &["reuse"]);
    let out = Command::new(memprof_bin())
        .args(["attach", "-p", &target.pid().to_string(), "--duration", "0.5", "--json", "-o"])
        .arg(&path)
        .output()
        .unwrap();
    target.go();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let last: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(last["pid"], target.pid());
}

/// `attach ... | head -1` and `completions ... | head -1`: once the reader has gone, memprof ends
/// at once, quietly, with 0 (an attach without --duration would otherwise trace on unread).
#[test]
fn a_closed_pipe_ends_memprof_quietly() {
    let target = Waiting::start(&fixture("lifecycle"), &["reuse"]);
    for args in [&["attach", "-p", &target.pid().to_string(), "--interval", "0.2"][..], &["completions", "bash"]] {
        let mut memprof =
            Command::new(memprof_bin()).args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        let mut first = String::new();
        BufReader::new(memprof.stdout.take().unwrap()).read_line(&mut first).unwrap();
        assert!(!first.is_empty(), "{args:?} printed nothing");
        let status = wait_for(20, "memprof to end once its reader has gone", || memprof.try_wait().unwrap());
        let mut stderr = String::new();
        memprof.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
        assert!(status.success(), "{args:?}: {status}: {stderr}");
        assert!(!stderr.contains("error") && !stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

#[test]
fn version_help_and_completions_come_from_the_cli() {
    let git = Command::new("git").args(["rev-parse", "--short=12", "HEAD"]).output().unwrap();
    let commit = String::from_utf8(git.stdout).unwrap().trim().to_string();
    let version = memprof(&["--version"]);
    assert!(version.status.success());
    assert_eq!(version.stdout.trim(), format!("memprof {} (commit {commit})", env!("CARGO_PKG_VERSION")));
    let help = memprof(&["--help"]);
    assert!(help.stdout.contains("Examples:\n  memprof attach -p 1234"), "{}", help.stdout);
    for sub in ["attach", "run", "daemon"] {
        let help = memprof(&[sub, "--help"]);
        assert!(help.stdout.contains(&format!("Examples:\n  memprof {sub} ")), "{sub}: {}", help.stdout);
    }
    let bash = memprof(&["completions", "bash"]);
    assert!(bash.stdout.contains("--follow-forks") && bash.stdout.contains("complete -F _memprof"), "{}", bash.stdout);
}

/// What bash's completion of `memprof WORDS...` offers for the last word, as bash asks it: the
/// script sourced, the function it registered called with COMP_WORDS and COMP_CWORD set.
fn bash_completes(words: &[&str]) -> Vec<String> {
    let script = std::env::temp_dir().join(format!("memprof-completion-{}.bash", std::process::id()));
    std::fs::write(&script, memprof(&["completions", "bash"]).stdout).unwrap();
    let ask = r#"source "$0"
function=$(complete -p memprof | sed -E 's/.* -F ([^ ]+) .*/\1/')
COMP_WORDS=(memprof "$@"); COMP_CWORD=$#
"$function" memprof "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"
printf '%s\n' "${COMPREPLY[@]}""#;
    let out = Command::new("bash").args(["-c", ask]).arg(&script).args(words).output().unwrap();
    let _ = std::fs::remove_file(&script);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().lines().map(str::to_string).collect()
}

/// `memprof attach -p <TAB>` offers the ids of running processes (this test's own among them),
/// those that start with what is typed; the other words complete as clap says.
#[test]
fn bash_completes_pids_for_p_and_options_for_the_rest() {
    let own = std::process::id().to_string();
    let prefix = &own[..own.len() - 1];
    for option in ["-p", "--pid"] {
        for sub in ["attach", "daemon", "snapshot", "inspect"] {
            let offered = bash_completes(&[sub, option, ""]);
            assert!(offered.contains(&own), "{sub} {option}: {offered:?}");
            assert!(offered.contains(&"1".to_string()), "{sub} {option}: {offered:?}");
        }
        let offered = bash_completes(&["attach", option, prefix]);
        assert!(offered.contains(&own), "{offered:?}");
        assert!(offered.iter().all(|pid| pid.starts_with(prefix) && pid.parse::<u32>().is_ok()), "{offered:?}");
    }
    assert_eq!(bash_completes(&["attach", "--dur"]), ["--duration"]);
    assert_eq!(bash_completes(&["attach", "-p", &own, "--follow-f"]), ["--follow-forks"]);
    // `report` has no -p: nothing is made up for it.
    assert!(!bash_completes(&["report", "-p", ""]).contains(&own));
}

/// A library with no code of its own (ICU's data) has an empty .eh_frame: no notice for it.
#[test]
fn a_data_only_library_is_not_a_missing_unwind_table() {
    let library = fixture_lib("data_only.c", "libmemprof_data_only.so", &["-DLIBRARY"]);
    let dir = library.parent().unwrap().to_str().unwrap().to_string();
    let program = fixture_with(
        "data_only.c",
        "data_only",
        &["-g", "-O0", &format!("-L{dir}"), "-Wl,--no-as-needed", "-lmemprof_data_only", &format!("-Wl,-rpath,{dir}")],
    );
    let outcome = run(&[], &[program.to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    assert!(!outcome.stderr.contains("eh_frame"), "{}", outcome.stderr);
    assert_eq!(site(&outcome.final_report(), "data_site"), (320, 5));
}

#[test]
fn a_command_that_does_not_exist() {
    let outcome = memprof(&["run", "--", "/no/such/program"]);
    assert_one_line_error(&outcome, "cannot start /no/such/program: no such file");
    let outcome = memprof(&["run", "--", "/etc/passwd"]);
    assert_one_line_error(&outcome, "cannot start /etc/passwd: not executable: give it the execute permission");
    let outcome = memprof(&["run", "--", "/tmp"]);
    assert_one_line_error(&outcome, "cannot start /tmp: a directory, not a program");
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
        &["run", "--record", "/tmp/memprof-same-file", "-o", "/tmp/memprof-same-file", "--", "true"],
        // Refused once the other flags are known.
        &["snapshot", "-p", "1", "-o", "/tmp/memprof-snapshot.txt"],
        &["snapshot", "-p", "1", "--daemon", "ftp://localhost", "-o", "/tmp/memprof-snapshot.json"],
        &["snapshot", "-p", "1", "--daemon", "http://192.0.2.1:9464", "-o", "/tmp/memprof-snapshot.json"],
        &["report", "--flame", "bytes", "--format", "json", "/dev/null"],
        &["report", "--flame", "peak", "--at", "3", "/dev/null"],
        &["report", "--flame", "allocations", "--at", "peak", "/dev/null"],
        &["report", "--gen-suppressions", "--format", "json", "/dev/null"],
        &["daemon", "--all", "--listen", "bogus"],
    ] {
        let outcome = memprof(args);
        assert_eq!(outcome.status.code(), Some(2), "{args:?}: {outcome:?}");
        assert!(!outcome.stderr.contains("panicked"));
        assert_eq!(outcome.stderr.lines().count(), 1, "{args:?}: one line: {}", outcome.stderr);
    }
}

/// Each refused value is one line naming its flag and what it takes.
#[test]
fn a_refused_value_names_its_flag_in_one_line() {
    for (args, said) in [
        (
            &["attach", "-p", "9", "--max-live", "4294967295"][..],
            "'--max-live <MAX_LIVE>': `4294967295` is not a whole number of entries from 1 to 134217728",
        ),
        (
            &["attach", "-p", "9", "--min-bytes", "1MB"],
            "'--min-bytes <BYTES>': `1MB` is not a whole number of bytes from 0",
        ),
        (&["attach", "-p", "0"], "'--pid <PID>': `0` is not a process id (a whole number from 1 to 4194304)"),
        (&["attach", "-p", "-5"], "'--pid <PID>': `-5` is not a process id"),
        (&["attach", "-p", "9", "--duration", "-1"], "'--duration <DURATION>': `-1` is not a number of seconds"),
        (&["attach", "-p", "9", "--duration", "1e309"], "'--duration <DURATION>': `1e309` is not a number of seconds"),
        (
            &["run", "--fail-on-leak-bytes", "-1", "true"],
            "'--fail-on-leak-bytes <BYTES>': `-1` is not a whole number of bytes",
        ),
        (
            &["daemon", "--all", "--max-frames", "200"],
            "'--max-frames <MAX_FRAMES>': `200` is not a whole number of frames from 1 to 127",
        ),
        (&["attach", "-p", "9", "--top", "-1"], "'--top <TOP>': `-1` is not a positive number of stacks"),
        (
            &["attach", "-p", "9", "--max-rate", "-1"],
            "'--max-rate <N|off>': `-1` is neither a number of calls a second",
        ),
        (&["attach", "-p", "9", "--sample-bytes", "-1"], "'--sample-bytes <N>': `-1` is not a number of bytes"),
        (
            &["daemon", "--all", "--leak-window", "-1"],
            "'--leak-window <LEAK_WINDOW>': `-1` is not a number of intervals",
        ),
        (
            &["attach", "-p", "9", "--leak-threshold", "-0.5"],
            "'--leak-threshold <LEAK_THRESHOLD>': `-0.5` is not a score",
        ),
        (&["report", "--at", "-3", "/dev/null"], "'--at <peak|final|SECONDS>': `-3` is not a number of seconds"),
        (
            &["attach", "-p", "9", "--interval", "1e-9"],
            "'--interval <INTERVAL>': `0.000000001` is not an interval from 0.1",
        ),
        (&["daemon", "--all", "--interval", "0.01"], "'--interval <INTERVAL>': `0.01` is not an interval from 0.1"),
    ] {
        let outcome = memprof(args);
        assert_eq!(outcome.status.code(), Some(2), "{args:?}: {outcome:?}");
        assert_eq!(outcome.stderr.lines().count(), 1, "{args:?}: {}", outcome.stderr);
        assert!(outcome.stderr.starts_with("memprof: error: invalid value"), "{}", outcome.stderr);
        assert!(outcome.stderr.contains(said), "{args:?}: {}", outcome.stderr);
    }
}

/// A script runs its interpreter: `run` finds the allocator there (`#!/usr/bin/env sh` included)
/// and follows the exec into the program the script starts. A script without `#!` runs under
/// `/bin/sh`, as a shell runs it.
#[test]
fn a_script_is_run_through_its_interpreter() {
    let script = std::env::temp_dir().join(format!("memprof-script-{}.sh", std::process::id()));
    let program = fixture("reports");
    for first_line in ["#!/usr/bin/env sh\n", ""] {
        std::fs::write(&script, format!("{first_line}exec {}\n", program.display())).unwrap();
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let outcome = run(&[], &[script.to_str().unwrap()]);
        assert!(outcome.status.success(), "{first_line:?}: {outcome:?}");
        let report = outcome.final_report();
        assert!(report["totals"]["allocations"].as_u64().unwrap() > 0, "{report}");
        assert_eq!(report["comm"], "reports", "{report}");
        // Each exec of the chain is handled, but the program is named once.
        assert_eq!(outcome.stderr.matches("(reports) runs ").count(), 1, "{}", outcome.stderr);
    }
    std::fs::remove_file(&script).unwrap();
}
