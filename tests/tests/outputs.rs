//! Report files: an existing file is replaced only by a complete report, whatever happens to
//! memprof; a signal that ends the session writes the final report; a full disk is said plainly.

use std::{
    fs,
    io::{BufRead as _, BufReader},
    path::Path,
    process::{Child, ChildStderr, Command, Stdio},
};

use memprof_tests::{fixture, memprof, memprof_bin, peak_memory, Outcome, Scratch};
use serde_json::Value;

/// What a test's directory (a `Scratch`, empty when made) holds: anything besides the report is a
/// leftover.
fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

/// `memprof run --format html --output REPORT -- sleep 30`, once it says it is tracing; with
/// the rest of what it says.
fn tracing_sleep(report: &Path) -> (Child, BufReader<ChildStderr>) {
    let mut memprof = Command::new(memprof_bin())
        .args(["run", "--format", "html", "--output", report.to_str().unwrap(), "--", "sleep", "30"])
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting memprof");
    let mut stderr = BufReader::new(memprof.stderr.take().unwrap());
    said_line(&mut stderr, "memprof: tracing");
    (memprof, stderr)
}

/// The next line memprof says that starts with `start`.
fn said_line(stderr: &mut BufReader<ChildStderr>, start: &str) -> String {
    let mut line = String::new();
    while !line.starts_with(start) {
        line.clear();
        assert!(stderr.read_line(&mut line).unwrap() > 0, "memprof ended before saying {start:?}");
    }
    line
}

fn signal(child: &Child, signal: i32) {
    // SAFETY: a plain kill(2) of our own child.
    assert_eq!(unsafe { libc::kill(child.id() as i32, signal) }, 0);
}

#[test]
fn a_failed_attach_leaves_the_previous_report_untouched() {
    let dir = Scratch::new("outputs", "failed");
    let report = dir.join("report.json");
    fs::write(&report, "previous").unwrap();
    // A pid that cannot be a process's (the kernel's default pid_max is below it).
    let outcome = memprof(&["attach", "--pid", "4194303", "--json", "--output", report.to_str().unwrap()]);
    assert!(!outcome.status.success(), "{outcome:?}");
    assert_eq!(fs::read_to_string(&report).unwrap(), "previous");
    assert_eq!(entries(dir.path()), ["report.json"]);
}

#[test]
fn memprof_killed_midway_leaves_the_previous_report_whole_and_nothing_else() {
    let dir = Scratch::new("outputs", "killed");
    let report = dir.join("report.html");
    fs::write(&report, "previous").unwrap();
    let (mut memprof, _) = tracing_sleep(&report);
    signal(&memprof, libc::SIGKILL);
    memprof.wait().unwrap();
    assert_eq!(fs::read_to_string(&report).unwrap(), "previous");
    assert_eq!(entries(dir.path()), ["report.html"]);
}

/// SIGTERM or SIGHUP sent to memprof alone: its command runs on, and memprof waits for it,
/// saying so after 2 s. A second one ends the session with its final report, leaves the command
/// running and exits with 128 + N.
#[test]
fn sigterm_and_sighup_end_the_session_with_its_final_report() {
    for (name, number) in [("SIGTERM", libc::SIGTERM), ("SIGHUP", libc::SIGHUP)] {
        let dir = Scratch::new("outputs", name);
        let report = dir.join("report.html");
        fs::write(&report, "previous").unwrap();
        let (mut memprof, mut stderr) = tracing_sleep(&report);
        signal(&memprof, number);
        let waits = said_line(&mut stderr, "memprof: pid ");
        assert!(
            waits
                .contains(&format!("(sleep) still runs 2 s after {name}: traced until it exits; signal memprof again")),
            "{waits}"
        );
        signal(&memprof, number);
        let left = said_line(&mut stderr, "memprof: pid ");
        assert!(left.ends_with(&format!("runs on untraced; memprof exits with {}\n", 128 + number)), "{left}");
        let status = memprof.wait().unwrap();
        assert_eq!(status.code(), Some(128 + number), "{name}: {status}");
        let sleep: i32 = left["memprof: pid ".len()..].split(' ').next().unwrap().parse().unwrap();
        // SAFETY: a plain kill(2) of the `sleep` memprof started and left running.
        assert_eq!(unsafe { libc::kill(sleep, libc::SIGKILL) }, 0, "the command runs on");
        let html = fs::read_to_string(&report).unwrap();
        assert!(html.trim_end().ends_with("</html>"), "{name}: an incomplete page: {html}");
        assert_eq!(entries(dir.path()), ["report.html"], "{name}");
    }
}

/// A directory of its own on a file system of `kib` KiB: `unmount` it after.
fn small_disk(test: &str, kib: usize) -> Scratch {
    let dir = Scratch::new("outputs", test);
    let size = format!("size={kib}k");
    let mounted = Command::new("mount").args(["-t", "tmpfs", "-o", &size, "tmpfs"]).arg(dir.path()).status().unwrap();
    assert!(mounted.success(), "mounting a small tmpfs");
    dir
}

/// Unmounts a `small_disk`, which is then removed when dropped.
fn unmount(dir: &Scratch) {
    assert!(Command::new("umount").arg(dir.path()).status().unwrap().success());
}

/// memprof said in one line, its last, that it could not write the output file for lack of
/// space, and ran the command on to its end: its exit code is the command's (see run_harmless.rs).
fn said_the_disk_is_full(outcome: &Outcome) {
    assert!(outcome.status.success(), "{outcome:?}");
    let error = outcome.stderr.lines().last().unwrap();
    assert!(
        error.starts_with("memprof: cannot go on: cannot write the output file")
            && error.contains("No space left on device"),
        "{}",
        outcome.stderr
    );
    assert_eq!(error.matches("No space left").count(), 1, "said once: {error}");
}

/// A file system too small for the report: memprof says so in one line, exits with the command's
/// code, and the previous report stays.
#[test]
fn a_full_disk_is_reported_and_the_previous_report_kept() {
    let dir = small_disk("full", 16);
    let report = dir.join("report.html");
    fs::write(&report, "previous").unwrap();
    let outcome = memprof(&[
        "run",
        "--format",
        "html",
        "--output",
        report.to_str().unwrap(),
        "--",
        fixture("reports").to_str().unwrap(),
    ]);
    let kept = fs::read_to_string(&report).unwrap();
    let left = entries(dir.path());
    unmount(&dir);
    said_the_disk_is_full(&outcome);
    assert_eq!(kept, "previous");
    assert_eq!(left, ["report.html"]);
}

/// Streamed reports (`--json`, one a line every interval: `reports.c`'s, some 7 KiB each) until the
/// disk is full: the report it cuts short is taken back, and the file holds the reports before it,
/// each whole. memprof says so in one line, and the command runs on to its end.
#[test]
fn a_streamed_report_cut_by_a_full_disk_is_taken_back() {
    const STREAMED_KIB: usize = 64;
    let dir = small_disk("streamed", STREAMED_KIB);
    let report = dir.join("reports.json");
    let program = fixture("reports");
    let outcome = memprof(&[
        "run",
        "--json",
        "--interval",
        "0.1",
        "--output",
        report.to_str().unwrap(),
        "--",
        program.to_str().unwrap(),
    ]);
    let kept = fs::read_to_string(&report).unwrap();
    let left = entries(dir.path());
    unmount(&dir);
    said_the_disk_is_full(&outcome);
    assert_eq!(left, ["reports.json"]);
    // Cut, the file would have filled the disk, ending mid-report.
    assert!(kept.len() < STREAMED_KIB << 10 && kept.ends_with('\n'), "a report cut short was kept: {kept}");
    let reports: Vec<Value> = kept
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|err| panic!("{err}: not a whole report: {line}")))
        .collect();
    assert!(reports.len() >= 2, "the disk filled at the first report: {kept}");
    assert!(reports.iter().all(|report| report["final"] != true), "the final report fitted: {kept}");
}

/// 65,536 distinct deep stacks (`many_stacks.c`) drawn by `run`: the HTML page and the flame
/// graph hold the largest stacks that fit their budget and say how many they leave out, and memprof
/// stays far below the 10 to 22 GB that drawing them all took (docs: outputs/flame-and-html.md).
#[test]
fn sixty_five_thousand_deep_stacks_are_drawn_within_bounds() {
    let dir = Scratch::new("outputs", "many-stacks");
    // Its output away from memprof's stderr, which is read to its end; it sleeps once done.
    let program = format!("exec {} >/dev/null 2>&1", fixture("many_stacks").display());
    for format in ["html", "flamegraph"] {
        let report = dir.join(format!("many.{format}"));
        let mut command = Command::new(memprof_bin());
        command.args(["run", "--max-rate", "off", "--duration", "6", "--format", format, "--output"]);
        command.args([report.to_str().unwrap(), "--", "sh", "-c", &program]);
        let (code, stderr, peak) = peak_memory(&mut command);
        let pid: i32 =
            stderr.split("tracing pid ").nth(1).and_then(|rest| rest.split(' ').next()?.parse().ok()).unwrap();
        // SAFETY: a signal to the fixture memprof left running.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        eprintln!("{format}: memprof's peak {} MiB", peak >> 20);
        assert_eq!(code, Some(0), "{stderr}");
        assert!(peak < 1 << 30, "{format}: peak {} MiB", peak >> 20);
        let drawn = fs::read_to_string(&report).unwrap();
        assert!(drawn.len() < 64 << 20, "{format}: {} bytes", drawn.len());
        // The page's JSON holds the count; the flame graph's subtitle says it.
        let left_out = match format {
            "html" => drawn.split("\"stacks_not_shown\":").nth(1).and_then(|rest| rest.split([',', '}']).next()),
            _ => drawn.split(" smaller stacks left out").next().and_then(|before| before.rsplit(' ').next()),
        };
        let left_out: u64 =
            left_out.and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{format}: no count left out"));
        assert!(left_out > 60_000, "{format}: {left_out} left out");
    }
}

#[test]
fn a_pipe_or_device_is_written_to_not_replaced() {
    // A rename over `--output /dev/null` had left the host a regular file there.
    let dir = Scratch::new("outputs", "fifo");
    let fifo = dir.join("reports");
    let path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0, "mkfifo");
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || fs::read_to_string(fifo).unwrap())
    };
    let program = fixture("peaks");
    let outcome = memprof(&["run", "--json", "--output", fifo.to_str().unwrap(), "--", program.to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    let text = reader.join().unwrap();
    assert!(text.lines().last().is_some_and(|line| line.starts_with("{\"final\":true")), "{text}");
    use std::os::unix::fs::FileTypeExt as _;
    assert!(fs::metadata(&fifo).unwrap().file_type().is_fifo(), "the FIFO was replaced");
    assert_eq!(entries(dir.path()), ["reports"]);
}

/// An output path that is a symbolic link: root's own (as `/dev/stdout` is) leads to its target,
/// which is replaced while the link stays; another user's is refused, as are a disk's device
/// and another user's pipe, each in one line, before the command runs.
#[test]
fn links_are_followed_only_when_root_owns_them_and_disks_are_never_written() {
    let dir = Scratch::new("outputs", "links");
    let target = dir.join("target.json");
    fs::write(&target, "old").unwrap();
    let ours = dir.join("ours.json");
    std::os::unix::fs::symlink(&target, &ours).unwrap();
    let outcome = memprof(&["run", "--json", "--output", ours.to_str().unwrap(), "--", "true"]);
    assert!(outcome.status.success(), "{}", outcome.stderr);
    assert!(fs::symlink_metadata(&ours).unwrap().file_type().is_symlink(), "the link stays a link");
    assert!(fs::read_to_string(&target).unwrap().contains("\"final\":true"), "the report replaced its target");

    let theirs = dir.join("theirs.json");
    std::os::unix::fs::symlink(&target, &theirs).unwrap();
    assert!(Command::new("chown").args(["-h", "nobody"]).arg(&theirs).status().unwrap().success());
    // A loop device's node with no file attached: writing it would fail anyway.
    let disk = dir.join("disk");
    assert!(Command::new("mknod").arg(&disk).args(["b", "7", "250"]).status().unwrap().success());
    // Another user's pipe would hand them the report, or keep memprof waiting for a reader.
    let their_pipe = dir.join("their_pipe");
    assert!(Command::new("mkfifo").arg(&their_pipe).status().unwrap().success());
    assert!(Command::new("chown").arg("nobody").arg(&their_pipe).status().unwrap().success());
    for (output, reason) in [
        (&theirs, "a symbolic link another user owns"),
        (&disk, "a block device"),
        (&their_pipe, "a pipe another user owns"),
    ] {
        let outcome = memprof(&["run", "--json", "--output", output.to_str().unwrap(), "--", "true"]);
        assert_eq!(outcome.status.code(), Some(1), "{}", outcome.stderr);
        assert_eq!(outcome.stderr.lines().count(), 1, "{}", outcome.stderr);
        assert!(outcome.stderr.contains(reason), "{}", outcome.stderr);
    }
}

/// `-o -` is standard output, as for most tools: it made a file named `-`.
#[test]
fn a_dash_as_output_is_standard_output() {
    let dir = Scratch::new("outputs", "dash");
    let outcome = Command::new(memprof_bin())
        .current_dir(dir.path())
        .args(["run", "--json", "-o", "-", "--", "true"])
        .stdin(Stdio::null())
        .output()
        .expect("running memprof");
    assert!(outcome.status.success(), "{outcome:?}");
    assert!(String::from_utf8_lossy(&outcome.stdout).contains("\"final\":true"), "{outcome:?}");
    assert!(!dir.join("-").exists(), "a file named -");
}

/// `-o /dev/stdout` writes the descriptor memprof was given, as a shell's `>` or `>>` gave it:
/// a file since deleted, or one opened for appending. It was reopened by its path, which named
/// nothing for a deleted file: the report replaced the host's `/dev/stdout` link.
#[test]
fn standard_output_named_as_a_path_is_the_descriptor_given() {
    use std::io::{Read as _, Seek as _};
    let dir = Scratch::new("outputs", "stdout");
    let deleted = dir.join("deleted.json");
    let mut file = fs::File::options().read(true).write(true).create(true).truncate(true).open(&deleted).unwrap();
    fs::remove_file(&deleted).unwrap();
    let appended = dir.join("appended.json");
    fs::write(&appended, "before\n").unwrap();
    let log = fs::OpenOptions::new().append(true).open(&appended).unwrap();
    for stdout in [file.try_clone().unwrap(), log] {
        let status = Command::new(memprof_bin())
            .args(["run", "--json", "-o", "/dev/stdout", "--", "true"])
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(Stdio::null())
            .status()
            .expect("running memprof");
        assert!(status.success());
    }
    let mut text = String::new();
    file.rewind().unwrap();
    file.read_to_string(&mut text).unwrap();
    assert!(text.contains("\"final\":true"), "{text}");
    let appended = fs::read_to_string(&appended).unwrap();
    assert!(appended.starts_with("before\n{\"final\":true"), "{appended}");
    assert!(fs::symlink_metadata("/dev/stdout").unwrap().file_type().is_symlink());
    // A descriptor memprof was not given is none of its own files either.
    let outcome = memprof(&["run", "--json", "-o", "/dev/fd/9", "--", "true"]);
    assert_eq!(outcome.status.code(), Some(1), "{outcome:?}");
    assert!(outcome.stderr.contains("memprof was given no descriptor 9"), "{}", outcome.stderr);
}
