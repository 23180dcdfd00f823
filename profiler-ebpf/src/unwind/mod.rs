//! The user stack walk: DWARF CFI rows (built by the daemon from each file's `.eh_frame`) or frame
//! pointers, frame by frame, into memprof's own stack tables.
//!
//! For each frame the walk takes the row covering the address from a per-CPU cache (`ROW_CACHE`)
//! or, on a miss, finds the process's executable mapping of the address (binary search in
//! `PROC_MAPPINGS`) and the row in that file's slice of the rows in `UNWIND_SHARDS` (binary
//! search); it then computes the canonical frame address (CFA) and reads the return address at
//! CFA - 8.
//! Files are shared: every process that maps a file points at the same rows.
//!
//! Stacks are stored under a 64-bit hash of their frames. A second hash kept in the value tells a
//! real collision from a repeat, so a stack is never merged with another one or thrown away
//! silently.
//!
//! Here: a walk's set-up and the stack's storing. `frames` steps from frame to frame, `rows`
//! finds a frame's row, `taken` the return addresses uretprobes took from the stack, `defer`
//! sends a walk stopped at a file with no table yet to the daemon, and `changes` tells the walk
//! and the daemon that a process's code may have moved.
//!
//! The maps' capacities in these files are defaults; the daemon sets the real ones at load time.

use core::intrinsics::{atomic_cxchg, atomic_xchg, AtomicOrdering};

use aya_ebpf::{
    bindings::{pt_regs, BPF_NOEXIST},
    cty::c_void,
    helpers::{bpf_loop, bpf_probe_read_user},
    macros::map,
    maps::{Array, HashMap, PerCpuArray, RingBuf},
    Global,
};
use profiler_common::{
    stack_id_of, stack_table, walk_kind, DropReason, ExecMapping, Stack, StackEnd, UnwindRow, MAX_FRAMES, NO_STACK,
    STACK_HASH_SEED,
};

use crate::{
    memo::{self, Reads, Start},
    shared::{count_drop, EEXIST, NO_PREALLOC},
};

mod changes;
mod defer;
mod frames;
mod rows;
mod taken;

use changes::{list_was_current, NO_LIST};
use defer::defer;
use frames::step;

pub use changes::{code_changed, on_mappings_changed};
pub use taken::TakenReturns;

#[map]
pub static STACKS: HashMap<u64, Stack> = HashMap::with_max_entries(65_536, NO_PREALLOC);
#[map]
pub static FREE_STACKS: HashMap<u64, Stack> = HashMap::with_max_entries(16_384, NO_PREALLOC);

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
/// What deferred walks leave of `UNWIND_EVENTS` to the mapping changes: room for about 80 lists
/// of the linker's objects. A burst of walks must not crowd out the change that names their
/// file: a process gone before the daemon reads its mappings keeps the last list it sent, and
/// without this one its new file would never get a table.
const MAPPING_EVENTS_ROOM: u64 = 1024 * 1024;

/// Where a walk builds its stack: 1 KiB does not fit on the 512-byte BPF stack.
#[repr(C)]
struct Scratch {
    /// 1 while a walk holds the scratch, and with it this CPU's row cache and memos (see
    /// `stack_id`).
    held: u64,
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
    /// A `walk_kind` constant: whether a walk cut short counts in its process's drops (a
    /// mapping's stack is only marked truncated in its report, see `mapping`), and whether its
    /// stack has totals.
    pub kind: u32,
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
            kind: walk_kind::CALL,
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
            kind: walk_kind::CALL,
        }
    }

    /// At an allocator's completion site (see `profiler_common::completion`), where the stack
    /// and rbp are as at the function's entry: walked from the return address at `[rsp]`, with
    /// the registers the return will have, so that the stack is the one a return probe walks.
    /// A uretprobe may have taken that address already (another tool's on the function, or
    /// another link's uprobe session at an earlier site of the call): the kernel's list has it
    /// then, and `trampoline` gives the process's trampoline to tell.
    ///
    /// # Safety
    /// `regs` must be the probe's context registers.
    pub unsafe fn completing(regs: *const pt_regs, trampoline: impl FnOnce() -> u64) -> Regs {
        let regs = &*regs;
        // SAFETY: a read of user memory through the helper, which faults safely.
        let slot = bpf_probe_read_user(regs.rsp as *const u64).unwrap_or(0);
        Regs {
            pc: TakenReturns::real_return(slot, regs.rsp, trampoline),
            sp: regs.rsp + 8,
            bp: regs.rbp,
            pc_is_return: true,
            first_is_probed: false,
            taken: TakenReturns::NONE,
            kind: walk_kind::CALL,
        }
    }
}

/// Walks the stack and returns its id in the `stack_table` `which`, or `NO_STACK` (counted) when
/// it cannot be kept.
///
/// Uprobe programs run with migration disabled but may be preempted: another task's walk on
/// this CPU may begin while this one is half done. A walk holds the CPU's scratch from its start
/// to its end, and one that finds it held keeps no stack (`stack_preempted`), so that no walk
/// mixes with another's. BPF programs always run to their end: the holder lets go. Until it runs
/// again, every walk on its CPU is dropped so (a task preempted mid-walk on a CPU busy with
/// tasks of higher priority: many `stack_preempted` there).
#[inline(always)]
pub fn stack_id(which: u32, tgid: u32, regs: Regs) -> u64 {
    let Some(scratch) = SCRATCH.get_ptr_mut(0) else {
        return NO_STACK;
    };
    // SAFETY: this CPU's scratch; its `held` word alone until the compare-and-swap succeeds.
    if !hold(unsafe { &mut (*scratch).held }) {
        count_drop(DropReason::StackPreempted);
        return NO_STACK;
    }
    let id = walk_held(which, tgid, regs, scratch);
    // SAFETY: as above; the walk's calls are done with the scratch.
    let_go(unsafe { &mut (*scratch).held });
    id
}

/// Takes `held` from 0 to 1; false when another walk holds it. Acquire: the walk's accesses to
/// the scratch come after it.
fn hold(held: &mut u64) -> bool {
    // SAFETY: an aligned u64 inside a map value; the intrinsic compiles to BPF's atomic
    // compare-and-exchange.
    unsafe { atomic_cxchg::<u64, { AtomicOrdering::Acquire }, { AtomicOrdering::Acquire }>(held, 0, 1).1 }
}

/// Sets `held` back to 0. Release: after the walk's accesses to the scratch. An exchange, as
/// LLVM's BPF back end has no atomic store.
fn let_go(held: &mut u64) {
    // SAFETY: an aligned u64 inside a map value; the intrinsic compiles to BPF's atomic exchange.
    unsafe { atomic_xchg::<u64, { AtomicOrdering::Release }>(held, 0) };
}

/// `stack_id` once the walk holds `scratch`.
#[inline(always)]
fn walk_held(which: u32, tgid: u32, regs: Regs, scratch: *mut Scratch) -> u64 {
    // SAFETY: this CPU's scratch, which this walk holds.
    let scratch = unsafe { &mut *scratch };
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
        which == stack_table::ALLOCATIONS
            && regs.pc_is_return
            && regs.taken.trampoline == 0
            && regs.kind != walk_kind::MAPPING_CALL,
    );
    // No mapping yet: an empty range.
    walk.mapping.end = 0;
    walk.list_seen = NO_LIST;
    scratch.window.len = 0;
    scratch.window.reads.clear();
    // Nothing kept across the calls but their arguments (and, in `stack_id`, the scratch's address,
    // in a register, to let go of it): on 6.1 a larger frame here, with
    // `walk_and_store`'s and its loop's under a free's, exceeds the 512 bytes a program's calls
    // may use together.
    let id = recall_walk();
    if id != NO_STACK {
        return id;
    }
    remember_walk(walk_and_store(which, regs.kind))
}

/// `memo::recall` for the walk `stack_id` set up; `NO_STACK` when it is not remembered. A global
/// function, as the next: verified once, apart from its callers.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn recall_walk() -> u64 {
    let Some(scratch) = SCRATCH.get_ptr_mut(0) else {
        return NO_STACK;
    };
    // SAFETY: this CPU's scratch, which the walk holds (see `stack_id`).
    let scratch = unsafe { &mut *scratch };
    if scratch.walk.memoize == 0 {
        return NO_STACK;
    }
    memo::recall(&scratch.walk.start, &mut scratch.window.words)
}

/// `memo::remember` for the walk that stored `id`, if it ended whole. Returns `id`.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn remember_walk(id: u64) -> u64 {
    let Some(scratch) = SCRATCH.get_ptr_mut(0) else {
        return id;
    };
    // SAFETY: as in `recall_walk`.
    let scratch = unsafe { &mut *scratch };
    let walk = &scratch.walk;
    if walk.memoize != 0 && id != NO_STACK && walk.end == StackEnd::Complete as u32 {
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
pub extern "C" fn walk_and_store(which: u32, kind: u32) -> u64 {
    let table = if which == stack_table::FREES { &FREE_STACKS } else { &STACKS };
    let Some(scratch) = SCRATCH.get_ptr_mut(0) else {
        return NO_STACK;
    };
    // One frame per iteration: the verifier checks `step` once, not once per frame.
    // One more iteration than frames: an entry probe's first one stores none.
    // SAFETY: `step` has the callback signature bpf_loop expects, and takes no context.
    unsafe { bpf_loop(MAX_FRAMES as u32 + 1, step as *mut c_void, core::ptr::null_mut(), 0) };
    // SAFETY: this CPU's scratch, which the walk holds (see `stack_id`), taken once the loop's
    // steps, which write it through references of their own, are done.
    let scratch = unsafe { &mut *scratch };
    let end = StackEnd::from_u32(scratch.walk.end);
    let mut reason = end.drop_reason();
    if end == StackEnd::NoTable && !list_was_current(scratch.walk.start.tgid, scratch.walk.list_seen) {
        if let Some(id) = defer(table, which, scratch, kind) {
            return id;
        }
        reason = Some(DropReason::DeferredWalkLost);
    }
    let walk = &scratch.walk;
    if let Some(reason) = reason.filter(|_| walk_kind::counts_cuts(kind)) {
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
        Ok(()) => id,
        // Another CPU stored it first; a collision then shows at the next lookup.
        Err(err) if err == -EEXIST => id,
        Err(_) => {
            count_drop(DropReason::StackTableFull);
            NO_STACK
        }
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
    /// `frame_row`'s answer for the frame being stepped: its row and its mapping's kind.
    row: UnwindRow,
    row_kind: u32,
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
