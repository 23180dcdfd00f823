//! A session cut short: SIGHUP (an SSH drop) still writes the report and says where; SIGKILL
//! leaves a recording readable up to its last interval; a file that is no recording is a
//! one-line error.

use std::{
    io::{BufRead, BufReader, Read},
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::Duration,
};

use memprof_tests::{fixture, memprof, memprof_bin, Waiting};
use serde_json::Value;

fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("memprof-recordings-{}-{name}", std::process::id()))
}

/// `memprof attach --pid PID ARGS` on a waiting fixture, returned once it traces, the fixture
/// released.
fn attach_running(target: &mut Waiting, args: &[&str]) -> Child {
    let mut memprof = Command::new(memprof_bin())
        .args(["attach", "--pid", &target.pid().to_string(), "--max-rate", "off", "--interval", "0.2"])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting memprof");
    let mut stderr = BufReader::new(memprof.stderr.as_mut().expect("piped"));
    let mut line = String::new();
    while !line.starts_with("memprof: tracing pid") {
        line.clear();
        assert!(stderr.read_line(&mut line).expect("reading memprof's stderr") > 0, "memprof ended before tracing");
    }
    target.go();
    memprof
}

fn signal(child: &Child, signal: i32) {
    // SAFETY: a plain kill(2) of our own child, which has not been waited for.
    assert_eq!(unsafe { libc::kill(child.id() as i32, signal) }, 0);
}

/// memprof's exit code and the rest of its standard error.
fn finish(mut memprof: Child) -> (Option<i32>, String) {
    let mut rest = String::new();
    memprof.stderr.take().expect("piped").read_to_string(&mut rest).expect("reading memprof's stderr");
    (memprof.wait().expect("waiting for memprof").code(), rest)
}

#[test]
fn a_hang_up_writes_the_report_and_says_where() {
    for (format, check) in [("html", b"<!doctype html>".as_slice()), ("pprof", [0x1f, 0x8b].as_slice())] {
        let mut target = Waiting::start(&fixture("daemon_target"), &[]);
        let output = temp_path(&format!("hangup.{format}"));
        let session = attach_running(&mut target, &["--format", format, "--output", output.to_str().unwrap()]);
        std::thread::sleep(Duration::from_millis(500));
        signal(&session, libc::SIGHUP);
        let (code, stderr) = finish(session);
        assert_eq!(code, Some(0), "{stderr}");
        assert!(stderr.contains(&format!("memprof: wrote {}\n", output.display())), "{stderr}");
        let written = std::fs::read(&output).unwrap();
        assert!(written.starts_with(check), "{format}: {} bytes", written.len());
        let _ = std::fs::remove_file(&output);
    }
}

#[test]
fn a_killed_session_leaves_its_intervals_readable() {
    let mut target = Waiting::start(&fixture("daemon_target"), &[]);
    let recording = temp_path("killed.rec");
    let session = attach_running(&mut target, &["--format", "html", "--record", recording.to_str().unwrap()]);
    std::thread::sleep(Duration::from_millis(1500));
    signal(&session, libc::SIGKILL);
    let (code, _) = finish(session);
    assert_eq!(code, None, "killed");

    let rendered = memprof(&["report", recording.to_str().unwrap(), "--format", "json"]);
    assert!(rendered.status.success(), "{rendered:?}");
    let reports: Vec<Value> = rendered.stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    // 1.5 s at 0.2 s: about seven intervals (a loaded machine may tick fewer times).
    assert!((3..=8).contains(&reports.len()), "{} reports", reports.len());
    assert!(reports.iter().all(|r| r["final"] == false));
    let times: Vec<f64> = reports.iter().map(|r| r["duration_s"].as_f64().unwrap()).collect();
    assert!(times.windows(2).all(|t| t[0] < t[1]), "{times:?}");
    assert!(
        rendered.stderr.starts_with(&format!(
            "memprof: the recording ended early: it ends before the final report (memprof was killed, its disk filled, or it is still recording); it has {} interval reports",
            reports.len()
        )),
        "{}",
        rendered.stderr
    );
    assert_eq!(rendered.stderr.lines().count(), 1, "{}", rendered.stderr);

    // The page of the last interval, with the heap's timeline rebuilt from the intervals.
    let page = memprof(&["report", recording.to_str().unwrap(), "--format", "html"]);
    assert!(page.status.success(), "{page:?}");
    let data = page.stdout.split("id=\"report-data\">").nth(1).unwrap().split("</script>").next().unwrap();
    let report: Value = serde_json::from_str(data).unwrap();
    assert_eq!(report["timeline"]["time_s"].as_array().unwrap().len(), reports.len());
    assert_eq!(report["duration_s"], reports.last().unwrap()["duration_s"]);

    // Cut inside its last record, it still reads to the record before.
    let bytes = std::fs::read(&recording).unwrap();
    std::fs::write(&recording, &bytes[..bytes.len() - 10]).unwrap();
    let cut = memprof(&["report", recording.to_str().unwrap(), "--format", "json"]);
    assert!(cut.status.success(), "{cut:?}");
    assert_eq!(cut.stdout.lines().count(), reports.len() - 1);
    assert!(cut.stderr.contains("its last record is cut short"), "{}", cut.stderr);
    let _ = std::fs::remove_file(&recording);
}

#[test]
fn what_is_not_a_recording_is_a_one_line_error() {
    let file = temp_path("garbage.rec");
    for (content, says) in [
        (
            b"{\"final\": true}\n".as_slice(),
            "is not a memprof recording (one is made by `memprof attach` or `run` with --record FILE)",
        ),
        (b"".as_slice(), "is not a memprof recording"),
        (b"memprof recording 1\n\x05\x00".as_slice(), "holds no complete interval"),
        (b"memprof recording 12\n\x05\x00".as_slice(), "is a recording of format 12, made by a newer memprof"),
    ] {
        std::fs::write(&file, content).unwrap();
        let outcome = memprof(&["report", file.to_str().unwrap(), "--format", "html"]);
        assert_eq!(outcome.status.code(), Some(1), "{outcome:?}");
        assert!(outcome.stdout.is_empty());
        assert_eq!(outcome.stderr.lines().count(), 1, "{}", outcome.stderr);
        assert!(outcome.stderr.starts_with("memprof: error: ") && outcome.stderr.contains(says), "{}", outcome.stderr);
    }
    let _ = std::fs::remove_file(&file);
    let missing = memprof(&["report", "/nonexistent/session.rec"]);
    assert_eq!(missing.stderr, "memprof: error: cannot read the recording /nonexistent/session.rec: No such file or directory (os error 2); check the path\n");
}
