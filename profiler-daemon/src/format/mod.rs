//! The formats a report is written in. Table and JSON stream a report every interval; the others
//! describe one moment and are written once, when tracing ends.

mod json;
mod table;

pub use table::site;

use clap::ValueEnum;

use crate::report::Report;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// A summary and the top stacks, for reading in a terminal.
    Table,
    /// One JSON object per report and line (schema in the README).
    Json,
}

impl Format {
    /// Written every interval rather than once at the end.
    pub fn streams(self) -> bool {
        matches!(self, Format::Table | Format::Json)
    }
}

/// The report in `format`, ending with a newline where the format is text.
pub fn render(report: &Report, format: Format) -> Vec<u8> {
    let mut text = match format {
        Format::Table => table::render(report),
        Format::Json => json::render(report),
    };
    text.push('\n');
    text.into_bytes()
}
