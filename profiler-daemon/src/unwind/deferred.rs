//! Walks the kernel could not finish: a frame in a file whose table was not loaded yet (a library
//! mapped moments ago, or a program just exec'd under `memprof run`). The kernel stored the frames
//! so far and sent the walk's registers with a copy of the stack (`DeferredUnwind`); once the
//! table is loaded, the walk goes on here, on the same rows by the same rules, as perf's DWARF
//! mode does. The target never waits for memprof.

use std::collections::HashMap;

use profiler_common::{
    cfa, mapping_kind, rbp, walk_kind, DeferredUnwind, DropReason, ProcMappings, StackEnd, UnwindRow, ENTRY_ROW,
    FRAME_POINTER_ROW, MAX_MAPPINGS, PAGE_BYTES, UC_RBP, UC_RIP, UC_RSP,
};

/// The rows' index space, as the kernel's walk reads it.
pub trait Rows {
    fn row(&self, index: u32) -> Option<UnwindRow>;
}

/// The frames a deferred walk found past those the kernel stored, and why it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    pub frames: Vec<u64>,
    pub end: StackEnd,
}

/// Deferred walks so far: finished means the walk reached the thread's outermost frame (or the
/// frame limit), as the kernel's would have; the others end where they could not go on (still no
/// table, or a frame above the copied stack), their stacks marked truncated. Split: walks whose
/// allocation stack is counted under two ids after all (see `kernel::early_stacks`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeferredCounts {
    pub walks: u64,
    pub unfinished: u64,
    pub split: u64,
}

/// Finished walks, by (process, stack table, stack id).
#[derive(Default)]
pub struct Deferred {
    completions: HashMap<(u32, u32, u64), Completion>,
    pub counts: DeferredCounts,
    /// Walks that ended cut, by process: when each was walked, and how it ended. Counted as the
    /// kernel's walk counts its own; an exec drops its old program's (see `exec_happened`).
    cut: HashMap<u32, Vec<(u64, StackEnd)>>,
    /// Walks finished, by process.
    finished: HashMap<u32, u64>,
}

impl Deferred {
    /// Keeps `completion`, walk `event` finished by `walk_on`, and counts it.
    pub fn record(&mut self, event: &DeferredUnwind, completion: Completion) -> &Completion {
        self.counts.walks += 1;
        *self.finished.entry(event.tgid).or_default() += 1;
        if walk_kind::counts_cuts(event.kind) && completion.end.drop_reason().is_some() {
            self.cut.entry(event.tgid).or_default().push((event.time_ns, completion.end));
        }
        if !matches!(completion.end, StackEnd::Complete | StackEnd::TooDeep) {
            self.counts.unfinished += 1;
            tracing::debug!(pid = event.tgid, pc = event.pc, end = ?completion.end, "deferred walk not finished");
        }
        let key = (event.tgid, event.table, event.stack_id);
        self.completions.insert(key, completion);
        &self.completions[&key]
    }

    /// The walks of process `tgid` that ended cut, by drop reason.
    pub fn drops(&self, tgid: u32) -> impl Iterator<Item = (DropReason, u64)> + '_ {
        let cut = self.cut.get(&tgid).map(Vec::as_slice).unwrap_or_default();
        let ends = [StackEnd::NoTable, StackEnd::BadRule, StackEnd::ReadFailed, StackEnd::TooDeep];
        ends.into_iter().filter_map(move |end| {
            Some((end.drop_reason()?, cut.iter().filter(|&&(_, ended)| ended == end).count() as u64))
        })
    }

    /// Process `tgid` exec'd at `exec_ns`: the walks its old program cut are not the new one's
    /// drops, as the kernel starts the new program's counts at the exec.
    pub fn exec_happened(&mut self, tgid: u32, exec_ns: u64) {
        if let Some(cut) = self.cut.get_mut(&tgid) {
            cut.retain(|&(walked_ns, _)| walked_ns >= exec_ns);
        }
    }

    pub fn completion(&self, tgid: u32, table: u32, stack_id: u64) -> Option<&Completion> {
        self.completions.get(&(tgid, table, stack_id))
    }

    /// The walks of process `tgid` finished so far.
    pub fn finished(&self, tgid: u32) -> u64 {
        self.finished.get(&tgid).copied().unwrap_or(0)
    }

    /// The process is gone: so are its stacks.
    pub fn forget(&mut self, tgid: u32) {
        self.completions.retain(|&(pid, _, _), _| pid != tgid);
        self.cut.remove(&tgid);
        self.finished.remove(&tgid);
    }
}

/// The registers between frames.
struct Regs {
    pc: u64,
    sp: u64,
    bp: u64,
    bp_known: bool,
    pc_is_return: bool,
}

/// The copied stack.
struct Window<'a> {
    start: u64,
    bytes: &'a [u8],
}

impl Window<'_> {
    fn read(&self, address: u64) -> Option<u64> {
        let offset = usize::try_from(address.checked_sub(self.start)?).ok()?;
        let word = self.bytes.get(offset..offset.checked_add(8)?)?;
        Some(u64::from_ne_bytes(word.try_into().ok()?))
    }
}

/// Walk `event` finished on `mappings`, within `frame_limit` frames in all (`--max-frames`).
pub(super) fn walk_on(
    event: &DeferredUnwind,
    mappings: &ProcMappings,
    rows: &impl Rows,
    frame_limit: usize,
) -> Completion {
    walk(event, mappings, rows, frame_limit.saturating_sub(event.stored as usize))
}

/// The kernel's walk (`profiler-ebpf/src/unwind/frames.rs`, `frame`) from where it stopped: its frame
/// `event.pc` is stored already (or is an entry probe's function, which stacks do not hold).
fn walk(event: &DeferredUnwind, mappings: &ProcMappings, rows: &impl Rows, room: usize) -> Completion {
    let copied = (event.pages as usize).min(event.window.len() / PAGE_BYTES) * PAGE_BYTES;
    let window = Window { start: event.window_start, bytes: &event.window[..copied] };
    let mut regs = Regs {
        pc: event.pc,
        sp: event.sp,
        bp: event.bp,
        bp_known: event.bp_known != 0,
        pc_is_return: event.pc_is_return != 0,
    };
    let mut frames = Vec::new();
    let mut first = true;
    loop {
        let at_entry = first && event.pc_recorded == 0;
        if !first {
            if frames.len() >= room {
                return Completion { frames, end: StackEnd::TooDeep };
            }
            frames.push(regs.pc);
        }
        first = false;
        let address = regs.pc - u64::from(regs.pc_is_return);
        let Some((row, kind)) = row_for(mappings, rows, address, at_entry) else {
            return Completion { frames, end: StackEnd::NoTable };
        };
        if let Err(end) = step(&mut regs, &row, kind, address, &window) {
            return Completion { frames, end };
        }
    }
}

/// One frame to its caller; Err with why the walk ends.
fn step(regs: &mut Regs, row: &UnwindRow, kind: u32, address: u64, window: &Window) -> Result<(), StackEnd> {
    let read = |at: u64| window.read(at).ok_or(StackEnd::ReadFailed);
    let offset = |base: u64, by: i64| base.wrapping_add(by as u64);
    let cfa = match row.cfa {
        cfa::RSP => offset(regs.sp, row.cfa_offset.into()),
        cfa::RBP if regs.bp_known => offset(regs.bp, row.cfa_offset.into()),
        cfa::RBP_DEREF if regs.bp_known => read(offset(regs.bp, row.cfa_offset.into()))?,
        cfa::PLT => regs.sp + 8 + if (address & 15) as i32 >= row.cfa_offset { 8 } else { 0 },
        cfa::END => return Err(StackEnd::Complete),
        cfa::SIGNAL => {
            let sp = regs.sp;
            (regs.pc, regs.bp, regs.sp) = (read(sp + UC_RIP)?.wrapping_add(1), read(sp + UC_RBP)?, read(sp + UC_RSP)?);
            // As the kernel's walk keeps it: the interrupted instruction, as a return just past it.
            (regs.bp_known, regs.pc_is_return) = (true, true);
            return Ok(());
        }
        cfa::NONE => return Err(StackEnd::NoTable),
        _ => return Err(StackEnd::BadRule),
    };
    let return_address = read(cfa - 8)?;
    let saved_at = match row.rbp {
        rbp::SAVED => Some(cfa),
        rbp::AT_RBP if regs.bp_known => Some(regs.bp),
        _ => None,
    };
    match saved_at {
        Some(base) => (regs.bp, regs.bp_known) = (read(offset(base, row.rbp_offset.into()))?, true),
        None if row.rbp != rbp::SAME => regs.bp_known = false,
        None => {}
    }
    (regs.pc, regs.sp, regs.pc_is_return) = (return_address, cfa, true);
    if return_address == 0 || (kind == mapping_kind::FRAME_POINTERS && regs.bp == 0) {
        return Err(StackEnd::Complete);
    }
    Ok(())
}

/// The row for `address` and its mapping's kind, as the kernel's `search_mapping` and `search_row` find it.
fn row_for(mappings: &ProcMappings, rows: &impl Rows, address: u64, at_entry: bool) -> Option<(UnwindRow, u32)> {
    let entries = &mappings.entries[..(mappings.len as usize).min(MAX_MAPPINGS)];
    let mapping = entries[..entries.partition_point(|m| m.start <= address)].last()?;
    if address >= mapping.end {
        return None;
    }
    if mapping.kind == mapping_kind::FRAME_POINTERS {
        return Some((if at_entry { ENTRY_ROW } else { FRAME_POINTER_ROW }, mapping.kind));
    }
    let file_address = u32::try_from(address.wrapping_sub(mapping.bias)).ok()?;
    // The last row at or below the address, by binary search over the file's slice.
    let (mut low, mut high) = (0u32, mapping.rows);
    while low < high {
        let middle = low + (high - low) / 2;
        if rows.row(mapping.first_row + middle)?.pc <= file_address {
            low = middle + 1;
        } else {
            high = middle;
        }
    }
    let row = rows.row(mapping.first_row + low.checked_sub(1)?)?;
    Some((row, mapping.kind))
}

#[cfg(test)]
mod tests {
    use super::*;
    use profiler_common::{ExecMapping, DEFERRED_PAGES};

    struct Table(Vec<UnwindRow>);

    impl Rows for Table {
        fn row(&self, index: u32) -> Option<UnwindRow> {
            self.0.get(index as usize).copied()
        }
    }

    fn row(pc: u32, cfa: u8, cfa_offset: i32) -> UnwindRow {
        UnwindRow { pc, cfa_offset, rbp_offset: 0, cfa, rbp: rbp::SAME }
    }

    /// One file mapped at 0x1000 with bias 0, holding `rows` rows of `table`.
    fn one_file(rows: u32) -> ProcMappings {
        let mut mappings =
            ProcMappings { len: 1, _pad: 0, code_changes_seen: 0, entries: [ExecMapping::default(); MAX_MAPPINGS] };
        mappings.entries[0] =
            ExecMapping { start: 0x1000, end: 0x2000, bias: 0, first_row: 0, rows, kind: mapping_kind::CFI, _pad: 0 };
        mappings
    }

    /// A walk the kernel stored at a return address `pc`, stack pointer `sp`, with the stack's
    /// page copied.
    fn stored_at(pc: u64, sp: u64) -> DeferredUnwind {
        DeferredUnwind {
            stack_id: 9,
            tgid: 1,
            table: 0,
            pc,
            sp,
            bp: 0,
            pc_is_return: 1,
            bp_known: 1,
            pc_recorded: 1,
            stored: 1,
            kind: walk_kind::CALL,
            pages: 1,
            window_start: sp & !0xfff,
            time_ns: 0,
            window: [0; DEFERRED_PAGES * PAGE_BYTES],
        }
    }

    fn put(event: &mut DeferredUnwind, at: u64, value: u64) {
        let offset = (at - event.window_start) as usize;
        event.window[offset..offset + 8].copy_from_slice(&value.to_ne_bytes());
    }

    /// Two CFI frames then `_start`'s end: `inner` (CFA = rsp + 16) called from `outer` (CFA =
    /// rsp + 32), called from `start` (the end).
    #[test]
    fn a_walk_goes_on_from_the_stored_frame_on_the_copied_stack() {
        let table = Table(vec![row(0x1000, cfa::RSP, 16), row(0x1100, cfa::RSP, 32), row(0x1200, cfa::END, 0)]);
        let mappings = one_file(3);
        let sp = 0x7fff_0000_0100u64;
        let mut event = stored_at(0x1010, sp);
        // inner's return address into outer at CFA - 8 = sp + 8; outer's into start at sp + 16 + 24.
        put(&mut event, sp + 8, 0x1110);
        put(&mut event, sp + 16 + 24, 0x1210);
        let mut deferred = Deferred::default();
        deferred.record(&event, walk_on(&event, &mappings, &table, 127));
        let completion = deferred.completion(1, 0, 9).expect("finished");
        assert_eq!(completion, &Completion { frames: vec![0x1110, 0x1210], end: StackEnd::Complete });
        assert_eq!(deferred.counts, DeferredCounts { walks: 1, unfinished: 0, split: 0 });
        // Without the copied stack the walk cannot go on: counted as not finished.
        event.pages = 0;
        deferred.record(&event, walk_on(&event, &mappings, &table, 127));
        assert_eq!(deferred.completion(1, 0, 9).expect("kept").end, StackEnd::ReadFailed);
        assert_eq!(deferred.counts, DeferredCounts { walks: 2, unfinished: 1, split: 0 });
        deferred.forget(1);
        assert!(deferred.completion(1, 0, 9).is_none());
    }

    /// A signal frame (`restorer`, whose rule reads the ucontext) over code interrupted at the
    /// first instruction of `outer`: that frame is kept one past the instruction, as a return
    /// address is, so that it is named after `outer`, and `outer`'s own row carries the walk on.
    #[test]
    fn a_frame_interrupted_at_its_first_instruction_is_kept_as_a_return_past_it() {
        let table = Table(vec![row(0x1000, cfa::SIGNAL, 0), row(0x1100, cfa::RSP, 8), row(0x1200, cfa::END, 0)]);
        let sp = 0x7fff_0000_0100u64;
        let interrupted_sp = sp + 0x800;
        let mut event = stored_at(0x1010, sp);
        put(&mut event, sp + UC_RIP, 0x1100);
        put(&mut event, sp + UC_RSP, interrupted_sp);
        put(&mut event, interrupted_sp, 0x1210);
        let mut deferred = Deferred::default();
        deferred.record(&event, walk_on(&event, &one_file(3), &table, 127));
        let completion = deferred.completion(1, 0, 9).expect("finished");
        assert_eq!(completion, &Completion { frames: vec![0x1101, 0x1210], end: StackEnd::Complete });
    }
}
