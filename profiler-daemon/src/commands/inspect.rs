//! `memprof inspect --pid N`: the blocks of a process the memprof daemon traces, classed as
//! valgrind's memcheck would and named by C++ type, from an inspection the daemon makes now
//! (`/api/v1/inspect`). Without a daemon, `attach --inspect` does the same in a session of its own.

use std::time::Duration;

use anyhow::{bail, Context as _};

use crate::{
    cli::InspectArgs,
    commands::{
        daemon_client::{self, Daemon, Reply},
        output::ReportOutput,
    },
    console::say,
    error::UserError,
    format::{self, Flame},
    heap::report::Report,
    process::procfs,
};

/// How long the daemon may take: the inspection of a large heap takes seconds.
const ANSWER_WAIT: Duration = Duration::from_secs(300);

pub fn run(args: &InspectArgs) -> anyhow::Result<i32> {
    let pid = args.pid.get();
    let format = args.output.format();
    // Before asking: a pprof profile for a terminal is refused without stopping the process.
    let mut output = ReportOutput::open(format, args.output.file.as_deref())?;
    let url = &args.daemon;
    let fix = format!("`memprof attach --pid {pid} --inspect --duration SECS` inspects it without a daemon");
    let daemon = Daemon::new(url, args.daemon_user.as_deref(), ANSWER_WAIT)?;
    let heuristics = args.inspect_heuristics;
    // A process that is not there: neither the daemon nor `attach` can inspect it. Checked once
    // the daemon has no answer, as the daemon knows best what it traces.
    let gone = || procfs::stat(pid).is_none();
    let body = match daemon.get(&format!("/api/v1/inspect?pid={pid}&heuristics={heuristics}"))? {
        Reply::NoDaemon(_) | Reply::Answer { status: 404, .. } if gone() => {
            return Err(UserError::NoSuchProcess(pid).into())
        }
        Reply::NoDaemon(why) => bail!("{why}, so none traces pid {pid}; {fix}"),
        Reply::Lost(why) => bail!("{why}; pid {pid} was not inspected"),
        Reply::Answer { status: 200, body } => body,
        Reply::Answer { status: 404, body } => {
            bail!("the daemon at {url}: {}; {fix}", daemon_client::error_message(&body))
        }
        Reply::Answer { status, body } => match daemon_client::refusal(url, args.daemon_user.as_deref(), status, &body)
        {
            Some(refusal) => bail!("{refusal}"),
            None => bail!("the daemon at {url} answered {status}: {}", daemon_client::error_message(&body)),
        },
    };
    let report: Report = serde_json::from_slice(&body).context("the daemon's answer is not a report")?;
    output.write_report(&format::select(&report, format, args.top), format, Flame::Bytes)?;
    if let Some(inspection) = &report.inspection {
        say!(
            "memprof: pid {pid} inspected by the daemon at {url}: held still {:.1} ms; it stays traced",
            inspection.pause_ms
        );
    }
    if let Some(path) = output.path() {
        say!("memprof: wrote {}", path.display());
    }
    Ok(0)
}
