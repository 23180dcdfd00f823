//! The table builder against readelf's own reading of the same CFI.

use std::{collections::HashMap, fs, ops::Range, path::Path, process::Command};

use object::ObjectSymbol;

use super::*;
use crate::compiled::{compile, run};

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

/// A function that realigns its stack: a 64-byte aligned local beside a variable-length array.
/// gcc reaches the CFA through a DRAP register (r10) in the prologue, then through a slot below
/// rbp (`DW_OP_breg6 k; DW_OP_deref`), and says rbp is saved at rbp (`DW_OP_breg6 0`).
const REALIGNED: &str = r#"
#include <string.h>
__attribute__((noipa)) long consume(const char *p, long n) {
    long s = 0;
    for (long i = 0; i < n; i++) s += p[i];
    return s;
}
__attribute__((noinline, noclone)) long realigned(long n) {
    char vla[n];
    _Alignas(64) char block[64];
    memset(vla, 1, n);
    memset(block, 2, sizeof block);
    return consume(vla, n) + consume(block, sizeof block);
}
int main(int argc, char **argv) {
    (void)argv;
    return (int)realigned(argc * 100) & 1;
}
"#;

/// What `readelf DUMP PATH` prints. It exits 1 on Debian's libc.so.6 without saying why,
/// having printed everything, so its exit status is not checked.
fn readelf(dump: &str, path: &Path) -> String {
    let output = Command::new("readelf").arg(dump).arg(path).output().expect("readelf (binutils) is installed");
    let text = String::from_utf8(output.stdout).unwrap();
    assert!(text.contains("Contents of the"), "readelf {dump} {path:?}: {}", String::from_utf8_lossy(&output.stderr));
    text
}

fn table(path: &Path) -> FileTable {
    build(&fs::read(path).unwrap()).unwrap().expect("the file has CFI")
}

fn hex(text: &str) -> u64 {
    u64::from_str_radix(text, 16).unwrap()
}

/// One FDE as `readelf --debug-dump=frames-interp` shows it: rows of rules by column name
/// ("CFA", "rbp", "ra", ...), the first at `start`. Where a rule is "exp", the interpreted dump
/// does not say which expression: `expressions` has those the FDE's instructions set.
struct ReadelfFde {
    start: u64,
    end: u64,
    signal: bool,
    rows: Vec<(u64, HashMap<String, String>)>,
    expressions: Expressions,
}

/// The distinct expressions an FDE's instructions give the CFA and rbp, as readelf prints
/// them (`DW_OP_breg6 (rbp): -24; DW_OP_deref`).
#[derive(Clone, Default)]
struct Expressions {
    cfa: Vec<String>,
    rbp: Vec<String>,
}

/// The expressions of each FDE of the first CFI section, by its `pc=` range, from readelf's
/// dump of the instructions.
fn readelf_expressions(path: &Path) -> HashMap<String, Expressions> {
    let text = readelf("--debug-dump=frames", path);
    let mut fdes: HashMap<String, Expressions> = HashMap::new();
    let mut current: Option<&mut Expressions> = None;
    for line in text.lines().skip_while(|line| !line.starts_with("Contents of")).skip(1) {
        if line.starts_with("Contents of") {
            break;
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        if let [_, _, _, "FDE", _, pc] = words[..] {
            current = Some(fdes.entry(pc.to_string()).or_default());
        } else if words.get(3) == Some(&"CIE") {
            current = None;
        }
        let Some(fde) = current.as_deref_mut() else { continue };
        // The operations are inside the instruction's last parentheses.
        let inside = |prefix: &str| Some(line.trim().strip_prefix(prefix)?.strip_suffix(')')?.to_string());
        let (list, expression) = match (inside("DW_CFA_def_cfa_expression ("), inside("DW_CFA_expression: r6 (rbp) ("))
        {
            (Some(cfa), _) => (&mut fde.cfa, cfa),
            (_, Some(rbp)) => (&mut fde.rbp, rbp),
            _ => continue,
        };
        if !list.contains(&expression) {
            list.push(expression);
        }
    }
    fdes
}

/// The FDEs of the first CFI section readelf dumps (`.eh_frame` if there is one), sorted.
fn readelf_fdes(path: &Path) -> Vec<ReadelfFde> {
    let mut expressions = readelf_expressions(path);
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
                let expressions = expressions.remove(pc).unwrap_or_default();
                fdes.push(ReadelfFde { start, end, signal, rows: vec![(start, rules)], expressions });
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

/// The one expression of `list`, which readelf's "exp" at some row of the FDE must be.
fn only_expression<'a>(list: &'a [String], what: &str) -> &'a str {
    match list {
        [one] => one,
        _ => panic!("the FDE gives {what} the expressions {list:?}: which one a row has is unknown"),
    }
}

/// The CFA rule the expression `text` (as readelf prints it) calls for.
fn cfa_expression(text: &str) -> (u8, i32) {
    const PLT: (&str, &str) = (
        "DW_OP_breg7 (rsp): 8; DW_OP_breg16 (rip): 0; DW_OP_lit15; DW_OP_and; DW_OP_lit",
        "; DW_OP_ge; DW_OP_lit3; DW_OP_shl; DW_OP_plus",
    );
    let drap = text.strip_prefix("DW_OP_breg6 (rbp): ").and_then(|rest| rest.strip_suffix("; DW_OP_deref"));
    let plt = text.strip_prefix(PLT.0).and_then(|rest| rest.strip_suffix(PLT.1));
    match (drap.map(str::parse), plt.map(str::parse)) {
        (Some(Ok(offset)), _) => (cfa::RBP_DEREF, offset),
        (_, Some(Ok(threshold))) => (cfa::PLT, threshold),
        _ => (cfa::UNSUPPORTED, 0),
    }
}

/// The row readelf's `rules` call for (pc aside), in an FDE with those `expressions`.
fn expected(rules: &HashMap<String, String>, signal: bool, expressions: &Expressions) -> UnwindRow {
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
        ("exp", ..) => cfa_expression(only_expression(&expressions.cfa, "the CFA")),
        (_, Some("rsp"), Some(Ok(offset))) => (cfa::RSP, offset),
        (_, Some("rbp"), Some(Ok(offset))) => (cfa::RBP, offset),
        _ => (cfa::UNSUPPORTED, 0),
    };
    if kind == cfa::UNSUPPORTED {
        return only(kind);
    }
    let (rbp, rbp_offset) = match rule("rbp") {
        "u" | "s" => (rbp::SAME, 0),
        "exp" => match only_expression(&expressions.rbp, "rbp").strip_prefix("DW_OP_breg6 (rbp): ").map(str::parse) {
            Some(Ok(offset)) => (rbp::AT_RBP, offset),
            _ => (rbp::LOST, 0),
        },
        saved => match saved.strip_prefix('c').map(str::parse) {
            Some(Ok(offset)) => (rbp::SAVED, offset),
            _ => (rbp::LOST, 0),
        },
    };
    UnwindRow { pc: 0, cfa_offset, rbp_offset, cfa: kind, rbp }
}

/// How many `cfa::` kinds there are, for counts by kind.
const CFA_KINDS: usize = cfa::RBP_DEREF as usize + 1;

/// Checks the table of `path` against readelf at every row of every FDE; returns how many rows
/// were checked, by `cfa::` kind.
fn check_against_readelf(path: &Path) -> [usize; CFA_KINDS] {
    let table = table(path);
    let mut checked = [0; CFA_KINDS];
    for fde in readelf_fdes(path) {
        for (loc, rules) in fde.rows.iter().filter(|(loc, _)| *loc < fde.end) {
            let want = expected(rules, fde.signal, &fde.expressions);
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
fn stack_realigning_rows_match_readelf() {
    for (name, frame_pointers) in [("realigned", "-fomit-frame-pointer"), ("realigned-fp", "-fno-omit-frame-pointer")] {
        let binary = compile(name, REALIGNED, &["-O2", "-g", frame_pointers]);
        let checked = check_against_readelf(&binary.path);
        assert!(checked[usize::from(cfa::RBP_DEREF)] > 0, "{frame_pointers}: {checked:?}");
        let rows = table(&binary.path).rows;
        assert!(
            rows.iter().any(|row| row.cfa == cfa::RBP_DEREF && row.rbp == rbp::AT_RBP),
            "{frame_pointers}: {rows:?}"
        );
    }
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

mod properties {
    use proptest::{prelude::*, sample::Index};

    use super::*;

    /// A small real executable with `.eh_frame`, its CFI section and its section headers: where
    /// a corruption reaches the parsers rather than the ELF header check.
    fn target() -> &'static (Vec<u8>, [Range<usize>; 3]) {
        static TARGET: std::sync::OnceLock<(Vec<u8>, [Range<usize>; 3])> = std::sync::OnceLock::new();
        TARGET.get_or_init(|| {
            let elf = fs::read("/usr/bin/true").unwrap();
            let file = ElfFile64::<object::Endianness>::parse(&elf[..]).unwrap();
            let (offset, size) = file.section_by_name(".eh_frame").unwrap().file_range().unwrap();
            let headers = u64::from_le_bytes(elf[0x28..0x30].try_into().unwrap()) as usize;
            let ranges = [0..elf.len(), offset as usize..(offset + size) as usize, headers..elf.len()];
            (elf, ranges)
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn mutated_and_truncated_elf_files_give_a_table_or_an_error(
            region in 0..3usize,
            flips in prop::collection::vec((any::<Index>(), any::<u8>()), 1..24),
            cut in prop::option::of(any::<Index>()),
        ) {
            let (elf, regions) = target();
            let mut bytes = elf.clone();
            let region = &regions[region];
            for (at, value) in flips {
                bytes[region.start + at.index(region.len())] = value;
            }
            if let Some(cut) = cut {
                bytes.truncate(cut.index(bytes.len()));
            }
            let _ = build(&bytes);
        }
    }
}

/// The rows `prologue::rows` gives the function at 0x1000 whose bytes are `code`, as
/// (offset in the function, cfa kind, cfa offset, rbp kind, rbp offset).
fn prologue_rows(code: &[u8]) -> Vec<(u32, u8, i32, u8, i16)> {
    prologue::rows(code, 0x1000)
        .iter()
        .map(|row| (row.pc - 0x1000, row.cfa, row.cfa_offset, row.rbp, row.rbp_offset))
        .collect()
}

const CALL: [u8; 5] = [0xe8, 0, 0, 0, 0];

#[test]
fn musl_strdup_prologue_saves_rbp_among_pushes() {
    // push %r12; push %rbp; mov %rdi,%rbp; sub $8,%rsp; call strlen
    let code = [&[0x41, 0x54, 0x55, 0x48, 0x89, 0xfd, 0x48, 0x83, 0xec, 0x08][..], &CALL].concat();
    assert_eq!(
        prologue_rows(&code),
        [
            (0, cfa::RSP, 8, rbp::SAME, 0),
            (2, cfa::RSP, 16, rbp::SAME, 0),
            (3, cfa::RSP, 24, rbp::SAVED, -24),
            (10, cfa::RSP, 32, rbp::SAVED, -24),
        ]
    );
}

#[test]
fn frame_pointer_prologue_makes_the_cfa_rbp_based() {
    // endbr64; push %rbp; mov %rsp,%rbp; push %rbx; sub $0x108,%rsp; call
    let code = [&[0xf3, 0x0f, 0x1e, 0xfa, 0x55, 0x48, 0x89, 0xe5, 0x53, 0x48, 0x81, 0xec, 0x08, 0x01, 0, 0][..], &CALL]
        .concat();
    assert_eq!(
        prologue_rows(&code),
        [(0, cfa::RSP, 8, rbp::SAME, 0), (5, cfa::RSP, 16, rbp::SAVED, -16), (8, cfa::RBP, 16, rbp::SAVED, -16)]
    );
}

#[test]
fn instructions_between_pushes_are_stepped_over() {
    // musl's libc_start_main_stage2: push %r13; movslq %esi,%rax; push %r12;
    // lea 0x8(%rdx,%rax,8),%r13; mov %rdx,%r12; push %rbp; mov %rax,%rbp; push %rbx;
    // mov %rdi,%rbx; sub $8,%rsp; call
    let code = [
        &[0x41, 0x55, 0x48, 0x63, 0xc6, 0x41, 0x54, 0x4c, 0x8d, 0x6c, 0xc2, 0x08, 0x49, 0x89, 0xd4, 0x55][..],
        &[0x48, 0x89, 0xc5, 0x53, 0x48, 0x89, 0xfb, 0x48, 0x83, 0xec, 0x08],
        &CALL,
    ]
    .concat();
    assert_eq!(
        prologue_rows(&code),
        [
            (0, cfa::RSP, 8, rbp::SAME, 0),
            (2, cfa::RSP, 16, rbp::SAME, 0),
            (7, cfa::RSP, 24, rbp::SAME, 0),
            (16, cfa::RSP, 32, rbp::SAVED, -32),
            (20, cfa::RSP, 40, rbp::SAVED, -32),
            (27, cfa::RSP, 48, rbp::SAVED, -32),
        ]
    );
}

#[test]
fn a_shrink_wrapped_prologue_after_an_early_exit_is_found() {
    // test %rdi,%rdi; je +1; ret; push %rbx; call
    let code = [&[0x48, 0x85, 0xff, 0x74, 0x01, 0xc3, 0x53][..], &CALL].concat();
    assert_eq!(prologue_rows(&code), [(0, cfa::RSP, 8, rbp::SAME, 0), (7, cfa::RSP, 16, rbp::SAME, 0)]);
}

#[test]
fn what_the_decoder_cannot_follow_is_unsupported() {
    let unsupported = |at| (at, cfa::UNSUPPORTED, 0, rbp::SAME, 0);
    // ud2: not an instruction the decoder knows.
    assert_eq!(prologue_rows(&[0x0f, 0x0b]), [unsupported(0)]);
    // A call with rsp misaligned by the rule found: not a prologue the decoder understood.
    assert_eq!(prologue_rows(&CALL), [unsupported(0)]);
    // push %rbp; and $-16,%rsp: realigning the stack without a frame pointer.
    assert_eq!(prologue_rows(&[0x55, 0x48, 0x83, 0xe4, 0xf0]), [(0, cfa::RSP, 8, rbp::SAME, 0), unsupported(1)]);
    // A function that never calls and runs past the decoder's budget.
    let long = [0x90; 100];
    assert_eq!(prologue_rows(&long), [(0, cfa::RSP, 8, rbp::SAME, 0), unsupported(64)]);
}

#[test]
fn writing_rbp_before_saving_it_loses_the_callers_rbp() {
    // mov %rdi,%rbp; push %rbx; call
    let code = [&[0x48, 0x89, 0xfd, 0x53][..], &CALL].concat();
    assert_eq!(
        prologue_rows(&code),
        [(0, cfa::RSP, 8, rbp::SAME, 0), (3, cfa::RSP, 8, rbp::LOST, 0), (4, cfa::RSP, 16, rbp::LOST, 0)]
    );
}

#[test]
fn thread_pointer_reads_and_syscalls_are_stepped_over() {
    // mov %fs:0,%rax; syscall; push %rbx; call
    let code = [&[0x64, 0x48, 0x8b, 0x04, 0x25, 0, 0, 0, 0, 0x0f, 0x05, 0x53][..], &CALL].concat();
    assert_eq!(prologue_rows(&code), [(0, cfa::RSP, 8, rbp::SAME, 0), (12, cfa::RSP, 16, rbp::SAME, 0)]);
}
