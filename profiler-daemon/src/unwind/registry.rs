//! Which unwind tables the kernel has: one per mapped file, shared by every process that maps
//! it, and each traced process's executable mappings pointing at them.
//!
//! Rows live in shards the kernel's walk reads and memprof writes through a mapping (`shards`).
//! A file's rows stay while some traced process maps it; after, they are kept idle for a while
//! (`idle`), then freed for reuse; a shard with no rows in use is given back to the kernel.

use std::{
    collections::{HashMap, HashSet},
    time::{Duration, Instant},
};

use aya::{maps::HashMap as BpfHashMap, Ebpf};
use profiler_common::{mapping_kind, DeferredUnwind, ExecMapping, ProcMappings, StackEnd, MAX_MAPPINGS};

use super::{
    deferred::{self, Completion, Deferred},
    idle::{FileKey, IdleTables},
    shards::{Shards, SHARD_BYTES},
    share::UserShares,
    space::RowSpace,
};
use crate::console::say;
use crate::process::{
    file_cache::FileVersion,
    procfs::{self, FileMapping},
};

mod files;
use files::bias;
pub(crate) use files::load_segments;

/// How memprof walks stacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UnwindMode {
    /// DWARF CFI from each file's `.eh_frame`: right on code built without frame pointers.
    Cfi,
    /// Frame pointers only: a little cheaper per frame, wrong where code omits them (most
    /// distribution code).
    Fp,
}

struct FileTable {
    first_row: u32,
    rows: u32,
    kind: u32,
    /// Executable loadable segments: (file offset, file size, virtual address), to find a
    /// mapping's bias.
    segments: Vec<(u64, u64, u64)>,
    /// How many traced processes map the file, by their user (see `share`).
    users: HashMap<u32, usize>,
    /// The file as the table was built from it; None where that could not be read: such a
    /// table is not kept idle.
    version: Option<FileVersion>,
}

/// A traced process: its user and the files it maps with code.
#[derive(Default)]
struct Process {
    uid: u32,
    files: HashSet<FileKey>,
}

/// The user a process is counted under when it was gone before its user could be read: one of
/// its own, bounded as any other.
const UNKNOWN_USER: u32 = u32::MAX;

/// Unwind tables in the kernel and the processes that use them.
pub struct Registry {
    mode: UnwindMode,
    shards: Shards,
    /// Which rows are in use, up to `--max-unwind-rows`.
    space: RowSpace,
    files: HashMap<FileKey, FileTable>,
    /// The rows each user's processes hold, and the most one may take.
    shares: UserShares,
    /// Files each traced process maps, to release them when it goes.
    processes: HashMap<u32, Process>,
    /// Files `memprof run`'s command is about to map (`preload`), held for it until a list of
    /// its mappings has them all: its first list, read at its exec, has only the executable and
    /// the dynamic linker, and releasing the C library's table there only to build it again a
    /// moment later is work thrown away.
    preloaded: HashMap<u32, HashSet<FileKey>>,
    /// Processes whose dynamic linker is hooked in the program they run (see
    /// `linker_hooked`): only their lists can be whole.
    linker_hooked: HashSet<u32>,
    /// Files whose table could not be loaded, with the rows it needed (0: not known), until it
    /// is: each is counted once in `not_loaded`, and one refused for want of room is not built
    /// again before that many rows are free.
    refused: HashMap<FileKey, u32>,
    not_loaded: NotLoaded,
    /// Files already warned about, so that each warning is said once.
    warned: HashSet<String>,
    /// Writes of `PROC_MAPPINGS` and purges of `STACKS` so far: the value of `MAPPINGS_GENERATION`.
    mapping_writes: u32,
    /// Tables no traced process uses, kept for the next (see `idle`).
    idle: IdleTables,
    /// Tables built so far (not those found loaded, in use or idle).
    built: u64,
    /// Walks the kernel left for memprof to finish.
    deferred: Deferred,
    /// `--max-frames`.
    frame_limit: usize,
}

/// Tables of mapped files that could not be loaded (their frames end stacks, counted as
/// `unwind_no_table`): each file counted once until its table is loaded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct NotLoaded {
    tables: u64,
    /// The rows they needed, where known (a file that cannot be read has no known size).
    rows: u64,
}

/// How many rows the tables take, and of how many files: for reports, metrics and the benchmark.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TableUse {
    /// Files with tables in the kernel (CFI rows, or frame pointers for a file without CFI).
    pub files: usize,
    /// Rows of the tables traced processes map.
    pub rows_used: u64,
    /// Rows of the tables no traced process maps now, kept for the next that does (see
    /// `--keep-unwind-tables`), or taken by a new table that needs them.
    #[serde(default)]
    pub rows_idle: u64,
    /// Tables built so far, each read from its file: a table kept idle and mapped again is not
    /// built again.
    #[serde(default)]
    pub tables_built: u64,
    /// Rows still free under `--max-unwind-rows`.
    pub rows_free: u64,
    /// `--max-unwind-rows`.
    pub rows_max: u64,
    /// Kernel memory of the shards that hold the rows (created as they are needed).
    pub kernel_bytes: u64,
    /// Tables of mapped files that could not be loaded: full tables (`rows_free` too few), a
    /// shard the kernel refused, or a file that could not be read. Counted once a file.
    pub tables_not_loaded: u64,
    /// The rows those tables needed, where known.
    pub rows_not_loaded: u64,
    /// Walks that met a file whose table was not loaded yet and were finished here, from a copy
    /// of the stack (see `deferred`), and those of them that could not reach the outermost
    /// frame (their stacks are marked truncated).
    pub deferred_walks: u64,
    pub deferred_unfinished: u64,
    /// Those of the walks whose allocation stack is counted under two ids, whose highs the
    /// reports add (an upper bound): the kernel had walked the stack whole, or another walk of
    /// it was deferred at another frame, before memprof finished this one (see
    /// `kernel::early_stacks`).
    pub deferred_split: u64,
    /// Executable code the tables cover: the executable segments of the files with CFI tables.
    #[serde(skip)]
    pub text_bytes: u64,
    /// What memprof itself keeps for the tables (rows live only in the kernel): its records of
    /// the files and of which process maps which, with their strings and vectors (not the hash
    /// tables' spare room).
    #[serde(skip)]
    pub held_bytes: u64,
}

impl Registry {
    /// Takes `UNWIND_SHARDS`; `max_rows` bounds the rows of all tables together.
    /// `frame_limit` is `--max-frames`. Tables no process uses are freed at once unless told
    /// (`keep_idle`): `run` and `attach` have no timer to free them later.
    pub fn new(ebpf: &mut Ebpf, mode: UnwindMode, max_rows: u32, frame_limit: u32) -> anyhow::Result<Self> {
        let map = ebpf.take_map("UNWIND_SHARDS").ok_or_else(|| anyhow::anyhow!("map UNWIND_SHARDS missing"))?;
        let shards = Shards::new(map)?;
        let capacity = u64::from(max_rows).min(shards.max_rows()) as u32;
        Ok(Self {
            mode,
            shards,
            space: RowSpace::new(capacity),
            files: HashMap::new(),
            shares: UserShares::default(),
            processes: HashMap::new(),
            preloaded: HashMap::new(),
            linker_hooked: HashSet::new(),
            refused: HashMap::new(),
            not_loaded: NotLoaded::default(),
            warned: HashSet::new(),
            mapping_writes: 0,
            idle: IdleTables::new(Duration::ZERO),
            built: 0,
            deferred: Deferred::default(),
            frame_limit: frame_limit as usize,
        })
    }

    pub fn table_use(&self) -> TableUse {
        let cfi = self.files.values().filter(|file| file.kind == mapping_kind::CFI);
        let text_bytes = cfi.flat_map(|file| &file.segments).map(|(_, size, _)| size).sum();
        let key_bytes = |(device, _): &FileKey| size_of::<FileKey>() + device.capacity();
        let file_bytes = |(key, file): (&FileKey, &FileTable)| {
            key_bytes(key) + size_of::<FileTable>() + file.segments.capacity() * size_of::<(u64, u64, u64)>()
        };
        let held: usize = self.files.iter().map(file_bytes).sum::<usize>()
            + self.processes.values().flat_map(|process| &process.files).map(key_bytes).sum::<usize>();
        let (taken, capacity) = (u64::from(self.space.used()), u64::from(self.space.capacity()));
        let idle: u64 = self.idle.keys().filter_map(|key| self.files.get(key)).map(|file| u64::from(file.rows)).sum();
        TableUse {
            files: self.files.len(),
            rows_used: taken - idle,
            rows_idle: idle,
            tables_built: self.built,
            rows_free: capacity - taken,
            rows_max: capacity,
            kernel_bytes: self.shards.count() as u64 * SHARD_BYTES,
            tables_not_loaded: self.not_loaded.tables,
            rows_not_loaded: self.not_loaded.rows,
            deferred_walks: self.deferred.counts.walks,
            deferred_unfinished: self.deferred.counts.unfinished,
            deferred_split: self.deferred.counts.split,
            text_bytes,
            held_bytes: held as u64,
        }
    }

    /// Bounds the rows one user's traced processes may take (`--max-unwind-rows-per-user`).
    pub fn bound_per_user(&mut self, rows: u32) {
        self.shares.bound(rows);
    }

    /// How long a table no traced process maps is kept for the next (`--keep-unwind-tables`).
    pub fn keep_idle(&mut self, keep: Duration) {
        self.idle.set_keep(keep);
        self.drop_unused();
        self.log_use();
    }

    /// When an idle table's time is up: `drop_expired` then gives its rows back.
    pub fn next_idle_expiry(&self) -> Option<Instant> {
        self.idle.next_expiry()
    }

    /// Gives back the rows of idle tables kept long enough.
    pub fn drop_expired(&mut self) {
        if self.next_idle_expiry().is_some_and(|expiry| expiry <= Instant::now()) {
            self.drop_unused();
            self.log_use();
        }
    }

    /// Kernel memory the shards not created yet would take, were every row up to `--max-unwind-rows` used.
    pub fn kernel_growth_bytes(&self) -> u64 {
        let shards = u64::from(self.space.capacity()).div_ceil(u64::from(profiler_common::UNWIND_SHARD_ROWS));
        shards.saturating_sub(self.shards.count() as u64) * SHARD_BYTES
    }

    /// Builds the tables of files of `mappings` (`pid`'s executable mappings) not seen yet, and
    /// gives the kernel the process's new mapping list. Cheap when nothing changed. Returns
    /// whether the files it maps with code changed. The mappings may be those of a process that
    /// has exited since; `changes`, what `code_changes` gave before they were read.
    /// `before_list` is given the new list, its files' tables loaded, before the kernel has it;
    /// not called when the list is held back.
    /// `list_may_wait`: whether the process is traced by its calls and its dynamic linker has
    /// not sent its objects since its exec (see `waits_for_libraries`).
    pub fn sync_with(
        &mut self,
        ebpf: &mut Ebpf,
        pid: u32,
        mappings: &[FileMapping],
        changes: u64,
        list_may_wait: bool,
        before_list: impl FnOnce(&mut Ebpf, &mut Self, &ProcMappings),
    ) -> anyhow::Result<bool> {
        let old = self.processes.remove(&pid);
        let uid = procfs::real_uid(pid).or(old.as_ref().map(|process| process.uid)).unwrap_or(UNKNOWN_USER);
        let old = old.unwrap_or_default();
        // The files this user holds for the process already; each new one is taken as it comes,
        // so that the next table built is weighed against the rows taken before it.
        let held = if uid == old.uid { old.files.clone() } else { HashSet::new() };
        // The idle tables this list names first: no table built for it takes their rows.
        for mapping in mappings.iter().filter(|m| m.executable) {
            self.claim_idle(&(mapping.device.clone(), mapping.inode), pid, mapping);
        }
        let mut entries = Vec::new();
        let mut used = HashSet::new();
        for mapping in mappings.iter().filter(|m| m.executable) {
            let key = (mapping.device.clone(), mapping.inode);
            let Some(file) = self.file(&key, pid, uid, mapping) else { continue };
            let Some(bias) = bias(&file.segments, mapping) else { continue };
            entries.push(ExecMapping {
                start: mapping.start,
                end: mapping.end,
                bias,
                first_row: file.first_row,
                rows: file.rows,
                kind: file.kind,
                _pad: 0,
            });
            if !held.contains(&key) && !used.contains(&key) {
                self.acquire(&key, uid);
            }
            used.insert(key);
        }
        if entries.len() > MAX_MAPPINGS {
            self.warn_once(
                &format!("pid {pid}"),
                &format!(
                    "pid {pid} has {} executable mappings; frames in those past {MAX_MAPPINGS} are not unwound",
                    entries.len()
                ),
            );
            entries.truncate(MAX_MAPPINGS);
        }
        let mut list = ProcMappings {
            len: entries.len() as u32,
            _pad: 0,
            code_changes_seen: changes,
            entries: [ExecMapping::default(); MAX_MAPPINGS],
        };
        list.entries[..entries.len()].copy_from_slice(&entries);
        let waits = list_may_wait && self.waits_for_libraries(pid, &used);
        let written = if waits {
            Ok(())
        } else {
            before_list(ebpf, self, &list);
            self.write_list(ebpf, pid, &list)
        };
        if waits || written.is_err() {
            // The kernel keeps the old list: the process keeps the files it names.
            for key in used.difference(&held) {
                self.release(key, uid);
            }
            self.processes.insert(pid, old);
            self.drop_unused();
            return written.map(|()| false);
        }
        if let Some(preloaded) = self.preloaded.get(&pid) {
            if preloaded.is_subset(&used) {
                self.preloaded.remove(&pid);
            } else {
                let missing: Vec<FileKey> = preloaded.difference(&used).cloned().collect();
                for key in missing {
                    if !held.contains(&key) {
                        self.acquire(&key, uid);
                    }
                    used.insert(key);
                }
            }
        }
        for key in old.files.iter().filter(|key| !(held.contains(*key) && used.contains(*key))) {
            self.release(key, old.uid);
        }
        let changed = used != old.files;
        self.processes.insert(pid, Process { uid, files: used });
        self.drop_unused();
        if changed {
            self.log_use();
        }
        Ok(changed)
    }

    /// Whether `pid`'s list of files `used` is held back from the kernel (when it may wait:
    /// see `sync_with`): `memprof run`'s command's list read at its exec, which holds only the
    /// executable and its dynamic linker and lacks the libraries the linker maps a moment later
    /// (`preload`), until the linker, hooked, has reported them (it does once they are mapped).
    /// Meanwhile the command's walks stop at their first frame, as before it had a list, under
    /// the same ids; given that list, they would stop in the C library, under others, and a
    /// stack met at both places would be counted under two ids (see `kernel::early_stacks`).
    fn waits_for_libraries(&self, pid: u32, used: &HashSet<FileKey>) -> bool {
        const EXECUTABLE_AND_LINKER: usize = 2;
        self.linker_hooked.contains(&pid)
            && used.len() <= EXECUTABLE_AND_LINKER
            && self.preloaded.get(&pid).is_some_and(|preloaded| !preloaded.is_subset(used))
    }

    /// Gives the kernel `pid`'s mapping list.
    fn write_list(&mut self, ebpf: &mut Ebpf, pid: u32, list: &ProcMappings) -> anyhow::Result<()> {
        let mut map: BpfHashMap<_, u32, ProcMappings> = BpfHashMap::try_from(
            ebpf.map_mut("PROC_MAPPINGS").ok_or_else(|| anyhow::anyhow!("map PROC_MAPPINGS missing"))?,
        )?;
        map.insert(pid, list, 0)?;
        // After the write: a walk that began before it may cache the new rows under the old
        // generation, which the bump then discards.
        self.new_generation(ebpf)
    }

    /// `pid`'s dynamic linker is hooked (`mappings_changed` in the BPF crate), in the program it
    /// runs now: from the hook's first call, every library it maps moves the process's count of
    /// code changes before the library's code runs.
    pub fn linker_hooked(&mut self, pid: u32) {
        self.linker_hooked.insert(pid);
    }

    /// How many times `pid` may have mapped code (`CODE_CHANGES` in the BPF crate; started at 0
    /// for a process with no count yet), to read before the mappings a list is built from: the
    /// kernel then defers a walk stopped outside the list only once the count has moved past the
    /// list's (see `ProcMappings::code_changes_seen`). Before its dynamic linker is hooked, a
    /// count that never matches: libraries mapped meanwhile moved no count, and the kernel defers
    /// every such walk, whose copy then brings the process's mappings to be read again.
    pub fn code_changes(&self, ebpf: &mut Ebpf, pid: u32) -> u64 {
        if !self.linker_hooked.contains(&pid) {
            return NOT_WHOLE;
        }
        let Some(Ok(mut map)) = ebpf.map_mut(CODE_CHANGES).map(BpfHashMap::<_, u32, u64>::try_from) else {
            return NOT_WHOLE;
        };
        // Not over a count the programs started meanwhile. Without an entry (the map is full) the
        // kernel takes no list of the process as whole.
        let _ = map.insert(pid, 0, BPF_NOEXIST);
        map.get(&pid, 0).unwrap_or(NOT_WHOLE)
    }

    /// A walk the kernel deferred, finished on `list`: the list `sync_with` is about to give the
    /// kernel, or, without one, `event.tgid`'s list as the kernel has it now (`NoTable` without
    /// either). Kept only once given to `record_deferred`.
    pub fn walk_deferred_on(&self, ebpf: &Ebpf, event: &DeferredUnwind, list: Option<&ProcMappings>) -> Completion {
        let kernels = || {
            ebpf.map("PROC_MAPPINGS")
                .and_then(|map| BpfHashMap::<_, u32, ProcMappings>::try_from(map).ok())
                .and_then(|map| map.get(&event.tgid, 0).ok())
        };
        match list {
            Some(list) => self.walk_deferred(event, list),
            None => match kernels() {
                Some(list) => self.walk_deferred(event, &list),
                None => Completion { frames: Vec::new(), end: StackEnd::NoTable },
            },
        }
    }

    /// Deferred walk `event` finished on `list`, ending `NoTable` where the list lacks a table
    /// for one of its frames; kept only once given to `record_deferred`.
    pub fn walk_deferred(&self, event: &DeferredUnwind, list: &ProcMappings) -> Completion {
        deferred::walk_on(event, list, &self.shards, self.frame_limit)
    }

    /// Keeps and counts `completion`, deferred walk `event` as `walk_deferred` finished it.
    pub fn record_deferred(&mut self, event: &DeferredUnwind, completion: Completion) -> &Completion {
        self.deferred.record(event, completion)
    }

    /// A finished walk's allocation stack is counted under two ids (see `TableUse`).
    pub fn deferred_split(&mut self) {
        self.deferred.counts.split += 1;
    }

    /// Process `tgid`'s deferred walks that ended cut, by the drop reason the kernel's walk
    /// counts them under.
    pub fn deferred_drops(&self, tgid: u32) -> impl Iterator<Item = (profiler_common::DropReason, u64)> + '_ {
        self.deferred.drops(tgid)
    }

    /// Process `tgid` exec'd at `exec_ns` (see `Deferred::exec_happened`).
    pub fn exec_happened(&mut self, tgid: u32, exec_ns: u64) {
        self.deferred.exec_happened(tgid, exec_ns);
        // The hook was in the old program's linker; the new one may have another, or none.
        self.linker_hooked.remove(&tgid);
    }

    /// The deferred walks of process `tgid` finished so far.
    pub fn deferred_finished(&self, tgid: u32) -> u64 {
        self.deferred.finished(tgid)
    }

    /// The rest of a deferred walk, once finished.
    pub fn completion(&self, tgid: u32, table: u32, stack_id: u64) -> Option<&Completion> {
        self.deferred.completion(tgid, table, stack_id)
    }

    /// Builds the tables of the files `pid` is about to map (`memprof run`'s command before its
    /// exec, from its dynamic loader's list) and holds them for it until it maps them all: then
    /// only its mappings are left to read, in a moment, before much of it has run.
    pub fn preload(&mut self, pid: u32, paths: &[std::path::PathBuf]) {
        use std::os::unix::fs::MetadataExt as _;
        let uid = procfs::real_uid(pid).unwrap_or(UNKNOWN_USER);
        let mut keys = HashSet::new();
        for path in paths {
            let Ok(meta) = std::fs::metadata(path) else { continue };
            let device = format!("{:02x}:{:02x}", libc::major(meta.dev()), libc::minor(meta.dev()));
            let mapping = FileMapping {
                start: 0,
                end: 0,
                offset: 0,
                path: path.display().to_string(),
                executable: true,
                device: device.clone(),
                inode: meta.ino(),
            };
            let key = (device, meta.ino());
            if self.file(&key, pid, uid, &mapping).is_some() && keys.insert(key.clone()) {
                self.acquire(&key, uid);
            }
        }
        self.processes.insert(pid, Process { uid, files: keys.clone() });
        self.preloaded.insert(pid, keys);
        self.log_use();
    }

    /// One line whenever the tables in use change (`cargo xtask bench` reads it).
    fn log_use(&self) {
        let TableUse { files, rows_used: rows, rows_idle, kernel_bytes, text_bytes, held_bytes, .. } = self.table_use();
        tracing::debug!(files, rows, rows_idle, kernel_bytes, text_bytes, held_bytes, "unwind tables in use");
    }

    /// Bumps `MAPPINGS_GENERATION`, which ends what the kernel's walks cached: rows by address, and
    /// walks remembered with their stack ids. After stacks were removed from `STACKS`: a
    /// remembered walk would give an id no longer stored.
    pub fn new_generation(&mut self, ebpf: &mut Ebpf) -> anyhow::Result<()> {
        self.mapping_writes = self.mapping_writes.wrapping_add(1);
        let mut generation: aya::maps::Array<_, u32> = aya::maps::Array::try_from(
            ebpf.map_mut("MAPPINGS_GENERATION").ok_or_else(|| anyhow::anyhow!("map MAPPINGS_GENERATION missing"))?,
        )?;
        generation.set(0, self.mapping_writes, 0)?;
        Ok(())
    }

    /// The process has exited: its mapping list goes, and the tables no one else uses go idle.
    pub fn forget(&mut self, ebpf: &mut Ebpf, pid: u32) {
        if let Some(Ok(mut map)) = ebpf.map_mut("PROC_MAPPINGS").map(BpfHashMap::<_, u32, ProcMappings>::try_from) {
            let _ = map.remove(&pid);
        }
        if let Some(Ok(mut map)) = ebpf.map_mut(CODE_CHANGES).map(BpfHashMap::<_, u32, u64>::try_from) {
            let _ = map.remove(&pid);
        }
        self.deferred.forget(pid);
        self.preloaded.remove(&pid);
        self.linker_hooked.remove(&pid);
        let process = self.processes.remove(&pid).unwrap_or_default();
        for key in &process.files {
            self.release(key, process.uid);
        }
        self.drop_unused();
        self.log_use();
    }

    /// One more process of `uid` maps the file.
    fn acquire(&mut self, key: &FileKey, uid: u32) {
        let Some(file) = self.files.get_mut(key) else { return };
        self.idle.remove(key);
        // Loaded for another user after all (see `share`).
        self.refused.remove(key);
        let processes = file.users.entry(uid).or_default();
        if *processes == 0 {
            self.shares.take(uid, file.rows);
        }
        *processes += 1;
    }

    /// One process of `uid` maps the file no more: the user's share gives its rows back with
    /// their last such process; `drop_unused` keeps them idle after the last process of all.
    fn release(&mut self, key: &FileKey, uid: u32) {
        let Some(file) = self.files.get_mut(key) else { return };
        let Some(processes) = file.users.get_mut(&uid) else { return };
        *processes -= 1;
        if *processes == 0 {
            file.users.remove(&uid);
            self.shares.give(uid, file.rows);
        }
    }

    fn warn_once(&mut self, what: &str, message: &str) {
        if self.warned.insert(what.to_string()) {
            say!("memprof: {message}");
        }
    }
}

const CODE_CHANGES: &str = "CODE_CHANGES";
/// How long a table no traced process maps is kept for the next (`--keep-unwind-tables`).
pub const KEEP_IDLE: Duration = Duration::from_secs(60);
/// The longest it may be told: a day.
pub const MAX_KEEP_IDLE_SECONDS: u32 = 86_400;
/// The map update that fails on an existing key.
pub const BPF_NOEXIST: u64 = 1;
/// A count the kernel's never reaches: the list is not taken as whole.
const NOT_WHOLE: u64 = u64::MAX;
