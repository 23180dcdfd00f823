//! Where a process makes the mapping calls growth mode reads (`mmap`, `munmap`, `mremap`, `brk`,
//! `madvise`): the instruction after each `syscall` of the wrappers it makes them through, in
//! its C library and in its own program (a static program's copy of its C library's, Go's
//! runtime's). A probe there, in that process alone, sees each call's arguments and result,
//! where the kernel refuses the `fexit` programs that would see them for every process at once
//! (see `kernel::mapping_programs`).
//!
//! What does not go through these wrappers is not seen there: `syscall(2)`, a program's own
//! inline `syscall` instructions, the dynamic linker's own `mmap` and musl's `malloc`, which
//! moves the break itself. Pages first touched in memory mapped so are counted outside the known
//! ranges (`growth.outside_pages`).

use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
    sync::LazyLock,
};

use profiler_common::mapping_event::syscall;

use crate::process::{
    allocator::{functions_with_code, is_c_library},
    elf_bytes,
    file_cache::{FileCache, Opened},
    go_functions::{self, GoFunctions},
    placement, procfs,
    procfs::FileMapping,
    usdt,
};

/// A wrapper: its name, its system call, and whether every C library makes that call in it
/// (musl's `brk` only fails; `posix_madvise` is glibc's second way to `madvise`).
type Wrapper = (&'static str, u32, bool);

/// A C library's wrappers, `mmap` first.
const C_WRAPPERS: [Wrapper; 6] = [
    ("mmap", syscall::MMAP, true),
    ("munmap", syscall::MUNMAP, true),
    ("mremap", syscall::MREMAP, true),
    ("brk", syscall::BRK, false),
    ("madvise", syscall::MADVISE, true),
    ("posix_madvise", syscall::MADVISE, false),
];

/// Go's runtime makes its own system calls, in assembly (`runtime·sysMmap` and the others in
/// `sys_linux_amd64.s`), whether or not the program is linked with a C library (cgo). It never
/// calls `mremap` or `brk`. Its `mmap` first; by their symbols' names, which a stripped program
/// has not (`go_wrappers_by_table`).
const GO_WRAPPERS: [Wrapper; 3] = [
    ("runtime.sysMmap.abi0", syscall::MMAP, true),
    ("runtime.sysMunmap.abi0", syscall::MUNMAP, true),
    ("runtime.madvise.abi0", syscall::MADVISE, true),
];

/// Which file the wrappers are read in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holder {
    /// A C library, which has them all.
    CLibrary,
    /// The process's program: a static program links in only the wrappers it calls, and a
    /// dynamic one none, unless it is Go.
    Program,
}

/// A probe site: the file offset of the instruction after a `syscall`, and which call it makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Site {
    pub offset: u64,
    pub call: u32,
}

/// A file a process maps with wrappers of its mapping calls, and the sites in it.
#[derive(Debug, Clone)]
pub struct Sites {
    /// A path that reaches the very file mapped.
    pub path: PathBuf,
    pub sites: Vec<Site>,
}

/// Sites by file and holder: a forking server's children all map the same C library.
static SITES: LazyLock<FileCache<Option<Vec<Site>>>> = LazyLock::new(|| FileCache::new(64));

/// The sites in the C library among `mappings`, `pid`'s, and in its program; `None` when it has
/// none (a static C program stripped of its symbols) or some wrapper in either is not one
/// memprof understands: a call made there would be missed.
pub fn of_process(pid: u32, mappings: &[FileMapping]) -> Option<Vec<Sites>> {
    let executable = procfs::exe_path(pid);
    let library = mappings.iter().find(|mapping| mapping.executable && is_c_library(&mapping.path));
    let program = mappings.iter().find(|mapping| {
        mapping.executable
            && Some(&mapping.path) == executable.as_ref()
            && library.is_none_or(|l| l.path != mapping.path)
    });
    let mut found = Vec::new();
    for (mapping, holder) in [(library, Holder::CLibrary), (program, Holder::Program)] {
        let Some(mapping) = mapping else { continue };
        let id = mapping.id()?;
        let (path, opened) = mapping.reachable_paths(pid).into_iter().find_map(|path| {
            let path = PathBuf::from(path);
            let opened = Opened::open_same(&path, id).ok()?;
            Some((path, opened))
        })?;
        found.push(sites_of(path, &opened, holder)?);
    }
    non_empty(found)
}

/// The sites in the C library among `files` and in `program`, which a command will map once it
/// starts (see `of_process`).
pub fn of_files(program: &Path, files: &[PathBuf]) -> Option<Vec<Sites>> {
    let library = files.iter().find(|file| file.to_str().is_some_and(is_c_library)).map(PathBuf::as_path);
    let program = Some(program).filter(|&program| library != Some(program));
    let mut found = Vec::new();
    for (file, holder) in [(library, Holder::CLibrary), (program, Holder::Program)] {
        let Some(file) = file else { continue };
        found.push(sites_of(file.to_path_buf(), &Opened::open(file).ok()?, holder)?);
    }
    non_empty(found)
}

/// The files that have sites, if any does.
fn non_empty(mut found: Vec<Sites>) -> Option<Vec<Sites>> {
    found.retain(|file| !file.sites.is_empty());
    (!found.is_empty()).then_some(found)
}

fn sites_of(path: PathBuf, opened: &Opened, holder: Holder) -> Option<Sites> {
    let what = match holder {
        Holder::CLibrary => "mapping calls",
        Holder::Program => "a program's own mapping calls",
    };
    let sites = SITES.get_or_read(opened, what, |file| read_sites(file, holder))?;
    Some(Sites { path, sites })
}

/// The sites of the wrappers `file` holds (none in a program that holds none); `None` when a
/// wrapper it holds is not understood, or a C library lacks one.
fn read_sites(file: &std::fs::File, holder: Holder) -> Option<Vec<Site>> {
    let data = elf_bytes::read(file).ok()?;
    let elf = object::File::parse(&*data).ok()?;
    let wanted: HashSet<&str> = C_WRAPPERS.iter().chain(&GO_WRAPPERS).map(|(name, _, _)| *name).collect();
    let mut functions = functions_with_code(&data, &elf, &wanted);
    if holder == Holder::Program && functions.is_empty() {
        functions = go_wrappers_by_table(&data, &elf);
    }
    // A program holds a set when it holds its `mmap`: a static Go program linked with cgo holds
    // both.
    let held: Vec<Wrapper> = match holder {
        Holder::CLibrary => C_WRAPPERS.to_vec(),
        Holder::Program => [&C_WRAPPERS[..], &GO_WRAPPERS[..]]
            .into_iter()
            .filter(|wrappers| functions.contains_key(wrappers[0].0))
            .flatten()
            .copied()
            .collect(),
    };
    let mut sites = Vec::new();
    for (name, call, always_calls) in held {
        let Some(&(offset, code)) = functions.get(name) else {
            if always_calls && holder == Holder::CLibrary {
                return None;
            }
            continue;
        };
        let returns = placement::syscall_returns(code, call)?;
        if always_calls && returns.is_empty() {
            return None;
        }
        sites.extend(returns.into_iter().map(|distance| Site { offset: offset + distance, call }));
    }
    Some(sites)
}

/// Go's runtime's wrappers in a Go program without a symbol table, by its own table of its
/// functions (`go_functions`), which names them without their symbols' `.abi0`.
fn go_wrappers_by_table<'d>(data: &'d [u8], elf: &object::File<'d>) -> HashMap<&'static str, (u64, &'d [u8])> {
    let unversioned = |symbol: &'static str| symbol.trim_end_matches(".abi0");
    let Some(table) = go_functions::section_data(elf) else { return HashMap::new() };
    let Some(functions) = GoFunctions::read(table, go_functions::text_start(elf)) else { return HashMap::new() };
    let names: Vec<&str> = GO_WRAPPERS.iter().map(|(symbol, _, _)| unversioned(symbol)).collect();
    let found = functions.find(table, &names).into_iter().filter_map(|(name, range)| {
        let (symbol, _, _) = GO_WRAPPERS.iter().find(|(symbol, _, _)| unversioned(symbol) == name)?;
        let offset = usdt::file_offset(elf, range.start)?;
        let start = usize::try_from(offset).ok()?;
        let code = data.get(start..start.checked_add(usize::try_from(range.end - range.start).ok()?)?)?;
        Some((*symbol, (offset, code)))
    });
    found.collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The C libraries the project's set-up installs: every wrapper found and understood.
    #[test]
    fn glibc_and_musl_wrappers_are_found() {
        for (library, calls) in [("/lib/x86_64-linux-gnu/libc.so.6", 6), ("/usr/lib/x86_64-linux-musl/libc.so", 5)] {
            let opened = Opened::open(Path::new(library)).expect(library);
            let sites = read_sites(opened.file(), Holder::CLibrary)
                .unwrap_or_else(|| panic!("{library}: wrappers not understood"));
            assert_eq!(sites.len(), calls, "{library}: {sites:?}");
            let made: HashSet<u32> = sites.iter().map(|site| site.call).collect();
            for (_, call, required) in C_WRAPPERS {
                assert!(!required || made.contains(&call), "{library}: no site of call {call}");
            }
        }
    }
}
