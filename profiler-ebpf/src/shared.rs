//! What every program uses: the map flag for hash maps, the atomic add and the drop counters.

use core::intrinsics::{atomic_xadd, AtomicOrdering};

use aya_ebpf::{macros::map, maps::PerCpuArray};
use profiler_common::DropReason;

/// Hash maps allocate entries as they fill instead of all at load: at the default capacities a
/// preallocated `LIVE` alone would pin about 100 MiB of kernel memory for an idle process.
pub const NO_PREALLOC: u32 = aya_ebpf::bindings::BPF_F_NO_PREALLOC;

/// Every event memprof could not record, by reason: read by the daemon, shown in every report.
#[map]
static DROPS: PerCpuArray<u64> = PerCpuArray::with_max_entries(DropReason::COUNT as u32, 0);

pub fn add(counter: &mut u64, value: u64) {
    // The BPF target has no compare-and-swap, so core's atomics lack fetch_add; the intrinsic
    // compiles to BPF's atomic add. SAFETY: the counter is an aligned u64 inside a map value.
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(counter, value) };
}

pub fn count_drop(reason: DropReason) {
    if let Some(counter) = DROPS.get_ptr_mut(reason as u32) {
        // Per-CPU, but uprobe programs run with only migration disabled: two tasks on one CPU
        // can interleave, so the add must be atomic.
        add(unsafe { &mut *counter }, 1);
    }
}
