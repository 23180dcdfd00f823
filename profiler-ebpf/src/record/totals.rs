//! The totals an allocation and a free change: per stack (`STACK_STATS`), per process
//! (`PROC_HEAP`) and per pair of threads (`THREAD_PAIRS`), with `LIVE`'s entry of the block.

use aya_ebpf::{bindings::BPF_NOEXIST, cty::c_void, helpers::bpf_ktime_get_ns, macros::map, maps::HashMap, Global};
use profiler_common::{
    generations::{self, FROZEN_AGE},
    stack_table, AddrKey, DropReason, LiveAlloc, Log2Histogram, ProcHeap, StackKey, StackStats, ThreadPairKey,
    ThreadPairStats, LOG2_BUCKETS, NO_STACK,
};

use super::{frees::forget_free, get_or_insert, usdt::rate_of, Probe, PROC_COUNTERS};
use crate::{
    live,
    shared::{add, add_and_read, count_drop, raise, EEXIST, NO_PREALLOC},
};

#[map]
static STACK_STATS: HashMap<StackKey, StackStats> = HashMap::with_max_entries(65_536, NO_PREALLOC);

/// Per process: bytes in use and their peak, sizes and lifetimes. One map, so that an allocation
/// and a free each take one per-process lookup for all of them.
#[map]
static PROC_HEAP: HashMap<u32, ProcHeap> = HashMap::with_max_entries(4_096, NO_PREALLOC);

/// Only frees by another thread than the allocating one: same-thread frees are the rest.
#[map]
static THREAD_PAIRS: HashMap<ThreadPairKey, ThreadPairStats> = HashMap::with_max_entries(16_384, NO_PREALLOC);

/// The generation clock (see `profiler_common::generations`), set by the loader: its start, and
/// the length of a generation (the reporting interval).
#[unsafe(no_mangle)]
static CLOCK_BASE_NS: Global<u64> = Global::new(0);
#[unsafe(no_mangle)]
static GENERATION_NS: Global<u64> = Global::new(5_000_000_000);

fn generation(time_ns: u64) -> u64 {
    generations::generation(time_ns, CLOCK_BASE_NS.load(), GENERATION_NS.load())
}

/// Zeroed values to insert from: read-only globals, since a 512-byte histogram does not fit on
/// the 512-byte BPF stack.
static EMPTY_STATS: StackStats = StackStats::EMPTY;

static EMPTY_HEAP: ProcHeap = ProcHeap::EMPTY;
static EMPTY_PAIR: ThreadPairStats = ThreadPairStats { frees: 0, freed_bytes: 0 };

/// An allocation recorded: `func`, its `AllocFn` with its marks (`SAMPLED`, `USDT`), stands for
/// what `rate` says (see `profiler_common::weight`). Returns whether it is in `LIVE`.
#[inline(always)]
pub(super) fn on_allocated(probe: Probe, tgid: u32, tid: u32, addr: u64, size: u64, func: u32, rate: u64) -> bool {
    let key = AddrKey { tgid, _pad: 0, addr };
    let alloc = LiveAlloc {
        size,
        time_ns: unsafe { bpf_ktime_get_ns() },
        stack_id: probe.stack_id(stack_table::ALLOCATIONS, tgid),
        tid,
        func,
    };
    let (count, bytes) = profiler_common::weight(rate, size);
    // The address is in use again: a later free of it is not a double free.
    forget_free(&key);
    if let Err(err) = live::insert(&key, &alloc, BPF_NOEXIST as u64) {
        if err != -EEXIST {
            count_drop(DropReason::LiveMapFull);
            return false;
        }
        // Still live: its free went unseen. Retire the old allocation so its stack is not charged forever.
        count_drop(DropReason::MissedFree);
        if let Some(old) = live::get(&key) {
            // When and by whom it was freed is unknown: no lifetime or thread pair for it.
            count_free(&key, &old, UNSEEN, alloc.time_ns, false);
        }
        if live::insert(&key, &alloc, 0).is_err() {
            count_drop(DropReason::LiveMapFull);
            return false;
        }
    }
    let heap = proc_heap(tgid);
    match allocation_stats(tgid, image_of(heap.as_deref()), &key, alloc.stack_id) {
        Some(stats) => {
            keep_bytes_at_peak(stats, heap.as_deref());
            add(&mut stats.allocations, count);
            add(&mut stats.allocated_bytes, bytes);
            // Read back after the add: another thread's update in between only makes it a
            // value the stack held a moment earlier or later.
            let outstanding = stats.allocated_bytes.wrapping_sub(stats.freed_bytes);
            if (outstanding as i64) > 0 {
                raise(&mut stats.max_outstanding_bytes, outstanding);
            }
            let slot = generations::slot(generation(alloc.time_ns));
            if let (Some(slot_bytes), Some(slot_count)) =
                (stats.generation_bytes.get_mut(slot), stats.generation_allocations.get_mut(slot))
            {
                add(slot_bytes, bytes);
                add(slot_count, count);
            }
        }
        None => count_drop(DropReason::StatsMapFull),
    }
    if let Some(heap) = heap {
        // Exactly the bytes in use this allocation made: every value the process held passes
        // through here, so the peak is the most it held, not the most a reader saw.
        let in_use = add_and_read(&mut heap.in_use, bytes);
        if (in_use as i64) > 0 && raise(&mut heap.peak, in_use) {
            heap.peak_ns = alloc.time_ns;
            add(&mut heap.peak_generation, 1);
        }
        count_in(&mut heap.sizes, size, count);
    }
    true
}

/// The process's `PROC_HEAP` entry, inserted empty at its first call.
fn proc_heap(tgid: u32) -> Option<&'static mut ProcHeap> {
    match get_or_insert(&PROC_HEAP, &tgid, &EMPTY_HEAP) {
        // SAFETY: a map value pointer stays valid while the program runs; updates are atomic but
        // for the peak's time, which a race can only leave a moment off.
        Some(heap) => Some(unsafe { &mut *heap }),
        None => {
            count_drop(DropReason::ProcessTableFull);
            None
        }
    }
}

/// Before a change to a stack's bytes: at the stack's first change since its process's latest
/// peak, keeps what it held then. A few instructions per call, where copying every stack's bytes
/// at each new peak would walk them all.
#[inline(always)]
fn keep_bytes_at_peak(stats: &mut StackStats, heap: Option<&ProcHeap>) {
    let Some(heap) = heap else {
        return;
    };
    // SAFETY: an aligned u64 in a map value; read once, as another CPU may bump it.
    let generation = unsafe { core::ptr::read_volatile(&heap.peak_generation) };
    if stats.peak_generation != generation {
        stats.bytes_at_peak = stats.allocated_bytes.wrapping_sub(stats.freed_bytes);
        stats.peak_generation = generation;
    }
}

fn stack_stats(tgid: u32, image: u32, stack_id: u64) -> Option<&'static mut StackStats> {
    let key = StackKey { tgid, image, stack_id };
    // SAFETY: a map value pointer stays valid while the program runs; every update is atomic.
    get_or_insert(&STACK_STATS, &key, &EMPTY_STATS).map(|stats| unsafe { &mut *stats })
}

/// The totals an allocation from stack `stack_id` counts in: the stack's own, or those of the
/// id it is counted under (`StackStats::counted_as`), which the `LIVE` entry of block `key` then
/// names too, for its free.
fn allocation_stats(tgid: u32, image: u32, key: &AddrKey, stack_id: u64) -> Option<&'static mut StackStats> {
    let stats = stack_stats(tgid, image, stack_id)?;
    let counted_as = stats.counted_as;
    if counted_as == NO_STACK {
        return Some(stats);
    }
    live::name_stack(key, counted_as);
    stack_stats(tgid, image, counted_as)
}

/// The program the process runs (`ProcHeap::image`); 0 without its heap entry.
#[inline(always)]
fn image_of(heap: Option<&ProcHeap>) -> u32 {
    heap.map_or(0, |heap| heap.image as u32)
}

/// Process `tgid` exec'd (`process::process_exec`, before the new program's first instruction):
/// its heap figures and counters start again, and its stacks' totals are kept apart from the old
/// program's under the returned number, the old one's plus one. The daemon drops the old
/// program's when it handles the exec; the probes of files both programs map record the new one
/// meanwhile. Only the exec'ing thread is left in the process, so nothing races these writes.
pub fn new_image(tgid: u32) -> u32 {
    let _ = PROC_COUNTERS.remove(tgid);
    crate::shared::forget_drops(tgid);
    // Emptied in place: a replacing insert needs a new element, which a map without
    // preallocation can fail to get. The old program's entry and number would then stay, and the
    // daemon's purge of that number would take the new program's totals with it.
    let Some(heap) = proc_heap(tgid) else {
        // Its first calls insert an entry numbered 0, which the purge of images below 0 keeps.
        return 0;
    };
    let image = (heap.image as u32).wrapping_add(1);
    let empty: *const ProcHeap = &EMPTY_HEAP;
    // Copied by the helper: the value is larger than the BPF stack, and unrolled stores would
    // make the program long. It reads this program's own read-only data, which does not fault.
    // SAFETY: `heap` is a map value of `size_of::<ProcHeap>()` bytes, as the copy.
    let _ = unsafe {
        aya_ebpf::helpers::generated::bpf_probe_read_kernel(
            (heap as *mut ProcHeap).cast::<c_void>(),
            core::mem::size_of::<ProcHeap>() as u32,
            empty.cast::<c_void>(),
        )
    };
    heap.image = image as u64;
    image
}

/// Adds `count` (in 1/COUNT_SCALE units) to the bucket of `value`.
fn count_in(histogram: &mut Log2Histogram, value: u64, count: u64) {
    let bucket = profiler_common::log2_bucket(value).min(LOG2_BUCKETS - 1);
    if let Some(total) = histogram.buckets.get_mut(bucket) {
        add(total, count);
    }
}

/// `count_free`'s freeing thread when the free was not seen. Thread id 0 is the kernel's idle task.
/// (Not an `Option`: the verifier rejects the uninitialised register a `None` passes.)
pub(super) const UNSEEN: u32 = 0;

/// Counts the end of allocation `alloc` of `key` in its stack's totals and age generation (and
/// as `temporary` there); in its process's bytes in use; when the free was seen (by thread
/// `freed_by`), in the process's lifetimes, and its thread pair when another thread freed it.
pub(super) fn count_free(key: &AddrKey, alloc: &LiveAlloc, freed_by: u32, now: u64, temporary: bool) {
    let (tgid, rate) = (key.tgid, rate_of(key, alloc));
    let (count, bytes) = profiler_common::weight(rate, alloc.size);
    let heap = proc_heap(tgid);
    let image = image_of(heap.as_deref());
    match stack_stats(tgid, image, alloc.stack_id) {
        Some(stats) => {
            keep_bytes_at_peak(stats, heap.as_deref());
            add(&mut stats.frees, count);
            add(&mut stats.freed_bytes, bytes);
            // Full mode only: unsampled calls do not pass the return probe that tracks a
            // thread's last allocation.
            if temporary && rate == 0 {
                add(&mut stats.temporary_allocations, count);
            }
            let born = generation(alloc.time_ns);
            if generation(now).saturating_sub(born) >= FROZEN_AGE {
                add(&mut stats.old_frees, count);
                add(&mut stats.old_freed_bytes, bytes);
            } else {
                let slot = generations::slot(born);
                if let (Some(slot_bytes), Some(slot_count)) =
                    (stats.generation_bytes.get_mut(slot), stats.generation_allocations.get_mut(slot))
                {
                    // Wrapping sums: adding the two's complement subtracts.
                    add(slot_bytes, bytes.wrapping_neg());
                    add(slot_count, count.wrapping_neg());
                }
            }
        }
        None => count_drop(DropReason::StatsMapFull),
    }
    if let Some(heap) = heap {
        // Wrapping sums: adding the two's complement subtracts.
        add(&mut heap.in_use, bytes.wrapping_neg());
        if freed_by != UNSEEN {
            count_in(&mut heap.lifetimes, now.saturating_sub(alloc.time_ns), count);
        }
    }
    if freed_by == UNSEEN {
        return;
    }
    if alloc.tid != freed_by {
        let key = ThreadPairKey { tgid, alloc_tid: alloc.tid, free_tid: freed_by, image };
        match get_or_insert(&THREAD_PAIRS, &key, &EMPTY_PAIR) {
            Some(pair) => {
                let pair = unsafe { &mut *pair };
                add(&mut pair.frees, count);
                add(&mut pair.freed_bytes, bytes);
            }
            None => count_drop(DropReason::ThreadPairTableFull),
        }
    }
}
