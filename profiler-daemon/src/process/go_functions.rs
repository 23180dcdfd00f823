//! A Go program's own table of its functions, `.gopclntab`: every Go program keeps it, stripped or
//! not, because its runtime prints and walks its stacks by it. It gives each function's address
//! range and name, and each address's file and line. memprof reads it where a stripped Go program
//! has no symbol table: to find the functions `--usdt` probes (`go_runtime`) and to name the
//! frames of its stacks (`symbolize`).
//!
//! The layout is the runtime's `pcHeader`, `functab` and `_func` (`runtime/symtab.go`), the same
//! in the fields read here from Go 1.18 on, but for where the code starts (`text_start`). A
//! function Go inlined into another is named by the function it is inlined into: its inlining
//! tree is not in this table.

use std::{borrow::Cow, fs::File, os::unix::fs::FileExt};

use object::{Object as _, ObjectSection as _, ObjectSegment as _};

/// `pcHeader.magic` of Go 1.18 and 1.19, and of Go 1.20 on.
const MAGICS: [u32; 2] = [0xffff_fff0, 0xffff_fff1];
/// The header's size: its magic, two pads, the instruction size, the pointer size, then eight
/// 8-byte fields.
const HEADER: usize = 8 + 8 * 8;
/// Most functions a table is read with: the largest Go programs have a few hundred thousand, and
/// the index takes 8 bytes each.
const MAX_FUNCTIONS: usize = 1 << 21;
/// Longest name or path read.
const MAX_TEXT: usize = 4096;
/// Most bytes of one function's line or file table read: the tables of the largest functions of
/// Go's runtime take a few KiB. They are read a first time shorter.
const MAX_PC_TABLE: usize = 64 * 1024;
const PC_TABLE_FIRST_READ: usize = 1024;

/// The sections that hold the table: Go's linker names it `.gopclntab`, or
/// `.data.rel.ro.gopclntab` in a position-independent program.
const SECTIONS: [&str; 2] = [".gopclntab", ".data.rel.ro.gopclntab"];

/// The table's bytes, where they are: in memory or in the file.
pub trait TableBytes {
    /// Up to `len` bytes from `offset` in the table, fewer at its end; none past it.
    fn at(&self, offset: u64, len: usize) -> Option<Cow<'_, [u8]>>;
}

impl TableBytes for [u8] {
    fn at(&self, offset: u64, len: usize) -> Option<Cow<'_, [u8]>> {
        let start = usize::try_from(offset).ok().filter(|&start| start < self.len())?;
        Some(Cow::Borrowed(&self[start..self.len().min(start.saturating_add(len))]))
    }
}

/// The table read from its file as it is asked for: a program's table takes megabytes, of which
/// a profile names a few hundred functions.
pub struct FileTable<'a> {
    pub file: &'a File,
    /// Where the table starts in the file, and its size.
    pub start: u64,
    pub size: u64,
}

impl TableBytes for FileTable<'_> {
    fn at(&self, offset: u64, len: usize) -> Option<Cow<'_, [u8]>> {
        let available = self.size.checked_sub(offset).filter(|&left| left > 0)?;
        let mut bytes = vec![0; len.min(usize::try_from(available).unwrap_or(len))];
        let read = self.file.read_at(&mut bytes, self.start.saturating_add(offset)).ok()?;
        bytes.truncate(read);
        Some(Cow::Owned(bytes))
    }
}

/// Where the table is in `elf`'s file (offset, size), from its section.
pub fn section_range<'data>(elf: &impl object::Object<'data>) -> Option<(u64, u64)> {
    SECTIONS.iter().find_map(|name| elf.section_by_name(name)?.file_range())
}

/// The table's bytes in `elf`.
pub fn section_data<'data>(elf: &impl object::Object<'data>) -> Option<&'data [u8]> {
    SECTIONS.iter().find_map(|name| elf.section_by_name(name)?.data().ok())
}

/// A Go program without a symbol table: its function table, read from its open file.
pub struct StrippedGo {
    start: u64,
    size: u64,
    functions: GoFunctions,
    /// The loaded segments' file ranges and addresses, to turn a file offset into the address
    /// the table knows.
    segments: Vec<(std::ops::Range<u64>, u64)>,
}

impl StrippedGo {
    /// `file`'s table, when it is a Go program without a symbol table.
    pub fn read(file: &File) -> Option<Self> {
        let cache = object::ReadCache::new(file);
        let elf = object::File::parse(&cache).ok()?;
        if elf.section_by_name(".symtab").is_some() {
            return None;
        }
        let (start, size) = section_range(&elf)?;
        let functions = GoFunctions::read(&FileTable { file, start, size }, text_start(&elf))?;
        let segments = elf.segments().map(|segment| {
            let (offset, size) = segment.file_range();
            (offset..offset.saturating_add(size), segment.address())
        });
        Some(Self { start, size, functions, segments: segments.collect() })
    }

    /// The frame of the instruction at `file_offset` of `file`, the file it was read from.
    pub fn frame(&self, file: &File, file_offset: u64) -> Option<GoFrame> {
        let (range, address) = self.segments.iter().find(|(range, _)| range.contains(&file_offset))?;
        let table = FileTable { file, start: self.start, size: self.size };
        self.functions.frame(&table, (file_offset - range.start).saturating_add(*address))
    }
}

/// Where the program's Go code starts, which the table no longer says from Go 1.26 on: the `text`
/// field of its module data (`runtime.firstmoduledata`, alone in section `.go.module`, whose first
/// field is the table's address), else the `.text` section's start, as Go's own tools take it.
pub fn text_start<'data>(elf: &impl object::Object<'data>) -> Option<u64> {
    let from_module = || {
        let module = elf.section_by_name(".go.module")?.data().ok()?;
        let table = SECTIONS.iter().find_map(|name| elf.section_by_name(name))?.address();
        (u64_at(module, 0)? == table).then(|| u64_at(module, MODULE_TEXT)).flatten()
    };
    from_module().or_else(|| Some(elf.section_by_name(".text")?.address()))
}

/// `moduledata.text`'s offset: after the table's address, six slices, and three addresses.
const MODULE_TEXT: usize = 8 + 6 * 24 + 3 * 8;

/// One address's place in the program's source.
#[derive(Debug, Clone, PartialEq)]
pub struct GoFrame {
    pub function: String,
    pub file: Option<String>,
    pub line: Option<u32>,
}

/// The table's index: where its parts are, and every function's entry.
#[derive(Debug)]
pub struct GoFunctions {
    /// The address function entries are counted from.
    text_start: u64,
    /// Offsets in the table of the function names, the compilation units' file lists, the file
    /// names, the line and file tables, and the functions' records.
    names: u64,
    units: u64,
    files: u64,
    pc_tables: u64,
    records: u64,
    /// Each function's entry (from `text_start`) and where its record is (from `records`), in
    /// address order; the last entry is the end of the last function's code.
    entries: Vec<(u32, u32)>,
}

impl GoFunctions {
    /// The index of `table`; none when it is not a table memprof reads. `text_start` is where the
    /// program's code starts when the table does not say (`text_start`).
    pub fn read(table: &(impl TableBytes + ?Sized), text_start: Option<u64>) -> Option<Self> {
        let header = table.at(0, HEADER)?;
        let word = |index: usize| u64_at(&header, 8 + 8 * index);
        let magic_known = MAGICS.contains(&u32_at(&header, 0)?);
        // Instructions of any length (x86's quantum is 1) and 8-byte pointers.
        if !magic_known || header.get(4..8)? != [0, 0, 1, 8] {
            return None;
        }
        let count = usize::try_from(word(0)?).ok().filter(|&count| count <= MAX_FUNCTIONS)?;
        let [text, names, units, files, pc_tables, records] = [2, 3, 4, 5, 6, 7].map(|index| word(index).unwrap_or(0));
        let text_start = if text != 0 { text } else { text_start? };
        let functab = table.at(records, (count + 1) * 8)?;
        if functab.len() != (count + 1) * 8 {
            return None;
        }
        let entries = functab.chunks_exact(8).map(|pair| (u32_at(pair, 0).unwrap_or(0), u32_at(pair, 4).unwrap_or(0)));
        let entries: Vec<(u32, u32)> = entries.collect();
        let sorted = entries.windows(2).all(|pair| pair[0].0 <= pair[1].0);
        sorted.then_some(Self { text_start, names, units, files, pc_tables, records, entries })
    }

    /// The address ranges of the functions named in `wanted`, in one pass over the table.
    pub fn find(&self, table: &(impl TableBytes + ?Sized), wanted: &[&str]) -> Vec<(String, std::ops::Range<u64>)> {
        let mut found = Vec::new();
        for (index, range) in self.ranges().enumerate() {
            let Some(name) = self.record(table, index).and_then(|record| self.name(table, &record)) else { continue };
            if wanted.contains(&name.as_str()) {
                found.push((name, range));
            }
        }
        found
    }

    /// Every function's address range, in address order.
    pub fn ranges(&self) -> impl Iterator<Item = std::ops::Range<u64>> + '_ {
        let address = |entry: u32| self.text_start.saturating_add(u64::from(entry));
        self.entries.windows(2).map(move |pair| address(pair[0].0)..address(pair[1].0))
    }

    /// The function, file and line of the instruction at `address`.
    pub fn frame(&self, table: &(impl TableBytes + ?Sized), address: u64) -> Option<GoFrame> {
        let offset = u32::try_from(address.checked_sub(self.text_start)?).ok()?;
        let end = self.entries.last()?.0;
        let index = self.entries.partition_point(|&(entry, _)| entry <= offset).checked_sub(1)?;
        if offset >= end {
            return None;
        }
        let record = self.record(table, index)?;
        let function = self.name(table, &record)?;
        let entry = self.entries[index].0;
        let value = |field: usize| {
            // A function without the table (the runtime's assembly has no file table).
            let at = u32_at(&record, field).filter(|&at| at != 0)?;
            let at = self.pc_tables.saturating_add(u64::from(at));
            // Most tables are short: a long one is read again whole.
            [PC_TABLE_FIRST_READ, MAX_PC_TABLE].into_iter().find_map(|length| {
                let bytes = table.at(at, length)?;
                match pc_value(&bytes, entry, offset) {
                    Some(value) => Some(Some(value)),
                    None if bytes.len() < length => Some(None),
                    None => None,
                }
            })?
        };
        let line = value(PCLN).and_then(|line| u32::try_from(line).ok());
        let file = value(PCFILE).and_then(|index| self.file_name(table, &record, index));
        Some(GoFrame { function, file, line })
    }

    /// The function record at `index`: its fixed fields.
    fn record<'t>(&self, table: &'t (impl TableBytes + ?Sized), index: usize) -> Option<Cow<'t, [u8]>> {
        let (_, at) = *self.entries.get(index)?;
        table.at(self.records.saturating_add(u64::from(at)), RECORD).filter(|record| record.len() == RECORD)
    }

    fn name(&self, table: &(impl TableBytes + ?Sized), record: &[u8]) -> Option<String> {
        let at = u64::try_from(i32::from_le_bytes(record.get(NAME..NAME + 4)?.try_into().ok()?)).ok()?;
        text(table, self.names.saturating_add(at))
    }

    /// The name of file `index` of the function's compilation unit.
    fn file_name(&self, table: &(impl TableBytes + ?Sized), record: &[u8], index: i32) -> Option<String> {
        let slot = u64::from(u32_at(record, UNIT)?) + u64::try_from(index).ok()?;
        let at = u32_at(&table.at(self.units.saturating_add(slot * 4), 4)?, 0)?;
        (at != u32::MAX).then_some(())?;
        text(table, self.files.saturating_add(u64::from(at)))
    }
}

/// A function record's size as read, and its fields' offsets: `entryOff`, `nameOff`, `args`,
/// `deferreturn`, `pcsp`, `pcfile`, `pcln`, `npcdata`, `cuOffset`.
const RECORD: usize = 36;
const NAME: usize = 4;
const PCFILE: usize = 20;
const PCLN: usize = 24;
const UNIT: usize = 32;

/// The NUL-terminated text at `offset` of the table.
fn text(table: &(impl TableBytes + ?Sized), offset: u64) -> Option<String> {
    let bytes = table.at(offset, MAX_TEXT)?;
    let end = bytes.iter().position(|&byte| byte == 0).unwrap_or(bytes.len());
    Some(String::from_utf8_lossy(&bytes[..end]).into_owned())
}

/// The value a line or file table gives the instruction at `target` of a function entered at
/// `entry` (both offsets from the text's start): the runtime's `pcvalue`. The table is pairs of
/// varints, a zig-zag change of the value and the length of code it holds for, from -1 at the
/// entry; a change of 0 past the first pair ends it.
fn pc_value(table: &[u8], entry: u32, target: u32) -> Option<i32> {
    let (mut at, mut value, mut pc) = (0, -1i32, u64::from(entry));
    let mut first = true;
    loop {
        let (change, used) = varint(table.get(at..)?)?;
        if change == 0 && !first {
            return None;
        }
        at += used;
        let (length, used) = varint(table.get(at..)?)?;
        at += used;
        value = value.wrapping_add((change >> 1) as i32 ^ -((change & 1) as i32));
        pc += u64::from(length);
        if u64::from(target) < pc {
            return Some(value);
        }
        first = false;
    }
}

/// An unsigned LEB128 varint of up to 32 bits, and the bytes it took.
fn varint(bytes: &[u8]) -> Option<(u32, usize)> {
    let mut value = 0u32;
    for (index, &byte) in bytes.iter().enumerate().take(5) {
        value |= u32::from(byte & 0x7f) << (7 * index);
        if byte & 0x80 == 0 {
            return Some((value, index + 1));
        }
    }
    None
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_table_gives_each_instruction_its_line() {
        // From -1: +11 for 4 bytes (line 10), +2 for 0x90 bytes (line 12, a two-byte length),
        // -3 for 1 byte (line 9), then the end.
        let table = [22, 4, 4, 0x90, 0x01, 5, 1, 0];
        assert_eq!(pc_value(&table, 0x100, 0x100), Some(10));
        assert_eq!(pc_value(&table, 0x100, 0x103), Some(10));
        assert_eq!(pc_value(&table, 0x100, 0x104), Some(12));
        assert_eq!(pc_value(&table, 0x100, 0x193), Some(12));
        assert_eq!(pc_value(&table, 0x100, 0x194), Some(9));
        assert_eq!(pc_value(&table, 0x100, 0x195), None);
        // Cut short: no answer rather than a wrong one.
        assert_eq!(pc_value(&table[..3], 0x100, 0x110), None);
    }

    #[test]
    fn a_table_of_another_layout_is_not_read() {
        let mut header = vec![0u8; HEADER + 16];
        header[..8].copy_from_slice(&[0xfb, 0xff, 0xff, 0xff, 0, 0, 1, 8]);
        assert!(GoFunctions::read(header.as_slice(), Some(0)).is_none(), "Go 1.16's magic");
        header[0] = 0xf0;
        header[7] = 4;
        assert!(GoFunctions::read(header.as_slice(), Some(0)).is_none(), "4-byte pointers");
        header[7] = 8;
        assert!(GoFunctions::read(header.as_slice(), Some(0)).is_some());
    }
}
