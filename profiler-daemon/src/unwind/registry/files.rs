//! A mapped file's table: built the first time a traced process maps the file, refused past
//! the rows or a user's share, kept idle once no process maps it (see `idle`), and its rows given
//! back.

use std::{collections::HashMap, time::Instant};

use object::{Object as _, ObjectSection as _, ObjectSegment as _, ObjectSymbol as _};
use profiler_common::mapping_kind;

use super::{FileTable, Registry, UnwindMode};
use crate::process::{elf_bytes, file_cache::FileVersion, procfs::FileMapping};
use crate::unwind::{
    idle::{self, FileKey},
    table,
};

impl Registry {
    /// Tables no traced process maps go idle; those idle long enough, or that cannot tell their
    /// file changed, give their rows back.
    pub(super) fn drop_unused(&mut self) {
        let now = Instant::now();
        let (space, idle) = (&mut self.space, &mut self.idle);
        let before = self.files.len();
        self.files.retain(|key, file| {
            if !file.users.is_empty() {
                return true;
            }
            if file.version.is_some() {
                idle.went_idle(key, now);
                if !idle.expired(key, now) {
                    return true;
                }
            }
            idle.remove(key);
            if file.rows > 0 {
                space.free(file.first_row, file.rows);
            }
            false
        });
        if self.files.len() < before {
            self.shards.release_unused(&self.space);
        }
    }

    /// Gives back an idle table's rows now; the caller releases the shards left unused.
    fn drop_idle(&mut self, key: &FileKey) {
        self.idle.remove(key);
        if let Some(file) = self.files.remove(key) {
            self.space.free(file.first_row, file.rows);
        }
    }

    /// Claims `key`'s idle table for `pid` (see `IdleTables::claim`) if it was built from the
    /// file `pid` maps now: a file written in place since, or a new one given the inode, is not
    /// the one it was built from, and its table goes.
    pub(super) fn claim_idle(&mut self, key: &FileKey, pid: u32, mapping: &FileMapping) {
        if !self.idle.contains(key) {
            return;
        }
        let Some(table) = self.files.get(key) else { return };
        if table.version.is_some() && mapping.open(pid).and_then(|file| version_of(&file)) == table.version {
            self.idle.claim(key);
        } else {
            self.drop_idle(key);
            self.shards.release_unused(&self.space);
        }
    }

    /// The idle tables whose rows must go, the longest idle first, for a free range of `rows`
    /// rows; None when all of them would not make one.
    fn room_for(&self, rows: u32) -> Option<Vec<FileKey>> {
        if self.space.fits(rows) {
            return Some(Vec::new());
        }
        // A table of no rows (frame pointers) makes no room.
        let (oldest, ranges): (Vec<FileKey>, Vec<(u32, u32)>) = self
            .idle
            .oldest_first()
            .into_iter()
            .filter_map(|key| {
                let range =
                    self.files.get(&key).filter(|file| file.rows > 0).map(|file| (file.first_row, file.rows))?;
                Some((key, range))
            })
            .unzip();
        let count = idle::evictions_needed(&self.space, &ranges, rows)?;
        Some(oldest[..count].to_vec())
    }

    /// A free range of `rows` rows, taken from idle tables when no range is free.
    fn alloc_rows(&mut self, rows: u32) -> Option<u32> {
        let evicted = self.room_for(rows)?;
        for key in &evicted {
            self.drop_idle(key);
        }
        let first_row = self.space.alloc(rows);
        if !evicted.is_empty() {
            self.shards.release_unused(&self.space);
        }
        first_row
    }

    /// The table of a mapped file, built and written to the kernel the first time a process of
    /// `uid` maps it. None when it cannot be loaded (said once, counted in `not_loaded`; its frames
    /// end stacks and are counted as `unwind_no_table`).
    pub(super) fn file(&mut self, key: &FileKey, pid: u32, uid: u32, mapping: &FileMapping) -> Option<&FileTable> {
        self.claim_idle(key, pid, mapping);
        // A table kept for no one costs this user its rows, as a new one would: it is refused
        // past the user's share, as a new one would be, and stays idle for others.
        let kept = self.files.get(key).filter(|file| file.users.is_empty() && file.rows > 0).map(|file| file.rows);
        if let Some(rows) = kept {
            if !self.share_allows(uid, rows, &mapping.path, pid) {
                self.idle.unclaim(key);
                self.count_refused(key, rows);
                return None;
            }
        }
        if !self.files.contains_key(key) {
            // Building a large table takes a while: not again before it can fit.
            let fits = |rows| self.room_for(rows).is_some() && self.shares.fits(uid, rows);
            if self.refused.get(key).is_some_and(|&rows| rows > 0 && !fits(rows)) {
                return None;
            }
            match self.build(pid, uid, mapping) {
                Ok(table) => {
                    self.refused.remove(key);
                    self.built += 1;
                    self.files.insert(key.clone(), table);
                }
                Err(rows) => {
                    self.count_refused(key, rows);
                    return None;
                }
            }
        }
        self.files.get(key)
    }

    /// The file's table could not be loaded: counted once in `not_loaded`, until it is.
    fn count_refused(&mut self, key: &FileKey, rows: u32) {
        if self.refused.insert(key.clone(), rows).is_none() {
            self.not_loaded.tables += 1;
            self.not_loaded.rows += u64::from(rows);
        }
    }

    /// Whether a table of `rows` rows, new to `uid`'s processes, stays within the user's share;
    /// said once when not.
    fn share_allows(&mut self, uid: u32, rows: u32, path: &str, pid: u32) -> bool {
        if self.shares.fits(uid, rows) {
            return true;
        }
        let (held, limit) = (self.shares.held(uid), self.shares.limit().unwrap_or(u32::MAX));
        self.warn_once(
            &format!("share of user {uid}"),
            &format!("user {uid}'s traced processes hold {held} unwind rows of the {limit} one user may take: frames in {path} ({rows} rows, pid {pid}) and their later files past that are not unwound, other users' are; raise --max-unwind-rows-per-user"),
        );
        false
    }

    /// The file's table, in the kernel; else the rows it needed (0: not known), having said why.
    fn build(&mut self, pid: u32, uid: u32, mapping: &FileMapping) -> Result<FileTable, u32> {
        let path = &mapping.path;
        let opened = mapping.open(pid);
        let version = opened.as_ref().and_then(version_of);
        let data = match opened.map(|file| elf_bytes::read(&file)) {
            Some(Ok(data)) => data,
            Some(Err(err)) => {
                self.warn_once(path, &format!("cannot read {path} ({err}): its frames are not unwound"));
                return Err(0);
            }
            None => {
                self.warn_once(path, &format!("cannot read {path}: its frames are not unwound"));
                return Err(0);
            }
        };
        let Some(segments) = load_segments(&data) else {
            self.warn_once(path, &format!("{path} is not an ELF file: its frames are not unwound"));
            return Err(0);
        };
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
                // A data-only library (ICU's data, say) has only the toolchain's start-up stubs
                // for code: no allocation stack passes through it, nothing to say.
                if self.mode == UnwindMode::Cfi && !is_data_only_library(&data) {
                    self.warn_once(
                        path,
                        &format!("{path} has no .eh_frame: its frames are unwound with frame pointers"),
                    );
                }
                return Ok(FileTable {
                    first_row: 0,
                    rows: 0,
                    kind: mapping_kind::FRAME_POINTERS,
                    segments,
                    users: HashMap::new(),
                    version,
                });
            }
            Err(err) => {
                self.warn_once(path, &format!("{path}: {err}: its frames are not unwound"));
                return Err(0);
            }
        };
        let count = u32::try_from(rows.len()).unwrap_or(u32::MAX);
        if !self.share_allows(uid, count, path, pid) {
            return Err(count);
        }
        let Some(first_row) = self.alloc_rows(count) else {
            let (capacity, free) = (self.space.capacity(), self.space.capacity() - self.space.used());
            self.warn_once(
                "rows",
                &format!("the unwind tables are full ({capacity} rows, {free} free): frames in {path} ({count} rows) and later files that do not fit are not unwound; raise --max-unwind-rows"),
            );
            return Err(count);
        };
        if let Err(err) = self.shards.ensure(first_row, count) {
            self.space.free(first_row, count);
            self.shards.release_unused(&self.space);
            self.warn_once("shards", &format!("{err}: frames in {path} are not unwound"));
            return Err(count);
        }
        self.shards.write(first_row, &rows);
        tracing::debug!(path, rows = rows.len(), file_bytes = data.len(), "unwind table built");
        Ok(FileTable { first_row, rows: count, kind: mapping_kind::CFI, segments, users: HashMap::new(), version })
    }
}

fn version_of(file: &std::fs::File) -> Option<FileVersion> {
    file.metadata().ok().map(|meta| FileVersion::of(&meta))
}

/// The ELF entry point, where it fits the rows' 32-bit addresses.
fn entry_point(data: &[u8]) -> Option<u32> {
    u32::try_from(object::File::parse(data).ok()?.entry()).ok().filter(|entry| *entry != 0)
}

/// Whether the file is a shared library that defines no function for others to call: its only
/// code is the toolchain's (`_init`, `_fini` and the like). An executable (it has an interpreter)
/// never is one: its code starts at its entry point.
fn is_data_only_library(data: &[u8]) -> bool {
    let Ok(file) = object::File::parse(data) else { return false };
    let has_interpreter = file.sections().any(|section| section.name() == Ok(".interp"));
    !has_interpreter
        && file.kind() == object::ObjectKind::Dynamic
        && !file.dynamic_symbols().any(|symbol| symbol.is_definition() && symbol.kind() == object::SymbolKind::Text)
}

/// The file's executable loadable segments, as (file offset, file size, virtual address).
pub(crate) fn load_segments(data: &[u8]) -> Option<Vec<(u64, u64, u64)>> {
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
pub(super) fn bias(segments: &[(u64, u64, u64)], mapping: &FileMapping) -> Option<u64> {
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
