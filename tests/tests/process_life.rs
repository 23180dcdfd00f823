//! Process life under real probes: a traced process that execs another program (dynamic or
//! static) is re-probed and its report describes the new program only; children are followed.

use std::{
    io::{BufRead, BufReader, Write},
    process::{Child, Command, Stdio},
};

use memprof_tests::{fixture, fixture_with, memprof_bin, run, site, total, Outcome};
use serde_json::Value;

fn dynamic() -> String {
    fixture("process_life").display().to_string()
}

fn static_binary() -> String {
    let flags = ["-static", "-g", "-O0", "-fno-omit-frame-pointer"];
    fixture_with("process_life.c", "process_life_static", &flags).display().to_string()
}

/// `memprof ARGS`, writing "go" to its stdin (which the command inherits) once its stderr has
/// shown a line containing `after`.
fn run_released(args: &[&str], after: &str) -> Outcome {
    let mut memprof = Command::new(memprof_bin());
    memprof.args(args).stdin(Stdio::piped());
    released(memprof, &[after.to_string()], |memprof| {
        memprof.stdin.as_mut().expect("piped").write_all(b"go\n").expect("releasing the fixture");
    })
}

/// Runs `memprof`; each time its stderr shows a line containing the next of `markers`, calls
/// `release`. Returns once memprof has exited.
fn released(mut memprof: Command, markers: &[String], mut release: impl FnMut(&mut Child)) -> Outcome {
    let mut memprof = memprof.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("starting memprof");
    let stdout = memprof.stdout.take().expect("piped");
    let reader = std::thread::spawn(move || std::io::read_to_string(stdout).unwrap_or_default());
    let mut stderr = BufReader::new(memprof.stderr.take().expect("piped"));
    let mut seen = String::new();
    for marker in markers {
        loop {
            let mut line = String::new();
            assert!(
                stderr.read_line(&mut line).expect("reading stderr") > 0,
                "memprof ended before `{marker}`: {seen}"
            );
            seen.push_str(&line);
            if line.contains(marker.as_str()) {
                break;
            }
        }
        release(&mut memprof);
    }
    let rest = std::io::read_to_string(stderr.into_inner()).unwrap_or_default();
    let status = memprof.wait().expect("waiting for memprof");
    Outcome { status, stdout: reader.join().expect("stdout reader"), stderr: seen + &rest }
}

fn children(report: &Value) -> &Vec<Value> {
    report["children"].as_array().unwrap_or_else(|| panic!("no children in {report}"))
}

#[test]
fn after_exec_into_a_dynamic_program_the_report_holds_the_new_program_only() {
    let program = dynamic();
    let outcome = run(&[], &[&program, "exec", &program, "new-image"]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert_eq!(site(&report, "new_image_alloc"), (7 * 512, 7), "{report}");
    assert_eq!(site(&report, "old_image_alloc"), (0, 0), "the old program's blocks are gone: {report}");
    assert_eq!(total(&report, "outstanding_bytes"), 7 * 512);
    assert_eq!(total(&report, "unknown_frees"), 0);
    assert!(outcome.stderr.contains("runs "), "the exec is announced: {}", outcome.stderr);
}

#[test]
fn after_exec_into_a_static_binary_its_own_allocator_is_probed() {
    let (program, target) = (dynamic(), static_binary());
    let outcome = run(&[], &[&program, "exec", &target, "new-image"]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert_eq!(site(&report, "new_image_alloc"), (7 * 512, 7), "{report}");
    assert_eq!(site(&report, "old_image_alloc"), (0, 0), "{report}");
    assert_eq!(report["comm"], "process_life_st", "the comm is the new program's");
    assert_eq!(report["exe"], target.as_str());
    assert!(outcome.stderr.contains(&format!("probes in {target}")), "{}", outcome.stderr);
}

#[test]
fn attach_follows_an_exec() {
    let program = dynamic();
    let mut target =
        memprof_tests::Waiting::start(&fixture("process_life"), &["exec", &program, "--wait", "new-image"]);
    let pid = target.pid().to_string();
    // The first "go" goes to the fixture once memprof traces it, the second once memprof has
    // probed the program it exec'd (which says "ready" again and waits).
    let mut memprof = Command::new(memprof_bin());
    memprof.args(["attach", "--pid", &pid, "--json", "--interval", "0.2"]);
    let markers = [format!("memprof: tracing pid {pid} "), format!("memprof: pid {pid} (")];
    let outcome = released(memprof, &markers, |_| target.go());
    let report = outcome.final_report();
    assert_eq!(site(&report, "new_image_alloc"), (7 * 512, 7), "{report}");
    assert_eq!(site(&report, "old_image_alloc"), (0, 0), "{report}");
    assert_eq!(report["exe"], program.as_str());
}

#[test]
fn run_follows_a_forked_child_whose_inherited_blocks_are_unknown_to_it() {
    let program = dynamic();
    let outcome = run_released(&["run", "--json", "--", &program, "fork"], "child of pid");
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    // The parent's five blocks stay the parent's: the child's frees of its copies are not theirs.
    assert_eq!(site(&report, "parent_alloc"), (500, 5), "{report}");
    assert_eq!(total(&report, "frees"), 0);
    let child = &children(&report)[0];
    assert_eq!(child["parent"], report["pid"]);
    assert_eq!(child["exited"], true);
    assert_eq!(site(child, "child_alloc"), (3 * 64, 3), "{child}");
    assert_eq!(total(child, "unknown_frees"), 5, "the inherited blocks are unknown to the child");
    assert_eq!(total(child, "frees"), 0, "never negative, never the parent's");
    assert_eq!(report["forks"]["followed"], 1);
    assert_eq!(report["forks"]["missed"], 0);
}

#[test]
fn run_follows_no_fork_with_follow_forks_false() {
    let program = dynamic();
    let outcome = run_released(&["run", "--json", "--follow-forks=false", "--", &program, "fork"], "tracing pid");
    let report = outcome.final_report();
    assert!(report.get("children").is_none() && report.get("forks").is_none(), "{report}");
    assert_eq!(site(&report, "parent_alloc"), (500, 5));
}

#[test]
fn a_vforked_child_that_execs_is_traced_in_its_new_program() {
    let (program, target) = (dynamic(), static_binary());
    // The new program says "ready" (on stdout, left out of the reports) and waits until memprof
    // has probed it: a child that is not ptraced runs on while memprof attaches.
    let args = ["run", "--json", "--", &program, "vfork-exec", &target, "--wait", "new-image"];
    let mut outcome = run_released(&args, " runs ");
    assert!(outcome.status.success(), "{outcome:?}");
    outcome.stdout = outcome.stdout.lines().filter(|l| l.starts_with('{')).map(|l| format!("{l}\n")).collect();
    let report = outcome.final_report();
    assert_eq!(report["forks"]["followed"], 1, "{report}");
    let child = &children(&report)[0];
    assert_eq!(child["exe"], target.as_str());
    assert_eq!(site(child, "new_image_alloc"), (7 * 512, 7), "{child}");
}

#[test]
fn a_fork_storm_counts_every_child_and_leaves_the_parent_exact() {
    let program = dynamic();
    let outcome = run_released(&["run", "--json", "--", &program, "storm", "1000"], "tracing pid");
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert_eq!(site(&report, "parent_alloc"), (96, 2), "{report}");
    let forks = &report["forks"];
    let (followed, missed) = (forks["followed"].as_u64().unwrap(), forks["missed"].as_u64().unwrap());
    assert_eq!(followed + missed, 1000, "every child is followed or counted missed: {forks}");
    assert_eq!(forks["events_lost"], 0);
    // Under load every child may die before it is attached: then none is listed.
    for child in report["children"].as_array().into_iter().flatten() {
        assert!(total(child, "outstanding_bytes") <= 32, "{child}");
    }
}
