//! A frame's row: from the per-CPU cache, or found by binary searches in the process's mapping
//! list and in its file's slice of the rows.

use aya_ebpf::{
    bindings::BPF_F_MMAPABLE,
    btf_maps::{Array as BtfArray, ArrayOfMaps},
    macros::{btf_map, map},
    maps::{HashMap, PerCpuArray},
};
use profiler_common::{
    mapping_kind, ExecMapping, ProcMappings, StackEnd, UnwindRow, ENTRY_ROW, FRAME_POINTER_ROW, MAX_MAPPINGS,
    UNWIND_SHARD_BITS, UNWIND_SHARD_ROWS,
};

use super::{changes::NO_LIST, frames::end, Scratch, Walk, SCRATCH};
use crate::shared::NO_PREALLOC;

/// Rows of every file's unwind table, each file a sorted slice of one index space cut in shards
/// (see `UNWIND_SHARD_ROWS`) that the daemon creates as tables need them, so that an idle memprof
/// holds no rows and a busy one is bounded only by `--max-unwind-rows`. Arrays of one size, outer
/// and inner: the verifier inlines both lookups. The daemon sets the shard count at load time.
#[btf_map]
static UNWIND_SHARDS: ArrayOfMaps<
    BtfArray<UnwindRow, { UNWIND_SHARD_ROWS as usize }, { BPF_F_MMAPABLE as usize }>,
    256,
> = ArrayOfMaps::new();
#[map]
pub(super) static PROC_MAPPINGS: HashMap<u32, ProcMappings> = HashMap::with_max_entries(4_096, NO_PREALLOC);

/// Binary search steps: enough for 2^9 = 512 > MAX_MAPPINGS mappings and 2^24 rows per file.
const MAPPING_STEPS: usize = 9;
const ROW_STEPS: usize = 24;

/// Leaves the row for frame address `address` in the walk's `row` and `row_kind`: from this CPU's
/// cache, else by `search_mapping` and `search_row`. False when the walk ended (no mapping or row
/// covers the address).
pub(super) fn frame_row(scratch: *mut Scratch, address: u64, at_entry: bool) -> bool {
    // SAFETY (each dereference below): this CPU's scratch and cache, which the walk holds (see
    // `stack_id`). No reference into the scratch lives across the searches, which take their own.
    let slot = ROW_CACHE.get_ptr_mut(cache_slot(address, unsafe { (*scratch).walk.start.tgid }));
    if let Some(slot) = slot {
        let (slot, walk) = unsafe { (&*slot, &mut (*scratch).walk) };
        if slot.holds(address, walk, at_entry) {
            copy_row(&mut walk.row, &slot.row);
            walk.row_kind = slot.kind & !AT_ENTRY;
            return true;
        }
    }
    if search_mapping(address) == 0 || search_row(address, u32::from(at_entry)) == 0 {
        return false;
    }
    if let Some(slot) = slot {
        unsafe { (*slot).fill(address, &(*scratch).walk, at_entry) };
    }
    true
}

/// Field by field: a whole copy between two maps' values is a call to `memmove`, byte by byte,
/// whose frame 6.1 also counts in the 512 bytes of stack (see `stack_id`).
fn copy_row(to: &mut UnwindRow, from: &UnwindRow) {
    (to.pc, to.cfa_offset, to.rbp_offset, to.cfa, to.rbp) =
        (from.pc, from.cfa_offset, from.rbp_offset, from.cfa, from.rbp);
}

/// Field by field, as `copy_row`.
fn copy_mapping(to: &mut ExecMapping, from: &ExecMapping) {
    (to.start, to.end, to.bias) = (from.start, from.end, from.bias);
    (to.first_row, to.rows, to.kind) = (from.first_row, from.rows, from.kind);
}

/// Makes the walk's `mapping` the process's executable mapping of `address`, by a binary search
/// in its list when the last frame's does not hold it. Returns 1, or 0 when the walk ended (no
/// mapping holds the address). A global function (see `walk_and_store`), as `search_row`: each
/// verified once, where inlined in `step` their searches were verified again on every path that
/// reaches them. Two, called one after the other: one would need more than the 32 bytes of stack
/// 6.1 leaves it under `step` (see `stack_id`).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn search_mapping(address: u64) -> u64 {
    let Some(scratch) = SCRATCH.get_ptr_mut(0) else { return 0 };
    // SAFETY: this CPU's scratch, which `frame_row` holds no reference into across this call.
    let walk = unsafe { &mut (*scratch).walk };
    if walk.mapping.start <= address && address < walk.mapping.end {
        return 1;
    }
    let list = unsafe { PROC_MAPPINGS.get(walk.start.tgid) };
    walk.list_seen = list.map_or(NO_LIST, |list| list.code_changes_seen);
    let Some(found) = list.and_then(|mappings| find_mapping(mappings, address)) else {
        end(walk, StackEnd::NoTable);
        return 0;
    };
    copy_mapping(&mut walk.mapping, found);
    1
}

/// The row for `address` in the walk's `mapping`, by a binary search in its file's rows, left in
/// the walk's `row` and `row_kind`. Returns 1, or 0 when the walk ended (no row covers it).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn search_row(address: u64, at_entry: u32) -> u64 {
    let Some(scratch) = SCRATCH.get_ptr_mut(0) else { return 0 };
    // SAFETY: as in `search_mapping`.
    let walk = unsafe { &mut (*scratch).walk };
    walk.row_kind = walk.mapping.kind;
    if walk.row_kind == mapping_kind::FRAME_POINTERS {
        walk.row = if at_entry != 0 { ENTRY_ROW } else { FRAME_POINTER_ROW };
        return 1;
    }
    let Some(row) = row_in_file(&walk.mapping, address) else {
        end(walk, StackEnd::NoTable);
        return 0;
    };
    copy_row(&mut walk.row, row);
    1
}

/// Rows found for recent frame addresses, per CPU, one per slot of an address's hash. The same
/// few allocation paths repeat millions of times: a hit costs one lookup where a miss costs two
/// binary searches over large tables.
#[map]
static ROW_CACHE: PerCpuArray<CachedRow> = PerCpuArray::with_max_entries(ROW_CACHE_SLOTS, 0);
const ROW_CACHE_SLOTS: u32 = 1 << ROW_CACHE_BITS;
const ROW_CACHE_BITS: u32 = 12;

/// The row of `pc` in process `tgid` while its mappings are those of `generation`. A slot never
/// filled matches no walk: no process has tgid 0.
#[repr(C)]
struct CachedRow {
    pc: u64,
    tgid: u32,
    generation: u32,
    row: UnwindRow,
    /// The mapping's kind, and `AT_ENTRY` for a function's first instruction.
    kind: u32,
}

const AT_ENTRY: u32 = 1 << 16;

fn cache_slot(pc: u64, tgid: u32) -> u32 {
    ((pc ^ (tgid as u64) << 40).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - ROW_CACHE_BITS)) as u32 % ROW_CACHE_SLOTS
}

impl CachedRow {
    fn holds(&self, pc: u64, walk: &Walk, at_entry: bool) -> bool {
        self.pc == pc
            && self.tgid == walk.start.tgid
            && self.generation == walk.start.generation
            && (self.kind & AT_ENTRY != 0) == at_entry
    }

    /// Keeps the walk's `row` and `row_kind` for `pc`.
    fn fill(&mut self, pc: u64, walk: &Walk, at_entry: bool) {
        (self.pc, self.tgid, self.generation) = (pc, walk.start.tgid, walk.start.generation);
        copy_row(&mut self.row, &walk.row);
        self.kind = walk.row_kind | if at_entry { AT_ENTRY } else { 0 };
    }
}

/// 1 when `low <= high`, else 0, without a branch (addresses are far below 2^63): every branch
/// in a search doubles the paths the verifier explores.
fn at_or_below(low: u64, high: u64) -> u64 {
    (high.wrapping_sub(low) >> 63) ^ 1
}

/// The mapping that holds `address`: a binary search over the sorted entries, branchless but for
/// its end (one branch out per step, not two ways to go on).
pub(super) fn find_mapping(mappings: &ProcMappings, address: u64) -> Option<&ExecMapping> {
    let (mut base, mut count) = (0usize, (mappings.len as usize).min(MAX_MAPPINGS));
    for _ in 0..MAPPING_STEPS {
        if count <= 1 {
            break;
        }
        let half = count / 2;
        let probe = mappings.entries.get((base + half) & (MAX_MAPPINGS - 1))?;
        base += half & (at_or_below(probe.start, address) as usize).wrapping_neg();
        count -= half;
    }
    let entry = mappings.entries.get(base & (MAX_MAPPINGS - 1))?;
    (count == 1 && entry.start <= address && address < entry.end).then_some(entry)
}

/// The row in `mapping`'s file that covers `address`: the last one whose `pc` is at or below it.
fn row_in_file(mapping: &ExecMapping, address: u64) -> Option<&'static UnwindRow> {
    let file_address = address.wrapping_sub(mapping.bias);
    if file_address > u32::MAX as u64 {
        return None;
    }
    let file_address = file_address as u32;
    let (mut base, mut count) = (mapping.first_row, mapping.rows);
    for _ in 0..ROW_STEPS {
        if count <= 1 {
            break;
        }
        let half = count / 2;
        let probe = row_at(base + half)?;
        base += half & (at_or_below(probe.pc as u64, file_address as u64) as u32).wrapping_neg();
        count -= half;
    }
    let row = row_at(base)?;
    (count == 1 && row.pc <= file_address).then_some(row)
}

/// Row `index` of the rows' index space; None where its shard does not exist (a mapping list
/// that still points at rows the daemon has released).
fn row_at(index: u32) -> Option<&'static UnwindRow> {
    UNWIND_SHARDS.get_value(index >> UNWIND_SHARD_BITS, &(index & (UNWIND_SHARD_ROWS - 1)))
}
