//! Filters on a report's stacks, the same for every format: `--min-bytes`, `--max-depth`,
//! `--focus`, `--ignore`. `--focus` and `--ignore` pick the stacks listed at the peak and for
//! temporary allocations too. Totals and drops stay those of the whole process.

use clap::Args;
use regex::Regex;

use crate::{
    heap::report::{Report, StackReport},
    symbolize::Frame,
};

#[derive(Debug, Args, Clone, Default)]
pub struct Filters {
    /// Only stacks with at least this many bytes in use.
    #[arg(long, default_value_t = 0, value_name = "BYTES", allow_negative_numbers = true, value_parser = crate::cli::whole("bytes", 0, u64::MAX))]
    pub min_bytes: u64,
    /// Keep the N outermost frames of each stack and merge stacks that then look alike.
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = crate::cli::whole("frames", 1, u32::MAX))]
    pub max_depth: Option<u32>,
    /// Only stacks with a frame whose function or module matches.
    #[arg(long, value_name = "REGEX")]
    pub focus: Option<Regex>,
    /// Leave out stacks with a frame whose function or module matches.
    #[arg(long, value_name = "REGEX")]
    pub ignore: Option<Regex>,
}

impl Filters {
    pub fn is_empty(&self) -> bool {
        self.min_bytes == 0 && self.max_depth.is_none() && self.focus.is_none() && self.ignore.is_none()
    }

    pub fn apply(&self, report: &mut Report) {
        report.stacks.retain(|stack| stack.outstanding_bytes >= self.min_bytes && self.picks(&stack.frames));
        report.peak.stacks.retain(|stack| self.picks(&stack.frames));
        report.temporary_stacks.retain(|stack| self.picks(&stack.frames));
        if let Some(depth) = self.max_depth {
            report.stacks = fold(std::mem::take(&mut report.stacks), depth as usize);
            // A merged stack's high is at most the sum of its parts' (`add_counts`), and no
            // stack held more at once than its whole process did at its peak.
            if report.peak.bytes > 0 {
                for stack in &mut report.stacks {
                    stack.max_outstanding_bytes = stack.max_outstanding_bytes.min(report.peak.bytes);
                }
            }
        }
    }

    /// Whether `--focus` and `--ignore` keep a stack of these frames.
    fn picks(&self, frames: &[Frame]) -> bool {
        let matches = |re: &Regex| frames.iter().any(|f| re.is_match(&f.function) || re.is_match(&f.module));
        self.focus.as_ref().is_none_or(matches) && !self.ignore.as_ref().is_some_and(matches)
    }
}

/// Cuts each stack to its `depth` outermost frames and merges stacks whose frames are then the
/// same; a merged stack keeps the id of its largest part and is a leak candidate if any part is.
fn fold(stacks: Vec<StackReport>, depth: usize) -> Vec<StackReport> {
    let mut folded: Vec<StackReport> = Vec::new();
    for mut stack in stacks {
        if stack.frames.len() > depth {
            stack.frames = stack.frames[stack.frames.len() - depth..].into();
            stack.via.clear();
        }
        match folded.iter_mut().find(|s| same_frames(s, &stack)) {
            Some(into) => merge(into, stack),
            None => folded.push(stack),
        }
    }
    folded.sort_by_key(|s| std::cmp::Reverse((s.outstanding_bytes, s.allocated_bytes)));
    folded
}

fn same_frames(a: &StackReport, b: &StackReport) -> bool {
    a.frames.len() == b.frames.len()
        && a.frames.iter().zip(b.frames.iter()).all(|(x, y)| x.function == y.function && x.module == y.module)
}

fn merge(into: &mut StackReport, part: StackReport) {
    if part.outstanding_bytes > into.outstanding_bytes {
        into.stack_id = part.stack_id.clone();
        into.leak = part.leak.clone();
    } else if part.leak.candidate && !into.leak.candidate {
        into.leak = part.leak.clone();
    }
    into.add_counts(&part);
    into.truncated |= part.truncated;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heap::report::{
        samples::{frame, report},
        PeakStack,
    };

    fn stack(bytes: u64, functions: &[&str]) -> StackReport {
        let mut stack = report().stacks.remove(0);
        stack.outstanding_bytes = bytes;
        stack.frames = functions.iter().map(|f| frame(f, None, None)).collect();
        stack
    }

    #[test]
    fn focus_ignore_and_min_bytes_pick_stacks() {
        let mut r = report();
        r.stacks = vec![stack(100, &["leak", "main"]), stack(10, &["cache", "main"]), stack(50, &["pool", "worker"])];
        let filters = Filters { focus: Some(Regex::new("^main$").unwrap()), min_bytes: 20, ..Filters::default() };
        filters.apply(&mut r);
        assert_eq!(r.stacks.iter().map(|s| s.outstanding_bytes).collect::<Vec<_>>(), [100]);
        let mut r = report();
        r.stacks = vec![stack(100, &["leak", "main"]), stack(50, &["pool", "worker"])];
        r.peak.stacks = r
            .stacks
            .iter()
            .map(|s| PeakStack { stack_id: s.stack_id.clone(), bytes: 1, frames: s.frames.clone() })
            .collect();
        Filters { ignore: Some(Regex::new("pool").unwrap()), ..Filters::default() }.apply(&mut r);
        assert_eq!(r.stacks.len(), 1);
        assert_eq!(r.peak.stacks.len(), 1, "the peak's stacks are picked alike");
    }

    #[test]
    fn max_depth_keeps_outer_frames_and_merges() {
        let mut r = report();
        r.stacks = vec![stack(100, &["a", "leak", "main"]), stack(30, &["b", "leak", "main"]), stack(5, &["main"])];
        Filters { max_depth: Some(2), ..Filters::default() }.apply(&mut r);
        assert_eq!(r.stacks.len(), 2);
        assert_eq!(r.stacks[0].outstanding_bytes, 130);
        assert_eq!(r.stacks[0].frames.iter().map(|f| f.function.as_str()).collect::<Vec<_>>(), ["leak", "main"]);
    }

    /// Two stacks whose highs came one after the other: merged, their sum is more than the
    /// process ever held, which bounds it.
    #[test]
    fn a_merged_stacks_high_is_no_more_than_its_process_peak() {
        let mut r = report();
        r.stacks = vec![stack(10, &["a", "main"]), stack(10, &["b", "main"])];
        r.stacks.iter_mut().for_each(|s| s.max_outstanding_bytes = 1000);
        r.peak.bytes = 1200;
        Filters { max_depth: Some(1), ..Filters::default() }.apply(&mut r);
        assert_eq!((r.stacks[0].outstanding_bytes, r.stacks[0].max_outstanding_bytes), (20, 1200));
    }
}
