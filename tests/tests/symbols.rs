//! Symbolization: demangled C++ names, inlined frames, processes in their own root,
//! distribution libraries named from their detached debug info, and files that would hold
//! memprof for good if it read them: FIFOs named for debug info, another user's FUSE files.

use std::{fs, path::Path, process::Command};

use memprof_tests::{attach, fixture, fixture_with, own_root, run, site, wait_for, Daemon, Waiting};
use serde_json::Value;
use std::io::BufRead as _;

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
    // As c++filt writes them: cpp_demangle alone writes `app::make<app::Small, >(&&)` and
    // `operator_bytes::operator ""(unsigned long long)`.
    assert_eq!(site(&report, "app::Small* app::make<app::Small>()"), (16, 1), "{report}");
    assert_eq!(site(&report, "operator\"\" _bytes(unsigned long long)"), (24, 1), "{report}");
}

/// A process in its own root (as in a container) uses its own copy of libc: a different inode
/// from the host's, which memprof must probe through /proc/PID/root.
#[test]
fn a_process_in_its_own_root_is_traced_in_its_own_libc() {
    let program = fixture("allocators");
    let root = own_root(&program, "allocators");
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

/// The C library the tests' fixtures map.
const LIBC: &str = "/usr/lib/x86_64-linux-gnu/libc.so.6";

fn tool(program: &str, args: &[&str]) -> String {
    let output = Command::new(program).args(args).output().unwrap_or_else(|e| panic!("starting {program}: {e}"));
    assert!(output.status.success(), "{program} {args:?}: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).expect("UTF-8 output")
}

/// The GNU build id of an ELF file, in hex, as `readelf -n` prints it.
fn build_id(path: &str) -> String {
    let notes = tool("readelf", &["-n", path]);
    let id = notes.lines().find_map(|line| line.trim().strip_prefix("Build ID: "));
    id.unwrap_or_else(|| panic!("{path} has no build id:\n{notes}")).to_string()
}

/// The one stack of distro_debug's 7 strdup copies: strdup in the C library, then keep_copies.
fn strdup_stack(report: &Value) -> &Value {
    let found: Vec<&Value> = report["stacks"]
        .as_array()
        .expect("stacks is an array")
        .iter()
        .filter(|stack| stack["frames"][1]["function"] == "keep_copies")
        .collect();
    assert_eq!(found.len(), 1, "one stack through keep_copies expected: {report}");
    assert_eq!(
        (found[0]["outstanding_bytes"].as_u64(), found[0]["outstanding_allocations"].as_u64()),
        (Some(700), Some(7))
    );
    found[0]
}

/// Debian's libc.so.6 has no DWARF: with libc6-dbg installed (`cargo xtask setup` does), blazesym
/// finds its detached debug file by build id under /usr/lib/debug/.build-id, and the frame of
/// strdup (which calls malloc itself) gets glibc's source file and line, the very ones binutils'
/// addr2line reads from that file.
#[test]
fn a_libc_frame_gets_file_and_line_from_the_detached_debug_file() {
    let sections = tool("readelf", &["-S", "-W", LIBC]);
    assert!(!sections.contains(".debug_line"), "{LIBC} has line tables of its own: this test proves nothing");
    let id = build_id(LIBC);
    let debug_file = format!("/usr/lib/debug/.build-id/{}/{}.debug", &id[..2], &id[2..]);
    assert!(Path::new(&debug_file).exists(), "{debug_file} is missing: install libc6-dbg (`cargo xtask setup`)");

    let program = fixture("distro_debug");
    let outcome = run(&["--interval", "3600"], &[program.to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    let strdup = &strdup_stack(&report)["frames"][0];
    assert_eq!(strdup["module"], LIBC, "{report}");

    // Where addr2line looks: the call before the return address, as a libc address.
    let base = outcome.stderr.lines().find_map(|line| line.strip_prefix("libc_base 0x"));
    let base = u64::from_str_radix(base.expect("the fixture prints libc_base"), 16).expect("hex");
    let address = strdup["address"].as_str().and_then(|a| a.strip_prefix("0x")).expect("a hex address");
    let call = u64::from_str_radix(address, 16).expect("hex") - base - 1;
    let answer = tool("addr2line", &["-f", "-e", &debug_file, &format!("{call:#x}")]);
    let (function, place) = answer.trim().split_once('\n').expect("addr2line prints two lines");
    let (path, line) = place.rsplit_once(':').expect("file:line");
    // glibc's own source tree: ./string/strdup.c (its DW_AT_name keeps the directory twice).
    assert!(path.ends_with("string/strdup.c"), "addr2line says {answer}");
    // addr2line names glibc's internal alias (`__GI___strdup`); memprof the function it aliases.
    assert_eq!(strdup["function"], function.trim_start_matches("__GI_"), "{strdup}");
    assert_eq!(strdup["file"], "strdup.c", "{strdup}");
    assert_eq!(strdup["line"].as_u64(), Some(line.parse().expect("a line number")), "{strdup}");
}

/// The same frame when no debug file matches the library: a copy of libc.so.6 whose build id is
/// changed gets only the name of its exported symbol, and no file or line. Both tests together
/// show that the file and line above come from libc6-dbg, not from libc.so.6.
#[test]
fn a_libc_frame_without_a_debug_file_has_only_its_symbol() {
    let dir = std::env::temp_dir().join(format!("memprof-nodebug-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    let copy = dir.join("libc.so.6");
    let mut bytes = fs::read(LIBC).unwrap();
    let id: Vec<u8> = (0..20).map(|i| u8::from_str_radix(&build_id(LIBC)[2 * i..2 * i + 2], 16).unwrap()).collect();
    let at: Vec<usize> = bytes.windows(id.len()).enumerate().filter(|(_, w)| *w == id).map(|(i, _)| i).collect();
    assert_eq!(at.len(), 1, "the build id must appear once in {LIBC}, in its note");
    for byte in &mut bytes[at[0]..at[0] + id.len()] {
        *byte = !*byte;
    }
    fs::write(&copy, bytes).unwrap();

    let program = fixture("distro_debug");
    let mut command = Command::new(&program);
    command.arg("--wait").env("LD_LIBRARY_PATH", &dir);
    let mut target = Waiting::start_command(command);
    let outcome = attach(&mut target, &["--interval", "60"]);
    drop(target);
    let _ = fs::remove_dir_all(&dir);
    assert!(outcome.stderr.contains(&format!("probes in {}", copy.display())), "{}", outcome.stderr);
    let report = outcome.final_report();
    let strdup = &strdup_stack(&report)["frames"][0];
    assert_eq!(strdup["module"], copy.to_str().unwrap(), "{report}");
    // strdup is a weak alias of __strdup in .dynsym: either name is the symbol.
    assert!(["strdup", "__strdup"].contains(&strdup["function"].as_str().unwrap_or("")), "{strdup}");
    assert_eq!((&strdup["file"], &strdup["line"]), (&Value::Null, &Value::Null), "{strdup}");
}

/// Programs that name a FIFO for their debug information: blazesym would open the FIFO and wait
/// for a writer for good, and memprof with it. memprof names their frames from their symbol
/// table instead, and finishes.
#[test]
fn a_fifo_named_for_debug_information_blocks_nothing() {
    // A stripped program's debug link names a FIFO beside it, in a directory others may add
    // files to.
    let beside = Hostile::new("beside", 0o777, true);
    // objcopy reads the debug file for its checksum, and names it by its file name.
    let debug = beside.dir.join("elsewhere").join(beside.fifo.file_name().unwrap());
    fs::create_dir(debug.parent().unwrap()).unwrap();
    objcopy(&["--only-keep-debug".as_ref(), beside.program.as_ref(), debug.as_ref()]);
    let link = format!("--add-gnu-debuglink={}", debug.display());
    objcopy(&["--strip-debug".as_ref(), link.as_ref(), beside.program.as_ref()]);
    fs::remove_file(&debug).unwrap();
    beside.assert_memprof_finishes();

    // dwz's supplementary file (`.gnu_debugaltlink`, a path and a build id) is a FIFO elsewhere.
    let altlink = Hostile::new("altlink", 0o777, false);
    altlink.add_section(".gnu_debugaltlink", &[altlink.fifo.as_os_str().as_encoded_bytes(), &[0], &[7; 20]].concat());
    altlink.assert_memprof_finishes();

    // In a directory of root's, a debug link whose name is a path leads to a FIFO elsewhere.
    let path = Hostile::new("path", 0o755, false);
    let mut name = [path.fifo.as_os_str().as_encoded_bytes(), &[0]].concat();
    name.resize(name.len().next_multiple_of(4) + 4, 0);
    path.add_section(".gnu_debuglink", &name);
    path.assert_memprof_finishes();
}

/// A program whose line table lists only file 0 while its rows name file 1: a malformed
/// `.debug_line` any user can ship, on which blazesym panics. memprof names its frames from its
/// symbol table: its symbolizer lives on (it died, and every process's frames went unnamed).
#[test]
fn a_malformed_line_table_costs_its_lines_not_the_symbolizer() {
    let dir = std::env::temp_dir().join(format!("memprof-lines-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir(&dir).unwrap();
    let (program, lines) = (dir.join("short_prog"), dir.join("debug_line"));
    fs::copy(fixture("short_prog"), &program).unwrap();
    let dump = format!(".debug_line={}", lines.display());
    objcopy(&["--dump-section".as_ref(), dump.as_ref(), program.as_ref(), "/dev/null".as_ref()]);
    let mut section = fs::read(&lines).unwrap();
    keep_only_file_zero(&mut section);
    fs::write(&lines, &section).unwrap();
    objcopy(&["--update-section".as_ref(), dump.as_ref(), program.as_ref()]);
    let outcome = run(&[], &[program.to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    assert!(outcome.stderr.contains("its debugging information could not be read"), "{}", outcome.stderr);
    // Named by the symbolizer that met the panic: it lived on.
    let report = outcome.final_report();
    assert_eq!(site(&report, "kept_site"), (1000, 10), "{report}");
    assert_eq!(site(&report, "first_site"), (48, 1), "{report}");
    fs::remove_dir_all(&dir).unwrap();
}

/// Sets the file count of the first line program in `section` (DWARF 5, as GCC writes it) to 1:
/// only file 0 is left, and its rows, which start at file 1, name a file it does not list.
fn keep_only_file_zero(section: &mut [u8]) {
    let uleb = |bytes: &[u8], at: &mut usize| {
        let (mut value, mut shift) = (0u64, 0);
        loop {
            let byte = bytes[*at];
            *at += 1;
            value |= u64::from(byte & 0x7f) << shift;
            shift += 7;
            if byte & 0x80 == 0 {
                return value;
            }
        }
    };
    assert_eq!(u16::from_le_bytes([section[4], section[5]]), 5, "a DWARF 5 line table");
    // unit_length, version, address and selector sizes, header_length, then five one-byte fields.
    let mut at = 4 + 2 + 1 + 1 + 4 + 5;
    let opcode_base = section[at] as usize;
    at += opcode_base;
    // The directories, then the files: each a list of (content, form) pairs and their entries.
    for list in ["directories", "files"] {
        let pairs = section[at] as usize;
        at += 1;
        let forms: Vec<u64> = (0..pairs).map(|_| (uleb(section, &mut at), uleb(section, &mut at)).1).collect();
        if list == "files" {
            assert!(section[at] > 1 && section[at] < 0x80, "files: {}", section[at]);
            section[at] = 1;
            return;
        }
        for _ in 0..uleb(section, &mut at) {
            for form in &forms {
                match form {
                    0x1f | 0x0e => at += 4,               // DW_FORM_line_strp, DW_FORM_strp
                    0x0b => at += 1,                      // DW_FORM_data1
                    0x05 => at += 2,                      // DW_FORM_data2
                    0x1e => at += 16,                     // DW_FORM_data16
                    0x0f => drop(uleb(section, &mut at)), // DW_FORM_udata
                    0x08 => at += section[at..].iter().position(|&b| b == 0).unwrap() + 1, // DW_FORM_string
                    other => panic!("directory form {other:#x}"),
                }
            }
        }
    }
}

fn objcopy(args: &[&std::ffi::OsStr]) {
    assert!(Command::new("objcopy").args(args).status().unwrap().success(), "objcopy {args:?}");
}

/// A copy of `short_prog` in a directory of its own, and the FIFO it is to name.
struct Hostile {
    dir: std::path::PathBuf,
    program: std::path::PathBuf,
    fifo: std::path::PathBuf,
}

impl Hostile {
    /// The directory has `mode`; the FIFO is beside the program (`short_prog.debug`) or in a
    /// directory any user may write to.
    fn new(case: &str, mode: u32, fifo_beside: bool) -> Self {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("memprof-fifo-{case}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir(&dir).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(mode)).unwrap();
        let program = dir.join("short_prog");
        fs::copy(fixture("short_prog"), &program).unwrap();
        let fifo = if fifo_beside {
            dir.join("short_prog.debug")
        } else {
            let elsewhere = dir.join("elsewhere");
            fs::create_dir(&elsewhere).unwrap();
            fs::set_permissions(&elsewhere, fs::Permissions::from_mode(0o777)).unwrap();
            elsewhere.join("debug")
        };
        assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        Self { dir, program, fifo }
    }

    fn add_section(&self, name: &str, bytes: &[u8]) {
        let data = self.dir.join("section");
        fs::write(&data, bytes).unwrap();
        let section = format!("{name}={}", data.display());
        objcopy(&["--add-section".as_ref(), section.as_ref(), self.program.as_ref()]);
    }

    fn assert_memprof_finishes(&self) {
        use std::os::unix::fs::OpenOptionsExt as _;
        let finished = std::sync::mpsc::channel();
        let command = self.program.to_str().unwrap().to_string();
        std::thread::spawn(move || finished.0.send(run(&[], &[&command])));
        let outcome = finished.1.recv_timeout(std::time::Duration::from_secs(60));
        // Unblocks a memprof that waits on the FIFO, so that the test ends either way.
        let _ = fs::OpenOptions::new().write(true).custom_flags(libc::O_NONBLOCK).open(&self.fifo);
        let report = outcome.unwrap_or_else(|_| panic!("memprof waited on {}", self.fifo.display())).final_report();
        assert_eq!(site(&report, "kept_site"), (1000, 10), "{report}");
    }
}

impl Drop for Hostile {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// A program run from another user's FUSE file system, whose server answers every request but
/// memprof's (as a user's own server may, where /etc/fuse.conf lets users allow others in):
/// memprof leaves the program's file alone, says so, and traces its allocations in the C
/// library all the same.
#[test]
fn a_users_fuse_server_that_never_answers_memprof_holds_it_not() {
    traced_from_a_server_that_never_answers_memprof(None, "from another user's FUSE file system");
}

/// The same from root's own FUSE file system, as a hung server (or a network file system whose
/// server is gone) would do: memprof looks at the file only while the file system answers.
#[test]
fn a_file_system_that_stops_answering_holds_memprof_not() {
    traced_from_a_server_that_never_answers_memprof(Some("root"), "from a file system that did not answer within 2 s");
}

/// Attaches to `daemon_target` run from `fuse_stall.py`'s file system (mounted with `owner`'s
/// argument), which never answers memprof: memprof says `said`, and counts the 50 blocks of 1,000
/// bytes the program allocates in the C library.
fn traced_from_a_server_that_never_answers_memprof(owner: Option<&str>, said: &str) {
    let served = serve_a_program_that_never_answers_memprof(owner);
    let mut target = Waiting::start(&served.mount.join("prog"), &[]);
    let program = target.pid() as i32;
    let finished = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let outcome = attach(&mut target, &["--duration", "2"]);
        let _ = target.child.kill();
        finished.0.send(outcome)
    });
    let outcome = finished.1.recv_timeout(std::time::Duration::from_secs(60));
    // Killing the server ends its file system: a memprof still waiting gets an error.
    drop(served);
    // SAFETY: a signal to the program this test started.
    unsafe { libc::kill(program, libc::SIGKILL) };
    let outcome = outcome.expect("memprof finished");
    assert!(outcome.stderr.contains(said), "{}", outcome.stderr);
    let report = outcome.final_report();
    let held = report["stacks"].as_array().unwrap().iter().find(|stack| stack["outstanding_allocations"] == 50);
    assert_eq!(held.map(|stack| &stack["outstanding_bytes"]), Some(&Value::from(50_000)), "{report}");
}

/// The daemon, asked to trace a program on a file system that stopped answering and another
/// program: it traces the other as usual, and SIGTERM stops it.
#[test]
fn a_file_system_that_stops_answering_keeps_the_daemon_from_nothing() {
    let served = serve_a_program_that_never_answers_memprof(Some("root"));
    let mut stalled = Waiting::start(&served.mount.join("prog"), &[]);
    let finished = std::sync::mpsc::channel();
    let stalled_pid = stalled.pid();
    std::thread::spawn(move || {
        let mut other = Waiting::start(&fixture("daemon_target"), &[]);
        let mut daemon = Daemon::start(&["--pid", &stalled_pid.to_string(), "--pid", &other.pid().to_string()]);
        daemon.wait_traced(other.pid());
        other.go();
        let leaks = format!("/api/v1/leaks?pid={}", other.pid());
        let held = wait_for(20, "the other program's held blocks", || {
            let held = site(&daemon.get_json(&leaks).1, "hold_site");
            (held == (50_000, 50)).then_some(held)
        });
        daemon.signal(libc::SIGTERM);
        let status = wait_for(20, "the daemon to stop", || daemon.child.try_wait().ok().flatten());
        finished.0.send((held, status, daemon.log()))
    });
    stalled.go();
    let outcome = finished.1.recv_timeout(std::time::Duration::from_secs(120));
    // Killing the server ends its file system: a daemon still waiting on it gets an error, and
    // can then be reaped.
    drop(served);
    let _ = stalled.child.kill();
    let (held, status, log) = outcome.expect("the daemon traced the other program and stopped");
    assert_eq!(held, (50_000, 50));
    assert!(status.success(), "{status:?}");
    assert!(log.contains("from a file system that did not answer within 2 s"), "{log}");
}

/// A process in a mount namespace of its own (as in a container) execs a program from a path
/// that, in memprof's own mounts, lies on a file system that never answers memprof. memprof does
/// not look there: it finishes with its report whether the process is still running (`exec`,
/// then `sleep`) or gone at once (`new-image`, whose blocks it counts).
#[test]
fn a_containers_program_on_a_path_the_hosts_mounts_would_hang_holds_memprof_not() {
    for (args, allocations) in [("exec /bin/sleep 1", None), ("new-image", Some((7 * 512, 7)))] {
        let served = serve_a_program_that_never_answers_memprof(Some("root"));
        let mount = served.mount.display().to_string();
        // In its own mounts the process takes the stalled file system off and puts a tmpfs with
        // the fixture in its place: it never sees the stall, memprof does.
        let script = format!(
            "umount -l {mount} && mount -t tmpfs none {mount} && cp {} {mount}/prog && exec {mount}/prog {args}",
            fixture("process_life").display()
        );
        let command: Vec<String> = ["unshare", "--mount", "--propagation", "private", "sh", "-c"]
            .map(String::from)
            .into_iter()
            .chain([script])
            .collect();
        let finished = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let command: Vec<&str> = command.iter().map(String::as_str).collect();
            finished.0.send(run(&[], &command))
        });
        let outcome = finished.1.recv_timeout(std::time::Duration::from_secs(60));
        // Killing the server ends its file system: a memprof still waiting gets an error.
        drop(served);
        let outcome = outcome.unwrap_or_else(|_| panic!("memprof waited on {mount}"));
        assert!(outcome.status.success(), "{outcome:?}");
        let report = outcome.final_report();
        // By totals: a walk made before the program's unwind table was built (counted as
        // `unwind_no_table`) puts a block under a shorter stack of its own.
        if let Some((bytes, count)) = allocations {
            let totals = &report["totals"];
            assert_eq!(
                (&totals["outstanding_bytes"], &totals["outstanding_allocations"]),
                (&bytes.into(), &count.into()),
                "{report}"
            );
        }
    }
}

/// `fuse_stall.py` serving a copy of `daemon_target` as `prog`, mounted with `owner`'s argument.
fn serve_a_program_that_never_answers_memprof(owner: Option<&str>) -> Served {
    // Tests run at once: each server in a directory of its own.
    static SERVED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let number = SERVED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("memprof-fuse-{}-{number}", std::process::id()));
    let mount = dir.join("mnt");
    fs::create_dir_all(&mount).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/fuse_stall.py");
    let mut server = Command::new("python3")
        .args([script, fixture("daemon_target"), mount.clone()])
        .args(owner)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut mounted = String::new();
    std::io::BufReader::new(server.stdout.as_mut().unwrap()).read_line(&mut mounted).unwrap();
    assert_eq!(mounted, "mounted\n", "the FUSE server did not mount");
    Served { server, mount, dir }
}

/// The FUSE server, its mount and their directory, gone with it.
struct Served {
    server: std::process::Child,
    mount: std::path::PathBuf,
    dir: std::path::PathBuf,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
        let _ = Command::new("umount").arg("-l").arg(&self.mount).status();
        let _ = fs::remove_dir_all(&self.dir);
    }
}
