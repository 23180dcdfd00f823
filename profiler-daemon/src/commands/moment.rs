//! `memprof report --at`: the moment of a recording a report shows: its end, its peak (the most
//! bytes in use at once), or the interval nearest a time.

use std::{
    fmt,
    path::{Path, PathBuf},
};

use crate::{
    cli,
    heap::{
        leak::{self, LeakVerdict},
        mappings::Mappings,
        report::{Report, StackReport, Totals},
    },
};

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Moment {
    /// The last report: the final one, or the last interval's of a recording cut short.
    Final,
    /// Each process at its own peak.
    Peak,
    /// The report nearest this many seconds after tracing began.
    Seconds(f64),
}

impl fmt::Display for Moment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Moment::Final => f.write_str("final"),
            Moment::Peak => f.write_str("peak"),
            Moment::Seconds(secs) => write!(f, "{secs}"),
        }
    }
}

/// Parses `--at`: peak, final, or seconds since tracing began.
pub fn moment(value: &str) -> Result<Moment, String> {
    match value {
        "peak" => Ok(Moment::Peak),
        "final" => Ok(Moment::Final),
        _ => {
            let secs = value.parse().map_err(|_| format!("`{value}` is none of peak, final or a number of seconds"))?;
            cli::check_seconds(secs, true).map(Moment::Seconds)
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MomentError {
    #[error("{}: --at {asked} is past its end at {end:.1} s; give seconds from 0 to {end:.1}, peak or final", path.display())]
    PastTheEnd { path: PathBuf, asked: f64, end: f64 },
    #[error("{}: it keeps no peak (nothing was in use, or a memprof without peaks recorded it); give --at final or --at SECONDS", path.display())]
    NoPeak { path: PathBuf },
}

/// The report at `moment` of `reports` (a recording's, in order), and the index of the last
/// report up to that moment.
pub fn pick(path: &Path, reports: &[Report], moment: Moment) -> Result<(Report, usize), MomentError> {
    let last = reports.len() - 1;
    match moment {
        Moment::Final => Ok((reports[last].clone(), last)),
        Moment::Peak => {
            let mut report = at_peak(&reports[last]);
            let window = reports.iter().flat_map(|r| &r.stacks).find_map(|s| s.leak.warming_up).map(|w| w.window);
            judge_as_then(&mut report, reports, window);
            if !has_peak(&report) {
                return Err(MomentError::NoPeak { path: path.to_path_buf() });
            }
            Ok((report, last))
        }
        Moment::Seconds(asked) => {
            // The end as reports show it, to a tenth: what was read there can be asked for.
            let end = (reports[last].duration_s * 10.0).ceil() / 10.0;
            if asked > end {
                return Err(MomentError::PastTheEnd { path: path.to_path_buf(), asked, end });
            }
            let distance = |r: &Report| (r.duration_s - asked).abs();
            let nearest = (0..reports.len())
                .min_by(|&a, &b| distance(&reports[a]).total_cmp(&distance(&reports[b])))
                .expect("a recording read has a report");
            Ok((reports[nearest].clone(), nearest))
        }
    }
}

/// Gives each stack of `report`, a process at its peak (and its children at theirs), the leak
/// rule's verdict of the last of `reports` made by then, not the final one's: at a peak one
/// second in, the rule had seen one interval. A stack that report does not list was not seen
/// at an interval yet: warming up, its `window` as the recording's verdicts say.
fn judge_as_then(report: &mut Report, reports: &[Report], window: Option<usize>) {
    let then = reports.iter().rev().find(|r| r.duration_s <= report.duration_s).and_then(|r| process_in(r, report.pid));
    let verdicts: std::collections::HashMap<&str, &LeakVerdict> =
        then.map(|r| r.stacks.iter().map(|s| (s.stack_id.as_str(), &s.leak)).collect()).unwrap_or_default();
    for stack in &mut report.stacks {
        stack.leak = match (verdicts.get(stack.stack_id.as_str()), window) {
            (Some(&verdict), _) => verdict.clone(),
            (None, Some(window)) => leak::warming_up(0, window),
            (None, None) => LeakVerdict::default(),
        };
    }
    for child in &mut report.children {
        judge_as_then(child, reports, window);
    }
}

/// Process `pid`'s part of `report`: the report's own, or a followed child's.
fn process_in(report: &Report, pid: u32) -> Option<&Report> {
    if report.pid == pid {
        return Some(report);
    }
    report.children.iter().find_map(|child| process_in(child, pid))
}

fn has_peak(report: &Report) -> bool {
    report.peak.bytes > 0 || report.children.iter().any(has_peak)
}

/// `report` and its children each at its peak (its high-water mark, as the report keeps it):
/// the stacks that held memory then with their bytes. The peak keeps bytes only, so counts and
/// what belongs to another moment (resident memory, mappings, histograms) are left out.
fn at_peak(report: &Report) -> Report {
    // By id: a process can hold tens of thousands of stacks.
    let listed: std::collections::HashMap<&str, &StackReport> =
        report.stacks.iter().map(|s| (s.stack_id.as_str(), s)).collect();
    let stacks = report
        .peak
        .stacks
        .iter()
        .map(|held| {
            let known = listed.get(held.stack_id.as_str());
            StackReport {
                stack_id: held.stack_id.clone(),
                outstanding_bytes: held.bytes,
                outstanding_allocations: 0,
                allocations: 0,
                allocated_bytes: 0,
                max_outstanding_bytes: 0,
                temporary_allocations: 0,
                pinned_pages: 0,
                pinned_bytes: 0,
                oldest_age_s: 0.0,
                oldest_ns: None,
                truncated: known.is_some_and(|s| s.truncated),
                via: known.map(|s| s.via.clone()).unwrap_or_default(),
                leak: known.map(|s| s.leak.clone()).unwrap_or_default(),
                reachability: None,
                types: Vec::new(),
                suppressed: known.and_then(|s| s.suppressed.clone()),
                frames: held.frames.clone(),
            }
        })
        .collect();
    Report {
        is_final: false,
        at_peak: true,
        duration_s: report.peak.at_s,
        totals: Totals { outstanding_bytes: report.peak.bytes, ..Totals::default() },
        stacks,
        temporary_stacks: Vec::new(),
        memory: None,
        mappings: Mappings::default(),
        sizes: Vec::new(),
        lifetimes: Vec::new(),
        thread_pairs: Vec::new(),
        threads: Vec::new(),
        inspection: None,
        children: report.children.iter().map(at_peak).collect(),
        ..report.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heap::report::{samples, PeakStack};

    fn at(secs: &[f64]) -> Vec<Report> {
        secs.iter()
            .map(|&s| {
                let mut report = samples::report();
                report.duration_s = s;
                report
            })
            .collect()
    }

    #[test]
    fn seconds_pick_the_nearest_report_and_past_the_end_is_refused() {
        let reports = at(&[0.5, 1.0, 1.5]);
        let path = Path::new("r.rec");
        assert_eq!(pick(path, &reports, Moment::Seconds(0.0)).unwrap().1, 0);
        assert_eq!(pick(path, &reports, Moment::Seconds(1.1)).unwrap().1, 1);
        assert_eq!(pick(path, &reports, Moment::Seconds(1.5)).unwrap().1, 2);
        assert_eq!(pick(path, &reports, Moment::Final).unwrap().1, 2);
        let err = pick(path, &reports, Moment::Seconds(9.0)).unwrap_err().to_string();
        assert_eq!(err, "r.rec: --at 9 is past its end at 1.5 s; give seconds from 0 to 1.5, peak or final");
        // An end of 1.46 s reads as 1.5 s, which can be asked for.
        let reports = at(&[0.5, 1.46]);
        assert_eq!(pick(path, &reports, Moment::Seconds(1.5)).unwrap().1, 1);
        let err = pick(path, &reports, Moment::Seconds(1.6)).unwrap_err().to_string();
        assert_eq!(err, "r.rec: --at 1.6 is past its end at 1.5 s; give seconds from 0 to 1.5, peak or final");
    }

    #[test]
    fn at_the_peak_stacks_hold_their_bytes_then() {
        let mut report = samples::report();
        report.peak.bytes = 300;
        report.peak.at_s = 0.7;
        let frames = report.stacks[0].frames.clone();
        report.peak.stacks = vec![
            PeakStack { stack_id: "00".into(), bytes: 200, frames: frames.clone() },
            PeakStack { stack_id: "01".into(), bytes: 100, frames },
        ];
        report.duration_s = 3.0;
        report.stacks[0].leak.candidate = true;
        // The rule's verdicts as they were at the peak: the interval's before it, not the end's.
        let mut then = report.clone();
        then.duration_s = 0.5;
        then.stacks[0].leak.candidate = false;
        let mut second = then.stacks[0].clone();
        second.stack_id = "01".into();
        second.leak.candidate = true;
        then.stacks.push(second);
        let (peak, _) = pick(Path::new("r.rec"), &[then, report], Moment::Peak).unwrap();
        assert!(peak.at_peak && !peak.is_final);
        assert_eq!(peak.duration_s, 0.7);
        assert_eq!(peak.totals.outstanding_bytes, 300);
        assert_eq!(
            peak.stacks.iter().map(|s| (s.outstanding_bytes, s.leak.candidate)).collect::<Vec<_>>(),
            [(200, false), (100, true)]
        );
    }

    #[test]
    fn a_recording_without_a_peak_says_so() {
        let err = pick(Path::new("r.rec"), &[samples::report()], Moment::Peak).unwrap_err();
        assert!(matches!(err, MomentError::NoPeak { .. }));
        assert!(moment("-1").is_err() && moment("soon").is_err());
        assert_eq!(moment("2.5"), Ok(Moment::Seconds(2.5)));
    }
}
