//! The unwind tables the kernel's stack walk reads, and each process's executable mappings.

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
