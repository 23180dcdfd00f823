//! The maps and what each probe does to them.

use core::ptr::read_volatile;

use aya_ebpf::{
    bindings::{pt_regs, BPF_NOEXIST},
    helpers::{
        bpf_get_current_pid_tgid, bpf_get_current_task, bpf_get_prandom_u32, bpf_ktime_get_ns, bpf_probe_read_user,
    },
    macros::map,
    maps::{Array, HashMap, RingBuf},
    programs::{ProbeContext, RetProbeContext},
    Global,
};
use profiler_common::{
    generations::{self, FROZEN_AGE},
    rate_slot, stack_table, AddrKey, AllocFn, DoubleFreeEvent, DropReason, FreeNote, FreeSite, FreedAlloc, Inflight,
    LiveAlloc, Log2Histogram, ProcCounters, ProcHeap, RecentFree, SampleRate, StackKey, StackStats, ThreadPairKey,
    ThreadPairStats, FREE_IN_C_LIBRARY, FREE_WRAPPER, LOG2_BUCKETS, NO_STACK, RATE_SLOTS, SAMPLED, USDT,
};

use crate::{
    live,
    shared::{add, count_drop, kernel_word, NO_PREALLOC},
    unwind::{self, Regs},
};

/// Capacities here are defaults; the daemon sets the real ones at load time.
///
/// A thread's entry stays while the thread lives, idle (`depth` 0) between calls: rewriting it in
/// place costs far less than an insert per call and a delete per return. `on_thread_exit` removes it.
#[map]
static INFLIGHT: HashMap<u32, Inflight> = HashMap::with_max_entries(16_384, NO_PREALLOC);
#[map]
static STACK_STATS: HashMap<StackKey, StackStats> = HashMap::with_max_entries(65_536, NO_PREALLOC);
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
fn forget_free(key: &AddrKey) {
    if let Some(slot) = recent_free(key).filter(|slot| slot.key == *key) {
        slot.key.addr = 0;
    }
}
#[map]
static PROC_COUNTERS: HashMap<u32, ProcCounters> = HashMap::with_max_entries(4_096, NO_PREALLOC);
/// Per process: bytes in use and their peak, sizes and lifetimes. One map, so that an allocation
/// and a free each take one per-process lookup for all of them.
#[map]
static PROC_HEAP: HashMap<u32, ProcHeap> = HashMap::with_max_entries(4_096, NO_PREALLOC);
/// Processes traced by sampling: tgid → mean bytes between samples (`--sample-bytes`). Their
/// frees of unrecorded blocks are expected, and their double frees are not looked for. Read
/// through `SAMPLE_RATES`, which holds most of them.
#[map]
static SAMPLING: HashMap<u32, u64> = HashMap::with_max_entries(4_096, NO_PREALLOC);
/// The rates again, by slot (see `SampleRate`), kept by the daemon beside `SAMPLING`.
#[map]
static SAMPLE_RATES: Array<SampleRate> = Array::with_max_entries(RATE_SLOTS, 0);

/// The weight (bytes it stands for) of each live block the allocator's own sampler reported
/// (`usdt`): a free takes off what its allocation added. As large as `LIVE` (set by the loader).
#[map]
static USDT_WEIGHTS: HashMap<AddrKey, u64> = HashMap::with_max_entries(1_048_576, NO_PREALLOC);

/// Process `tgid`'s mean bytes between samples; 0 when it records every call.
#[inline(always)]
fn sample_bytes(tgid: u32) -> u64 {
    let Some(slot) = SAMPLE_RATES.get(rate_slot(tgid)) else {
        return 0;
    };
    slot.of(tgid).unwrap_or_else(|| unsafe { SAMPLING.get(tgid) }.copied().unwrap_or(0))
}

/// Only frees by another thread than the allocating one: same-thread frees are the rest.
#[map]
static THREAD_PAIRS: HashMap<ThreadPairKey, ThreadPairStats> = HashMap::with_max_entries(16_384, NO_PREALLOC);
#[map]
static DOUBLE_FREES: RingBuf = RingBuf::with_byte_size(1024 * 1024, 0);

/// The generation clock (see `profiler_common::generations`), set by the loader: its start, and
/// the length of a generation (the reporting interval).
#[unsafe(no_mangle)]
static CLOCK_BASE_NS: Global<u64> = Global::new(0);
#[unsafe(no_mangle)]
static GENERATION_NS: Global<u64> = Global::new(5_000_000_000);

fn generation(time_ns: u64) -> u64 {
    generations::generation(time_ns, CLOCK_BASE_NS.load(), GENERATION_NS.load())
}

const EEXIST: i32 = 17;

fn ids() -> (u32, u32) {
    let pid_tgid = bpf_get_current_pid_tgid();
    ((pid_tgid >> 32) as u32, pid_tgid as u32)
}

/// Zeroed values to insert from: read-only globals, since a 512-byte histogram does not fit on
/// the 512-byte BPF stack.
static EMPTY_STATS: StackStats = StackStats::EMPTY;
static EMPTY_COUNTERS: ProcCounters =
    ProcCounters { unknown_frees: 0, internal_frees: 0, failed_allocations: 0, usdt_samples: 0 };
static EMPTY_HEAP: ProcHeap = ProcHeap::EMPTY;
static EMPTY_PAIR: ThreadPairStats = ThreadPairStats { frees: 0, freed_bytes: 0 };
/// A thread's entry between calls.
static IDLE: Inflight = Inflight {
    func: 0,
    depth: 0,
    size: 0,
    ptr_arg: 0,
    tgid: 0,
    stashed: 0,
    stash: LiveAlloc { size: 0, time_ns: 0, stack_id: NO_STACK, tid: 0, func: 0 },
    entry_sp: 0,
    sample_bytes: 0,
    recorded: 0,
    _pad: 0,
    free_note: FreeNote::EMPTY,
    last_alloc: 0,
};

/// Returns the value for `key`, inserting `empty` first when it is missing.
fn get_or_insert<K, V>(map: &HashMap<K, V>, key: &K, empty: &'static V) -> Option<*mut V> {
    if let Some(value) = map.get_ptr_mut(key) {
        return Some(value);
    }
    // Another CPU may insert the same key first; BPF_NOEXIST then fails and the lookup finds theirs.
    let _ = map.insert(key, empty, BPF_NOEXIST as u64);
    map.get_ptr_mut(key)
}

fn bump_proc_counter(tgid: u32, field: fn(&mut ProcCounters) -> &mut u64) {
    match get_or_insert(&PROC_COUNTERS, &tgid, &EMPTY_COUNTERS) {
        Some(counters) => add(field(unsafe { &mut *counters }), 1),
        None => count_drop(DropReason::ProcessTableFull),
    }
}

/// The registers of the probe that fired, for a stack walk.
#[derive(Clone, Copy)]
pub struct Probe {
    regs: *const pt_regs,
    /// At a return probe: the walk starts at the return address.
    at_return: bool,
    /// At a USDT probe site, whose frame is the first (see `Regs::at_site`).
    at_site: bool,
}

impl Probe {
    /// Inlined: as a function of its own, its frame would add to the chain of frames a free's
    /// walk stacks up, which 6.1 bounds at 512 bytes.
    #[inline(always)]
    fn stack_id(self, which: u32, tgid: u32) -> u64 {
        // SAFETY: `regs` is the context of the probe that is running.
        let regs = unsafe {
            if self.at_site {
                Regs::at_site(self.regs)
            } else {
                Regs::of(self.regs, self.at_return)
            }
        };
        unwind::stack_id(which, tgid, regs)
    }

    /// Where the probed call returns to: at a return probe, the instruction pointer (the kernel
    /// has put the real return address back); at an entry, the word at the stack pointer, as
    /// the daemon places entry probes before anything is pushed. 0 when unreadable.
    fn caller(self) -> u64 {
        // SAFETY: `regs` is the context of the probe that is running; the user read faults safely.
        unsafe {
            let regs = &*self.regs;
            if self.at_return {
                regs.rip
            } else {
                bpf_probe_read_user(regs.rsp as *const u64).unwrap_or(0)
            }
        }
    }

    /// Whether the C library's own code called the free whose entry probe has `cookie`.
    fn called_by_c_library(self, cookie: u64) -> bool {
        // SAFETY: `regs` is the context of the probe that is running: at an entry, its address.
        let here = unsafe { (*self.regs).rip };
        !self.at_return && profiler_common::called_by_c_library(cookie, here, self.caller())
    }
}

/// Set by the loader (`--full-free-stacks`): every free's stack is walked, so that a double
/// free's report shows its first free's whole stack. Else a free keeps only its caller (one
/// read), and only the second free of a double free is walked: the walk at every free would
/// serve only the rare double free.
#[unsafe(no_mangle)]
static FULL_FREE_STACKS: Global<u32> = Global::new(0);

/// How far below an allocator call's entry a call nested in it can run. glibc's allocator frames
/// are small; a thread's stack starts megabytes away from any other's.
const NESTING_STACK_SPAN: u64 = 64 * 1024;

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
fn nested_in(state: &Inflight, tgid: u32, sp: u64) -> bool {
    state.depth != 0
        && state.tgid == tgid
        && (sp == 0
            || state.entry_sp == 0
            || (sp <= state.entry_sp && state.entry_sp - sp < NESTING_STACK_SPAN && frame_live(state.entry_sp)))
}

/// The address of the probe that fired, at an entry probe: the kernel sets the instruction
/// pointer back to the breakpoint before it runs the programs. `bpf_get_func_ip` says the same
/// but returns 0 in uprobes before Linux 6.6.
#[inline(always)]
pub fn probe_address(ctx: &ProbeContext) -> u64 {
    // SAFETY: the context is the running probe's.
    unsafe { (*ctx.regs).rip }
}

fn stack_pointer(ctx: &ProbeContext) -> u64 {
    #[cfg(bpf_target_arch = "x86_64")]
    {
        unsafe { (*ctx.regs).rsp }
    }
    #[cfg(not(bpf_target_arch = "x86_64"))]
    {
        let _ = ctx;
        0
    }
}

/// Returns whether the call's return must be seen (it has in-flight state to settle).
/// `skippable`: the return probe fires only if this returns true (a uprobe session).
pub fn on_entry(ctx: &ProbeContext, func: AllocFn, size: u64, ptr_arg: u64, skippable: bool) -> bool {
    let (tgid, tid) = ids();
    let sample_bytes = sample_bytes(tgid);
    // Full mode records every call without a draw. SAFETY: a helper without arguments.
    let recorded = sample_bytes == 0 || profiler_common::sampled(sample_bytes, size, unsafe { bpf_get_prandom_u32() });
    let resizes = ptr_arg != 0 && func.resizes();
    if !recorded && !resizes && skippable {
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
    if !recorded && old.is_none() {
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
    let probe = Probe { regs: ctx.regs, at_return: true, at_site: false };
    let ret: u64 = ctx.ret();
    let Some(state) = INFLIGHT.get_ptr_mut(tid).filter(|state| unsafe { (**state).depth } != 0) else {
        if sample_bytes(tgid) != 0 {
            // A call the entry probe did not sample.
            return;
        }
        count_drop(DropReason::InflightMissing);
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
    let probe = Probe { regs: ctx.regs, at_return: false, at_site: false };
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

/// An allocation recorded: `func`, its `AllocFn` with its marks (`SAMPLED`, `USDT`), stands for
/// what `rate` says (see `profiler_common::weight`). Returns whether it is in `LIVE`.
#[inline(always)]
fn on_allocated(probe: Probe, tgid: u32, tid: u32, addr: u64, size: u64, func: u32, rate: u64) -> bool {
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
    match stack_stats(tgid, image_of(heap.as_deref()), alloc.stack_id) {
        Some(stats) => {
            keep_bytes_at_peak(stats, heap.as_deref());
            add(&mut stats.allocations, count);
            add(&mut stats.allocated_bytes, bytes);
            // Read back after the add: another thread's update in between only makes it a
            // value the stack held a moment earlier or later.
            let outstanding = stats.allocated_bytes.wrapping_sub(stats.freed_bytes);
            if outstanding > stats.max_outstanding_bytes && (outstanding as i64) > 0 {
                stats.max_outstanding_bytes = outstanding;
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
        add(&mut heap.in_use, bytes);
        let in_use = heap.in_use;
        if in_use > heap.peak && (in_use as i64) > 0 {
            heap.peak = in_use;
            heap.peak_ns = alloc.time_ns;
            add(&mut heap.peak_generation, 1);
        }
        count_in(&mut heap.sizes, size, count);
    }
    true
}

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
            count_free(&key, &old, UNSEEN, unsafe { bpf_ktime_get_ns() }, false);
        }
    }
    // The weight first: the block's free takes off what its weight says.
    if USDT_WEIGHTS.insert(key, weight, 0).is_err() {
        count_drop(DropReason::LiveMapFull);
        return;
    }
    let probe = Probe { regs: ctx.regs, at_return: false, at_site: true };
    if !on_allocated(probe, tgid, tid, addr, size, AllocFn::Malloc as u32 | SAMPLED | USDT, weight) {
        let _ = USDT_WEIGHTS.remove(key);
    }
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
        retire(Probe { regs: ctx.regs, at_return: false, at_site: true }, key, &alloc, false);
        let _ = USDT_WEIGHTS.remove(key);
    }
}

/// What one recorded allocation stands for (see `profiler_common::weight`): 0 when every call is
/// recorded. Sampling is never turned off for a process, so its rate is still the one the block had.
#[inline(always)]
fn rate_of(key: &AddrKey, alloc: &LiveAlloc) -> u64 {
    if alloc.func & USDT != 0 {
        unsafe { USDT_WEIGHTS.get(key) }.copied().unwrap_or(0)
    } else if alloc.func & SAMPLED != 0 {
        sample_bytes(key.tgid)
    } else {
        0
    }
}

/// The process's `PROC_HEAP` entry, inserted empty at its first call.
fn proc_heap(tgid: u32) -> Option<&'static mut ProcHeap> {
    match get_or_insert(&PROC_HEAP, &tgid, &EMPTY_HEAP) {
        // SAFETY: a map value pointer stays valid while the program runs; updates are atomic adds
        // but for the peak's fields, which a race can only leave a moment off.
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
    let image = unsafe { PROC_HEAP.get(tgid) }.map_or(0, |heap| heap.image as u32).wrapping_add(1);
    let _ = PROC_COUNTERS.remove(tgid);
    crate::shared::forget_drops(tgid);
    // Inserted from the static, not a copy on the stack.
    let empty: &'static ProcHeap = &EMPTY_HEAP;
    if PROC_HEAP.insert(tgid, empty, 0).is_ok() {
        if let Some(heap) = PROC_HEAP.get_ptr_mut(tgid) {
            // SAFETY: a map value pointer stays valid while the program runs.
            unsafe { (*heap).image = image as u64 };
        }
    }
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
const UNSEEN: u32 = 0;

/// Counts the end of allocation `alloc` of `key` in its stack's totals and age generation (and
/// as `temporary` there); in its process's bytes in use; when the free was seen (by thread
/// `freed_by`), in the process's lifetimes, and its thread pair when another thread freed it.
fn count_free(key: &AddrKey, alloc: &LiveAlloc, freed_by: u32, now: u64, temporary: bool) {
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
fn retire(probe: Probe, key: AddrKey, alloc: &LiveAlloc, temporary: bool) {
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
fn unseen_free(probe: Probe, tgid: u32, addr: u64, cookie: u64) {
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
