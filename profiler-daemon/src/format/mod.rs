//! The formats a report is written in. Table and JSON stream a report every interval; the others
//! describe one moment and are written once, when tracing ends.

mod flamegraph;
mod folded;
mod html;
mod json;
pub mod pprof;
mod reachability;
mod table;

pub use html::escape;
pub use table::{describe, site};

use std::{io::IsTerminal as _, path::Path};

use clap::ValueEnum;

use crate::{error::UserError, heap::report::Report};

/// The largest report or profile memprof reads (a file for `diff`, a daemon's answer for
/// `snapshot`), decompressed size included: what it reads is held in memory whole.
pub const MAX_INPUT_BYTES: u64 = 256 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// A summary and the top stacks, for reading in a terminal.
    Table,
    /// One JSON object per report and line (schema in the README).
    Json,
    /// Folded stacks, `outermost;...;innermost BYTES`, for flamegraph.pl and inferno.
    Folded,
    /// An SVG flame graph of the bytes in use.
    Flamegraph,
    /// One self-contained HTML page: heap over time, leaks, a call tree, histograms.
    Html,
    /// A gzip-compressed pprof heap profile (profile.proto) for `go tool pprof`; needs --output.
    Pprof,
}

impl Format {
    /// Written every interval rather than once at the end.
    pub fn streams(self) -> bool {
        matches!(self, Format::Table | Format::Json)
    }
}

/// Refuses to write a binary format to a terminal.
pub fn check_destination(format: Format, output: Option<&Path>) -> Result<(), UserError> {
    if format == Format::Pprof && output.is_none() && std::io::stdout().is_terminal() {
        return Err(UserError::BinaryToTerminal("pprof"));
    }
    Ok(())
}

/// The report in `format`, ending with a newline where the format is text.
pub fn render(report: &Report, format: Format) -> Vec<u8> {
    // Table and JSON have a section per process; the others draw one profile, with each process
    // a root frame of its own once there are several.
    let merged;
    let report = if report.children.is_empty() || format.streams() {
        report
    } else {
        merged = crate::heap::report::merge_processes(report);
        &merged
    };
    match format {
        Format::Table => line(table::render(report)),
        Format::Json => line(json::render(report)),
        Format::Folded => folded::render(report).into_bytes(),
        Format::Flamegraph => flamegraph::render(report),
        Format::Html => html::render(report).into_bytes(),
        Format::Pprof => pprof::render(report, pprof::DefaultType::InuseSpace),
    }
}

fn line(mut text: String) -> Vec<u8> {
    text.push('\n');
    text.into_bytes()
}
