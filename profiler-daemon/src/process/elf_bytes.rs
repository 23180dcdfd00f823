//! An ELF file's bytes as memprof reads them: all but its DWARF debugging sections, which memprof
//! never parses (`.debug_frame`, call frame information, is kept). In a file built with `-g`
//! those are most of its size: read whole, each such file cost memprof its full size in memory
//! and in time before its unwind table or its allocator could be read (BENCHMARKS.md). The
//! bytes left out read as zeros, from pages that are never touched.
//!
//! What is read is bounded (`MAX_READ`, and half the memory memprof has room for): a traced
//! process can map a file of any size as code, and the daemon reads every such file.

use std::{fs::File, io, ops::Deref, os::unix::fs::FileExt, path::Path, ptr::NonNull};

use object::{
    elf::{FileHeader64, SHT_NOBITS},
    read::elf::{FileHeader, SectionHeader},
    Endianness,
};

/// The most bytes of one file memprof reads. The largest programs' code and tables are a few
/// hundred MiB; their debugging sections, which can be larger, are not read.
const MAX_READ: u64 = 2 << 30;

/// A file's bytes at their offsets, in an anonymous mapping of the file's size.
pub struct ElfBytes {
    start: NonNull<u8>,
    len: usize,
    /// Bytes that may be read into it, and those still left of them.
    allowed: u64,
    budget: u64,
}

// SAFETY: the mapping is owned by this value alone, as a `Vec<u8>`'s buffer is.
unsafe impl Send for ElfBytes {}
// SAFETY: shared references only read it.
unsafe impl Sync for ElfBytes {}

impl ElfBytes {
    /// A zeroed mapping of `len` bytes (not 0), into which `budget` bytes may be read. Without
    /// a reservation: most of a large file's pages are the debugging sections, never touched.
    fn zeroed(len: usize, budget: u64) -> io::Result<Self> {
        // SAFETY: a new private anonymous mapping; nothing else refers to the range.
        let start = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if start == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let start = NonNull::new(start.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(Self { start, len, allowed: budget, budget })
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes mapped writable, owned by `self`, borrowed mutably through it.
        unsafe { std::slice::from_raw_parts_mut(self.start.as_ptr(), self.len) }
    }

    /// Reads the file's bytes in `range` into their place, within the budget.
    fn fill(&mut self, file: &File, range: std::ops::Range<usize>) -> io::Result<()> {
        let wanted = range.len() as u64;
        if wanted > self.budget {
            return Err(io::Error::new(
                io::ErrorKind::FileTooLarge,
                format!("more to read than the {} MiB memprof reads of one file", self.allowed >> 20),
            ));
        }
        self.budget -= wanted;
        let bytes = self.bytes_mut().get_mut(range.clone()).ok_or_else(|| truncated(range.end))?;
        file.read_exact_at(bytes, range.start as u64)
    }
}

impl Deref for ElfBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `len` bytes mapped readable, owned by `self`.
        unsafe { std::slice::from_raw_parts(self.start.as_ptr(), self.len) }
    }
}

impl Drop for ElfBytes {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `zeroed`, unmapped once.
        unsafe { libc::munmap(self.start.as_ptr().cast(), self.len) };
    }
}

fn truncated(offset: usize) -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, format!("the file ends before byte {offset}"))
}

/// The file at `path` (see the module's comment).
pub fn read_path(path: &Path) -> io::Result<ElfBytes> {
    read(&super::procfs::open_regular(path)?)
}

/// The open `file` (see the module's comment). A file whose section headers do not read is read
/// whole; one that is not 64-bit ELF is refused.
pub fn read(file: &File) -> io::Result<ElfBytes> {
    let len = usize::try_from(file.metadata()?.len()).map_err(io::Error::other)?;
    if len == 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "the file is empty"));
    }
    let mut bytes = ElfBytes::zeroed(len, MAX_READ.min(super::memory::room().bytes / 2))?;
    // The ELF header, then the section headers and their names.
    bytes.fill(file, 0..len.min(size_of::<FileHeader64<Endianness>>()))?;
    if header(&bytes).is_none() {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "not a 64-bit ELF file"));
    }
    let skipped = match section_table_range(&bytes) {
        Some(range) => {
            bytes.fill(file, range)?;
            names_range(&bytes).map(|range| bytes.fill(file, range)).transpose()?;
            debugging_sections(&bytes)
        }
        None => Vec::new(),
    };
    let mut next = 0;
    for skip in skipped {
        if skip.start > next {
            bytes.fill(file, next..skip.start)?;
        }
        next = next.max(skip.end);
    }
    if next < len {
        bytes.fill(file, next..len)?;
    }
    Ok(bytes)
}

fn header(bytes: &[u8]) -> Option<(&FileHeader64<Endianness>, Endianness)> {
    let header = FileHeader64::<Endianness>::parse(bytes).ok()?;
    Some((header, header.endian().ok()?))
}

/// Where the section headers are (the first one alone when their count is kept in it).
fn section_table_range(bytes: &[u8]) -> Option<std::ops::Range<usize>> {
    let (header, endian) = header(bytes)?;
    let count = u64::from(header.e_shnum(endian)).max(1);
    let range = file_range(bytes, header.e_shoff(endian), count.checked_mul(u64::from(header.e_shentsize(endian)))?)?;
    (range.start != 0).then_some(range)
}

/// Where the sections' names are.
fn names_range(bytes: &[u8]) -> Option<std::ops::Range<usize>> {
    let (header, endian) = header(bytes)?;
    let sections = header.section_headers(endian, bytes).ok()?;
    let index = usize::try_from(header.shstrndx(endian, bytes).ok()?).ok()?;
    let (start, size) = sections.get(index)?.file_range(endian)?;
    file_range(bytes, start, size)
}

/// `size` bytes from `start`, if the file holds them.
fn file_range(bytes: &[u8], start: u64, size: u64) -> Option<std::ops::Range<usize>> {
    let start = usize::try_from(start).ok()?;
    let end = start.checked_add(usize::try_from(size).ok()?)?;
    (end <= bytes.len()).then_some(start..end)
}

/// The file ranges of the DWARF sections memprof does not read, sorted.
fn debugging_sections(bytes: &[u8]) -> Vec<std::ops::Range<usize>> {
    let Some((header, endian)) = header(bytes) else { return Vec::new() };
    let Ok(sections) = header.sections(endian, bytes) else { return Vec::new() };
    let mut ranges: Vec<_> = sections
        .iter()
        .filter(|section| section.sh_type(endian) != SHT_NOBITS)
        .filter(|section| sections.section_name(endian, section).is_ok_and(unread_debugging_section))
        .filter_map(|section| {
            let (start, size) = section.file_range(endian)?;
            file_range(bytes, start, size)
        })
        .collect();
    ranges.sort_by_key(|range| range.start);
    ranges
}

/// `.debug_info`, `.zdebug_line` and the like; not `.debug_frame`.
fn unread_debugging_section(name: &[u8]) -> bool {
    let rest = name.strip_prefix(b".debug_").or_else(|| name.strip_prefix(b".zdebug_"));
    rest.is_some_and(|rest| rest != b"frame")
}

#[cfg(test)]
mod tests {
    use super::*;
    use object::{Object, ObjectSection};

    /// This test binary is built with debugging information, as a user's program with `-g` is.
    #[test]
    fn every_byte_but_the_debugging_sections_is_read() {
        let path = std::env::current_exe().expect("own executable");
        let whole = std::fs::read(&path).expect("read whole");
        let read = read_path(&path).expect("read in part");
        assert_eq!(read.len(), whole.len());
        let elf = object::File::parse(&whole[..]).expect("ELF");
        let mut skipped = 0;
        for section in elf.sections() {
            let Some((start, size)) = section.file_range() else { continue };
            let range = start as usize..(start + size) as usize;
            let name = section.name().expect("name");
            if unread_debugging_section(name.as_bytes()) {
                assert!(read[range.clone()].iter().all(|&b| b == 0), "{name} was read");
                skipped += range.len();
            } else {
                assert_eq!(read[range.clone()], whole[range], "{name} differs");
            }
        }
        assert!(skipped > whole.len() / 2, "only {skipped} of {} bytes are debugging sections", whole.len());
        let symbols = |data: &[u8]| object::File::parse(data).expect("ELF").symbols().count();
        assert_eq!(symbols(&read), symbols(&whole));
    }

    #[test]
    fn a_file_that_is_not_elf_or_too_large_is_refused() {
        let dir = std::env::temp_dir().join(format!("memprof-elf-bytes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temporary directory");
        let path = dir.join("script");
        std::fs::write(&path, b"#!/bin/sh\necho hello\n").expect("write");
        assert_eq!(read_path(&path).err().map(|e| e.to_string()).as_deref(), Some("not a 64-bit ELF file"));
        std::fs::write(&path, b"").expect("write");
        assert!(read_path(&path).is_err());
        // A sparse file of 60 GiB after an ELF header without section headers: read whole, it
        // would take 60 GiB of memory.
        let own = std::fs::read(std::env::current_exe().expect("own executable")).expect("read");
        let mut header = own[..size_of::<FileHeader64<Endianness>>()].to_vec();
        header[0x28..0x30].fill(0); // e_shoff
        std::fs::write(&path, &header).expect("write");
        std::fs::File::options().write(true).open(&path).and_then(|f| f.set_len(60 << 30)).expect("extend");
        let err = read_path(&path).err().expect("refused");
        assert_eq!(err.kind(), io::ErrorKind::FileTooLarge, "{err}");
        std::fs::remove_dir_all(&dir).expect("clean up");
    }
}
