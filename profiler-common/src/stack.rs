//! Stacks: their ids, the stored frames, why a walk ended, and the walks user space finishes.

use crate::DropReason;

/// Stack id recorded when no stack could be kept. Real ids are 64-bit hashes of the frames, never 0.
pub const NO_STACK: u64 = 0;

/// A stack's id is a hash of its frames that the kernel's walk folds in frame by frame
/// (`stack_hash_step` from `STACK_HASH_SEED`) and ends with why the walk ended (`stack_id_of`).
/// User space finishes deferred walks with the same steps, so that a stack has one id however it
/// was walked.
pub const STACK_HASH_SEED: u64 = 0x9e37_79b9_7f4a_7c15;

#[inline(always)]
pub fn stack_hash_step(hash: u64, pc: u64) -> u64 {
    (hash.rotate_left(23) ^ pc).wrapping_mul(0x0100_0000_01b3)
}

/// The id of a stack whose frames folded to `hash` and whose walk ended as `end` (never
/// `NO_STACK`).
#[inline(always)]
pub fn stack_id_of(hash: u64, end: u32) -> u64 {
    let id = hash ^ end as u64;
    if id == NO_STACK {
        1
    } else {
        id
    }
}

/// Frames kept per stack at most.
pub const MAX_FRAMES: usize = 127;

/// A stored stack in `STACKS` or `FREE_STACKS`, keyed by a 64-bit hash of its frames. `check` is a
/// second, independent hash of them: a different stack under the same key is a collision,
/// counted and never merged.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Stack {
    pub check: u64,
    pub len: u32,
    /// `StackEnd`: why the walk stopped.
    pub end: u32,
    /// Return addresses, innermost first; frame 0 is the instruction where the walk began.
    pub frames: [u64; MAX_FRAMES],
}

/// Why a stack walk stopped. Only `Complete` reached the thread's outermost frame.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StackEnd {
    /// The unwind info marked the outermost frame (`_start`, `clone3`: the return address is
    /// undefined), or frame pointers reached a zero frame.
    Complete = 0,
    NoTable = 1,
    BadRule = 2,
    ReadFailed = 3,
    TooDeep = 4,
    /// A frame's file had no table yet: the walk's state and a copy of the stack went to
    /// memprof, which finishes the walk once the table is loaded (`DeferredUnwind`). Not a drop:
    /// memprof counts how many it finished and how many it could not.
    Deferred = 5,
}

impl StackEnd {
    pub fn from_u32(value: u32) -> StackEnd {
        match value {
            0 => StackEnd::Complete,
            1 => StackEnd::NoTable,
            2 => StackEnd::BadRule,
            3 => StackEnd::ReadFailed,
            5 => StackEnd::Deferred,
            _ => StackEnd::TooDeep,
        }
    }

    /// The drop counter a walk that stopped here bumps (none for a complete one).
    pub fn drop_reason(self) -> Option<DropReason> {
        match self {
            StackEnd::Complete | StackEnd::Deferred => None,
            StackEnd::NoTable => Some(DropReason::UnwindNoTable),
            StackEnd::BadRule => Some(DropReason::UnwindBadRule),
            StackEnd::ReadFailed => Some(DropReason::UnwindReadFailed),
            StackEnd::TooDeep => Some(DropReason::StackTooDeep),
        }
    }
}

/// Pages of the user stack a deferred walk copies, from the one holding the stack pointer up:
/// at least 28 KiB above it, and up to 32 KiB. Fewer were not enough for perl's start-up walks,
/// deferred above `Perl_set_caret_X` and its 4 KiB buffer, nor for python3's, deferred inside
/// its nested imports (docs: performance.md#measurements-behind-design-choices).
pub const DEFERRED_PAGES: usize = 8;
pub const PAGE_BYTES: usize = 4096;
/// Pages a short deferred walk's record holds (`ShortDeferredUnwind`): a main thread's stack,
/// whose top its environment follows, most often ends within 3 pages of where a walk stops.
pub const SHORT_DEFERRED_PAGES: usize = 4;

/// Which stack table a deferred walk's stack is stored in.
pub mod stack_table {
    pub const ALLOCATIONS: u32 = 0;
    pub const FREES: u32 = 1;
}

/// What a walk's stack is of. It decides whether a cut in the walk counts in its process's drops
/// and whether the stack has totals in `STACK_STATS`.
pub mod walk_kind {
    /// An allocator call or an allocation sample: a cut counts, and in the allocations' table its
    /// stack has totals (a free's, in the frees' table, has none).
    pub const CALL: u32 = 0;
    /// A page fault of growth mode: a cut counts, but pages have no totals per stack.
    pub const PAGE_FAULT: u32 = 1;
    /// A mapping call: no totals, and its stack says it was cut itself.
    pub const MAPPING_CALL: u32 = 2;

    /// Whether a cut in a walk of `kind` counts in its process's drops.
    pub const fn counts_cuts(kind: u32) -> bool {
        kind != MAPPING_CALL
    }
}

/// A walk that stopped at a frame whose file has no unwind table yet (a library mapped moments
/// ago), sent through `UNWIND_EVENTS` so that memprof finishes it once the table is loaded. Its
/// stack is stored under `stack_id` with the frames walked so far and `StackEnd::Deferred`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct DeferredUnwindOf<const WINDOW_BYTES: usize> {
    pub stack_id: u64,
    pub tgid: u32,
    /// A `stack_table` constant.
    pub table: u32,
    /// The registers at the frame the kernel could not unwind.
    pub pc: u64,
    pub sp: u64,
    pub bp: u64,
    /// Whether `pc` is a return address (its call is the byte before it).
    pub pc_is_return: u32,
    pub bp_known: u32,
    /// Whether `pc` is already the stored stack's last frame (else it is an entry probe's
    /// function, which stacks do not hold).
    pub pc_recorded: u32,
    /// Frames the stored stack holds.
    pub stored: u32,
    /// A `walk_kind` constant.
    pub kind: u32,
    /// Pages copied into `window` (0 to `DEFERRED_PAGES`): the copy stops at the first page
    /// that cannot be read, the stack's top.
    pub pages: u32,
    /// The address of `window[0]`: the page holding `sp`.
    pub window_start: u64,
    /// `bpf_ktime_get_ns` at the walk: one from before the process's latest exec was its old
    /// program's.
    pub time_ns: u64,
    pub window: [u8; WINDOW_BYTES],
}

/// A deferred walk with up to `DEFERRED_PAGES` of stack.
pub type DeferredUnwind = DeferredUnwindOf<{ DEFERRED_PAGES * PAGE_BYTES }>;
/// The record of one whose stack ends within `SHORT_DEFERRED_PAGES`: the ring holds twice as
/// many of these. Its fields are `DeferredUnwind`'s, at the same offsets.
pub type ShortDeferredUnwind = DeferredUnwindOf<{ SHORT_DEFERRED_PAGES * PAGE_BYTES }>;
