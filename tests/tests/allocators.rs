//! Exact outstanding bytes and allocations per call site, for every allocator function.

use memprof_tests::{assert_nothing_dropped, attach, fixture, fixture_with, run, site, total, Waiting};

#[test]
fn every_allocator_function_is_counted_exactly() {
    let outcome = run(&[], &[fixture("allocators").to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert_eq!(site(&report, "site_malloc"), (1000, 10));
    assert_eq!(site(&report, "site_calloc"), (500, 5));
    assert_eq!(site(&report, "site_posix_memalign"), (600, 3));
    assert_eq!(site(&report, "site_aligned_alloc"), (256, 2));
    assert_eq!(site(&report, "site_memalign"), (384, 4));
    assert_eq!(site(&report, "site_valloc"), (100, 1));
    assert_eq!(site(&report, "site_pvalloc"), (100, 1));
    // Freed right away: counted, not outstanding.
    assert_eq!(site(&report, "freed_site"), (0, 0));
    // malloc(SIZE_MAX), calloc's overflow, reallocarray's overflow, posix_memalign(EINVAL);
    // free(NULL) is ignored.
    assert_eq!(total(&report, "failed_allocations"), 4);
    assert_eq!(total(&report, "unknown_frees"), 0);
    assert_eq!(total(&report, "outstanding_bytes"), 2940);
    assert_eq!(total(&report, "outstanding_allocations"), 26);
    // The memalign family relays to malloc inside glibc: only the outermost call counts.
    assert_eq!(total(&report, "allocations"), 26 + 7);
    assert_eq!(total(&report, "frees"), 7);
    assert_eq!(total(&report, "freed_bytes"), 7000);
    assert_nothing_dropped(&report);
}

#[test]
fn every_realloc_case_is_counted_exactly() {
    let outcome = run(&[], &[fixture("realloc").to_str().unwrap()]);
    assert!(outcome.status.success(), "the fixture checks realloc's behaviour itself: {outcome:?}");
    let report = outcome.final_report();
    assert_eq!(site(&report, "site_realloc_null"), (64, 1), "realloc(NULL, n) is malloc");
    assert_eq!(site(&report, "site_realloc_zero"), (0, 0), "realloc(p, 0) frees p");
    assert_eq!(site(&report, "site_realloc_move"), (1 << 20, 1), "a moved block is the new one");
    assert_eq!(site(&report, "site_realloc_shrink"), (900, 1), "in place, the new size counts");
    assert_eq!(site(&report, "site_reallocarray"), (30, 1));
    // Of the seeds only the one whose realloc failed is still outstanding.
    assert_eq!(site(&report, "seed"), (50, 1));
    assert_eq!(total(&report, "failed_allocations"), 1);
    // realloc calls malloc and free inside glibc: those nested calls are not counted again.
    assert_eq!(total(&report, "allocations"), 8);
    assert_eq!(total(&report, "frees"), 3);
    assert_eq!(total(&report, "freed_bytes"), 32 + 16 + 1000);
    assert_eq!(total(&report, "unknown_frees"), 0);
    assert_nothing_dropped(&report);
}

#[test]
fn threads_allocating_at_once_and_freeing_each_others_memory() {
    let outcome = run(&[], &[fixture("threads").to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    for leak in ["leak_a", "leak_b", "leak_c", "leak_d"] {
        assert_eq!(site(&report, leak), (500 * 24, 500), "{leak}");
    }
    // Allocated by one thread, freed by another.
    assert_eq!(site(&report, "handoff_alloc"), (0, 0));
    let handoff = report["stacks"].as_array().unwrap().iter().any(|s| s["frames"][0]["function"] == "handoff_alloc");
    assert!(!handoff, "a fully freed stack is not listed");
    assert_eq!(report["double_frees"].as_array().unwrap().len(), 0, "thread exit is not a double free");
    assert_nothing_dropped(&report);
}

/// glibc gives each thread that calls the allocator a cache it allocates inside itself, never
/// through malloc, and frees through free as the thread exits: one internal free per such
/// thread, none per thread that never called it, and no unknown free under `run`, run after run.
#[test]
fn glibc_thread_caches_freed_at_thread_exit_are_internal_frees_not_unknown() {
    let program = fixture("thread_caches");
    for (using, idle) in [(8, 0), (8, 0), (8, 0), (8, 0), (8, 0), (5, 5), (5, 5), (0, 5), (3, 0), (3, 0)] {
        let outcome = run(&[], &[program.to_str().unwrap(), &using.to_string(), &idle.to_string()]);
        assert!(outcome.status.success(), "{outcome:?}");
        let report = outcome.final_report();
        assert_eq!(site(&report, "churn_site"), (0, 0), "{using} threads: {report}");
        assert_eq!(total(&report, "unknown_frees"), 0, "{using} + {idle} threads: {report}");
        assert_eq!(total(&report, "internal_frees"), using, "{using} + {idle} threads: {report}");
        assert_nothing_dropped(&report);
    }
}

/// A static binary has its allocator inside: memprof probes the executable itself. Its double
/// frees are told from glibc's thread-exit frees by name, as both sit in the one file.
#[test]
fn a_static_binary_is_traced_in_itself() {
    let flags = ["-static", "-g", "-O0", "-fno-omit-frame-pointer", "-pthread"];
    let program = fixture_with("allocators.c", "allocators_static", &flags);
    let outcome = run(&[], &[program.to_str().unwrap()]);
    assert!(outcome.stderr.contains(&format!("probes in {}", program.display())), "{}", outcome.stderr);
    let report = outcome.final_report();
    assert_eq!(site(&report, "site_malloc"), (1000, 10));
    assert_eq!(site(&report, "site_calloc"), (500, 5));
    assert_eq!(site(&report, "site_memalign"), (384, 4));
    assert_eq!(total(&report, "failed_allocations"), 4);

    let threads = fixture_with("threads.c", "threads_static", &flags);
    let report = run(&[], &[threads.to_str().unwrap()]).final_report();
    assert_eq!(site(&report, "leak_a"), (500 * 24, 500));
    assert_eq!(report["double_frees"].as_array().unwrap().len(), 0, "thread exit is not a double free");
    // Its C library shares the program's file: no caller there is taken for the library's own.
    assert_eq!(total(&report, "internal_frees"), 0, "{report}");

    let lifecycle = fixture_with("lifecycle.c", "lifecycle_static", &flags);
    let report = run(&[], &[lifecycle.to_str().unwrap(), "double-free"]).final_report();
    let double_frees = report["double_frees"].as_array().unwrap();
    assert_eq!(double_frees.len(), 1, "{report}");
    assert_eq!(double_frees[0]["second_free"]["frames"][0]["function"], "df_second_free");
}

#[test]
fn reallocs_racing_with_mallocs_in_other_threads_stay_exact() {
    let outcome = run(&[], &[fixture("realloc_threads").to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert_eq!(site(&report, "keep_site"), (4 * 1000 * 32, 4000));
    assert_eq!(site(&report, "seed_site"), (0, 0), "every seed was freed by its realloc");
    assert_eq!(site(&report, "grow_site"), (0, 0), "every grown block was freed");
    assert_eq!(report["double_frees"].as_array().unwrap().len(), 0, "{report}");
    assert_nothing_dropped(&report);
}

#[test]
fn a_file_that_defines_malloc_but_is_only_read_is_not_taken_for_the_allocator() {
    // A copy of the C library, mapped for reading only as a symbolizer maps a debug file (a
    // memprof daemon maps libc's): probes there would never fire.
    let copy = std::env::temp_dir().join(format!("memprof-readonly-{}.debug", std::process::id()));
    std::fs::copy("/usr/lib/x86_64-linux-gnu/libc.so.6", &copy).unwrap();
    let mut target = Waiting::start(&fixture("mapped_readonly"), &[copy.to_str().unwrap()]);
    let outcome = attach(&mut target, &[]);
    std::fs::remove_file(&copy).unwrap();
    assert!(outcome.status.success(), "{outcome:?}");
    assert!(outcome.stderr.contains("libc.so.6"), "probes the C library that runs: {}", outcome.stderr);
    assert_eq!(site(&outcome.final_report(), "mapped_site"), (1000, 10));
}

/// A command given as a link to a program whose RPATH is `$ORIGIN/../lib` (Debian's
/// `/usr/bin/java`): memprof asks the loader about the file the link names, as the kernel runs
/// it, and counts it exactly (it said the program's library could not be found).
#[test]
fn a_link_to_a_program_with_an_origin_rpath_is_run_and_counted() {
    let root = std::env::temp_dir().join(format!("memprof-origin-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    for dir in ["bin", "lib"] {
        std::fs::create_dir_all(root.join(dir)).unwrap();
    }
    let lib = fixture_with("origin_lib.c", "liborigin.so", &["-shared", "-fPIC", "-O1"]);
    std::fs::copy(&lib, root.join("lib/liborigin.so")).unwrap();
    let program = root.join("bin/origin_main");
    let source = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/origin_main.c");
    let compiled = std::process::Command::new("cc")
        .args(["-O1", "-g", "-o", program.to_str().unwrap(), source.to_str().unwrap()])
        .args(["-L", root.join("lib").to_str().unwrap(), "-lorigin", "-Wl,-rpath,$ORIGIN/../lib"])
        .status()
        .unwrap();
    assert!(compiled.success(), "compiling {}", source.display());
    let link = root.join("origin_link");
    std::os::unix::fs::symlink(&program, &link).unwrap();
    let outcome = run(&[], &[link.to_str().unwrap()]);
    let _ = std::fs::remove_dir_all(&root);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert_eq!(site(&report, "origin_alloc"), (300, 3));
    assert_nothing_dropped(&report);
}

/// A process whose comm and a mapped file's name are not UTF-8 is traced like any other (it was
/// reported as gone: its `/proc` files failed to read as UTF-8), its name shown with U+FFFD.
#[test]
fn a_process_with_names_that_are_not_utf8_is_traced() {
    let mut target = Waiting::start(&fixture("odd_names"), &[]);
    let outcome = attach(&mut target, &[]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert_eq!(report["comm"], "odd\u{fffd}\u{fffd}name", "{}", report["comm"]);
    assert_eq!(site(&report, "odd_site"), (1000, 10));
    assert_nothing_dropped(&report);
}
