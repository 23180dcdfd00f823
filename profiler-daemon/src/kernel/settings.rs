//! What is fixed when the programs are loaded: map capacities and how stacks are walked. Set from
//! the command line (`attach`, `run`) or the daemon's configuration.

use clap::Args;

use crate::unwind::UnwindMode;

/// Map capacities and stack-walk settings, fixed when the programs are loaded.
#[derive(Debug, Args, Clone, Copy, PartialEq, Eq)]
pub struct LoadSettings {
    /// Outstanding allocations tracked at once; more are counted as `live_map_full`.
    #[arg(long, default_value_t = DEFAULT_LOAD.max_live, allow_negative_numbers = true, value_parser = crate::cli::whole("entries", 1, MAX_MAP_ENTRIES))]
    pub max_live: u32,
    /// Distinct call stacks kept; more are counted as `stack_table_full`.
    #[arg(long, default_value_t = DEFAULT_LOAD.max_stacks, allow_negative_numbers = true, value_parser = crate::cli::whole("stacks", 1, MAX_MAP_ENTRIES))]
    pub max_stacks: u32,
    /// How stacks are walked: `cfi` reads each file's .eh_frame (right without frame pointers),
    /// `fp` follows frame pointers only.
    #[arg(long, value_enum, default_value_t = DEFAULT_LOAD.unwind)]
    pub unwind: UnwindMode,
    /// Frames kept per stack; a deeper stack is cut and marked truncated.
    #[arg(long, default_value_t = DEFAULT_LOAD.max_frames, allow_negative_numbers = true, value_parser = crate::cli::whole("frames", 1, profiler_common::MAX_FRAMES as u32))]
    pub max_frames: u32,
    /// Most rows of unwind tables kept in the kernel, all files together (16 bytes each): an upper
    /// bound, as rows are held in 1 MiB shards created when tables need them.
    #[arg(long, default_value_t = DEFAULT_LOAD.max_unwind_rows, allow_negative_numbers = true, value_parser = crate::cli::whole("rows", 1, u32::MAX))]
    pub max_unwind_rows: u32,
    /// Also trace anonymous mmap, munmap, mremap and brk with their stacks (memory outside
    /// malloc). Off by default: these calls, by any process on the host, then run a program at
    /// their return; on a kernel that refuses fexit programs, every system call on the host does
    /// (docs: guide/mappings.md#memory-outside-malloc-mappings).
    #[arg(long)]
    pub mappings: bool,
    /// Walk the stack of every free, so that a double free's first free shows its whole stack.
    /// Without it a free keeps only its caller (the function that called free), and only the
    /// second free of a double free is walked: cheaper at every free.
    #[arg(long)]
    pub full_free_stacks: bool,
}

/// The most entries a BPF hash table takes: the kernel rounds them up to a power of two buckets,
/// and refuses more than fit in 4 GiB of 16-byte buckets (`E2BIG`, "Argument list too long").
pub const MAX_MAP_ENTRIES: u32 = 1 << 27;

pub const DEFAULT_LOAD: LoadSettings = LoadSettings {
    max_live: 1 << 20,
    max_stacks: 1 << 16,
    unwind: UnwindMode::Cfi,
    max_frames: profiler_common::MAX_FRAMES as u32,
    // 256 MiB at most: room for the largest programs measured (gdb, postgres with its JIT, a
    // large C++ library; docs: performance.md#measurements-behind-design-choices),
    // none of it taken before it is needed.
    max_unwind_rows: 1 << 24,
    mappings: false,
    full_free_stacks: false,
};
