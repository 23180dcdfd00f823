//! A walk stopped at a file with no table yet: its stack sent to the daemon, which finishes it.

use aya_ebpf::{
    bindings::{BPF_NOEXIST, BPF_RB_AVAIL_DATA},
    cty::c_void,
    helpers::{bpf_ktime_get_ns, bpf_loop, bpf_probe_read_user},
    maps::{ring_buf::RingBufEntry, HashMap},
};
use profiler_common::{
    walk_kind, DeferredUnwind, DeferredUnwindOf, DropReason, ShortDeferredUnwind, Stack, StackEnd, NO_STACK,
    PAGE_BYTES, SHORT_DEFERRED_PAGES,
};

use super::{
    rows::{find_mapping, PROC_MAPPINGS},
    taken::restore_taken,
    Scratch, Walk, MAPPING_EVENTS_ROOM, SCRATCH, UNWIND_EVENTS, UNWIND_EVENTS_BYTES,
};

/// Words above the stopped frame's stack pointer searched for return addresses: its own and
/// its callers'.
const CALLER_WORDS: u32 = 32;
/// A word this close to the stopped frame's address is taken for an address in its file, whose
/// extent is not known yet.
const NEAR_CODE: u64 = 64 << 20;
use crate::shared::{count_drop, EEXIST};

/// A walk stopped at a frame with no table: stores the frames so far as a `Deferred` stack and,
/// the first time that stack is stored, sends its state and a copy of the stack to the daemon,
/// which finishes the walk in user space (see `DeferredUnwind`). The id also hashes the stack
/// pointer, so that calls reaching the frame from different depths stay apart, and the words
/// above it that look like return addresses (see `callers`), so that two call sites at one depth
/// do too: the first one's copy finishes every walk stored under its id. At an entry probe that
/// stored no frame yet (a free in a library not read yet) or a mapping's walk that stored only
/// the system call's wrapper (before the process's mappings are read), the word at the stack
/// pointer is the return address, and is hashed whatever it looks like. None when the event
/// cannot be sent (the ring is full): the stack is then kept cut, counted as
/// `deferred_walk_lost`.
///
/// Only walks that would have been cut come here, and only while a newer mapping list may come
/// (`list_was_current`): the cost of every other stays as it was.
pub(super) fn defer(table: &HashMap<u64, Stack>, which: u32, scratch: &mut Scratch, kind: u32) -> Option<u64> {
    let mapping_call = kind == walk_kind::MAPPING_CALL;
    let walk = &scratch.walk;
    // At a syscall the first frame is the C library's wrapper, the same for every caller.
    let first_frame_only = (walk.len == 0 && walk.first_is_probed != 0) || (mapping_call && walk.len <= 1);
    let caller = if first_frame_only { unsafe { bpf_probe_read_user(walk.sp as *const u64) }.unwrap_or(0) } else { 0 };
    let callers = callers();
    let walk = &scratch.walk;
    let place = walk.sp.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ caller.rotate_left(29) ^ callers.rotate_left(13);
    let hash = (walk.hash ^ place).rotate_left(7) ^ StackEnd::Deferred as u64;
    let check = walk.check ^ walk.sp ^ caller ^ callers.rotate_left(3) ^ walk.len as u64;
    let id = if hash == NO_STACK { 1 } else { hash };
    if let Some(stored) = unsafe { table.get(id) } {
        if stored.check == check && stored.len == walk.len {
            return Some(id);
        }
        count_drop(DropReason::StackCollision);
        return Some(NO_STACK);
    }
    let queued = UNWIND_EVENTS.query(BPF_RB_AVAIL_DATA as u64);
    // A mapping call's walk gives way to the heap's: it takes no copy once the ring is a quarter
    // full, and keeps its stack cut instead.
    if mapping_call && queued > UNWIND_EVENTS_BYTES / 4 {
        return None;
    }
    // Every walk gives way to the mapping changes (see `MAPPING_EVENTS_ROOM`).
    if queued + size_of::<DeferredUnwind>() as u64 > UNWIND_EVENTS_BYTES - MAPPING_EVENTS_ROOM {
        return None;
    }
    let window_start = walk.sp & !(PAGE_BYTES as u64 - 1);
    // A stack that ends within the short record's pages gets one: the copy stops there anyway.
    let past_short = window_start + (SHORT_DEFERRED_PAGES * PAGE_BYTES) as u64;
    // SAFETY: a read of user memory, which fails cleanly past the stack's top.
    let short = unsafe { bpf_probe_read_user(past_short as *const u8) }.is_err();
    let entry = if short {
        let mut entry = UNWIND_EVENTS.reserve::<ShortDeferredUnwind>(0)?;
        fill(entry.as_mut_ptr(), walk, id, which, kind, window_start);
        Reserved::Short(entry)
    } else {
        let mut entry = UNWIND_EVENTS.reserve::<DeferredUnwind>(0)?;
        fill(entry.as_mut_ptr(), walk, id, which, kind, window_start);
        Reserved::Whole(entry)
    };
    scratch.stack.check = check;
    scratch.stack.len = scratch.walk.len;
    scratch.stack.end = StackEnd::Deferred as u32;
    let stack: &Stack = &scratch.stack;
    match table.insert(id, stack, BPF_NOEXIST as u64) {
        Ok(()) => {
            entry.submit();
            Some(id)
        }
        // Another CPU stored it first, and sent its event.
        Err(err) if err == -EEXIST => {
            entry.discard();
            Some(id)
        }
        Err(_) => {
            entry.discard();
            count_drop(DropReason::StackTableFull);
            Some(NO_STACK)
        }
    }
}

/// A deferred walk's record in the ring, until it is submitted or discarded.
enum Reserved {
    Short(RingBufEntry<ShortDeferredUnwind>),
    Whole(RingBufEntry<DeferredUnwind>),
}

impl Reserved {
    fn submit(self) {
        match self {
            Self::Short(entry) => entry.submit(0),
            Self::Whole(entry) => entry.submit(0),
        }
    }

    fn discard(self) {
        match self {
            Self::Short(entry) => entry.discard(0),
            Self::Whole(entry) => entry.discard(0),
        }
    }
}

/// Writes the walk's state and a copy of its stack from `window_start` into a reserved record.
#[inline(always)]
fn fill<const WINDOW_BYTES: usize>(
    event: *mut DeferredUnwindOf<WINDOW_BYTES>,
    walk: &Walk,
    id: u64,
    which: u32,
    kind: u32,
    window_start: u64,
) {
    let pages = WINDOW_BYTES / PAGE_BYTES;
    // SAFETY: the reserved record is ours until submitted or discarded.
    unsafe {
        (*event).stack_id = id;
        (*event).tgid = walk.start.tgid;
        (*event).table = which;
        ((*event).pc, (*event).sp, (*event).bp) = (walk.pc, walk.sp, walk.bp);
        ((*event).pc_is_return, (*event).bp_known) = (walk.pc_is_return, walk.bp_known);
        (*event).pc_recorded = u32::from(walk.len > 0 || walk.pc_is_return != 0);
        (*event).stored = walk.len;
        (*event).kind = kind;
        (*event).window_start = window_start;
        (*event).time_ns = bpf_ktime_get_ns();
        (*event).pages = pages as u32;
        for page in 0..pages {
            let copied = aya_ebpf::helpers::generated::bpf_probe_read_user(
                (*event).window.as_mut_ptr().add(page * PAGE_BYTES).cast(),
                PAGE_BYTES as u32,
                (window_start + (page * PAGE_BYTES) as u64) as *const c_void,
            );
            if copied != 0 {
                (*event).pages = page as u32;
                break;
            }
        }
        if walk.trampoline != 0 {
            let copied = (*event).pages as u64 * PAGE_BYTES as u64;
            restore_taken::<WINDOW_BYTES>(walk.taken, window_start, copied, (*event).window.as_mut_ptr());
        }
    }
}

/// A hash of the words above the stopped frame's stack pointer that look like return addresses:
/// near the frame's own address (most often its caller is in the same file, which no list
/// holds yet) or in a file the process's list holds, and just after a call instruction. The
/// frames' locals, which change from call to call, mostly look like neither: pointers to the
/// file's data are near too, but seldom follow a call.
fn callers() -> u64 {
    let mut hash = 0u64;
    // SAFETY: `caller_word` has the callback signature bpf_loop expects, and `hash` outlives it.
    unsafe { bpf_loop(CALLER_WORDS, caller_word as *mut c_void, (&raw mut hash).cast(), 0) };
    hash
}

/// Folds word `index` above the stopped frame into the hash at `context` when it looks like a
/// return address. Returns 1 to stop (the stack ends there), 0 to go on.
extern "C" fn caller_word(index: u64, context: *mut c_void) -> i64 {
    let Some(scratch) = SCRATCH.get_ptr_mut(0) else { return 1 };
    // SAFETY: this CPU's scratch, as the walk left it; `context` is `callers`' hash.
    let (scratch, hash) = unsafe { (&mut *scratch, &mut *context.cast::<u64>()) };
    let (pc, sp, tgid) = (scratch.walk.pc, scratch.walk.sp, scratch.walk.start.tgid);
    let Some(word) = scratch.window.fetch(sp.wrapping_add(index * 8)) else { return 1 };
    let near = word.wrapping_sub(pc.wrapping_sub(NEAR_CODE)) < 2 * NEAR_CODE;
    // SAFETY: a lookup in a map the daemon writes whole entries of.
    let known = || unsafe { PROC_MAPPINGS.get(tgid) }.is_some_and(|list| find_mapping(list, word).is_some());
    if (near || known()) && follows_call(word) {
        *hash = (*hash ^ word ^ index << 56).wrapping_mul(0xff51_afd7_ed55_8ccd).rotate_left(31);
    }
    0
}

/// Whether the code before `address` ends with a call instruction, as a return address's does:
/// a direct call, or an indirect one through a register or memory, as compilers emit them.
fn follows_call(address: u64) -> bool {
    // SAFETY: a read of user memory, which fails cleanly where nothing is mapped.
    let Ok(before) = (unsafe { bpf_probe_read_user(address.wrapping_sub(8) as *const u64) }) else {
        return false;
    };
    let b = before.to_le_bytes();
    b[3] == 0xe8
        || (b[6] == 0xff && matches!(b[7] & 0xf8, 0xd0 | 0x10))
        || (b[5] == 0xff && b[6] & 0xf8 == 0x50)
        || (b[4] == 0xff && b[5] == 0x54)
        || (b[2] == 0xff && (b[3] == 0x15 || b[3] & 0xf8 == 0x90))
}
