//! Which unwind tables the kernel has: one per mapped file, shared by every process that maps
//! it, and each traced process's executable mappings pointing at them.
//!
//! Rows live in `UNWIND_ROWS`, an array the daemon maps into its own memory (`BPF_F_MMAPABLE`),
//! so a table of 100,000 rows is one copy rather than 100,000 syscalls. A file's rows stay while
//! some traced process maps it and are freed for reuse after.

use std::{
    collections::{HashMap, HashSet},
    os::fd::{AsFd as _, AsRawFd as _},
    ptr::NonNull,
};

use aya::{
    maps::{HashMap as BpfHashMap, Map, MapData},
    Ebpf,
};
use object::{Object as _, ObjectSegment as _};
use profiler_common::{mapping_kind, ExecMapping, ProcMappings, UnwindRow, MAX_MAPPINGS};

use super::{space::RowSpace, table};
use crate::process::procfs::{self, FileMapping};

/// How memprof walks stacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UnwindMode {
    /// DWARF CFI from each file's `.eh_frame`: right on code built without frame pointers.
    Cfi,
    /// Frame pointers only: cheaper, wrong where code omits them (most distribution code).
    Fp,
}

/// The array rows are written to: each row takes 16 bytes, as the kernel rounds an array's
/// element size up to 8.
const ROW_STRIDE: usize = 16;

/// A mapped file, named by device and inode: the same while any process maps it.
type FileKey = (String, u64);

struct FileTable {
    first_row: u32,
    rows: u32,
    kind: u32,
    /// Executable loadable segments: (file offset, file size, virtual address), to find a
    /// mapping's bias.
    segments: Vec<(u64, u64, u64)>,
    /// Traced processes that map the file.
    users: usize,
}

/// Unwind tables in the kernel and the processes that use them.
pub struct Registry {
    mode: UnwindMode,
    rows: NonNull<UnwindRow>,
    space: RowSpace,
    files: HashMap<FileKey, FileTable>,
    /// Files each traced process maps, to release them when it goes.
    processes: HashMap<u32, HashSet<FileKey>>,
    /// Files already warned about, so that each warning is said once.
    warned: HashSet<String>,
    /// Writes of `PROC_MAPPINGS` so far: the value of `MAPPINGS_GENERATION`.
    mapping_writes: u32,
}

// SAFETY: `rows` points into a shared mapping that lives as long as memprof and is written only
// through `&mut self`; nothing about it is tied to the thread that made it.
unsafe impl Send for Registry {}

/// How many rows the tables take, and of how many files: for metrics and the benchmark.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TableUse {
    pub files: usize,
    pub rows: u64,
    pub capacity: u64,
    /// Executable code the tables cover: the executable segments of the files with CFI tables.
    pub text_bytes: u64,
    /// What memprof itself keeps for the tables (rows live only in the kernel's array): its
    /// records of the files and of which process maps which, with their strings and vectors
    /// (not the hash tables' spare room).
    pub held_bytes: u64,
}

impl Registry {
    pub fn new(ebpf: &mut Ebpf, mode: UnwindMode) -> anyhow::Result<Self> {
        let Some(Map::Array(data)) = ebpf.map("UNWIND_ROWS") else {
            anyhow::bail!("map UNWIND_ROWS missing from the eBPF object");
        };
        let capacity = data.info()?.max_entries();
        let rows = map_rows(data, capacity as usize)?;
        Ok(Self {
            mode,
            rows,
            space: RowSpace::new(capacity),
            files: HashMap::new(),
            processes: HashMap::new(),
            warned: HashSet::new(),
            mapping_writes: 0,
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
            + self.processes.values().flatten().map(key_bytes).sum::<usize>();
        TableUse {
            files: self.files.len(),
            rows: self.space.used() as u64,
            capacity: self.space.capacity() as u64,
            text_bytes,
            held_bytes: held as u64,
        }
    }

    /// Reads `pid`'s executable mappings, builds the tables of files not seen yet, and gives the
    /// kernel the process's new mapping list. Cheap when nothing changed.
    pub fn sync(&mut self, ebpf: &mut Ebpf, pid: u32) -> anyhow::Result<()> {
        // An exited process not yet reaped has no mappings left: keep what it had.
        let Ok(mappings) = procfs::file_mappings(pid) else { return Ok(()) };
        let mut entries = Vec::new();
        let mut used = HashSet::new();
        for mapping in mappings.iter().filter(|m| m.executable) {
            let key = (mapping.device.clone(), mapping.inode);
            let Some(file) = self.file(&key, pid, mapping) else { continue };
            let Some(bias) = bias(&file.segments, mapping) else { continue };
            used.insert(key);
            entries.push(ExecMapping {
                start: mapping.start,
                end: mapping.end,
                bias,
                first_row: file.first_row,
                rows: file.rows,
                kind: file.kind,
                _pad: 0,
            });
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
        let mut list =
            ProcMappings { len: entries.len() as u32, _pad: 0, entries: [ExecMapping::default(); MAX_MAPPINGS] };
        list.entries[..entries.len()].copy_from_slice(&entries);
        let mut map: BpfHashMap<_, u32, ProcMappings> = BpfHashMap::try_from(
            ebpf.map_mut("PROC_MAPPINGS").ok_or_else(|| anyhow::anyhow!("map PROC_MAPPINGS missing"))?,
        )?;
        map.insert(pid, list, 0)?;
        // After the write: a walk that began before it may cache the new rows under the old
        // generation, which the bump then discards.
        self.mapping_writes = self.mapping_writes.wrapping_add(1);
        let mut generation: aya::maps::Array<_, u32> = aya::maps::Array::try_from(
            ebpf.map_mut("MAPPINGS_GENERATION").ok_or_else(|| anyhow::anyhow!("map MAPPINGS_GENERATION missing"))?,
        )?;
        generation.set(0, self.mapping_writes, 0)?;
        let old = self.processes.insert(pid, used.clone()).unwrap_or_default();
        for key in used.difference(&old) {
            if let Some(file) = self.files.get_mut(key) {
                file.users += 1;
            }
        }
        for key in old.difference(&used) {
            self.release(key);
        }
        self.drop_unused();
        if used != old {
            self.log_use();
        }
        Ok(())
    }

    /// One line whenever the tables in use change (`cargo xtask bench` reads it).
    fn log_use(&self) {
        let TableUse { files, rows, text_bytes, held_bytes, .. } = self.table_use();
        let kernel_bytes = rows * ROW_STRIDE as u64;
        tracing::debug!(files, rows, kernel_bytes, text_bytes, held_bytes, "unwind tables in use");
    }

    /// The process has exited: its mapping list goes, and the tables no one else uses.
    pub fn forget(&mut self, ebpf: &mut Ebpf, pid: u32) {
        if let Some(Ok(mut map)) = ebpf.map_mut("PROC_MAPPINGS").map(BpfHashMap::<_, u32, ProcMappings>::try_from) {
            let _ = map.remove(&pid);
        }
        for key in self.processes.remove(&pid).unwrap_or_default() {
            self.release(&key);
        }
        self.drop_unused();
        self.log_use();
    }

    fn release(&mut self, key: &FileKey) {
        if let Some(file) = self.files.get_mut(key) {
            file.users = file.users.saturating_sub(1);
        }
    }

    fn drop_unused(&mut self) {
        let space = &mut self.space;
        self.files.retain(|_, file| {
            if file.users == 0 && file.rows > 0 {
                space.free(file.first_row, file.rows);
            }
            file.users > 0
        });
    }

    /// The table of a mapped file, built and written to the kernel the first time it is seen.
    /// None when the file cannot be read or its table has no room (said once; its frames end
    /// stacks and are counted as `unwind_no_table`).
    fn file(&mut self, key: &FileKey, pid: u32, mapping: &FileMapping) -> Option<&FileTable> {
        if !self.files.contains_key(key) {
            let table = self.build(pid, mapping)?;
            self.files.insert(key.clone(), table);
        }
        self.files.get(key)
    }

    fn build(&mut self, pid: u32, mapping: &FileMapping) -> Option<FileTable> {
        let path = &mapping.path;
        let data = match mapping.reachable_paths(pid).iter().find_map(|p| std::fs::read(p).ok()) {
            Some(data) => data,
            None => {
                self.warn_once(path, &format!("cannot read {path}: its frames are not unwound"));
                return None;
            }
        };
        let segments = load_segments(&data)?;
        let built = match self.mode {
            UnwindMode::Fp => Ok(None),
            UnwindMode::Cfi => table::build(&data),
        };
        let rows = match built {
            Ok(Some(mut table)) => {
                if let Some(entry) = entry_point(&data) {
                    table.end_at_entry_point(entry);
                }
                table.rows
            }
            Ok(None) => {
                if self.mode == UnwindMode::Cfi {
                    self.warn_once(
                        path,
                        &format!("{path} has no .eh_frame: its frames are unwound with frame pointers"),
                    );
                }
                return Some(FileTable {
                    first_row: 0,
                    rows: 0,
                    kind: mapping_kind::FRAME_POINTERS,
                    segments,
                    users: 0,
                });
            }
            Err(err) => {
                self.warn_once(path, &format!("{path}: {err}: its frames are not unwound"));
                return None;
            }
        };
        let Some(first_row) = self.space.alloc(rows.len() as u32) else {
            let capacity = self.space.capacity();
            self.warn_once(
                "rows",
                &format!("the unwind tables are full ({capacity} rows): frames in {path} and later files are not unwound; raise --max-unwind-rows"),
            );
            return None;
        };
        for (i, row) in rows.iter().enumerate() {
            // SAFETY: alloc returned a range inside the mapped array; the kernel reads rows only
            // of mappings that point at them, and none points at this range until `sync`.
            unsafe {
                self.rows
                    .as_ptr()
                    .cast::<u8>()
                    .add((first_row as usize + i) * ROW_STRIDE)
                    .cast::<UnwindRow>()
                    .write(*row)
            };
        }
        tracing::debug!(path, rows = rows.len(), file_bytes = data.len(), "unwind table built");
        Some(FileTable { first_row, rows: rows.len() as u32, kind: mapping_kind::CFI, segments, users: 0 })
    }

    fn warn_once(&mut self, what: &str, message: &str) {
        if self.warned.insert(what.to_string()) {
            eprintln!("memprof: {message}");
        }
    }
}

/// Maps the rows array into memprof's memory. It stays mapped for memprof's lifetime, as the
/// map itself does.
fn map_rows(data: &MapData, capacity: usize) -> anyhow::Result<NonNull<UnwindRow>> {
    let length = (capacity * ROW_STRIDE).next_multiple_of(4096);
    // SAFETY: a shared mapping of a BPF array created with BPF_F_MMAPABLE; the length is the
    // array's size rounded up to a page, which the kernel allows.
    let address = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            length,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            data.fd().as_fd().as_raw_fd(),
            0,
        )
    };
    if address == libc::MAP_FAILED {
        anyhow::bail!("mapping UNWIND_ROWS into memory: {}", std::io::Error::last_os_error());
    }
    NonNull::new(address.cast()).ok_or_else(|| anyhow::anyhow!("mapping UNWIND_ROWS returned NULL"))
}

/// The ELF entry point, where it fits the rows' 32-bit addresses.
fn entry_point(data: &[u8]) -> Option<u32> {
    u32::try_from(object::File::parse(data).ok()?.entry()).ok().filter(|entry| *entry != 0)
}

/// The file's executable loadable segments, as (file offset, file size, virtual address).
fn load_segments(data: &[u8]) -> Option<Vec<(u64, u64, u64)>> {
    const PF_X: u32 = 1;
    let file = object::File::parse(data).ok()?;
    Some(
        file.segments()
            .filter(|s| matches!(s.flags(), object::SegmentFlags::Elf { p_flags } if p_flags & PF_X != 0))
            .map(|s| {
                let (offset, size) = s.file_range();
                (offset, size, s.address())
            })
            .collect(),
    )
}

/// What to subtract from an address in `mapping` to get the file's virtual address.
fn bias(segments: &[(u64, u64, u64)], mapping: &FileMapping) -> Option<u64> {
    // The kernel maps from the page below a segment's file offset: LLD, unlike GNU ld, leaves a
    // segment's offset and address apart within the page (offset 0x15660 at 0x16660).
    let (offset, _, address) =
        segments.iter().find(|(offset, size, _)| (offset & !0xfff..offset + size.max(&1)).contains(&mapping.offset))?;
    Some(mapping.start.wrapping_sub(address.wrapping_add(mapping.offset.wrapping_sub(*offset))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bias_maps_addresses_to_virtual_addresses() {
        // A PIE's text segment at file offset 0x1000, vaddr 0x1000, mapped at 0x5555_5555_5000.
        let segments = [(0, 0x1000, 0), (0x1000, 0x2000, 0x1000)];
        let mapping = FileMapping {
            start: 0x5555_5555_5000,
            end: 0x5555_5555_7000,
            offset: 0x1000,
            path: "/x".into(),
            executable: true,
            device: "fe:01".into(),
            inode: 1,
        };
        assert_eq!(bias(&segments, &mapping), Some(0x5555_5555_4000));
        // A non-PIE executable: vaddr 0x401000 at offset 0x1000, mapped where it says.
        let segments = [(0x1000, 0x2000, 0x40_1000)];
        let mapping = FileMapping { start: 0x40_1000, end: 0x40_3000, ..mapping };
        assert_eq!(bias(&segments, &mapping), Some(0));
        // LLD: text at file offset 0x15660, vaddr 0x16660; the kernel maps offset 0x15000.
        let segments = [(0x15660, 0x2000, 0x16660)];
        let mapping = FileMapping { start: 0x5555_5556_a000, offset: 0x15000, ..mapping };
        assert_eq!(bias(&segments, &mapping), Some(0x5555_5556_a000 - 0x16000));
    }
}
