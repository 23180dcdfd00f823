//! What every program uses: the map flag for hash maps, kernel reads, the atomic add and the drop
//! counters.

use core::intrinsics::{atomic_xadd, AtomicOrdering};

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_kernel},
    macros::map,
    maps::{HashMap, PerCpuArray},
};
use profiler_common::{DropReason, ProcDrops};

/// Hash maps allocate entries as they fill instead of all at load: at the default capacities a
/// preallocated `LIVE` alone would pin most of an idle memprof's kernel memory
/// (docs: performance.md#measurements-behind-design-choices).
pub const NO_PREALLOC: u32 = aya_ebpf::bindings::BPF_F_NO_PREALLOC;

/// Every event memprof could not record, by process (tgid) and reason: read by the daemon, shown
/// in the process's reports. Twice `TRACED`'s capacity: a process's entry stays until the daemon
/// purges it after its exit.
#[map]
static PROC_DROPS: HashMap<u32, ProcDrops> = HashMap::with_max_entries(8_192, NO_PREALLOC);

/// Drops `PROC_DROPS` had no room for, by reason: shown apart in every report.
#[map]
static DROPS: PerCpuArray<u64> = PerCpuArray::with_max_entries(DropReason::COUNT as u32, 0);

/// A zeroed entry to insert from.
static NO_DROPS: ProcDrops = ProcDrops { counts: [0; DropReason::COUNT] };

/// The kernel word at `base + offset`; 0 when unreadable.
#[inline(always)]
pub fn kernel_word(base: u64, offset: u32) -> u64 {
    // SAFETY: a read through the helper, which faults safely.
    unsafe { bpf_probe_read_kernel((base + offset as u64) as *const u64) }.unwrap_or(0)
}

pub fn add(counter: &mut u64, value: u64) {
    // The BPF target has no compare-and-swap, so core's atomics lack fetch_add; the intrinsic
    // compiles to BPF's atomic add. SAFETY: the counter is an aligned u64 inside a map value.
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(counter, value) };
}

/// A process that exec'd counts its new program's drops from zero (see `record::new_image`).
pub fn forget_drops(tgid: u32) {
    let _ = PROC_DROPS.remove(tgid);
}

/// Counts a drop in the current process's counters. Drops are rare, so the hash lookup here
/// costs the common path nothing.
pub fn count_drop(reason: DropReason) {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    let entry = PROC_DROPS.get_ptr_mut(tgid).or_else(|| {
        // Inserted from the static, not a copy on the stack the stack walk needs.
        let empty: &'static ProcDrops = &NO_DROPS;
        // Another CPU may insert it first; BPF_NOEXIST then fails and the lookup finds theirs.
        let _ = PROC_DROPS.insert(tgid, empty, BPF_NOEXIST as u64);
        PROC_DROPS.get_ptr_mut(tgid)
    });
    // SAFETY: a map value pointer stays valid while the program runs.
    let counter = match entry {
        Some(drops) => unsafe { (*drops).counts.get_mut(reason as usize) }.map(|c| c as *mut u64),
        // Per-CPU, but uprobe programs run with only migration disabled: two tasks on one CPU
        // can interleave, so the add must be atomic too.
        None => DROPS.get_ptr_mut(reason as u32),
    };
    if let Some(counter) = counter {
        add(unsafe { &mut *counter }, 1);
    }
}
