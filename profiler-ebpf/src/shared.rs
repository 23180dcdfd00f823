//! What every program uses: the map flag for hash maps, kernel reads, the atomic updates and the
//! drop counters.

use core::intrinsics::{atomic_cxchg, atomic_xadd, AtomicOrdering};

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

/// What a map's insert with `BPF_NOEXIST` returns when the key is there already (negated).
pub const EEXIST: i32 = 17;

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
    // core's atomic types are not built for the BPF target; the intrinsic compiles to BPF's
    // atomic add. SAFETY: the counter is an aligned u64 inside a map value.
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(counter, value) };
}

/// Adds `value` and returns the sum this add made, exact even when other CPUs add at the same
/// moment. BPF's fetch-add needs an object built for BPF v3 (a different code for every
/// program), so it is a compare-and-swap, tried again while other CPUs change the counter
/// between the read and the swap. After `TRIES` such changes it adds and reads back: a sum the
/// counter held a moment later.
pub fn add_and_read(counter: &mut u64, value: u64) -> u64 {
    // SAFETY: an aligned u64 inside a map value; read once, as another CPU may change it.
    let mut held = unsafe { core::ptr::read_volatile(counter) };
    for _ in 0..TRIES {
        let (seen, swapped) = swap_if(counter, held, held.wrapping_add(value));
        if swapped {
            return held.wrapping_add(value);
        }
        held = seen;
    }
    add(counter, value);
    // SAFETY: as above.
    unsafe { core::ptr::read_volatile(counter) }
}

/// How often a compare-and-swap is tried before giving up: each failure is another CPU's change
/// landing between the read and the swap.
const TRIES: usize = 4;

/// Stores `new` if the word holds `expected`; returns what it held and whether it stored.
fn swap_if(word: &mut u64, expected: u64, new: u64) -> (u64, bool) {
    // SAFETY: an aligned u64 inside a map value; the intrinsic compiles to BPF's atomic
    // compare-and-exchange.
    unsafe { atomic_cxchg::<u64, { AtomicOrdering::Relaxed }, { AtomicOrdering::Relaxed }>(word, expected, new) }
}

/// Raises `high` to `value` unless it already holds as much; true when this call raised it.
/// A plain compare and store lets two CPUs at a new high leave the lower of their values. It
/// gives up after `TRIES` raises by other CPUs in between, which takes five CPUs at a new high at
/// the same moment.
pub fn raise(high: &mut u64, value: u64) -> bool {
    // SAFETY: an aligned u64 inside a map value; read once, as another CPU may raise it.
    let mut held = unsafe { core::ptr::read_volatile(high) };
    for _ in 0..TRIES {
        if value <= held {
            return false;
        }
        let (seen, swapped) = swap_if(high, held, value);
        if swapped {
            return true;
        }
        held = seen;
    }
    false
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
