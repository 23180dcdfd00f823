//! Finds the allocator a process uses and where its entry points sit in the file.
//!
//! Uprobes bind to an inode, so the file is opened through `/proc/PID/root`: a container's process
//! is then probed in its own libc, not the host's.

use std::{
    collections::HashMap,
    fs,
    path::{Path, PathBuf},
};

use object::{Object, ObjectSection, ObjectSymbol};
use profiler_common::AllocFn;

use crate::{error::UserError, process::procfs};

/// An entry point to probe: its file offset and what it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbePoint {
    pub offset: u64,
    pub func: AllocFn,
}

/// The file holding a process's allocator and the distinct entry points in it.
#[derive(Debug, Clone)]
pub struct Allocator {
    /// What `/proc/PID/maps` calls the file (for messages).
    pub display_path: String,
    /// The path to attach through, valid from memprof's mount namespace.
    pub attach_path: PathBuf,
    /// Allocation functions, one per distinct address (glibc's aligned_alloc is memalign).
    pub allocs: Vec<ProbePoint>,
    pub free_offset: u64,
}

/// Finds the allocator of `pid`: the executable itself when it defines malloc (static binaries),
/// else a mapped library defining it, preferring a preloaded allocator over the C library.
pub fn find(pid: u32) -> Result<Allocator, UserError> {
    let exe = procfs::exe_path(pid);
    let mut candidates = procfs::mapped_files(pid)?;
    // Only files with code mapped: a file mapped for reading only (a C library's debug file that
    // a symbolizer reads, as memprof's daemon does) defines malloc too, but never runs.
    let running = procfs::file_mappings(pid).map_err(|_| UserError::NoSuchProcess(pid))?;
    candidates.retain(|file| running.iter().any(|m| m.executable && m.path == file.path));
    // The executable first, then libraries; among those, libc last so that an LD_PRELOADed
    // allocator (jemalloc, tcmalloc) wins as it does at run time.
    candidates.sort_by_key(|file| (Some(&file.path) != exe.as_ref(), is_libc(&file.path)));
    let mut tried = Vec::new();
    for file in candidates {
        if is_dynamic_loader(&file.path) {
            continue;
        }
        for attach_path in file.reachable_paths(pid) {
            if let Some(allocator) = read_entry_points(Path::new(&attach_path), &file.path) {
                return Ok(allocator);
            }
        }
        tried.push(file.path);
    }
    Err(UserError::NoAllocator {
        pid,
        detail: if tried.is_empty() {
            "it maps no files".to_string()
        } else {
            format!("none of {} mapped files exports malloc and free", tried.len())
        },
    })
}

/// Reads the entry points of an ELF file that defines both malloc and free.
pub fn read_entry_points(attach_path: &Path, display_path: &str) -> Option<Allocator> {
    let data = fs::read(attach_path).ok()?;
    let file = object::File::parse(&*data).ok()?;
    let wanted: Vec<&'static str> = AllocFn::ALL.iter().map(|func| func.symbol()).chain(["free"]).collect();
    let offsets = symbol_file_offsets(&file, &wanted);
    let free_offset = past_null_check(&data, *offsets.get("free")?);
    offsets.get("malloc")?;
    let mut allocs: Vec<ProbePoint> = Vec::new();
    for func in AllocFn::ALL {
        if let Some(&offset) = offsets.get(func.symbol()) {
            if !allocs.iter().any(|point| point.offset == offset) {
                allocs.push(ProbePoint { offset, func });
            }
        }
    }
    Some(Allocator {
        display_path: display_path.to_string(),
        attach_path: attach_path.to_path_buf(),
        allocs,
        free_offset,
    })
}

/// Where to probe `free`: past its `if (p == NULL) return;` when it opens with one.
///
/// A uprobe on an instruction the kernel cannot emulate is single-stepped, about 12 times dearer
/// (shared/notes/probe-costs.md). glibc's free opens with `test %rdi,%rdi; je ...`, which is
/// single-stepped, followed by `push %rbp`, which is emulated; `free(NULL)` is a no-op, so a probe
/// after the jump sees every free that matters. Only these encodings are recognised; anything
/// else keeps the probe on the symbol. The stack is untouched until that push, so the return
/// address the program reads at `rsp` is still the caller's.
fn past_null_check(data: &[u8], offset: u64) -> u64 {
    const TEST_RDI_RDI: [u8; 3] = [0x48, 0x85, 0xff];
    // The encodings below are x86-64's.
    if !cfg!(target_arch = "x86_64") {
        return offset;
    }
    let Some(code) = usize::try_from(offset).ok().and_then(|start| data.get(start..start + 16)) else {
        return offset;
    };
    if code[..3] != TEST_RDI_RDI {
        return offset;
    }
    let jump_len = match code[3] {
        0x74 => 2,                    // je rel8
        0x0f if code[4] == 0x84 => 6, // je rel32
        _ => return offset,
    };
    let next = 3 + jump_len;
    let is_push = matches!(code[next], 0x50..=0x57) || (code[next] == 0x41 && matches!(code[next + 1], 0x50..=0x57));
    if is_push {
        offset + next as u64
    } else {
        offset
    }
}

/// The file offset of function `name` in the ELF file at `path` (to probe it).
pub fn function_file_offset(path: &Path, name: &'static str) -> Option<u64> {
    let data = fs::read(path).ok()?;
    let file = object::File::parse(&*data).ok()?;
    symbol_file_offsets(&file, &[name]).get(name).copied()
}

/// File offsets of the functions named `wanted` that the file defines, from the dynamic table or,
/// in a static binary, the full symbol table.
fn symbol_file_offsets(file: &object::File, wanted: &[&'static str]) -> HashMap<&'static str, u64> {
    let mut offsets = HashMap::new();
    for symbol in file.dynamic_symbols().chain(file.symbols()) {
        if symbol.is_undefined() || symbol.kind() != object::SymbolKind::Text {
            continue;
        }
        let Ok(name) = symbol.name() else { continue };
        // Versioned names such as `malloc@@GLIBC_2.2.5` are the same function.
        let name = name.split('@').next().unwrap_or(name);
        let Some(&wanted) = wanted.iter().find(|w| **w == name) else {
            continue;
        };
        if offsets.contains_key(wanted) {
            continue;
        }
        if let Some(offset) = file_offset(file, symbol.address()) {
            offsets.insert(wanted, offset);
        }
    }
    offsets
}

/// Uprobes are placed by file offset: the address's distance into its section plus the section's
/// offset in the file.
fn file_offset(file: &object::File, address: u64) -> Option<u64> {
    file.sections().find_map(|section| {
        let (start, size) = (section.address(), section.size());
        let (offset, _) = section.file_range()?;
        (address >= start && address < start + size).then(|| address - start + offset)
    })
}

fn file_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

fn is_libc(path: &str) -> bool {
    let name = file_name(path);
    name.starts_with("libc.so") || name.starts_with("libc-")
}

fn is_dynamic_loader(path: &str) -> bool {
    file_name(path).starts_with("ld-linux")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_libc_has_distinct_entry_points() {
        let pid = std::process::id();
        let allocator = find(pid).expect("the test binary uses libc's malloc");
        assert!(allocator.display_path.contains("libc"), "{}", allocator.display_path);
        let mut offsets: Vec<u64> = allocator.allocs.iter().map(|p| p.offset).collect();
        offsets.sort();
        offsets.dedup();
        assert_eq!(offsets.len(), allocator.allocs.len(), "one probe per address");
        assert_eq!(allocator.allocs[0].func, AllocFn::Malloc);
    }

    #[test]
    fn free_is_probed_past_its_null_check() {
        let mut code = vec![0u8; 32];
        // test %rdi,%rdi; je rel32; push %rbp
        code[4..14].copy_from_slice(&[0x48, 0x85, 0xff, 0x0f, 0x84, 0xbf, 0, 0, 0, 0x55]);
        assert_eq!(past_null_check(&code, 4), 13);
        // test %rdi,%rdi; je rel8; push %r12
        code[4..11].copy_from_slice(&[0x48, 0x85, 0xff, 0x74, 0x10, 0x41, 0x54]);
        assert_eq!(past_null_check(&code, 4), 9);
        // Anything else (here: endbr64) stays on the symbol.
        code[4..8].copy_from_slice(&[0xf3, 0x0f, 0x1e, 0xfa]);
        assert_eq!(past_null_check(&code, 4), 4);
        assert_eq!(past_null_check(&code, 30), 30, "too close to the end to decode");
    }

    #[test]
    fn libc_is_tried_after_other_libraries() {
        assert!(is_libc("/usr/lib/x86_64-linux-gnu/libc.so.6"));
        assert!(!is_libc("/usr/lib/libjemalloc.so.2"));
        assert!(is_dynamic_loader("/lib64/ld-linux-x86-64.so.2"));
    }
}
