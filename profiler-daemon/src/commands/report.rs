//! `memprof report FILE`: a recording rendered in any format, as the session that made it would
//! have written it (see `recording`), at any moment (`moment`), with the session's filters, as
//! flame graphs of bytes, allocations or temporary allocations.

use std::path::Path;

use anyhow::bail;
use clap::ValueEnum;

use crate::{
    cli::ReportArgs,
    commands::{
        moment::{self, Moment},
        output::ReportOutput,
        recording::Recording,
        suppress::{self, Suppressing},
    },
    console::say,
    error::UserError,
    format::{self, Flame, Format},
    heap::{
        leak::{StackTimeline, Timeline},
        report::Report,
        wrappers::{WrapperArgs, Wrappers},
    },
    kernel::settings::DEFAULT_LOAD,
    process::memory,
};

/// The most frames a report rendered from a recording names, all its stacks and processes
/// together: as many as a session with the default tables holds (every stack as deep as
/// stacks go). A recording stores each stack's frames once, and each report repeats them.
const MAX_FRAMES: u64 = DEFAULT_LOAD.max_stacks as u64 * profiler_common::MAX_FRAMES as u64;

/// What a frame costs written out beyond its names (keys, numbers, the address).
const FRAME_OVERHEAD: u64 = 96;

pub fn run(args: &ReportArgs) -> anyhow::Result<i32> {
    let (format, flame) = drawn(args)?;
    let moment = moment(args.at, flame)?;
    let suppressing = Suppressing::open(&args.suppress, &args.output, format)?;
    if let Some(output) = args.output.file.as_deref().filter(|output| same_file(output, &args.recording)) {
        return Err(UserError::OutputIsRecording(output.to_path_buf()).into());
    }
    let mut recording = Recording::read(&args.recording)?;
    if !args.wrappers.is_empty() {
        let wrappers = Wrappers::new(&WrapperArgs { wrappers: args.wrappers.clone(), no_auto_wrappers: true });
        recording.reports.iter_mut().for_each(|report| report.fold_wrappers(&wrappers));
    }
    let top = args.top.unwrap_or(recording.settings.top);
    let mut output = ReportOutput::open(format, args.output.file.as_deref())?;
    let last = recording.reports.last().expect("a recording read has a report");
    if let Some(why) = &recording.ended_early {
        say!(
            "memprof: the recording ended early: {why}; it has {} interval reports, to {:.1} s, and no final report",
            recording.reports.len(),
            last.duration_s
        );
    }
    // What the format shows of a report, suppressed and filtered as asked. Suppressions apply
    // even without rules: the count of the stacks the session suppressed is made again for the
    // moment shown.
    let shown = |report: &Report| -> anyhow::Result<Report> {
        let mut filtered = report.clone();
        filtered.for_each_process(&mut |process| {
            suppressing.rules.apply(process);
            args.filters.apply(process);
        });
        let selected = format::select_stacks(&filtered, format, top, format == Format::Pprof || flame.counts_freed());
        check_size(&args.recording, &selected)?;
        Ok(selected)
    };
    match moment {
        None if format.streams() => {
            let mut generated = None;
            for report in &recording.reports {
                let report = shown(report)?;
                output.write_report(&report, format, Flame::Bytes)?;
                generated = suppressing.generated(&report);
            }
            suppress::print(generated)?;
        }
        moment => {
            let (at, upto) = moment::pick(&args.recording, &recording.reports, moment.unwrap_or(Moment::Final))?;
            if flame == Flame::Temporary {
                check_temporary(&args.recording, &at)?;
            }
            let mut report = shown(&at)?;
            if !format.streams() && report.timeline.is_empty() {
                // Only a final report carries the heap's timeline: the intervals' give it back.
                with_timelines(&mut report, &recording.reports[..=upto]);
            }
            output.write_report(&report, format, flame)?;
            if let Some(line) = format::left_out_of(&report, format) {
                say!("{line}");
            }
            if let (false, Some(path)) = (format.streams(), output.path()) {
                say!("memprof: wrote {}", path.display());
            }
            suppress::print(suppressing.generated(&report))?;
        }
    }
    Ok(0)
}

/// Whether both paths name one file, through links or not.
fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    }
}

/// The format and what its flame graph measures: `--flame` draws a flame graph unless the format
/// asked for is folded stacks.
fn drawn(args: &ReportArgs) -> anyhow::Result<(Format, Flame)> {
    match (args.flame, args.output.format_given()) {
        (None, _) => Ok((args.output.format(), Flame::Bytes)),
        // No format named: --flame says which is wanted.
        (Some(flame), None) => Ok((Format::Flamegraph, flame)),
        (Some(flame), Some(format @ (Format::Flamegraph | Format::Folded))) => Ok((format, flame)),
        (Some(flame), Some(other)) => Err(UserError::Flags(format!(
            "--flame {} draws a flame graph, and --format {} is not one; give --format flamegraph or folded, or leave out --flame",
            name(flame),
            name(other)
        ))
        .into()),
    }
}

/// The moment shown: `--at`, or the peak for `--flame peak`. The peak keeps bytes only, so
/// graphs of counts are refused there.
fn moment(at: Option<Moment>, flame: Flame) -> anyhow::Result<Option<Moment>> {
    match (flame, at) {
        (Flame::Peak, None | Some(Moment::Peak)) => Ok(Some(Moment::Peak)),
        (Flame::Peak, Some(other)) => Err(UserError::Flags(format!(
            "--flame peak draws the peak, not --at {other}; leave out --at, or give --flame bytes"
        ))
        .into()),
        (counts, Some(Moment::Peak)) if counts.counts_freed() => Err(UserError::Flags(format!(
            "the peak keeps bytes only, so --flame {} cannot be drawn at it; give --at final or --at SECONDS, or --flame bytes",
            name(counts)
        ))
        .into()),
        (_, at) => Ok(at),
    }
}

/// Refuses a graph of temporary allocations from a process traced in a mode that does not
/// count them (only every call traced tells which allocations were temporary).
fn check_temporary(path: &Path, report: &Report) -> anyhow::Result<()> {
    let only_sampled = report.usdt_samples.is_some() && !report.usdt_beside_calls;
    if report.sample_bytes != 0 || report.growth.is_some() || only_sampled {
        bail!(
            "{}: its allocations were sampled or traced by pages, which counts no temporary allocations; record with every call traced (--max-rate off, no --sample-bytes, --growth or --usdt)",
            path.display()
        );
    }
    Ok(())
}

/// The name a flag gives `value`.
pub fn name(value: impl ValueEnum) -> String {
    value.to_possible_value().map_or_else(String::new, |v| v.get_name().to_string())
}

/// Refuses, before it is rendered, a report whose frames are more than `MAX_FRAMES` or would
/// take more than a quarter of the memory memprof may use written out.
fn check_size(path: &Path, report: &Report) -> anyhow::Result<()> {
    let (frames, bytes) = frames(report);
    let room = memory::room();
    if frames > MAX_FRAMES || bytes > room.bytes / 4 {
        bail!(
            "{}: its report at {:.1} s names {frames} frames ({} MiB written out), more than memprof renders ({MAX_FRAMES} frames, a quarter of the {room}); render fewer stacks (--format table --top N)",
            path.display(),
            report.duration_s,
            bytes >> 20,
        );
    }
    Ok(())
}

/// The frames of `report` and its children, and about the bytes they take written out.
fn frames(report: &Report) -> (u64, u64) {
    let own = report.stacks.iter().flat_map(|s| s.frames.iter()).fold((0, 0), |(n, bytes), f| {
        let names = f.function.len() + f.file.as_ref().map_or(0, String::len) + f.module.len() + f.address.len();
        (n + 1, bytes + names as u64 + FRAME_OVERHEAD)
    });
    report.children.iter().map(frames).fold(own, |(n, bytes), (m, more)| (n + m, bytes + more))
}

/// Gives `report` and its children the timelines of `reports`: in-use bytes at each interval,
/// and those of the stacks that are leak candidates.
fn with_timelines(report: &mut Report, reports: &[Report]) {
    let points: Vec<&Report> = reports.iter().filter_map(|r| process(r, report.pid)).collect();
    let mut timeline = Timeline {
        time_s: points.iter().map(|r| r.duration_s).collect(),
        outstanding_bytes: points.iter().map(|r| r.totals.outstanding_bytes).collect(),
        stacks: Vec::new(),
    };
    for stack in report.stacks.iter().filter(|s| s.leak.candidate) {
        let bytes: Vec<Option<u64>> = points
            .iter()
            .map(|r| r.stacks.iter().find(|s| s.stack_id == stack.stack_id).map(|s| s.outstanding_bytes))
            .collect();
        let Some(first) = bytes.iter().position(Option::is_some) else { continue };
        timeline.stacks.push(StackTimeline {
            stack_id: stack.stack_id.clone(),
            first,
            outstanding_bytes: bytes[first..].iter().map(|b| b.unwrap_or(0)).collect(),
        });
    }
    report.timeline = timeline;
    for child in &mut report.children {
        with_timelines(child, reports);
    }
}

/// The report of process `pid` in `report`, or among its children.
fn process(report: &Report, pid: u32) -> Option<&Report> {
    if report.pid == pid {
        return Some(report);
    }
    report.children.iter().find_map(|child| process(child, pid))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heap::report::samples;

    #[test]
    fn the_peak_graph_is_the_peak_and_counts_are_not_drawn_at_it() {
        assert_eq!(moment(None, Flame::Peak).unwrap(), Some(Moment::Peak));
        assert_eq!(moment(None, Flame::Allocations).unwrap(), None);
        assert_eq!(moment(Some(Moment::Seconds(2.0)), Flame::Temporary).unwrap(), Some(Moment::Seconds(2.0)));
        let err = moment(Some(Moment::Seconds(2.0)), Flame::Peak).unwrap_err().to_string();
        assert_eq!(err, "--flame peak draws the peak, not --at 2; leave out --at, or give --flame bytes");
        assert!(moment(Some(Moment::Peak), Flame::Temporary).unwrap_err().to_string().contains("--flame temporary"));
    }

    #[test]
    fn temporary_allocations_need_every_call_traced() {
        let mut report = samples::report();
        assert!(check_temporary(Path::new("r.rec"), &report).is_ok());
        report.sample_bytes = 4096;
        let err = check_temporary(Path::new("r.rec"), &report).unwrap_err().to_string();
        assert!(err.starts_with("r.rec: its allocations were sampled"), "{err}");
    }
}
