//! Types shared by the eBPF programs and the daemon.
//!
//! Everything here crosses the kernel/user boundary through BPF maps, so every type is `#[repr(C)]`,
//! has no implicit padding (asserted below) and holds plain integers only.
#![cfg_attr(not(test), no_std)]

/// Which allocator entry point an allocation came from.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocFn {
    Malloc = 0,
    Calloc = 1,
    Realloc = 2,
    Reallocarray = 3,
    PosixMemalign = 4,
    AlignedAlloc = 5,
    Memalign = 6,
    Valloc = 7,
    Pvalloc = 8,
}

impl AllocFn {
    pub const ALL: [AllocFn; 9] = [
        AllocFn::Malloc,
        AllocFn::Calloc,
        AllocFn::Realloc,
        AllocFn::Reallocarray,
        AllocFn::PosixMemalign,
        AllocFn::AlignedAlloc,
        AllocFn::Memalign,
        AllocFn::Valloc,
        AllocFn::Pvalloc,
    ];

    pub fn from_u32(value: u32) -> Option<AllocFn> {
        AllocFn::ALL.get(value as usize).copied()
    }

    /// The C symbol this entry point is exported as.
    pub fn symbol(self) -> &'static str {
        match self {
            AllocFn::Malloc => "malloc",
            AllocFn::Calloc => "calloc",
            AllocFn::Realloc => "realloc",
            AllocFn::Reallocarray => "reallocarray",
            AllocFn::PosixMemalign => "posix_memalign",
            AllocFn::AlignedAlloc => "aligned_alloc",
            AllocFn::Memalign => "memalign",
            AllocFn::Valloc => "valloc",
            AllocFn::Pvalloc => "pvalloc",
        }
    }
}

/// Why an event could not be recorded. Indexes the per-CPU `DROPS` array.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropReason {
    /// `LIVE` was full: the allocation is neither tracked nor counted.
    LiveMapFull = 0,
    /// `STACK_STATS` was full: the allocation is tracked but its stack totals are not.
    StatsMapFull = 1,
    /// The user stack could not be walked; the allocation is counted under stack id `NO_STACK`.
    StackWalkFailed = 2,
    /// `STACKS` already held another stack in this hash bucket (or was full); counted under `NO_STACK`.
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
    /// `PROC_COUNTERS` or `SIZE_HIST` was full: a per-process counter could not be bumped.
    ProcessTableFull = 8,
}

impl DropReason {
    pub const COUNT: usize = 9;
    pub const ALL: [DropReason; DropReason::COUNT] = [
        DropReason::LiveMapFull,
        DropReason::StatsMapFull,
        DropReason::StackWalkFailed,
        DropReason::StackCollision,
        DropReason::InflightMapFull,
        DropReason::InflightMissing,
        DropReason::DoubleFreeEventLost,
        DropReason::MissedFree,
        DropReason::ProcessTableFull,
    ];

    /// The snake_case name used in reports and metrics.
    pub fn name(self) -> &'static str {
        match self {
            DropReason::LiveMapFull => "live_map_full",
            DropReason::StatsMapFull => "stats_map_full",
            DropReason::StackWalkFailed => "stack_walk_failed",
            DropReason::StackCollision => "stack_collision",
            DropReason::InflightMapFull => "inflight_map_full",
            DropReason::InflightMissing => "inflight_missing",
            DropReason::DoubleFreeEventLost => "double_free_event_lost",
            DropReason::MissedFree => "missed_free",
            DropReason::ProcessTableFull => "process_table_full",
        }
    }
}

/// Stack id recorded when no stack could be taken. Real ids are below `STACKS`' capacity.
pub const NO_STACK: u32 = u32::MAX;

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
}

/// Key of a live allocation: addresses repeat across processes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AddrKey {
    pub tgid: u32,
    pub _pad: u32,
    pub addr: u64,
}

/// One outstanding allocation.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LiveAlloc {
    pub size: u64,
    /// `bpf_ktime_get_ns` (CLOCK_MONOTONIC) at the allocator's return.
    pub time_ns: u64,
    pub stack_id: u32,
    pub tid: u32,
    /// `AllocFn`.
    pub func: u32,
    pub _pad: u32,
}

/// Where and when a free happened. `caller` is the return address read at free's entry, where a
/// frame-pointer walk misses the function that called free; 0 when the stack is already complete.
/// `stack_id` is in `FREE_STACKS`, not `STACKS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct FreeSite {
    pub time_ns: u64,
    pub caller: u64,
    pub stack_id: u32,
    pub tid: u32,
}

/// A recently freed allocation, kept to recognise a second free of the same address.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FreedAlloc {
    pub alloc: LiveAlloc,
    pub free: FreeSite,
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
    pub stack_id: u32,
}

/// Per-(process, stack) totals, updated atomically by the programs.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackStats {
    pub allocations: u64,
    pub allocated_bytes: u64,
    pub frees: u64,
    pub freed_bytes: u64,
}

/// Per-process counters of events that have no stack.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcCounters {
    /// Frees of addresses never seen allocated since attach.
    pub unknown_frees: u64,
    /// Allocator calls that returned NULL (or an error code).
    pub failed_allocations: u64,
}

/// Power-of-two buckets of allocation sizes: bucket `i` counts sizes in `(2^(i-1), 2^i]`, bucket 0
/// sizes 0 and 1.
pub const SIZE_BUCKETS: usize = 64;

/// Per-process histogram of allocation sizes, filled in the kernel.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SizeHistogram {
    pub buckets: [u64; SIZE_BUCKETS],
}

impl Default for SizeHistogram {
    fn default() -> Self {
        Self { buckets: [0; SIZE_BUCKETS] }
    }
}

/// The bucket of `size`: the smallest `i` with `size <= 2^i`.
pub fn size_bucket(size: u64) -> usize {
    if size <= 1 {
        return 0;
    }
    // Binary search for the highest set bit of size - 1 (BPF has no count-leading-zeros).
    let mut v = size - 1;
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

const _: () = {
    assert!(core::mem::size_of::<Inflight>() == 72);
    assert!(core::mem::size_of::<AddrKey>() == 16);
    assert!(core::mem::size_of::<LiveAlloc>() == 32);
    assert!(core::mem::size_of::<FreeSite>() == 24);
    assert!(core::mem::size_of::<FreedAlloc>() == 56);
    assert!(core::mem::size_of::<DoubleFreeEvent>() == 96);
    assert!(core::mem::size_of::<StackKey>() == 8);
    assert!(core::mem::size_of::<StackStats>() == 32);
    assert!(core::mem::size_of::<ProcCounters>() == 16);
    assert!(core::mem::size_of::<SizeHistogram>() == 8 * SIZE_BUCKETS);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_fall_in_power_of_two_buckets() {
        let cases = [(0, 0), (1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4), (4096, 12), (4097, 13)];
        for (size, bucket) in cases {
            assert_eq!(size_bucket(size), bucket, "size {size}");
        }
        assert_eq!(size_bucket(u64::MAX), 64);
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
    unsafe impl aya::Pod for SizeHistogram {}
    unsafe impl aya::Pod for FreedAlloc {}
    unsafe impl aya::Pod for Inflight {}
}
