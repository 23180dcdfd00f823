//! A file's unwind table for the eBPF stack walker, built from its DWARF call frame information.
//!
//! The walker cannot run CFI programs in the kernel, so they are evaluated here, once per file,
//! into one sorted table of [`UnwindRow`]s: for each address range, which of the few rules x86_64
//! code actually uses finds the caller's frame.

use std::{borrow::Cow, io::Read as _, ops::Range};

use flate2::read::ZlibDecoder;

use gimli::{
    BaseAddresses, CfaRule, CieOrFde, DebugFrame, EhFrame, EndianSlice, FrameDescriptionEntry, LittleEndian,
    Reader as _, RegisterRule, UnwindContext, UnwindSection, UnwindTableRow, X86_64,
};
use object::{read::elf::ElfFile64, Architecture, CompressionFormat, Object, ObjectSection, ObjectSymbol, SymbolKind};
use profiler_common::{cfa, rbp, UnwindRow, FRAME_POINTER_ROW};

use crate::process::go_functions::{self, GoFunctions};

// A path the fuzz target's `#[path]` include of this file resolves alike.
#[path = "table/prologue.rs"]
mod prologue;

type Slice<'a> = EndianSlice<'a, LittleEndian>;

/// The CFA expression GNU ld emits for the entries of `.plt`: CFA = rsp + 8, plus 8 once the
/// entry has pushed its relocation index, i.e. from byte `N` of the 16-byte entry on. Byte
/// `PLT_THRESHOLD_AT` is `DW_OP_litN`.
const PLT_EXPRESSION: [u8; 11] = [
    gimli::DW_OP_breg7.0, // rsp
    8,
    gimli::DW_OP_breg16.0, // rip
    0,
    gimli::DW_OP_lit15.0,
    gimli::DW_OP_and.0,
    gimli::DW_OP_lit0.0,
    gimli::DW_OP_ge.0,
    gimli::DW_OP_lit3.0,
    gimli::DW_OP_shl.0,
    gimli::DW_OP_plus.0,
];
const PLT_THRESHOLD_AT: usize = 6;

/// The unwind table of one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileTable {
    /// Sorted by `pc`, with no two neighbours alike. The last row is a `cfa::NONE` row at the end
    /// of the last FDE.
    pub rows: Vec<UnwindRow>,
}

impl FileTable {
    /// The row that covers `address` (an ELF virtual address), as the BPF side finds it: the last
    /// one with `pc <= address`. `None` before the first row.
    #[cfg(test)]
    pub fn lookup(&self, address: u32) -> Option<&UnwindRow> {
        self.index_of(address).map(|index| &self.rows[index])
    }

    fn index_of(&self, address: u32) -> Option<usize> {
        self.rows.partition_point(|row| row.pc <= address).checked_sub(1)
    }

    /// Marks the code at `entry`, the file's ELF entry point, as a thread's outermost frame when
    /// no CFI covers it: the dynamic linker's hand-written `_start`/`_dl_start_user` has none, and
    /// the constructors it runs would otherwise end in a truncated stack.
    pub fn end_at_entry_point(&mut self, entry: u32) {
        if let Some(row) = self.index_of(entry).and_then(|index| self.rows.get_mut(index)) {
            if row.cfa == profiler_common::cfa::NONE {
                row.cfa = profiler_common::cfa::END;
            }
        }
    }
}

/// Why a file's unwind table could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    #[error("not a 64-bit ELF file: {0}")]
    NotElf(object::Error),
    #[error("not an x86_64 file (architecture {0:?})")]
    NotX86_64(Architecture),
    #[error("cannot read {section}: {cause}")]
    Section { section: &'static str, cause: object::Error },
    #[error("malformed CFI in {section}: {cause}")]
    Cfi { section: &'static str, cause: gimli::Error },
    #[error("CFI address {0:#x} does not fit in 32 bits")]
    AddressTooLarge(u64),
    #[error("cannot inflate {section}: {cause}")]
    Inflate { section: &'static str, cause: std::io::Error },
}

/// The most a compressed CFI section is inflated to: Go's largest programs have a few MiB.
const MAX_INFLATED: u64 = 256 << 20;

/// Builds the unwind table of the ELF file `elf` from its `.eh_frame`, or from its `.debug_frame`
/// when it has no `.eh_frame`; a Go program's from both (`.eh_frame`'s rows first where both
/// cover an address): linked by the system's linker, it keeps its C code's CFI in `.eh_frame`
/// and its Go code's in `.debug_frame`. (Other files' `.debug_frame` beside an `.eh_frame`, as
/// musl's static C library built with `-g`, is left out: the functions `.eh_frame` misses there
/// are read from their prologues.) `Ok(None)`: the file has no CFI (neither section, or no FDE
/// in it); the caller falls back to frame pointers.
pub fn build(elf: &[u8]) -> Result<Option<FileTable>, TableError> {
    let file = ElfFile64::<object::Endianness>::parse(elf).map_err(TableError::NotElf)?;
    if file.architecture() != Architecture::X86_64 {
        return Err(TableError::NotX86_64(file.architecture()));
    }
    let debug_frame = read_section(&file, ".debug_frame");
    let go = go_functions::section_data(&file)
        .and_then(|table| Some((GoFunctions::read(table, go_functions::text_start(&file))?, table)));
    let (mut spans, mut rows) = if let Some(section) = read_section(&file, ".eh_frame")? {
        // `.eh_frame` pointers are mostly pc-relative, and may be relative to .text or the GOT.
        let mut bases = BaseAddresses::default().set_eh_frame(section.address);
        if let Some(text) = file.section_by_name(".text") {
            bases = bases.set_text(text.address());
        }
        if let Some(got) = file.section_by_name(".got") {
            bases = bases.set_got(got.address());
        }
        let mut eh_frame = EhFrame::new(&section.data, LittleEndian);
        eh_frame.set_address_size(8);
        let (mut spans, mut rows) = evaluate(&eh_frame, &bases, ".eh_frame")?;
        // What `.debug_frame` adds is a bonus: a file whose `.eh_frame` reads keeps its table
        // when its `.debug_frame` does not.
        let debug_frame = if go.is_some() { debug_frame } else { Ok(None) };
        match debug_frame.and_then(|section| section.map(|section| evaluate_debug_frame(&section)).transpose()) {
            Ok(Some((more_spans, more_rows))) => add_uncovered(&mut spans, &mut rows, more_spans, &more_rows),
            Ok(None) => {}
            Err(err) => tracing::debug!("{err}: its .eh_frame alone is used"),
        }
        (spans, rows)
    } else if let Some(section) = debug_frame? {
        evaluate_debug_frame(&section)?
    } else {
        return Ok(None);
    };
    add_functions(&file, &mut spans, &mut rows);
    if let Some((go, table)) = go {
        add_go_functions(&go, table, &mut spans, &mut rows);
    }
    let rows = merge(spans, &rows);
    Ok((!rows.is_empty()).then_some(FileTable { rows }))
}

/// A CFI section's contents, and its address.
struct Section<'a> {
    data: Cow<'a, [u8]>,
    address: u64,
}

/// The section `name`, if the file has it with any contents (a separate debug file keeps
/// `.eh_frame` as an empty NOBITS section).
fn read_section<'a>(
    file: &ElfFile64<'a, object::Endianness>,
    name: &'static str,
) -> Result<Option<Section<'a>>, TableError> {
    let Some(section) = file.section_by_name(name) else { return Ok(None) };
    let error = |cause| TableError::Section { section: name, cause };
    // Go compresses its `.debug_frame` with zlib; object decompresses only with its
    // `compression` feature (and its zstd crate), so zlib is inflated here with flate2.
    let compressed = section.compressed_data().map_err(error)?;
    let data = if compressed.format == CompressionFormat::Zlib {
        let mut data = Vec::with_capacity(compressed.uncompressed_size.min(MAX_INFLATED) as usize);
        ZlibDecoder::new(compressed.data)
            .take(MAX_INFLATED)
            .read_to_end(&mut data)
            .map_err(|cause| TableError::Inflate { section: name, cause })?;
        Cow::Owned(data)
    } else {
        section.uncompressed_data().map_err(error)?
    };
    Ok((!data.is_empty()).then(|| Section { data, address: section.address() }))
}

fn evaluate_debug_frame(section: &Section) -> Result<(Vec<Span>, Vec<UnwindRow>), TableError> {
    let mut debug_frame = DebugFrame::new(&section.data, LittleEndian);
    debug_frame.set_address_size(8);
    evaluate(&debug_frame, &BaseAddresses::default(), ".debug_frame")
}

/// Adds to `spans` (and their `rows`) the spans of `more` (rows in `more_rows`) that cross none
/// of them.
fn add_uncovered(spans: &mut Vec<Span>, rows: &mut Vec<UnwindRow>, more: Vec<Span>, more_rows: &[UnwindRow]) {
    let mut covered: Vec<Range<u32>> = spans.iter().map(|span| span.start..span.end).collect();
    covered.sort_by_key(|range| range.start);
    for span in more {
        let after = covered.partition_point(|range| range.start < span.end);
        if after > 0 && covered[after - 1].end > span.start {
            continue;
        }
        let first = rows.len();
        rows.extend_from_slice(&more_rows[span.rows]);
        spans.push(Span { start: span.start, end: span.end, rows: first..rows.len() });
    }
}

/// The address range of one FDE, and where its rows are in the row buffer.
struct Span {
    start: u32,
    end: u32,
    rows: Range<usize>,
}

/// Evaluates every FDE of `section` into spans and their rows, in section order.
fn evaluate<'a, S: UnwindSection<Slice<'a>>>(
    section: &S,
    bases: &BaseAddresses,
    name: &'static str,
) -> Result<(Vec<Span>, Vec<UnwindRow>), TableError> {
    let cfi = |cause| TableError::Cfi { section: name, cause };
    let mut spans = Vec::new();
    let mut rows = Vec::new();
    let mut ctx = UnwindContext::new();
    let mut entries = section.entries(bases);
    while let Some(entry) = entries.next().map_err(cfi)? {
        let CieOrFde::Fde(partial) = entry else { continue };
        let fde = partial.parse(S::cie_from_offset).map_err(cfi)?;
        let start = fde.initial_address();
        // Linkers leave the FDEs of discarded functions in `.debug_frame` at a tombstone address,
        // 0 (GNU ld) or -1 (lld), where no code is.
        if fde.len() == 0 || start == 0 || start == u64::MAX {
            continue;
        }
        let end = start.checked_add(fde.len()).ok_or(TableError::AddressTooLarge(start))?;
        let too_large = |_| TableError::AddressTooLarge(end);
        let (start, end) = (u32::try_from(start).map_err(too_large)?, u32::try_from(end).map_err(too_large)?);
        let first = rows.len();
        // gimli refuses some instructions real files use (libgcrypt's hand-written assembly sets
        // the register of an expression CFA): the rows before stand, and from there on this FDE,
        // not the whole file, is unsupported.
        if let Err(pc) = fde_rows(&fde, section, bases, &mut ctx, start..end, &mut rows) {
            rows.push(UnwindRow { pc, cfa: cfa::UNSUPPORTED, ..UnwindRow::default() });
        }
        spans.push(Span { start, end, rows: first..rows.len() });
    }
    Ok((spans, rows))
}

/// Appends the rows of `fde`, which covers `range`, to `rows`. `Err`: an instruction could not be
/// evaluated, at or after the address it holds (in `range`).
fn fde_rows<'a, S: UnwindSection<Slice<'a>>>(
    fde: &FrameDescriptionEntry<Slice<'a>>,
    section: &S,
    bases: &BaseAddresses,
    ctx: &mut UnwindContext<usize>,
    range: Range<u32>,
    rows: &mut Vec<UnwindRow>,
) -> Result<(), u32> {
    let signal = fde.is_signal_trampoline();
    let mut table = fde.rows(section, bases, ctx).map_err(|_| range.start)?;
    // Where the row being evaluated begins.
    let mut next = range.start;
    while let Some(row) = table.next_row().map_err(|_| next)? {
        // Malformed CFI may advance past the FDE's end; addresses only grow from here.
        let Some(pc) = u32::try_from(row.start_address()).ok().filter(|pc| range.contains(pc)) else { break };
        rows.push(UnwindRow { pc, ..rule(row, signal, section).map_err(|_| pc)? });
        match u32::try_from(row.end_address()).ok().filter(|pc| range.contains(pc)) {
            Some(end) => next = end,
            None => break,
        }
    }
    Ok(())
}

/// The rule of one CFI row, everything of an [`UnwindRow`] but `pc`. Rows that end the walk carry
/// no offsets, so that neighbours alike merge.
fn rule<'a, S: UnwindSection<Slice<'a>>>(
    row: &UnwindTableRow<usize>,
    signal: bool,
    section: &S,
) -> gimli::Result<UnwindRow> {
    let only = |cfa| Ok(UnwindRow { cfa, ..UnwindRow::default() });
    if signal {
        // The trampoline's CFI describes the ucontext on its stack, which the BPF side reads itself.
        return only(cfa::SIGNAL);
    }
    match row.register(X86_64::RA) {
        // No rule at all is undefined too (DWARF's default); either way the thread begins here.
        None | Some(RegisterRule::Undefined) => return only(cfa::END),
        Some(RegisterRule::Offset(-8)) => {}
        Some(_) => return only(cfa::UNSUPPORTED),
    }
    let (kind, cfa_offset) = match row.cfa() {
        CfaRule::RegisterAndOffset { register, offset } => {
            let kind = match *register {
                X86_64::RSP => cfa::RSP,
                X86_64::RBP => cfa::RBP,
                _ => return only(cfa::UNSUPPORTED),
            };
            match i32::try_from(*offset) {
                Ok(offset) => (kind, offset),
                Err(_) => return only(cfa::UNSUPPORTED),
            }
        }
        CfaRule::Expression(expression) => {
            let expression = expression.get(section)?.0;
            if let Some(threshold) = plt_threshold(expression.slice()) {
                (cfa::PLT, i32::from(threshold))
            } else if let Some(offset) = rbp_relative(expression.slice(), true) {
                (cfa::RBP_DEREF, offset)
            } else {
                return only(cfa::UNSUPPORTED);
            }
        }
    };
    // A callee-saved register without a rule is unchanged by convention, as if SameValue.
    let (rbp, rbp_offset) = match row.register(X86_64::RBP) {
        None | Some(RegisterRule::Undefined | RegisterRule::SameValue) => (rbp::SAME, 0),
        Some(RegisterRule::Offset(offset)) => match i16::try_from(offset) {
            Ok(offset) => (rbp::SAVED, offset),
            Err(_) => (rbp::LOST, 0),
        },
        Some(RegisterRule::Expression(expression)) => {
            match rbp_relative(expression.get(section)?.0.slice(), false).and_then(|k| i16::try_from(k).ok()) {
                Some(offset) => (rbp::AT_RBP, offset),
                None => (rbp::LOST, 0),
            }
        }
        Some(_) => (rbp::LOST, 0),
    };
    Ok(UnwindRow { pc: 0, cfa_offset, rbp_offset, cfa: kind, rbp })
}

/// The `N` of `expression` if it is GNU ld's `.plt` expression.
fn plt_threshold(expression: &[u8]) -> Option<u8> {
    let threshold = expression.get(PLT_THRESHOLD_AT)?.checked_sub(gimli::DW_OP_lit0.0).filter(|&n| n <= 15)?;
    let matches = expression.len() == PLT_EXPRESSION.len()
        && expression
            .iter()
            .zip(PLT_EXPRESSION)
            .enumerate()
            .all(|(i, (&byte, want))| i == PLT_THRESHOLD_AT || byte == want);
    matches.then_some(threshold)
}

/// The `k` of `DW_OP_breg6 (rbp) k`, followed by `DW_OP_deref` when `deref`: the forms gcc
/// gives a function that realigns its stack (`DW_CFA_def_cfa_expression` for the CFA, with
/// `deref`, and `DW_CFA_expression` for where rbp is saved).
fn rbp_relative(expression: &[u8], deref: bool) -> Option<i32> {
    let (&op, rest) = expression.split_first()?;
    if op != gimli::DW_OP_breg6.0 {
        return None;
    }
    let mut operand = EndianSlice::new(rest, LittleEndian);
    let offset = operand.read_sleb128().ok()?;
    let tail: &[u8] = if deref { &[gimli::DW_OP_deref.0] } else { &[] };
    if operand.slice() != tail {
        return None;
    }
    i32::try_from(offset).ok()
}

/// Adds a span for each function of the symbol tables that no FDE covers (code built without
/// unwind tables, such as musl), with rows from its prologue. The function at the entry point is
/// left out: `_start` has no caller, and [`FileTable::end_at_entry_point`] ends stacks there.
fn add_functions(file: &ElfFile64<'_, object::Endianness>, spans: &mut Vec<Span>, rows: &mut Vec<UnwindRow>) {
    let mut covered: Vec<Range<u32>> = spans.iter().map(|span| span.start..span.end).collect();
    covered.sort_by_key(|range| range.start);
    let mut functions: Vec<_> = file
        .symbols()
        .chain(file.dynamic_symbols())
        .filter(|symbol| symbol.kind() == SymbolKind::Text && symbol.size() > 0)
        .filter_map(|symbol| Some((symbol.address(), symbol.size(), symbol.section_index()?)))
        .collect();
    // Aliases (`malloc` and `__libc_malloc`, `.symtab` and `.dynsym`) are one function.
    functions.sort_by_key(|&(address, size, _)| (address, size));
    functions.dedup_by_key(|&mut (address, ..)| address);
    let entry = file.entry();
    for (address, size, section) in functions {
        let Some(end) = address.checked_add(size) else { continue };
        let (Ok(start), Ok(end)) = (u32::try_from(address), u32::try_from(end)) else { continue };
        let before = covered.partition_point(|range| range.start <= start);
        if (address..u64::from(end)).contains(&entry) || before > 0 && covered[before - 1].contains(&start) {
            continue;
        }
        let code =
            file.section_by_index(section).ok().and_then(|section| section.data_range(address, size).ok().flatten());
        let Some(code) = code else { continue };
        let first = rows.len();
        rows.extend(prologue::rows(code, start).into_iter().filter(|row| row.pc < end));
        spans.push(Span { start, end, rows: first..rows.len() });
    }
}

/// Where Go starts a goroutine (`goexit`, its return address), a thread, and the program.
const GO_OUTERMOST: [&str; 3] = ["runtime.goexit", "runtime.mstart", "runtime.rt0_go"];

/// Adds a span with the frame-pointer rule for each function of a Go program that no FDE covers:
/// Go keeps a frame pointer in all its code, but has no CFI for its assembly, nor for any of its
/// code in a program the system's linker linked (cgo) and stripped of its `.debug_frame`. The
/// functions a goroutine or a thread starts in are its outermost frames, where stacks end.
fn add_go_functions(go: &GoFunctions, table: &[u8], spans: &mut Vec<Span>, rows: &mut Vec<UnwindRow>) {
    let outermost: Vec<Range<u64>> = go.find(table, &GO_OUTERMOST).into_iter().map(|(_, range)| range).collect();
    let mut more_rows = Vec::new();
    let mut more = Vec::new();
    for range in go.ranges() {
        let (Ok(start), Ok(end)) = (u32::try_from(range.start), u32::try_from(range.end)) else { continue };
        let rule = if outermost.contains(&range) {
            UnwindRow { cfa: cfa::END, ..UnwindRow::default() }
        } else {
            FRAME_POINTER_ROW
        };
        more_rows.push(UnwindRow { pc: start, ..rule });
        more.push(Span { start, end, rows: more_rows.len() - 1..more_rows.len() });
    }
    add_uncovered(spans, rows, more, &more_rows);
}

/// The sorted table of the spans' rows, with a `cfa::NONE` row wherever no FDE begins where the
/// previous one ends, and after the last. FDEs rarely overlap; when they do, the one that starts
/// later (or comes later in the section, at the same start) wins from its start on, and what the
/// earlier one covered past the later one's end is left to a NONE row.
fn merge(mut spans: Vec<Span>, rows: &[UnwindRow]) -> Vec<UnwindRow> {
    spans.sort_by_key(|span| span.start);
    let mut table = Vec::with_capacity(rows.len() + spans.len());
    let none = |pc| UnwindRow { pc, cfa: cfa::NONE, ..UnwindRow::default() };
    let mut end = None;
    for span in &spans {
        if let Some(end) = end.filter(|&end| end < span.start) {
            push(&mut table, none(end));
        }
        // Only rows of earlier FDEs can be popped here, never a NONE row: those lie before the start.
        while table.last().is_some_and(|row| row.pc >= span.start) {
            table.pop();
        }
        for &row in &rows[span.rows.clone()] {
            push(&mut table, row);
        }
        end = Some(span.end);
    }
    if let Some(end) = end {
        push(&mut table, none(end));
    }
    table
}

/// Appends `row`, whose pc is not below the last row's: a row at the same pc replaces the last
/// (CFI may advance by 0), and a row with the same rule as the last adds nothing.
fn push(table: &mut Vec<UnwindRow>, row: UnwindRow) {
    if table.last().is_some_and(|last| last.pc == row.pc) {
        table.pop();
    }
    if table.last().is_some_and(|last| UnwindRow { pc: row.pc, ..*last } == row) {
        return;
    }
    table.push(row);
}

#[cfg(test)]
mod tests;
