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
use profiler_common::{stack_table, DeferredUnwind, ProcHeap, Stack, StackEnd, StackKey, StackStats};

use crate::{
    kernel::aggregate::{map, whole_frames, whole_id},
    unwind::{Completion, BPF_NOEXIST},
};

/// Makes the whole stack of deferred walk `event`, finished as `completion`, count under the
/// walk's early id. Not when the whole stack has an entry already (the kernel walked it whole
/// before): its counts stay apart, and the report adds the two. A walk memprof could not finish
/// ends where the kernel's will, at the same frame, for the same reason; but for a read of the
/// stack, which memprof's copy of it may end before the kernel's does.
pub fn count_whole_under_early_id(ebpf: &mut Ebpf, event: &DeferredUnwind, completion: &Completion) {
    if event.table != stack_table::ALLOCATIONS || completion.end == StackEnd::ReadFailed {
        return;
    }
    if let Err(err) = write_entry(ebpf, event, completion) {
        tracing::debug!(pid = event.tgid, "counting a deferred stack under its early id: {err:#}");
    }
}

fn write_entry(ebpf: &mut Ebpf, event: &DeferredUnwind, completion: &Completion) -> anyhow::Result<()> {
    let stored: Stack = BpfHashMap::<_, u64, Stack>::try_from(map(ebpf, "STACKS")?)?.get(&event.stack_id, 0)?;
    let (frames, end) = whole_frames(&stored, Some(completion));
    let heap: Option<ProcHeap> =
        BpfHashMap::<_, u32, ProcHeap>::try_from(map(ebpf, "PROC_HEAP")?)?.get(&event.tgid, 0).ok();
    let image = heap.map_or(0, |heap| heap.image as u32);
    let early = StackKey { tgid: event.tgid, image, stack_id: event.stack_id };
    let whole = StackKey { stack_id: whole_id(&frames, end), ..early };
    let stats = ebpf.map_mut("STACK_STATS").context("map STACK_STATS missing from the eBPF object")?;
    let mut stats = BpfHashMap::<_, StackKey, StackStats>::try_from(stats)?;
    // None under the process's program now: an earlier program's, which the exec's purge drops.
    stats.get(&early, 0)?;
    stats.insert(whole, StackStats { counted_as: event.stack_id, ..StackStats::EMPTY }, BPF_NOEXIST)?;
    Ok(())
}
