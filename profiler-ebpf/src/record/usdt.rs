//! The blocks an allocator's own sampler reports through its `otel_memory` probes (the
//! programs are `crate::usdt`'s), each standing for the bytes its weight says.

use aya_ebpf::{helpers::bpf_ktime_get_ns, macros::map, maps::HashMap, programs::ProbeContext};
use profiler_common::{AddrKey, AllocFn, DropReason, LiveAlloc, SAMPLED, USDT};

use super::{
    add_to_proc_counter, bump_proc_counter,
    frees::retire,
    ids, sample_bytes,
    totals::{count_free, on_allocated, UNSEEN},
    Probe, Site,
};
use crate::{
    live,
    shared::{count_drop, NO_PREALLOC},
};

/// The weight (bytes it stands for) of each live block the allocator's own sampler reported
/// (`usdt`): a free takes off what its allocation added. As large as `LIVE` (set by the loader).
#[map]
static USDT_WEIGHTS: HashMap<AddrKey, u64> = HashMap::with_max_entries(1_048_576, NO_PREALLOC);

/// An allocation the allocator's own sampler reported (`otel_memory:alloc`), standing for
/// `weight` bytes.
pub fn on_usdt_alloc(ctx: &ProbeContext, addr: u64, size: u64, weight: u64) {
    if addr == 0 {
        return;
    }
    let (tgid, tid) = ids();
    bump_proc_counter(tgid, |c| &mut c.usdt_samples);
    let key = AddrKey { tgid, _pad: 0, addr };
    // Still live: its free went unreported. Retired here, while its own weight is kept.
    if let Some(old) = live::get(&key) {
        count_drop(DropReason::MissedFree);
        if live::remove(&key).is_ok() {
            count_estimate(&key, &old);
            count_free(&key, &old, UNSEEN, unsafe { bpf_ktime_get_ns() }, false);
        }
    }
    // The weight first: the block's free takes off what its weight says.
    if USDT_WEIGHTS.insert(key, weight, 0).is_err() {
        count_drop(DropReason::LiveMapFull);
        return;
    }
    let probe = Probe { regs: ctx.regs, site: Site::Usdt };
    if on_allocated(probe, tgid, tid, addr, size, AllocFn::Malloc as u32 | SAMPLED | USDT, weight) {
        add_to_proc_counter(tgid, |c| &mut c.usdt_counts, profiler_common::weight(weight, size).0);
    } else {
        let _ = USDT_WEIGHTS.remove(key);
    }
}

/// Counts what a sampled block's end takes off its stack's counts (see `usdt_counts`), before
/// its weight goes.
fn count_estimate(key: &AddrKey, alloc: &LiveAlloc) {
    let (count, _) = profiler_common::weight(rate_of(key, alloc), alloc.size);
    add_to_proc_counter(key.tgid, |c| &mut c.usdt_counts, count);
}

/// A block the allocator's sampler reported freed (`otel_memory:free`). One it did not report
/// allocated since attach is an unknown free.
pub fn on_usdt_free(ctx: &ProbeContext, addr: u64) {
    if addr == 0 {
        return;
    }
    let tgid = ids().0;
    let key = AddrKey { tgid, _pad: 0, addr };
    let Some(alloc) = live::get(&key) else {
        bump_proc_counter(tgid, |c| &mut c.unknown_frees);
        return;
    };
    // Two threads freeing the same block race here: only the one that removes it counts it.
    if live::remove(&key).is_ok() {
        count_estimate(&key, &alloc);
        retire(Probe { regs: ctx.regs, site: Site::Usdt }, key, &alloc, false);
        let _ = USDT_WEIGHTS.remove(key);
    }
}

/// What one recorded allocation stands for (see `profiler_common::weight`): 0 when every call is
/// recorded. Sampling is never turned off for a process, so its rate is still the one the block had.
#[inline(always)]
pub(super) fn rate_of(key: &AddrKey, alloc: &LiveAlloc) -> u64 {
    if alloc.func & USDT != 0 {
        unsafe { USDT_WEIGHTS.get(key) }.copied().unwrap_or(0)
    } else if alloc.func & SAMPLED != 0 {
        sample_bytes(key.tgid)
    } else {
        0
    }
}
