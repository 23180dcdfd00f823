//! `--inspect` on a live process: every block of `reachability.c` (built -O2 without frame
//! pointers, two threads asleep in the kernel) in the class valgrind's memcheck gives it, and
//! the process running on as it would have.
//!
//! The truth, from `valgrind --leak-check=full --show-leak-kinds=all` (3.19) on the same source
//! and flags, asked for its leak check (`vgdb leak_check full kinds all`) at the same point, where
//! the process waits for "end" (loss records trimmed to the fixture's sites):
//!
//! ```text
//!  56 bytes in 1 blocks are indirectly lost              cycle_second
//!  80 bytes in 1 blocks are still reachable              from_global
//!  96 bytes in 1 blocks are still reachable              from_stack    (stack_thread)
//! 104 (48 direct, 56 indirect) bytes in 1 blocks are definitely lost   cycle_first
//! 112 bytes in 1 blocks are still reachable              from_register (register_thread)
//! 128 bytes in 1 blocks are possibly lost                interior
//! 160 bytes in 5 blocks are indirectly lost              list_node
//! 160 bytes in 4 blocks are definitely lost              lost_overwritten
//! 224 (64 direct, 160 indirect) bytes in 1 blocks are definitely lost  list_head
//! ```
//!
//! (valgrind runs the fixture only with a copy of ld.so and libc: on a machine where memprof's
//! probes are attached, valgrind translates their breakpoints and the program dies of SIGTRAP.)

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    process::{Command, Stdio},
};

use memprof_tests::{
    attach, attach_with,
    cgroup::MemoryCgroup,
    fixture_cpp, fixture_with, free_port, http_get,
    inspection::{reach, reachability, stack},
    memprof_bin, wait_for, Daemon, Outcome, Waiting,
};
use serde_json::{json, Value};

fn fixture() -> std::path::PathBuf {
    fixture_with("reachability.c", "reachability", &["-g", "-O2", "-fomit-frame-pointer", "-pthread"])
}

/// Each site's reachability, as memcheck reports it (see the file's comment).
fn truth() -> Vec<(&'static str, Value)> {
    let none = (0, 0);
    vec![
        ("lost_overwritten", reach((160, 4), none, none, none, 160)),
        ("list_head", reach((64, 1), none, none, none, 224)),
        ("list_node", reach(none, (160, 5), none, none, 0)),
        ("from_global", reach(none, none, none, (80, 1), 0)),
        ("from_stack", reach(none, none, none, (96, 1), 0)),
        ("from_register", reach(none, none, none, (112, 1), 0)),
        ("interior", reach(none, none, (128, 1), none, 0)),
        ("cycle_first", reach((48, 1), none, none, none, 104)),
        ("cycle_second", reach(none, (56, 1), none, none, 0)),
    ]
}

fn check(report: &Value) {
    for (site, expected) in truth() {
        assert_eq!(reachability(report, site), &expected, "{site}");
    }
    let inspection = &report["inspection"];
    assert_eq!(inspection["threads"], 3, "{inspection}");
    assert!(inspection["root_bytes_scanned"].as_u64().unwrap() > 0, "{inspection}");
    assert!(inspection["pause_ms"].as_f64().unwrap() > 0.0, "{inspection}");
    // Every tracked block is in the totals, the fixture's and pthread's (thread DTVs).
    let totals = &inspection["totals"];
    let classified: u64 = ["definitely_lost", "indirectly_lost", "possibly_lost", "reachable"]
        .iter()
        .map(|class| totals[format!("{class}_bytes")].as_u64().unwrap())
        .sum();
    assert_eq!(classified, report["totals"]["outstanding_bytes"].as_u64().unwrap(), "{inspection}");
}

#[test]
fn attach_inspect_classes_each_block_as_memcheck_and_the_process_runs_on() {
    let mut target = Waiting::start(&fixture(), &[]);
    let outcome = attach(&mut target, &["--inspect", "--duration", "2", "--interval", "1"]);
    assert!(outcome.status.success(), "{outcome:?}");
    assert!(outcome.stderr.contains("memprof: inspected pid"), "{}", outcome.stderr);
    let report = outcome.final_report();
    check(&report);
    // Blocks made before memprof attached may hold pointers: the untracked heap was scanned.
    assert_eq!(report["inspection"]["unclassified_heap_scanned"], true);
    ends_as_without_memprof(&mut target, "set\ndone ok\n");
}

/// Chunk headers a process rewrote so that their sizes, past the end of the address space, lead
/// glibc's walk back to a chunk it has been at: in the main heap, or in a mapping that holds
/// blocks mapped one by one. The walks end, and so does memprof (it went round for good, the
/// heap's walk taking memory as it went, and neither Ctrl-C nor SIGTERM stopped it).
#[test]
fn chunk_sizes_that_wrap_around_end_the_walk() {
    let fixture = fixture_with("wrapping_chunks.c", "wrapping_chunks", &["-g", "-O0"]);
    for heap in ["heap", "mapped"] {
        let outcome = inspect_within_a_minute(Waiting::start(&fixture, &[heap]));
        assert!(outcome.status.success(), "{heap}: {outcome:?}");
        assert!(outcome.stderr.contains("memprof: inspected pid"), "{heap}: {}", outcome.stderr);
        let report = outcome.final_report();
        assert!(report["inspection"]["untracked_blocks"].is_u64(), "{heap}: {report:#}");
    }
}

/// A process's own allocator says what size each block has: one of 2^46 bytes and one to the end
/// of the address space are inspected in the time any is (the first made memprof build a table of
/// 2^34 pages, the second read 2^64 bytes a MiB at a time).
#[test]
fn made_up_block_sizes_are_inspected() {
    let fixture = fixture_with("made_up_sizes.c", "made_up_sizes", &["-g", "-O1", "-rdynamic"]);
    let outcome = inspect_within_a_minute(Waiting::start(&fixture, &[]));
    assert!(outcome.status.success(), "{outcome:?}");
    assert!(outcome.stderr.contains("(mimalloc)"), "{}", outcome.stderr);
    assert!(outcome.stderr.contains("memprof: inspected pid"), "{}", outcome.stderr);
}

/// `attach --inspect --duration 3` to `target`, killed after a minute if it goes round: the
/// test fails instead of waiting for good.
fn inspect_within_a_minute(mut target: Waiting) -> Outcome {
    let pid = target.pid();
    let mut memprof = Command::new("timeout");
    memprof.args(["-s", "KILL", "60"]).arg(memprof_bin());
    attach_with(memprof, &mut target, pid, &["--inspect", "--duration", "3"])
}

/// Lets the fixture finish: what it prints from now on (`rest_expected`) and its exit code are those of
/// a run without memprof.
fn ends_as_without_memprof(target: &mut Waiting, rest_expected: &str) {
    let child = &mut target.child;
    child.stdin.as_mut().unwrap().write_all(b"end\n").unwrap();
    let mut rest = String::new();
    child.stdout.as_mut().unwrap().read_to_string(&mut rest).unwrap();
    assert_eq!(rest, rest_expected);
    assert_eq!(child.wait().unwrap().code(), Some(3));
}

/// `memprof run --json --inspect --duration 2` with `flags` on `fixture`, which prints "set" when
/// ready and ends on a line of stdin: the final report and what the fixture printed.
fn run_inspect(fixture: &std::path::Path, flags: &[&str]) -> (Value, Vec<String>) {
    run_inspect_in(None, fixture, flags)
}

/// `run_inspect`, memprof (and so the fixture) in `group` when given.
fn run_inspect_in(group: Option<&MemoryCgroup>, fixture: &std::path::Path, flags: &[&str]) -> (Value, Vec<String>) {
    // A file, not a pipe: the command inherits memprof's stderr and outlives it.
    let stderr_path = std::env::temp_dir().join(format!(
        "memprof-inspect-{}-{}.err",
        std::process::id(),
        fixture.file_name().unwrap().to_string_lossy()
    ));
    let stderr_file = std::fs::File::create(&stderr_path).unwrap();
    let mut memprof = match group {
        Some(group) => {
            let mut sh = Command::new("sh");
            sh.args(["-c", r#"echo $$ > "$0" && exec "$@""#]).arg(group.procs()).arg(memprof_bin());
            sh
        }
        None => Command::new(memprof_bin()),
    };
    let mut memprof = memprof
        .args(["run", "--json", "--inspect", "--duration", "2", "--interval", "1"])
        .args(flags)
        .arg("--")
        .arg(fixture)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(stderr_file)
        .spawn()
        .expect("starting memprof");
    let mut stdin = memprof.stdin.take().unwrap();
    // Read as it comes: reports larger than the pipe would block memprof before its end. The
    // command holds the pipe too, so this ends with the command.
    let mut reports = memprof.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        reports.read_to_string(&mut text).map(|_| text)
    });
    let status = memprof.wait().unwrap();
    let stderr = std::fs::read_to_string(&stderr_path).unwrap();
    let _ = std::fs::remove_file(&stderr_path);
    assert!(status.success(), "{stderr}");
    assert!(stderr.contains("memprof: inspected pid"), "{stderr}");
    // memprof is gone; the command it left running still reads this stdin and writes that stdout.
    stdin.write_all(b"end\n").unwrap();
    drop(stdin);
    let stdout = reader.join().unwrap().unwrap();
    let (reports, fixture_output): (Vec<&str>, Vec<&str>) = stdout.lines().partition(|l| l.starts_with('{'));
    let report: Value = serde_json::from_str(reports.last().expect("a report")).unwrap();
    (report, fixture_output.into_iter().map(String::from).collect())
}

#[test]
fn run_inspect_at_duration_with_every_allocation_seen() {
    let (report, fixture_output) = run_inspect(&fixture(), &["--inspect-precopy", "never"]);
    assert_eq!(fixture_output, ["set", "done ok"]);
    check(&report);
    assert_eq!(report["inspection"]["unclassified_heap_scanned"], false);
    assert_eq!(report["inspection"]["method"], "single_stop");
    // memprof saw every block made: glibc's heaps hold none in use it did not.
    assert_eq!(report["inspection"]["untracked_blocks"], 0);
}

/// A process whose main thread called pthread_exit: that thread, a zombie until the process ends,
/// cannot be stopped and holds nothing; the others are, and the blocks are classed. (The whole
/// inspection failed, blaming another tracer.)
#[test]
fn a_process_whose_main_thread_exited_is_inspected() {
    let mut target =
        Waiting::start(&fixture_with("leader_exit.c", "leader_exit", &["-g", "-O0", "-pthread"]), &["hold"]);
    let outcome = attach(&mut target, &["--inspect", "--duration", "2"]);
    assert!(outcome.status.success(), "{outcome:?}");
    assert!(outcome.stderr.contains("memprof: inspected pid"), "{}", outcome.stderr);
    let report = outcome.final_report();
    let none = (0, 0);
    assert_eq!(reachability(&report, "hold_site"), &reach(none, none, none, (21_000, 7), 0), "{report:#}");
}

/// A block whose only pointer is in shared memory is reachable, as memcheck says: the maps show
/// shared anonymous memory as `/dev/zero (deleted)` and POSIX shared memory under `/dev/shm`,
/// which were skipped as devices' memory, and such blocks were called definitely lost.
#[test]
fn pointers_kept_in_shared_memory_keep_their_blocks_reachable() {
    let fixture = fixture_with("shared_roots.c", "shared_roots", &["-g", "-O0"]);
    let (report, fixture_output) = run_inspect(&fixture, &["--inspect-precopy", "never"]);
    assert_eq!(fixture_output, ["set", "done ok"]);
    let none = (0, 0);
    for (site, bytes) in [("shared_anon", 111), ("posix_shm", 222), ("shared_memfd", 333)] {
        assert_eq!(reachability(&report, site), &reach(none, none, none, (bytes, 1), 0), "{site}");
    }
    assert_eq!(reachability(&report, "shared_lost"), &reach((666, 1), none, none, none, 666));
}

/// Under `--sample-bytes`, each sampled block's class in its stack's figures counts the blocks and
/// bytes it stands for, as the in-use figures beside it do: a site whose every block is lost shows
/// all of its estimate lost (its sampled blocks' own bytes were shown, about 1.5% of it here).
#[test]
fn a_sampled_blocks_class_counts_what_it_stands_for() {
    let fixture = fixture_with("sampled_lost.c", "sampled_lost", &["-g", "-O1"]);
    let (report, fixture_output) = run_inspect(&fixture, &["--sample-bytes", "4096", "--inspect-precopy", "never"]);
    assert_eq!(fixture_output, ["set", "done ok"]);
    let site = stack(&report, "lost_small");
    let (bytes, blocks) =
        (site["outstanding_bytes"].as_u64().unwrap(), site["outstanding_allocations"].as_u64().unwrap());
    assert!(bytes > 3_200_000, "an estimate near the truth, 6,400,000: {site}");
    let none = (0, 0);
    assert_eq!(reachability(&report, "lost_small"), &reach((bytes, blocks), none, none, none, bytes));
    // The blocks not sampled are among those memprof did not record, classed from glibc's heap:
    // with the sampled ones as themselves, the whole heap, each block once. (They were counted
    // twice: once in the estimates, once as not recorded.)
    let inspection = &report["inspection"];
    let lost = |part: &str, what: &str| inspection[part][format!("definitely_lost_{what}")].as_u64().unwrap_or(0);
    assert_eq!(lost("totals", "blocks") + lost("untracked_classes", "blocks"), 100_000, "{inspection:#}");
    // A block not recorded counts its chunk's usable size: 72 bytes for these 64.
    let unrecorded = 100_000 - lost("totals", "blocks");
    assert_eq!(lost("totals", "bytes"), lost("totals", "blocks") * 64, "{inspection:#}");
    assert_eq!(lost("untracked_classes", "bytes"), unrecorded * 72, "{inspection:#}");
}

/// Whether this kernel keeps soft-dirty bits (`CONFIG_MEM_SOFT_DIRTY`): a page of ours written
/// after they were cleared has bit 55 of its pagemap entry set.
fn kernel_has_soft_dirty() -> bool {
    use std::os::unix::fs::FileExt as _;
    let mut page = vec![1u8; 8192];
    let addr = (page.as_ptr() as u64).next_multiple_of(4096);
    let at = (addr - page.as_ptr() as u64) as usize;
    std::fs::write("/proc/self/clear_refs", "4").expect("clearing our soft-dirty bits");
    // SAFETY: a byte of our own buffer, written so that the write is not elided.
    unsafe { std::ptr::write_volatile(page.as_mut_ptr().add(at), 2) };
    let mut entry = [0u8; 8];
    let pagemap = std::fs::File::open("/proc/self/pagemap").unwrap();
    pagemap.read_exact_at(&mut entry, addr / 4096 * 8).unwrap();
    u64::from_ne_bytes(entry) & (1 << 55) != 0
}

/// Whether this kernel write-protects asynchronously with userfaultfd (6.7+ with
/// `CONFIG_PTE_MARKER_UFFD_WP`): `UFFDIO_API` (`_IOWR(0xAA, 0x3F, 24)`) accepts
/// `UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED` (linux/userfaultfd.h).
fn kernel_has_async_write_protect() -> bool {
    // SAFETY: userfaultfd(2) with flags; the ioctl reads and writes the 24-byte struct uffdio_api.
    unsafe {
        let fd = libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | 1 /* UFFD_USER_MODE_ONLY */) as i32;
        if fd < 0 {
            return false;
        }
        let mut api: [u64; 3] = [0xAA, (1 << 15) | (1 << 13), 0];
        let ok = libc::ioctl(fd, 0xc018_aa3f, api.as_mut_ptr()) == 0;
        libc::close(fd);
        ok
    }
}

/// The pre-copy: the memory copied while the process runs, then in the stop only the pages
/// written since (soft-dirty bits; else, with `write-protect`, of the heap userfaultfd's write protection, the rest
/// whole) or all of it again into the warm copy, gives the classes a single stop gives, while a
/// thread keeps relinking a list (every node reachable whenever the process is stopped) and
/// the main thread waits in read(2). The report names the path taken.
#[test]
fn a_copy_made_while_a_thread_relinks_a_list_classes_as_a_single_stop() {
    let fixture = fixture_with("relinking.c", "relinking", &["-g", "-O2", "-pthread"]);
    let site = |report: &Value, function: &str| reachability(report, function).clone();
    let soft_dirty = kernel_has_soft_dirty();
    let precopied = if soft_dirty { "soft_dirty" } else { "recopy" };
    let write_protected = if soft_dirty {
        "soft_dirty"
    } else if kernel_has_async_write_protect() {
        "write_protect"
    } else {
        "recopy"
    };
    let mut classes = Vec::new();
    for (precopy, method) in [("always", precopied), ("write-protect", write_protected), ("never", "single_stop")] {
        let (report, fixture_output) = run_inspect(&fixture, &["--inspect-precopy", precopy]);
        assert_eq!(fixture_output, ["set", "done ok"], "{precopy}");
        let inspection = &report["inspection"];
        assert_eq!(inspection["method"], method, "{inspection}");
        // The relinking thread's stack and the list's pages at least were written since.
        let copied = inspection["bytes_copied_in_pause"].as_u64().unwrap();
        assert!(copied > 0, "{inspection}");
        let list = site(&report, "list_node");
        assert_eq!(list["reachable_blocks"], 4096, "{precopy}: {list}");
        assert_eq!(list["reachable_bytes"], 4096 * 256, "{precopy}: {list}");
        let lost = site(&report, "lost_block");
        assert_eq!(lost["definitely_lost_blocks"], 16, "{precopy}: {lost}");
        assert_eq!(lost["definitely_lost_bytes"], 16 * 64, "{precopy}: {lost}");
        classes.push((list, lost, inspection["totals"].clone()));
    }
    assert_eq!(classes[0], classes[2]);
    assert_eq!(classes[1], classes[2]);
}

/// A process that reserved 2 GiB ahead and wrote 32 MiB of it, as a JVM or jemalloc does, inspected
/// by memprof under a memory cgroup of 1 GiB: memprof copies (and holds) the pages that hold data,
/// not the reservation, and classes its blocks as a single stop would. Copied whole, the
/// reservation was refused as larger than the room memprof has, or, pre-copied, written with
/// zeros page by page into memprof's memory.
#[test]
fn a_heap_reserved_ahead_is_copied_by_the_pages_it_holds() {
    let fixture = fixture_with("reserved.c", "reserved", &["-g", "-O0"]);
    let group = MemoryCgroup::new(&format!("memprof-test-reserved-{}", std::process::id()), 1 << 30);
    for precopy in ["auto", "never"] {
        let (report, fixture_output) = run_inspect_in(Some(&group), &fixture, &["--inspect-precopy", precopy]);
        assert_eq!(fixture_output, ["set", "done ok"], "{precopy}");
        let inspection = &report["inspection"];
        let single_stop = inspection["method"] == "single_stop";
        assert_eq!(single_stop, precopy == "never", "{precopy}: {inspection}");
        let lost = reachability(&report, "lost_block");
        assert_eq!((&lost["definitely_lost_blocks"], &lost["definitely_lost_bytes"]), (&json!(16), &json!(16 * 64)));
        assert_eq!(reachability(&report, "kept_block")["reachable_bytes"], 128, "{precopy}: {inspection}");
        // The 32 MiB written and the program's other memory, not the 2 GiB reserved.
        let roots = inspection["root_bytes_scanned"].as_u64().unwrap();
        assert!((32 << 20..256 << 20).contains(&roots), "{precopy}: {inspection}");
    }
    assert!(group.peak() < 512 << 20, "memprof and the fixture took {} MiB", group.peak() >> 20);
    assert_eq!(group.oom_kills(), 0);
}

/// The open descriptors and the mappings of `pid`.
fn descriptors_and_maps(pid: u32) -> (usize, String) {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).expect("the fixture's descriptors").count();
    (fds, std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("the fixture's maps"))
}

/// `write_watch.c` (with `args`) inspected with `--inspect-precopy write-protect`: its threads write
/// its heap from user space and, in read(2), from the kernel while it is pre-copied, and two
/// more wait in read(2) meanwhile. It runs on as without memprof, with the descriptors and
/// mappings it had; the inspection.
fn inspect_write_watch(args: &[&str]) -> Value {
    // A binary per test: tests running at once would replace each other's.
    let name = format!("write_watch{}", args.concat().replace('-', "_"));
    let fixture = fixture_with("write_watch.c", &name, &["-O2", "-pthread"]);
    let mut target = Waiting::start(&fixture, args);
    let before = descriptors_and_maps(target.pid());
    let outcome =
        attach(&mut target, &["--inspect", "--inspect-precopy", "write-protect", "--duration", "2", "--interval", "1"]);
    assert!(outcome.status.success(), "{outcome:?}");
    assert_eq!(descriptors_and_maps(target.pid()), before);
    ends_as_without_memprof(&mut target, "set\ndone ok\n");
    outcome.final_report()["inspection"].clone()
}

/// The heap write-protected while pre-copied, by calls injected into a thread waiting in
/// read(2): only the pages written since are read again.
#[test]
fn the_write_protected_precopy_leaves_the_process_as_it_was() {
    let inspection = inspect_write_watch(&[]);
    if !kernel_has_soft_dirty() && kernel_has_async_write_protect() {
        assert_eq!(inspection["method"], "write_protect", "{inspection}");
    }
    // Where the pages written are told, only those were read again: half of the 8 MiB heap,
    // with the thread stacks and the data written, not all of it. Soft-dirty bits are kept per
    // huge page where the heap has transparent huge pages (Debian's kernels: `always`): the one
    // that straddles the end of the written half is read again whole, up to 2 MiB more.
    if inspection["method"] != "recopy" {
        assert!(inspection["bytes_copied_in_pause"].as_u64().unwrap() < 7 << 20, "{inspection}");
    }
}

/// Under a seccomp filter (one that allows every call, but memprof cannot know) nothing is
/// injected: every page is read again in the stop.
#[test]
fn a_process_under_seccomp_is_not_write_protected() {
    let inspection = inspect_write_watch(&["--seccomp"]);
    if !kernel_has_soft_dirty() {
        assert_eq!(inspection["method"], "recopy", "{inspection}");
    }
}

#[test]
fn run_inspect_needs_a_duration() {
    let outcome = memprof_tests::memprof(&["run", "--inspect", "--", "true"]);
    assert_eq!(outcome.status.code(), Some(2));
    assert!(outcome.stderr.contains("add --duration SECS"), "{}", outcome.stderr);
}

/// `reachability_types.cpp`: C++ objects named by the vtable their first word points into, per
/// site, with their classes as memcheck gives them. valgrind 3.19 on the same source and flags
/// (`--leak-check=full --show-leak-kinds=all`, at exit: the blocks do not change after "set"),
/// loss records trimmed to their sites:
///
/// ```text
/// 16 bytes in 1 blocks are still reachable    circles()
/// 32 bytes in 2 blocks are definitely lost    circles()
/// 40 bytes in 1 blocks are still reachable    widgets()
/// 40 bytes in 1 blocks are definitely lost    widgets()
/// 80 bytes in 3 blocks are definitely lost    mixed(unsigned long)
/// LEAK SUMMARY: definitely lost: 152 bytes in 6 blocks, still reachable: 56 bytes in 2 blocks
/// ```
#[test]
fn attach_inspect_names_cpp_objects_by_type() {
    let fixture = fixture_cpp("reachability_types.cpp", "reachability_types", &["-g", "-O2", "-fomit-frame-pointer"]);
    let mut target = Waiting::start(&fixture, &[]);
    let outcome = attach(&mut target, &["--inspect", "--duration", "2", "--interval", "1"]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    let none = (0, 0);
    let types = |site| &stack(&report, site)["types"];
    assert_eq!(types("circles"), &json!([{"type": "Circle", "bytes": 48, "blocks": 3}]));
    assert_eq!(reachability(&report, "circles"), &reach((32, 2), none, none, (16, 1), 32));
    assert_eq!(types("widgets"), &json!([{"type": "ns::Widget", "bytes": 80, "blocks": 2}]));
    assert_eq!(reachability(&report, "widgets"), &reach((40, 1), none, none, (40, 1), 40));
    // One call site, two types and a block of none.
    assert_eq!(
        types("mixed"),
        &json!([{"type": "ns::Widget", "bytes": 40, "blocks": 1}, {"type": "Circle", "bytes": 16, "blocks": 1}])
    );
    assert_eq!(reachability(&report, "mixed"), &reach((80, 3), none, none, none, 80));
    let all = &report["inspection"]["types"];
    assert_eq!(
        all,
        &json!([{"type": "ns::Widget", "bytes": 120, "blocks": 3}, {"type": "Circle", "bytes": 64, "blocks": 4}])
    );
    ends_as_without_memprof(&mut target, "set\ndone ok\n");
}

/// `memprof inspect --pid N` (and the `MEMPROF_DAEMON_PASSWORD` it logs in with) against `daemon`.
fn inspect(daemon: &str, pid: u32, more: &[&str]) -> Outcome {
    let pid = pid.to_string();
    let mut memprof = Command::new(memprof_bin());
    memprof.args(["inspect", "--pid", &pid, "--daemon", daemon]).args(more);
    memprof.env("MEMPROF_DAEMON_PASSWORD", "inspect-secret").stdin(Stdio::null());
    memprof.output().expect("starting memprof").into()
}

/// A daemon behind basic auth traces the fixture: `memprof inspect` gets the inspection it makes
/// on request, with the classes `attach --inspect` gives; without credentials, for a pid it does
/// not trace, or with no daemon there, a one-line error that names the fix.
#[test]
fn memprof_inspect_asks_the_daemon_that_traces_the_process() {
    let dir = std::env::temp_dir().join(format!("memprof-inspect-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let web = dir.join("web.yml");
    let hash = bcrypt::hash("inspect-secret", 4).unwrap();
    std::fs::write(&web, format!("basic_auth_users:\n  oncall: '{hash}'\n")).unwrap();
    let mut target = Waiting::start(&fixture(), &[]);
    let pid = target.pid();
    let daemon = Daemon::spawn(&["--pid", &pid.to_string(), "--web-config-file", web.to_str().unwrap()], &[]);
    let url = format!("http://127.0.0.1:{}", daemon.port);
    let targets = || {
        let mut curl = Command::new("curl");
        curl.args(["-s", "-u", "oncall:inspect-secret"]).arg(format!("{url}/api/v1/targets"));
        String::from_utf8(curl.output().ok()?.stdout).ok()
    };
    wait_for(20, "the daemon to trace the fixture", || targets()?.contains(&format!("\"pid\":{pid},")).then_some(()));
    target.go();
    let mut set = String::new();
    BufReader::new(target.child.stdout.as_mut().unwrap()).read_line(&mut set).unwrap();
    assert_eq!(set, "set\n");

    let (status, body) = http_get(daemon.port, &format!("/api/v1/inspect?pid={pid}")).unwrap();
    assert_eq!(status, 401, "no inspection without credentials: {body}");
    let anonymous = inspect(&url, pid, &["--json"]);
    assert_eq!(anonymous.status.code(), Some(1), "{anonymous:?}");
    assert!(anonymous.stderr.contains("give --daemon-user USER"), "{}", anonymous.stderr);

    let outcome = inspect(&url, pid, &["--daemon-user", "oncall", "--format", "json"]);
    assert!(outcome.status.success(), "{outcome:?}");
    assert!(
        outcome.stderr.contains(&format!("memprof: pid {pid} inspected by the daemon at {url}")),
        "{}",
        outcome.stderr
    );
    check(&outcome.final_report());

    let table = inspect(&url, pid, &["--daemon-user", "oncall", "--top", "100"]);
    assert!(table.status.success(), "{table:?}");
    assert!(table.stdout.contains("[definitely lost 160 B in 4 (retaining 160 B)]"), "{}", table.stdout);

    let fix = "memprof attach --pid 1 --inspect --duration SECS";
    let untraced = inspect(&url, 1, &["--daemon-user", "oncall"]);
    assert_eq!(untraced.status.code(), Some(1), "{untraced:?}");
    assert_eq!(untraced.stderr.lines().count(), 1, "{}", untraced.stderr);
    assert!(untraced.stderr.contains("pid 1 is not traced") && untraced.stderr.contains(fix), "{}", untraced.stderr);
    let nobody = inspect(&format!("http://127.0.0.1:{}", free_port()), 1, &[]);
    assert_eq!(nobody.status.code(), Some(1), "{nobody:?}");
    assert!(nobody.stderr.contains("no memprof daemon answers") && nobody.stderr.contains(fix), "{}", nobody.stderr);

    // The daemon's inspection left the process as it was.
    ends_as_without_memprof(&mut target, "done ok\n");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `attach_spans.c`: blocks made after the attach whose only pointers are in blocks made before
/// it, or in a freed block. Classed as memcheck classes them (checked by hand with valgrind on
/// the fixture): the blocks memprof did not see made are marked as blocks, not scanned as roots,
/// and free memory's stale words are no root.
#[test]
fn pointers_from_blocks_made_before_the_attach_and_from_free_memory_class_as_memcheck_does() {
    let fixture = fixture_with("attach_spans.c", "attach_spans", &["-g", "-O0"]);
    let mut target = Waiting::start(&fixture, &[]);
    let outcome = attach(&mut target, &["--inspect", "--duration", "2", "--interval", "1"]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    let none = (0, 0);
    assert_eq!(reachability(&report, "kept_by_keeper"), &reach(none, none, none, (88, 1), 0));
    assert_eq!(reachability(&report, "held_by_holder"), &reach(none, (88, 1), none, none, 0));
    assert_eq!(reachability(&report, "stale_only"), &reach((88, 1), none, none, none, 88));
    // The keeper, reachable, and the holder, lost with what it holds.
    let unseen = &report["inspection"]["untracked_classes"];
    assert_eq!(unseen, &reach((56, 1), none, none, (56, 1), 56 + 88), "{}", report["inspection"]);
    ends_as_without_memprof(&mut target, "set\ndone ok\n");
}

/// `forked_heap.c`: a child whose heap grew after its fork, a second mapping, keeps 20 blocks only
/// through a block ending where the first mapping ends. Reachable: that block was read as the
/// heap's free top chunk, and its blocks called definitely lost.
#[test]
fn blocks_kept_through_a_heap_split_by_a_fork_are_reachable() {
    kept_through_a_heap_split_by_a_fork(&[], |maps| maps.matches("[heap]").count() == 2);
}

/// `forked_heap.c arena`: the same in a thread arena, the parent's thread's, which the child's
/// thread takes over and grows past the end its reservation had at the fork.
#[test]
fn blocks_kept_through_a_thread_arena_split_by_a_fork_are_reachable() {
    kept_through_a_heap_split_by_a_fork(&["arena"], arena_split);
}

/// Whether `maps` (a `/proc/PID/maps`) shows a thread arena's heap in two mappings: one at the
/// start of its reservation (64 MiB aligned), another continuing it, both writable and anonymous.
fn arena_split(maps: &str) -> bool {
    let anonymous: Vec<(u64, u64)> = maps
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (start, end) = fields[0].split_once('-')?;
            let parse = |hex| u64::from_str_radix(hex, 16).ok();
            (fields.len() == 5 && fields[1] == "rw-p").then_some((parse(start)?, parse(end)?))
        })
        .collect();
    anonymous.windows(2).any(|pair| pair[0].0.is_multiple_of(64 << 20) && pair[0].1 == pair[1].0)
}

/// `forked_heap.c` with `args`: memprof attaches to its child, whose heap `split` sees in two
/// mappings, and inspects it; the 20 blocks kept only through the chunk at the split are reachable.
fn kept_through_a_heap_split_by_a_fork(args: &[&str], split: fn(&str) -> bool) {
    let fixture = fixture_with("forked_heap.c", "forked_heap", &["-g", "-O0", "-pthread"]);
    let mut target = Waiting::start(&fixture, args);
    let parent = target.pid();
    let children = std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children")).unwrap();
    let child: u32 = children.trim().parse().expect("one child");
    let maps = std::fs::read_to_string(format!("/proc/{child}/maps")).unwrap();
    assert!(split(&maps), "the child's heap is two mappings: {maps}");
    let outcome = memprof_tests::attach_pid(&mut target, child, &["--inspect", "--duration", "2", "--interval", "1"]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    let none = (0, 0);
    assert_eq!(reachability(&report, "kept_through_x"), &reach(none, none, none, (20 * 64, 20), 0));
    ends_as_without_memprof(&mut target, "set\ndone ok\n");
}

/// `tail_linked.c` keeps 40-byte structures through pointers at their last word, which is also
/// where glibc's next chunk header is: kept so by the program, as memcheck says, each is possibly
/// lost, the 3 made before the attach and the 2 memprof saw made.
#[test]
fn a_block_kept_through_its_last_word_by_the_program_is_possibly_lost() {
    let fixture = fixture_with("tail_linked.c", "tail_linked", &["-g", "-O2"]);
    let mut target = Waiting::start(&fixture, &[]);
    let outcome = attach(&mut target, &["--inspect", "--duration", "2", "--interval", "1"]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    let none = (0, 0);
    // (The loop is unrolled: two stacks.)
    let inspection = &report["inspection"];
    assert_eq!(inspection["totals"], reach(none, none, (2 * 40, 2), none, 0), "{inspection}");
    assert_eq!(inspection["untracked_classes"], reach(none, none, (3 * 40, 3), none, 0), "{inspection}");
    ends_as_without_memprof(&mut target, "set\ndone ok\n");
}

/// `early_leaks.c` makes its blocks before memprof attaches, one after: the inspection classes
/// the one it saw made, and counts the 15 blocks in use it did not (their usable sizes: 6 x 40,
/// 2 x 104, a mapped block of 208880; in a thread's arena 5 x 72; glibc's 280 for the thread),
/// the 13 freed blocks left in malloc's caches not among them.
#[test]
fn attach_inspect_counts_the_blocks_made_before_it() {
    let fixture = fixture_with("early_leaks.c", "early_leaks", &["-g", "-O2", "-pthread"]);
    let mut target = Waiting::start(&fixture, &[]);
    let outcome = attach(&mut target, &["--inspect", "--duration", "2", "--interval", "1"]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    let none = (0, 0);
    assert_eq!(reachability(&report, "made_after"), &reach((48, 1), none, none, none, 48));
    let inspection = &report["inspection"];
    assert_eq!(inspection["untracked_blocks"], 15, "{inspection}");
    assert_eq!(inspection["untracked_bytes"], 6 * 40 + 2 * 104 + 208_880 + 5 * 72 + 280, "{inspection}");
    // Those in the heap, classed: the 6 lost, the thread's glibc block held by a pointer into it,
    // the 7 kept (the block mapped alone is a root, not among them).
    let classes = reach((6 * 40, 6), none, (280, 1), (2 * 104 + 5 * 72, 7), 6 * 40);
    assert_eq!(inspection["untracked_classes"], classes, "{inspection}");
    ends_as_without_memprof(&mut target, "set\ndone ok\n");
}
