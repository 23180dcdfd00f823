//! `LIVE`, the outstanding allocations, and the filter that answers most lookups of blocks that
//! are not in it (see `profiler_common::LIVE_FILTER_SLOTS`). Every change to `LIVE` goes through
//! here, so that each filter slot counts at least the entries whose keys fall in it: one that is
//! too high (an entry overwritten) costs a lookup, never a wrong answer. The daemon takes off
//! what it removes itself. While the daemon inspects a process, the addresses of its changes are
//! noted too (`LIVE_CHANGES`).

use aya_ebpf::{
    bindings::{BPF_F_MMAPABLE, BPF_NOEXIST},
    macros::map,
    maps::{Array, HashMap},
};
use profiler_common::{live_filter_slot, AddrKey, LiveAlloc, LiveWatch, LIVE_FILTER_SLOTS};

use crate::shared::{add, EEXIST, NO_PREALLOC};

/// A plain hash, not an LRU: an LRU would evict the oldest allocations, which are the leaks.
/// The capacity is a default; the daemon sets the real one at load time.
#[map]
static LIVE: HashMap<AddrKey, LiveAlloc> = HashMap::with_max_entries(1_048_576, NO_PREALLOC);
/// Mappable: the daemon's decrements must be atomic against the programs' adds.
#[map]
static LIVE_FILTER: Array<u64> = Array::with_max_entries(LIVE_FILTER_SLOTS, BPF_F_MMAPABLE);

/// The process being inspected, set by the daemon (see `LiveWatch`).
#[map]
static LIVE_WATCH: Array<LiveWatch> = Array::with_max_entries(1, 0);
/// The addresses of the watched process's blocks that changed since the daemon last emptied it:
/// a set, as a busy allocator hands the same addresses out again and again. Its capacity is a
/// default, as `LIVE`'s.
#[map]
static LIVE_CHANGES: HashMap<u64, u8> = HashMap::with_max_entries(1024, NO_PREALLOC);

/// Notes that `key`'s entry changed, if its process is watched. After the change: a daemon that
/// starts watching after this read lists the table after the change (see `kernel::live_watch`).
#[inline(always)]
fn note_change(key: &AddrKey) {
    let Some(watch) = LIVE_WATCH.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: a map value pointer stays valid while the program runs.
    let watch = unsafe { &mut *watch };
    if watch.tgid != key.tgid {
        return;
    }
    // By reference: the key where it is, the value a constant; copies would take stack, which
    // 6.1 bounds for the whole chain of calls.
    #[allow(clippy::needless_borrows_for_generic_args)]
    let noted = LIVE_CHANGES.insert(&key.addr, &1, BPF_NOEXIST as u64);
    match noted {
        Ok(()) => {}
        Err(err) if err == -EEXIST => {}
        Err(_) => watch.overflowed = 1,
    }
}

/// Adds `change` (wrapping: `u64::MAX` takes one off) to the slot of `key`.
fn count(key: &AddrKey, change: u64) {
    if let Some(slot) = LIVE_FILTER.get_ptr_mut(live_filter_slot(key)) {
        // SAFETY: a map value pointer stays valid while the program runs.
        add(unsafe { &mut *slot }, change);
    }
}

/// The block at `key`, if it is live.
#[inline(always)]
pub fn get(key: &AddrKey) -> Option<LiveAlloc> {
    let maybe = LIVE_FILTER.get(live_filter_slot(key)).is_none_or(|count| *count != 0);
    if !maybe {
        return None;
    }
    // SAFETY: copied at once.
    unsafe { LIVE.get(key) }.copied()
}

/// Inserts (`flags` as the map's update) and counts the entry.
pub fn insert(key: &AddrKey, alloc: &LiveAlloc, flags: u64) -> Result<(), i32> {
    // Counted first: a lookup on another CPU between the two must not find the slot at 0.
    count(key, 1);
    let inserted = LIVE.insert(key, alloc, flags);
    match inserted {
        Ok(()) => note_change(key),
        Err(_) => count(key, u64::MAX),
    }
    inserted
}

/// Names stack `stack_id` in the entry of `key`. Called before the allocating call returns the
/// block to its caller, so no free of it races the store.
pub fn name_stack(key: &AddrKey, stack_id: u64) {
    if let Some(alloc) = LIVE.get_ptr_mut(key) {
        // SAFETY: a map value pointer stays valid while the program runs; an aligned store.
        unsafe { (*alloc).stack_id = stack_id };
    }
}

/// Removes the entry; Ok when this call removed it (two threads freeing one block race here).
pub fn remove(key: &AddrKey) -> Result<(), i32> {
    let removed = LIVE.remove(key);
    if removed.is_ok() {
        count(key, u64::MAX);
        note_change(key);
    }
    removed
}
