//! Turns return addresses into frames on one thread that owns blazesym (its Symbolizer is !Send).
//!
//! Each traced process's file mappings are read while it lives and the mapped files are kept
//! open, so a process that has exited (or aborted on a double free) is still symbolized: blazesym
//! reads the files through `/proc/self/fd/N`, which stays valid, and works for containers too.

use std::{
    collections::{BTreeSet, HashMap},
    fs::File,
    ops::Range,
    os::fd::AsRawFd,
    panic::AssertUnwindSafe,
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        mpsc, Arc, OnceLock, Weak,
    },
    thread,
};

use blazesym::symbolize::{
    source::{Elf, Source},
    Input, Sym, Symbolized, Symbolizer,
};
use serde::{Deserialize, Serialize};

use crate::{
    demangle,
    process::{
        go_functions::{GoFrame, StrippedGo},
        procfs::{self, FileMapping},
    },
    text::printable,
};

mod clones;
mod debug_links;

use clones::Clones;
use debug_links::{debug_info_is_safe, DEBUG_DIR};

/// Code of one file mapped into the process: addresses `start..limit` map the file from
/// `file_offset` on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Module {
    pub path: String,
    pub start: u64,
    pub limit: u64,
    pub file_offset: u64,
    /// The file's GNU build id (`NT_GNU_BUILD_ID`) in hex; empty when it has none.
    pub build_id: String,
}

/// One frame of a symbolized stack, innermost first. A shared handle: the same frame (one return
/// address of one process) is in many stacks and in every interval's report, and is stored once
/// (the symbolizer's cache holds it), so a report's size grows with its stacks' depth by a pointer
/// a frame, not by the frame's names.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Frame(Arc<FrameInfo>);

/// A stack's frames, innermost first: one list shared by every report that names the stack
/// (a daemon keeps its processes' stacks from one interval to the next), never copied.
pub type Frames = Arc<[Frame]>;

impl Frame {
    pub fn new(info: FrameInfo) -> Self {
        Self(Arc::new(info))
    }
}

impl std::ops::Deref for Frame {
    type Target = FrameInfo;

    fn deref(&self) -> &FrameInfo {
        &self.0
    }
}

/// Changing a frame changes this handle's copy only.
impl std::ops::DerefMut for Frame {
    fn deref_mut(&mut self) -> &mut FrameInfo {
        Arc::make_mut(&mut self.0)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FrameInfo {
    /// The return address as found on the stack.
    pub address: String,
    /// `function`, or `module+0xoffset` when the module has no symbol for it.
    pub function: String,
    pub file: Option<String>,
    pub line: Option<u32>,
    pub module: String,
    /// Inlined into the next frame (same address).
    pub inlined: bool,
    /// The name as the object file's symbol table has it, when `function` is its demangled form
    /// or a compiler's clone of it (`fill.isra.0`): valgrind's suppressions name functions so
    /// (`--gen-suppressions`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mangled: Option<String>,
}

impl FrameInfo {
    /// A frame memprof could not name (see `names_no_function`).
    pub fn is_unnamed(&self) -> bool {
        names_no_function(&self.function)
    }
}

/// Whether `function` is how memprof shows code without a symbol: `module+0xoffset`, the
/// module's file name and the offset in it. No C, C++ or Rust name has that shape.
pub fn names_no_function(function: &str) -> bool {
    function.rsplit_once("+0x").is_some_and(|(module, offset)| {
        !module.is_empty() && !offset.is_empty() && offset.bytes().all(|b| b.is_ascii_hexdigit())
    })
}

/// Longest function name or file path kept: a symbol can be any length (a generated C++ type
/// reaches megabytes), and each is kept for as long as its process is traced.
pub const MAX_NAME: usize = 4096;

/// `name`, cut at `MAX_NAME` bytes with a marker saying how much was left out.
pub fn capped(name: &str) -> String {
    if name.len() <= MAX_NAME {
        return name.to_string();
    }
    let mut end = MAX_NAME;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...[{} more bytes]", &name[..end], name.len() - end)
}

/// An address resolved to its place in a file: stable across runs, unlike the address.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    pub module: String,
    pub file_offset: u64,
    pub frames: Vec<Frame>,
}

/// Why an address got no function name, for the failure counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// In no file mapping of the process (JIT code, or the mappings were not read in time).
    NoModule,
    /// In a file without a symbol for it (stripped, or no such function).
    NoSymbol,
    /// In memory that holds no code (a thread's stack, data): the walk that found it went wrong
    /// there, and its stack ends before it (see `Resolved::is_not_code`).
    NotCode,
}

impl Failure {
    pub const ALL: [Failure; 3] = [Failure::NoModule, Failure::NoSymbol, Failure::NotCode];

    pub fn name(self) -> &'static str {
        match self {
            Failure::NoModule => "no_module",
            Failure::NoSymbol => "no_symbol",
            Failure::NotCode => "not_code",
        }
    }
}

/// Addresses that got no function name, by `Failure`.
type Failures = Arc<[AtomicU64; Failure::ALL.len()]>;

/// The module of addresses in no file mapping.
const ANONYMOUS: &str = "[anonymous]";

/// The module of addresses in memory that holds no code.
const NOT_CODE: &str = "[not code]";

impl Resolved {
    /// An address in memory that holds no code, with no frame: a frame-pointer walk through a
    /// JIT's frames (node's) can read a stack address as a return address.
    pub fn is_not_code(&self) -> bool {
        self.module == NOT_CODE
    }
}

enum Request {
    /// Re-read the process's mappings (it may have loaded libraries) and keep their files open.
    Refresh {
        pid: u32,
        /// Read already (see `refresh_with`), else read now.
        mappings: Option<Vec<FileMapping>>,
        done: mpsc::Sender<()>,
    },
    /// Stacks of return addresses, each resolved as a whole.
    Symbolize { pid: u32, stacks: Vec<Vec<u64>>, reply: mpsc::Sender<Vec<Vec<Resolved>>> },
    /// The executable mappings of these files, as last read.
    Modules { pid: u32, paths: BTreeSet<String>, reply: mpsc::Sender<Vec<Module>> },
    /// A process just forked `child`: the child's mappings are its parent's until it maps
    /// others. Read as `Refresh` reads them, with the parent's open files; the parent's where the
    /// child's cannot be read (it exited meanwhile, as a short-lived child does while memprof
    /// attaches to it).
    Inherit { parent: u32, child: u32, mappings: Vec<FileMapping>, done: mpsc::Sender<()> },
    /// The process has exited and will not be asked about again: drop its files and cache.
    Forget { pid: u32 },
}

/// A cheap handle to the symbolizer thread.
#[derive(Clone)]
pub struct SymbolizerHandle {
    requests: mpsc::Sender<Request>,
    failures: Failures,
}

impl SymbolizerHandle {
    pub fn spawn() -> Self {
        let (requests, receiver) = mpsc::channel();
        let failures: Failures = Arc::default();
        let counted = failures.clone();
        thread::Builder::new()
            .name("symbolizer".into())
            .spawn(move || SymbolizerThread::new(counted).serve(receiver))
            .expect("spawning the symbolizer thread");
        Self { requests, failures }
    }

    pub fn forget(&self, pid: u32) {
        let _ = self.requests.send(Request::Forget { pid });
    }

    /// How many distinct addresses got no function name, by reason.
    pub fn failures(&self) -> Vec<(Failure, u64)> {
        Failure::ALL.iter().map(|f| (*f, self.failures[*f as usize].load(Ordering::Relaxed))).collect()
    }

    pub fn refresh(&self, pid: u32) {
        let (done, wait) = mpsc::channel();
        if self.requests.send(Request::Refresh { pid, mappings: None, done }).is_ok() {
            let _ = wait.recv();
        }
    }

    /// `refresh` with `pid`'s mappings read already: a process that may have exited since
    /// (its files are opened by path then, when the path still names the file mapped).
    pub fn refresh_with(&self, pid: u32, mappings: Vec<FileMapping>) {
        let (done, wait) = mpsc::channel();
        if self.requests.send(Request::Refresh { pid, mappings: Some(mappings), done }).is_ok() {
            let _ = wait.recv();
        }
    }

    /// Takes `mappings`, those of `child` just forked by `parent` as read (see `Request::Inherit`).
    pub fn inherit(&self, parent: u32, child: u32, mappings: Vec<FileMapping>) {
        let (done, wait) = mpsc::channel();
        if self.requests.send(Request::Inherit { parent, child, mappings, done }).is_ok() {
            let _ = wait.recv();
        }
    }

    /// Resolves the return addresses of `pid`'s `stacks` (all frames of a stack are return
    /// addresses), in one request: a process's first report names hundreds of stacks, and each
    /// request is a round trip between two threads.
    pub fn symbolize(&self, pid: u32, stacks: Vec<Vec<u64>>) -> Vec<Vec<Resolved>> {
        let (reply, wait) = mpsc::channel();
        let counts: Vec<usize> = stacks.iter().map(Vec::len).collect();
        if self.requests.send(Request::Symbolize { pid, stacks, reply }).is_ok() {
            if let Ok(resolved) = wait.recv() {
                return resolved;
            }
        }
        counts.into_iter().map(|count| vec![unknown(0, "[unknown]", 0); count]).collect()
    }

    /// The executable mappings of `pid` whose file is one of `paths`, with their build ids.
    pub fn modules(&self, pid: u32, paths: BTreeSet<String>) -> Vec<Module> {
        let (reply, wait) = mpsc::channel();
        if self.requests.send(Request::Modules { pid, paths, reply }).is_ok() {
            return wait.recv().unwrap_or_default();
        }
        Vec::new()
    }
}

/// A file mapping of a traced process with the file kept open (see the module doc).
#[derive(Clone)]
struct OpenModule {
    mapping: FileMapping,
    file: Arc<OpenFile>,
}

struct SymbolizerThread {
    symbolizer: Symbolizer,
    modules: HashMap<u32, Vec<OpenModule>>,
    /// Every open mapped file by its device and inode, so that all mappings of one file in all
    /// processes share one descriptor, and blazesym, which caches what it parsed by path
    /// (`/proc/self/fd/N`), parses it once. Held by `modules`; an entry is gone once they let go.
    files: HashMap<(String, u64), Weak<OpenFile>>,
    cache: HashMap<(u32, u64), Resolved>,
    /// Each process's executable mappings as last read (see `sort_out_anonymous`): a process
    /// gone keeps those it had.
    code: HashMap<u32, Vec<Range<u64>>>,
    failures: Failures,
}

impl SymbolizerThread {
    fn new(failures: Failures) -> Self {
        // Names are demangled by `demangle::demangled`: blazesym's demangling takes any name for a C++ one.
        // Debug files are looked for only where `debug_links` checks them.
        let symbolizer = Symbolizer::builder()
            .enable_code_info(true)
            .enable_inlined_fns(true)
            .enable_demangling(false)
            .set_debug_dirs(Some([DEBUG_DIR]))
            .build();
        Self {
            symbolizer,
            modules: HashMap::new(),
            files: HashMap::new(),
            cache: HashMap::new(),
            code: HashMap::new(),
            failures,
        }
    }

    fn serve(mut self, requests: mpsc::Receiver<Request>) {
        for request in requests {
            match request {
                Request::Refresh { pid, mappings, done } => {
                    self.refresh(pid, mappings);
                    let _ = done.send(());
                }
                Request::Inherit { parent, child, mappings, done } => {
                    // The parent's files first: a child gone before its read is still
                    // symbolized by them.
                    if let Some(inherited) = self.modules.get(&parent).map(|modules| modules.to_vec()) {
                        self.modules.insert(child, inherited);
                    }
                    self.refresh(child, Some(mappings));
                    let _ = done.send(());
                }
                Request::Symbolize { pid, stacks, reply } => {
                    let resolved = (stacks.iter())
                        .map(|addresses| {
                            let mut resolved: Vec<Resolved> =
                                addresses.iter().map(|&address| self.resolve(pid, address)).collect();
                            self.sort_out_anonymous(pid, &mut resolved);
                            resolved
                        })
                        .collect();
                    let _ = reply.send(resolved);
                }
                Request::Modules { pid, paths, reply } => {
                    let _ = reply.send(self.executable_modules(pid, &paths));
                }
                Request::Forget { pid } => {
                    self.modules.remove(&pid);
                    self.cache.retain(|(cached_pid, _), _| *cached_pid != pid);
                    self.code.remove(&pid);
                    self.files.retain(|_, file| file.strong_count() > 0);
                }
            }
        }
    }

    fn refresh(&mut self, pid: u32, mappings: Option<Vec<FileMapping>>) {
        // An exited process that is not yet reaped still has a /proc entry, with no mappings:
        // keep what was read while it lived.
        let mappings = match mappings {
            Some(mappings) => mappings,
            // The code ranges too, from the same read: a process that exits before its last
            // stacks are named has its addresses sorted out by those (see `sort_out_anonymous`).
            None => match procfs::file_mappings_and_code(pid) {
                Ok((mappings, code)) => {
                    if !code.is_empty() {
                        self.code.insert(pid, code);
                    }
                    mappings
                }
                Err(_) => return,
            },
        };
        if mappings.is_empty() {
            return;
        }
        let old = self.modules.remove(&pid).unwrap_or_default();
        let mut modules = Vec::with_capacity(mappings.len());
        for mapping in mappings {
            let Some(file) = self.open(pid, &mapping) else { continue };
            modules.push(OpenModule { mapping, file });
        }
        // What the new list misses is kept, unless its addresses or its file are now mapped
        // elsewhere: a list read as the process exits, or rebuilt from the linker's list, can
        // miss files, and stacks recorded while a library was loaded still point into it after
        // a dlclose. Bounded by the files the process ever mapped.
        let missed: Vec<OpenModule> = old
            .into_iter()
            .filter(|gone| {
                !modules.iter().any(|m| {
                    m.mapping.path == gone.mapping.path
                        || (m.mapping.start < gone.mapping.end && gone.mapping.start < m.mapping.end)
                })
            })
            .collect();
        modules.extend(missed);
        self.modules.insert(pid, modules);
    }

    /// The file `mapping` maps: the one open already when any process maps it, else opened now.
    fn open(&mut self, pid: u32, mapping: &FileMapping) -> Option<Arc<OpenFile>> {
        let identity = (mapping.inode != 0).then(|| (mapping.device.clone(), mapping.inode));
        if let Some(file) = identity.as_ref().and_then(|identity| self.files.get(identity)?.upgrade()) {
            return Some(file);
        }
        let file = mapping.open(pid)?;
        let file = Arc::new(OpenFile {
            debug_info: AtomicBool::new(debug_info_is_safe(&file)),
            unreadable: AtomicBool::new(false),
            file,
            clones: OnceLock::new(),
            build_id: OnceLock::new(),
            stripped_go: OnceLock::new(),
        });
        if let Some(identity) = identity {
            self.files.insert(identity, Arc::downgrade(&file));
        }
        Some(file)
    }

    fn executable_modules(&self, pid: u32, paths: &BTreeSet<String>) -> Vec<Module> {
        let modules = self.modules.get(&pid).map(Vec::as_slice).unwrap_or_default();
        modules
            .iter()
            .filter(|m| m.mapping.executable && paths.contains(printable(&m.mapping.path).as_ref()))
            .map(|m| Module {
                path: printable(&m.mapping.path).into_owned(),
                start: m.mapping.start,
                limit: m.mapping.end,
                file_offset: m.mapping.offset,
                build_id: m.file.build_id().to_owned(),
            })
            .collect()
    }

    fn resolve(&mut self, pid: u32, address: u64) -> Resolved {
        if let Some(known) = self.cache.get(&(pid, address)) {
            return known.clone();
        }
        let resolved = self.resolve_uncached(pid, address);
        // An address in no known mapping may be in a library loaded since the last refresh: ask
        // again next time rather than remember the failure.
        if resolved.module != ANONYMOUS {
            self.cache.insert((pid, address), resolved.clone());
        }
        resolved
    }

    fn resolve_uncached(&self, pid: u32, address: u64) -> Resolved {
        let module = self
            .modules
            .get(&pid)
            .and_then(|modules| modules.iter().find(|m| (m.mapping.start..m.mapping.end).contains(&address)));
        let Some(module) = module else {
            // Counted by `sort_out_anonymous`.
            return unknown(address, ANONYMOUS, address);
        };
        let file_offset = address - module.mapping.start + module.mapping.offset;
        // As frames name it (see `frames_of`).
        let path = &printable(&module.mapping.path).into_owned();
        // A return address points after the call; the call itself is one byte earlier.
        if let Some(go) = module.file.stripped_go() {
            return match go.frame(&module.file.file, file_offset.saturating_sub(1)) {
                Some(frame) => {
                    Resolved { module: path.clone(), file_offset, frames: vec![go_frame(address, path, frame)] }
                }
                None => {
                    self.count(Failure::NoSymbol);
                    unknown(address, path, file_offset)
                }
            };
        }
        let symbolize = |offset| self.symbolize_offset(module, path, offset);
        let symbolized = match symbolize(file_offset.saturating_sub(1)) {
            // A signal handler returns to the first byte of the trampoline (`__restore_rt`): the
            // byte before it is padding between functions.
            Some(Symbolized::Unknown(_)) => symbolize(file_offset),
            other => other,
        };
        match symbolized {
            Some(Symbolized::Sym(sym)) => {
                // Names from the symbol table carry a clone's suffix already.
                let debug_info = module.file.debug_info.load(Ordering::Relaxed);
                let clone = debug_info.then(|| module.file.clones().of(sym.addr, &sym.name)).flatten();
                Resolved { module: path.clone(), file_offset, frames: frames_of(address, path, &sym, clone) }
            }
            _ => {
                self.count(Failure::NoSymbol);
                unknown(address, path, file_offset)
            }
        }
    }

    /// blazesym's answer for `file_offset` in `module`'s file (named `path`). A file whose debug
    /// information makes blazesym panic (a malformed `.debug_line`, which any user's program
    /// can carry) is read again without it, and from then on: the panic would otherwise end
    /// this thread, and every process's stacks would go unnamed.
    fn symbolize_offset(&self, module: &OpenModule, path: &str, file_offset: u64) -> Option<Symbolized<'_>> {
        let attempt = |debug_syms: bool| {
            let mut elf = Elf::new(PathBuf::from(format!("/proc/self/fd/{}", module.file.file.as_raw_fd())));
            elf.debug_syms = debug_syms;
            let source = Source::Elf(elf);
            std::panic::catch_unwind(AssertUnwindSafe(|| {
                self.symbolizer.symbolize_single(&source, Input::FileOffset(file_offset)).ok()
            }))
        };
        if module.file.unreadable.load(Ordering::Relaxed) {
            return None;
        }
        let debug_info = module.file.debug_info.load(Ordering::Relaxed);
        if let Ok(symbolized) = attempt(debug_info) {
            return symbolized;
        }
        if debug_info {
            module.file.debug_info.store(false, Ordering::Relaxed);
            tracing::warn!(
                "{path}: its debugging information could not be read: its frames are named from its symbol table, without source lines"
            );
            if let Ok(symbolized) = attempt(false) {
                return symbolized;
            }
        }
        // Not asked again: each panic would be said on standard error.
        module.file.unreadable.store(true, Ordering::Relaxed);
        tracing::warn!("{path}: its symbols could not be read: its frames are not named");
        None
    }

    /// Addresses in no file mapping: a JIT's code (in an executable anonymous mapping, or in a
    /// file mapped since the last refresh), counted `NoModule`; or no code at all, `NotCode`,
    /// remembered as such. Told by the process's executable mappings, read again (once for the
    /// lot) only when an address is in none of those last read: a process gone keeps its last.
    fn sort_out_anonymous(&mut self, pid: u32, resolved: &mut [Resolved]) {
        // A return address follows its call: the call is in code even at a mapping's very end.
        let in_code =
            |code: &[Range<u64>], r: &Resolved| code.iter().any(|c| c.contains(&r.file_offset.saturating_sub(1)));
        let unknown = |r: &Resolved| r.module == ANONYMOUS;
        let known = self.code.get(&pid).map(Vec::as_slice).unwrap_or_default();
        if resolved.iter().any(|r| unknown(r) && !in_code(known, r)) {
            if let Some(code) = procfs::executable_ranges(pid).ok().filter(|code| !code.is_empty()) {
                self.code.insert(pid, code);
            }
        }
        let Some(code) = self.code.get(&pid) else {
            resolved.iter().filter(|r| unknown(r)).for_each(|_| self.count(Failure::NoModule));
            return;
        };
        for r in resolved.iter_mut().filter(|r| unknown(r)) {
            if in_code(code, r) {
                self.count(Failure::NoModule);
                continue;
            }
            self.count(Failure::NotCode);
            let address = r.file_offset;
            *r = Resolved { module: NOT_CODE.to_string(), file_offset: address, frames: Vec::new() };
            self.cache.insert((pid, address), r.clone());
        }
    }

    fn count(&self, failure: Failure) {
        self.failures[failure as usize].fetch_add(1, Ordering::Relaxed);
    }
}

/// A mapped file kept open.
struct OpenFile {
    file: File,
    /// Whether blazesym may read its debug information: where it is safe to
    /// (`debug_info_is_safe`), until it made blazesym fail (`symbolize_offset`).
    debug_info: AtomicBool,
    /// Its symbol table made blazesym fail too: its frames go unnamed.
    unreadable: AtomicBool,
    /// Read when a frame is first named from its debug information.
    clones: OnceLock<Clones>,
    /// Read when first asked for, once for every process that maps the file: pprof names code
    /// by it.
    build_id: OnceLock<String>,
    /// A Go program without a symbol table is named by its own function table, which blazesym
    /// does not read; read when first asked for.
    stripped_go: OnceLock<Option<StrippedGo>>,
}

impl OpenFile {
    fn stripped_go(&self) -> Option<&StrippedGo> {
        self.stripped_go.get_or_init(|| StrippedGo::read(&self.file)).as_ref()
    }

    fn clones(&self) -> &Clones {
        self.clones.get_or_init(|| Clones::read(&self.file))
    }

    fn build_id(&self) -> &str {
        self.build_id.get_or_init(|| build_id(&self.file))
    }
}

/// The ELF's GNU build id in lowercase hex; empty when it has none or is not ELF.
fn build_id(file: &File) -> String {
    let cache = object::ReadCache::new(file);
    let id = object::File::parse(&cache).ok().and_then(|elf| object::Object::build_id(&elf).ok().flatten());
    id.map(|bytes| bytes.iter().map(|b| format!("{b:02x}")).collect()).unwrap_or_default()
}

fn unknown(address: u64, module: &str, file_offset: u64) -> Resolved {
    let name = module.rsplit('/').next().unwrap_or(module);
    Resolved {
        module: module.to_string(),
        file_offset,
        frames: vec![Frame::new(FrameInfo {
            address: format!("{address:#x}"),
            function: capped(&format!("{name}+{file_offset:#x}")),
            file: None,
            line: None,
            module: capped(module),
            inlined: false,
            mangled: None,
        })],
    }
}

/// The frame of one address of a stripped Go program (`module` already printable).
fn go_frame(address: u64, module: &str, frame: GoFrame) -> Frame {
    Frame::new(FrameInfo {
        address: format!("{address:#x}"),
        function: capped(&printable(&frame.function)),
        file: frame.file.map(|file| capped(&printable(&file))),
        line: frame.line,
        module: capped(module),
        inlined: false,
        mangled: None,
    })
}

/// The frames of one address (`module` already printable): inlined functions innermost first,
/// then the function they sit in, which is `clone` in the symbol table when a compiler cloned it.
/// blazesym gives each its own location: `sym.code_info` is in `sym`, `inlined[i]`'s in itself.
fn frames_of(address: u64, module: &str, sym: &Sym, clone: Option<&str>) -> Vec<Frame> {
    let frame = |function: &str, code_info: Option<&blazesym::symbolize::CodeInfo>, inlined: bool| {
        let function = without_internal_alias(function);
        let name = demangle::demangled(function);
        let symbol = if inlined { None } else { clone };
        let mangled = symbol.or((name != function).then_some(function)).map(|symbol| capped(&printable(symbol)));
        Frame::new(FrameInfo {
            address: format!("{address:#x}"),
            function: capped(&printable(&name)),
            file: code_info.map(|info| capped(&printable(&info.file.to_string_lossy()))),
            line: code_info.and_then(|info| info.line),
            module: capped(module),
            inlined,
            mangled,
        })
    };
    let mut frames: Vec<Frame> = sym.inlined.iter().rev().map(|f| frame(&f.name, f.code_info.as_ref(), true)).collect();
    frames.push(frame(&sym.name, sym.code_info.as_deref(), false));
    frames
}

/// glibc's hidden alias of a function for its own calls (`__GI___strdup`, `__GI_memcpy`), which
/// its debug symbols name first, read as the function it aliases (`__strdup`): no one calls it by
/// the alias's name, and valgrind never shows it.
fn without_internal_alias(function: &str) -> &str {
    function.strip_prefix("__GI_").filter(|name| !name.is_empty()).unwrap_or(function)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glibcs_internal_aliases_read_as_what_they_alias() {
        assert_eq!(without_internal_alias("__GI___strdup"), "__strdup");
        assert_eq!(without_internal_alias("__GI_memcpy"), "memcpy");
        assert_eq!(without_internal_alias("__GI_"), "__GI_");
        assert_eq!(without_internal_alias("g_strdup"), "g_strdup");
    }
}
