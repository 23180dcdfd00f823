//! Walks remembered by where they started, so that a stack the same call site reaches again from
//! the same depth costs one copy of the user stack instead of a walk.
//!
//! A walk is a function of its registers, the unwind rows (one `MAPPINGS_GENERATION`) and the
//! words it read from the stack and used (a saved rbp is noted only once a frame uses it:
//! `Walk::bp`). A memo keeps all of them with the stack's id; a later walk that starts with the
//! same registers, under the same generation, finds every word still the same, would read the
//! same words and step the same frames, so it would end with the same stack. One copy of the
//! stack then checks the words. A loop that allocates from one place, or a server's
//! event loop, walks once per place and depth, not once per call.
//!
//! Memos are per CPU, one per slot of their start's hash, used only by the walk that holds the
//! CPU's scratch (see `unwind::stack_id`). `remember` sets a slot's `whole` flag last: a memo is
//! used whole or not at all.

use aya_ebpf::{cty::c_void, macros::map, maps::PerCpuArray};
use profiler_common::NO_STACK;

use crate::unwind::WINDOW_WORDS;

const WINDOW_BYTES: u64 = (WINDOW_WORDS * 8) as u64;

/// Words a remembered walk may have used: one a frame, two where a frame uses a saved rbp, so
/// sixteen to thirty-two frames. A power of two: see `nth`. Each word adds to the time the
/// verifier takes at load (docs: reference/limits.md#kernel-memory).
pub const MEMO_WORDS: usize = 32;

/// `value` as a number LLVM knows nothing about (the verifier still does: a read of the stack).
#[inline(always)]
fn opaque(value: usize) -> usize {
    // SAFETY: a read of a local.
    unsafe { core::ptr::read_volatile(&value) }
}

/// `index` as an array index LLVM cannot see through: a loop's counter is otherwise turned into a
/// moving pointer, whose bound 6.1's verifier loses.
#[inline(always)]
fn nth(index: usize) -> usize {
    opaque(index) & (MEMO_WORDS - 1)
}

/// The words a walk read, in order; `count` past `MEMO_WORDS` when it read more.
#[repr(C)]
pub struct Reads {
    pub count: u32,
    _pad: u32,
    pub addresses: [u64; MEMO_WORDS],
    pub values: [u64; MEMO_WORDS],
}

impl Reads {
    pub fn clear(&mut self) {
        self.count = 0;
    }

    /// Notes the word read at `address`.
    #[inline(always)]
    pub fn note(&mut self, address: u64, value: u64) {
        let index = self.count as usize;
        if let (Some(at), Some(held)) = (self.addresses.get_mut(index), self.values.get_mut(index)) {
            (*at, *held) = (address, value);
        }
        self.count = self.count.saturating_add(1);
    }
}

/// Where a walk started: the registers it depends on, and the rows' generation.
#[repr(C)]
pub struct Start {
    pub tgid: u32,
    pub generation: u32,
    pub pc: u64,
    pub sp: u64,
    pub bp: u64,
}

#[repr(C)]
struct Memo {
    pc: u64,
    sp: u64,
    /// Only compared when the walk used the register's value (`uses_bp`): code built without
    /// frame pointers keeps anything in rbp.
    bp: u64,
    tgid: u32,
    generation: u32,
    uses_bp: u32,
    count: u32,
    /// The lowest word read, and the bytes from it past the highest.
    low: u64,
    len: u64,
    stack_id: u64,
    /// Each word read, as its index from `low`.
    offsets: [u16; MEMO_WORDS],
    values: [u64; MEMO_WORDS],
    /// 1 once `remember` wrote all of the above; 0 for an empty slot, or one it gave up on.
    whole: u64,
}

const MEMO_SLOTS: u32 = 128;

#[map]
static MEMOS: PerCpuArray<Memo> = PerCpuArray::with_max_entries(MEMO_SLOTS, 0);

fn slot(start: &Start) -> Option<&'static mut Memo> {
    let mixed = (start.pc ^ start.sp.rotate_left(23) ^ (start.tgid as u64) << 40).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let index = (mixed >> 57) as u32 % MEMO_SLOTS;
    // SAFETY: this CPU's slot, which only the walk that holds its scratch uses.
    MEMOS.get_ptr_mut(index).map(|memo| unsafe { &mut *memo })
}

/// The stack id remembered for a walk from `start`, if every word it read is still the same;
/// `window` receives the copy it is checked against. `NO_STACK` otherwise.
#[inline(never)]
pub fn recall(start: &Start, window: &mut [u64; WINDOW_WORDS]) -> u64 {
    let Some(memo) = slot(start) else { return NO_STACK };
    if memo.whole == 0
        || memo.pc != start.pc
        || memo.sp != start.sp
        || memo.tgid != start.tgid
        || memo.generation != start.generation
        || (memo.uses_bp != 0 && memo.bp != start.bp)
    {
        return NO_STACK;
    }
    // `remember` keeps no longer copy. A bound the verifier sees on the register passed (6.1's
    // loses one tested on a copy).
    let len = memo.len.min(WINDOW_BYTES);
    // SAFETY: the window holds `WINDOW_BYTES`; the helper reads user memory, faulting safely.
    let copied = unsafe {
        aya_ebpf::helpers::generated::bpf_probe_read_user(
            window.as_mut_ptr().cast::<c_void>(),
            len as u32,
            memo.low as *const c_void,
        )
    };
    if copied != 0 {
        return NO_STACK;
    }
    for index in 0..MEMO_WORDS {
        if index >= memo.count as usize {
            break;
        }
        let (Some(&offset), Some(&value)) = (memo.offsets.get(nth(index)), memo.values.get(nth(index))) else {
            return NO_STACK;
        };
        if window.get(offset as usize & (WINDOW_WORDS - 1)).copied() != Some(value) {
            return NO_STACK;
        }
    }
    memo.stack_id
}

/// Remembers that the walk from `start`, which used rbp's value if `uses_bp`, read `reads` and
/// stored `stack_id`; nothing when it read too many words, or words one copy cannot check.
#[inline(never)]
pub fn remember(start: &Start, uses_bp: u32, reads: &Reads, stack_id: u64) {
    let count = reads.count as usize;
    if count == 0 || count > MEMO_WORDS {
        return;
    }
    // Else LLVM bounds the loops below by `count` alone, which 6.1's verifier then cannot see end.
    let count = opaque(count);
    let (mut low, mut high) = (u64::MAX, 0);
    for index in 0..MEMO_WORDS {
        if index >= count {
            break;
        }
        let Some(&address) = reads.addresses.get(nth(index)) else { return };
        (low, high) = (low.min(address), high.max(address));
    }
    let len = high.wrapping_sub(low).wrapping_add(8);
    if len > WINDOW_BYTES {
        return;
    }
    let Some(memo) = slot(start) else { return };
    // Emptied first: a `remember` that gives up below leaves no memo.
    memo.whole = 0;
    (memo.pc, memo.sp, memo.bp) = (start.pc, start.sp, start.bp);
    (memo.tgid, memo.generation, memo.uses_bp, memo.count) = (start.tgid, start.generation, uses_bp, count as u32);
    (memo.low, memo.len, memo.stack_id) = (low, len, stack_id);
    for index in 0..MEMO_WORDS {
        if index >= count {
            break;
        }
        let (Some(&address), Some(&value)) = (reads.addresses.get(nth(index)), reads.values.get(nth(index))) else {
            return;
        };
        let distance = address.wrapping_sub(low);
        if !distance.is_multiple_of(8) {
            // A word the copy would not hold at a word's place: no memo.
            return;
        }
        let offset = (distance / 8) as u16;
        if let (Some(at), Some(held)) = (memo.offsets.get_mut(nth(index)), memo.values.get_mut(nth(index))) {
            (*at, *held) = (offset, value);
        }
    }
    memo.whole = 1;
}
