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

use crate::{error::UserError, procfs};

/// An entry point to probe: its file offset and what it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbePoint {
    pub offset: u64,
    pub func: AllocFn,
}

/// The file holding a process's allocator and the distinct entry points in it.
#[derive(Debug)]
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
    let offsets = symbol_file_offsets(&file);
    let free_offset = *offsets.get("free")?;
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

/// File offsets of the defined allocator symbols, from the dynamic table or, in a static binary,
/// the full symbol table.
fn symbol_file_offsets(file: &object::File) -> HashMap<&'static str, u64> {
    let wanted: Vec<&'static str> = AllocFn::ALL.iter().map(|func| func.symbol()).chain(["free"]).collect();
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
    fn libc_is_tried_after_other_libraries() {
        assert!(is_libc("/usr/lib/x86_64-linux-gnu/libc.so.6"));
        assert!(!is_libc("/usr/lib/libjemalloc.so.2"));
        assert!(is_dynamic_loader("/lib64/ld-linux-x86-64.so.2"));
    }
}
