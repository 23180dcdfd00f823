//! The workspace's tests, each failed test run once more: the end-to-end tests start real
//! processes on a machine CI shares, and a test that fails twice fails the suite. One that passes
//! the second time is named as flaky at the end, never passed over in silence.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    process::Command,
    sync::mpsc::RecvTimeoutError,
    time::Duration,
};

use anyhow::{bail, Context as _};

const TEST: [&str; 5] = ["test", "--release", "--workspace", "--exclude", "profiler-ebpf"];

pub fn run() -> anyhow::Result<()> {
    let failed = run_collecting_failures(&[])?;
    if failed.is_empty() {
        return Ok(());
    }
    println!("\nxtask: {} test(s) failed; running them once more: {}", failed.len(), failed.join(", "));
    let mut exact = vec!["--exact"];
    exact.extend(failed.iter().map(String::as_str));
    let failed_again = run_collecting_failures(&exact)?;
    if !failed_again.is_empty() {
        bail!("tests failed twice: {}", failed_again.join(", "));
    }
    println!("\nxtask: FLAKY (failed once, passed when run again): {}", failed.join(", "));
    Ok(())
}

/// Runs `cargo test` (libtest's `filter` after `--`), echoing what it prints, and returns the
/// tests that failed. A failure no test is named for (a build, a crashed test binary) is an error.
fn run_collecting_failures(filter: &[&str]) -> anyhow::Result<Vec<String>> {
    let (reader, writer) = std::io::pipe().context("creating a pipe")?;
    // One pipe for both: cargo's "Running" lines and the tests' own lines stay in order.
    let mut cargo = Command::new("cargo")
        .args(TEST)
        .arg("--no-fail-fast")
        .arg("--")
        .args(filter)
        .current_dir(super::root())
        .stdout(writer.try_clone().context("duplicating the pipe")?)
        .stderr(writer)
        .spawn()
        .context("starting cargo test")?;
    // Read on a thread: a process a test left behind may hold the pipe open after cargo ends.
    let (lines, received) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(reader).lines() {
            let Ok(line) = line else { break };
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    let mut failed = Vec::new();
    let mut echo = |line: String| -> anyhow::Result<()> {
        writeln!(std::io::stdout().lock(), "{line}")?;
        if let Some(name) = line.strip_prefix("test ").and_then(|rest| rest.strip_suffix(" ... FAILED")) {
            failed.push(name.to_string());
        }
        Ok(())
    };
    let status = loop {
        match received.recv_timeout(Duration::from_millis(200)) {
            Ok(line) => echo(line)?,
            Err(RecvTimeoutError::Disconnected) => break cargo.wait().context("waiting for cargo test")?,
            Err(RecvTimeoutError::Timeout) => {
                if let Some(status) = cargo.try_wait().context("waiting for cargo test")? {
                    break status;
                }
            }
        }
    };
    // What cargo wrote just before it ended.
    while let Ok(line) = received.recv_timeout(Duration::from_secs(1)) {
        echo(line)?;
    }
    if !status.success() && failed.is_empty() {
        bail!("`cargo {}` failed ({status}) with no test named as failed", TEST.join(" "));
    }
    Ok(failed)
}
