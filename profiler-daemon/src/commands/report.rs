//! `memprof report FILE`: a recording rendered in any format, as the session that made it would
//! have written it (see `recording`).

use crate::{
    cli::ReportArgs,
    commands::{output::ReportOutput, recording::Recording},
    format,
    heap::{
        leak::{StackTimeline, Timeline},
        report::Report,
    },
};

pub fn run(args: &ReportArgs) -> anyhow::Result<i32> {
    let recording = Recording::read(&args.recording)?;
    let top = args.top.unwrap_or(recording.settings.top);
    let format = args.output.format();
    let mut output = ReportOutput::open(format, args.output.file.as_deref())?;
    let last = recording.reports.last().expect("a recording read has a report");
    if let Some(why) = &recording.ended_early {
        eprintln!(
            "memprof: the recording ended early: {why}; it has {} interval reports, to {:.1} s, and no final report",
            recording.reports.len(),
            last.duration_s
        );
    }
    if format.streams() {
        for report in &recording.reports {
            output.write_report(&format::render(&format::select(report, format, top), format))?;
        }
    } else {
        let mut report = format::select(last, format, top);
        if !last.is_final {
            // Only a final report carries the heap's timeline: the intervals' give it back.
            with_timelines(&mut report, &recording.reports);
        }
        output.write_report(&format::render(&report, format))?;
        if let Some(path) = output.path() {
            eprintln!("memprof: wrote {}", path.display());
        }
    }
    Ok(0)
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
