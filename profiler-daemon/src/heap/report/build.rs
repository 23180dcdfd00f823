//! One process's report, built from its snapshot.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use profiler_common::DropReason;

use super::{
    Bucket, Peak, PeakStack, Report, StackReport, Stacks, TemporaryStack, ThreadPair, Totals, LISTED_MAX,
    MISSED_GENERATIONS,
};
use crate::{
    heap::{
        double_free::DoubleFrees,
        inspect::{Inspection, Reachability},
        leak::{LeakTracker, Timeline},
        mappings,
        pinned::Pinned,
        types::{self, TypeCount},
    },
    kernel::aggregate::{KernelSnapshot, Sampler, Snapshot, StackSnapshot, StackTable},
    symbolize::Frames,
};

/// What a report needs besides the snapshot.
pub struct Context<'a> {
    pub stacks: Stacks<'a>,
    pub comm: &'a str,
    /// See `Report::ns_pid`: read once at attach, since a pid namespace is for life.
    pub ns_pid: Option<u32>,
    pub double_frees: &'a DoubleFrees,
    pub leaks: &'a LeakTracker,
    /// The pages the process's live blocks pin, by kernel stack id.
    pub pinned: &'a Pinned,
}

/// How much of a snapshot a report shows.
#[derive(Debug, Clone, Copy)]
pub struct Selection {
    pub is_final: bool,
    /// At most this many stacks; `None` keeps all.
    pub top: Option<usize>,
    /// Count only allocations at least min-age old (the snapshot's aged figures).
    pub aged_only: bool,
    /// Also list the stacks that hold nothing now, after those that do: pprof's allocation
    /// profile counts every allocation.
    pub freed: bool,
    /// List every stack held at the peak: a recording keeps them for `memprof report --at
    /// peak`, and `format::select` shows the `LISTED_MAX` largest.
    pub whole_peak: bool,
}

/// Builds the report of one process's `snapshot`.
pub fn build(ctx: &Context, snapshot: &Snapshot, kernel: &KernelSnapshot, selection: Selection) -> Report {
    let mut totals = Totals {
        outstanding_bytes: snapshot.outstanding_bytes(),
        unknown_frees: snapshot.counters.unknown_frees,
        internal_frees: snapshot.counters.internal_frees,
        failed_allocations: snapshot.counters.failed_allocations,
        ..Totals::default()
    };
    for stack in &snapshot.stacks {
        totals.allocations += stack.stats.allocations;
        totals.allocated_bytes += stack.stats.allocated_bytes;
        totals.frees += stack.stats.frees;
        totals.freed_bytes += stack.stats.freed_bytes;
        totals.outstanding_allocations += stack.stats.allocations.saturating_sub(stack.stats.frees);
        totals.temporary_allocations += stack.stats.temporary_allocations;
    }
    let counted = |s: &StackSnapshot| {
        if selection.aged_only {
            (s.aged_bytes, s.aged_allocations)
        } else {
            (s.outstanding_bytes, s.outstanding_allocations)
        }
    };
    let mut listed: Vec<_> =
        snapshot.stacks.iter().filter(|s| counted(s).1 > 0 || (selection.freed && s.stats.allocations > 0)).collect();
    listed.sort_by_key(|s| std::cmp::Reverse((counted(s), s.stats.allocated_bytes)));
    let top = selection.top.unwrap_or(usize::MAX);
    // Kernel stack id to the report's, for the timeline.
    let mut report_ids = HashMap::new();
    // Several kernel stacks can be one report's (see `merge_same_stacks`): the largest are read
    // until `top` of the report's are listed, each with its parts read so far.
    let mut distinct = HashSet::new();
    ctx.stacks.symbolize_all(listed.iter().take(top).map(|s| s.stored_id));
    let stacks: Vec<StackReport> = listed
        .into_iter()
        .map_while(|stack| {
            if distinct.len() >= top {
                return None;
            }
            let symbolized = ctx.stacks.symbolize(StackTable::Allocations, stack.stored_id);
            distinct.insert(symbolized.id.clone());
            report_ids.insert(stack.stack_id, symbolized.id.clone());
            let (outstanding_bytes, outstanding_allocations) = counted(stack);
            // Live blocks carry the id their stack was stored under; a stack the kernel
            // deferred counts under both. (A second deferred walk of the same stack, absorbed
            // into it, is counted in the process's total only.)
            let mut pinned = ctx.pinned.of(stack.stack_id);
            if stack.stored_id != stack.stack_id {
                pinned.add(ctx.pinned.of(stack.stored_id));
            }
            let report = StackReport {
                stack_id: symbolized.id,
                outstanding_bytes,
                outstanding_allocations,
                allocations: stack.stats.allocations,
                allocated_bytes: stack.stats.allocated_bytes,
                max_outstanding_bytes: stack.stats.max_outstanding_bytes,
                temporary_allocations: stack.stats.temporary_allocations,
                pinned_pages: pinned.pages,
                pinned_bytes: pinned.bytes,
                // Ages are known to the generation: none is older than tracing.
                oldest_age_s: 0.0,
                oldest_ns: stack.oldest_ns.map(|t| t.max(ctx.stacks.start_ns)),
                truncated: symbolized.truncated,
                via: symbolized.via,
                leak: ctx.leaks.verdict(stack.stack_id),
                reachability: None,
                types: Vec::new(),
                suppressed: None,
                frames: symbolized.frames,
            }
            .aged_at(snapshot.now_ns);
            Some(report)
        })
        .collect();
    let stacks = merge_same_stacks(stacks);
    let names = Names::new(ctx, &report_ids, &stacks);
    let peak =
        peak(&names, snapshot, if selection.whole_peak { None } else { Some(selection.top.unwrap_or(LISTED_MAX)) });
    let temporary_stacks = temporary_stacks(&names, snapshot, selection.top);
    let mappings = mappings::build(&snapshot.mappings, selection.top.unwrap_or(LISTED_MAX).min(LISTED_MAX), |id| {
        let symbolized = ctx.stacks.symbolize(StackTable::Allocations, id);
        (symbolized.id, symbolized.truncated, symbolized.frames)
    });
    let frames =
        stacks.iter().flat_map(|s| s.frames.iter()).chain(mappings.stacks.iter().flat_map(|s| s.frames.iter()));
    let modules = ctx.stacks.modules(frames);
    Report {
        is_final: selection.is_final,
        context: None,
        pid: ctx.stacks.pid,
        ns_pid: ctx.ns_pid,
        comm: ctx.comm.to_string(),
        exe: String::new(),
        parent: None,
        blind_spots: Vec::new(),
        exited: false,
        live: false,
        at_peak: false,
        duration_s: ctx.stacks.seconds_since_start(snapshot.now_ns),
        sample_bytes: snapshot.sample_bytes,
        growth: snapshot.growth,
        usdt_samples: (snapshot.sampler != Sampler::None).then_some(snapshot.counters.usdt_samples),
        usdt_beside_calls: snapshot.sampler == Sampler::BesideCalls,
        totals,
        peak,
        temporary_stacks,
        memory: None,
        mappings,
        dropped: dropped(snapshot),
        unattributed_dropped: unattributed_dropped(kernel),
        stacks_not_shown: 0,
        suppressed: None,
        modules,
        stacks,
        double_frees: ctx.double_frees.kept().to_vec(),
        double_frees_not_kept: ctx.double_frees.not_kept(),
        double_frees_unconfirmed: ctx.double_frees.unconfirmed(),
        sizes: power_of_two_buckets(&snapshot.sizes.buckets),
        lifetimes: power_of_two_buckets(&snapshot.lifetimes.buckets),
        thread_pairs: thread_pairs(snapshot),
        threads: Vec::new(),
        timeline: if selection.is_final {
            ctx.leaks.timeline(|id| report_ids.get(&id).cloned())
        } else {
            Timeline::default()
        },
        children: Vec::new(),
        forks: None,
        unwind_tables: None,
        inspection: None,
    }
}

/// Gives `report` its inspection, and each of its stacks its blocks' classes and types.
pub fn add_inspection(report: &mut Report, inspection: Inspection, stacks: &Stacks) {
    // Kernel ids to the report's: two kernel ids may hold the same frames (see `merge_same_stacks`).
    let mut report_id: HashMap<u64, String> = HashMap::new();
    let mut id = |kernel_id: u64| {
        report_id.entry(kernel_id).or_insert_with(|| stacks.symbolize(StackTable::Allocations, kernel_id).id).clone()
    };
    let mut by_id: HashMap<String, Reachability> = HashMap::new();
    for (&kernel_id, reachability) in &inspection.per_stack {
        by_id.entry(id(kernel_id)).or_default().add(reachability);
    }
    let mut types_by_id: HashMap<String, Vec<TypeCount>> = HashMap::new();
    for (&kernel_id, counts) in &inspection.per_stack_types {
        types::merge(types_by_id.entry(id(kernel_id)).or_default(), counts);
    }
    for stack in &mut report.stacks {
        stack.reachability = by_id.get(&stack.stack_id).copied();
        stack.types = types_by_id.remove(&stack.stack_id).unwrap_or_default();
    }
    report.inspection = Some(inspection);
}

/// Names a snapshot's stacks as the report does: `ids` maps kernel ids to the report ids of the
/// stacks listed, `listed` those by report id; others are symbolized.
struct Names<'a> {
    ctx: &'a Context<'a>,
    ids: &'a HashMap<u64, String>,
    listed: HashMap<&'a str, &'a StackReport>,
}

impl<'a> Names<'a> {
    fn new(ctx: &'a Context<'a>, ids: &'a HashMap<u64, String>, listed: &'a [StackReport]) -> Self {
        Self { ctx, ids, listed: listed.iter().map(|s| (s.stack_id.as_str(), s)).collect() }
    }

    fn of(&self, stack: &StackSnapshot) -> (String, Frames) {
        let known = self.ids.get(&stack.stack_id).and_then(|id| self.listed.get(id.as_str()));
        match known {
            Some(listed) => (listed.stack_id.clone(), listed.frames.clone()),
            None => {
                let symbolized = self.ctx.stacks.symbolize(StackTable::Allocations, stack.stored_id);
                (symbolized.id, symbolized.frames)
            }
        }
    }

    /// The `top` stacks of `snapshot` by `value` (those above 0), named, each stack's value
    /// summed with its deferred walk's twin's (the same frames: see `merge_same_stacks`).
    fn top<'s>(
        &self,
        snapshot: &'s Snapshot,
        top: Option<usize>,
        value: impl Fn(&StackSnapshot) -> u64,
    ) -> Vec<(String, Frames, Vec<&'s StackSnapshot>)> {
        let mut chosen: Vec<&StackSnapshot> = snapshot.stacks.iter().filter(|s| value(s) > 0).collect();
        chosen.sort_by_key(|s| std::cmp::Reverse(value(s)));
        // Every one is named, in requests of a few hundred: past the `top`, a stack may still be
        // a twin of one listed.
        self.ctx.stacks.symbolize_all(chosen.iter().map(|s| s.stored_id));
        let mut named: Vec<(String, Frames, Vec<&'s StackSnapshot>)> = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        for stack in chosen {
            let (id, frames) = self.of(stack);
            match index.get(&id) {
                Some(&same) => named[same].2.push(stack),
                None if named.len() < top.unwrap_or(usize::MAX) => {
                    index.insert(id.clone(), named.len());
                    named.push((id, frames, vec![stack]));
                }
                None => {}
            }
        }
        named
    }
}

/// The process's peak and the stacks that held memory then: at most `top` of them and
/// `LISTED_MAX`, or all of them without `top`.
fn peak(names: &Names, snapshot: &Snapshot, top: Option<usize>) -> Peak {
    let top = top.map(|top| top.min(LISTED_MAX));
    let stacks = names
        .top(snapshot, top, |s| s.peak_bytes)
        .into_iter()
        .map(|(stack_id, frames, parts)| PeakStack {
            stack_id,
            bytes: parts.iter().map(|s| s.peak_bytes).sum(),
            frames,
        })
        .collect();
    let at_ns = snapshot.peak.at_ns;
    Peak {
        bytes: snapshot.peak.bytes,
        at_s: if at_ns == 0 { 0.0 } else { names.ctx.stacks.seconds_since_start(at_ns) },
        stacks,
    }
}

/// The stacks with the most temporary allocations, at most `top` of them.
fn temporary_stacks(names: &Names, snapshot: &Snapshot, top: Option<usize>) -> Vec<TemporaryStack> {
    let top = Some(top.unwrap_or(LISTED_MAX).min(LISTED_MAX));
    names
        .top(snapshot, top, |s| s.stats.temporary_allocations)
        .into_iter()
        .map(|(stack_id, frames, parts)| TemporaryStack {
            stack_id,
            temporary_allocations: parts.iter().map(|s| s.stats.temporary_allocations).sum(),
            allocations: parts.iter().map(|s| s.stats.allocations).sum(),
            frames,
        })
        .collect()
}

/// Stacks with the same frames as one: a walk the kernel deferred (see `unwind::deferred`) is
/// stored apart from the same stack walked whole once the table was loaded. The larger one's
/// leak verdict stands for both.
fn merge_same_stacks(mut merged: Vec<StackReport>) -> Vec<StackReport> {
    // Merged in place: the list is a process's every stack, twins are rare.
    let mut first: HashMap<&str, usize> = HashMap::new();
    let twins: Vec<(usize, usize)> = (0..merged.len())
        .filter_map(|i| match first.get(merged[i].stack_id.as_str()) {
            Some(&into) => Some((into, i)),
            None => {
                first.insert(&merged[i].stack_id, i);
                None
            }
        })
        .collect();
    drop(first);
    for &(into, twin) in &twins {
        let twin = merged[twin].clone();
        merged[into].add_counts(&twin);
        merged[into].truncated &= twin.truncated;
    }
    if !twins.is_empty() {
        let gone: BTreeSet<usize> = twins.iter().map(|&(_, twin)| twin).collect();
        let mut index = 0;
        merged.retain(|_| {
            index += 1;
            !gone.contains(&(index - 1))
        });
    }
    merged.sort_by_key(|s| std::cmp::Reverse(((s.outstanding_bytes, s.outstanding_allocations), s.allocated_bytes)));
    merged
}

/// What the process could not record, by reason: its drops in the kernel and the age
/// generations missed.
pub fn dropped(snapshot: &Snapshot) -> BTreeMap<&'static str, u64> {
    let mut dropped: BTreeMap<_, _> =
        DropReason::ALL.iter().map(|r| (r.name(), snapshot.drops.counts[*r as usize])).collect();
    dropped.insert(MISSED_GENERATIONS, snapshot.missed_generations);
    dropped
}

/// The drops of no process in particular that happened, by reason; with the bytes of records
/// memprof's rings skipped (`ring::SKIPPED_REASON`).
pub fn unattributed_dropped(kernel: &KernelSnapshot) -> BTreeMap<&'static str, u64> {
    DropReason::ALL
        .iter()
        .map(|r| (r.name(), kernel.unattributed_drops[*r as usize]))
        .chain([(crate::ring::SKIPPED_REASON, crate::ring::skipped_bytes())])
        .filter(|(_, count)| *count > 0)
        .collect()
}

/// Thread pairs, most bytes first.
fn thread_pairs(snapshot: &Snapshot) -> Vec<ThreadPair> {
    let mut pairs: Vec<ThreadPair> = snapshot
        .thread_pairs
        .iter()
        .map(|(key, stats)| ThreadPair {
            alloc_tid: key.alloc_tid,
            free_tid: key.free_tid,
            frees: stats.frees,
            freed_bytes: stats.freed_bytes,
        })
        .collect();
    pairs.sort_by_key(|p| (std::cmp::Reverse(p.freed_bytes), p.alloc_tid, p.free_tid));
    pairs
}

/// The non-empty buckets of a histogram whose bucket `i` counts values in `2^(i-1)+1 ..= 2^i`.
fn power_of_two_buckets(counts: &[u64]) -> Vec<Bucket> {
    let bound = |i: usize| if i >= 64 { u64::MAX } else { 1u64 << i };
    counts
        .iter()
        .enumerate()
        .filter(|(_, count)| **count > 0)
        .map(|(i, &count)| Bucket { min: if i == 0 { 0 } else { bound(i - 1) + 1 }, max: bound(i), count })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_cover_powers_of_two() {
        let buckets = power_of_two_buckets(&[1, 0, 2, 0, 3]);
        assert_eq!(
            buckets,
            [
                Bucket { min: 0, max: 1, count: 1 },
                Bucket { min: 3, max: 4, count: 2 },
                Bucket { min: 9, max: 16, count: 3 }
            ]
        );
    }
}
