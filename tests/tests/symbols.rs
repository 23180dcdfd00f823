//! Symbolization: demangled C++ names, inlined frames, and processes in their own root.

use std::{fs, path::Path, process::Command};

use memprof_tests::{attach, fixture, fixture_with, run, site, Waiting};

#[test]
fn cpp_names_are_demangled_and_inlined_functions_have_frames() {
    let program =
        fixture_with("symbols.cpp", "symbols", &["-x", "c++", "-g", "-O2", "-fno-omit-frame-pointer", "-lstdc++"]);
    let report = run(&[], &[program.to_str().unwrap()]).final_report();
    let stack = &report["stacks"][0];
    assert_eq!(stack["outstanding_bytes"], 120, "{report}");
    let frames = stack["frames"].as_array().unwrap();
    assert_eq!(frames[0]["function"], "inlined_helper");
    assert_eq!(frames[0]["inlined"], true);
    assert_eq!(frames[1]["function"], "app::Cache::grow(unsigned long)");
    assert_eq!(frames[1]["inlined"], false);
    assert_eq!(frames[1]["file"], "symbols.cpp");
    assert_eq!(frames[2]["function"], "main");
}

/// A process in its own root (as in a container) uses its own copy of libc: a different inode
/// from the host's, which memprof must probe through /proc/PID/root.
#[test]
fn a_process_in_its_own_root_is_traced_in_its_own_libc() {
    let program = fixture("allocators");
    let root = std::env::temp_dir().join(format!("memprof-root-{}", std::process::id()));
    for (from, to) in [
        ("/lib/x86_64-linux-gnu/libc.so.6", "lib/x86_64-linux-gnu/libc.so.6"),
        ("/lib64/ld-linux-x86-64.so.2", "lib64/ld-linux-x86-64.so.2"),
        (program.to_str().unwrap(), "allocators"),
    ] {
        let to = root.join(to);
        fs::create_dir_all(to.parent().unwrap()).unwrap();
        // A copy, not a link: the copy is a different inode, as a container's libc is.
        fs::copy(Path::new(from), &to).unwrap();
    }
    let mut chrooted = Command::new("chroot");
    chrooted.arg(&root).args(["/allocators", "--wait"]);
    let mut target = Waiting::start_command(chrooted);
    let outcome = attach(&mut target, &["--interval", "60"]);
    let _ = fs::remove_dir_all(&root);
    let own_libc = root.join("lib/x86_64-linux-gnu/libc.so.6");
    assert!(outcome.stderr.contains(&format!("probes in {}", own_libc.display())), "{}", outcome.stderr);
    let report = outcome.final_report();
    assert_eq!(site(&report, "site_malloc"), (1000, 10), "{report}");
    assert_eq!(site(&report, "site_calloc"), (500, 5));
    assert_eq!(report["stacks"][0]["frames"][0]["module"], root.join("allocators").to_str().unwrap());
}
