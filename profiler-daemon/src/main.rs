//! memprof: an eBPF heap profiler. See the README for what it does and how to run it.

mod ages;
mod aggregate;
mod allocator;
mod batch;
mod btf;
mod cli;
mod daemon;
mod diff;
mod error;
mod family;
mod filter;
mod format;
mod leak;
mod loader;
mod probes;
mod process;
mod procfs;
mod report;
mod sampling;
mod session;
mod snapshot;
mod symbolize;
mod target;
mod unwind;
mod uprobe_multi;

use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(EnvFilter::try_from_env("MEMPROF_LOG").unwrap_or_else(|_| EnvFilter::new("warn")))
        .init();
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(err) => return fail(&anyhow::Error::from(err)),
    };
    let result = runtime.block_on(async {
        match &cli.command {
            cli::Command::Attach { pid, trace } => session::attach(*pid, trace).await,
            cli::Command::Run { trace, fail_on_leak_bytes, command } => {
                session::run(command, trace, *fail_on_leak_bytes).await
            }
            cli::Command::Daemon(args) => daemon::run(args).await,
            cli::Command::Snapshot(args) => snapshot::run(args).await,
            cli::Command::Diff(args) => diff::run(args),
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
