//! Totals the programs keep: per stack, per pair of threads and per process.

use crate::generations::GENERATIONS;

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
    /// `NO_STACK`, or the id this stack's allocations are counted under: the early id of a walk
    /// the kernel deferred, which memprof found to be this stack. memprof writes such an entry,
    /// empty, before the kernel can walk the stack whole, so that one entry holds all its counts
    /// and its high (docs: guide/peaks.md).
    pub counted_as: u64,
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
        counted_as: crate::NO_STACK,
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
    /// The allocations and frees those samples stand for in `STACK_STATS` (in 1/`COUNT_SCALE`
    /// units): the rest of its counts are the calls its allocator probes saw.
    pub usdt_counts: u64,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_fall_in_power_of_two_buckets() {
        let cases = [(0, 0), (1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4), (4096, 12), (4097, 13)];
        for (size, bucket) in cases {
            assert_eq!(log2_bucket(size), bucket, "size {size}");
        }
        assert_eq!(log2_bucket(u64::MAX), 64);
    }
}
