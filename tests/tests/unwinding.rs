//! DWARF (.eh_frame) unwinding in the kernel: code built like distribution code, without frame
//! pointers, must give whole stacks, from the allocating function through every caller to the
//! thread's outermost frame (`clone3` for a thread, `_start` for main), with exact bytes per site.
//!
//! Frames are matched by function name: exactly, or with a C++ parameter list after it
//! (`open_session` matches `open_session(int)`), or with a Rust hash after it; `name*` matches a
//! prefix (`__libc_start_main*`: glibc's symbol has several aliases) and `*name` a suffix.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    path::Path,
    process::{Command, Stdio},
};

use memprof_tests::{
    assert_nothing_dropped, fixture_cpp, fixture_lib, fixture_musl, fixture_rust, fixture_with, memprof_bin, run, site,
    total, wait_for, Daemon, Outcome, Waiting,
};
use serde_json::Value;

/// Like distribution code: optimized, with debug info, no frame pointers (gcc's default at -O2 on
/// x86_64, said explicitly).
const C_FLAGS: &[&str] = &["-O2", "-g", "-fomit-frame-pointer", "-pthread"];
/// A release build, frame pointers explicitly off.
const RUST_FLAGS: &[&str] = &["-C", "opt-level=3", "-g", "-C", "force-frame-pointers=no", "--edition", "2021"];

/// The outermost frames below main, as glibc 2.36 (Debian 12) lays them out (see `gdb bt` with
/// `set backtrace past-main on`): `_start` is the entry point, its CFI marks the return address
/// undefined, so the walk ends there.
const MAIN_TAIL: [&str; 4] = ["main", "__libc_start_call_main", "__libc_start_main*", "_start"];
/// Debian's LLVM 14 (`libllvm14`, installed by `cargo xtask setup`): 110 MB, 48 MB of code.
const LLVM: &str = "/usr/lib/x86_64-linux-gnu/libLLVM-14.so.1";
/// The outermost frames of a pthread: clone3's CFI marks the child's return address undefined.
const THREAD_TAIL: [&str; 2] = ["start_thread", "clone3"];

/// The counters that say a stack was cut short or not kept.
const STACK_DROPS: [&str; 7] = [
    "unwind_no_table",
    "deferred_walk_lost",
    "unwind_bad_rule",
    "unwind_read_failed",
    "stack_too_deep",
    "stack_collision",
    "stack_table_full",
];

fn path(p: &Path) -> &str {
    p.to_str().expect("UTF-8 path")
}

/// `memprof run --json --interval 3600 -- COMMAND`: only the final report, after the command exits.
fn run_to_end(command: &[&str]) -> Value {
    let outcome: Outcome = run(&["--interval", "3600"], command);
    assert!(outcome.status.success(), "{command:?} failed under memprof: {outcome:?}");
    outcome.final_report()
}

/// `run_to_end` for a fixture started with `--wait`: released after its "ready" and the next
/// interval report, whose refresh has read its mappings, so that its walks use the tables.
fn run_once_tables_are_read(command: &[&str]) -> Value {
    let mut memprof = Command::new(memprof_bin())
        .args(["run", "--json", "--interval", "0.2", "--"])
        .args(command)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting memprof");
    let mut lines = BufReader::new(memprof.stdout.take().expect("piped")).lines();
    let mut next = || lines.next().expect("memprof's output ended early").expect("reading memprof's output");
    while next() != "ready" {}
    while !next().starts_with('{') {}
    memprof.stdin.as_mut().expect("piped").write_all(b"go\n").expect("releasing the fixture");
    let rest: Vec<String> = std::iter::from_fn(|| lines.next()).map_while(Result::ok).collect();
    let status = memprof.wait().expect("memprof's end");
    assert!(status.success(), "{command:?} failed under memprof: {status:?}");
    let last = rest.iter().rev().find(|line| line.starts_with('{')).expect("a final report");
    serde_json::from_str(last).expect("JSON")
}

fn dropped(report: &Value, reason: &str) -> u64 {
    report["dropped"][reason].as_u64().unwrap_or_else(|| panic!("dropped.{reason} missing in {report}"))
}

fn stacks(report: &Value) -> &Vec<Value> {
    report["stacks"].as_array().expect("stacks is an array")
}

fn frames(stack: &Value) -> &Vec<Value> {
    stack["frames"].as_array().expect("frames is an array")
}

fn function(frame: &Value) -> &str {
    frame["function"].as_str().expect("function is a string")
}

/// Drops a Rust legacy-mangling hash (`::h0123456789abcdef`) if the demangler left it.
fn without_hash(name: &str) -> &str {
    match name.rsplit_once("::h") {
        Some((head, hash)) if hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit()) => head,
        _ => name,
    }
}

fn matches(function: &str, pattern: &str) -> bool {
    let name = without_hash(function);
    if let Some(prefix) = pattern.strip_suffix('*') {
        return name.starts_with(prefix);
    }
    if let Some(suffix) = pattern.strip_prefix('*') {
        return name.ends_with(suffix);
    }
    name == pattern || name.strip_prefix(pattern).is_some_and(|rest| rest.starts_with('('))
}

/// The stack, one frame a line, for failure messages.
fn describe(stack: &Value) -> String {
    let mut text = format!(
        "stack {} ({} bytes in {} allocations, truncated: {}):\n",
        stack["stack_id"], stack["outstanding_bytes"], stack["outstanding_allocations"], stack["truncated"]
    );
    for (i, frame) in frames(stack).iter().enumerate() {
        let inlined = if frame["inlined"] == true { " [inlined]" } else { "" };
        text.push_str(&format!(
            "  #{i:<3} {} [{}]{inlined}\n",
            function(frame),
            frame["module"].as_str().unwrap_or("?")
        ));
    }
    text
}

fn describe_all(report: &Value) -> String {
    let mut text = format!("totals: {}\ndropped: {}\n", report["totals"], report["dropped"]);
    for stack in stacks(report) {
        text.push_str(&describe(stack));
    }
    text
}

fn bytes_and_count(stack: &Value) -> (u64, u64) {
    (stack["outstanding_bytes"].as_u64().expect("bytes"), stack["outstanding_allocations"].as_u64().expect("count"))
}

/// The one stack whose innermost frame is `site`: every allocation there took the same whole path.
fn only_stack_at<'a>(report: &'a Value, site: &str) -> &'a Value {
    let found: Vec<&Value> =
        stacks(report).iter().filter(|s| frames(s).first().is_some_and(|f| matches(function(f), site))).collect();
    assert_eq!(found.len(), 1, "expected one stack starting at {site}:\n{}", describe_all(report));
    found[0]
}

/// The one stack with outstanding memory that passes through `function` (C++ and Rust: STL code
/// may come first, operator new and Rust's alloc code folded into the allocator).
fn only_stack_through<'a>(report: &'a Value, function_name: &str) -> &'a Value {
    let found: Vec<&Value> =
        stacks(report).iter().filter(|s| frames(s).iter().any(|f| matches(function(f), function_name))).collect();
    assert_eq!(found.len(), 1, "expected one stack through {function_name}:\n{}", describe_all(report));
    found[0]
}

/// The stack's functions are exactly `expected`, innermost first.
fn assert_frames(stack: &Value, expected: &[&str]) {
    let names: Vec<&str> = frames(stack).iter().map(function).collect();
    let same = names.len() == expected.len() && names.iter().zip(expected).all(|(name, want)| matches(name, want));
    assert!(same, "expected the frames {expected:?}, got\n{}", describe(stack));
}

/// The stack's innermost functions are exactly `expected`.
fn assert_starts_with(stack: &Value, expected: &[&str]) {
    let names: Vec<&str> = frames(stack).iter().map(function).take(expected.len()).collect();
    let same = names.len() == expected.len() && names.iter().zip(expected).all(|(name, want)| matches(name, want));
    assert!(same, "expected the innermost frames {expected:?}, got\n{}", describe(stack));
}

/// `chain` appears in order among the stack's functions (other frames may sit between: operator
/// new, inlined STL code, glibc internals), its last entry is the outermost frame, and the walk
/// reached it: the stack is not truncated.
fn assert_whole(stack: &Value, chain: &[&str]) {
    let names: Vec<&str> = frames(stack).iter().map(function).collect();
    let mut next = 0;
    for name in &names {
        if next < chain.len() && matches(name, chain[next]) {
            next += 1;
        }
    }
    assert!(
        next == chain.len(),
        "{:?} is not in the stack (the chain stops before it):\n{}",
        chain.get(next),
        describe(stack)
    );
    let last = names.last().expect("a stack has frames");
    assert!(
        matches(last, chain[chain.len() - 1]),
        "the outermost frame is not {}:\n{}",
        chain[chain.len() - 1],
        describe(stack)
    );
    assert_complete(stack);
}

fn assert_complete(stack: &Value) {
    assert_eq!(stack["truncated"], false, "the walk must reach the thread's outermost frame:\n{}", describe(stack));
}

/// Every counter of a cut or lost stack is zero; otherwise says how many and shows the cut stacks
/// (before assert_nothing_dropped, whose message is the whole report).
fn assert_no_stack_drops(report: &Value) {
    let nonzero: Vec<(&str, u64)> =
        STACK_DROPS.iter().map(|&reason| (reason, dropped(report, reason))).filter(|&(_, n)| n > 0).collect();
    if !nonzero.is_empty() {
        let mut cut = String::new();
        for stack in stacks(report).iter().filter(|s| s["truncated"] != false) {
            cut.push_str(&describe(stack));
        }
        panic!("stacks were cut or lost: {nonzero:?}\ntruncated stacks:\n{cut}");
    }
}

fn chain<'a>(head: &[&'a str], tail: &[&'a str]) -> Vec<&'a str> {
    head.iter().chain(tail).copied().collect()
}

/// C at -O2 without frame pointers: a worker thread's leak three calls deep and main's two calls
/// deep, each one whole stack ending at the thread's outermost frame.
#[test]
fn c_stacks_without_frame_pointers_are_whole() {
    let program = fixture_with("unwind_c.c", "unwind_c", C_FLAGS);
    let report = run_to_end(&[path(&program)]);
    assert_eq!(site(&report, "worker_site"), (37 * 1000, 37), "{}", describe_all(&report));
    assert_eq!(site(&report, "main_site"), (23 * 512, 23), "{}", describe_all(&report));

    let worker = only_stack_at(&report, "worker_site");
    assert_frames(worker, &chain(&["worker_site", "worker_middle", "worker_outer", "worker"], &THREAD_TAIL));
    assert_complete(worker);
    assert_eq!(frames(worker)[0]["module"], path(&program), "{}", describe(worker));
    let main = only_stack_at(&report, "main_site");
    assert_frames(main, &chain(&["main_site", "main_outer"], &MAIN_TAIL));
    assert_complete(main);
    assert_no_stack_drops(&report);
    assert_nothing_dropped(&report);
}

/// A static musl program: musl has no CFI, so the frames of strdup and of musl's start-up code
/// are unwound from their prologues, down to `_start` (the entry point ends the walk). Between
/// main and `_start`, `_start_c` and `__libc_start_main` reach their callees with jmp (tail
/// calls) and leave no frame.
#[test]
fn static_musl_stacks_through_code_without_cfi_reach_main() {
    let program = fixture_musl("unwind_musl.c", "unwind_musl", &["-O2", "-g"]);
    let report = run_to_end(&[path(&program)]);
    let tail = ["main", "libc_start_main_stage2", "_start"];
    let strdup = only_stack_through(&report, "site_strdup");
    assert_eq!(bytes_and_count(strdup), (390, 10), "{}", describe_all(&report));
    assert_frames(strdup, &chain(&["strdup", "site_strdup"], &tail));
    assert_complete(strdup);
    let malloc = only_stack_at(&report, "site_malloc");
    assert_eq!(bytes_and_count(malloc), (1000, 10), "{}", describe_all(&report));
    assert_frames(malloc, &chain(&["site_malloc"], &tail));
    assert_complete(malloc);
    assert_no_stack_drops(&report);
}

/// C++ at -O2: operator new (libstdc++), std::string, std::vector growth and std::map nodes, in
/// a std::thread (started by libstdc++) and in main. The fixture checks the sizes it leaks.
#[test]
fn cpp_stacks_through_operator_new_and_the_stl_are_whole() {
    let program = fixture_cpp("unwind_cpp.cpp", "unwind_cpp", C_FLAGS);
    let report = run_to_end(&[path(&program)]);
    let cases: [(&str, Vec<&str>, (u64, u64)); 4] = [
        // 37 new Session of 200 bytes.
        ("open_session", chain(&["open_session", "handle_client", "worker"], &THREAD_TAIL), (37 * 200, 37)),
        // 20 strings of 300 chars: capacity 300 plus the terminating NUL.
        ("remember_name", chain(&["remember_name", "handle_client", "worker"], &THREAD_TAIL), (20 * 301, 20)),
        // 1000 push_back from empty: the buffer doubles up to 1024 longs; the old ones are freed.
        ("grow_vector", chain(&["grow_vector", "build_index"], &MAIN_TAIL), (1024 * 8, 1)),
        // 500 nodes of 48 bytes (rb-tree header 32 + pair<const int, long> 16).
        ("fill_map", chain(&["fill_map", "build_index"], &MAIN_TAIL), (500 * 48, 500)),
    ];
    for (function_name, whole, expected) in &cases {
        let stack = only_stack_through(&report, function_name);
        assert_eq!(bytes_and_count(stack), *expected, "{function_name}:\n{}", describe(stack));
        assert_whole(stack, whole);
    }
    assert_no_stack_drops(&report);
    assert_nothing_dropped(&report);
}

/// Library constructors run before main from the dynamic loader's entry (`_dl_start_user` in
/// ld.so, which has no CFI of its own). libstdc++'s constructor allocates its emergency exception
/// pool there (72704 bytes with Debian 12's libstdc++.so.6.0.30, GCC 12): every C++ program has
/// this stack, and it must be whole too.
#[test]
fn a_library_constructor_run_by_the_dynamic_loader_has_a_whole_stack() {
    let program = fixture_cpp("unwind_cpp.cpp", "unwind_cpp_ctor", C_FLAGS);
    let report = run_to_end(&[path(&program)]);
    let stack = only_stack_through(&report, "_dl_init");
    assert_eq!(bytes_and_count(stack), (72704, 1), "{}", describe(stack));
    assert_whole(stack, &["_dl_init", "_dl_start_user"]);
    assert_no_stack_drops(&report);
}

/// A Rust release build: leaks in a std::thread and in main through #[inline(never)] functions.
#[test]
fn rust_release_stacks_are_whole() {
    let program = fixture_rust("unwind_rust.rs", "unwind_rust", RUST_FLAGS);
    let report = run_to_end(&[path(&program)]);
    // First: a cut stack's message then says why it was cut.
    assert_no_stack_drops(&report);

    let worker = only_stack_through(&report, "unwind_rust::leak_in_worker");
    assert_eq!(bytes_and_count(worker), (29 * 3000, 29), "{}", describe(worker));
    // std's thread_start (std::sys::thread::unix::Thread::new::thread_start in Rust 1.95) runs the
    // closure; then glibc's start_thread and clone3.
    assert_whole(
        worker,
        &chain(&["unwind_rust::leak_in_worker", "unwind_rust::serve_worker", "*::thread_start"], &THREAD_TAIL),
    );

    let main = only_stack_through(&report, "unwind_rust::leak_in_main");
    assert_eq!(bytes_and_count(main), (13 * 800, 13), "{}", describe(main));
    // unwind_rust::main runs under std::rt::lang_start, called by the C main that rustc emits.
    assert_whole(
        main,
        &chain(&["unwind_rust::leak_in_main", "unwind_rust::serve_main", "unwind_rust::main"], &MAIN_TAIL),
    );
    assert_nothing_dropped(&report);
}

/// A function that realigns its stack (gcc's DRAP: the CFA is read from the frame, at rbp + k)
/// allocates itself and through a callee; below it, a caller whose CFA is rbp-based needs the
/// rbp the realigning frame saved. Both stacks are whole down to `_start`, bytes exact.
#[test]
fn stacks_through_a_stack_realigning_function_are_whole() {
    let program = fixture_with("unwind_drap.c", "unwind_drap", C_FLAGS);
    let report = run_to_end(&[path(&program)]);
    let direct = only_stack_at(&report, "realigned");
    assert_eq!(bytes_and_count(direct), (3 * 300, 3), "{}", describe(direct));
    assert_frames(direct, &chain(&["realigned", "framed"], &MAIN_TAIL));
    assert_complete(direct);
    let through = only_stack_at(&report, "leaf");
    assert_eq!(bytes_and_count(through), (5 * 200, 5), "{}", describe(through));
    assert_frames(through, &chain(&["leaf", "realigned", "framed"], &MAIN_TAIL));
    assert_complete(through);
    assert_no_stack_drops(&report);
    assert_nothing_dropped(&report);
}

/// 110 recursive frames plus the 4 below main fit in the 127 frames kept: the stack is whole.
#[test]
fn a_recursion_110_deep_is_kept_whole() {
    let program = fixture_with("unwind_deep.c", "unwind_deep_110", C_FLAGS);
    let report = run_to_end(&[path(&program), "110"]);
    assert_eq!(site(&report, "recurse"), (3 * 1234, 3), "{}", describe_all(&report));
    let stack = only_stack_at(&report, "recurse");
    let mut expected = vec!["recurse"; 110];
    expected.extend(MAIN_TAIL);
    assert_frames(stack, &expected);
    assert_complete(stack);
    assert_no_stack_drops(&report);
    assert_nothing_dropped(&report);
}

/// 300 recursive frames do not fit: the innermost 127 are kept, the stack is marked truncated
/// and counted as too deep, and its bytes are still exact.
#[test]
fn a_recursion_300_deep_is_cut_at_127_frames_and_marked_truncated() {
    let program = fixture_with("unwind_deep.c", "unwind_deep_300", C_FLAGS);
    let report = run_to_end(&[path(&program), "300"]);
    assert_eq!(site(&report, "recurse"), (3 * 1234, 3), "{}", describe_all(&report));
    let stack = only_stack_at(&report, "recurse");
    assert_eq!(stack["truncated"], true, "{}", describe(stack));
    let real: Vec<&Value> = frames(stack).iter().filter(|f| f["inlined"] == false).collect();
    assert_eq!(real.len(), 127, "{}", describe(stack));
    assert!(
        real.iter().all(|f| function(f) == "recurse"),
        "the innermost 127 frames are recurse:\n{}",
        describe(stack)
    );
    assert!(dropped(&report, "stack_too_deep") > 0, "{}", report["dropped"]);
    for reason in ["unwind_no_table", "unwind_bad_rule", "unwind_read_failed", "stack_collision", "stack_table_full"] {
        assert_eq!(dropped(&report, reason), 0, "dropped.{reason}: {}", report["dropped"]);
    }
}

/// A library dlopened while traced, and called at once: main -> plugin_leak -> plugin_leak_inner
/// -> malloc, 41 x 2000 bytes. Its first walks meet it before memprof has read its table: they
/// are deferred (the kernel sends the stack's copy, memprof finishes the walk) and whole, and the
/// program is never stopped for them. memprof sometimes reads the table first (the program runs
/// on meanwhile): every run's stacks must be whole, and one of a few runs must have deferred.
#[test]
fn a_library_loaded_with_dlopen_while_traced_is_unwound() {
    let lib = fixture_lib("unwind_plugin.c", "libunwind_plugin.so", &["-O2", "-g", "-fomit-frame-pointer"]);
    let program = fixture_with("unwind_c.c", "unwind_c_plugin", C_FLAGS);
    let mut deferred = Vec::new();
    for _ in 0..5 {
        let report = run_to_end(&[path(&program), "plugin", path(&lib)]);
        assert_eq!(site(&report, "plugin_leak_inner"), (41 * 2000, 41), "{}", describe_all(&report));
        let stack = only_stack_at(&report, "plugin_leak_inner");
        assert_frames(stack, &chain(&["plugin_leak_inner", "plugin_leak"], &MAIN_TAIL));
        assert_eq!(frames(stack)[0]["module"], path(&lib), "{}", describe(stack));
        assert_eq!(frames(stack)[1]["module"], path(&lib), "{}", describe(stack));
        assert_complete(stack);
        assert_no_stack_drops(&report);
        assert_nothing_dropped(&report);
        let tables = &report["unwind_tables"];
        assert_eq!(tables["deferred_unfinished"], 0, "{tables}");
        deferred.push(tables["deferred_walks"].as_u64().expect("deferred_walks"));
        if deferred.last() != Some(&0) {
            return;
        }
    }
    panic!("no run deferred a walk: deferred walks by run {deferred:?}");
}

/// The twins (below) inside a library dlopened while traced: walks deferred at the one site, at
/// one stack depth from both callers, are told apart by the return addresses above it, so the
/// first caller's stack copy does not finish the other's. Deferral is not certain (see above):
/// every run must keep them apart, and one of a few must have deferred.
#[test]
fn deferred_walks_from_two_callers_at_one_depth_keep_their_stacks_apart() {
    let lib = fixture_lib("unwind_plugin.c", "libunwind_plugin.so", &["-O2", "-g", "-fomit-frame-pointer"]);
    let program = fixture_with("unwind_c.c", "unwind_c_plugin", C_FLAGS);
    let mut deferred = Vec::new();
    for _ in 0..5 {
        let report = run_to_end(&[path(&program), "plugin-twins", path(&lib)]);
        for (twin, size) in [("plugin_twin_a", 300), ("plugin_twin_b", 700)] {
            let stack = only_stack_through(&report, twin);
            assert_eq!(bytes_and_count(stack), (50 * size, 50), "{}", describe_all(&report));
            assert_whole(stack, &chain(&["plugin_twin_site", twin, "plugin_twins"], &MAIN_TAIL));
        }
        assert_no_stack_drops(&report);
        deferred.push(report["unwind_tables"]["deferred_walks"].as_u64().expect("deferred_walks"));
        if deferred.last() != Some(&0) {
            return;
        }
    }
    panic!("no run deferred a walk: deferred walks by run {deferred:?}");
}

/// Code a loader of its own maps (a JIT's, a runtime's) moves no count of code changes: no
/// dynamic linker announces it, and nothing watches mmap without `--mappings`. Once the daemon
/// holds a whole mapping list (read after a dlopen the dynamic linker's hook reported), the
/// kernel's walks through such code are cut there and counted; the daemon then reads the
/// process's mappings again at its next scan of /proc, and the walks after that are whole. Every
/// block leaked through the code is counted, under a cut stack or a whole one.
#[test]
fn code_mapped_by_a_loader_of_its_own_is_unwound_after_the_daemon_reads_the_mappings_again() {
    let plugin = fixture_lib("unwind_plugin.c", "libunwind_plugin.so", &["-O2", "-g", "-fomit-frame-pointer"]);
    let flags = ["-O2", "-g", "-fomit-frame-pointer", "-nostdlib", "-Wl,-e,loaded_leak"];
    let lib = fixture_lib("unwind_loaded.c", "libunwind_loaded.so", &flags);
    let program = fixture_with("unwind_c.c", "unwind_c_loader", C_FLAGS);
    let mut held = Waiting::start(&program, &["loader", path(&plugin), path(&lib)]);
    let pid = held.pid().to_string();
    let daemon = Daemon::start(&["--pid", &pid, "--resync-interval", "1"]);
    daemon.wait_traced(held.pid());
    held.go();
    let leaks = format!("/api/v1/leaks?pid={pid}");
    let whole_at = |module: &Path| {
        let report = daemon.get_json(&leaks).1;
        let whole_in = |stack: &Value| first_frame_in(stack, module) && stack["truncated"] == false;
        stacks(&report).iter().any(whole_in).then_some(())
    };
    wait_for(30, "the plugin's whole stack", || whole_at(&plugin));
    held.go();
    wait_for(30, "a whole stack through the loaded code", || whole_at(&lib));
    held.go();
    let mut said = String::new();
    BufReader::new(held.child.stdout.as_mut().expect("piped")).read_line(&mut said).expect("reading the fixture");
    let rounds: u64 = said.trim().strip_prefix("rounds ").and_then(|n| n.parse().ok()).expect("rounds N");
    let in_lib = |stack: &&Value| first_frame_in(stack, &lib);
    let report = wait_for(20, "every block leaked through the loaded code", || {
        let report = daemon.get_json(&leaks).1;
        let through = stacks(&report).iter().filter(in_lib).map(bytes_and_count);
        (through.fold((0, 0), |sum, (bytes, n)| (sum.0 + bytes, sum.1 + n)) == (rounds * 700, rounds)).then_some(report)
    });
    let whole: Vec<&Value> = stacks(&report).iter().filter(in_lib).filter(|s| s["truncated"] == false).collect();
    assert_eq!(whole.len(), 1, "{}", describe_all(&report));
    assert_frames(whole[0], &chain(&["loaded_leak", "loader_caller", "leak_through_loaded_code"], &MAIN_TAIL));
    assert!(
        dropped(&report, "unwind_no_table") > 0,
        "the walks before the mappings were read again: {}",
        report["dropped"]
    );
    assert_eq!(report["unwind_tables"]["deferred_unfinished"], 0, "{}", report["unwind_tables"]);
}

/// Whether the stack's innermost frame is in `module`.
fn first_frame_in(stack: &Value, module: &Path) -> bool {
    frames(stack).first().is_some_and(|frame| frame["module"] == path(module))
}

/// Two threads load two libraries at the same moment, neither stopped for memprof: walks that
/// meet a library before its table is read are finished from their stack copies. Each
/// library's leak has its whole stack, through its own module, down to its thread's start.
#[test]
fn libraries_loaded_by_two_threads_at_once_are_unwound() {
    let flags = ["-O2", "-g", "-fomit-frame-pointer"];
    let libs = [
        fixture_lib("unwind_plugin.c", "libunwind_plugin_a.so", &flags),
        fixture_lib("unwind_plugin.c", "libunwind_plugin_b.so", &flags),
    ];
    let program = fixture_with("unwind_c.c", "unwind_c_plugins", C_FLAGS);
    let report = run_to_end(&[path(&program), "plugins", path(&libs[0]), path(&libs[1])]);
    // First: a cut stack's message then says why it was cut.
    assert_no_stack_drops(&report);
    for (lib, blocks) in libs.iter().zip([17, 29]) {
        let found: Vec<&Value> =
            stacks(&report).iter().filter(|s| frames(s).first().is_some_and(|f| f["module"] == path(lib))).collect();
        assert_eq!(found.len(), 1, "expected one stack in {}:\n{}", lib.display(), describe_all(&report));
        let stack = found[0];
        assert_eq!(bytes_and_count(stack), (blocks * 2000, blocks), "{}", describe(stack));
        assert_frames(stack, &chain(&["plugin_leak_inner", "plugin_leak", "plugin_thread"], &THREAD_TAIL));
        assert_eq!(frames(stack)[1]["module"], path(lib), "{}", describe(stack));
        assert_complete(stack);
    }
    assert_nothing_dropped(&report);
}

/// A signal handler's frame sits on the kernel's signal frame: below the handler is glibc's
/// trampoline `__restore_rt`, then the interrupted code (inside raise), then its callers.
#[test]
fn a_signal_handler_stack_continues_into_the_interrupted_code() {
    let program = fixture_with("unwind_c.c", "unwind_c_signal", C_FLAGS);
    let report = run_to_end(&[path(&program), "signal"]);
    assert_eq!(site(&report, "handler_leak"), (5 * 700, 5), "{}", describe_all(&report));
    // The drops first: a stack cut short is counted there, with why.
    assert_no_stack_drops(&report);
    assert_nothing_dropped(&report);
    let stack = only_stack_at(&report, "handler_leak");
    assert_starts_with(stack, &["handler_leak", "handler", "__restore_rt"]);
    assert_whole(stack, &chain(&["handler_leak", "handler", "__restore_rt", "raise_signal"], &MAIN_TAIL));
}

/// One call site at one stack depth from two callers, in turns: only the return address in its
/// frame tells the stacks apart, so the walk the kernel remembered for one caller (see the BPF
/// crate's `memo`) must not stand for the other's. Released once the tables are read, so that
/// every walk is the kernel's.
#[test]
fn one_site_at_one_depth_from_two_callers_keeps_their_stacks_apart() {
    let program = fixture_with("unwind_c.c", "unwind_c_twins", C_FLAGS);
    let report = run_once_tables_are_read(&[path(&program), "--wait", "twins"]);
    assert_eq!(report["unwind_tables"]["deferred_walks"], 0, "{}", describe_all(&report));
    let a = only_stack_through(&report, "twin_a");
    assert_eq!(bytes_and_count(a), (50 * 300, 50), "{}", describe_all(&report));
    assert_whole(a, &chain(&["twin_site", "twin_a"], &MAIN_TAIL));
    let b = only_stack_through(&report, "twin_b");
    assert_eq!(bytes_and_count(b), (50 * 700, 50), "{}", describe_all(&report));
    assert_whole(b, &chain(&["twin_site", "twin_b"], &MAIN_TAIL));
    assert_no_stack_drops(&report);
    assert_nothing_dropped(&report);
}

/// A frame whose caller is in no file the process maps, as in code built at run time: once
/// memprof has the process's mappings, the kernel's walk ends there, cut, and counted. It does
/// not send a copy of the stack for memprof to finish: no list of mappings to come would.
#[test]
fn a_caller_in_no_mapping_ends_the_walk_without_a_deferred_copy() {
    let program = fixture_with("unwind_c.c", "unwind_c_nowhere", C_FLAGS);
    let report = run_once_tables_are_read(&[path(&program), "--wait", "nowhere"]);
    assert_eq!(site(&report, "nowhere_alloc"), (31 * 600, 31), "{}", describe_all(&report));
    let stack = only_stack_at(&report, "nowhere_alloc");
    assert_eq!(stack["truncated"], true, "{}", describe(stack));
    assert_eq!(report["unwind_tables"]["deferred_walks"], 0, "{}", describe_all(&report));
    assert!(dropped(&report, "unwind_no_table") > 0, "{}", report["dropped"]);
    assert_eq!(dropped(&report, "deferred_walk_lost"), 0, "{}", report["dropped"]);
}

/// The same through a handler on an alternate signal stack (SA_ONSTACK, as Rust and Go runtimes
/// use): the walk jumps from the alternate stack back to the thread's stack at the signal frame.
#[test]
fn a_signal_handler_on_an_alternate_stack_continues_into_the_interrupted_code() {
    let program = fixture_with("unwind_c.c", "unwind_c_altstack", C_FLAGS);
    // Once memprof has the program's tables: a walk deferred in its first milliseconds copies
    // only the alternate stack, and stops at the signal frame (docs: reference/limits.md#unwinding).
    let report = run_once_tables_are_read(&[path(&program), "--wait", "altstack"]);
    assert_eq!(site(&report, "altstack_leak"), (3 * 900, 3), "{}", describe_all(&report));
    let stack = only_stack_at(&report, "altstack_leak");
    assert_starts_with(stack, &["altstack_leak", "altstack_handler", "__restore_rt"]);
    assert_whole(stack, &chain(&["altstack_leak", "altstack_handler", "__restore_rt", "kill_self"], &MAIN_TAIL));
    assert_no_stack_drops(&report);
    assert_nothing_dropped(&report);
}

/// A fault at a function's first instruction (a stack overflow's first push, a call through a
/// bad pointer): the signal frame holds the faulting instruction itself, not a return address,
/// so its frame is named after that function, not the one before it in the file.
#[test]
fn a_frame_interrupted_at_its_first_instruction_is_named_after_its_own_function() {
    let program = fixture_with("unwind_c.c", "unwind_c_fault", C_FLAGS);
    let report = run_once_tables_are_read(&[path(&program), "--wait", "fault"]);
    assert_eq!(site(&report, "fault_leak"), (4 * 800, 4), "{}", describe_all(&report));
    let stack = only_stack_at(&report, "fault_leak");
    assert_whole(
        stack,
        &chain(&["fault_leak", "fault_handler", "__restore_rt", "fault_at_entry", "fault_caller"], &MAIN_TAIL),
    );
    assert_no_stack_drops(&report);
    assert_nothing_dropped(&report);
}

/// A real interpreter from the distribution: no stack lost or cut, every outstanding byte under a
/// stack with frames, and the largest stack whole down to the interpreter's main.
fn assert_interpreter_stacks_whole(report: &Value, entries: &[&str]) {
    assert_no_stack_drops(report);
    let all = stacks(report);
    assert!(!all.is_empty(), "{}", describe_all(report));
    for stack in all {
        assert!(!frames(stack).is_empty(), "outstanding memory without a stack:\n{}", describe(stack));
    }
    let sum: u64 = all.iter().map(|s| s["outstanding_bytes"].as_u64().expect("bytes")).sum();
    assert_eq!(sum, total(report, "outstanding_bytes"), "the stacks must hold every outstanding byte");
    let top = all.iter().max_by_key(|s| s["outstanding_bytes"].as_u64()).expect("a stack");
    let reaches_main = frames(top).iter().any(|f| entries.iter().any(|entry| matches(function(f), entry)));
    assert!(reaches_main, "the largest stack does not reach {entries:?}:\n{}", describe(top));
    assert_whole(top, &["__libc_start_call_main", "__libc_start_main*", "_start"]);
}

/// LLVM's 100 MB C++ library, dlopened while traced: its table alone needs more rows than the
/// single fixed array memprof had held (524288 at the default size, which LLVM filled: its
/// frames were cut as `unwind_no_table`). At the default sizes now, its shards are created as
/// it is loaded and every stack through it reaches main, but those whose deferred walk found the
/// ring full on a busy machine: they are cut, and counted.
#[test]
fn a_100_mb_cpp_library_is_unwound_at_the_default_sizes() {
    let program = fixture_with("unwind_big.c", "unwind_big", C_FLAGS);
    let report = run_to_end(&[path(&program), LLVM]);
    let tables = &report["unwind_tables"];
    let rows_used = tables["rows_used"].as_u64().expect("unwind_tables.rows_used");
    assert!(rows_used > 524_288, "LLVM's table needs more rows than the old array held: {tables}");
    assert_eq!(tables["tables_not_loaded"], 0, "{tables}");
    let rows = |field: &str| tables[field].as_u64().unwrap_or_else(|| panic!("unwind_tables.{field}: {tables}"));
    assert_eq!(rows_used + rows("rows_idle") + rows("rows_free"), rows("rows_max"), "{tables}");
    let through_llvm: Vec<&Value> = stacks(&report)
        .iter()
        .filter(|s| frames(s).iter().any(|f| f["module"].as_str().is_some_and(|m| m.contains("libLLVM"))))
        .collect();
    assert!(!through_llvm.is_empty(), "{}", describe_all(&report));
    // Its constructors defer a walk for each of about 3,500 stacks while its table is built: on
    // a busy machine some find no room, and are counted. Each cut stack is one of those.
    let lost = dropped(&report, "deferred_walk_lost");
    let cut = through_llvm.iter().filter(|stack| stack["truncated"] == true).count() as u64;
    assert!(cut <= lost, "{cut} stacks through LLVM cut, {lost} deferred walks lost:\n{}", describe_all(&report));
    assert!(cut < through_llvm.len() as u64, "every stack through LLVM cut:\n{}", describe_all(&report));
    for stack in through_llvm.iter().filter(|stack| stack["truncated"] != true) {
        let reaches_main = frames(stack).iter().any(|f| matches(function(f), "main"));
        assert!(reaches_main, "a stack through LLVM stops before main:\n{}", describe(stack));
    }
    let contexts: Vec<&Value> = stacks(&report)
        .iter()
        .filter(|s| frames(s).iter().any(|f| matches(function(f), "LLVMContextCreate")))
        .collect();
    // The contexts are created just after the constructors' walks: when those filled the ring,
    // theirs may be among the lost, cut before LLVMContextCreate's frame.
    assert!(
        !contexts.is_empty() || lost > 0,
        "no stack through LLVMContextCreate, and no walk lost:\n{}",
        describe_all(&report)
    );
    for stack in contexts {
        assert_whole(stack, &chain(&["LLVMContextCreate", "big_leak"], &MAIN_TAIL));
    }
    // A walk deferred while LLVM's table was being built sees 28 to 32 KiB of stack (docs: reference/limits.md#unwinding):
    // one that needed more ends as unwind_read_failed and is counted unfinished. Nothing else
    // may be cut.
    let unfinished = tables["deferred_unfinished"].as_u64().unwrap_or(0);
    let mut report = report.clone();
    let read_failed = dropped(&report, "unwind_read_failed");
    report["dropped"]["unwind_read_failed"] = read_failed.saturating_sub(unfinished).into();
    report["dropped"]["deferred_walk_lost"] = 0.into();
    assert_no_stack_drops(&report);
}

/// Tables that do not fit under `--max-unwind-rows` are said once, counted with the rows they
/// needed, and their frames end stacks as `unwind_no_table`: never lost silently.
#[test]
fn tables_past_max_unwind_rows_are_counted_with_the_rows_they_needed() {
    let program = fixture_with("unwind_c.c", "unwind_c_few_rows", C_FLAGS);
    let outcome = run(&["--interval", "3600", "--max-unwind-rows", "2000"], &[path(&program)]);
    assert!(outcome.status.success(), "{outcome:?}");
    assert_eq!(outcome.stderr.matches("the unwind tables are full").count(), 1, "said once: {}", outcome.stderr);
    let report = outcome.final_report();
    let tables = &report["unwind_tables"];
    let number = |field: &str| tables[field].as_u64().unwrap_or_else(|| panic!("unwind_tables.{field}: {tables}"));
    assert_eq!(number("rows_max"), 2000, "{tables}");
    assert!(number("rows_used") <= 2000, "{tables}");
    assert_eq!(number("rows_used") + number("rows_idle") + number("rows_free"), 2000, "{tables}");
    // The C library's table alone needs more than 2000 rows.
    assert!(number("tables_not_loaded") >= 1, "{tables}");
    assert!(number("rows_not_loaded") > 2000, "{tables}");
    assert!(dropped(&report, "unwind_no_table") > 0, "{}", report["dropped"]);
}

#[test]
fn perl_stacks_are_whole() {
    let report = run_to_end(&["/usr/bin/perl", "-e", "my %h; $h{$_} = [1,2] for 1..100000"]);
    assert_interpreter_stacks_whole(&report, &["main"]);
}

/// Debian's python3 (/usr/bin, not a pyenv shim). Its main only tail-calls Py_BytesMain, so
/// Py_BytesMain sits right above __libc_start_call_main.
#[test]
fn python3_stacks_are_whole() {
    let report = run_to_end(&["/usr/bin/python3", "-c", "d = {i: [i] for i in range(100000)}"]);
    assert_interpreter_stacks_whole(&report, &["main", "Py_BytesMain"]);
}

/// node calls malloc from V8's JIT code, which has no unwind table: a frame-pointer walk
/// through its frames can read an address on the thread's stack as a return address. Such an
/// address is no code: the stack ends before it, marked truncated and counted, and one site's
/// walks, each wrong at another stack address, are one stack. Attached to, and under `run` to
/// its exit, when its mappings can no longer be read.
#[test]
fn a_walk_into_a_stack_address_ends_before_it() {
    let script = memprof_tests::workspace().join("tests/fixtures/node_buffers.js");
    let mut node =
        Command::new("node").arg(&script).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("starting node");
    let mut said = String::new();
    BufReader::new(node.stderr.as_mut().expect("piped")).read_line(&mut said).expect("reading node");
    let mut ready = String::new();
    BufReader::new(node.stdout.as_mut().expect("piped")).read_line(&mut ready).expect("reading node");
    assert_eq!(ready, "ready\n");
    let attached = Command::new(memprof_bin())
        .args(["attach", "--pid", &node.id().to_string(), "--json", "--max-rate", "off", "--duration", "3"])
        .output()
        .expect("running memprof");
    let _ = node.kill();
    let _ = node.wait();
    assert!(attached.status.success(), "{}", String::from_utf8_lossy(&attached.stderr));
    let stdout = String::from_utf8_lossy(&attached.stdout);
    ends_before_the_stack(stdout.lines().last().expect("a report"), &said);

    let dir = std::env::temp_dir().join(format!("memprof-node-run-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let output = dir.join("report.json");
    let ran = Command::new(memprof_bin())
        .args(["run", "--json", "-o"])
        .arg(&output)
        .args(["--", "node"])
        .arg(&script)
        .arg("3")
        .output()
        .expect("running memprof");
    let said = String::from_utf8_lossy(&ran.stderr);
    assert!(ran.status.success(), "{said}");
    let reports = std::fs::read_to_string(&output).unwrap();
    ends_before_the_stack(reports.lines().last().expect("a report"), &said);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `report` (JSON) has stacks through node's Buffer code and no frame in the `[stack]` mapping
/// whose line `said` holds (`stack LINE`, from `node_buffers.js`).
fn ends_before_the_stack(report: &str, said: &str) {
    let line = said.lines().find_map(|l| l.strip_prefix("stack ")).expect("node_buffers.js says its [stack]");
    let (start, end) = line.split_once(' ').and_then(|(range, _)| range.split_once('-')).expect("a range");
    let stack = u64::from_str_radix(start, 16).unwrap()..u64::from_str_radix(end, 16).unwrap();
    let report: Value = serde_json::from_str(report).expect("JSON");
    assert_eq!(report["final"], true, "{report}");
    let stacks = report["stacks"].as_array().expect("stacks");
    let buffers = |s: &Value| {
        let mut functions = s["frames"].as_array().unwrap().iter().filter_map(|f| f["function"].as_str());
        functions.any(|f| f.starts_with("node::Buffer::(anonymous namespace)::CreateUnsafeArrayBuffer"))
    };
    assert!(stacks.iter().any(buffers), "no stack through node's Buffer code in {} stacks", stacks.len());
    for s in stacks {
        for frame in s["frames"].as_array().unwrap() {
            let address = u64::from_str_radix(frame["address"].as_str().unwrap().trim_start_matches("0x"), 16).unwrap();
            assert!(!stack.contains(&address), "a stack address as a frame: {}", s["frames"]);
        }
    }
}
