//! What a drawn report (the HTML page, the flame graph) shows of a process's stacks: the largest
//! whose JSON fits in `PAGE_BUDGET`, the others counted in `stacks_not_shown`. A page drawing
//! tens of thousands of deep stacks would not open in a browser, and building it took memprof
//! gigabytes.

use super::Flame;
use crate::heap::report::Report;

/// The JSON of the stacks a drawn report holds at most.
const PAGE_BUDGET: usize = 16 << 20;

/// `report` with its largest stacks by what `flame` measures (then by bytes allocated) whose
/// JSON fits in `PAGE_BUDGET`. Frames are shared handles, so the copy costs the kept stacks'
/// frame lists only. A report of several processes is merged into one first (see
/// `format::render_flame`): its children are not paged.
pub fn page(report: &Report, flame: Flame) -> Report {
    let mut order: Vec<&_> = report.stacks.iter().collect();
    order.sort_by_key(|s| std::cmp::Reverse((flame.value(s), s.allocated_bytes)));
    let mut spent = 0;
    let mut kept = Vec::new();
    for stack in order {
        let size = serde_json::to_vec(stack).map_or(usize::MAX, |json| json.len());
        if spent + size > PAGE_BUDGET {
            break;
        }
        spent += size;
        kept.push(stack.clone());
    }
    let mut page = Report { stacks: Vec::new(), ..report.clone() };
    page.stacks_not_shown = report.stacks_not_shown + (report.stacks.len() - kept.len()) as u64;
    page.stacks = kept;
    page
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heap::report::samples;

    #[test]
    fn the_largest_stacks_that_fit_are_kept_and_the_others_counted() {
        let mut report = samples::report();
        let one = report.stacks[0].clone();
        let size = serde_json::to_vec(&one).unwrap().len();
        report.stacks = (0..(PAGE_BUDGET / size + 10) as u64)
            .map(|n| {
                let mut stack = one.clone();
                stack.stack_id = format!("{n:016x}");
                stack.outstanding_bytes = n;
                stack
            })
            .collect();
        let paged = page(&report, Flame::Bytes);
        let not_shown = paged.stacks_not_shown as usize;
        assert!(not_shown >= 10, "{not_shown}");
        assert_eq!(paged.stacks.len() + not_shown, report.stacks.len());
        let smallest_kept = paged.stacks.iter().map(|s| s.outstanding_bytes).min().unwrap();
        assert_eq!(smallest_kept, not_shown as u64, "the largest kept, the smallest left out");
        let small = page(&samples::report(), Flame::Bytes);
        assert_eq!((small.stacks.len(), small.stacks_not_shown), (samples::report().stacks.len(), 0));
    }
}
