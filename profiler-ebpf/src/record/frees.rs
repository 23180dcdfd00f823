//! A free: the block's end counted, and the free remembered a while in `RECENT_FREES`, where a
//! second free of the same address is recognised as a double free.

use aya_ebpf::{
    helpers::{bpf_ktime_get_ns, bpf_probe_read_user},
    macros::map,
    maps::{Array, RingBuf},
    programs::ProbeContext,
    Global,
};
use profiler_common::{
    stack_table, AddrKey, DoubleFreeEvent, DropReason, FreeNote, FreeSite, FreedAlloc, Inflight, LiveAlloc, RecentFree,
    FREE_IN_C_LIBRARY, FREE_WRAPPER, NO_STACK, SAMPLED,
};

use super::{
    bump_proc_counter, calls::nested_in, get_or_insert, ids, probe_address, sample_bytes, stack_pointer,
    totals::count_free, Probe, Site, IDLE, INFLIGHT, NESTING_STACK_SPAN,
};
use crate::{live, shared::count_drop};

/// Recent frees, one per slot of an address's hash: a newer free in the same slot forgets an
/// older one, which only forgets an old double-free candidate. An array, not an LRU hash: a slot
/// is a few inlined instructions, where an LRU insert per free and a delete per allocation cost
/// more than the rest of those probes' map work.
#[map]
static RECENT_FREES: Array<RecentFree> = Array::with_max_entries(RECENT_FREE_SLOTS, 0);
const RECENT_FREE_SLOTS: u32 = 16_384;

/// The slot that remembers a free of `key`.
fn recent_free(key: &AddrKey) -> Option<&'static mut RecentFree> {
    let mixed = (key.addr ^ (key.tgid as u64) << 48).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let slot = (mixed >> 40) as u32 % RECENT_FREE_SLOTS;
    // SAFETY: a map value pointer stays valid while the program runs.
    RECENT_FREES.get_ptr_mut(slot).map(|slot| unsafe { &mut *slot })
}

/// Forgets a remembered free of `key`: its address is in use again.
pub(super) fn forget_free(key: &AddrKey) {
    if let Some(slot) = recent_free(key).filter(|slot| slot.key == *key) {
        slot.key.addr = 0;
    }
}

#[map]
static DOUBLE_FREES: RingBuf = RingBuf::with_byte_size(1024 * 1024, 0);

/// Set by the loader (`--full-free-stacks`): every free's stack is walked, so that a double
/// free's report shows its first free's whole stack. Else a free keeps only its caller (one
/// read), and only the second free of a double free is walked: the walk at every free would
/// serve only the rare double free.
#[unsafe(no_mangle)]
static FULL_FREE_STACKS: Global<u32> = Global::new(0);

/// A free of `addr`, its probe's `cookie` saying whether the function may call another probed
/// free (`FREE_WRAPPER`, see `FreeNote`) or is the C library's (`FREE_IN_C_LIBRARY`).
pub fn on_free(ctx: &ProbeContext, addr: u64, cookie: u64) {
    let wrapper = cookie & FREE_WRAPPER != 0;
    if addr == 0 {
        return;
    }
    let (tgid, tid) = ids();
    let key = AddrKey { tgid, _pad: 0, addr };
    let live = live::get(&key);
    // A sampled process frees blocks that were not sampled all the time: nothing to do (checked
    // first, as it is most of a sampled process's frees).
    if live.is_none() && sample_bytes(tgid) != 0 {
        return;
    }
    let sp = stack_pointer(ctx);
    let state = INFLIGHT.get_ptr_mut(tid);
    if state.is_some_and(|state| nested_in(unsafe { &*state }, tgid, sp)) {
        // Called from inside realloc (or another allocator call): the outer call's return handles it.
        return;
    }
    if live.is_none() && state.is_some_and(|state| inside_wrapper(unsafe { &(*state).free_note }, ctx, addr, sp)) {
        // The inner free of a wrapper's block: the wrapper's free counted it.
        return;
    }
    if wrapper {
        note_wrapper(state, ctx, tgid, tid, addr, sp);
    }
    let probe = Probe { regs: ctx.regs, site: Site::Entry };
    // Freed by its own thread as the very next call after its allocation: no other allocation or
    // free in between (heaptrack's temporary allocation). Any free ends the run.
    let last_alloc = match state {
        // SAFETY: a pointer to this thread's own `INFLIGHT` entry, which only this thread writes.
        Some(state) => unsafe { core::mem::replace(&mut (*state).last_alloc, 0) },
        None => 0,
    };
    match live {
        // Two threads freeing the same block race here: only the one that removes it counts it.
        Some(alloc) => {
            let temporary = alloc.tid == tid && last_alloc == addr;
            if live::remove(&key).is_ok() {
                retire(probe, key, &alloc, temporary);
            }
        }
        None => unseen_free(probe, tgid, addr, cookie),
    }
}

/// Whether this free of `addr` runs inside the wrapper free `note` recorded (see `FreeNote`).
fn inside_wrapper(note: &FreeNote, ctx: &ProbeContext, addr: u64, sp: u64) -> bool {
    if note.addr != addr || sp > note.sp || note.sp - sp >= NESTING_STACK_SPAN {
        return false;
    }
    // SAFETY: a helper reading user memory, which faults safely.
    let slot = unsafe { bpf_probe_read_user(note.sp as *const u64) }.unwrap_or(0);
    probe_address(ctx) != note.ip && slot == note.ret
}

/// Records a wrapper free in its thread's entry (inserted idle for a thread that has none).
#[inline(always)]
fn note_wrapper(state: Option<*mut Inflight>, ctx: &ProbeContext, tgid: u32, tid: u32, addr: u64, sp: u64) {
    let Some(state) = state.or_else(|| get_or_insert(&INFLIGHT, &tid, &IDLE)) else {
        count_drop(DropReason::InflightMapFull);
        return;
    };
    // SAFETY: this thread's own entry; helpers reading the probe's context and user memory.
    let state = unsafe { &mut *state };
    state.tgid = tgid;
    state.free_note = FreeNote {
        addr,
        sp,
        ret: unsafe { bpf_probe_read_user(sp as *const u64) }.unwrap_or(0),
        ip: probe_address(ctx),
    };
}

/// A free by thread `tid` at `time_ns`, with its stack when `walk`, else its caller.
#[inline(always)]
fn free_site(probe: Probe, tgid: u32, tid: u32, time_ns: u64, walk: bool) -> FreeSite {
    if !walk {
        return FreeSite { time_ns, stack_id: NO_STACK, caller: probe.caller(), tid, _pad: 0 };
    }
    // Free stacks only serve double-free reports: a map of their own keeps them from crowding
    // out allocation stacks.
    let stack_id = probe.stack_id(stack_table::FREES, tgid);
    FreeSite { time_ns, stack_id, caller: 0, tid, _pad: 0 }
}

/// Counts the free of a block that was live (`temporary`: see `Inflight::last_alloc`), and
/// remembers it to recognise a second free.
pub(super) fn retire(probe: Probe, key: AddrKey, alloc: &LiveAlloc, temporary: bool) {
    let (tid, now) = (ids().1, unsafe { bpf_ktime_get_ns() });
    count_free(&key, alloc, tid, now, temporary);
    if alloc.func & SAMPLED != 0 {
        // Double frees are looked for in full mode only: with most blocks unrecorded, a reused
        // address would pass for freed twice.
        return;
    }
    let free = free_site(probe, key.tgid, tid, now, FULL_FREE_STACKS.load() != 0);
    if let Some(slot) = recent_free(&key) {
        // Two frees in one slot at once may mix their fields; a double free of either address
        // would then show the other's stacks, which is all that can go wrong.
        *slot = RecentFree { key, freed: FreedAlloc { alloc: *alloc, free } };
    }
}

/// A free of an address not live: a double free if it was freed since it was last allocated.
/// `cookie`: the free probe's (0 at a return probe), which says whether the C library's own
/// code called it (see `FREE_IN_C_LIBRARY`).
pub(super) fn unseen_free(probe: Probe, tgid: u32, addr: u64, cookie: u64) {
    let key = AddrKey { tgid, _pad: 0, addr };
    let Some(slot) = recent_free(&key).filter(|slot| slot.key == key) else {
        if cookie & FREE_IN_C_LIBRARY != 0 && probe.called_by_c_library(cookie) {
            // A block the C library allocated inside itself, never through malloc.
            bump_proc_counter(tgid, |c| &mut c.internal_frees);
        } else {
            // Allocated before attach (or its allocation was dropped): expected, not an error.
            bump_proc_counter(tgid, |c| &mut c.unknown_frees);
        }
        return;
    };
    // Also seen when the allocator itself frees what sits in its caches (glibc's
    // tcache_thread_shutdown at thread exit): the daemon tells those apart by the caller.
    // The walk runs before the ring's record is reserved: a reservation held across it keeps the
    // verifier from pruning the walk's states. The event is written in the record, not on the
    // BPF stack, which the walk needs.
    let second = free_site(probe, tgid, ids().1, unsafe { bpf_ktime_get_ns() }, true);
    let Some(mut entry) = DOUBLE_FREES.reserve::<DoubleFreeEvent>(0) else {
        count_drop(DropReason::DoubleFreeEventLost);
        return;
    };
    let event = entry.as_mut_ptr();
    // SAFETY: the reserved record is ours until submitted.
    unsafe {
        ((*event).tgid, (*event)._pad, (*event).addr) = (tgid, 0, addr);
        (*event).first = slot.freed;
        (*event).second = second;
    }
    entry.submit(0);
}
