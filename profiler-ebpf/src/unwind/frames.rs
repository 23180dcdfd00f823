//! One frame of a walk: its row applied to the registers, the caller's found in the copy of the
//! user stack the walk reads from.

use aya_ebpf::{cty::c_void, helpers::bpf_probe_read_user};
use profiler_common::{cfa, mapping_kind, rbp, stack_hash_step, StackEnd, UC_RBP, UC_RIP, UC_RSP};

use super::{rows::frame_row, taken::taken_return, Scratch, Walk, Window, FRAME_LIMIT, SCRATCH, WINDOW_WORDS};

/// Records frame `index` and steps to its caller. Returns 1 to stop the loop, 0 to go on.
pub(super) extern "C" fn step(index: u64, _context: *mut c_void) -> i64 {
    let Some(scratch) = SCRATCH.get_ptr_mut(0) else { return 1 };
    // SAFETY: this CPU's scratch, which the walk holds (see `stack_id`). No reference into it
    // lives across `frame_row`, whose searches take their own.
    let Some((address, at_entry)) = record(index as usize, unsafe { &mut *scratch }) else { return 1 };
    if !frame_row(scratch, address, at_entry) {
        return 1;
    }
    // SAFETY: as above.
    let scratch = unsafe { &mut *scratch };
    match to_caller(&mut scratch.walk, &mut scratch.window) {
        Some(()) => 0,
        None => 1,
    }
}

/// Keeps frame `index`'s address in the stack, and returns the address whose row unwinds it and
/// whether it is the probed function's entry. None when the walk ends (too deep).
fn record(index: usize, scratch: &mut Scratch) -> Option<(u64, bool)> {
    let (walk, stack) = (&mut scratch.walk, &mut scratch.stack);
    let pc = walk.pc;
    let at_entry = index == 0 && walk.first_is_probed != 0;
    // At an entry probe frame 0 is the allocator itself (free): stacks begin at its caller.
    if !at_entry {
        // Past the limit the walk ends as `TooDeep`, as it began.
        if walk.len >= FRAME_LIMIT.load() {
            return None;
        }
        *stack.frames.get_mut(walk.len as usize)? = pc;
        walk.len += 1;
        walk.hash = stack_hash_step(walk.hash, pc);
        walk.check = (walk.check ^ pc).wrapping_mul(0xff51_afd7_ed55_8ccd).rotate_left(31);
    }
    // A return address follows its call: the call, and the row that covers it, is before it.
    Some((pc - walk.pc_is_return as u64, at_entry))
}

/// Applies the row `frame_row` found to the registers: the caller's frame. None when the walk
/// ends (with `walk.end` saying why).
fn to_caller(walk: &mut Walk, window: &mut Window) -> Option<()> {
    let (row, kind) = (walk.row, walk.row_kind);
    let address = walk.pc - walk.pc_is_return as u64;
    let frame_pointers = kind == mapping_kind::FRAME_POINTERS;
    let sp = walk.sp;
    let cfa = match row.cfa {
        cfa::RSP => sp.wrapping_add(row.cfa_offset as i64 as u64),
        cfa::RBP if walk.bp_known != 0 => walk.bp(&mut window.reads).wrapping_add(row.cfa_offset as i64 as u64),
        cfa::RBP_DEREF if walk.bp_known != 0 => {
            let at = walk.bp(&mut window.reads).wrapping_add(row.cfa_offset as i64 as u64);
            match window.read(at) {
                Some(cfa) => cfa,
                None => return end(walk, StackEnd::ReadFailed),
            }
        }
        cfa::PLT => sp + 8 + if (address & 15) as i32 >= row.cfa_offset { 8 } else { 0 },
        cfa::END => return end(walk, StackEnd::Complete),
        cfa::SIGNAL => {
            // The kernel saved the interrupted registers in the signal frame's ucontext.
            // One read at a time: a tuple of reads leaves the verifier an unwritten register
            // on the path where an early one failed.
            let Some(pc) = window.read(sp + UC_RIP) else { return end(walk, StackEnd::ReadFailed) };
            let Some(bp) = window.read(sp + UC_RBP) else { return end(walk, StackEnd::ReadFailed) };
            let Some(sp) = window.read(sp + UC_RSP) else { return end(walk, StackEnd::ReadFailed) };
            // The interrupted instruction itself, kept as if a call returned just past its first
            // byte: the next frame looks up its row at `pc`, and reports name the function of
            // `pc`, not of the byte before it (a fault at a function's first instruction).
            (walk.pc, walk.sp, walk.bp, walk.bp_known, walk.pc_is_return) = (pc.wrapping_add(1), sp, bp, 1, 1);
            (walk.bp_from_regs, walk.bp_saved_at) = (0, 0);
            return Some(());
        }
        cfa::NONE => return end(walk, StackEnd::NoTable),
        _ => return end(walk, StackEnd::BadRule),
    };
    let Some(mut return_address) = window.read(cfa - 8) else {
        return end(walk, StackEnd::ReadFailed);
    };
    if walk.trampoline != 0 && return_address == walk.trampoline {
        return_address = taken_return(walk);
    }
    // Where the caller's rbp was saved: relative to the CFA, or to this frame's rbp (a
    // stack-realigning function), which is only known while rbp is.
    let saved_at = match row.rbp {
        rbp::SAVED => Some(cfa),
        rbp::AT_RBP if walk.bp_known != 0 => Some(walk.bp(&mut window.reads)),
        _ => None,
    };
    match saved_at {
        Some(base) => {
            let at = base.wrapping_add(row.rbp_offset as i64 as u64);
            match window.fetch(at) {
                Some(saved) => (walk.bp, walk.bp_known, walk.bp_from_regs, walk.bp_saved_at) = (saved, 1, 0, at),
                None => return end(walk, StackEnd::ReadFailed),
            }
        }
        None if row.rbp != rbp::SAME => walk.bp_known = 0,
        None => {}
    }
    (walk.pc, walk.sp, walk.pc_is_return) = (return_address, cfa, 1);
    // CFI ends at an undefined return address (above), but some hand-written outermost frames
    // just hold 0; frame pointers end at a zero frame.
    if return_address == 0 || (frame_pointers && walk.bp(&mut window.reads) == 0) {
        return end(walk, StackEnd::Complete);
    }
    Some(())
}

pub(super) fn end(walk: &mut Walk, why: StackEnd) -> Option<()> {
    walk.end = why as u32;
    None
}

impl Window {
    /// The word at `address`, noted for the walk's memo.
    fn read(&mut self, address: u64) -> Option<u64> {
        let value = self.fetch(address)?;
        self.reads.note(address, value);
        Some(value)
    }

    /// The word at `address`: from the copy when it holds it, else from a new copy starting there.
    /// A copy stops at the end of its page: a failed copy then means the word's page is not
    /// mapped (a garbage frame address), and is not tried again word by word.
    pub(super) fn fetch(&mut self, address: u64) -> Option<u64> {
        let offset = address.wrapping_sub(self.start);
        if offset.is_multiple_of(8) && offset < self.len && self.len - offset >= 8 {
            return self.words.get((offset / 8) as usize & (WINDOW_WORDS - 1)).copied();
        }
        self.len = 0;
        let page_rest = PAGE_SIZE - (address & (PAGE_SIZE - 1));
        if page_rest < 8 {
            // The word straddles two pages.
            return unsafe { bpf_probe_read_user(address as *const u64) }.ok();
        }
        let size = page_rest.min(core::mem::size_of_val(&self.words) as u64) as u32;
        // SAFETY: the destination is this window's words, at least `size` bytes long.
        let copied = unsafe {
            aya_ebpf::helpers::generated::bpf_probe_read_user(
                self.words.as_mut_ptr().cast(),
                size,
                address as *const c_void,
            )
        };
        if copied != 0 {
            return None;
        }
        (self.start, self.len) = (address, size as u64);
        Some(self.words[0])
    }
}

const PAGE_SIZE: u64 = 4096;
