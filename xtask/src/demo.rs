//! `cargo xtask demo`: builds memprof, starts the bundled leaky server and attaches to it.

use std::process::{Command, Stdio};

use anyhow::{bail, Context as _};

use crate::{build_memprof, root};

pub fn run() -> anyhow::Result<()> {
    let memprof = build_memprof()?;
    let out_dir = root().join("target/demo");
    std::fs::create_dir_all(&out_dir)?;
    let server = out_dir.join("leaky_server");
    let source = root().join("demo/leaky_server.c");
    crate::compile_c(&source, &server, &["-g", "-O1", "-fno-omit-frame-pointer", "-pthread"])?;
    let mut patient = Command::new(&server).stdout(Stdio::null()).spawn().context("starting the demo server")?;
    let pid = patient.id().to_string();
    println!("$ sudo memprof attach --pid {pid} --interval 2 --duration 9 --leak-window 3 --top 3");
    let status = Command::new(&memprof)
        .args(["attach", "--pid", &pid, "--interval", "2", "--duration", "9", "--leak-window", "3", "--top", "3"])
        .status()
        .context("starting memprof");
    let _ = patient.kill();
    let _ = patient.wait();
    if !status?.success() {
        bail!("memprof failed; it needs root (try: sudo -E cargo xtask demo)");
    }
    println!(
        "The demo server leaks in two places, and memprof flags both as leak candidates (LEAK ends in !): the cache remember() fills is never \
         trimmed, and sessions from open_session() are not closed on handle_request's error path."
    );
    Ok(())
}
