//! `memprof snapshot`: one process's report in a file. Taken from the memprof daemon when it
//! traces the process (which then stays traced), else by attaching for `--duration` and
//! detaching. Either way the process keeps running.

use std::{path::Path, time::Duration};

use anyhow::bail;
use clap::Parser;

use crate::{
    cli::{OutputArgs, SnapshotArgs, SnapshotFormat, TraceArgs, MAX_SECONDS},
    commands::{
        daemon_client::{self, Daemon, Reply},
        output::ReportFile,
        session,
    },
    console::say,
    error::UserError,
    format::Format,
};

/// How long the daemon may take to answer.
const ANSWER_WAIT: Duration = Duration::from_secs(30);

pub async fn run(args: &SnapshotArgs) -> anyhow::Result<i32> {
    let format = match args.format {
        Some(format) => format,
        None => format_of(&args.output)?,
    };
    let pid = args.pid.get();
    match from_daemon(&args.daemon, args.daemon_user.as_deref(), pid, format)? {
        Answer::Report(report) => {
            let error = |cause| UserError::Output { path: args.output.clone(), cause };
            ReportFile::create(&args.output).and_then(|mut file| file.append(&report)).map_err(error)?;
            say!(
                "memprof: pid {pid} is traced by the daemon at {}: wrote its report to {}; it stays traced",
                args.daemon,
                args.output.display()
            );
        }
        Answer::NotTraced(why) => {
            say!("memprof: {why}; attaching to pid {pid} for {} s", args.duration);
            let attached = session::attach(args.pid, &trace_args(args, format)).await?;
            if let session::Attached::StoppedBefore(_) = attached {
                // Said by the session: no probe was attached, nothing written.
                return Ok(attached.exit_code());
            }
            // A session says where it wrote a profile, not a stream of JSON reports: this one
            // wrote its final report alone.
            if format == SnapshotFormat::Json {
                say!("memprof: wrote {}", args.output.display());
            }
            // Another daemon may trace it still: only this snapshot's probes are gone. A process
            // that exited meanwhile was said to by the session, with its report up to its exit.
            if attached == session::Attached::Traced {
                say!("memprof: pid {pid} keeps running; the snapshot's probes are detached");
            }
        }
    }
    Ok(0)
}

/// The format `path`'s name asks for, as for `attach`; a snapshot is pprof or JSON only.
fn format_of(path: &Path) -> Result<SnapshotFormat, anyhow::Error> {
    match Format::of_file_name(path) {
        Some(Format::Json) => Ok(SnapshotFormat::Json),
        Some(Format::Pprof) => Ok(SnapshotFormat::Pprof),
        _ => Err(UserError::Flags(format!(
            "cannot tell the format from the name {}; end it in .pb.gz or .json, or give --format pprof|json",
            path.display()
        ))
        .into()),
    }
}

/// `memprof attach` settings for one final report at `--duration`: every other setting at its
/// command-line default.
fn trace_args(args: &SnapshotArgs, format: SnapshotFormat) -> TraceArgs {
    #[derive(Parser)]
    struct Attach {
        #[command(flatten)]
        trace: TraceArgs,
    }
    let mut trace = Attach::parse_from(["attach"]).trace;
    let format = match format {
        SnapshotFormat::Pprof => Format::Pprof,
        SnapshotFormat::Json => Format::Json,
    };
    trace.output = OutputArgs::new(format, Some(args.output.clone()));
    trace.duration = Some(args.duration);
    // No report before the final one.
    trace.interval = MAX_SECONDS;
    trace.maps = args.maps;
    trace
}

enum Answer {
    Report(Vec<u8>),
    /// Why the daemon cannot give the report: none answers, or it does not trace the process.
    NotTraced(String),
}

/// Asks the daemon at `url` (its socket, or `http://HOST:PORT` on this host), logged in as
/// `user` if given, for the report of `pid`.
fn from_daemon(url: &str, user: Option<&str>, pid: u32, format: SnapshotFormat) -> anyhow::Result<Answer> {
    let path = match format {
        SnapshotFormat::Pprof => format!("/debug/pprof/heap?pid={pid}"),
        SnapshotFormat::Json => format!("/api/v1/leaks?pid={pid}"),
    };
    let (status, body) = match Daemon::new(url, user, ANSWER_WAIT)?.get(&path)? {
        Reply::Answer { status, body } => (status, body),
        Reply::NoDaemon(why) => return Ok(Answer::NotTraced(why)),
        Reply::Lost(why) => bail!("{why}; run memprof snapshot again once it is back"),
    };
    match status {
        200 if format == SnapshotFormat::Json => Ok(Answer::Report([body, b"\n".to_vec()].concat())),
        200 => Ok(Answer::Report(body)),
        404 => Ok(Answer::NotTraced(format!("the daemon at {url} does not trace pid {pid}"))),
        _ => match daemon_client::refusal(url, user, status, &body) {
            Some(refusal) => bail!("{refusal}"),
            None => bail!("the daemon at {url} answered {path} with {status}: {}", daemon_client::error_message(&body)),
        },
    }
}
