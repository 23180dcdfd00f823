//! memprof: an eBPF heap profiler. The book (docs: introduction.md) says what it does and how to run it.
// Messages go through `console::say!`: `eprintln!` panics when standard error is closed or full.
#![deny(clippy::print_stderr)]

mod bell;
mod cli;
mod commands;
#[cfg(test)]
mod compiled;
mod console;
mod daemon;
mod demangle;
mod error;
mod format;
mod heap;
mod input;
mod kernel;
mod names;
mod peer;
mod process;
mod ring;
mod symbolize;
#[cfg(test)]
mod test_maps;
mod text;
mod unwind;

use std::{io::IsTerminal as _, process::ExitCode};

/// memprof's allocations stay out of the C library's malloc: its probes, once shared by every
/// process mapping the file, trap in memprof too (docs: internals/probes.md#shared-or-per-process), and the
/// daemon allocates for every process it attaches to.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_purge_delay` in mimalloc 3's mimalloc.h: the -sys crate names no constant for it.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Memory freed goes back to the system at once, not after mimalloc's delay: the daemon at rest
/// otherwise kept resident the pages of the reports it had rebuilt before its targets settled
/// (BENCHMARKS.md: the daemon at rest).
fn return_freed_memory_at_once() {
    // SAFETY: sets one of mimalloc's options, which it reads at each purge; no memory is touched.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0) };
}

use clap::{error::ErrorKind, Parser};
use tracing_subscriber::EnvFilter;

use crate::console::say;

fn main() -> ExitCode {
    if let Some(code) = kernel::helper::run_if_asked() {
        return ExitCode::from(code);
    }
    commands::output::note_given_descriptors();
    return_freed_memory_at_once();
    let cli = match cli::Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => return usage_error(&err),
    };
    // The daemon logs each process it starts and stops tracing (info); a session at a terminal
    // says that itself, and logs only what goes wrong.
    let default_filter = match cli.command {
        cli::Command::Daemon(_) => "warn,memprof=info",
        _ => "warn",
    };
    tracing_subscriber::fmt()
        .with_writer(|| console::Stderr)
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
            cli::Command::Attach { pid, trace } => {
                commands::session::attach(*pid, trace).await.map(commands::session::Attached::exit_code)
            }
            cli::Command::Run { trace, fail_on_leak_bytes, on_error, command } => {
                commands::session::run(command, trace, *fail_on_leak_bytes, *on_error).await
            }
            cli::Command::Daemon(args) => daemon::run(args).await,
            cli::Command::Snapshot(args) => commands::snapshot::run(args).await,
            cli::Command::Inspect(args) => commands::inspect::run(args),
            cli::Command::Diff(args) => commands::diff::run(args),
            cli::Command::Completions { shell } => commands::completions::completions(*shell),
            cli::Command::Man { dir } => commands::manual::man_pages(dir),
            cli::Command::CliReference { dir } => commands::manual::cli_reference(dir),
            cli::Command::Report(args) => commands::report::run(args),
        }
    });
    match result {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(err) => fail(&err),
    }
}

/// One line naming the problem; the cause chain joined with ": ". Exits with 2 for flags refused
/// (as `usage_error` does), else 1.
fn fail(err: &anyhow::Error) -> ExitCode {
    say!("memprof: error: {err:#}");
    if err.downcast_ref::<error::UserError>().is_some_and(error::UserError::refuses_flags) {
        return ExitCode::from(2);
    }
    ExitCode::FAILURE
}

/// A command line clap refuses, in one line: its first line, with its tip if it has one, and
/// where to look (clap's own runs 3 to 6 lines, a usage block and a help hint). Help and the
/// version are printed as clap prints them.
fn usage_error(err: &clap::Error) -> ExitCode {
    if matches!(
        err.kind(),
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        err.exit()
    }
    // Lossy: `args()` panics on an argument that is not UTF-8.
    let args: Vec<String> = std::env::args_os().map(|arg| arg.to_string_lossy().into_owned()).collect();
    say!("memprof: error: {}", one_line(&err.render().to_string(), unexpected_tip(err, &args).as_deref()));
    ExitCode::from(2)
}

/// A tip for an argument clap did not expect, in place of clap's, which names the flag spelled
/// most alike (`--sample-bytes` for `attach --fail-on-leak-bytes`): a flag of another command
/// names that command, a bare number where a pid goes asks for `-p`.
fn unexpected_tip(err: &clap::Error, args: &[String]) -> Option<String> {
    use clap::{
        error::{ContextKind, ContextValue},
        CommandFactory as _,
    };
    if err.kind() != ErrorKind::UnknownArgument {
        return None;
    }
    let Some(ContextValue::String(arg)) = err.get(ContextKind::InvalidArg) else { return None };
    let memprof = cli::Cli::command();
    // memprof's own flags are --help and --version: the first word is the command.
    let name = args.get(1)?;
    let command = memprof.find_subcommand(name)?;
    let pid_given = args.iter().any(|a| a.starts_with("--pid") || (a.starts_with("-p") && !a.starts_with("--")));
    if arg.parse::<u32>().is_ok() && !pid_given && command.get_arguments().any(|a| a.get_long() == Some("pid")) {
        return Some(format!("give the process id as -p {arg}"));
    }
    let long = arg.strip_prefix("--")?.split('=').next()?;
    let owners: Vec<String> = memprof
        .get_subcommands()
        .filter(|other| !other.is_hide_set() && other.get_arguments().any(|a| a.get_long() == Some(long)))
        .map(|other| format!("`memprof {}`", other.get_name()))
        .collect();
    (!owners.is_empty())
        .then(|| format!("--{long} is an option of {} only, not of `memprof {name}`", owners.join(" and ")))
}

/// clap's rendered error as one line: its message, with what it lists (the arguments missing,
/// the values possible) and its tips (or `tip` in their place), up to its usage block or its
/// pointer to `--help`.
fn one_line(rendered: &str, tip: Option<&str>) -> String {
    let tip_line = tip.map(|tip| format!("tip: {tip}"));
    let lines = rendered
        .lines()
        .map(str::trim)
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        // Our tip replaces clap's.
        .filter(|l| !l.is_empty() && (tip.is_none() || !l.starts_with("tip: ")))
        .chain(tip_line.as_deref());
    let mut line = String::new();
    for (i, part) in lines.enumerate() {
        match (i, part.strip_prefix("tip: ")) {
            (0, _) => line.push_str(part.trim_start_matches("error: ")),
            (_, Some(tip)) => {
                line.push_str("; ");
                line.push_str(tip);
            }
            (_, None) => {
                line.push(' ');
                line.push_str(part);
            }
        }
    }
    line.push_str("; see memprof --help");
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(args: &[&str]) -> String {
        let err = cli::Cli::try_parse_from(args).unwrap_err();
        let args: Vec<String> = args.iter().map(ToString::to_string).collect();
        one_line(&err.render().to_string(), unexpected_tip(&err, &args).as_deref())
    }

    #[test]
    fn a_refused_command_line_is_one_line_naming_the_flag() {
        let line = refused(&["memprof", "attach", "-p", "9", "--max-live", "4294967295"]);
        assert_eq!(
            line,
            "invalid value '4294967295' for '--max-live <MAX_LIVE>': `4294967295` is not a whole number of entries from 1 to 134217728; see memprof --help"
        );
        let line = refused(&["memprof", "attach", "-p", "9", "--top", "-1"]);
        assert!(line.contains("'--top <TOP>': `-1` is not a positive number of stacks; give 1 or more"), "{line}");
        let line = refused(&["memprof", "attach", "-p", "9", "--frobnicate"]);
        assert!(line.starts_with("unexpected argument '--frobnicate' found; "), "{line}");
        assert!(!line.contains('\n'), "{line}");
        let line = refused(&["memprof", "attach"]);
        assert_eq!(line, "the following required arguments were not provided: --pid <PID>; see memprof --help");
        let line = refused(&["memprof", "attach", "-p", "9", "--fail-on-leak-bytes", "0"]);
        assert_eq!(
            line,
            "unexpected argument '--fail-on-leak-bytes' found; --fail-on-leak-bytes is an option of `memprof run` only, not of `memprof attach`; see memprof --help"
        );
        let line = refused(&["memprof", "attach", "10318"]);
        assert_eq!(line, "unexpected argument '10318' found; give the process id as -p 10318; see memprof --help");
        let line = refused(&["memprof", "attach", "-p", "9", "--inspect-precopy", "x"]);
        assert!(line.ends_with("[possible values: auto, always, never, write-protect]; see memprof --help"), "{line}");
    }
}
