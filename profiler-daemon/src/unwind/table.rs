//! A file's unwind table for the eBPF stack walker, built from its DWARF call frame information.
//!
//! The walker cannot run CFI programs in the kernel, so they are evaluated here, once per file,
//! into one sorted table of [`UnwindRow`]s: for each address range, which of the few rules x86_64
//! code actually uses finds the caller's frame.

use std::{borrow::Cow, ops::Range};

use gimli::{
    BaseAddresses, CfaRule, CieOrFde, DebugFrame, EhFrame, EndianSlice, FrameDescriptionEntry, LittleEndian,
    RegisterRule, UnwindContext, UnwindSection, UnwindTableRow, X86_64,
};
use object::{read::elf::ElfFile64, Architecture, Object, ObjectSection};
use profiler_common::{cfa, rbp, UnwindRow};

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
    #[error("cannot read {section}: {source}")]
    Section { section: &'static str, source: object::Error },
    #[error("malformed CFI in {section}: {source}")]
    Cfi { section: &'static str, source: gimli::Error },
    #[error("CFI address {0:#x} does not fit in 32 bits")]
    AddressTooLarge(u64),
}

/// Builds the unwind table of the ELF file `elf` from its `.eh_frame`, or from its `.debug_frame`
/// when it has no `.eh_frame`. `Ok(None)`: the file has no CFI (neither section, or no FDE in it);
/// the caller falls back to frame pointers.
pub fn build(elf: &[u8]) -> Result<Option<FileTable>, TableError> {
    let file = ElfFile64::<object::Endianness>::parse(elf).map_err(TableError::NotElf)?;
    if file.architecture() != Architecture::X86_64 {
        return Err(TableError::NotX86_64(file.architecture()));
    }
    let (spans, rows) = if let Some(section) = read_section(&file, ".eh_frame")? {
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
        evaluate(&eh_frame, &bases, ".eh_frame")?
    } else if let Some(section) = read_section(&file, ".debug_frame")? {
        let mut debug_frame = DebugFrame::new(&section.data, LittleEndian);
        debug_frame.set_address_size(8);
        evaluate(&debug_frame, &BaseAddresses::default(), ".debug_frame")?
    } else {
        return Ok(None);
    };
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
    // A compressed `.debug_frame` is an error here: object decompresses only with its
    // `compression` feature, which memprof leaves out.
    let data = section.uncompressed_data().map_err(|source| TableError::Section { section: name, source })?;
    Ok((!data.is_empty()).then(|| Section { data, address: section.address() }))
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
    let cfi = |source| TableError::Cfi { section: name, source };
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
        CfaRule::Expression(expression) => match plt_threshold(expression.get(section)?.0.slice()) {
            Some(threshold) => (cfa::PLT, i32::from(threshold)),
            None => return only(cfa::UNSUPPORTED),
        },
    };
    // A callee-saved register without a rule is unchanged by convention, as if SameValue.
    let (rbp, rbp_offset) = match row.register(X86_64::RBP) {
        None | Some(RegisterRule::Undefined | RegisterRule::SameValue) => (rbp::SAME, 0),
        Some(RegisterRule::Offset(offset)) => match i16::try_from(offset) {
            Ok(offset) => (rbp::SAVED, offset),
            Err(_) => (rbp::LOST, 0),
        },
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
mod tests {
    use std::{
        collections::HashMap,
        fs,
        ops::Range,
        path::{Path, PathBuf},
        process::Command,
    };

    use object::ObjectSymbol;

    use super::*;

    const LIBC: &str = "/usr/lib/x86_64-linux-gnu/libc.so.6";

    /// Frames the walker meets most: a large stack frame, a variable-length array (its CFA is
    /// rbp-based), many callee-saved registers, and calls through the PLT.
    const FIXTURE: &str = r#"
#include <stdio.h>
#include <string.h>
__attribute__((noipa)) long consume(const char *p, long n) {
    long s = 0;
    for (long i = 0; i < n; i += 64) s += p[i];
    return s;
}
__attribute__((noinline)) long big_frame(long n) {
    char buf[200000];
    memset(buf, (int)n, sizeof buf);
    return consume(buf, sizeof buf);
}
__attribute__((noinline)) long vla(long n) {
    char buf[n];
    memset(buf, 1, n);
    return consume(buf, n);
}
__attribute__((noinline)) long saves(long a, long b, long c) {
    long x = consume("abc", a), y = consume("de", b), z = consume("f", c);
    return x * y + consume("g", x + y + z) + a * b * c;
}
int main(int argc, char **argv) {
    long n = argc * 100;
    printf("%ld\n", big_frame(n) + vla(n) + saves(n, argc, 3));
    return 0;
}
"#;

    fn run(command: &mut Command) -> String {
        let output = command.output().unwrap_or_else(|e| panic!("{command:?}: {e}"));
        assert!(output.status.success(), "{command:?}: {}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8(output.stdout).unwrap()
    }

    /// A binary compiled for one test, deleted with its directory when dropped.
    struct Binary {
        dir: PathBuf,
        path: PathBuf,
    }

    impl Drop for Binary {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }

    /// Compiles `source` with `cc` and `flags` in a directory of its own, named after `test`.
    fn compile(test: &str, source: &str, flags: &[&str]) -> Binary {
        let dir = std::env::temp_dir().join(format!("memprof-table-{}-{test}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let binary = Binary { path: dir.join("fixture"), dir };
        fs::write(binary.dir.join("fixture.c"), source).unwrap();
        run(Command::new("cc").args(flags).arg(binary.dir.join("fixture.c")).arg("-o").arg(&binary.path));
        binary
    }

    /// What `readelf DUMP PATH` prints. It exits 1 on Debian's libc.so.6 without saying why,
    /// having printed everything, so its exit status is not checked.
    fn readelf(dump: &str, path: &Path) -> String {
        let output = Command::new("readelf").arg(dump).arg(path).output().expect("readelf (binutils) is installed");
        let text = String::from_utf8(output.stdout).unwrap();
        assert!(
            text.contains("Contents of the"),
            "readelf {dump} {path:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        text
    }

    fn table(path: &Path) -> FileTable {
        build(&fs::read(path).unwrap()).unwrap().expect("the file has CFI")
    }

    fn hex(text: &str) -> u64 {
        u64::from_str_radix(text, 16).unwrap()
    }

    /// One FDE as `readelf --debug-dump=frames-interp` shows it: rows of rules by column name
    /// ("CFA", "rbp", "ra", ...), the first at `start`.
    struct ReadelfFde {
        start: u64,
        end: u64,
        signal: bool,
        rows: Vec<(u64, HashMap<String, String>)>,
    }

    /// The FDEs of the first CFI section readelf dumps (`.eh_frame` if there is one), sorted.
    fn readelf_fdes(path: &Path) -> Vec<ReadelfFde> {
        let text = readelf("--debug-dump=frames-interp", path);
        // By offset: whether the CIE is a signal trampoline's, and its rules, which an FDE
        // without instructions (readelf shows no rows for it) keeps.
        let mut cies: HashMap<&str, (bool, HashMap<String, String>)> = HashMap::new();
        let mut fdes: Vec<ReadelfFde> = Vec::new();
        let mut cie = None;
        let mut columns: Vec<String> = Vec::new();
        for line in text.lines().skip_while(|line| !line.starts_with("Contents of")).skip(1) {
            let words: Vec<&str> = line.split_whitespace().collect();
            match words[..] {
                ["Contents", "of", ..] => break,
                [offset, _, _, "CIE", augmentation, ..] => {
                    cies.insert(offset, (augmentation.contains('S'), HashMap::new()));
                    cie = Some(offset);
                }
                [_, _, _, "FDE", of, pc] => {
                    let (signal, rules) = cies[of.trim_start_matches("cie=")].clone();
                    let (start, end) = pc.trim_start_matches("pc=").split_once("..").unwrap();
                    let (start, end) = (hex(start), hex(end));
                    fdes.push(ReadelfFde { start, end, signal, rows: vec![(start, rules)] });
                    cie = None;
                }
                ["LOC", ref names @ ..] => columns = names.iter().map(|name| name.to_string()).collect(),
                [loc, ref cells @ ..] if loc.len() == 16 => {
                    // A register rule, "r9 (r9)", holds a space.
                    let mut rules: Vec<String> = Vec::new();
                    for cell in cells {
                        match rules.last_mut() {
                            Some(rule) if cell.starts_with('(') => *rule += cell,
                            _ => rules.push(cell.to_string()),
                        }
                    }
                    let rules = columns.iter().cloned().zip(rules).collect();
                    match cie {
                        Some(offset) => cies.get_mut(offset).unwrap().1 = rules,
                        None => {
                            let rows = &mut fdes.last_mut().unwrap().rows;
                            // A later row at the same location (or the FDE's first, at its start)
                            // replaces the CIE's.
                            if rows.last().is_some_and(|&(at, _)| at == hex(loc)) {
                                rows.pop();
                            }
                            rows.push((hex(loc), rules));
                        }
                    }
                }
                _ => {}
            }
        }
        fdes.retain(|fde| fde.end > fde.start);
        fdes.sort_by_key(|fde| fde.start);
        assert!(fdes.windows(2).all(|pair| pair[0].end <= pair[1].start), "overlapping FDEs in {path:?}");
        fdes
    }

    /// The address range of `.plt` and the threshold in its CFA expression, as readelf shows it.
    fn plt(path: &Path) -> Option<(Range<u64>, i32)> {
        let data = fs::read(path).unwrap();
        let file = ElfFile64::<object::Endianness>::parse(&*data).unwrap();
        let section = file.section_by_name(".plt")?;
        let frames = readelf("--debug-dump=frames", path);
        let (_, rest) = frames.split_once("DW_OP_lit15; DW_OP_and; DW_OP_lit")?;
        let threshold = rest.split(';').next()?.parse().ok()?;
        Some((section.address()..section.address() + section.size(), threshold))
    }

    /// The row readelf's `rules` call for (pc aside); `plt` says whether `exp` is the PLT's.
    fn expected(rules: &HashMap<String, String>, signal: bool, plt: Option<i32>) -> UnwindRow {
        let only = |cfa| UnwindRow { cfa, ..UnwindRow::default() };
        let rule = |column: &str| rules.get(column).map_or("u", String::as_str);
        if signal {
            return only(cfa::SIGNAL);
        }
        match rule("ra") {
            "u" => return only(cfa::END),
            "c-8" => {}
            _ => return only(cfa::UNSUPPORTED),
        }
        let cfa_rule = rule("CFA");
        let (kind, cfa_offset) = match (cfa_rule, cfa_rule.get(..3), cfa_rule.get(3..).map(str::parse)) {
            ("exp", ..) => match plt {
                Some(threshold) => (cfa::PLT, threshold),
                None => return only(cfa::UNSUPPORTED),
            },
            (_, Some("rsp"), Some(Ok(offset))) => (cfa::RSP, offset),
            (_, Some("rbp"), Some(Ok(offset))) => (cfa::RBP, offset),
            _ => return only(cfa::UNSUPPORTED),
        };
        let (rbp, rbp_offset) = match rule("rbp") {
            "u" | "s" => (rbp::SAME, 0),
            saved => match saved.strip_prefix('c').map(str::parse) {
                Some(Ok(offset)) => (rbp::SAVED, offset),
                _ => (rbp::LOST, 0),
            },
        };
        UnwindRow { pc: 0, cfa_offset, rbp_offset, cfa: kind, rbp }
    }

    /// Checks the table of `path` against readelf at every row of every FDE; returns how many rows
    /// were checked, by `cfa::` kind.
    fn check_against_readelf(path: &Path) -> [usize; 7] {
        let table = table(path);
        let plt = plt(path);
        let mut checked = [0; 7];
        for fde in readelf_fdes(path) {
            for (loc, rules) in fde.rows.iter().filter(|(loc, _)| *loc < fde.end) {
                let in_plt = plt.as_ref().filter(|(range, _)| range.contains(loc)).map(|&(_, threshold)| threshold);
                let want = expected(rules, fde.signal, in_plt);
                let got = table.lookup(*loc as u32).unwrap_or_else(|| panic!("no row at {loc:#x}"));
                assert_eq!(UnwindRow { pc: 0, ..*got }, want, "at {loc:#x} in {path:?}: readelf says {rules:?}");
                checked[usize::from(want.cfa)] += 1;
            }
        }
        checked
    }

    #[test]
    fn fixture_rows_match_readelf() {
        let binary = compile("fixture", FIXTURE, &["-O2", "-g"]);
        let checked = check_against_readelf(&binary.path);
        for kind in [cfa::RSP, cfa::RBP, cfa::PLT, cfa::END] {
            assert!(checked[usize::from(kind)] > 0, "no rows of kind {kind} checked: {checked:?}");
        }
        assert!(table(&binary.path).rows.iter().any(|row| row.cfa == cfa::RSP && row.cfa_offset > 200_000));
    }

    #[test]
    fn libc_rows_match_readelf() {
        let checked = check_against_readelf(Path::new(LIBC));
        assert!(checked.iter().sum::<usize>() > 10_000, "{checked:?}");
        // __restore_rt; clone's and clone3's child; setcontext, longjmp and vfork.
        assert!(checked[usize::from(cfa::SIGNAL)] >= 1, "{checked:?}");
        assert!(checked[usize::from(cfa::END)] >= 2, "{checked:?}");
        assert!(checked[usize::from(cfa::UNSUPPORTED)] >= 1, "{checked:?}");
    }

    #[test]
    fn debug_frame_is_read_without_eh_frame() {
        let binary = compile("debug-frame", FIXTURE, &["-O2", "-g", "-fno-asynchronous-unwind-tables"]);
        let stripped = binary.dir.join("stripped");
        run(Command::new("objcopy")
            .args(["--remove-section", ".eh_frame", "--remove-section", ".eh_frame_hdr"])
            .arg(&binary.path)
            .arg(&stripped));
        let checked = check_against_readelf(&stripped);
        assert!(checked[usize::from(cfa::RBP)] > 0, "{checked:?}");
    }

    #[test]
    fn gaps_are_none_and_plt_entries_plt() {
        let binary = compile("gaps", FIXTURE, &["-O2", "-g"]);
        let table = table(&binary.path);
        let fdes = readelf_fdes(&binary.path);
        assert_eq!(table.lookup(fdes[0].start as u32 - 1), None);
        let mut gaps = 0;
        for (fde, next) in fdes.iter().zip(fdes.iter().skip(1).map(Some).chain([None])) {
            let gap = fde.end..next.map_or(fde.end + 64, |next| next.start);
            for address in gap {
                assert_eq!(table.lookup(address as u32).unwrap().cfa, cfa::NONE, "at {address:#x}");
                gaps += 1;
            }
        }
        assert!(gaps > 64, "the fixture has no gap between FDEs");
        let (range, threshold) = plt(&binary.path).expect("the fixture calls through a .plt");
        assert_eq!(threshold, 11, "GNU ld's lazy PLT");
        // The first 16 bytes are the resolver's entry, with rules of their own.
        for address in range.start + 16..range.end {
            let row = table.lookup(address as u32).unwrap();
            assert_eq!((row.cfa, row.cfa_offset), (cfa::PLT, threshold), "at {address:#x}");
        }
    }

    #[test]
    fn an_instruction_gimli_refuses_makes_the_rest_of_its_fde_unsupported() {
        // `odd` does as libgcrypt's assembly: it sets a CFA register while the CFA is an
        // expression (`*(rsp + 16) + 8`), which DWARF does not allow. `unbalanced` restores a
        // state it never remembered.
        let source = r#"
__asm__(".globl odd\n.type odd, @function\nodd:\n.cfi_startproc\n"
        "push %rbx\n.cfi_adjust_cfa_offset 8\n.cfi_offset rbx, -16\n"
        "nop\n.cfi_escape 0x0f, 0x05, 0x77, 0x10, 0x06, 0x23, 0x08\n"
        "nop\n.cfi_def_cfa_register rsp\n"
        "nop\npop %rbx\n.cfi_adjust_cfa_offset -8\n"
        "ret\n.cfi_endproc\n.size odd, .-odd\n"
        ".globl unbalanced\n.type unbalanced, @function\nunbalanced:\n.cfi_startproc\n"
        "push %rbx\n.cfi_adjust_cfa_offset 8\n"
        "nop\n.cfi_escape 0x0b\n"
        "nop\npop %rbx\n.cfi_adjust_cfa_offset -8\n"
        "ret\n.cfi_endproc\n.size unbalanced, .-unbalanced\n");
int main(void) { return 0; }
"#;
        let binary = compile("refused", source, &["-O2"]);
        let data = fs::read(&binary.path).unwrap();
        let file = ElfFile64::<object::Endianness>::parse(&*data).unwrap();
        let table = build(&data).unwrap().unwrap();
        let rules = |function: &str| {
            let symbol = file.symbol_by_name(function).unwrap();
            (symbol.address()..symbol.address() + symbol.size())
                .map(|address| table.lookup(address as u32).map(|row| (row.cfa, row.cfa_offset)).unwrap())
                .collect::<Vec<_>>()
        };
        let (rsp, unsupported) = (|offset| (cfa::RSP, offset), (cfa::UNSUPPORTED, 0));
        // Were the instructions accepted, `odd` would be rsp-based again from byte 3, and
        // `unbalanced` rsp+16 from byte 1 and rsp+8 from byte 4.
        assert_eq!(rules("odd"), [rsp(8), rsp(16), unsupported, unsupported, unsupported, unsupported]);
        assert_eq!(rules("unbalanced"), [rsp(8), rsp(16), unsupported, unsupported, unsupported]);
    }

    #[test]
    fn merge_sorts_fills_gaps_and_resolves_overlaps() {
        let rule = |cfa, cfa_offset| UnwindRow { cfa, cfa_offset, ..UnwindRow::default() };
        let (x, y, z, w) = (rule(cfa::RSP, 8), rule(cfa::RSP, 16), rule(cfa::RBP, 16), rule(cfa::END, 0));
        let at = |pc, row: UnwindRow| UnwindRow { pc, ..row };
        let rows = [at(10, x), at(15, y), at(0, x), at(20, y), at(25, z), at(40, x), at(45, x), at(40, w)];
        let span = |start, end, rows| Span { start, end, rows };
        let spans = vec![
            span(10, 20, 0..2),
            span(0, 5, 2..3),
            span(20, 30, 3..4),
            // Nested in the one before.
            span(25, 28, 4..5),
            span(40, 50, 5..7),
            // The same range again, later in the section.
            span(40, 50, 7..8),
        ];
        let none = rule(cfa::NONE, 0);
        let want = [at(0, x), at(5, none), at(10, x), at(15, y), at(25, z), at(28, none), at(40, w), at(50, none)];
        assert_eq!(merge(spans, &rows), want);
    }

    /// `elf` with the size in the header of its section `name` set to `size`.
    fn with_section_size(elf: &[u8], name: &str, size: u64) -> Vec<u8> {
        let index = ElfFile64::<object::Endianness>::parse(elf).unwrap().section_by_name(name).unwrap().index().0;
        let section_headers = u64::from_le_bytes(elf[0x28..0x30].try_into().unwrap()) as usize;
        let sh_size = section_headers + index * 64 + 32;
        let mut bytes = elf.to_vec();
        bytes[sh_size..sh_size + 8].copy_from_slice(&size.to_le_bytes());
        bytes
    }

    #[test]
    fn corrupt_files_never_panic() {
        let fixture = fs::read(&compile("corrupt", FIXTURE, &["-O2", "-g"]).path).unwrap();
        let libc = fs::read(LIBC).unwrap();
        // xorshift64: the same corruptions every run.
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut random = move |below: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as usize % below
        };
        for (elf, flips) in [(&fixture, 2000), (&libc, 30)] {
            for cut in (0..64).map(|i| elf.len() * i / 64).chain([1, 63, 64, 65, elf.len() - 1]) {
                let _ = build(&elf[..cut]);
            }
            let file = ElfFile64::<object::Endianness>::parse(&elf[..]).unwrap();
            let (offset, size) = file.section_by_name(".eh_frame").unwrap().file_range().unwrap();
            for cut in (0..32).map(|i| size * i / 32).chain([1, 3, 4, 5, 8, size - 1]) {
                let _ = build(&with_section_size(elf, ".eh_frame", cut));
            }
            for _ in 0..flips {
                let mut bytes = elf.clone();
                for _ in 0..1 + random(8) {
                    bytes[offset as usize + random(size as usize)] ^= 1 << random(8);
                }
                let _ = build(&bytes);
            }
        }
    }

    #[test]
    fn files_without_cfi_have_no_table() {
        let flags = ["-O2", "-nostdlib", "-static", "-fno-asynchronous-unwind-tables", "-fno-unwind-tables"];
        let binary = compile("no-cfi", "void _start(void) { for (;;) ; }\n", &flags);
        assert!(matches!(build(&fs::read(&binary.path).unwrap()), Ok(None)));
    }

    #[test]
    fn rejects_what_it_cannot_index() {
        assert!(matches!(build(b"#!/bin/sh\n"), Err(TableError::NotElf(_))));
        let mut arm = fs::read(LIBC).unwrap();
        arm[18..20].copy_from_slice(&object::elf::EM_AARCH64.to_le_bytes());
        assert!(matches!(build(&arm), Err(TableError::NotX86_64(_))));
        // PIE, so that the code links at all above 4 GiB.
        let high = compile("high", FIXTURE, &["-O2", "-fPIE", "-pie", "-Wl,-Ttext-segment=0x100000000"]);
        assert!(matches!(build(&fs::read(&high.path).unwrap()), Err(TableError::AddressTooLarge(_))));
    }
}
