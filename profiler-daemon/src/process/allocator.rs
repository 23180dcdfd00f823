//! Finds the allocator a process uses and where its entry points sit in the file.
//!
//! Uprobes bind to an inode, so the file is opened through `/proc/PID/root`: a container's process
//! is then probed in its own libc, not the host's.

use std::{
    collections::{HashMap, HashSet},
    fs,
    path::{Path, PathBuf},
    sync::LazyLock,
};

use object::{Object, ObjectSection, ObjectSymbol};
use profiler_common::AllocFn;
use serde::{Deserialize, Serialize};

use crate::{
    error::UserError,
    process::{
        elf_bytes,
        families::{self, Family, Role},
        file_cache::FileCache,
        placement, procfs,
    },
};

/// An allocating entry point to probe: its file offset and what it does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbePoint {
    pub offset: u64,
    pub func: AllocFn,
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
}

/// One file holding allocator code, and its distinct entry points.
#[derive(Debug, Clone)]
pub struct AllocatorFile {
    /// What `/proc/PID/maps` calls the file (for messages, and to tell the allocator's frames).
    pub display_path: String,
    /// The path to attach through, valid from memprof's mount namespace.
    pub attach_path: PathBuf,
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
#[derive(Debug, Clone)]
pub struct Allocator {
    pub files: Vec<AllocatorFile>,
    /// Allocators found beside these that memprof does not probe.
    pub unprobed: Vec<BlindSpot>,
}

/// Something memprof knows it does not see in a process, and what to do about it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BlindSpot {
    /// `unprobed_allocator` (found in a mapped file) or `unseen_growth` (anonymous memory grew
    /// while no probed call was made).
    pub kind: &'static str,
    pub what: String,
    pub advice: String,
    /// The memory it holds in a few words ("the JVM's heap"), for a runtime's allocator: the
    /// likely owner of resident memory that the heap does not account for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub heap: Option<&'static str>,
    /// An environment variable (`NAME=value`) under which the process routes this allocator's
    /// memory through malloc after all: then it is no blind spot.
    #[serde(skip)]
    pub unless_env: Option<&'static str>,
}

/// A blind spot as a saved report has it (see `crate::names`).
#[derive(Deserialize)]
struct SavedBlindSpot {
    kind: String,
    what: String,
    advice: String,
    #[serde(default)]
    heap: Option<String>,
}

impl<'de> Deserialize<'de> for BlindSpot {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let saved = SavedBlindSpot::deserialize(deserializer)?;
        Ok(Self {
            kind: crate::names::intern(saved.kind),
            what: saved.what,
            advice: saved.advice,
            heap: saved.heap.map(crate::names::intern),
            unless_env: None,
        })
    }
}

/// An allocator memprof finds but does not probe.
struct Unprobed {
    /// A symbol that says a file holds it.
    mark: &'static str,
    /// What goes unseen, and what to do.
    what: &'static str,
    advice: &'static str,
    /// `BlindSpot::heap`.
    heap: &'static str,
    /// The environment that routes it through malloc.
    unless_env: Option<&'static str>,
}

const UNPROBED: [Unprobed; 5] = [
    Unprobed {
        mark: "PyObject_Malloc",
        what: "CPython's object allocator (pymalloc): objects up to 512 bytes come from its own arenas, which malloc never sees",
        advice: "start python with PYTHONMALLOC=malloc to route them through malloc",
        heap: "pymalloc's arenas",
        unless_env: Some("PYTHONMALLOC=malloc"),
    },
    Unprobed {
        mark: "runtime.mallocgc",
        what: "Go's runtime allocator: the Go heap never passes through malloc (only cgo's calls do)",
        advice: "use Go's own heap profile (runtime/pprof or net/http/pprof)",
        heap: "Go's heap",
        unless_env: None,
    },
    Unprobed {
        mark: "JNI_CreateJavaVM",
        what: "the JVM: Java objects live in its garbage-collected heap, which malloc never sees",
        advice: "use the JVM's own tools (jcmd GC.heap_info, Java Flight Recorder)",
        heap: "the JVM's heap",
        unless_env: None,
    },
    Unprobed {
        // v8::Isolate::New: node, and any program that embeds V8.
        mark: "_ZN2v87Isolate3NewERKNS0_12CreateParamsE",
        what: "V8: JavaScript objects live in its garbage-collected heap, which malloc never sees",
        advice: "use V8's own tools (node --heapsnapshot-signal, or a heap snapshot from node --inspect)",
        heap: "V8's heap",
        unless_env: None,
    },
    Unprobed {
        mark: "coreclr_initialize",
        what: ".NET's runtime: managed objects live in its garbage-collected heap, which malloc never sees",
        advice: "use .NET's own tools (dotnet-gcdump, dotnet-counters)",
        heap: ".NET's heap",
        unless_env: None,
    },
];

impl BlindSpot {
    /// The name of the variable of `unless_env`.
    pub fn env_name(&self) -> Option<&'static str> {
        self.unless_env.map(|entry| entry.split_once('=').map_or(entry, |(name, _)| name))
    }
}

impl Allocator {
    /// glibc's malloc, whose arenas point at chunk headers (see `heap::reachability`).
    pub fn is_glibc(&self) -> bool {
        self.files.iter().any(|file| file.display_path.ends_with("/libc.so.6"))
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
/// binary) can be traced: by the memory it maps (`--mappings`) or the pages it touches
/// (`--growth`), with no allocator probe.
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
    // Only files with code mapped: a file mapped for reading only (a C library's debug file that
    // a symbolizer reads, as memprof's daemon does) defines malloc too, but never runs.
    let running = procfs::file_mappings(pid).map_err(|err| procfs::maps_error(pid, err))?;
    candidates.retain(|file| running.iter().any(|m| m.executable && m.path == file.path));
    let scans = candidates
        .iter()
        .filter(|file| !is_dynamic_loader(&file.path))
        .filter_map(|file| file.reachable_paths(pid).iter().find_map(|path| scan(Path::new(path), &file.path)));
    allocator_of(scans.collect(), runtime_only).map_err(|detail| UserError::NoAllocator {
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
        let scan = at.iter().find_map(|path| scan_file(&[], Path::new(path), &mapping.path));
        spots.extend(scan.into_iter().flat_map(|scan| scan.unprobed));
    }
    spots
}

/// The interpreter of a script (`#!/bin/sh -e`, `#!/usr/bin/env python3`), found as the kernel
/// and `env` find it.
fn script_interpreter(data: &[u8]) -> Option<PathBuf> {
    let line = data.strip_prefix(b"#!")?.split(|&b| b == b'\n').next()?;
    let mut words = std::str::from_utf8(line).ok()?.split_whitespace();
    let interpreter = PathBuf::from(words.next()?);
    if interpreter.file_name() != Some("env".as_ref()) {
        return Some(interpreter);
    }
    let name = words.find(|word| !word.starts_with('-'))?;
    std::env::split_paths(&std::env::var_os("PATH")?).map(|dir| dir.join(name)).find(|path| path.is_file())
}

/// The allocators a command will have once the dynamic loader has mapped its libraries, found
/// before it runs: in the executable and in the libraries its loader lists for it (`ld.so --list
/// PROGRAM`, what `ldd` runs, which maps them without running the program), with memprof's
/// environment (`LD_PRELOAD`, `LD_LIBRARY_PATH`), which the command inherits.
///
/// Also returns the files the command maps when it starts (itself, its libraries and its dynamic
/// loader), whose unwind tables can be built before it runs.
pub fn for_command(program: &Path, runtime_only: RuntimeOnly) -> Result<(Allocator, Vec<PathBuf>), UserError> {
    let no_allocator = |detail: String| UserError::NoAllocatorInCommand { program: program.to_path_buf(), detail };
    let mut data = fs::read(program).map_err(|err| no_allocator(format!("reading it: {err}")))?;
    // A script runs its interpreter (the kernel follows up to four of them).
    let mut program = program.to_path_buf();
    for _ in 0..4 {
        let Some(interpreter) = script_interpreter(&data) else { break };
        data =
            fs::read(&interpreter).map_err(|err| no_allocator(format!("reading {}: {err}", interpreter.display())))?;
        program = interpreter;
    }
    // As the kernel runs it: the file a link names, whose directory `$ORIGIN` in its RPATH is.
    let program = fs::canonicalize(&program).unwrap_or(program);
    let program = program.as_path();
    let mut paths = vec![program.to_path_buf()];
    if let Some(interpreter) = interpreter(&data) {
        paths.extend(loader_list(&interpreter, program).map_err(no_allocator)?);
        if !paths.contains(&interpreter) {
            paths.push(interpreter);
        }
    }
    let scans = paths.iter().filter(|path| !is_dynamic_loader(&path.to_string_lossy())).filter_map(|path| {
        // As /proc/PID/maps will name it, to recognise the allocator's own frames later.
        let display = fs::canonicalize(path).unwrap_or_else(|_| path.clone());
        scan(path, &display.to_string_lossy())
    });
    let allocator = allocator_of(scans.collect(), runtime_only).map_err(no_allocator)?;
    Ok((allocator, paths))
}

/// The allocator libraries a program loads in place of the C library's malloc with
/// `LD_PRELOAD`, by the names Debian ships them under.
const PRELOADABLE: &[&str] = &["libjemalloc.so.2", "libtcmalloc.so.4", "libtcmalloc_minimal.so.4", "libmimalloc.so.2"];

/// The preloadable allocator libraries (`PRELOADABLE`) installed beside `allocator`'s C library
/// that `allocator` does not hold already. `run` probes them for its command before it starts:
/// the kernel puts a file's probes in place when the process maps it, so a program the command
/// execs later with one preloaded (`env LD_PRELOAD=... prog`) is traced from its first call.
pub fn standby(allocator: &Allocator) -> Allocator {
    let held: HashSet<PathBuf> = allocator.files.iter().filter_map(|f| fs::canonicalize(&f.attach_path).ok()).collect();
    let Some(dir) = allocator.files.iter().find(|f| is_libc(&f.display_path)).and_then(|f| f.attach_path.parent())
    else {
        return Allocator { files: Vec::new(), unprobed: Vec::new() };
    };
    let files = PRELOADABLE
        .iter()
        .filter_map(|name| fs::canonicalize(dir.join(name)).ok())
        .filter(|path| !held.contains(path))
        .filter_map(|path| scan(&path, &path.to_string_lossy())?.allocator)
        .collect();
    Allocator { files, unprobed: Vec::new() }
}

/// The dynamic loader an executable names (`PT_INTERP`); none for a static one.
fn interpreter(data: &[u8]) -> Option<PathBuf> {
    let elf = object::File::parse(data).ok()?;
    let section = elf.section_by_name(".interp")?;
    let bytes = section.data().ok()?;
    let path = bytes.split(|&b| b == 0).next()?;
    Some(PathBuf::from(std::str::from_utf8(path).ok()?))
}

/// The libraries `interpreter --list program` says the program maps, in load order.
fn loader_list(interpreter: &Path, program: &Path) -> Result<Vec<PathBuf>, String> {
    let out = std::process::Command::new(interpreter)
        .arg("--list")
        .arg(program)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|err| format!("running {} --list: {err}", interpreter.display()))?;
    if !out.status.success() {
        let why = String::from_utf8_lossy(&out.stderr);
        return Err(format!("its dynamic loader cannot load it: {}", why.trim()));
    }
    Ok(parse_loader_list(&String::from_utf8_lossy(&out.stdout)))
}

/// Lines such as `libjemalloc.so.2 => /lib/x86_64-linux-gnu/libjemalloc.so.2 (0x7f...)` and
/// `/lib64/ld-linux-x86-64.so.2 (0x7f...)`; the vDSO has no file.
fn parse_loader_list(text: &str) -> Vec<PathBuf> {
    text.lines()
        .filter_map(|line| {
            let line = line.trim();
            let path = line.split_once("=> ").map_or(line, |(_, path)| path);
            let path = path.rsplit_once(" (").map_or(path, |(path, _)| path);
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect()
}

/// What one file holds: allocator entry points to probe, and allocators memprof does not probe.
#[derive(Clone)]
struct FileScan {
    allocator: Option<AllocatorFile>,
    unprobed: Vec<BlindSpot>,
}

/// The allocator of the files scanned, the C library's last: the order the dynamic loader binds
/// `malloc` in, so that messages name the one in use first. Without one, why not.
fn allocator_of(scans: Vec<FileScan>, runtime_only: RuntimeOnly) -> Result<Allocator, String> {
    let unprobed: Vec<BlindSpot> = scans.iter().flat_map(|scan| scan.unprobed.clone()).collect();
    let mut files: Vec<AllocatorFile> = scans.into_iter().filter_map(|scan| scan.allocator).collect();
    if files.is_empty() {
        if unprobed.is_empty() {
            return Err("none of its files holds an allocator memprof knows".to_string());
        }
        if runtime_only == RuntimeOnly::Accepted {
            return Ok(Allocator { files, unprobed });
        }
        let what: Vec<String> = unprobed.iter().map(|spot| format!("{} ({})", spot.what, spot.advice)).collect();
        return Err(format!(
            "it allocates through {}; --mappings shows where it maps its memory, by stack",
            what.join("; ")
        ));
    }
    files.sort_by_key(|file| is_libc(&file.display_path));
    Ok(Allocator { files, unprobed })
}

/// Scans with every family, by file: every exec and attach scans the files its process maps,
/// the C library and the shell among them each time, and a scan reads the whole file.
static SCANS: LazyLock<FileCache<Option<FileScan>>> = LazyLock::new(|| FileCache::new(1024));

/// `scan_file` with every family, once per file: a file scanned through another path (another
/// process's `/proc/PID/root`) is attached through this one.
fn scan(attach_path: &Path, display_path: &str) -> Option<FileScan> {
    let mut scan =
        SCANS.get_or_read(attach_path, display_path, || scan_file(&families::all(), attach_path, display_path))?;
    if let Some(file) = &mut scan.allocator {
        file.attach_path = attach_path.to_path_buf();
    }
    Some(scan)
}

/// Reads what an ELF file holds of allocators, with one pass over its symbols; `None` when it
/// holds none at all.
fn scan_file(families: &[Family], attach_path: &Path, display_path: &str) -> Option<FileScan> {
    let data = elf_bytes::read_path(attach_path).ok()?;
    let elf = object::File::parse(&*data).ok()?;
    let wanted: HashSet<&str> = families
        .iter()
        .flat_map(|f| f.entries.iter().map(|(s, _)| s.as_str()))
        .chain(UNPROBED.iter().map(|unprobed| unprobed.mark))
        .collect();
    let functions = functions(&elf, &wanted);
    let unprobed: Vec<BlindSpot> = UNPROBED
        .iter()
        .filter(|unprobed| functions.contains_key(unprobed.mark))
        .map(|unprobed| BlindSpot {
            kind: "unprobed_allocator",
            what: format!("{}, in {display_path}", unprobed.what),
            advice: unprobed.advice.to_string(),
            heap: Some(unprobed.heap),
            unless_env: unprobed.unless_env,
        })
        .collect();
    // Probe sites are chosen by decoding x86-64 code; on other machines they stay on the symbols.
    let code = |function: Function| match elf.architecture() {
        object::Architecture::X86_64 => function.code(&data),
        _ => &[],
    };
    let text = crate::unwind::load_segments(&data).unwrap_or_default();
    let allocator = read_file(families, &functions, code, &text, attach_path, display_path);
    (allocator.is_some() || !unprobed.is_empty()).then_some(FileScan { allocator, unprobed })
}

/// The entry points of `families` a file defines, from its `functions`, if it holds any; `code`
/// gives a function's bytes to decode (none: probed at its symbol); `text`, the file's
/// executable segments (file offset, size, address).
fn read_file<'d>(
    families: &[Family],
    functions: &HashMap<&str, Function>,
    code: impl Fn(Function) -> &'d [u8],
    text: &[(u64, u64, u64)],
    attach_path: &Path,
    display_path: &str,
) -> Option<AllocatorFile> {
    let present = |family: &&Family| family.is_in(|symbol| functions.contains_key(symbol));
    let mut found: Vec<&Family> = families.iter().filter(|f| !f.companion).filter(present).collect();
    let own_allocator = found.iter().any(|f| f.name != families::STANDARD_FAMILY);
    if found.len() > 1 {
        // Rust's global allocator calls one of the others, probed already.
        found.retain(|f| f.name != families::RUST);
    }
    if own_allocator {
        found.extend(families.iter().filter(|f| f.companion).filter(present));
    }
    if found.is_empty() {
        return None;
    }
    let wrapper = !is_libc(display_path);
    let mut file = AllocatorFile {
        display_path: display_path.to_string(),
        attach_path: attach_path.to_path_buf(),
        families: Vec::new(),
        allocs: Vec::new(),
        frees: Vec::new(),
    };
    // Symbol addresses probed already: aliases (glibc's `cfree` is `free`) get one probe, and a
    // probe may sit past the symbol's address (see `placement`).
    let mut probed = HashSet::new();
    for family in found {
        if !file.families.contains(&family.name) {
            file.families.push(family.name);
        }
        for (symbol, role) in &family.entries {
            let Some(&function) = functions.get(symbol.as_str()) else { continue };
            if !probed.insert(function.offset) {
                continue;
            }
            let offset = function.offset + placement::probe_distance(code(function), *role);
            match role {
                Role::Alloc(func) => file.allocs.push(ProbePoint { offset, func: *func }),
                Role::Free => {
                    let c_library_code = if wrapper { None } else { code_around(text, offset) };
                    file.frees.push(FreePoint { offset, wrapper, c_library_code })
                }
            }
        }
    }
    (!file.allocs.is_empty() && !file.frees.is_empty()).then_some(file)
}

/// How far the executable segment of `text` that holds file offset `offset` reaches below and
/// above it: distances in the file are distances in memory within one segment.
fn code_around(text: &[(u64, u64, u64)], offset: u64) -> Option<(u64, u64)> {
    let &(start, size, _) = text.iter().find(|(start, size, _)| (*start..start + size).contains(&offset))?;
    Some((offset - start, start + size - offset))
}

/// The file offset of function `name` in the ELF file at `path` (to probe it).
pub fn function_file_offset(path: &Path, name: &'static str) -> Option<u64> {
    let data = elf_bytes::read_path(path).ok()?;
    let file = object::File::parse(&*data).ok()?;
    functions(&file, &HashSet::from([name])).get(name).map(|function| function.offset)
}

/// How far symbol `to` is from symbol `from` in the file at `path` (their virtual addresses, the
/// same distance once loaded); None unless both are defined.
pub fn symbol_distance(path: &Path, from: &str, to: &str) -> Option<u64> {
    let data = elf_bytes::read_path(path).ok()?;
    let file = object::File::parse(&*data).ok()?;
    let address = |wanted: &str| {
        file.dynamic_symbols().chain(file.symbols()).find_map(|symbol| {
            let name = symbol.name().ok()?;
            (!symbol.is_undefined() && name.split('@').next() == Some(wanted)).then(|| symbol.address())
        })
    };
    Some(address(to)?.wrapping_sub(address(from)?))
}

/// A function in an ELF file: where its code starts in the file, and its symbol's size.
#[derive(Debug, Clone, Copy)]
struct Function {
    offset: u64,
    size: u64,
}

impl Function {
    /// Its bytes in `data` (the whole file); none when its size is unknown or out of the file.
    fn code(self, data: &[u8]) -> &[u8] {
        let range = usize::try_from(self.offset).ok().zip(usize::try_from(self.size).ok());
        range.and_then(|(start, size)| data.get(start..start.checked_add(size)?)).unwrap_or(&[])
    }
}

/// The functions named in `wanted` that the file defines, from the dynamic table and the full
/// symbol table (static binaries, Rust's static allocators).
fn functions<'a>(file: &object::File, wanted: &HashSet<&'a str>) -> HashMap<&'a str, Function> {
    let mut found = HashMap::new();
    for symbol in file.dynamic_symbols().chain(file.symbols()) {
        if symbol.is_undefined() || symbol.kind() != object::SymbolKind::Text {
            continue;
        }
        let Ok(name) = symbol.name() else { continue };
        // Versioned names such as `malloc@@GLIBC_2.2.5` are the same function.
        let name = name.split('@').next().unwrap_or(name);
        let Some(&wanted) = wanted.get(name) else {
            continue;
        };
        if found.contains_key(wanted) {
            continue;
        }
        if let Some(offset) = file_offset(file, symbol.address()) {
            found.insert(wanted, Function { offset, size: symbol.size() });
        }
    }
    found
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

    /// Where each entry point of each family is probed in Debian's allocator libraries (the
    /// project's set-up installs them for the allocator tests): a table on stdout for review,
    /// and the sites measured to matter.
    #[test]
    fn debian_allocators_are_probed_past_their_single_stepped_openings() {
        const LIBRARIES: [&str; 4] =
            ["libjemalloc.so.2", "libtcmalloc_minimal.so.4", "libmimalloc.so.2.0", "libc.so.6"];
        let families = families::all();
        let wanted: HashSet<&str> = families.iter().flat_map(|f| f.entries.iter().map(|(s, _)| s.as_str())).collect();
        let mut placed = HashMap::new();
        for library in LIBRARIES {
            let path = format!("/usr/lib/x86_64-linux-gnu/{library}");
            let data = fs::read(&path).unwrap_or_else(|err| panic!("{path}: {err} (cargo xtask setup installs it)"));
            let elf = object::File::parse(&*data).expect("an ELF file");
            let functions = functions(&elf, &wanted);
            let mut rows: Vec<(&str, u64)> = families
                .iter()
                .flat_map(|family| family.entries.iter())
                .filter_map(|(symbol, role)| {
                    let function = functions.get(symbol.as_str())?;
                    Some((symbol.as_str(), placement::probe_distance(function.code(&data), *role)))
                })
                .collect();
            rows.sort();
            rows.dedup();
            for (symbol, distance) in rows {
                println!("{library:26} {symbol:40} +{distance}");
                placed.insert((library, symbol), distance);
            }
        }
        for (library, symbol, distance) in [
            // cmp $0x1000,%rdi; ja: at the ja
            ("libjemalloc.so.2", "malloc", 7),
            // mov %rdi,%rax; ... cmp 0x1b0(%rax),%rcx; jne: at the jne
            ("libjemalloc.so.2", "free", 48),
            ("libjemalloc.so.2", "sdallocx", 10),
            // opens with pushes: emulated at the symbol
            ("libjemalloc.so.2", "calloc", 0),
            ("libtcmalloc_minimal.so.4", "tc_malloc", 10),
            ("libtcmalloc_minimal.so.4", "tc_free", 10),
            // mov %rdi,%rcx; test %rdi,%rdi; je, then rdi is rewritten: at the je
            ("libmimalloc.so.2.0", "mi_free", 6),
            // test %rdi,%rdi; je; push %rbp: at the je (a push is emulated by writing the stack)
            ("libc.so.6", "free", 3),
            ("libc.so.6", "malloc", 0),
        ] {
            assert_eq!(placed.get(&(library, symbol)), Some(&distance), "{symbol} in {library}");
        }
    }

    #[test]
    fn loader_lists_are_read_as_ldd_prints_them() {
        let text = "\tlinux-vdso.so.1 (0x00007ffc)\n\tlibjemalloc.so.2 => /lib/x86_64-linux-gnu/libjemalloc.so.2 (0x00007f1)\n\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f2)\n\t/lib64/ld-linux-x86-64.so.2 (0x00007f3)\n";
        let paths: Vec<String> = parse_loader_list(text).iter().map(|p| p.display().to_string()).collect();
        assert_eq!(
            paths,
            [
                "/lib/x86_64-linux-gnu/libjemalloc.so.2",
                "/lib/x86_64-linux-gnu/libc.so.6",
                "/lib64/ld-linux-x86-64.so.2"
            ]
        );
    }

    #[test]
    fn libc_is_tried_after_other_libraries() {
        assert!(is_libc("/usr/lib/x86_64-linux-gnu/libc.so.6"));
        assert!(!is_libc("/usr/lib/libjemalloc.so.2"));
        assert!(is_dynamic_loader("/lib64/ld-linux-x86-64.so.2"));
    }
}
