//! What a probe's cookie tells its program, and which links record a traced process.

use crate::completion::RegisterNumber;

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

/// The arguments a probe may find moved (see `MovedArguments`): 0 to 3, every one a program reads.
pub const MOVABLE_ARGUMENTS: usize = 4;

/// The registers that hold arguments 0 to 3 at a probe placed past instructions that copied them
/// to other registers and then wrote their own (mimalloc's functions pass their arguments on to
/// the call they end in); `None` for one still in its own register.
pub type MovedArguments = [Option<RegisterNumber>; MOVABLE_ARGUMENTS];

/// Where a probe's cookie keeps its `MovedArguments`: 5 bits an argument, 0 for one in its own
/// register, else its register's number plus one. Above an allocation probe's completion
/// (`completion`) and below `SHARED_LINK`; a free probe with moved arguments is not the C
/// library's (`c_library_free_cookie`, which takes those bits, places none).
const MOVED_SHIFT: u32 = 41;
const MOVED_BITS: u32 = 5;

/// The cookie bits saying where `moved` arguments are.
pub fn moved_arguments_cookie(moved: &MovedArguments) -> u64 {
    let mut bits = 0;
    for (argument, register) in moved.iter().enumerate() {
        if let Some(register) = register {
            bits |= u64::from((register & 0xf) + 1) << (MOVED_SHIFT + MOVED_BITS * argument as u32);
        }
    }
    bits
}

/// The register that holds argument `argument` at the probe whose cookie is `cookie`, where it is
/// not in its own.
pub fn moved_argument(cookie: u64, argument: usize) -> Option<RegisterNumber> {
    let field = (cookie >> (MOVED_SHIFT + MOVED_BITS * argument as u32)) & ((1 << MOVED_BITS) - 1);
    field.checked_sub(1).map(|register| register as RegisterNumber)
}

/// The register that holds the block at the free probe whose cookie is `cookie`, where it is not
/// in rdi: never at the C library's, whose cookie holds the span of its code in those bits.
pub fn moved_block(cookie: u64) -> Option<RegisterNumber> {
    match cookie & FREE_IN_C_LIBRARY {
        0 => moved_argument(cookie, 0),
        _ => None,
    }
}

/// Set in the cookie of every probe of a link shared by every process that maps a file (pid 0):
/// its programs record only the processes whose `TRACED` entry has `traced::SHARED`. The other
/// bits are the probe's own cookie.
pub const SHARED_LINK: u64 = 1 << 63;

/// Where a perf-event uprobe's return probe keeps, in its cookie, the process it was opened
/// for (0: none, a link the kernel filters by itself). Linux 6.1 runs a perf-event uretprobe's
/// program without the event's process filter, in every process where another consumer of the
/// same probe asked for the return: the return program of each traced process would fire at
/// every other's returns (a `--follow-forks` child, the daemon's targets of one program).
pub const RETURN_OWNER_SHIFT: u32 = 32;

/// `cookie` (a return probe's) with `tgid` as its owner (see `RETURN_OWNER_SHIFT`).
pub fn with_return_owner(cookie: u64, tgid: u32) -> u64 {
    cookie | u64::from(tgid) << RETURN_OWNER_SHIFT
}

/// The process a return probe with `cookie` was opened for; 0 for any.
pub fn return_owner(cookie: u64) -> u32 {
    ((cookie & !SHARED_LINK) >> RETURN_OWNER_SHIFT) as u32
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
    /// Its allocator probes are being attached: a return probe may be in place before the entry
    /// probe of its function, and a call that entered before the entry probe returns without its
    /// entry recorded. Such a call began before tracing did, as a block allocated before it:
    /// no drop. Kept across its entry's rewrites until its probes are attached.
    pub const ATTACHING: u32 = 8;
    /// Its mapping calls are read by probes of its own (`mapping_call_return`): the program at
    /// every system call, attached for another process, skips it, so that no call is read twice.
    /// Kept across its entry's rewrites while it is traced.
    pub const OWN_MAPPING_CALLS: u32 = 16;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_return_probes_owner_is_kept_beside_its_function_and_the_shared_bit() {
        let cookie = with_return_owner(7, 4_194_304);
        assert_eq!(return_owner(cookie), 4_194_304);
        assert_eq!(return_owner(cookie | SHARED_LINK), 4_194_304);
        assert_eq!(cookie & 0xffff_ffff, 7);
        assert_eq!(return_owner(7 | SHARED_LINK), 0);
    }

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
    fn moved_arguments_ride_above_a_completion_and_below_the_shared_bit() {
        use crate::completion::{Completion, RAX, RSI};
        let moved = [Some(RSI), None, Some(RAX), Some(15)];
        let completion = Completion { condition: 5, result: 2 };
        let cookie = completion.cookie(3) | moved_arguments_cookie(&moved);
        assert_eq!(core::array::from_fn(|n| moved_argument(cookie, n)), moved);
        assert_eq!(Completion::of(cookie), Some(completion));
        assert_eq!(cookie as u32, 3);
        assert_eq!(cookie & SHARED_LINK, 0);
        assert_eq!(moved_arguments_cookie(&[None; MOVABLE_ARGUMENTS]), 0);
        assert_eq!(moved_argument(FREE_WRAPPER, 0), None);
        let c_library = c_library_free_cookie(0x100, 0x3fff_ffff).unwrap();
        assert_eq!(moved_block(c_library), None, "its bits are the span of its code");
        assert_eq!(moved_block(FREE_WRAPPER | moved_arguments_cookie(&moved)), Some(RSI));
    }
}
