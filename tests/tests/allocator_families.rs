//! Allocators other than the C library's: jemalloc (standard and its own API), tcmalloc and
//! mimalloc with C++'s `operator new`, linked or preloaded, and Rust's global allocators on the
//! tikv-jemallocator and mimalloc crates. Exact bytes per leaking site, under `run` and `attach`.

use std::process::{Command, Stdio};

use memprof_tests::{
    assert_nothing_dropped, attach, fixture, fixture_cpp, fixture_crate, fixture_with, run, run_with_env, site,
    through, total, wait_for, Outcome, Waiting,
};
use serde_json::Value;

const LIBDIR: &str = "/usr/lib/x86_64-linux-gnu";

/// The C fixture on jemalloc's API, linked with `-ljemalloc`.
fn jemalloc_fixture() -> std::path::PathBuf {
    let flags = ["-g", "-O2", "-fno-omit-frame-pointer", "-Wl,--no-as-needed", "-ljemalloc"];
    fixture_with("allocators_jemalloc.c", "allocators_jemalloc", &flags)
}

fn assert_jemalloc_sites(outcome: &Outcome) {
    assert!(outcome.status.success(), "{outcome:?}");
    assert!(outcome.stderr.contains("libjemalloc.so.2 (C library malloc, jemalloc"), "{}", outcome.stderr);
    let report = outcome.final_report();
    assert_eq!(site(&report, "site_malloc"), (1000, 10), "malloc is jemalloc's, not the C library's");
    assert_eq!(site(&report, "site_calloc"), (600, 5));
    assert_eq!(site(&report, "site_mallocx"), (512, 8));
    assert_eq!(site(&report, "site_rallocx"), (1200, 4), "a rallocx'd block is the new one");
    assert_eq!(site(&report, "site_xallocx"), (2 * 32768, 2), "xallocx resized in place");
    assert_eq!(site(&report, "seed_grow"), (0, 0), "a failed xallocx left the block, freed by sdallocx");
    assert_eq!(site(&report, "freed_sized"), (0, 0), "sdallocx and dallocx free");
    assert_eq!(total(&report, "unknown_frees"), 0);
    assert_eq!(report["double_frees"].as_array().unwrap().len(), 0, "{report}");
    assert_nothing_dropped(&report);
}

#[test]
fn jemalloc_linked_and_its_own_api_under_run() {
    let program = jemalloc_fixture();
    assert_jemalloc_sites(&run(&[], &[program.to_str().unwrap()]));
}

#[test]
fn jemalloc_linked_and_its_own_api_under_attach() {
    let mut target = Waiting::start(&jemalloc_fixture(), &[]);
    assert_jemalloc_sites(&attach(&mut target, &[]));
}

/// Another tool's return probe on jemalloc's `malloc` (bpftrace's here) takes each call's return
/// address at the entry, before memprof's probe on the fast path's last branch reads it: memprof
/// finds the real one in the kernel's list, and every site keeps its stack and its bytes.
#[test]
fn jemalloc_sites_stay_exact_under_another_tools_return_probe() {
    let library = format!("{LIBDIR}/libjemalloc.so.2");
    let mut bpftrace = Command::new("bpftrace")
        .args(["-q", "-e", &format!("uretprobe:{library}:malloc {{ @calls = count(); }}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("bpftrace (installed by xtask setup)");
    let listed = format!("pid {} ", bpftrace.id());
    wait_for(60, "bpftrace's return probe on jemalloc's malloc", || {
        let perf = Command::new("bpftool").args(["perf", "list"]).output().expect("bpftool (xtask setup)");
        let text = String::from_utf8_lossy(&perf.stdout).into_owned();
        text.lines()
            .any(|line| line.starts_with(&listed) && line.contains("uretprobe") && line.contains(&library))
            .then_some(())
    });
    let program = jemalloc_fixture();
    let outcome = run(&[], &[program.to_str().unwrap()]);
    let _ = bpftrace.kill();
    let _ = bpftrace.wait();
    assert_jemalloc_sites(&outcome);
}

/// `malloc`'s fast and slow paths on each allocator that has them (memprof records a fast path's
/// calls at its last branch, see docs/internals/how-it-works.md), and on glibc's, which has none
/// memprof takes; mimalloc's `calloc` and `realloc`, probed where their arguments have moved to
/// other registers: the same bytes at every site, under `run` and `attach`.
#[test]
fn fast_and_slow_paths_and_moved_arguments_are_exact_on_every_allocator() {
    let program = fixture("fast_paths");
    for preload in ["", "libjemalloc.so.2", "libmimalloc.so.2.0"] {
        let library = if preload.is_empty() { String::new() } else { format!("{LIBDIR}/{preload}") };
        let outcome = run_with_env(&[("LD_PRELOAD", &library)], &[], &[program.to_str().unwrap()]);
        assert_fast_path_sites(&outcome, &library);
        let mut waiting = Command::new(&program);
        waiting.arg("--wait").env("LD_PRELOAD", &library);
        let mut target = Waiting::start_command(waiting);
        assert_fast_path_sites(&attach(&mut target, &[]), &library);
    }
}

fn assert_fast_path_sites(outcome: &Outcome, library: &str) {
    assert!(outcome.status.success(), "{library}: {outcome:?}");
    assert!(outcome.stderr.contains(library), "{library} is probed: {}", outcome.stderr);
    let report = outcome.final_report();
    assert_eq!(site(&report, "site_small"), (2400, 100), "{library}");
    assert_eq!(site(&report, "site_large"), (60000, 3), "{library}");
    assert_eq!(site(&report, "site_calloc"), (1200, 4), "{library}");
    assert_eq!(site(&report, "site_realloc"), (10000, 2), "{library}");
    assert_eq!(site(&report, "churn"), (0, 0), "{library}: every free is seen");
    assert_eq!(total(&report, "failed_allocations"), 1, "{library}: malloc(SIZE_MAX)");
    assert_eq!(total(&report, "unknown_frees"), 0, "{library}");
    assert_nothing_dropped(&report);
}

/// The C++ fixture's leaks through `new`, `new[]`, `std::vector` and `std::string`.
fn assert_cxx_sites(outcome: &Outcome, allocator: &str) {
    assert!(outcome.stderr.contains("C++ operator new/delete"), "{allocator}: {}", outcome.stderr);
    assert_cxx_leaks(outcome, allocator);
}

/// The C++ fixture's leaks, each stack starting at the caller of `operator new` whether the
/// allocator's own `operator new` is probed (tcmalloc, jemalloc, mimalloc) or libstdc++'s calls a
/// probed `malloc` (glibc).
fn assert_cxx_leaks(outcome: &Outcome, allocator: &str) {
    assert!(outcome.status.success(), "{allocator}: {outcome:?}");
    let report = outcome.final_report();
    assert_eq!(site(&report, "site_new"), (400, 10), "{allocator}: the caller of operator new is the site");
    assert_eq!(site(&report, "site_new_array"), (1500, 5), "{allocator}");
    for stack in report["stacks"].as_array().unwrap() {
        let first = stack["frames"][0]["function"].as_str().unwrap_or("");
        assert!(!first.starts_with("operator new"), "{allocator}: {stack}");
    }
    assert_eq!(through(&report, "site_new"), (400, 10), "{allocator}");
    assert_eq!(through(&report, "site_new_array"), (1500, 5), "{allocator}");
    assert_eq!(through(&report, "site_vector"), (3 * (24 + 4000), 6), "{allocator}");
    assert_eq!(through(&report, "site_string"), (4 * (32 + 41), 8), "{allocator}");
    assert_eq!(through(&report, "churn"), (0, 0), "{allocator}: every delete is seen");
    assert_eq!(total(&report, "unknown_frees"), 0, "{allocator}");
    assert_eq!(report["double_frees"].as_array().unwrap().len(), 0, "{allocator}: {report}");
    assert_nothing_dropped(&report);
}

#[test]
fn cxx_new_on_tcmalloc_jemalloc_and_mimalloc_when_linked() {
    for (allocator, lib) in [("tcmalloc", "-ltcmalloc_minimal"), ("jemalloc", "-ljemalloc"), ("mimalloc", "-lmimalloc")]
    {
        let name = format!("cxx_new_{allocator}");
        let program = fixture_cpp("cxx_new.cpp", &name, &["-g", "-O2", "-Wl,--no-as-needed", lib]);
        assert_cxx_sites(&run(&[], &[program.to_str().unwrap()]), allocator);
    }
}

/// Attached while it waits: under `run`, its first calls of `operator new`, from four sites at
/// one depth before memprof has libstdc++'s unwind table, would share one deferred walk.
#[test]
fn cxx_new_on_glibc_has_the_same_sites() {
    let program = fixture_cpp("cxx_new.cpp", "cxx_new", &["-g", "-O2"]);
    let mut target = Waiting::start(&program, &[]);
    assert_cxx_leaks(&attach(&mut target, &[]), "glibc");
}

#[test]
fn cxx_new_on_jemalloc_and_mimalloc_when_preloaded() {
    let program = fixture_cpp("cxx_new.cpp", "cxx_new", &["-g", "-O2"]);
    for lib in ["libjemalloc.so.2", "libmimalloc.so.2.0"] {
        let preload = format!("{LIBDIR}/{lib}");
        let outcome = run_with_env(&[("LD_PRELOAD", &preload)], &[], &[program.to_str().unwrap()]);
        assert!(outcome.stderr.contains(&preload), "{lib} is probed: {}", outcome.stderr);
        assert_cxx_sites(&outcome, lib);
    }
}

/// The Rust fixture's leaks (tests/fixtures/rust_allocators/src/leaks.rs).
fn assert_rust_sites(report: &Value, allocator: &str) {
    let site = |name: &str| through(report, &format!("{allocator}::leaks::{name}"));
    assert_eq!(site("site_box"), (100_000, 100), "{allocator}");
    assert_eq!(site("site_vec"), (80_000, 10), "{allocator}");
    assert_eq!(site("site_string"), (20_000, 50), "{allocator}");
    assert_eq!(site("site_grown"), (4 * 256, 4), "{allocator}: grown by realloc");
    assert_eq!(site("churn"), (0, 0), "{allocator}");
    assert_nothing_dropped(report);
}

#[test]
fn rust_on_tikv_jemallocator_and_the_mimalloc_crate() {
    for (bin, family) in [("jemalloc", "(jemalloc)"), ("mimalloc", "(mimalloc)")] {
        let program = fixture_crate("rust_allocators", bin);
        let outcome = run(&[], &[program.to_str().unwrap()]);
        assert!(outcome.status.success(), "{outcome:?}");
        assert!(outcome.stderr.contains(&format!("{} {family}", program.display())), "{}", outcome.stderr);
        let report = outcome.final_report();
        assert_rust_sites(&report, bin);
        assert_eq!(total(&report, "unknown_frees"), 0, "{bin}: every free is of a block seen allocated");

        // Attached while it waits: the blocks its stdin and stdout buffers hold were allocated
        // before, and their frees are unknown frees.
        let mut target = Waiting::start(&program, &[]);
        let outcome = attach(&mut target, &[]);
        assert!(outcome.status.success(), "{outcome:?}");
        assert_rust_sites(&outcome.final_report(), bin);
    }
}
