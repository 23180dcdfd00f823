//! The price of tracing, said after a process's first second traced, and `attach`'s default
//! `--max-rate`, which samples a busy process unless told `--max-rate off`. The cost itself is
//! the benchmarks' to measure: these check what is said, not how fast anything runs.

use std::{
    io::Read as _,
    process::{Command, Stdio},
};

use memprof_tests::{attach, fixture, memprof_bin, released, run, total, Waiting};

/// The loop runs this long, past its first second traced however fast the machine's traps are;
/// it says how many pairs of `malloc` and `free` it made.
const LOOP: &str = "--seconds=3";

/// The pairs the loop says it made, from its output.
fn pairs_made(output: &str) -> u64 {
    output
        .lines()
        .find_map(|line| line.strip_prefix("pairs "))
        .and_then(|pairs| pairs.parse().ok())
        .unwrap_or_else(|| panic!("the loop said no count of pairs: {output:?}"))
}

/// What the waiting loop printed, once it has ended.
fn loop_output(target: &mut Waiting) -> String {
    let mut output = String::new();
    target.child.stdout.as_mut().expect("piped").read_to_string(&mut output).expect("reading the loop");
    assert!(target.child.wait().expect("the loop").success(), "the loop failed: {output}");
    output
}

/// The calls a second the price line of `pid` says (with its thousands' commas), and the rest of
/// the line after them.
fn price_line(stderr: &str, pid: u32) -> (u64, String) {
    let prefix = format!("memprof: pid {pid} makes ");
    let line = stderr
        .lines()
        .find_map(|line| line.strip_prefix(prefix.as_str()).filter(|rest| rest.contains("allocator calls a second")))
        .unwrap_or_else(|| panic!("no price line for pid {pid}: {stderr}"));
    let (rate, rest) = line.split_once(' ').unwrap();
    (rate.replace(',', "").parse().unwrap_or_else(|_| panic!("not a rate: {line}")), rest.to_string())
}

#[test]
fn attach_says_the_price_and_with_max_rate_off_records_every_call() {
    let mut target = Waiting::start(&fixture("malloc_loop"), &[LOOP]);
    let pid = target.pid();
    // The helper gives `--max-rate off`.
    let outcome = attach(&mut target, &["--interval", "60"]);
    assert!(outcome.status.success(), "{outcome:?}");
    let (rate, rest) = price_line(&outcome.stderr, pid);
    assert!(rate > 0, "{}", outcome.stderr);
    assert!(rest.starts_with("allocator calls a second; tracing them adds about "), "{rest}");
    assert!(rest.contains("(its system time went from "), "measured before attaching: {rest}");
    assert!(!outcome.stderr.contains("more than --max-rate"), "{}", outcome.stderr);
    let report = outcome.final_report();
    assert_eq!(report["sample_bytes"], 0, "{report}");
    let pairs = pairs_made(&loop_output(&mut target));
    assert_eq!(total(&report, "allocations"), pairs, "{report}");
    assert_eq!(total(&report, "frees"), pairs, "{report}");
}

/// A second after the switch, what sampling costs is said too, with growth mode named when that
/// is worth saving.
#[test]
fn attach_samples_a_busy_process_by_default_and_says_how_not_to() {
    // A second traced by its calls, a second sampled, and time to spare.
    let mut target = Waiting::start(&fixture("malloc_loop"), &["--seconds=4"]);
    let pid = target.pid().to_string();
    let mut memprof = Command::new(memprof_bin());
    memprof.args(["attach", "--pid", &pid, "--json", "--interval", "60"]).stdin(Stdio::null());
    let outcome = released(memprof, &[format!("memprof: tracing pid {pid} ")], |_| target.go());
    assert!(outcome.status.success(), "{outcome:?}");
    let switch = outcome
        .stderr
        .lines()
        .find(|line| line.contains("more than --max-rate 50000 (the default)"))
        .unwrap_or_else(|| panic!("no switch line: {}", outcome.stderr));
    assert!(switch.starts_with(&format!("memprof: pid {pid} makes ")), "{switch}");
    assert!(
        switch.ends_with("sampling one in every 65536 bytes from now on; --max-rate off records every call"),
        "{switch}"
    );
    let (rate, rest) = price_line(&outcome.stderr, pid.parse().unwrap());
    assert!(rate > 50_000, "{}", outcome.stderr);
    assert!(!rest.contains("--sample-bytes"), "memprof samples it already: {rest}");
    let sampled = outcome
        .stderr
        .lines()
        .find_map(|line| line.strip_prefix(&format!("memprof: pid {pid} makes about ")))
        .unwrap_or_else(|| panic!("no price line once sampled: {}", outcome.stderr));
    let added = sampled
        .split_once("(estimated from the samples); sampling them adds about ")
        .and_then(|(_, rest)| rest.split_once(" s of CPU a second"))
        .and_then(|(seconds, _)| seconds.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("not a sampled price: {sampled}"));
    // Named above a twentieth of a core (the line rounds to hundredths).
    if added >= 0.06 {
        assert!(sampled.ends_with("; --growth (heap growth by page, any rate) costs nearly nothing"), "{sampled}");
    } else if added <= 0.04 {
        assert!(!sampled.contains("--growth"), "{sampled}");
    }
    assert_eq!(outcome.final_report()["sample_bytes"], 65536);
}

#[test]
fn run_says_the_price_of_its_command() {
    // The loop prints its time on stdout: the report goes to a file.
    let path = std::env::temp_dir().join(format!("memprof-price-{}.json", std::process::id()));
    let path_arg = path.to_str().unwrap();
    let outcome = run(&["--interval", "60", "-o", path_arg], &[fixture("malloc_loop").to_str().unwrap(), LOOP]);
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    let _ = std::fs::remove_file(&path);
    assert!(outcome.status.success(), "{outcome:?}");
    let report: serde_json::Value = serde_json::from_str(text.lines().last().expect("a report")).unwrap();
    assert_eq!(report["final"], true, "{report}");
    let pid = report["pid"].as_u64().unwrap() as u32;
    let (rate, rest) = price_line(&outcome.stderr, pid);
    assert!(rate > 0, "{}", outcome.stderr);
    assert!(
        rest.starts_with("allocator calls a second; tracing them costs it about ")
            && rest.contains(" s of CPU a second (not measured before tracing: its system time, "),
        "{rest}"
    );
    // `run` records every call unless asked otherwise.
    assert_eq!(report["sample_bytes"], 0, "{report}");
    assert_eq!(total(&report, "allocations"), pairs_made(&outcome.stdout), "{report}");
}

#[test]
fn max_rate_is_a_number_or_off() {
    let outcome = memprof_tests::memprof(&["attach", "-p", "1", "--max-rate", "fast"]);
    assert_eq!(outcome.status.code(), Some(2), "{outcome:?}");
    assert!(
        outcome.stderr.contains("`fast` is neither a number of calls a second (at least 1) nor `off`"),
        "{}",
        outcome.stderr
    );
}
