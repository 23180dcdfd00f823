//! The price of tracing, said after a process's first second traced, and `attach`'s default
//! `--max-rate`, which samples a busy process unless told `--max-rate off`. The cost itself is
//! the benchmarks' to measure: these check what is said, not how fast anything runs.

use std::{
    io::Read as _,
    path::Path,
    process::{Command, Stdio},
};

use memprof_tests::{
    attach, fixture, fixture_musl, fixture_musl_unnamed_mmap, memprof_bin, released, released_when, run, through,
    total, Marker, Waiting,
};

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

/// How long a busy loop runs: a second traced by its calls, a second sampled, the move to growth
/// mode, which loads its programs (a second and a half on this project's VM, over two while the
/// other tests run), and time to spare.
const BUSY: &str = "--seconds=6";

/// `memprof attach ARGS --json --interval 60` to the loop run with `loop_args` for `BUSY`.
fn attach_to_the_busy_loop(loop_args: &[&str], args: &[&str]) -> (String, memprof_tests::Outcome) {
    attach_to_a_busy_loop(&fixture("malloc_loop"), loop_args, args)
}

/// `attach_to_the_busy_loop` with `program`, a build of `malloc_loop.c`.
fn attach_to_a_busy_loop(program: &Path, loop_args: &[&str], args: &[&str]) -> (String, memprof_tests::Outcome) {
    let mut command = Command::new(program);
    command.args(["--wait", BUSY]).args(loop_args);
    attach_to_a_busy_command(command, args)
}

/// `attach_to_a_busy_loop` with the loop started by `command`, which gives it `--wait`.
fn attach_to_a_busy_command(command: Command, args: &[&str]) -> (String, memprof_tests::Outcome) {
    let mut target = Waiting::start_command(command);
    let pid = target.pid().to_string();
    let mut memprof = Command::new(memprof_bin());
    memprof.args(["attach", "--pid", &pid, "--json", "--interval", "60"]).args(args).stdin(Stdio::null());
    let outcome = released(memprof, &[format!("memprof: tracing pid {pid} ")], |_| target.go());
    assert!(outcome.status.success(), "{outcome:?}");
    (pid, outcome)
}

/// `attach ARGS` to the loop `program` (`malloc_loop.c`) run with `--until-stop`: it runs until
/// memprof has said what the price of sampling it makes it do, since a loop that ended first
/// would leave a move to its pages half made, and unsaid. With `then_exec`, the loop then execs
/// that program with its arguments (`--exec`; they include `--wait`), which goes once memprof
/// says it runs.
fn attach_until_the_price_is_acted_on(
    program: &Path,
    args: &[&str],
    then_exec: Option<(&Path, &[&str])>,
) -> (String, memprof_tests::Outcome) {
    let mut loop_args = vec!["--until-stop"];
    if let Some((exec, exec_args)) = then_exec {
        loop_args.extend(["--exec", exec.to_str().unwrap()]);
        loop_args.extend(exec_args);
    }
    let mut target = Waiting::start(program, &loop_args);
    let pid = target.pid().to_string();
    let mut memprof = Command::new(memprof_bin());
    memprof.args(["attach", "--pid", &pid, "--json", "--interval", "60"]).args(args).stdin(Stdio::null());
    let tracing = format!("memprof: tracing pid {pid} ");
    let exec_runs = then_exec.map(|(exec, _)| {
        let name = exec.file_name().unwrap().to_string_lossy();
        format!("memprof: pid {pid} ({name}) runs ")
    });
    let is_tracing = |line: &str| line.starts_with(&tracing);
    let is_acted_on = |line: &str| acted_on(line, &pid);
    let is_exec_running = |line: &str| exec_runs.as_ref().is_some_and(|runs| line.starts_with(runs));
    let mut markers: Vec<Marker> =
        vec![("tracing", &is_tracing), ("what sampling's price made memprof do", &is_acted_on)];
    if then_exec.is_some() {
        markers.push(("the exec'd program runs", &is_exec_running));
    }
    let mut said = 0;
    let outcome = released_when(memprof, &markers, |_| {
        said += 1;
        if said == 2 {
            target.stop()
        } else {
            target.go()
        }
    });
    assert!(outcome.status.success(), "{outcome:?}");
    (pid, outcome)
}

/// Whether `line` says what memprof does about sampling `pid` costing what it does: moves it,
/// keeps it sampled (saying why), or nothing, at a price below the move's.
fn acted_on(line: &str, pid: &str) -> bool {
    let Some(rest) = line.strip_prefix(&format!("memprof: pid {pid} ")) else { return false };
    rest.starts_with("costs more than a tenth of a core even sampled: ")
        || rest.starts_with("stays sampled: ")
        || rest.starts_with("could not be moved to growth mode: ")
        || sampled_price_of(line, pid).is_some_and(|(_, added)| added < 0.11)
}

/// The CPU seconds a second the price line said once `pid` was sampled.
fn sampled_price(stderr: &str, pid: &str) -> (String, f64) {
    stderr
        .lines()
        .find_map(|line| sampled_price_of(line, pid))
        .unwrap_or_else(|| panic!("no price line once sampled: {stderr}"))
}

/// `line`'s sampled price for `pid`, if it is one.
fn sampled_price_of(line: &str, pid: &str) -> Option<(String, f64)> {
    let sampled = line.strip_prefix(&format!("memprof: pid {pid} makes about "))?;
    let added = sampled
        .split_once("(estimated from the samples); sampling them adds about ")
        .and_then(|(_, rest)| rest.split_once(" s of CPU a second"))
        .and_then(|(seconds, _)| seconds.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("not a sampled price: {sampled}"));
    Some((sampled.to_string(), added))
}

/// The line that says `pid` is moved to its pages, if any.
fn moved_line<'a>(stderr: &'a str, pid: &str) -> Option<&'a str> {
    let prefix = format!("memprof: pid {pid} costs more than a tenth of a core even sampled: ");
    stderr.lines().find(|line| line.starts_with(&prefix))
}

/// Whether `pid` was kept sampled for the other processes' sake: this machine's kernel refuses
/// `fexit` programs, and growth mode would slow every system call on it.
fn kept_for_the_host(stderr: &str, pid: &str) -> bool {
    stderr.lines().any(|line| {
        line == format!(
            "memprof: pid {pid} stays sampled: growth mode would slow every system call on this host: its kernel \
             refuses fexit programs and the process maps memory through no wrapper memprof can probe (docs: \
             reference/limits.md#mappings); --growth traces it by its pages all the same"
        )
    })
}

/// A second after the switch, what sampling costs is said too. Above a tenth of a core, `attach`
/// moves the process on to its pages, unless that would slow every other process's system calls:
/// where the kernel refuses `fexit` programs (as this project's VM's), growth mode reads a
/// process's mapping calls at its own wrappers of them (its C library's, a static program's
/// copy), and a program whose wrappers memprof cannot find has none to read them at. Above a
/// twentieth, it names growth mode. Where the kernel takes `fexit` programs, the three loops are
/// moved alike: the dynamic one alone is run there.
#[test]
fn attach_samples_a_busy_process_then_traces_its_pages_and_says_how_not_to() {
    let mut loops = vec![(fixture("malloc_loop"), true)];
    if memprof_tests::kernel_refuses_fexit() {
        let flags = ["-g", "-O0", "-fno-omit-frame-pointer"];
        loops.push((fixture_musl("malloc_loop.c", "price_static_loop", &flags), true));
        loops.push((fixture_musl_unnamed_mmap("malloc_loop.c", "price_unnamed_mmap_loop", &flags), false));
    }
    for (program, has_wrappers) in loops {
        let (pid, outcome) = attach_until_the_price_is_acted_on(&program, &[], None);
        let kept = kept_for_the_host(&outcome.stderr, &pid);
        assert!(!(kept && has_wrappers), "its own wrappers read its mapping calls: {}", outcome.stderr);
        says_the_price_and_moves_or_keeps_it(&pid, &outcome);
    }
}

/// What `attach_samples_a_busy_process_then_traces_its_pages_and_says_how_not_to` asserts of
/// each busy loop, `pid`.
fn says_the_price_and_moves_or_keeps_it(pid: &str, outcome: &memprof_tests::Outcome) {
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
    let (sampled, added) = sampled_price(&outcome.stderr, pid);
    let moved = moved_line(&outcome.stderr, pid);
    let report = outcome.final_report();
    // The line rounds to hundredths.
    if added >= 0.11 && kept_for_the_host(&outcome.stderr, pid) {
        // `cargo xtask kernels` says so of Debian's kernels, which take them.
        assert!(std::env::var_os("MEMPROF_TEST_FEXIT").is_none(), "they take fexit programs: {}", outcome.stderr);
        // Found out without attaching the program at every system call, whose attach says this.
        assert!(!outcome.stderr.contains("this kernel refuses fexit programs ("), "{}", outcome.stderr);
        assert!(moved.is_none(), "{}", outcome.stderr);
        assert!(!sampled.contains("--growth"), "the next line names it: {sampled}");
        assert_eq!(report["sample_bytes"], 65536, "{report}");
        assert!(report["growth"].is_null(), "{report}");
    } else if added >= 0.11 {
        let moved = moved.unwrap_or_else(|| panic!("not moved at {added} s a second: {}", outcome.stderr));
        assert!(
            moved.ends_with(
                "traced by the pages its heap first touches from now on (growth mode, as --growth), its calls' \
                 records dropped; --sample-bytes 65536 keeps it sampled, --max-rate off records every call"
            ),
            "{moved}"
        );
        assert!(!sampled.contains("--growth"), "the move is said instead: {sampled}");
        assert!(report["growth"].is_object(), "{report}");
        assert_eq!(report["sample_bytes"], 0, "{report}");
    } else if added <= 0.09 {
        assert!(moved.is_none() && !kept_for_the_host(&outcome.stderr, pid), "{}", outcome.stderr);
        assert_eq!(report["sample_bytes"], 65536, "{report}");
        if added >= 0.06 {
            assert!(sampled.ends_with("; --growth (heap growth by page, any rate) costs nearly nothing"), "{sampled}");
        } else if added <= 0.04 {
            assert!(!sampled.contains("--growth"), "{sampled}");
        }
    }
}

/// A double free found before `attach` samples a busy process, then moves it to its pages,
/// stays in its report: the move drops what its calls hold, not what they found. Sampled or
/// moved (on this project's VM, moved), the one double free is there. mimalloc, preloaded, does
/// not abort on it.
#[test]
fn a_double_free_found_before_the_move_to_pages_stays_in_the_report() {
    let mut command = Command::new(fixture("malloc_loop"));
    command.args(["--wait", BUSY, "--double-free"]);
    command.env("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libmimalloc.so.2.0");
    let (pid, outcome) = attach_to_a_busy_command(command, &[]);
    assert!(outcome.stderr.contains("more than --max-rate"), "not sampled: {}", outcome.stderr);
    let report = outcome.final_report();
    let double_frees = report["double_frees"].as_array().expect("double_frees");
    let [double_free] = &double_frees[..] else { panic!("one double free: {report}") };
    assert_eq!(double_free["size"], 4096, "{double_free}");
    for which in ["alloc", "first_free", "second_free"] {
        assert_eq!(double_free[which]["frames"][0]["function"], "free_twice", "{which}: {double_free}");
    }
    let moved = moved_line(&outcome.stderr, &pid).is_some();
    assert_eq!(report["growth"].is_object(), moved, "{report}");
}

/// Sampling chosen by a `--max-rate` given, or kept for `--inspect`, which needs the blocks, is
/// not moved from whatever it costs.
#[test]
fn sampling_asked_for_or_inspected_stays_sampling() {
    for args in [&["--max-rate", "50000"][..], &["--inspect", "--duration", "3"]] {
        let (pid, outcome) = attach_to_the_busy_loop(&[], args);
        assert!(outcome.stderr.contains("more than --max-rate"), "{args:?}: {}", outcome.stderr);
        sampled_price(&outcome.stderr, &pid);
        let considered = moved_line(&outcome.stderr, &pid).is_some() || kept_for_the_host(&outcome.stderr, &pid);
        assert!(!considered, "{args:?}: {}", outcome.stderr);
        let report = outcome.final_report();
        assert_eq!(report["sample_bytes"], 65536, "{args:?}: {report}");
        assert!(report["growth"].is_null(), "{args:?}: {report}");
    }
}

/// A process moved to its pages stays so through an exec: its new program is traced by the pages
/// it touches from its start. With `--mappings`, whose programs run for every process already,
/// the move is made whatever the kernel. `growth` keeps 100 blocks of 64 KiB in `leak_pages`,
/// written whole; its pages are those, give or take the pages its blocks share with others (a
/// page or two of block headers).
#[test]
fn a_process_moved_to_its_pages_is_traced_by_them_after_an_exec() {
    const LEAKED: u64 = 100 * 64 * 1024;
    const SLACK: u64 = 3 * 4096;
    let growth = fixture("growth");
    let then_exec = Some((growth.as_path(), &["--wait"][..]));
    let (pid, outcome) = attach_until_the_price_is_acted_on(&fixture("malloc_loop"), &["--mappings"], then_exec);
    let (_, added) = sampled_price(&outcome.stderr, &pid);
    if moved_line(&outcome.stderr, &pid).is_none() {
        // Sampling was cheap enough on this machine's traps.
        assert!(added < 0.11, "not moved at {added} s a second: {}", outcome.stderr);
        return;
    }
    let report = outcome.final_report();
    assert!(report["exe"].as_str().is_some_and(|exe| exe.ends_with("/growth")), "{report}");
    assert!(report["growth"].is_object(), "{report}");
    let (leaked, _) = through(&report, "leak_pages");
    assert!((LEAKED - SLACK..=LEAKED + SLACK).contains(&leaked), "leak_pages holds {leaked} bytes: {report}");
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
