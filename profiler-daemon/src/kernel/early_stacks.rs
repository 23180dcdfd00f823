//! A stack the kernel first walked in part (a walk it deferred, which memprof finishes:
//! `unwind::deferred`) and later whole, counted in one `STACK_STATS` entry: its early id's.
//!
//! The deferred walks' allocations count under the early id, the kernel's whole walks' under the
//! whole stack's id. In two entries, each id keeps a high of its own, and the stack's high, of the
//! two together, is lost. So, once memprof has finished a deferred walk and before it gives the
//! kernel the mapping list that lets it walk the stack whole, it writes an empty entry under the
//! whole id that sends its allocations to the early id's (`StackStats::counted_as`). The reports
//! name the stack by its whole id (`aggregate::merge_deferred`).

use anyhow::Context as _;
use aya::{maps::HashMap as BpfHashMap, Ebpf};
use profiler_common::{stack_table, walk_kind, DeferredUnwind, ProcHeap, Stack, StackEnd, StackKey, StackStats};

use crate::{
    kernel::aggregate::{map, whole_frames, whole_id},
    unwind::{Completion, BPF_NOEXIST},
};

/// Where a finished walk's whole stack counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counted {
    /// Under the walk's early id, or not an allocation's stack.
    Together,
    /// Under an id of its own too: the whole stack had an entry already (the kernel walked it
    /// whole before, or another deferred walk of it, stopped at another frame, was finished
    /// first). The report adds the two ids' highs.
    Apart,
}

/// Makes the whole stack of deferred walk `event`, finished as `completion`, count under the
/// walk's early id, unless it has an entry already. A walk memprof could not finish ends where
/// the kernel's will, at the same frame, for the same reason; but for a read of the stack, which
/// memprof's copy of it may end before the kernel's does. Only an allocation's stack has totals:
/// a page fault's or a mapping call's early id never has an entry. `by_calls`: whether the walk's
/// process is traced by its allocator calls still; the stacks of one moved to its pages went.
pub fn count_whole_under_early_id(
    ebpf: &mut Ebpf,
    event: &DeferredUnwind,
    completion: &Completion,
    by_calls: bool,
) -> Counted {
    let allocation = by_calls && event.table == stack_table::ALLOCATIONS && event.kind == walk_kind::CALL;
    if !allocation || completion.end == StackEnd::ReadFailed {
        return Counted::Together;
    }
    write_entry(ebpf, event, completion).unwrap_or_else(|err| {
        tracing::debug!(pid = event.tgid, "counting a deferred stack under its early id: {err:#}");
        Counted::Together
    })
}

fn write_entry(ebpf: &mut Ebpf, event: &DeferredUnwind, completion: &Completion) -> anyhow::Result<Counted> {
    let stored: Stack = BpfHashMap::<_, u64, Stack>::try_from(map(ebpf, "STACKS")?)?.get(&event.stack_id, 0)?;
    let (frames, end) = whole_frames(&stored, Some(completion));
    let image = program_image(ebpf, event.tgid).unwrap_or(0);
    let early = StackKey { tgid: event.tgid, image, stack_id: event.stack_id };
    let whole = StackKey { stack_id: whole_id(&frames, end), ..early };
    if whole == early {
        return Ok(Counted::Together);
    }
    let stats = ebpf.map_mut("STACK_STATS").context("map STACK_STATS missing from the eBPF object")?;
    let mut stats = BpfHashMap::<_, StackKey, StackStats>::try_from(stats)?;
    // The early id may have no entry yet: memprof read the walk before the kernel counted its
    // allocation. The entry below sends the whole stack's allocations there all the same, and
    // the kernel makes it at the first of them. (A walk of the program before an exec is sent
    // under the new program's number: an entry its stacks never name.)
    let apart =
        |existing: StackStats| if existing.counted_as == event.stack_id { Counted::Together } else { Counted::Apart };
    if let Ok(existing) = stats.get(&whole, 0) {
        return Ok(apart(existing));
    }
    match stats.insert(whole, StackStats { counted_as: event.stack_id, ..StackStats::EMPTY }, BPF_NOEXIST) {
        Ok(()) => Ok(Counted::Together),
        // The kernel counted it whole in between.
        Err(err) => stats.get(&whole, 0).map(apart).map_err(|_| err.into()),
    }
}

/// The number of the program process `tgid` runs (`ProcHeap::image`), which each of its execs
/// moves; None before its first allocator call.
pub fn program_image(ebpf: &Ebpf, tgid: u32) -> Option<u32> {
    let heaps = BpfHashMap::<_, u32, ProcHeap>::try_from(map(ebpf, "PROC_HEAP").ok()?).ok()?;
    heaps.get(&tgid, 0).ok().map(|heap| heap.image as u32)
}
