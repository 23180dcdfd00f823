//! The formats a report is written in. Table and JSON stream a report every interval; the others
//! describe one moment and are written once, when tracing ends.

mod flamegraph;
mod folded;
mod html;
mod json;
mod page;
pub mod pprof;
mod reachability;
pub mod screen;
mod table;

pub use html::escape;
pub use table::{describe, site};

use std::{
    collections::HashSet,
    io::{self, IsTerminal as _},
    path::Path,
};

use clap::ValueEnum;

use crate::{
    error::UserError,
    heap::report::{Report, StackReport, LISTED_MAX},
};

/// The largest report or profile memprof reads (a file for `diff`, a daemon's answer for
/// `snapshot`), decompressed size included: what it reads is held in memory whole.
pub const MAX_INPUT_BYTES: u64 = 256 << 20;

/// What `from` gives, read to its end; `None` as soon as it gives more than `limit` bytes. Read a
/// piece at a time into room for `limit` bytes reserved at once, so that the memory touched is
/// the bytes read: `read_to_end` zero-fills its spare capacity before each read, and a buffer
/// that grows is copied into one twice its size, both touching about twice what it holds. Pages
/// reserved and never written take no memory.
pub fn read_at_most(mut from: impl std::io::Read, limit: u64) -> std::io::Result<Option<Vec<u8>>> {
    let mut bytes = Vec::with_capacity(usize::try_from(limit).unwrap_or(usize::MAX));
    let mut piece = vec![0u8; 256 << 10];
    loop {
        let n = match from.read(&mut piece) {
            Ok(0) => return Ok(Some(bytes)),
            Ok(n) => n,
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(err) => return Err(err),
        };
        if (bytes.len() + n) as u64 > limit {
            return Ok(None);
        }
        bytes.extend_from_slice(&piece[..n]);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// A summary and the top stacks, for reading in a terminal.
    Table,
    /// One JSON object per report and line (docs: reference/json-schema.md#the-json-schema).
    Json,
    /// Folded stacks, `outermost;...;innermost BYTES`, for flamegraph.pl and inferno.
    Folded,
    /// An SVG flame graph of the bytes in use.
    Flamegraph,
    /// One self-contained HTML page: heap over time, leaks, a call tree, histograms.
    Html,
    /// A gzip-compressed pprof heap profile (profile.proto) for `go tool pprof`; needs --output,
    /// or standard output redirected away from a terminal.
    Pprof,
}

impl Format {
    /// Written every interval rather than once at the end.
    pub fn streams(self) -> bool {
        matches!(self, Format::Table | Format::Json)
    }

    /// The format a report file's name asks for, when no flag names one: a table written to
    /// `heap.pb.gz` would be read by no tool. `snapshot`, `attach`, `run`, `inspect` and
    /// `report` all decide by this one list.
    pub fn of_file_name(path: &Path) -> Option<Format> {
        let name = path.file_name()?.to_string_lossy();
        [(".json", Format::Json), (".pb.gz", Format::Pprof), (".html", Format::Html), (".svg", Format::Flamegraph)]
            .into_iter()
            .find(|(end, _)| name.ends_with(end))
            .map(|(_, format)| format)
    }
}

/// What the frames of a flame graph (and the values of folded stacks) measure.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum Flame {
    /// Bytes in use.
    #[default]
    Bytes,
    /// Allocations made since tracing began.
    Allocations,
    /// Temporary allocations: freed by their thread before it allocated or freed anything else.
    Temporary,
    /// Bytes in use at the peak (the report at the peak: `--at peak`).
    Peak,
}

impl Flame {
    /// What `stack` counts in the graph.
    pub fn value(self, stack: &StackReport) -> u64 {
        match self {
            Flame::Bytes | Flame::Peak => stack.outstanding_bytes,
            Flame::Allocations => stack.allocations,
            Flame::Temporary => stack.temporary_allocations,
        }
    }

    /// Counts stacks that hold nothing now.
    pub fn counts_freed(self) -> bool {
        matches!(self, Flame::Allocations | Flame::Temporary)
    }
}

/// Refuses to write a binary format to a terminal.
pub fn check_destination(format: Format, output: Option<&Path>) -> Result<(), UserError> {
    if format == Format::Pprof && output.is_none() && std::io::stdout().is_terminal() {
        return Err(UserError::BinaryToTerminal("pprof"));
    }
    Ok(())
}

/// What `format` shows of a report that may hold every stack (a recording's): the stacks that
/// hold nothing now only in pprof's allocation profile, the `top` largest in the table (and of
/// the peak's, temporary and mapping lists there), `LISTED_MAX` of those lists elsewhere, the
/// modules and leak timelines of the stacks kept. The live session and `memprof report` both go
/// through here, so both write the same report from the same data.
pub fn select(report: &Report, format: Format, top: usize) -> Report {
    select_stacks(report, format, top, format == Format::Pprof)
}

/// `select`, keeping the stacks that hold nothing now when `freed`: a flame graph of the
/// allocations made counts them too (`Flame::counts_freed`).
pub fn select_stacks(report: &Report, format: Format, top: usize, freed: bool) -> Report {
    let mut selected = report.clone();
    select_in(&mut selected, format, top, freed);
    selected
}

fn select_in(report: &mut Report, format: Format, top: usize, freed: bool) {
    if !freed {
        // Bytes without a count: a report at the peak, which keeps no counts.
        report.stacks.retain(|s| s.outstanding_allocations > 0 || s.outstanding_bytes > 0);
    }
    // A recording's lists them all: the table shows `top` of each, as the session did.
    let listed = if format == Format::Table { top.min(LISTED_MAX) } else { LISTED_MAX };
    if format == Format::Table {
        report.stacks.truncate(top);
    }
    report.peak.stacks.truncate(listed);
    report.temporary_stacks.truncate(listed);
    report.mappings.stacks.truncate(listed);
    let ids: HashSet<&str> = report.stacks.iter().map(|s| s.stack_id.as_str()).collect();
    report.timeline.stacks.retain(|s| ids.contains(s.stack_id.as_str()));
    let modules: HashSet<&str> =
        report.stacks.iter().flat_map(|s| s.frames.iter()).map(|f| f.module.as_str()).collect();
    report.modules.retain(|m| modules.contains(m.path.as_str()));
    for child in &mut report.children {
        select_in(child, format, top, freed);
    }
}

/// What the report's processes could not see and what was dropped, one phrase each (a process
/// among several named first): for the formats with no place of their own for it.
pub fn unseen_and_dropped(report: &Report) -> Vec<String> {
    let several = !report.children.is_empty();
    let mut phrases = Vec::new();
    let mut add = |process: &Report| {
        let who = if several { format!("pid {}: ", process.pid) } else { String::new() };
        phrases.extend(process.blind_spots.iter().map(|spot| format!("{who}not seen: {}", spot.what)));
        phrases.extend(process.dropped_line().map(|dropped| format!("{who}{dropped}")));
    };
    add(report);
    report.children.iter().for_each(&mut add);
    phrases
}

/// For folded stacks, which have no place for it: one line of what `unseen_and_dropped` says,
/// to be said beside them. None for the other formats, or when there is nothing to say.
pub fn left_out_of(report: &Report, format: Format) -> Option<String> {
    if format != Format::Folded {
        return None;
    }
    let phrases = unseen_and_dropped(report);
    (!phrases.is_empty()).then(|| format!("memprof: the folded stacks leave out: {}", phrases.join("; ")))
}

/// The report in `format`, ending with a newline where the format is text; flame graphs and
/// folded stacks of the bytes in use.
pub fn render(report: &Report, format: Format) -> Vec<u8> {
    render_flame(report, format, Flame::Bytes)
}

/// The report in `format` (flame graphs and folded stacks of what `flame` measures), written to
/// `out`: JSON and folded stacks as they are made, the others once rendered.
pub fn write(report: &Report, format: Format, flame: Flame, out: &mut dyn io::Write) -> io::Result<()> {
    // Table and JSON have a section per process; the others draw one profile, with each process
    // a root frame of its own once there are several.
    let merged;
    // pprof labels each process's samples instead (`pprof::encode`).
    let report = if report.children.is_empty() || format.streams() || format == Format::Pprof {
        report
    } else {
        merged = crate::heap::report::merge_processes(report);
        &merged
    };
    match format {
        Format::Table => writeln!(out, "{}", table::render(report)),
        Format::Json => json::write(report, out),
        Format::Folded => folded::write(report, flame, out),
        Format::Flamegraph => out.write_all(&flamegraph::render(&page::page(report, flame), flame)),
        Format::Html => out.write_all(html::render(&page::page(report, Flame::Bytes)).as_bytes()),
        Format::Pprof => out.write_all(&pprof::render(report, pprof::DefaultType::InuseSpace)),
    }
}

/// `write`, into memory.
pub fn render_flame(report: &Report, format: Format, flame: Flame) -> Vec<u8> {
    let mut written = Vec::new();
    write(report, format, flame, &mut written).expect("writing to memory cannot fail");
    written
}
