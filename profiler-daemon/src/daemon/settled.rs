//! Targets at rest. A process whose stacks have not changed for a whole leak window (see
//! `kernel::stillness`) is settled: its stacks are not read again and its view is not rebuilt.
//! Each interval brings the last view up to date instead (the ages, the memory, the timeline),
//! until the process moves again. At rest this is most of a traced process's life, and a
//! rebuild costs in proportion to its stacks.

use crate::{
    daemon::{heavy::Built, view::TargetView},
    heap::{
        leak::LeakSettings,
        report::{self, Report},
    },
};

/// The intervals in a row a target is still before it is settled. By then its leak verdicts are
/// a whole window of equal points, which more equal points do not change (one more interval,
/// so that the window's start is past the generation of its last allocation), and every
/// generation it wrote is frozen, taken over by the ages' book (`AgeBook::rest`).
pub fn intervals(leak: LeakSettings) -> u32 {
    leak.window as u32 + 2
}

/// What changed of a settled target since its last view.
pub struct Now<'a> {
    pub now_ns: u64,
    pub start_ns: u64,
    /// The rest of the report that changes with time or with other processes.
    pub update: &'a dyn Fn(&mut Report),
}

/// `last` brought up to `now`: the stacks and verdicts stay, their ages grow.
pub fn bring_up_to_date(last: &TargetView, now: Now) -> TargetView {
    let mut report = last.report.clone();
    report.duration_s = report::seconds(now.now_ns.saturating_sub(now.start_ns));
    report.stacks = report.stacks.into_iter().map(|stack| stack.aged_at(now.now_ns)).collect();
    (now.update)(&mut report);
    TargetView {
        pid: last.pid,
        slot: last.slot,
        comm: last.comm.clone(),
        cgroup: last.cgroup.clone(),
        attached_at: last.attached_at,
        double_frees: last.double_frees,
        leak_candidate_bytes: last.leak_candidate_bytes,
        leak_candidates: last.leak_candidates,
        leak_warming_up: last.leak_warming_up,
        sample_bytes: last.sample_bytes,
        sizes: last.sizes,
        top_stacks: last.top_stacks.clone(),
        other_stack_bytes: last.other_stack_bytes,
        report,
        freed_stacks: last.freed_stacks.iter().cloned().map(|stack| stack.aged_at(now.now_ns)).collect(),
        built: Built::default(),
    }
}
