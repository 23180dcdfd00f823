//! An allocator call's entry and return: the call kept per thread in `INFLIGHT` from one to
//! the other, calls nested in it told apart, and what the call did decided at its return.

use core::ptr::read_volatile;

use aya_ebpf::{
    helpers::{bpf_get_current_task, bpf_get_prandom_u32, bpf_probe_read_user},
    programs::{ProbeContext, RetProbeContext},
    Global,
};
use profiler_common::{traced, AddrKey, AllocFn, DropReason, Inflight, SAMPLED};

use super::{
    bump_proc_counter,
    frees::{forget_free, retire, unseen_free},
    get_or_insert, ids, sample_bytes, stack_pointer,
    totals::on_allocated,
    Probe, Site, IDLE, INFLIGHT, NESTING_STACK_SPAN,
};
use crate::{
    live, process,
    shared::{count_drop, kernel_word},
};

/// Offsets, read by the daemon from the kernel's BTF, on the way from the current task to its
/// process's uretprobe trampoline: `task->mm->uprobes_state.xol_area->vaddr`.
#[unsafe(no_mangle)]
static TASK_MM_OFFSET: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static MM_XOL_AREA_OFFSET: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static XOL_AREA_VADDR_OFFSET: Global<u32> = Global::new(0);

/// The current process's `mm_struct`; 0 when unreadable.
#[inline(always)]
pub fn current_mm() -> u64 {
    // SAFETY: a helper without arguments.
    let task = unsafe { bpf_get_current_task() };
    kernel_word(task, TASK_MM_OFFSET.load())
}

/// Where this process's probed calls return first: once a call's entry programs have run, the
/// kernel replaces its return address with this trampoline's. 0 when unknown.
#[inline(always)]
pub fn return_trampoline() -> u64 {
    let mm = current_mm();
    let area = if mm == 0 { 0 } else { kernel_word(mm, MM_XOL_AREA_OFFSET.load()) };
    if area == 0 {
        return 0;
    }
    kernel_word(area, XOL_AREA_VADDR_OFFSET.load())
}

/// Whether the frame of the in-flight call that entered at `entry_sp` is still on the stack: its
/// return address slot still holds the trampoline. A call that a signal handler longjmp'd out of
/// left its frame to later calls, and any call since at the same depth or deeper has written its
/// own return address there, or its callers have. Taken as live when the trampoline is unknown:
/// the stack test alone decides then.
#[inline(always)]
fn frame_live(entry_sp: u64) -> bool {
    let trampoline = return_trampoline();
    if trampoline == 0 {
        return true;
    }
    // SAFETY: a read of user memory through the helper, which faults safely.
    let slot = unsafe { bpf_probe_read_user(entry_sp as *const u64) }.unwrap_or(0);
    slot == trampoline
}

/// Whether a call at stack pointer `sp` of this thread runs inside the in-flight call `state`:
/// at or below its entry (`<=`: glibc tail-calls, as realloc(NULL, n) and memalign jump to
/// malloc, and a jump keeps the frame), not far below, and with that call's frame still live. An
/// entry whose return will never come (a thread that died inside the allocator, its id since
/// reused; a call a signal handler longjmp'd out of) fails the test and is treated as stale.
///
/// Any call may have others nested in it: glibc's malloc calls none, but the malloc of mimalloc
/// calls `mi_malloc`, a custom Rust global allocator may call `malloc`, `operator new` of
/// tcmalloc and mimalloc call their own allocation functions.
pub(super) fn nested_in(state: &Inflight, tgid: u32, sp: u64) -> bool {
    state.depth != 0
        && state.tgid == tgid
        && (sp == 0
            || state.entry_sp == 0
            || (sp <= state.entry_sp && state.entry_sp - sp < NESTING_STACK_SPAN && frame_live(state.entry_sp)))
}

/// Returns whether the call's return must be seen (it has in-flight state to settle).
/// `skippable`: the return probe fires only if this returns true (a uprobe session).
pub fn on_entry(ctx: &ProbeContext, func: AllocFn, size: u64, ptr_arg: u64, skippable: bool) -> bool {
    let (tgid, tid) = ids();
    let sample_bytes = sample_bytes(tgid);
    // Full mode records every call without a draw. SAFETY: a helper without arguments.
    let recorded = sample_bytes == 0 || profiler_common::sampled(sample_bytes, size, unsafe { bpf_get_prandom_u32() });
    let resizes = ptr_arg != 0 && func.resizes();
    let nests = func.may_call_malloc(ptr_arg);
    if !recorded && !resizes && !nests && skippable {
        // Not drawn, and its return will not fire: nothing to keep, not even the depth of a
        // call it is nested in, whose return comes after this one's would have.
        return false;
    }
    let sp = stack_pointer(ctx);
    let entry = INFLIGHT.get_ptr_mut(tid);
    if let Some(state) = entry {
        let stale = unsafe { *state };
        if nested_in(&stale, tgid, sp) {
            // Nested inside another allocator call of this thread: only the outermost one counts.
            unsafe { (*state).depth += 1 };
            return true;
        }
        if stale.depth != 0 {
            // Stale: its return will never come. Give back the block a stale realloc had taken.
            count_drop(DropReason::InflightMissing);
            if stale.stashed != 0 {
                let _ = live::insert(&AddrKey { tgid: stale.tgid, _pad: 0, addr: stale.ptr_arg }, &stale.stash, 0);
            }
            // Idle now, so that a call not drawn below does not find it again.
            unsafe { (*state).depth = 0 };
        }
    }
    let key = AddrKey { tgid, _pad: 0, addr: ptr_arg };
    // realloc frees its old block inside the call: a recorded one is settled at the return.
    let old = if resizes { live::get(&key) } else { None };
    if !recorded && old.is_none() && !nests {
        // Not sampled: nothing to do at its return (which then finds no state; see on_return).
        return false;
    }
    // The thread's first call inserts its entry idle; it is then filled like any other.
    let Some(idle) = entry.or_else(|| get_or_insert(&INFLIGHT, &tid, &IDLE)) else {
        count_drop(DropReason::InflightMapFull);
        return false;
    };
    // SAFETY: this thread's own entry; only this thread writes it while the thread lives.
    let state = unsafe { &mut *idle };
    // Field by field, not the whole struct: the stash is written only when there is one (copying
    // an empty one takes a byte-wise memset).
    (state.func, state.size, state.ptr_arg, state.tgid) = (func as u32, size, ptr_arg, tgid);
    (state.entry_sp, state.sample_bytes, state.recorded) = (sp, sample_bytes, u32::from(recorded));
    state.stashed = 0;
    if let Some(old) = old {
        // Taken out of LIVE now, the old block cannot be confused with a block another thread
        // gets at the same address before realloc returns.
        state.stash = old;
        state.stashed = u32::from(live::remove(&key).is_ok());
    }
    state.depth = 1;
    true
}

/// A call that its allocator's fast path completes, at the branch that sends it to its return
/// (see `profiler_common::completion`): what its entry and its return would have done, at once.
/// `returned` is the block it returns.
///
/// Inlined, as `on_return`: the session program's frame then serves both, where a frame of its
/// own would put the walk's chain of frames past the 512 bytes the verifier allows.
#[inline(always)]
pub fn on_completion(ctx: &ProbeContext, func: AllocFn, size: u64, returned: u64) {
    let (tgid, tid) = ids();
    let sample_bytes = sample_bytes(tgid);
    // SAFETY: a helper without arguments.
    if sample_bytes != 0 && !profiler_common::sampled(sample_bytes, size, unsafe { bpf_get_prandom_u32() }) {
        return;
    }
    let entry = INFLIGHT.get_ptr_mut(tid);
    // SAFETY: this thread's own entry; only this thread writes it while the thread lives.
    if entry.is_some_and(|state| nested_in(unsafe { &*state }, tgid, stack_pointer(ctx))) {
        // Inside another allocator call of this thread: only the outermost one counts.
        return;
    }
    if returned == 0 {
        if size != 0 {
            bump_proc_counter(tgid, |c| &mut c.failed_allocations);
        }
        return;
    }
    let probe = Probe { regs: ctx.regs, site: Site::Completion };
    let marks = if sample_bytes != 0 { SAMPLED } else { 0 };
    on_allocated(probe, tgid, tid, returned, size, func as u32 | marks, sample_bytes);
    // Kept for the next free of this thread, which may make it a temporary allocation.
    if let Some(state) = entry.or_else(|| get_or_insert(&INFLIGHT, &tid, &IDLE)) {
        // SAFETY: as above.
        unsafe { (*state).last_alloc = returned };
    }
}

/// Whether thread `tid` of process `tgid` is inside a probed allocator call (in full mode every
/// call is; in sampled mode only those drawn).
pub fn in_allocator_call(tgid: u32, tid: u32) -> bool {
    unsafe { INFLIGHT.get(tid) }.is_some_and(|state| state.depth != 0 && state.tgid == tgid)
}

/// The current thread is exiting: its entry goes (nothing else would remove it: a new thread
/// does not get its id for a long time). A call still in flight died with it (a thread cancelled
/// or killed inside the allocator) and its return will never come: counted, and the block a
/// realloc had taken out of `LIVE` given back.
pub fn on_thread_exit() {
    let (_, tid) = ids();
    let Some(state) = (unsafe { INFLIGHT.get(tid) }).copied() else {
        return;
    };
    if state.depth != 0 {
        count_drop(DropReason::InflightMissing);
        if state.stashed != 0 {
            let _ = live::insert(&AddrKey { tgid: state.tgid, _pad: 0, addr: state.ptr_arg }, &state.stash, 0);
        }
    }
    let _ = INFLIGHT.remove(tid);
}

#[inline(always)]
pub fn on_return(ctx: &RetProbeContext) {
    let (tgid, tid) = ids();
    let probe = Probe { regs: ctx.regs, site: Site::Return };
    let ret: u64 = ctx.ret();
    let Some(state) = INFLIGHT.get_ptr_mut(tid).filter(|state| unsafe { (**state).depth } != 0) else {
        if sample_bytes(tgid) != 0 {
            // A call the entry probe did not sample.
            return;
        }
        // Entered before its entry probe was attached, it began before tracing did: its block
        // is one allocated before, not a drop.
        if process::traced_flags(tgid).is_none_or(|flags| flags & traced::ATTACHING == 0) {
            count_drop(DropReason::InflightMissing);
        }
        // The call may have returned a block that was freed earlier: it is not freed any more.
        if ret != 0 {
            forget_free(&AddrKey { tgid, _pad: 0, addr: ret });
        }
        return;
    };
    // SAFETY: this thread's own entry, which only this thread writes while it lives. Not copied
    // whole: a copy takes more of the BPF stack than the walk below leaves. Each field branched
    // on is read once (volatile: not read again from the map), so the verifier sees one value.
    let call = unsafe { &mut *state };
    if call.depth > 1 {
        call.depth -= 1;
        return;
    }
    call.depth = 0;
    // Before the reads below: with them, the index may be spilled before its bounds check, which
    // 6.1's verifier does not carry over to the spilled copy.
    let Some(func) = AllocFn::from_u32(call.func) else {
        return;
    };
    // SAFETY: reads of fields of this thread's entry, as above.
    let (size, ptr_arg, stashed, recorded) = unsafe {
        (
            read_volatile(&call.size),
            read_volatile(&call.ptr_arg),
            read_volatile(&call.stashed),
            read_volatile(&call.recorded),
        )
    };
    let returned = match func {
        // posix_memalign returns an error code and stores the pointer through its out-pointer.
        AllocFn::PosixMemalign if ret as i32 != 0 => {
            bump_proc_counter(tgid, |c| &mut c.failed_allocations);
            return;
        }
        AllocFn::PosixMemalign => unsafe { bpf_probe_read_user(ptr_arg as *const u64) }.unwrap_or(0),
        // xallocx returns the block's real size: below the size asked, it did not resize, which
        // is no failure (the caller then moves the block itself). The block stays as it was.
        AllocFn::ResizeInPlace if ret < size => {
            if stashed != 0 {
                let _ = live::insert(&AddrKey { tgid, _pad: 0, addr: ptr_arg }, &call.stash, 0);
            }
            return;
        }
        AllocFn::ResizeInPlace => ptr_arg,
        _ => ret,
    };
    let resizes = func.resizes() && ptr_arg != 0;
    // A realloc that succeeded, moved or in place, freed the old block; so did glibc's
    // realloc(p, 0), which returns NULL. A failed one left the old block live.
    if resizes && (returned != 0 || size == 0) {
        if stashed != 0 {
            let temporary = call.last_alloc == ptr_arg && call.stash.tid == tid;
            retire(probe, AddrKey { tgid, _pad: 0, addr: ptr_arg }, &call.stash, temporary);
        } else if call.sample_bytes == 0 {
            // A sampled process resizes unrecorded blocks all the time: not an unknown free.
            unseen_free(probe, tgid, ptr_arg, 0);
        }
    } else if stashed != 0 {
        let _ = live::insert(&AddrKey { tgid, _pad: 0, addr: ptr_arg }, &call.stash, 0);
    }
    if returned != 0 && recorded != 0 {
        let marks = if call.sample_bytes != 0 { SAMPLED } else { 0 };
        on_allocated(probe, tgid, tid, returned, size, func as u32 | marks, call.sample_bytes);
        call.last_alloc = returned;
    } else if returned == 0 && size != 0 && func != AllocFn::PosixMemalign {
        // (A resize of a recorded block whose new block was not drawn returned one: no failure.)
        // malloc(0) and realloc(p, 0) may legitimately return NULL; posix_memalign's failures
        // were counted by their return code.
        bump_proc_counter(tgid, |c| &mut c.failed_allocations);
    }
}
