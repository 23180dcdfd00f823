//! Where a process's C library makes the mapping calls growth mode reads (`mmap`, `munmap`,
//! `mremap`, `brk`, `madvise`): the instruction after each `syscall` of their wrappers. A probe
//! there, in that process alone, sees each call's arguments and result, where the kernel
//! refuses the `fexit` programs that would see them for every process at once (see
//! `kernel::mapping_programs`).
//!
//! What does not go through these wrappers is not seen there: a program's own `syscall`
//! instructions (Go, a static program) and `syscall(2)`, the dynamic linker's own `mmap` and
//! musl's `malloc`, which moves the break itself. Pages first touched in memory mapped so are
//! counted outside the known ranges (`growth.outside_pages`).

use std::{
    collections::HashSet,
    path::{Path, PathBuf},
    sync::LazyLock,
};

use profiler_common::mapping_event::syscall;

use crate::process::{
    allocator::{functions_with_code, is_c_library},
    elf_bytes,
    file_cache::{FileCache, Opened},
    placement,
    procfs::FileMapping,
};

/// Each wrapper, its system call, and whether a C library must make that call in it: musl's
/// `brk` only fails, and `posix_madvise` is glibc's second way to `madvise`.
const WRAPPERS: [(&str, u32, bool); 6] = [
    ("mmap", syscall::MMAP, true),
    ("munmap", syscall::MUNMAP, true),
    ("mremap", syscall::MREMAP, true),
    ("brk", syscall::BRK, false),
    ("madvise", syscall::MADVISE, true),
    ("posix_madvise", syscall::MADVISE, false),
];

/// A probe site: the file offset of the instruction after a `syscall`, and which call it makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Site {
    pub offset: u64,
    pub call: u32,
}

/// The C library a process maps, and the sites in it.
#[derive(Debug, Clone)]
pub struct Sites {
    /// A path that reaches the very file mapped.
    pub path: PathBuf,
    pub sites: Vec<Site>,
}

/// Sites by file: a forking server's children all map the same C library.
static SITES: LazyLock<FileCache<Option<Vec<Site>>>> = LazyLock::new(|| FileCache::new(64));

/// The sites of the C library among `mappings`, `pid`'s; `None` when it maps none (a static
/// program, Go) or its wrappers are not the ones understood.
pub fn of_process(pid: u32, mappings: &[FileMapping]) -> Option<Sites> {
    let library = mappings.iter().find(|mapping| mapping.executable && is_c_library(&mapping.path))?;
    let id = library.id()?;
    let (path, opened) = library.reachable_paths(pid).into_iter().find_map(|path| {
        let path = PathBuf::from(path);
        let opened = Opened::open_same(&path, id).ok()?;
        Some((path, opened))
    })?;
    sites_of(path, &opened)
}

/// The sites of the C library at `path`, which a command will map once it starts.
pub fn of_file(path: &Path) -> Option<Sites> {
    sites_of(path.to_path_buf(), &Opened::open(path).ok()?)
}

fn sites_of(path: PathBuf, opened: &Opened) -> Option<Sites> {
    let sites = SITES.get_or_read(opened, "mapping calls", read_sites)?;
    Some(Sites { path, sites })
}

fn read_sites(file: &std::fs::File) -> Option<Vec<Site>> {
    let data = elf_bytes::read(file).ok()?;
    let elf = object::File::parse(&*data).ok()?;
    let wanted: HashSet<&str> = WRAPPERS.iter().map(|(name, _, _)| *name).collect();
    let functions = functions_with_code(&data, &elf, &wanted);
    let mut sites = Vec::new();
    for (name, call, required) in WRAPPERS {
        let Some(&(offset, code)) = functions.get(name) else {
            if required {
                return None;
            }
            continue;
        };
        let returns = placement::syscall_returns(code, call)?;
        if required && returns.is_empty() {
            return None;
        }
        sites.extend(returns.into_iter().map(|distance| Site { offset: offset + distance, call }));
    }
    Some(sites)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The C libraries the project's set-up installs: every wrapper found and understood.
    #[test]
    fn glibc_and_musl_wrappers_are_found() {
        for (library, calls) in [("/lib/x86_64-linux-gnu/libc.so.6", 6), ("/usr/lib/x86_64-linux-musl/libc.so", 5)] {
            let opened = Opened::open(Path::new(library)).expect(library);
            let sites = read_sites(opened.file()).unwrap_or_else(|| panic!("{library}: wrappers not understood"));
            assert_eq!(sites.len(), calls, "{library}: {sites:?}");
            let made: HashSet<u32> = sites.iter().map(|site| site.call).collect();
            for (_, call, required) in WRAPPERS {
                assert!(!required || made.contains(&call), "{library}: no site of call {call}");
            }
        }
    }
}
