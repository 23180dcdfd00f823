//! The user stack walk: DWARF CFI rows (built by the daemon from each file's `.eh_frame`) or frame
//! pointers, frame by frame, into memprof's own stack tables.
//!
//! For each frame the walk takes the row covering the address from a per-CPU cache (`ROW_CACHE`)
//! or, on a miss, finds the process's executable mapping of the address (binary search in
//! `PROC_MAPPINGS`) and the row in that file's slice of the rows in `UNWIND_SHARDS` (binary
//! search); it then
//! computes the canonical frame address (CFA) and reads the return address at CFA - 8.
//! Files are shared: every process that maps a file points at the same rows.
//!
//! Stacks are stored under a 64-bit hash of their frames. A second hash kept in the value tells a
//! real collision from a repeat, so a stack is never merged with another one or thrown away
//! silently.

use aya_ebpf::{
    bindings::{pt_regs, BPF_F_MMAPABLE, BPF_NOEXIST, BPF_RB_AVAIL_DATA},
    btf_maps::{Array as BtfArray, ArrayOfMaps},
    cty::c_void,
    helpers::{
        bpf_get_current_pid_tgid, bpf_get_current_task, bpf_ktime_get_ns, bpf_loop, bpf_probe_read_kernel,
        bpf_probe_read_user, bpf_probe_read_user_str_bytes,
    },
    macros::{btf_map, map},
    maps::{Array, HashMap, PerCpuArray, RingBuf},
    Global,
};
use profiler_common::{
    cfa, mapping_kind, rbp, stack_hash_step, stack_id_of, stack_table, DeferredUnwind, DropReason, ExecMapping,
    LinkMapEvent, ProcMappings, Stack, StackEnd, UnwindRow, DEFERRED_PAGES, LINK_MAP_OBJECTS, MAX_FRAMES, MAX_MAPPINGS,
    NO_STACK, PAGE_BYTES, STACK_HASH_SEED, UC_RBP, UC_RIP, UC_RSP, UNWIND_SHARD_BITS, UNWIND_SHARD_ROWS,
};

use crate::{
    memo::{self, Reads, Start},
    shared::{add, count_drop, kernel_word, NO_PREALLOC},
};

/// Capacities here are defaults; the daemon sets the real ones at load time.
#[map]
pub static STACKS: HashMap<u64, Stack> = HashMap::with_max_entries(65_536, NO_PREALLOC);
#[map]
pub static FREE_STACKS: HashMap<u64, Stack> = HashMap::with_max_entries(16_384, NO_PREALLOC);
/// Rows of every file's unwind table, each file a sorted slice of one index space cut in shards
/// (see `UNWIND_SHARD_ROWS`) that the daemon creates as tables need them, so that an idle memprof
/// holds no rows and a busy one is bounded only by `--max-unwind-rows`. Arrays of one size, outer
/// and inner: the verifier inlines both lookups. The daemon sets the shard count at load time.
#[btf_map]
static UNWIND_SHARDS: ArrayOfMaps<
    BtfArray<UnwindRow, { UNWIND_SHARD_ROWS as usize }, { BPF_F_MMAPABLE as usize }>,
    256,
> = ArrayOfMaps::new();
#[map]
static PROC_MAPPINGS: HashMap<u32, ProcMappings> = HashMap::with_max_entries(4_096, NO_PREALLOC);
/// Per traced process, how many times it may have mapped code since it was traced: its execs,
/// its dynamic linker's changes (`on_mappings_changed`) and, while memprof traces mappings, its
/// mappings of files' code. A walk stopped outside the process's mapping list waits for
/// a newer list (`defer`) only while the list is older than the latest change (see
/// `ProcMappings::code_changes_seen`); else the frame is in no file (code built at run time, or a
/// frame pointer that pointed nowhere) and the walk ends there, cut, without a copy of the stack.
#[map]
static CODE_CHANGES: HashMap<u32, u64> = HashMap::with_max_entries(4_096, NO_PREALLOC);

/// Process `tgid` exec'd or mapped a file's code: its mapping list may lack it.
pub fn code_changed(tgid: u32) {
    // Inserted at 0 first, so that an insert by the daemon meanwhile (at 0) loses no change.
    let _ = CODE_CHANGES.insert(tgid, 0, BPF_NOEXIST as u64);
    // Without an entry (the map is full), no list of the process is taken as current.
    if let Some(changes) = CODE_CHANGES.get_ptr_mut(tgid) {
        // SAFETY: a map value pointer stays valid while the program runs.
        add(unsafe { &mut *changes }, 1);
    }
}

/// Whether the mapping list of process `tgid` whose `code_changes_seen` is `seen` holds every
/// file it maps: no change since the daemon read the mappings the list was built from. Asked of
/// the list the walk searched, not of the one in the map now: the daemon may have written a
/// newer one, with the file the walk missed, since.
fn list_was_current(tgid: u32, seen: u64) -> bool {
    // SAFETY: a field read at once from a map value.
    seen != NO_LIST && unsafe { CODE_CHANGES.get(tgid) }.is_some_and(|&changes| changes == seen)
}

/// `Walk::list_seen` before the walk has searched a list, or when the process has none.
const NO_LIST: u64 = u64::MAX;

/// Bumped by the daemon after every write to `PROC_MAPPINGS`: the rows cached by address (which
/// an address's row may change with) are valid for one generation. One for all processes, in an
/// array (an inlined lookup): a walk needs it before anything else, and mappings rarely change.
#[map]
static MAPPINGS_GENERATION: Array<u32> = Array::with_max_entries(1, 0);

/// For the daemon to read new files' tables: processes whose mappings changed (their tgids, 4
/// bytes), and walks that stopped at a file with no table yet (`DeferredUnwind`). One ring, so
/// that a deferred walk comes after the mapping change that explains it. 16 MiB: room for
/// hundreds of deferred walks (32 KiB copies) at once, each stored once (see `defer`). LLVM's
/// first JIT set-up under postgres makes that many while its large table is built
/// (docs: performance.md#measurements-behind-design-choices).
#[map]
static UNWIND_EVENTS: RingBuf = RingBuf::with_byte_size(UNWIND_EVENTS_BYTES as u32, 0);
const UNWIND_EVENTS_BYTES: u64 = 16 * 1024 * 1024;

/// At the dynamic linker's `_dl_debug_state`. `r_debug` is the address of its `_r_debug` (0:
/// unknown): when the change is complete, the linker's list of objects goes to the daemon with
/// the event, so that it knows the process's mappings even if the process is gone before it
/// reads `/proc`; else just the process's id.
pub fn on_mappings_changed(r_debug: u64) {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    // Before a library's mapping and after it, both before its code runs.
    code_changed(tgid);
    if r_debug != 0 && send_link_map(tgid, r_debug) {
        return;
    }
    if UNWIND_EVENTS.output::<u32>(&tgid, 0).is_err() {
        // The daemon finds new mappings at its next refresh anyway.
        count_drop(DropReason::MappingEventLost);
    }
}

/// `struct r_debug`: `r_map` at 8, `r_state` at 24; `struct link_map`: `l_addr` at 0, `l_name`
/// at 8, `l_next` at 24.
const R_MAP: u64 = 8;
const R_STATE: u64 = 24;
const L_NAME: u64 = 8;
const L_NEXT: u64 = 24;
/// `r_state` when the list is consistent (not in the middle of an add or a delete).
const RT_CONSISTENT: i32 = 0;

/// Sends the linker's list of objects; false when it is not consistent now or cannot be read.
fn send_link_map(tgid: u32, r_debug: u64) -> bool {
    let state = unsafe { bpf_probe_read_user((r_debug + R_STATE) as *const i32) };
    if state != Ok(RT_CONSISTENT) {
        return false;
    }
    let Ok(mut object) = (unsafe { bpf_probe_read_user((r_debug + R_MAP) as *const u64) }) else { return false };
    let Some(mut entry) = UNWIND_EVENTS.reserve::<LinkMapEvent>(0) else {
        count_drop(DropReason::MappingEventLost);
        return true;
    };
    let event = entry.as_mut_ptr();
    // SAFETY: the reserved record is ours until submitted.
    unsafe {
        (*event).tgid = tgid;
        (*event).count = 0;
        (*event).time_ns = bpf_ktime_get_ns();
        for index in 0..LINK_MAP_OBJECTS {
            if object == 0 {
                break;
            }
            let slot = &mut (*event).objects[index];
            slot.base = bpf_probe_read_user(object as *const u64).unwrap_or(0);
            slot.name[0] = 0;
            if let Ok(name) = bpf_probe_read_user((object + L_NAME) as *const u64) {
                let _ = bpf_probe_read_user_str_bytes(name as *const u8, &mut slot.name);
            }
            (*event).count = index as u32 + 1;
            object = bpf_probe_read_user((object + L_NEXT) as *const u64).unwrap_or(0);
        }
    }
    entry.submit(0);
    true
}

/// Where a walk builds its stack: 1 KiB does not fit on the 512-byte BPF stack.
#[repr(C)]
struct Scratch {
    /// Bumped by every walk on this CPU. Uprobe programs run with migration disabled but may be
    /// preempted: a walk that finds the count changed under it knows another task on this CPU
    /// reused the scratch, and keeps no stack rather than a mixed one.
    uses: u64,
    /// In the map value, not on the BPF stack: the verifier tracks no values in map memory, so
    /// the loop's state looks the same at every frame and `step` is verified only once or twice.
    walk: Walk,
    window: Window,
    stack: Stack,
}

/// Bytes of the user stack copied at once. A walk reads two words per frame, all close together:
/// each `bpf_probe_read_user` costs far more than the bytes it copies, so one copy serves several
/// frames (on the tight loop, a whole walk). 2 KiB: cheaper than 1 KiB on perl's deep stacks and
/// the same on the loop; 4 KiB made the loop's walks dearer
/// (docs: performance.md#measurements-behind-design-choices).
pub const WINDOW_WORDS: usize = 256;

/// A copy of the user stack from `start`, `len` bytes (0: none yet).
#[repr(C)]
struct Window {
    start: u64,
    len: u64,
    words: [u64; WINDOW_WORDS],
    /// What the walk read, for its memo.
    reads: Reads,
}

#[map]
static SCRATCH: PerCpuArray<Scratch> = PerCpuArray::with_max_entries(1, 0);

/// Frames kept per stack (`--max-frames`), at most `MAX_FRAMES`.
#[unsafe(no_mangle)]
static FRAME_LIMIT: Global<u32> = Global::new(MAX_FRAMES as u32);

/// Binary search steps: enough for 2^9 = 512 > MAX_MAPPINGS mappings and 2^24 rows per file.
const MAPPING_STEPS: usize = 9;
const ROW_STEPS: usize = 24;

/// The registers a walk starts from.
pub struct Regs {
    pub pc: u64,
    pub sp: u64,
    pub bp: u64,
    /// Whether `pc` is a return address (at a return probe), whose call is the byte before it;
    /// else it is the exact instruction (at an entry probe, a page fault, or after a signal frame).
    pub pc_is_return: bool,
    /// Whether frame 0 is the probed function itself (an allocator's entry), which stacks leave
    /// out: their first frame is its caller. A page fault's frame 0 is the code that touched the
    /// page, which they keep.
    pub first_is_probed: bool,
    /// Where a walk from inside probed calls (a system call the allocator made) finds their
    /// return addresses; none for the allocator's own probes, whose walks start outside the
    /// calls they probe.
    pub taken: TakenReturns,
    /// Whether a walk cut short counts in its process's drops: the heap's stacks do; a
    /// mapping's stack is only marked truncated in its report (see `mapping`).
    pub counts_cuts: bool,
}

/// The return addresses the kernel's uretprobes took from a thread's stack: each call's slot
/// holds the return trampoline's address instead, and the kernel keeps the real one in a list,
/// innermost first (`struct return_instance`).
#[derive(Clone, Copy)]
pub struct TakenReturns {
    /// The process's return trampoline (0: none to look for).
    pub trampoline: u64,
    /// The thread's innermost `return_instance`.
    pub innermost: u64,
}

impl TakenReturns {
    pub const NONE: TakenReturns = TakenReturns { trampoline: 0, innermost: 0 };

    /// The current thread's, given its process's return trampoline.
    pub fn current(trampoline: u64) -> TakenReturns {
        // SAFETY: a helper without arguments.
        let task = unsafe { bpf_get_current_task() };
        let utask = kernel_word(task, TASK_UTASK_OFFSET.load());
        let innermost = if utask == 0 { 0 } else { kernel_word(utask, UTASK_RETURNS_OFFSET.load()) };
        TakenReturns { trampoline, innermost }
    }
}

/// Offsets, read by the daemon from the kernel's BTF: `task->utask->return_instances`, and a
/// `return_instance`'s `orig_ret_vaddr`, `chained`, `next` and `stack` (the slot's address).
#[unsafe(no_mangle)]
static TASK_UTASK_OFFSET: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static UTASK_RETURNS_OFFSET: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static RETURN_ADDRESS_OFFSET: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static RETURN_CHAINED_OFFSET: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static RETURN_NEXT_OFFSET: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static RETURN_STACK_OFFSET: Global<u32> = Global::new(0);

/// Instances looked at: a walk meets as many as probed calls are in flight in its thread
/// (nested allocator calls), and a probed function tail-called by another probed function adds
/// a `chained` instance that shares its caller's slot.
const TAKEN_MAX: usize = 4;

/// The real return address of the next slot holding the trampoline, walking outward; moves past
/// the instances that share it. 0 when the list has no more (the walk then ends).
fn taken_return(walk: &mut Walk) -> u64 {
    let address = kernel_word(walk.taken, RETURN_ADDRESS_OFFSET.load());
    for _ in 0..TAKEN_MAX {
        let instance = walk.taken;
        if instance == 0 {
            break;
        }
        // SAFETY: a read through the helper, which faults safely; `chained` is a bool.
        let chained = unsafe { bpf_probe_read_kernel((instance + RETURN_CHAINED_OFFSET.load() as u64) as *const u8) };
        walk.taken = kernel_word(instance, RETURN_NEXT_OFFSET.load());
        if chained.unwrap_or(0) == 0 {
            break;
        }
    }
    address
}

impl Regs {
    /// # Safety
    /// `regs` must be the probe's context registers.
    pub unsafe fn of(regs: *const pt_regs, pc_is_return: bool) -> Regs {
        let regs = &*regs;
        Regs {
            pc: regs.rip,
            sp: regs.rsp,
            bp: regs.rbp,
            pc_is_return,
            first_is_probed: !pc_is_return,
            taken: TakenReturns::NONE,
            counts_cuts: true,
        }
    }

    /// At a USDT probe site, whose frame is the stack's first (at an allocator's entry, frame 0 is
    /// the allocator and is left out): walked as if a call returned just after the site's one-byte
    /// `nop`, so that the frame is kept and its row is the one at the site.
    ///
    /// # Safety
    /// `regs` must be the probe's context registers.
    pub unsafe fn at_site(regs: *const pt_regs) -> Regs {
        let regs = &*regs;
        let pc = regs.rip + 1;
        Regs {
            pc,
            sp: regs.rsp,
            bp: regs.rbp,
            pc_is_return: true,
            first_is_probed: false,
            taken: TakenReturns::NONE,
            counts_cuts: true,
        }
    }
}

/// Walks the stack and returns its id in the `stack_table` `which`, or `NO_STACK` (counted) when
/// it cannot be kept.
#[inline(always)]
pub fn stack_id(which: u32, tgid: u32, regs: Regs) -> u64 {
    let Some(scratch) = SCRATCH.get_ptr_mut(0) else {
        return NO_STACK;
    };
    let scratch = unsafe { &mut *scratch };
    scratch.uses = scratch.uses.wrapping_add(1);
    let ours = scratch.uses;
    // Field by field: a whole `Walk` would copy `mapping`'s 40 zero bytes with a byte-wise memset.
    let walk = &mut scratch.walk;
    (walk.pc, walk.sp, walk.bp) = (regs.pc, regs.sp, regs.bp);
    (walk.hash, walk.check) = (STACK_HASH_SEED, 0xc2b2_ae3d_27d4_eb4f);
    (walk.len, walk.end) = (0, StackEnd::TooDeep as u32);
    walk.pc_is_return = u32::from(regs.pc_is_return);
    walk.first_is_probed = u32::from(regs.first_is_probed);
    (walk.trampoline, walk.taken) = (regs.taken.trampoline, regs.taken.innermost);
    // rbp is known at the start; a frame that clobbers it without saving it loses it.
    (walk.bp_known, walk.bp_from_regs, walk.uses_bp, walk.bp_saved_at) = (1, 1, 0, 0);
    (walk.start.pc, walk.start.sp, walk.start.bp) = (regs.pc, regs.sp, regs.bp);
    walk.start.tgid = tgid;
    walk.start.generation = MAPPINGS_GENERATION.get(0).copied().unwrap_or(0);
    // Only the heap's walks from a return address outside any probed call: their stacks repeat,
    // and nothing but the registers and the stack's words decides them (see `memo`).
    walk.memoize = u32::from(
        which == stack_table::ALLOCATIONS && regs.pc_is_return && regs.taken.trampoline == 0 && regs.counts_cuts,
    );
    // No mapping yet: an empty range.
    walk.mapping.end = 0;
    walk.list_seen = NO_LIST;
    scratch.window.len = 0;
    scratch.window.reads.clear();
    walk.ours = ours;
    // Nothing kept across the calls but their arguments: on 6.1 a larger frame here, with
    // `walk_and_store`'s and its loop's under a free's, exceeds the 512 bytes a program's calls
    // may use together.
    let id = recall_walk();
    if id != NO_STACK {
        return id;
    }
    remember_walk(walk_and_store(which, u32::from(regs.counts_cuts), ours))
}

/// `memo::recall` for the walk `stack_id` set up; `NO_STACK` when it is not remembered. A global
/// function, as the next: verified once, apart from its callers.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn recall_walk() -> u64 {
    let Some(scratch) = SCRATCH.get_ptr_mut(0) else {
        return NO_STACK;
    };
    // SAFETY: this CPU's scratch; see `Scratch::uses` for another task using it meanwhile.
    let scratch = unsafe { &mut *scratch };
    if scratch.walk.memoize == 0 {
        return NO_STACK;
    }
    let id = memo::recall(&scratch.walk.start, &mut scratch.window.words);
    if scratch.uses == scratch.walk.ours {
        id
    } else {
        NO_STACK
    }
}

/// `memo::remember` for the walk that stored `id`, if it ended whole and no other task's walk
/// mixed with it. Returns `id`.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn remember_walk(id: u64) -> u64 {
    let Some(scratch) = SCRATCH.get_ptr_mut(0) else {
        return id;
    };
    // SAFETY: as in `recall_walk`.
    let scratch = unsafe { &mut *scratch };
    let walk = &scratch.walk;
    if walk.memoize != 0 && id != NO_STACK && walk.end == StackEnd::Complete as u32 && scratch.uses == walk.ours {
        memo::remember(&walk.start, walk.uses_bp, &scratch.window.reads, id);
    }
    id
}

/// `stack_id`'s walk of the registers it left in `SCRATCH`, and the stack's storing. A global
/// function (not mangled, never inlined, scalar arguments only): kernels before 6.3 verify it once
/// per program, apart from its callers, where a static function is verified again on every path
/// that reaches each of its call sites.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn walk_and_store(which: u32, counts_cuts: u32, ours: u64) -> u64 {
    let table = if which == stack_table::FREES { &FREE_STACKS } else { &STACKS };
    let counts_cuts = counts_cuts != 0;
    let Some(scratch) = SCRATCH.get_ptr_mut(0) else {
        return NO_STACK;
    };
    let scratch = unsafe { &mut *scratch };
    // One frame per iteration: the verifier checks `step` once, not once per frame.
    // SAFETY: `step` has the callback signature bpf_loop expects.
    // One more iteration than frames: an entry probe's first one stores none.
    unsafe { bpf_loop(MAX_FRAMES as u32 + 1, step as *mut c_void, core::ptr::null_mut(), 0) };
    let end = StackEnd::from_u32(scratch.walk.end);
    let mut reason = end.drop_reason();
    if end == StackEnd::NoTable && !list_was_current(scratch.walk.start.tgid, scratch.walk.list_seen) {
        if let Some(id) = defer(table, which, scratch, ours, counts_cuts) {
            return id;
        }
        reason = Some(DropReason::DeferredWalkLost);
    }
    let walk = &scratch.walk;
    if let Some(reason) = reason.filter(|_| counts_cuts) {
        count_drop(reason);
    }
    let check = walk.check ^ walk.len as u64;
    let id = stack_id_of(walk.hash, walk.end);
    if let Some(stored) = unsafe { table.get(id) } {
        if stored.check == check && stored.len == walk.len {
            return id;
        }
        count_drop(DropReason::StackCollision);
        return NO_STACK;
    }
    scratch.stack.check = check;
    scratch.stack.len = walk.len;
    scratch.stack.end = walk.end;
    // By reference: a 1 KiB value does not fit on the 512-byte BPF stack.
    let stack: &Stack = &scratch.stack;
    match table.insert(id, stack, BPF_NOEXIST as u64) {
        Ok(()) if scratch.uses != ours => {
            // Preempted mid-walk by a task that walked on this CPU too: what was copied may mix
            // both stacks.
            let _ = table.remove(id);
            count_drop(DropReason::StackPreempted);
            NO_STACK
        }
        Ok(()) => id,
        // Another CPU stored it first; a collision then shows at the next lookup.
        Err(err) if err == -EEXIST => id,
        Err(_) => {
            count_drop(DropReason::StackTableFull);
            NO_STACK
        }
    }
}

const EEXIST: i32 = 17;

/// A walk stopped at a frame with no table: stores the frames so far as a `Deferred` stack and,
/// the first time that stack is stored, sends its state and a copy of the stack to the daemon,
/// which finishes the walk in user space (see `DeferredUnwind`). The id also hashes the stack
/// pointer, so that calls reaching the frame from different depths stay apart, and, at an entry
/// probe that stored no frame yet (a free in a library not read yet) or a mapping's walk that
/// stored only the system call's wrapper (before the process's mappings are read), the return
/// address at the stack pointer, so that two call sites at one depth do too. None when
/// the event cannot be sent (the ring is full): the stack is then kept cut, counted as
/// `deferred_walk_lost`.
///
/// Only walks that would have been cut come here, and only while a newer mapping list may come
/// (`list_was_current`): the cost of every other stays as it was.
fn defer(table: &HashMap<u64, Stack>, which: u32, scratch: &mut Scratch, ours: u64, counts_cuts: bool) -> Option<u64> {
    let walk = &scratch.walk;
    // At a syscall the first frame is the C library's wrapper, the same for every caller.
    let first_frame_only = (walk.len == 0 && walk.first_is_probed != 0) || (!counts_cuts && walk.len <= 1);
    let caller = if first_frame_only { unsafe { bpf_probe_read_user(walk.sp as *const u64) }.unwrap_or(0) } else { 0 };
    let place = walk.sp.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ caller.rotate_left(29);
    let hash = (walk.hash ^ place).rotate_left(7) ^ StackEnd::Deferred as u64;
    let check = walk.check ^ walk.sp ^ caller ^ walk.len as u64;
    let id = if hash == NO_STACK { 1 } else { hash };
    if let Some(stored) = unsafe { table.get(id) } {
        if stored.check == check && stored.len == walk.len {
            return Some(id);
        }
        count_drop(DropReason::StackCollision);
        return Some(NO_STACK);
    }
    // A mapping's walk (`counts_cuts` false) gives way to the heap's: it takes no copy once the
    // ring is a quarter full, and keeps its stack cut instead.
    if !counts_cuts && UNWIND_EVENTS.query(BPF_RB_AVAIL_DATA as u64) > UNWIND_EVENTS_BYTES / 4 {
        return None;
    }
    let mut entry = UNWIND_EVENTS.reserve::<DeferredUnwind>(0)?;
    let event = entry.as_mut_ptr();
    let window_start = walk.sp & !(PAGE_BYTES as u64 - 1);
    // SAFETY: the reserved record is ours until submitted or discarded.
    unsafe {
        (*event).stack_id = id;
        (*event).tgid = walk.start.tgid;
        (*event).table = which;
        ((*event).pc, (*event).sp, (*event).bp) = (walk.pc, walk.sp, walk.bp);
        ((*event).pc_is_return, (*event).bp_known) = (walk.pc_is_return, walk.bp_known);
        (*event).pc_recorded = u32::from(walk.len > 0 || walk.pc_is_return != 0);
        (*event).stored = walk.len;
        (*event).counts_cuts = u32::from(counts_cuts);
        (*event).window_start = window_start;
        (*event).time_ns = bpf_ktime_get_ns();
        (*event).pages = DEFERRED_PAGES as u32;
        for page in 0..DEFERRED_PAGES {
            let copied = aya_ebpf::helpers::generated::bpf_probe_read_user(
                (*event).window.as_mut_ptr().add(page * PAGE_BYTES).cast(),
                PAGE_BYTES as u32,
                (window_start + (page * PAGE_BYTES) as u64) as *const c_void,
            );
            if copied != 0 {
                (*event).pages = page as u32;
                break;
            }
        }
        if walk.trampoline != 0 {
            let copied = (*event).pages as u64 * PAGE_BYTES as u64;
            restore_taken(walk.taken, window_start, copied, (*event).window.as_mut_ptr());
        }
    }
    scratch.stack.check = check;
    scratch.stack.len = scratch.walk.len;
    scratch.stack.end = StackEnd::Deferred as u32;
    let stack: &Stack = &scratch.stack;
    match table.insert(id, stack, BPF_NOEXIST as u64) {
        Ok(()) if scratch.uses != ours => {
            let _ = table.remove(id);
            entry.discard(0);
            count_drop(DropReason::StackPreempted);
            Some(NO_STACK)
        }
        Ok(()) => {
            entry.submit(0);
            Some(id)
        }
        // Another CPU stored it first, and sent its event.
        Err(err) if err == -EEXIST => {
            entry.discard(0);
            Some(id)
        }
        Err(_) => {
            entry.discard(0);
            count_drop(DropReason::StackTableFull);
            Some(NO_STACK)
        }
    }
}

/// Writes back, in a deferred walk's copy of the stack (`copied` bytes from `window_start`), the
/// return addresses uretprobes took from it (see `TakenReturns`), from `instance` outward: user
/// space finishes the walk from the copy, where their slots hold the trampoline.
///
/// # Safety
/// `window` must be the event's copy, `DEFERRED_PAGES * PAGE_BYTES` long.
unsafe fn restore_taken(mut instance: u64, window_start: u64, copied: u64, window: *mut u8) {
    for _ in 0..TAKEN_MAX {
        if instance == 0 {
            break;
        }
        let offset = kernel_word(instance, RETURN_STACK_OFFSET.load()).wrapping_sub(window_start);
        if offset + 8 <= copied && offset <= (DEFERRED_PAGES * PAGE_BYTES - 8) as u64 {
            let slot = window.add(offset as usize).cast::<u64>();
            slot.write_unaligned(kernel_word(instance, RETURN_ADDRESS_OFFSET.load()));
        }
        instance = kernel_word(instance, RETURN_NEXT_OFFSET.load());
    }
}

/// The state of a walk between frames.
#[repr(C)]
struct Walk {
    pc: u64,
    sp: u64,
    bp: u64,
    hash: u64,
    check: u64,
    len: u32,
    /// `StackEnd`: `TooDeep` until the walk ends otherwise.
    end: u32,
    /// Whether `pc` is a return address, whose call is the byte before it; else it is the exact
    /// instruction (at an entry probe, or after a signal frame).
    pc_is_return: u32,
    bp_known: u32,
    /// See `Regs::first_is_probed`.
    first_is_probed: u32,
    /// Whether `bp` still holds the register's value the walk began with, and whether the walk
    /// used that value (see `memo`).
    bp_from_regs: u32,
    uses_bp: u32,
    /// Where `bp` was restored from, while no frame has used it (0: none). Code built without
    /// frame pointers saves whatever it keeps in rbp, a new value at nearly every call: the word
    /// is noted for the memo only once used, so that a memo is not refused for a value the walk
    /// never depended on, nor filled with such words.
    bp_saved_at: u64,
    /// Whether the walk is remembered (see `memo`).
    memoize: u32,
    /// `Scratch::uses` when it began.
    ours: u64,
    /// The process, registers and `MAPPINGS_GENERATION` it began with (cached rows of another
    /// generation are stale).
    start: Start,
    /// See `TakenReturns`: the trampoline (0: none), and the next taken return address's
    /// `return_instance`.
    trampoline: u64,
    taken: u64,
    /// The mapping of the last frame: the next frame is most often in the same file, and then
    /// needs no lookup. Empty (start = end) before the first.
    mapping: ExecMapping,
    /// `code_changes_seen` of the mapping list the walk last searched (`NO_LIST`: none).
    list_seen: u64,
}

impl Walk {
    /// rbp's value, noting that the walk used it: the register's it began with, or the word it
    /// was restored from (see `memo`).
    fn bp(&mut self, reads: &mut Reads) -> u64 {
        self.uses_bp |= self.bp_from_regs;
        if self.bp_saved_at != 0 {
            reads.note(self.bp_saved_at, self.bp);
            self.bp_saved_at = 0;
        }
        self.bp
    }
}

/// Records frame `index` and steps to its caller. Returns 1 to stop the loop, 0 to go on.
extern "C" fn step(index: u64, _context: *mut c_void) -> i64 {
    let Some(scratch) = SCRATCH.get_ptr_mut(0) else { return 1 };
    // SAFETY: this CPU's scratch; see `Scratch::uses` for another task using it meanwhile.
    let scratch = unsafe { &mut *scratch };
    match frame(index as usize, &mut scratch.walk, &mut scratch.window, &mut scratch.stack) {
        Some(()) => 0,
        None => 1,
    }
}

/// One frame; None when the walk ends (with `walk.end` saying why).
fn frame(index: usize, walk: &mut Walk, window: &mut Window, stack: &mut Stack) -> Option<()> {
    let pc = walk.pc;
    let at_entry = index == 0 && walk.first_is_probed != 0;
    // At an entry probe frame 0 is the allocator itself (free): stacks begin at its caller.
    if !at_entry {
        // Past the limit the walk ends as `TooDeep`, as it began.
        if walk.len >= FRAME_LIMIT.load() {
            return None;
        }
        *stack.frames.get_mut(walk.len as usize)? = pc;
        walk.len += 1;
        walk.hash = stack_hash_step(walk.hash, pc);
        walk.check = (walk.check ^ pc).wrapping_mul(0xff51_afd7_ed55_8ccd).rotate_left(31);
    }
    // A return address follows its call: the call, and the row that covers it, is before it.
    let address = pc - walk.pc_is_return as u64;
    let cached = ROW_CACHE.get_ptr_mut(cache_slot(address, walk.start.tgid)).map(|slot| unsafe { &mut *slot });
    let (row, kind) = match cached {
        Some(slot) if slot.holds(address, walk, at_entry) => (slot.row, slot.kind & !AT_ENTRY),
        slot => {
            let (row, kind) = search_row(walk, address, at_entry)?;
            if let Some(slot) = slot {
                slot.fill(address, walk, at_entry, row, kind);
            }
            (row, kind)
        }
    };
    let frame_pointers = kind == mapping_kind::FRAME_POINTERS;
    let sp = walk.sp;
    let cfa = match row.cfa {
        cfa::RSP => sp.wrapping_add(row.cfa_offset as i64 as u64),
        cfa::RBP if walk.bp_known != 0 => walk.bp(&mut window.reads).wrapping_add(row.cfa_offset as i64 as u64),
        cfa::RBP_DEREF if walk.bp_known != 0 => {
            let at = walk.bp(&mut window.reads).wrapping_add(row.cfa_offset as i64 as u64);
            match window.read(at) {
                Some(cfa) => cfa,
                None => return end(walk, StackEnd::ReadFailed),
            }
        }
        cfa::PLT => sp + 8 + if (address & 15) as i32 >= row.cfa_offset { 8 } else { 0 },
        cfa::END => return end(walk, StackEnd::Complete),
        cfa::SIGNAL => {
            // The kernel saved the interrupted registers in the signal frame's ucontext.
            // One read at a time: a tuple of reads leaves the verifier an unwritten register
            // on the path where an early one failed.
            let Some(pc) = window.read(sp + UC_RIP) else { return end(walk, StackEnd::ReadFailed) };
            let Some(bp) = window.read(sp + UC_RBP) else { return end(walk, StackEnd::ReadFailed) };
            let Some(sp) = window.read(sp + UC_RSP) else { return end(walk, StackEnd::ReadFailed) };
            (walk.pc, walk.sp, walk.bp, walk.bp_known, walk.pc_is_return) = (pc, sp, bp, 1, 0);
            (walk.bp_from_regs, walk.bp_saved_at) = (0, 0);
            return Some(());
        }
        cfa::NONE => return end(walk, StackEnd::NoTable),
        _ => return end(walk, StackEnd::BadRule),
    };
    let Some(mut return_address) = window.read(cfa - 8) else {
        return end(walk, StackEnd::ReadFailed);
    };
    if walk.trampoline != 0 && return_address == walk.trampoline {
        return_address = taken_return(walk);
    }
    // Where the caller's rbp was saved: relative to the CFA, or to this frame's rbp (a
    // stack-realigning function), which is only known while rbp is.
    let saved_at = match row.rbp {
        rbp::SAVED => Some(cfa),
        rbp::AT_RBP if walk.bp_known != 0 => Some(walk.bp(&mut window.reads)),
        _ => None,
    };
    match saved_at {
        Some(base) => {
            let at = base.wrapping_add(row.rbp_offset as i64 as u64);
            match window.fetch(at) {
                Some(saved) => (walk.bp, walk.bp_known, walk.bp_from_regs, walk.bp_saved_at) = (saved, 1, 0, at),
                None => return end(walk, StackEnd::ReadFailed),
            }
        }
        None if row.rbp != rbp::SAME => walk.bp_known = 0,
        None => {}
    }
    (walk.pc, walk.sp, walk.pc_is_return) = (return_address, cfa, 1);
    // CFI ends at an undefined return address (above), but some hand-written outermost frames
    // just hold 0; frame pointers end at a zero frame.
    if return_address == 0 || (frame_pointers && walk.bp(&mut window.reads) == 0) {
        return end(walk, StackEnd::Complete);
    }
    Some(())
}

/// The row for `address` and its mapping's kind, by binary searches; None (the walk ended) when
/// no mapping or row covers it.
fn search_row(walk: &mut Walk, address: u64, at_entry: bool) -> Option<(UnwindRow, u32)> {
    if !(walk.mapping.start <= address && address < walk.mapping.end) {
        let list = unsafe { PROC_MAPPINGS.get(walk.start.tgid) };
        walk.list_seen = list.map_or(NO_LIST, |list| list.code_changes_seen);
        let Some(found) = list.and_then(|mappings| find_mapping(mappings, address)) else {
            end(walk, StackEnd::NoTable);
            return None;
        };
        walk.mapping = *found;
    }
    let mapping = &{ walk.mapping };
    match row_for(mapping, address, at_entry) {
        Some(row) => Some((*row, mapping.kind)),
        None => {
            end(walk, StackEnd::NoTable);
            None
        }
    }
}

/// Rows found for recent frame addresses, per CPU, one per slot of an address's hash. The same
/// few allocation paths repeat millions of times: a hit costs one lookup where a miss costs two
/// binary searches over large tables.
#[map]
static ROW_CACHE: PerCpuArray<CachedRow> = PerCpuArray::with_max_entries(ROW_CACHE_SLOTS, 0);
const ROW_CACHE_SLOTS: u32 = 1 << ROW_CACHE_BITS;
const ROW_CACHE_BITS: u32 = 12;

/// The row of `pc` in process `tgid` while its mappings are those of `generation`.
#[repr(C)]
struct CachedRow {
    pc: u64,
    tgid: u32,
    generation: u32,
    row: UnwindRow,
    /// The mapping's kind, and `AT_ENTRY` for a function's first instruction.
    kind: u32,
    /// A hash of the fields above: a task preempted while it filled the slot leaves a mix,
    /// which must not pass for a row.
    check: u64,
}

const AT_ENTRY: u32 = 1 << 16;

fn cache_slot(pc: u64, tgid: u32) -> u32 {
    ((pc ^ (tgid as u64) << 40).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - ROW_CACHE_BITS)) as u32 % ROW_CACHE_SLOTS
}

impl CachedRow {
    fn holds(&self, pc: u64, walk: &Walk, at_entry: bool) -> bool {
        self.pc == pc
            && self.tgid == walk.start.tgid
            && self.generation == walk.start.generation
            && (self.kind & AT_ENTRY != 0) == at_entry
            && self.check == self.hash()
    }

    fn fill(&mut self, pc: u64, walk: &Walk, at_entry: bool, row: UnwindRow, kind: u32) {
        (self.pc, self.tgid, self.generation, self.row) = (pc, walk.start.tgid, walk.start.generation, row);
        self.kind = kind | if at_entry { AT_ENTRY } else { 0 };
        self.check = self.hash();
    }

    fn hash(&self) -> u64 {
        let row = &self.row;
        let rule = (row.cfa_offset as u32 as u64) << 32
            | (row.rbp_offset as u16 as u64) << 16
            | (row.cfa as u64) << 8
            | row.rbp as u64;
        let ids = (self.tgid as u64) << 32 | self.generation as u64;
        (self.pc ^ ids.rotate_left(17) ^ rule.rotate_left(41) ^ self.kind as u64).wrapping_mul(0xff51_afd7_ed55_8ccd)
    }
}

fn end(walk: &mut Walk, why: StackEnd) -> Option<()> {
    walk.end = why as u32;
    None
}

impl Window {
    /// The word at `address`, noted for the walk's memo.
    fn read(&mut self, address: u64) -> Option<u64> {
        let value = self.fetch(address)?;
        self.reads.note(address, value);
        Some(value)
    }

    /// The word at `address`: from the copy when it holds it, else from a new copy starting there.
    /// A copy stops at the end of its page: a failed copy then means the word's page is not
    /// mapped (a garbage frame address), and is not tried again word by word.
    fn fetch(&mut self, address: u64) -> Option<u64> {
        let offset = address.wrapping_sub(self.start);
        if offset.is_multiple_of(8) && offset < self.len && self.len - offset >= 8 {
            return self.words.get((offset / 8) as usize & (WINDOW_WORDS - 1)).copied();
        }
        self.len = 0;
        let page_rest = PAGE_SIZE - (address & (PAGE_SIZE - 1));
        if page_rest < 8 {
            // The word straddles two pages.
            return unsafe { bpf_probe_read_user(address as *const u64) }.ok();
        }
        let size = page_rest.min(core::mem::size_of_val(&self.words) as u64) as u32;
        // SAFETY: the destination is this window's words, at least `size` bytes long.
        let copied = unsafe {
            aya_ebpf::helpers::generated::bpf_probe_read_user(
                self.words.as_mut_ptr().cast(),
                size,
                address as *const c_void,
            )
        };
        if copied != 0 {
            return None;
        }
        (self.start, self.len) = (address, size as u64);
        Some(self.words[0])
    }
}

const PAGE_SIZE: u64 = 4096;

/// 1 when `low <= high`, else 0, without a branch (addresses are far below 2^63): every branch
/// in a search doubles the paths the verifier explores.
fn at_or_below(low: u64, high: u64) -> u64 {
    (high.wrapping_sub(low) >> 63) ^ 1
}

/// The mapping that holds `address`: a binary search over the sorted entries, branchless but for
/// its end (one branch out per step, not two ways to go on).
fn find_mapping(mappings: &ProcMappings, address: u64) -> Option<&ExecMapping> {
    let (mut base, mut count) = (0usize, (mappings.len as usize).min(MAX_MAPPINGS));
    for _ in 0..MAPPING_STEPS {
        if count <= 1 {
            break;
        }
        let half = count / 2;
        let probe = mappings.entries.get((base + half) & (MAX_MAPPINGS - 1))?;
        base += half & (at_or_below(probe.start, address) as usize).wrapping_neg();
        count -= half;
    }
    let entry = mappings.entries.get(base & (MAX_MAPPINGS - 1))?;
    (count == 1 && entry.start <= address && address < entry.end).then_some(entry)
}

static FRAME_POINTER_ROW: UnwindRow = profiler_common::FRAME_POINTER_ROW;
static ENTRY_ROW: UnwindRow = profiler_common::ENTRY_ROW;

/// The row that covers `address`: the last one whose `pc` is at or below it.
fn row_for(mapping: &ExecMapping, address: u64, at_entry: bool) -> Option<&'static UnwindRow> {
    if mapping.kind == mapping_kind::FRAME_POINTERS {
        return Some(if at_entry { &ENTRY_ROW } else { &FRAME_POINTER_ROW });
    }
    let file_address = address.wrapping_sub(mapping.bias);
    if file_address > u32::MAX as u64 {
        return None;
    }
    let file_address = file_address as u32;
    let (mut base, mut count) = (mapping.first_row, mapping.rows);
    for _ in 0..ROW_STEPS {
        if count <= 1 {
            break;
        }
        let half = count / 2;
        let probe = row_at(base + half)?;
        base += half & (at_or_below(probe.pc as u64, file_address as u64) as u32).wrapping_neg();
        count -= half;
    }
    let row = row_at(base)?;
    (count == 1 && row.pc <= file_address).then_some(row)
}

/// Row `index` of the rows' index space; None where its shard does not exist (a mapping list
/// that still points at rows the daemon has released).
fn row_at(index: u32) -> Option<&'static UnwindRow> {
    UNWIND_SHARDS.get_value(index >> UNWIND_SHARD_BITS, &(index & (UNWIND_SHARD_ROWS - 1)))
}
