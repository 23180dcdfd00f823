//! The allocating entry points memprof probes, and where their arguments are.

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
