//! `--suppressions` and `--gen-suppressions` for `attach`, `run` and `report`: the rules read
//! before anything starts, and the rules generated for the final report, printed after it.

use std::io::Write as _;

use crate::{
    cli::OutputArgs,
    commands::report,
    error::UserError,
    format::Format,
    heap::{
        report::Report,
        suppressions::{self, SuppressionArgs, Suppressions},
    },
};

pub struct Suppressing {
    pub rules: Suppressions,
    generate: bool,
}

impl Suppressing {
    /// Reads the files, and checks that generated rules have somewhere to go: standard output,
    /// after the report, unless the report is there in a format other than the table.
    pub fn open(args: &SuppressionArgs, output: &OutputArgs, format: Format) -> anyhow::Result<Self> {
        if args.gen_suppressions && output.file.is_none() && format != Format::Table {
            return Err(UserError::Flags(format!(
                "--gen-suppressions prints to standard output, where the {} report goes; write the report to a file (-o FILE) or give --format table",
                report::name(format)
            ))
            .into());
        }
        Ok(Self { rules: Suppressions::load(&args.files)?, generate: args.gen_suppressions })
    }

    /// A rule for each leak candidate or stack with lost blocks of `report`, when asked.
    pub fn generated(&self, report: &Report) -> Option<String> {
        self.generate.then(|| suppressions::generate(report))
    }
}

/// Prints generated rules after the report.
pub fn print(rules: Option<String>) -> anyhow::Result<()> {
    if let Some(text) = rules {
        let mut out = std::io::stdout().lock();
        out.write_all(text.as_bytes())?;
        out.flush()?;
    }
    Ok(())
}
