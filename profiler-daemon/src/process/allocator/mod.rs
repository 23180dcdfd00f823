//! Finds the allocator a process uses and where its entry points sit in the file.
//!
//! Uprobes bind to an inode, so the file is opened through `/proc/PID/root`: a container's process
//! is then probed in its own libc, not the host's.
//!
//! Here: what a process's allocator is, found from the files it maps. `entry_points` reads a
//! file's entry points, `command` a command's files before it runs, `blind_spots` what memprof finds
//! but does not probe.

use std::{
    collections::HashSet,
    path::{Path, PathBuf},
};

use profiler_common::{completion::Completion, moved_arguments_cookie, AllocFn, MovedArguments};

use crate::{
    error::UserError,
    process::{
        families,
        file_cache::{FileId, Opened},
        procfs,
    },
};

mod blind_spots;
mod command;
mod entry_points;

pub use blind_spots::BlindSpot;
pub use command::{for_command, standby};
pub use entry_points::{function_file_offset, functions_with_code, symbol_distance};

use blind_spots::UNPROBED;
use entry_points::{scan, scan_file};

/// An allocating entry point to probe: its file offset and what it does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbePoint {
    pub offset: u64,
    pub func: AllocFn,
    /// At a branch of the function's fast path that completes some of its calls, which need no
    /// return probe (see `process::fast_path`); `None` at an entry.
    pub completion: Option<Completion>,
    /// Where the arguments read are, those the function's first instructions moved out of their
    /// registers (see `process::placement`, `process::fast_path`).
    pub moved: MovedArguments,
}

impl ProbePoint {
    /// Its probe's cookie.
    pub fn cookie(&self) -> u64 {
        let func = self.func as u32;
        let site = self.completion.map_or(u64::from(func), |completion| completion.cookie(func));
        site | moved_arguments_cookie(&self.moved)
    }

    /// Its return probe's cookie: the return program reads the call from its entry's record.
    pub fn return_cookie(&self) -> u64 {
        u64::from(self.func as u32)
    }
}

/// A freeing entry point to probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FreePoint {
    pub offset: u64,
    /// It may call another probed free of the same block (see `profiler_common::FreeNote`):
    /// every free outside the C library's own shared object may.
    pub wrapper: bool,
    /// In the C library's own shared object: how far its executable segment reaches below and
    /// above the probe, to tell the library's internal frees (`profiler_common::FREE_IN_C_LIBRARY`).
    pub c_library_code: Option<(u64, u64)>,
    /// Where the block is, if the function's first instructions moved it out of rdi (never in
    /// the C library's, whose cookie holds `c_library_code`).
    pub moved: MovedArguments,
}

/// One file holding allocator code, and its distinct entry points.
#[derive(Debug, Clone)]
pub struct AllocatorFile {
    /// What `/proc/PID/maps` calls the file (for messages, and to tell the allocator's frames).
    pub display_path: String,
    /// The path to attach through, valid from memprof's mount namespace.
    pub attach_path: PathBuf,
    /// The file read: probes go only into it (`file_cache::Opened::open_same`).
    pub id: FileId,
    /// The families found in it, for messages.
    pub families: Vec<&'static str>,
    /// One per distinct address (glibc's aligned_alloc is memalign, tcmalloc's tc_new is
    /// operator new).
    pub allocs: Vec<ProbePoint>,
    pub frees: Vec<FreePoint>,
}

/// Every file of a process that holds allocator code: a C++ program on jemalloc has jemalloc
/// (with its own `operator new`) and the C library; a Rust binary with a static jemalloc, that
/// and the C library its C dependencies call; python, its object allocator and the C library.
#[derive(Debug, Clone, Default)]
pub struct Allocator {
    pub files: Vec<AllocatorFile>,
    /// Allocators found beside these that memprof does not probe.
    pub unprobed: Vec<BlindSpot>,
    /// The files with code that were looked into, as `/proc/PID/maps` names them: only files
    /// mapped later are looked into for blind spots (`unprobed_in_new_files`).
    pub looked_into: HashSet<String>,
}

impl Allocator {
    /// glibc's malloc, whose arenas point at chunk headers (see `heap::reachability`): the C
    /// library's `malloc`, no allocator of its own replacing it (jemalloc, tcmalloc, mimalloc).
    /// A file that exports `malloc` with no allocator of its own wraps glibc's (glibc's
    /// `libc_malloc_debug`).
    pub fn is_glibc(&self) -> bool {
        let glibc = self.files.iter().any(|file| file.display_path.ends_with("/libc.so.6"));
        let replaced = self.files.iter().any(|file| {
            file.families.contains(&families::STANDARD_FAMILY)
                && file.families.iter().any(|family| *family != families::STANDARD_FAMILY)
        });
        glibc && !replaced
    }

    /// The files and their families, for messages: `libjemalloc.so.2 (jemalloc, C++ operator
    /// new/delete), libc.so.6 (C library malloc)`.
    pub fn describe(&self) -> String {
        if self.files.is_empty() {
            return "no allocator file (its runtime's allocator is not probed: only its mappings or pages are traced)"
                .to_string();
        }
        let files: Vec<String> =
            self.files.iter().map(|f| format!("{} ({})", f.display_path, f.families.join(", "))).collect();
        files.join(", ")
    }

    /// Whether Go's heap is among its blind spots: a Go program.
    pub fn go_heap_unseen(&self) -> bool {
        self.unprobed.iter().any(|spot| spot.heap == Some(blind_spots::GO_HEAP))
    }

    /// Go's heap stays unseen for `why` (its runtime's sampler cannot show it): its blind spot's
    /// advice says so, and what shows it instead of `--usdt`.
    pub fn go_heap_unseen_because(&mut self, why: &str) {
        for spot in self.unprobed.iter_mut().filter(|spot| spot.heap == Some(blind_spots::GO_HEAP)) {
            spot.advice = format!("{why}; or trace it with {}", super::go_program::OTHER_MODES);
        }
    }

    /// Traced through `sites` (`--usdt`): a Go runtime sampled at its own sites is no blind spot.
    pub fn seen_through(&mut self, sites: &[super::usdt::Site]) {
        if sites.iter().any(|site| site.spec.sampler == profiler_common::usdt::sampler::GO) {
            self.unprobed.retain(|spot| spot.heap != Some(blind_spots::GO_HEAP));
        }
    }

    /// For a command about to start (`memprof run`): the environment entries (`NAME=value`) that
    /// route its unprobed allocators through malloc, where there is one, so that their memory is
    /// seen (CPython's pymalloc: `PYTHONMALLOC=malloc`). Those allocators are no blind spot then.
    /// A variable set already in memprof's environment, which the command inherits, is the
    /// user's choice and kept (a blind spot unless its value routes it, as reports check).
    /// Returns the blind spots so routed, each with its `unless_env`.
    pub fn route_through_malloc(&mut self) -> Vec<BlindSpot> {
        let (routed, kept) = std::mem::take(&mut self.unprobed)
            .into_iter()
            .partition(|spot| spot.env_name().is_some_and(|name| std::env::var_os(name).is_none()));
        self.unprobed = kept;
        routed
    }

    /// The environment entries of `route_through_malloc` for any program, not only this one's:
    /// `run` starts every command with them, as it may exec such a program later (a pyenv shim,
    /// a script, `env`); programs that do not read them ignore them. Variables set already in
    /// memprof's environment are kept as they are.
    pub fn routes_for_any_program() -> Vec<&'static str> {
        let unset = |entry: &&'static str| {
            let name = entry.split_once('=').map_or(*entry, |(name, _)| name);
            std::env::var_os(name).is_none()
        };
        UNPROBED.iter().filter_map(|unprobed| unprobed.unless_env).filter(unset).collect()
    }

    /// The files' paths as `/proc/PID/maps` names them.
    pub fn modules(&self) -> Vec<String> {
        self.files.iter().map(|f| f.display_path.clone()).collect()
    }
}

/// Finds the allocators of `pid` in the files it has code mapped from: the executable itself
/// (static binaries, Rust's static jemalloc or mimalloc, python's object allocator) and its
/// libraries.
pub fn find(pid: u32) -> Result<Allocator, UserError> {
    find_with(pid, RuntimeOnly::Refused)
}

/// Whether a process whose only allocators are runtimes memprof does not probe (a pure Go
/// binary) can be traced: by the memory it maps (`--mappings`), the pages it touches
/// (`--growth`) or its runtime's own sampler (`--usdt`), with no allocator probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuntimeOnly {
    Accepted,
    Refused,
}

impl RuntimeOnly {
    pub fn accepted_if(yes: bool) -> Self {
        if yes {
            Self::Accepted
        } else {
            Self::Refused
        }
    }
}

/// `find`, which accepts a process with only a runtime's allocator as `runtime_only` says.
pub fn find_with(pid: u32, runtime_only: RuntimeOnly) -> Result<Allocator, UserError> {
    let mut candidates = procfs::mapped_files(pid)?;
    let valgrind_tool = procfs::exe_path(pid).is_some_and(|exe| is_valgrind_tool(&exe));
    if valgrind_tool || candidates.iter().any(|file| is_valgrind_preload(&file.path)) {
        return Err(UserError::UnderValgrind(pid));
    }
    // Only files with code mapped: a file mapped for reading only (a C library's debug file that
    // a symbolizer reads, as memprof's daemon does) defines malloc too, but never runs.
    let running = procfs::file_mappings(pid).map_err(|err| procfs::maps_error(pid, err))?;
    candidates.retain(|file| running.iter().any(|m| m.executable && m.path == file.path));
    let scans = candidates
        .iter()
        .filter(|file| !is_dynamic_loader(&file.path))
        .filter_map(|file| file.reachable_paths(pid).iter().find_map(|path| scan(Path::new(path), &file.path)));
    let looked_into = candidates.iter().map(|file| file.path.clone()).collect();
    allocator_of(scans.collect(), looked_into, runtime_only).map_err(|detail| UserError::NoAllocator {
        pid,
        detail: if candidates.is_empty() { "it maps no files".to_string() } else { detail },
    })
}

/// The allocators memprof does not probe in the files with code mapped in `pid` that are not in
/// `scanned`, which then holds them: a runtime loaded after the process started (the java
/// launcher loads libjvm with dlopen).
pub fn unprobed_in_new_files(pid: u32, scanned: &mut HashSet<String>) -> Vec<BlindSpot> {
    let Ok(mappings) = procfs::file_mappings(pid) else { return Vec::new() };
    let mut spots = Vec::new();
    for mapping in mappings.iter().filter(|m| m.executable && !is_dynamic_loader(&m.path)) {
        if !scanned.insert(mapping.path.clone()) {
            continue;
        }
        // Only the unprobed allocators' marks are looked for: no family.
        let at = mapping.reachable_paths(pid);
        let scan = at.iter().find_map(|path| {
            let opened = Opened::open(Path::new(path)).ok()?;
            scan_file(&[], &opened, Path::new(path), &mapping.path)
        });
        spots.extend(scan.into_iter().flat_map(|scan| scan.unprobed));
    }
    spots
}

/// valgrind's libraries preloaded into the program it runs (`vgpreload_memcheck-amd64-linux.so`):
/// valgrind runs the program's code translated, breakpoints included, and a breakpoint of
/// memprof's stops it with SIGTRAP.
fn is_valgrind_preload(path: &str) -> bool {
    path.rsplit('/').next().is_some_and(|name| name.starts_with("vgpreload_"))
}

/// Whether `program` is valgrind's launcher (`/usr/bin/valgrind`, Debian's script, and the
/// `valgrind.bin` it runs) or one of its tools.
pub fn runs_valgrind(program: &Path) -> bool {
    let launcher = program.file_name().is_some_and(|name| name == "valgrind" || name == "valgrind.bin");
    launcher || is_valgrind_tool(&program.to_string_lossy())
}

/// The valgrind program `pid` runs, if any: `ran` (the path its exec ran), else what `/proc`
/// says now. valgrind's launcher may be a script (Debian's): its process then has the launcher's
/// name, and the shell as its executable.
pub fn valgrind_of(pid: u32, ran: Option<PathBuf>) -> Option<String> {
    let program = ran.or_else(|| procfs::exe_path(pid).map(PathBuf::from))?;
    if runs_valgrind(&program) {
        return Some(program.display().to_string());
    }
    procfs::comm(pid).filter(|comm| runs_valgrind(Path::new(comm)))
}

/// `UnderValgrind` when `pid` runs valgrind now: a process that exec'd it while memprof
/// attached to it (a child memprof hears of late) is to get no breakpoint, which valgrind would
/// meet in the code it runs.
pub fn refuse_valgrind(pid: u32) -> Result<(), UserError> {
    match valgrind_of(pid, None) {
        Some(_) => Err(UserError::UnderValgrind(pid)),
        None => Ok(()),
    }
}

/// A valgrind tool, which runs a program in its own process (`/usr/libexec/valgrind/memcheck-amd64-linux`):
/// the program's files are mapped in it, its C library among them, and breakpoints of memprof's
/// there would stop it (see `is_valgrind_preload`).
pub fn is_valgrind_tool(path: &str) -> bool {
    let path = Path::new(path);
    let in_valgrind = path.parent().and_then(Path::file_name).is_some_and(|dir| dir == "valgrind");
    in_valgrind && path.file_name().is_some_and(|name| name.to_string_lossy().ends_with("-linux"))
}

/// What one file holds: allocator entry points to probe, and allocators memprof does not probe.
#[derive(Clone)]
struct FileScan {
    allocator: Option<AllocatorFile>,
    unprobed: Vec<BlindSpot>,
}

/// The allocator of the files scanned, the C library's last: the order the dynamic loader binds
/// `malloc` in, so that messages name the one in use first. Without one, why not.
fn allocator_of(
    scans: Vec<FileScan>,
    looked_into: HashSet<String>,
    runtime_only: RuntimeOnly,
) -> Result<Allocator, String> {
    let unprobed: Vec<BlindSpot> = scans.iter().flat_map(|scan| scan.unprobed.clone()).collect();
    let mut files: Vec<AllocatorFile> = scans.into_iter().filter_map(|scan| scan.allocator).collect();
    if files.is_empty() {
        if unprobed.is_empty() {
            return Err("none of its files holds an allocator memprof knows".to_string());
        }
        if runtime_only == RuntimeOnly::Accepted {
            return Ok(Allocator { files, unprobed, looked_into });
        }
        let what: Vec<String> = unprobed.iter().map(|spot| format!("{} ({})", spot.what, spot.advice)).collect();
        return Err(format!(
            "it allocates through {}; --growth shows the pages it touches, by the stack that touched each first; \
             --mappings shows where it maps its memory, by stack",
            what.join("; ")
        ));
    }
    files.sort_by_key(|file| is_libc(&file.display_path));
    Ok(Allocator { files, unprobed, looked_into })
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

/// Whether `path` names a C library: glibc's, or musl's (its dynamic loader).
pub fn is_c_library(path: &str) -> bool {
    is_libc(path) || file_name(path).starts_with("ld-musl")
}

/// Whether `path` names a dynamic loader, glibc's or musl's (musl's is its C library too).
pub fn is_any_dynamic_loader(path: &str) -> bool {
    is_dynamic_loader(path) || file_name(path).starts_with("ld-musl")
}

/// Whether `pid` runs a statically linked program: it maps no dynamic loader (the kernel maps a
/// dynamic program's loader beside it at exec, before it runs).
pub fn statically_linked(pid: u32) -> bool {
    procfs::file_mappings(pid)
        .is_ok_and(|mappings| !mappings.iter().any(|mapping| is_any_dynamic_loader(&mapping.path)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_libc_has_distinct_entry_points() {
        let pid = std::process::id();
        let allocator = find(pid).expect("the test binary uses libc's malloc");
        let libc = allocator.files.last().expect("a file");
        assert!(libc.display_path.contains("libc"), "{}", allocator.describe());
        assert_eq!(libc.families, ["C library malloc"]);
        let mut offsets: Vec<u64> =
            libc.allocs.iter().map(|p| p.offset).chain(libc.frees.iter().map(|p| p.offset)).collect();
        offsets.sort();
        offsets.dedup();
        assert_eq!(offsets.len(), libc.allocs.len() + libc.frees.len(), "one probe per address");
        assert_eq!(libc.frees.len(), 1, "free and its alias cfree are one probe");
        assert_eq!(libc.allocs[0].func, AllocFn::Malloc);
        assert!(libc.frees.iter().all(|free| !free.wrapper), "the C library's free calls no other");
        let (below, above) = libc.frees[0].c_library_code.expect("free is in the C library's code");
        assert!(below > 0 && above > 0 && below + above > 1 << 20, "its whole text: {below:#x} {above:#x}");
        assert_eq!(libc.frees.len(), 1, "cfree is free: one probe");
    }

    #[test]
    fn glibcs_malloc_is_in_use_unless_an_allocator_of_its_own_exports_malloc() {
        let file = |path: &str, families: &[&'static str]| AllocatorFile {
            display_path: path.to_string(),
            attach_path: path.into(),
            id: FileId { device: 0, inode: 0 },
            families: families.to_vec(),
            allocs: Vec::new(),
            frees: Vec::new(),
        };
        let libc = file("/usr/lib/x86_64-linux-gnu/libc.so.6", &[families::STANDARD_FAMILY]);
        let libstdcxx = file("/usr/lib/x86_64-linux-gnu/libstdc++.so.6", &["C++ operator new/delete"]);
        let jemalloc = file("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", &[families::STANDARD_FAMILY, "jemalloc"]);
        let of = |files: &[&AllocatorFile]| Allocator {
            files: files.iter().map(|f| (*f).clone()).collect(),
            ..Default::default()
        };
        assert!(of(&[&libc]).is_glibc());
        assert!(of(&[&libstdcxx, &libc]).is_glibc());
        assert!(!of(&[&jemalloc, &libc]).is_glibc());
        assert!(!of(&[&jemalloc]).is_glibc());
        let debug = file("/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0", &[families::STANDARD_FAMILY]);
        assert!(of(&[&debug, &libc]).is_glibc());
    }

    #[test]
    fn libc_is_tried_after_other_libraries() {
        assert!(is_libc("/usr/lib/x86_64-linux-gnu/libc.so.6"));
        assert!(!is_libc("/usr/lib/libjemalloc.so.2"));
        assert!(is_dynamic_loader("/lib64/ld-linux-x86-64.so.2"));
    }
}
