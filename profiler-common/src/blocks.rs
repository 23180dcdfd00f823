//! The blocks themselves: a call in flight, the live blocks and the recent frees.

/// Per-thread state of an allocator call between its entry and its return probe.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Inflight {
    /// `AllocFn` of the outermost call.
    pub func: u32,
    /// Allocator calls nested inside the outermost one (glibc's realloc calls malloc, ...).
    pub depth: u32,
    /// Requested size in bytes (`u64::MAX` when calloc's product overflows).
    pub size: u64,
    /// realloc's old pointer, or posix_memalign's out-pointer.
    pub ptr_arg: u64,
    /// The thread's process: thread ids are reused, and an entry left by a thread that died inside
    /// the allocator must not be taken for a new thread's.
    pub tgid: u32,
    /// Whether `stash` holds realloc's old block, taken out of `LIVE` at entry.
    pub stashed: u32,
    pub stash: LiveAlloc,
    /// Stack pointer at entry (0 where unknown): a call nested in this one runs just below it.
    pub entry_sp: u64,
    /// Mean bytes between samples the call was sampled under (0: every call is recorded); with
    /// `recorded` 0 the call's block is not recorded (only realloc's old block is handled).
    pub sample_bytes: u64,
    pub recorded: u32,
    pub _pad: u32,
    /// The thread's last free through a wrapper (see `FreeNote`).
    pub free_note: FreeNote,
    /// The block this thread allocated last, until its next free (0: none): freeing it then,
    /// with no other allocation or free in between, makes it a temporary allocation
    /// (heaptrack's definition).
    pub last_alloc: u64,
}

/// A free through a function that may call another probed free before it returns (`free` in
/// libmimalloc calls `mi_free`, `operator delete` of mimalloc calls `mi_free`):
/// the inner free of the same block is part of it, not a second free. Inner means: same address,
/// another function, at or below the wrapper's stack pointer while the wrapper's return address
/// is still in its slot.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FreeNote {
    pub addr: u64,
    /// Stack pointer at the wrapper's entry: its return address slot.
    pub sp: u64,
    /// The return address the slot held then.
    pub ret: u64,
    /// The wrapper's address (the probe's, see `probe_address` in the eBPF programs).
    pub ip: u64,
}

impl FreeNote {
    pub const EMPTY: FreeNote = FreeNote { addr: 0, sp: 0, ret: 0, ip: 0 };
}

/// Key of a live allocation: addresses repeat across processes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AddrKey {
    pub tgid: u32,
    pub _pad: u32,
    pub addr: u64,
}

/// The process whose `LIVE` changes the programs note in `LIVE_CHANGES` while the daemon
/// inspects it: the inspection lists its blocks before the stop, and in the stop reads again
/// only the blocks that changed meanwhile, not the whole table every traced process shares.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LiveWatch {
    /// 0: none (no process allocates as tgid 0).
    pub tgid: u32,
    /// 1 once a change could not be noted (`LIVE_CHANGES` full): the whole table must be read.
    pub overflowed: u32,
}

/// Slots of the live blocks' filter: each counts the `LIVE` entries whose key falls in it, so that
/// a slot at 0 says, without a hash lookup, that a block is not live (a sampling process's frees
/// are almost all of blocks it did not record). Slots are u64: an array's values are 8-byte
/// aligned anyway, and the shared atomic add is 64-bit.
pub const LIVE_FILTER_SLOTS: u32 = 1 << LIVE_FILTER_BITS;
const LIVE_FILTER_BITS: u32 = 19;

/// The filter slot of a live block's key.
#[inline(always)]
pub fn live_filter_slot(key: &AddrKey) -> u32 {
    let mixed = (key.addr ^ (key.tgid as u64) << 44).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (mixed >> (64 - LIVE_FILTER_BITS)) as u32
}

/// One outstanding allocation.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LiveAlloc {
    pub size: u64,
    /// `bpf_ktime_get_ns` (CLOCK_MONOTONIC) at the allocator's return.
    pub time_ns: u64,
    pub stack_id: u64,
    pub tid: u32,
    /// `AllocFn`.
    pub func: u32,
}

/// Where and when a free happened. `stack_id` is in `FREE_STACKS`, not `STACKS`; a free whose
/// stack was not walked (`NO_STACK`: only a double free's second free is, unless every free's
/// stack is asked for) keeps the address it returns to in `caller` (0: unknown).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct FreeSite {
    pub time_ns: u64,
    pub stack_id: u64,
    pub caller: u64,
    pub tid: u32,
    pub _pad: u32,
}

/// A recently freed allocation, kept to recognise a second free of the same address.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FreedAlloc {
    pub alloc: LiveAlloc,
    pub free: FreeSite,
}

/// A slot of `RECENT_FREES`: which block it remembers (`addr` 0: none), and its free.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RecentFree {
    pub key: AddrKey,
    pub freed: FreedAlloc,
}

/// Sent through the `DOUBLE_FREES` ring buffer: rare, so an event stream is fine here.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DoubleFreeEvent {
    pub tgid: u32,
    pub _pad: u32,
    pub addr: u64,
    pub first: FreedAlloc,
    pub second: FreeSite,
}
