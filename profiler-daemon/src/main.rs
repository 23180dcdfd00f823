//! memprof: an eBPF heap profiler. See the README for what it does and how to run it.

mod cli;
mod commands;
mod daemon;
mod error;
mod format;
mod heap;
mod kernel;
mod names;
mod peer;
mod process;
mod ring;
mod symbolize;
mod text;
mod unwind;

use std::{io::IsTerminal as _, process::ExitCode};

/// memprof's allocations stay out of the C library's malloc: its probes, once shared by every
/// process mapping the file, trap in memprof too (about 4 µs a malloc/free pair), and the
/// daemon allocates for every process it attaches to.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::Parser;
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    // The daemon logs each process it starts and stops tracing (info); a session at a terminal
    // says that itself, and logs only what goes wrong.
    let default_filter = match cli.command {
        cli::Command::Daemon(_) => "warn,memprof=info",
        _ => "warn",
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colours only for a person: not in a journal, a file or a pipe.
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(EnvFilter::try_from_env("MEMPROF_LOG").unwrap_or_else(|_| EnvFilter::new(default_filter)))
        .init();
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(err) => return fail(&anyhow::Error::from(err)),
    };
    let result = runtime.block_on(async {
        match &cli.command {
            cli::Command::Attach { pid, trace } => commands::session::attach(*pid, trace).await,
            cli::Command::Run { trace, fail_on_leak_bytes, command } => {
                commands::session::run(command, trace, *fail_on_leak_bytes).await
            }
            cli::Command::Daemon(args) => daemon::run(args).await,
            cli::Command::Snapshot(args) => commands::snapshot::run(args).await,
            cli::Command::Inspect(args) => commands::inspect::run(args),
            cli::Command::Diff(args) => commands::diff::run(args),
            cli::Command::Completions { shell } => commands::manual::completions(*shell),
            cli::Command::Man { dir } => commands::manual::man_pages(dir),
            cli::Command::Report(args) => commands::report::run(args),
        }
    });
    match result {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(err) => fail(&err),
    }
}

/// One line naming the problem; the cause chain joined with ": ".
fn fail(err: &anyhow::Error) -> ExitCode {
    eprintln!("memprof: error: {err:#}");
    ExitCode::FAILURE
}
