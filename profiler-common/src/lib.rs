//! Types shared by the eBPF programs and the daemon.
//!
//! Everything here crosses the kernel/user boundary through BPF maps, so every type is `#[repr(C)]`,
//! has no implicit padding (asserted below) and holds plain integers only.
#![cfg_attr(not(test), no_std)]

pub mod generations;
pub mod usdt;

use generations::GENERATIONS;

/// What an allocating entry point does and where its arguments are: every allocator family's
/// functions map to one of these (the daemon's `process::families` has the tables). The probe's
/// cookie is one of these; frees need none (every free takes the block first).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocFn {
    /// `malloc(size)`, and everything with the size first: `mallocx(size, flags)`, `operator
    /// new(size, ...)`, `mi_malloc_aligned(size, alignment)`, `__rg_alloc(size, align)`.
    Malloc = 0,
    /// `calloc(n, size)`: `n * size` bytes.
    Calloc = 1,
    /// `realloc(ptr, size)`, also `rallocx(ptr, size, flags)`.
    Realloc = 2,
    /// `reallocarray(ptr, n, size)`.
    Reallocarray = 3,
    /// `posix_memalign(&out, alignment, size)`: the pointer through `out`, 0 on success.
    PosixMemalign = 4,
    /// `aligned_alloc(alignment, size)`.
    AlignedAlloc = 5,
    /// `memalign(alignment, size)`.
    Memalign = 6,
    /// `valloc(size)`.
    Valloc = 7,
    /// `pvalloc(size)`.
    Pvalloc = 8,
    /// jemalloc's `xallocx(ptr, size, extra, flags)`: resizes in place and returns the block's
    /// real size, which is below `size` when it could not grow.
    ResizeInPlace = 9,
    /// Rust's `__rg_realloc(ptr, old_size, align, new_size)`.
    RustRealloc = 10,
}

impl AllocFn {
    pub const ALL: [AllocFn; 11] = [
        AllocFn::Malloc,
        AllocFn::Calloc,
        AllocFn::Realloc,
        AllocFn::Reallocarray,
        AllocFn::PosixMemalign,
        AllocFn::AlignedAlloc,
        AllocFn::Memalign,
        AllocFn::Valloc,
        AllocFn::Pvalloc,
        AllocFn::ResizeInPlace,
        AllocFn::RustRealloc,
    ];

    pub fn from_u32(value: u32) -> Option<AllocFn> {
        AllocFn::ALL.get(value as usize).copied()
    }

    /// Whether the call takes a block (its first argument) and may give it back resized.
    pub fn resizes(self) -> bool {
        matches!(self, AllocFn::Realloc | AllocFn::Reallocarray | AllocFn::ResizeInPlace | AllocFn::RustRealloc)
    }

    /// Whether glibc's version of the call may call `malloc` inside it (mostly as a tail call):
    /// realloc and reallocarray of NULL (`ptr_arg` 0), and the aligned allocators. A sampled
    /// call of these that is not drawn still keeps its in-flight state, so that the `malloc`
    /// inside it is seen nested and not drawn on its own: each was counted about twice.
    pub fn may_call_malloc(self, ptr_arg: u64) -> bool {
        match self {
            AllocFn::Realloc | AllocFn::Reallocarray => ptr_arg == 0,
            AllocFn::PosixMemalign | AllocFn::AlignedAlloc | AllocFn::Memalign | AllocFn::Valloc | AllocFn::Pvalloc => {
                true
            }
            _ => false,
        }
    }

    /// Which of the call's arguments (0 first) memprof's entry probe reads: the daemon places
    /// the probe where they are still in their registers.
    pub const fn arguments(self) -> Arguments {
        use AllocFn::*;
        let (size, count, pointer) = match self {
            Malloc | Valloc | Pvalloc => (0, None, None),
            Calloc => (1, Some(0), None),
            Realloc | ResizeInPlace => (1, None, Some(0)),
            Reallocarray => (2, Some(1), Some(0)),
            PosixMemalign => (2, None, Some(0)),
            AlignedAlloc | Memalign => (1, None, None),
            RustRealloc => (3, None, Some(0)),
        };
        Arguments { size, count, pointer }
    }
}

/// Where an allocation function's arguments are (see `AllocFn::arguments`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arguments {
    /// The size asked for: of each element when `count` is given (`calloc`, `reallocarray`).
    pub size: usize,
    pub count: Option<usize>,
    /// The pointer argument kept until the return: the old block of a resize, posix_memalign's
    /// out-pointer.
    pub pointer: Option<usize>,
}

impl Arguments {
    /// Every argument read, 0 first.
    pub fn read(self) -> impl Iterator<Item = usize> {
        [Some(self.size), self.count, self.pointer].into_iter().flatten()
    }
}

/// Why an event could not be recorded, or was recorded with less than a whole stack. Indexes a
/// process's `ProcDrops`, and the per-CPU `DROPS` array of drops that found no room there.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropReason {
    /// `LIVE` was full: the allocation is neither tracked nor counted.
    LiveMapFull = 0,
    /// `STACK_STATS` was full: the allocation is tracked but its stack totals are not.
    StatsMapFull = 1,
    /// `STACKS` (or `FREE_STACKS`) was full: the allocation is counted under `NO_STACK`.
    StackTableFull = 2,
    /// Another stack had the same 64-bit hash: counted under `NO_STACK`, never merged with it.
    StackCollision = 3,
    /// `INFLIGHT` was full: a call's arguments could not be kept until its return.
    InflightMapFull = 4,
    /// A return probe found no entry state (the call began before the probes were attached), or
    /// an entry state turned out stale (its return never came: the thread died inside the call).
    InflightMissing = 5,
    /// The double-free ring buffer was full.
    DoubleFreeEventLost = 6,
    /// An address was returned again while still live: its free was never seen.
    MissedFree = 7,
    /// `PROC_COUNTERS` or `PROC_HEAP` was full: a per-process counter could not be bumped.
    ProcessTableFull = 8,
    /// A frame's address was in no mapping with an unwind table (JIT code, or a library mapped
    /// moments ago and not read yet): the stack ends there, marked truncated.
    UnwindNoTable = 9,
    /// A frame's unwind rule is one memprof does not follow, or needs a register lost earlier:
    /// the stack ends there, marked truncated.
    UnwindBadRule = 10,
    /// Reading the target's stack failed (a corrupt frame, or a page not present): the stack
    /// ends there, marked truncated.
    UnwindReadFailed = 11,
    /// The stack was deeper than the frame limit: its outermost frames are cut, marked truncated.
    StackTooDeep = 12,
    /// A stack walk was preempted by another on the same CPU, which reused its scratch space:
    /// counted under `NO_STACK` rather than kept mixed.
    StackPreempted = 13,
    /// The ring buffer telling the daemon of new mappings was full: it finds them at its next
    /// refresh instead.
    MappingEventLost = 14,
    /// The table of thread pairs (who frees whose allocations) was full: the free is counted,
    /// its pair is not.
    ThreadPairTableFull = 15,
    /// A walk stopped at a file with no table yet, and its stack copy could not be sent to the
    /// daemon to finish (the ring of deferred walks was full): the stack ends there, truncated.
    DeferredWalkLost = 16,
    /// The ring buffer of anonymous `mmap`, `munmap`, `mremap` and `brk` calls was full: the
    /// process's mappings miss that call.
    MmapEventLost = 17,
    /// The same ring was full at a page's first touch (`--growth`): the page is not counted.
    FaultEventLost = 18,
}

impl DropReason {
    pub const COUNT: usize = 19;
    pub const ALL: [DropReason; DropReason::COUNT] = [
        DropReason::LiveMapFull,
        DropReason::StatsMapFull,
        DropReason::StackTableFull,
        DropReason::StackCollision,
        DropReason::InflightMapFull,
        DropReason::InflightMissing,
        DropReason::DoubleFreeEventLost,
        DropReason::MissedFree,
        DropReason::ProcessTableFull,
        DropReason::UnwindNoTable,
        DropReason::UnwindBadRule,
        DropReason::UnwindReadFailed,
        DropReason::StackTooDeep,
        DropReason::StackPreempted,
        DropReason::MappingEventLost,
        DropReason::ThreadPairTableFull,
        DropReason::DeferredWalkLost,
        DropReason::MmapEventLost,
        DropReason::FaultEventLost,
    ];

    /// The snake_case name used in reports and metrics.
    pub fn name(self) -> &'static str {
        match self {
            DropReason::LiveMapFull => "live_map_full",
            DropReason::StatsMapFull => "stats_map_full",
            DropReason::StackTableFull => "stack_table_full",
            DropReason::StackCollision => "stack_collision",
            DropReason::InflightMapFull => "inflight_map_full",
            DropReason::InflightMissing => "inflight_missing",
            DropReason::DoubleFreeEventLost => "double_free_event_lost",
            DropReason::MissedFree => "missed_free",
            DropReason::ProcessTableFull => "process_table_full",
            DropReason::UnwindNoTable => "unwind_no_table",
            DropReason::UnwindBadRule => "unwind_bad_rule",
            DropReason::UnwindReadFailed => "unwind_read_failed",
            DropReason::StackTooDeep => "stack_too_deep",
            DropReason::StackPreempted => "stack_preempted",
            DropReason::MappingEventLost => "mapping_event_lost",
            DropReason::ThreadPairTableFull => "thread_pair_table_full",
            DropReason::DeferredWalkLost => "deferred_walk_lost",
            DropReason::MmapEventLost => "mmap_event_lost",
            DropReason::FaultEventLost => "fault_event_lost",
        }
    }
}

/// Counts of allocations and frees are kept in 1/`COUNT_SCALE` units, so that a sampled
/// allocation can stand for a fraction more than one (see `weight`).
pub const COUNT_SCALE: u64 = 256;

/// Set in `LiveAlloc::func` when the allocation was recorded by sampling.
pub const SAMPLED: u32 = 1 << 31;

/// Set in `LiveAlloc::func`, with `SAMPLED`, when the allocator's own sampler reported the
/// allocation through its `otel_memory` probe (see `usdt`): its weight is kept beside it.
pub const USDT: u32 = 1 << 30;

/// A sampling process's rate where the programs read it on every call: slot `rate_slot(tgid)` of
/// an array, an inlined lookup instead of a hash lookup. A process whose slot another holds
/// stays in the hash of rates alone, and its slot counts it in `collided`, so that a call finds
/// a process without either at the cost of the array lookup.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SampleRate {
    /// The process holding the slot (0: none).
    pub tgid: u32,
    /// Sampling processes whose slot this is but that another one holds.
    pub collided: u32,
    /// Its mean bytes between samples.
    pub sample_bytes: u64,
}

/// Slots of the rate array: a power of two, for an `and` instead of a division per call.
pub const RATE_SLOTS: u32 = 4096;

#[inline(always)]
pub fn rate_slot(tgid: u32) -> u32 {
    tgid & (RATE_SLOTS - 1)
}

impl SampleRate {
    /// Process `tgid`'s rate as its slot says: `None` when the slot cannot say (another process
    /// holds it and some process is in the hash alone), 0 when it does not sample.
    #[inline(always)]
    pub fn of(&self, tgid: u32) -> Option<u64> {
        if self.tgid == tgid {
            Some(self.sample_bytes)
        } else if self.collided == 0 {
            Some(0)
        } else {
            None
        }
    }

    /// Process `tgid` samples at `sample_bytes` from now on; `known`: it did already (one that
    /// collided stays in the hash alone, counted once).
    pub fn claim(&mut self, tgid: u32, sample_bytes: u64, known: bool) {
        if self.tgid == tgid || (self.tgid == 0 && !known) {
            (self.tgid, self.sample_bytes) = (tgid, sample_bytes);
        } else if !known {
            self.collided += 1;
        }
    }

    /// Process `tgid`, which sampled, has left.
    pub fn release(&mut self, tgid: u32) {
        if self.tgid == tgid {
            (self.tgid, self.sample_bytes) = (0, 0);
        } else {
            self.collided = self.collided.saturating_sub(1);
        }
    }
}

/// How much one recorded allocation of `size` bytes counts for, as (count in 1/`COUNT_SCALE`
/// units, bytes), when allocations are sampled with probability `min(1, size / sample_bytes)`
/// (every one when `sample_bytes` is 0): the inverse of its probability, so that sums are
/// unbiased estimates. A free takes off exactly what its allocation added.
pub fn weight(sample_bytes: u64, size: u64) -> (u64, u64) {
    let size_for_odds = if size == 0 { 1 } else { size };
    if sample_bytes == 0 || size_for_odds >= sample_bytes {
        (COUNT_SCALE, size)
    } else {
        (COUNT_SCALE * sample_bytes / size_for_odds, sample_bytes * size / size_for_odds)
    }
}

/// Whether an allocation of `size` is sampled, given a uniform random `draw`: with probability
/// `min(1, size / sample_bytes)`.
pub fn sampled(sample_bytes: u64, size: u64, draw: u32) -> bool {
    let size_for_odds = if size == 0 { 1 } else { size };
    sample_bytes == 0 || size_for_odds >= sample_bytes || (draw as u64) < (size_for_odds << 32) / sample_bytes
}

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

/// Cookie of a free probe whose function may call another probed free (see `FreeNote`).
pub const FREE_WRAPPER: u64 = 1;

/// Cookie bit of a free probe in the C library's own shared object: a free of a block never
/// seen allocated that its own code calls is the library's internal one
/// (`ProcCounters::internal_frees`). Its own code is its executable segment, which the cookie
/// spans from the probe (see `c_library_free_cookie`): constant distances in the file, where
/// addresses differ in every process. The caller is the return address, the word at the stack
/// pointer where free probes sit (nothing is pushed before them). Never set on a file that
/// holds the program's code too (a static binary), where a caller inside it may be the program.
pub const FREE_IN_C_LIBRARY: u64 = 2;
const SPAN_BITS: u32 = 30;
const SPAN_MASK: u64 = (1 << SPAN_BITS) - 1;

/// The cookie of a C library's free probe whose executable segment starts `below` bytes before
/// the probe and ends `above` bytes after it; `None` when a distance does not fit.
pub fn c_library_free_cookie(below: u64, above: u64) -> Option<u64> {
    (below <= SPAN_MASK && above <= SPAN_MASK).then_some(FREE_IN_C_LIBRARY | below << 2 | above << (2 + SPAN_BITS))
}

/// Whether `caller` is code of the C library whose free probe at `probe` has `cookie` (see
/// `c_library_free_cookie`).
pub fn called_by_c_library(cookie: u64, probe: u64, caller: u64) -> bool {
    let (below, above) = ((cookie >> 2) & SPAN_MASK, (cookie >> (2 + SPAN_BITS)) & SPAN_MASK);
    cookie & FREE_IN_C_LIBRARY != 0 && probe.wrapping_sub(below) <= caller && caller < probe.wrapping_add(above)
}

/// Set in the cookie of every probe of a link shared by every process that maps a file (pid 0):
/// its programs record only the processes whose `TRACED` entry has `traced::SHARED`. The other
/// bits are the probe's own cookie.
pub const SHARED_LINK: u64 = 1 << 63;

/// Key of a live allocation: addresses repeat across processes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AddrKey {
    pub tgid: u32,
    pub _pad: u32,
    pub addr: u64,
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

/// Key of the per-stack totals.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StackKey {
    pub tgid: u32,
    /// The process's program when the totals were made (`ProcHeap::image`): after an exec the
    /// old program's totals are told from the new one's until the daemon drops them.
    pub image: u32,
    pub stack_id: u64,
}

/// Per-(process, stack) totals, updated atomically by the programs.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StackStats {
    pub allocations: u64,
    pub allocated_bytes: u64,
    pub frees: u64,
    pub freed_bytes: u64,
    /// Outstanding bytes and allocations by generation slot (see `generations`): wrapping sums
    /// of additions at allocation and subtractions at free.
    pub generation_bytes: [u64; GENERATIONS],
    pub generation_allocations: [u64; GENERATIONS],
    /// Frees of allocations from generations already frozen.
    pub old_freed_bytes: u64,
    pub old_frees: u64,
    /// The most bytes the stack had outstanding at once (DHAT's max-live).
    pub max_outstanding_bytes: u64,
    /// Allocations freed by their thread before it allocated or freed anything else (in 1/COUNT_SCALE
    /// units); full mode only.
    pub temporary_allocations: u64,
    /// The stack's outstanding bytes at its process's peak `peak_generation` (see `ProcHeap`),
    /// written at the stack's first change after that peak: until it changes, its outstanding
    /// bytes now are those it held then.
    pub peak_generation: u64,
    pub bytes_at_peak: u64,
}

impl StackStats {
    pub const EMPTY: StackStats = StackStats {
        allocations: 0,
        allocated_bytes: 0,
        frees: 0,
        freed_bytes: 0,
        generation_bytes: [0; GENERATIONS],
        generation_allocations: [0; GENERATIONS],
        old_freed_bytes: 0,
        old_frees: 0,
        max_outstanding_bytes: 0,
        temporary_allocations: 0,
        peak_generation: 0,
        bytes_at_peak: 0,
    };
}

impl Default for StackStats {
    fn default() -> Self {
        Self::EMPTY
    }
}

/// Key of the per-process counts of allocations freed by another thread than their own.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ThreadPairKey {
    pub tgid: u32,
    pub alloc_tid: u32,
    pub free_tid: u32,
    /// As `StackKey::image`.
    pub image: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ThreadPairStats {
    pub frees: u64,
    pub freed_bytes: u64,
}

/// Per-process counters of events that have no stack.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcCounters {
    /// Frees of addresses never seen allocated since attach, but `internal_frees`.
    pub unknown_frees: u64,
    /// Frees of addresses never seen allocated, called by the C library's own code (see
    /// `FREE_IN_C_LIBRARY`): blocks it allocated inside itself without calling `malloc`, as
    /// glibc does each thread's cache, which it frees through `free` when the thread exits.
    pub internal_frees: u64,
    /// Allocator calls that returned NULL (or an error code).
    pub failed_allocations: u64,
    /// Allocations the allocator's `otel_memory:alloc` probe reported (see `usdt`).
    pub usdt_samples: u64,
}

/// Per-process heap figures that allocations and frees update (one lookup per call, in
/// `PROC_HEAP`): bytes in use, their high-water mark, and the size and lifetime histograms.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcHeap {
    /// Bytes allocated and not freed since tracing began (wrapping sums; weighted when sampled).
    pub in_use: u64,
    /// The most `in_use` has been, and when (`bpf_ktime_get_ns`).
    pub peak: u64,
    pub peak_ns: u64,
    /// Bumped at every new peak: a stack's `bytes_at_peak` belongs to the peak of its
    /// `peak_generation` (see `StackStats`).
    pub peak_generation: u64,
    /// Sizes of allocations in bytes (counts in 1/COUNT_SCALE units).
    pub sizes: Log2Histogram,
    /// Lifetimes of freed allocations in ns (counts in 1/COUNT_SCALE units).
    pub lifetimes: Log2Histogram,
    /// How many execs the process made since it was first traced: the entry starts again at
    /// each (see `ProcessEvent::image`), and its stacks' totals are kept under this number.
    pub image: u64,
}

impl ProcHeap {
    pub const EMPTY: ProcHeap = ProcHeap {
        in_use: 0,
        peak: 0,
        peak_ns: 0,
        peak_generation: 0,
        sizes: Log2Histogram { buckets: [0; LOG2_BUCKETS] },
        lifetimes: Log2Histogram { buckets: [0; LOG2_BUCKETS] },
        image: 0,
    };
}

impl Default for ProcHeap {
    fn default() -> Self {
        Self::EMPTY
    }
}

/// A process's drops, by `DropReason`, in `PROC_DROPS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcDrops {
    pub counts: [u64; DropReason::COUNT],
}

impl Default for ProcDrops {
    fn default() -> Self {
        Self { counts: [0; DropReason::COUNT] }
    }
}

/// Power-of-two buckets: bucket `i` counts values in `(2^(i-1), 2^i]`, bucket 0 values 0 and 1.
pub const LOG2_BUCKETS: usize = 64;

/// Per-process histogram filled in the kernel: of allocation sizes in bytes, of lifetimes in ns.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Log2Histogram {
    pub buckets: [u64; LOG2_BUCKETS],
}

impl Default for Log2Histogram {
    fn default() -> Self {
        Self { buckets: [0; LOG2_BUCKETS] }
    }
}

/// The bucket of `value`: the smallest `i` with `value <= 2^i`.
pub fn log2_bucket(value: u64) -> usize {
    if value <= 1 {
        return 0;
    }
    // Binary search for the highest set bit of value - 1 (BPF has no count-leading-zeros).
    let mut v = value - 1;
    let mut bits = 0;
    let mut step = 32;
    while step > 0 {
        if v >> step != 0 {
            v >>= step;
            bits += step;
        }
        step >>= 1;
    }
    bits + 1
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

/// Objects a `LinkMapEvent` holds at most, and the bytes of each one's path.
pub const LINK_MAP_OBJECTS: usize = 48;
pub const LINK_MAP_NAME_BYTES: usize = 248;

/// One object the dynamic linker has loaded: its load bias (`l_addr`) and path (`l_name`,
/// empty for the executable).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct LoadedObject {
    pub base: u64,
    pub name: [u8; LINK_MAP_NAME_BYTES],
}

/// The dynamic linker's list of loaded objects (`r_debug.r_map`), read in the process when the
/// linker reports a consistent state (`_dl_debug_state`, `RT_CONSISTENT`): with the files' program
/// headers it gives the process's mappings even after the process is gone, as a debugger learns
/// them. Sent through `UNWIND_EVENTS`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct LinkMapEvent {
    pub tgid: u32,
    /// Objects read, up to `LINK_MAP_OBJECTS`.
    pub count: u32,
    /// `bpf_ktime_get_ns` when it was read: a list sent before the process's latest exec is its
    /// old program's.
    pub time_ns: u64,
    pub objects: [LoadedObject; LINK_MAP_OBJECTS],
}

/// Which stack table a deferred walk's stack is stored in.
pub mod stack_table {
    pub const ALLOCATIONS: u32 = 0;
    pub const FREES: u32 = 1;
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
    /// 1 when a cut in the walk counts in its process's drops (the heap's stacks), 0 for a
    /// mapping's stack, which says it was cut itself.
    pub counts_cuts: u32,
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

/// How the canonical frame address (CFA: the stack pointer before the call) of a row is found.
pub mod cfa {
    /// No unwind info covers the address: the stack ends, truncated.
    pub const NONE: u8 = 0;
    /// CFA = rsp + offset.
    pub const RSP: u8 = 1;
    /// CFA = rbp + offset.
    pub const RBP: u8 = 2;
    /// A PLT entry: CFA = rsp + 8, plus 8 when `(address & 15) >= offset` (the expression GNU ld
    /// emits for `.plt`).
    pub const PLT: u8 = 3;
    /// The return address is undefined: the outermost frame of a thread (`_start`, `clone3`).
    pub const END: u8 = 4;
    /// A signal trampoline (`__restore_rt`): the interrupted registers are in the `ucontext_t`
    /// at rsp.
    pub const SIGNAL: u8 = 5;
    /// An expression or register rule memprof does not follow: the stack ends, truncated.
    pub const UNSUPPORTED: u8 = 6;
    /// CFA = the u64 at rbp + offset: a function that realigns its stack keeps the CFA in a
    /// register (the DRAP) and, past its prologue, in its frame below rbp
    /// (`DW_OP_breg6 offset; DW_OP_deref`).
    pub const RBP_DEREF: u8 = 7;
}

/// Where the caller's rbp is after a row's frame is popped.
pub mod rbp {
    /// rbp was not changed by this frame (or is restored as it was).
    pub const SAME: u8 = 0;
    /// Saved at CFA + offset.
    pub const SAVED: u8 = 1;
    /// Not recoverable: a later frame that needs rbp ends the stack.
    pub const LOST: u8 = 2;
    /// Saved at rbp + offset (`DW_OP_breg6 offset`), where a function that realigns its stack
    /// pushes it.
    pub const AT_RBP: u8 = 3;
}

/// One row of a file's unwind table: from `pc` (an ELF virtual address) up to the next row's
/// `pc`, how to find the caller's frame. x86_64: the return address is always at CFA - 8.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct UnwindRow {
    pub pc: u32,
    pub cfa_offset: i32,
    pub rbp_offset: i16,
    /// A `cfa::` constant.
    pub cfa: u8,
    /// An `rbp::` constant.
    pub rbp: u8,
}

/// The frame-pointer rules: CFA = rbp + 16, the caller's rbp saved at CFA - 16. At a function's
/// first instruction (an entry probe) nothing is pushed yet: CFA = rsp + 8.
pub const FRAME_POINTER_ROW: UnwindRow =
    UnwindRow { pc: 0, cfa_offset: 16, rbp_offset: -16, cfa: cfa::RBP, rbp: rbp::SAVED };
pub const ENTRY_ROW: UnwindRow = UnwindRow { pc: 0, cfa_offset: 8, rbp_offset: 0, cfa: cfa::RSP, rbp: rbp::SAME };

/// Offsets in the `ucontext_t` a signal trampoline's rsp points at: `uc_mcontext` starts at 40,
/// and its `gregs` are indexed by REG_RBP = 10, REG_RSP = 15, REG_RIP = 16.
pub const UC_RBP: u64 = 40 + 10 * 8;
pub const UC_RSP: u64 = 40 + 15 * 8;
pub const UC_RIP: u64 = 40 + 16 * 8;

/// Unwind rows live in shards of `UNWIND_SHARD_ROWS` rows (the arrays of `UNWIND_SHARDS`), which
/// the daemon creates only when tables need them: row `n` of the rows' index space is row
/// `n % UNWIND_SHARD_ROWS` of shard `n / UNWIND_SHARD_ROWS`, and a file's table may span shards.
/// 2^16 rows take 1 MiB of kernel memory (the kernel rounds a row up to 16 bytes): little waste
/// in a shard partly used, and few shards for a large table.
pub const UNWIND_SHARD_BITS: u32 = 16;
pub const UNWIND_SHARD_ROWS: u32 = 1 << UNWIND_SHARD_BITS;

/// How a mapping's frames are unwound.
pub mod mapping_kind {
    /// With the rows `first_row..first_row + rows` of the rows' index space (`UNWIND_SHARDS`).
    pub const CFI: u32 = 0;
    /// With frame pointers: the file has no `.eh_frame` (or memprof was asked to).
    pub const FRAME_POINTERS: u32 = 1;
}

/// An executable file mapping of a traced process, for the stack walk.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ExecMapping {
    pub start: u64,
    pub end: u64,
    /// Address minus `bias` is the ELF virtual address the rows are keyed by.
    pub bias: u64,
    pub first_row: u32,
    pub rows: u32,
    /// A `mapping_kind::` constant.
    pub kind: u32,
    pub _pad: u32,
}

/// Executable mappings of one process kept for the walk; more are not unwound (and counted).
pub const MAX_MAPPINGS: usize = 256;

/// A process's executable mappings, sorted by `start`, in `PROC_MAPPINGS`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ProcMappings {
    pub len: u32,
    pub _pad: u32,
    /// The process's count of code changes (`CODE_CHANGES` in the BPF crate) read before its
    /// mappings were: while the count has not moved since, a frame outside the list is in no file
    /// the process maps, and no later list would let a deferred walk go on.
    pub code_changes_seen: u64,
    pub entries: [ExecMapping; MAX_MAPPINGS],
}

/// Sent through `PROCESS_EVENTS` when a traced process execs or forks (rare: an event stream).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessEvent {
    /// A `process_event::` constant.
    pub kind: u32,
    /// The traced process.
    pub tgid: u32,
    /// The task the event names besides the process, by its kernel pid (a thread's id): for a
    /// fork, the new process (its main thread, whose pid is its tgid); for an exec, the thread
    /// that called it, by its id before the exec (`tgid` unless another of its threads exec'd).
    pub pid: u32,
    /// For an exec, the new program's number (`ProcHeap::image`): what the process's maps hold
    /// under a smaller one, or allocated before `time_ns`, is the old program's.
    pub image: u32,
    /// `bpf_ktime_get_ns` at the event.
    pub time_ns: u64,
    /// For an exec, the path the new program was run by, as given to `execve` (relative to the
    /// process's directory, cut at `EXEC_PATH_BYTES`), NUL-terminated: its name when it is gone
    /// before memprof reads `/proc` (a program that runs for a millisecond).
    pub path: [u8; EXEC_PATH_BYTES],
}

impl ProcessEvent {
    /// Whether a thread other than the main one exec'd: the kernel's pid-filtered probes follow
    /// the main thread's task, which the exec ended, so the process's probes no longer fire.
    pub fn exec_by_other_thread(&self) -> bool {
        self.kind == process_event::EXEC && self.pid != self.tgid
    }
}

/// Room for `ProcessEvent::path`.
pub const EXEC_PATH_BYTES: usize = 256;

/// What a `ProcessEvent` reports.
pub mod process_event {
    /// The process replaced its program (`execve`): its pid stays, its memory is new.
    pub const EXEC: u32 = 0;
    /// The process made a new process (`fork`, `vfork`, `clone` without `CLONE_THREAD`).
    pub const FORK: u32 = 1;
    /// The process's main thread exited: the process is gone, or is a moment later, unless its
    /// other threads run on (the main thread called `pthread_exit`).
    pub const EXIT: u32 = 2;
}

/// Which execs and forks of processes not traced are reported too (`DISCOVER`), for the daemon
/// to find the processes its rules match as they start.
pub mod discover {
    /// Every exec on the host: a program's command name is set at its exec.
    pub const EXECS: u32 = 1;
    /// Every new process on the host: a process starts in its parent's cgroup.
    pub const FORKS: u32 = 2;
}

/// A change to a traced process's anonymous private memory outside the heap's blocks, sent
/// through `MAPPING_EVENTS` at the return of `mmap`, `munmap`, `mremap`, `brk` or `madvise`
/// (calls rare next to malloc's: an event stream), and, for a process traced by its page faults
/// (`--growth`), at the first touch of each page. Addresses and lengths are as the call gave
/// them; the daemon rounds them to pages, as the kernel does.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MappingEvent {
    pub tgid: u32,
    /// A `mapping_event::` constant.
    pub kind: u32,
    /// The address of the process's `mm_struct`, only compared: an exec gives the process a new
    /// memory, whose mappings start from none.
    pub mm: u64,
    /// `MAP`, `UNMAP`: the range's start; `REMAP`: the old range's.
    pub addr: u64,
    /// `MAP`, `UNMAP`: the range's length; `REMAP`: the old range's.
    pub len: u64,
    /// `REMAP`: the new range's start; `BRK`: the new break.
    pub new_addr: u64,
    /// `REMAP`: the new range's length.
    pub new_len: u64,
    /// The caller's stack in `STACKS` (`NO_STACK` for `UNMAP`).
    pub stack_id: u64,
    /// `mapping_event::IN_ALLOCATOR`, `mapping_event::KEEP_OLD`.
    pub flags: u32,
    pub _pad: u32,
    /// `FAULT`: when the page was touched (the kernel's monotonic clock).
    pub time_ns: u64,
}

/// What a `MappingEvent` reports, and its flags.
pub mod mapping_event {
    /// An anonymous private mapping was made (over whatever was there, for `MAP_FIXED`).
    pub const MAP: u32 = 0;
    /// A range stopped being anonymous private memory: `munmap`, or a `MAP_FIXED` mapping of
    /// another kind over it.
    pub const UNMAP: u32 = 1;
    /// `mremap` moved or resized a range.
    pub const REMAP: u32 = 2;
    /// `brk` returned: the program break after it.
    pub const BRK: u32 = 3;
    /// A page of `addr` was touched and the kernel gave it memory: `stack_id` touched it.
    pub const FAULT: u32 = 4;
    /// `madvise` took back the memory of a range (`MADV_DONTNEED`, `MADV_FREE`, `MADV_REMOVE`):
    /// it stays mapped, and its pages' next touch gives them memory again.
    pub const RELEASE: u32 = 5;
    /// Made inside a probed allocator call (glibc's malloc maps large blocks and grows its heap
    /// with `brk`): memory the heap's blocks already count.
    pub const IN_ALLOCATOR: u32 = 1;
    /// `MREMAP_DONTUNMAP`: the old range stays mapped.
    pub const KEEP_OLD: u32 = 2;
}

/// Flags of a traced process in `TRACED`.
pub mod traced {
    /// Its calls are recorded by the links shared per file (`SHARED_LINK`), not by links of its
    /// own. Set before its first link is attached and kept while it is traced, so that exactly
    /// one of the two kinds of links records each call.
    pub const SHARED: u32 = 2;
    /// Traced by the pages it touches (`--growth`, or switched above `--max-rate`): only such a
    /// process's `madvise` releases are sent, as only its pages need them. Kept across its
    /// entry's rewrites while it is traced.
    pub const GROWTH: u32 = 4;
}

const _: () = {
    assert!(core::mem::size_of::<Inflight>() == 128);
    assert!(core::mem::size_of::<FreeNote>() == 32);
    assert!(core::mem::size_of::<AddrKey>() == 16);
    assert!(core::mem::size_of::<LiveAlloc>() == 32);
    assert!(core::mem::size_of::<FreeSite>() == 32);
    assert!(core::mem::size_of::<FreedAlloc>() == 64);
    assert!(core::mem::size_of::<RecentFree>() == 80);
    assert!(core::mem::size_of::<DoubleFreeEvent>() == 112);
    assert!(core::mem::size_of::<StackKey>() == 16);
    assert!(core::mem::size_of::<Stack>() == 16 + 8 * MAX_FRAMES);
    assert!(core::mem::size_of::<UnwindRow>() == 12);
    assert!(core::mem::size_of::<ExecMapping>() == 40);
    assert!(core::mem::size_of::<ProcMappings>() == 16 + 40 * MAX_MAPPINGS);
    assert!(core::mem::size_of::<StackStats>() == 80 + 16 * GENERATIONS);
    assert!(core::mem::size_of::<ThreadPairKey>() == 16);
    assert!(core::mem::size_of::<ThreadPairStats>() == 16);
    assert!(core::mem::size_of::<ProcCounters>() == 32);
    assert!(core::mem::size_of::<SampleRate>() == 16);
    assert!(core::mem::size_of::<usdt::ProbeSpec>() == 24 * usdt::ARGS);
    assert!(core::mem::size_of::<ProcDrops>() == 8 * DropReason::COUNT);
    assert!(core::mem::size_of::<Log2Histogram>() == 8 * LOG2_BUCKETS);
    assert!(core::mem::size_of::<ProcHeap>() == 40 + 16 * LOG2_BUCKETS);
    assert!(core::mem::size_of::<ProcessEvent>() == 24 + EXEC_PATH_BYTES);
    assert!(core::mem::size_of::<MappingEvent>() == 72);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_c_library_free_cookie_spans_its_executable_segment() {
        let cookie = c_library_free_cookie(0x100, 0x2000).unwrap();
        let probe = 0x7f00_0000_1100;
        assert!(called_by_c_library(cookie, probe, 0x7f00_0000_1000), "the segment's first byte");
        assert!(called_by_c_library(cookie, probe, 0x7f00_0000_30ff), "its last");
        assert!(!called_by_c_library(cookie, probe, 0x7f00_0000_0fff));
        assert!(!called_by_c_library(cookie, probe, 0x7f00_0000_3100));
        assert!(!called_by_c_library(cookie | SHARED_LINK, probe, 0x5555_0000_1000), "the program");
        assert!(!called_by_c_library(FREE_WRAPPER, probe, probe), "not the C library's free");
        assert_eq!(cookie & (FREE_WRAPPER | SHARED_LINK), 0);
        assert_eq!(c_library_free_cookie(1 << 30, 0), None, "too far to say");
    }

    #[test]
    fn each_function_reads_its_own_arguments() {
        let read = |func: AllocFn| func.arguments().read().collect::<Vec<_>>();
        assert_eq!(read(AllocFn::Malloc), [0]);
        assert_eq!(read(AllocFn::Calloc), [1, 0], "size, then count");
        assert_eq!(read(AllocFn::Reallocarray), [2, 1, 0]);
        assert_eq!(read(AllocFn::PosixMemalign), [2, 0], "size, then the out-pointer");
        assert_eq!(read(AllocFn::Memalign), [1]);
        assert_eq!(read(AllocFn::RustRealloc), [3, 0], "new size, then the old block");
    }

    #[test]
    fn sampled_weights_are_inverse_odds() {
        assert_eq!(weight(0, 100), (COUNT_SCALE, 100));
        assert_eq!(weight(4096, 8192), (COUNT_SCALE, 8192), "larger than the mean: always recorded");
        assert_eq!(weight(4096, 64), (COUNT_SCALE * 64, 4096), "1 in 64: stands for 64 allocations");
        assert_eq!(weight(4096, 0), (COUNT_SCALE * 4096, 0));
        assert!(sampled(4096, 64, 0) && !sampled(4096, 64, u32::MAX));
        // The odds: draws below 2^32 / 64.
        assert!(sampled(4096, 64, (1 << 26) - 1) && !sampled(4096, 64, 1 << 26));
    }

    #[test]
    fn a_rate_slot_says_who_samples_or_sends_to_the_hash() {
        let (a, b, c) = (5, 5 + RATE_SLOTS, 5 + 2 * RATE_SLOTS);
        assert_eq!(rate_slot(a), rate_slot(b));
        let mut slot = SampleRate::default();
        assert_eq!(slot.of(a), Some(0), "an empty slot: nobody samples");
        slot.claim(a, 4096, false);
        assert_eq!((slot.of(a), slot.of(b)), (Some(4096), Some(0)));
        // b collides: it is in the hash alone, and every other tgid of the slot must look there.
        slot.claim(b, 8192, false);
        slot.claim(b, 8192, true);
        assert_eq!((slot.of(a), slot.of(b), slot.of(c)), (Some(4096), None, None));
        // a leaves: the slot stays empty while b, in the hash, still counts, even when b's rate
        // is set again.
        slot.release(a);
        slot.claim(b, 8192, true);
        assert_eq!((slot.of(a), slot.of(b), slot.collided), (None, None, 1));
        slot.release(b);
        assert_eq!((slot.of(b), slot.of(c)), (Some(0), Some(0)));
        // The next to sample takes the free slot.
        slot.claim(c, 512, false);
        assert_eq!((slot.of(c), slot.of(a)), (Some(512), Some(0)));
    }

    #[test]
    fn sizes_fall_in_power_of_two_buckets() {
        let cases = [(0, 0), (1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4), (4096, 12), (4097, 13)];
        for (size, bucket) in cases {
            assert_eq!(log2_bucket(size), bucket, "size {size}");
        }
        assert_eq!(log2_bucket(u64::MAX), 64);
    }
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: all of these are repr(C), padding-free (asserted above) and valid for any bit pattern.
    unsafe impl aya::Pod for AddrKey {}
    unsafe impl aya::Pod for LiveAlloc {}
    unsafe impl aya::Pod for StackKey {}
    unsafe impl aya::Pod for StackStats {}
    unsafe impl aya::Pod for ProcCounters {}
    unsafe impl aya::Pod for SampleRate {}
    unsafe impl aya::Pod for ProcDrops {}
    unsafe impl aya::Pod for Log2Histogram {}
    unsafe impl aya::Pod for ProcHeap {}
    unsafe impl aya::Pod for ThreadPairKey {}
    unsafe impl aya::Pod for ThreadPairStats {}
    unsafe impl aya::Pod for FreedAlloc {}
    unsafe impl aya::Pod for RecentFree {}
    unsafe impl aya::Pod for Inflight {}
    unsafe impl aya::Pod for Stack {}
    unsafe impl aya::Pod for UnwindRow {}
    unsafe impl aya::Pod for ProcMappings {}
    unsafe impl aya::Pod for ProcessEvent {}
    unsafe impl aya::Pod for DoubleFreeEvent {}
    unsafe impl aya::Pod for MappingEvent {}
    unsafe impl aya::Pod for usdt::ProbeSpec {}
}
