//! The kernel's unwind rows, in shards of `UNWIND_SHARD_ROWS` rows that are created when a table
//! needs them and released when no table uses them: an idle memprof holds no rows, and a process
//! that maps 100 MB of code gets the rows it needs, up to `--max-unwind-rows`.
//!
//! Each shard is a `BPF_F_MMAPABLE` array mapped into memprof's memory, so a table of 100,000
//! rows is one copy rather than 100,000 syscalls, and published in `UNWIND_SHARDS`, the array of
//! maps the stack walk reads. memprof keeps each shard's descriptor open (at most one per MiB of
//! rows), so that its kernel memory shows in memprof's `/proc/PID/fdinfo` like every other map's.

use std::{
    os::fd::{AsFd as _, AsRawFd as _, BorrowedFd, OwnedFd},
    ptr::NonNull,
};

use aya::maps::{ArrayOfMaps, Map, MapData};
use profiler_common::{UnwindRow, UNWIND_SHARD_BITS, UNWIND_SHARD_ROWS};

use super::{shard_map, space::RowSpace};

/// Bytes a row takes in a shard: the kernel rounds an array's element size up to 8.
pub const ROW_STRIDE: usize = 16;
/// Kernel memory of one shard.
pub const SHARD_BYTES: u64 = UNWIND_SHARD_ROWS as u64 * ROW_STRIDE as u64;

#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    #[error("the kernel refused a new shard of unwind rows: {0}")]
    Create(std::io::Error),
    #[error("mapping a shard of unwind rows into memory: {0}")]
    Map(std::io::Error),
    #[error("publishing a shard of unwind rows: {0}")]
    Publish(std::io::Error),
}

/// The shards that exist, by index in `UNWIND_SHARDS`.
pub struct Shards {
    /// `UNWIND_SHARDS`, an array of maps.
    outer: Map,
    /// The shards' BTF (see `shard_map`).
    btf: OwnedFd,
    /// None where no shard is.
    shards: Vec<Option<Shard>>,
}

struct Shard {
    /// Kept for its descriptor: see the module's comment.
    _map: OwnedFd,
    /// The shard's rows in memprof's memory, `SHARD_BYTES` long.
    rows: NonNull<u8>,
}

// SAFETY: the mappings live until `release_unused` unmaps them and are written only through
// `&mut self`; nothing about them is tied to the thread that made them.
unsafe impl Send for Shards {}

impl Shards {
    /// Takes `UNWIND_SHARDS` (created empty with the programs).
    pub fn new(mut outer: Map) -> anyhow::Result<Self> {
        let shards = ArrayOfMaps::<&mut MapData, MapData>::try_from(&mut outer)?.len();
        let btf = shard_map::load_btf().map_err(|err| anyhow::anyhow!("loading the unwind shards' BTF: {err}"))?;
        Ok(Self { outer, btf, shards: (0..shards).map(|_| None).collect() })
    }

    /// Rows the shards could hold: `UNWIND_SHARDS`'s length times a shard's rows.
    pub fn max_rows(&self) -> u64 {
        self.shards.len() as u64 * u64::from(UNWIND_SHARD_ROWS)
    }

    /// Shards that exist.
    pub fn count(&self) -> usize {
        self.shards.iter().flatten().count()
    }

    /// Creates the shards that rows `first..first + rows` fall in and that do not exist yet.
    pub fn ensure(&mut self, first: u32, rows: u32) -> Result<(), ShardError> {
        for shard in shard_range(first, rows) {
            if self.shards[shard].is_none() {
                self.shards[shard] = Some(self.create(shard)?);
            }
        }
        Ok(())
    }

    fn create(&mut self, shard: usize) -> Result<Shard, ShardError> {
        let map = shard_map::create(self.btf.as_fd(), UNWIND_SHARD_ROWS).map_err(ShardError::Create)?;
        // SAFETY: a shared mapping of a BPF array created with BPF_F_MMAPABLE, exactly its size
        // (a whole number of pages).
        let address = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                SHARD_BYTES as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                map.as_raw_fd(),
                0,
            )
        };
        if address == libc::MAP_FAILED {
            return Err(ShardError::Map(std::io::Error::last_os_error()));
        }
        let address =
            NonNull::new(address.cast::<u8>()).ok_or_else(|| ShardError::Map(std::io::Error::other("NULL")))?;
        if let Err(err) = shard_map::set(outer_fd(&self.outer), shard as u32, Some(map.as_fd())) {
            // SAFETY: the mapping made above, used by nothing else.
            unsafe { libc::munmap(address.as_ptr().cast(), SHARD_BYTES as usize) };
            return Err(ShardError::Publish(err));
        }
        Ok(Shard { _map: map, rows: address })
    }

    /// Writes rows from `first` on, into shards `ensure` created.
    pub fn write(&mut self, first: u32, rows: &[UnwindRow]) {
        for (i, row) in rows.iter().enumerate() {
            let index = first as usize + i;
            let Some(Some(shard)) = self.shards.get(index >> UNWIND_SHARD_BITS) else {
                unreachable!("row {index} written before its shard was created");
            };
            let offset = (index & (UNWIND_SHARD_ROWS as usize - 1)) * ROW_STRIDE;
            // SAFETY: inside the shard's mapping; the kernel reads rows only of mappings that
            // point at them, and none points at these until the registry's next `sync`.
            unsafe { shard.rows.as_ptr().add(offset).cast::<UnwindRow>().write(*row) };
        }
    }

    /// Releases the shards in which `space` has no row in use: the kernel frees each once the
    /// walks running now are done with it.
    pub fn release_unused(&mut self, space: &RowSpace) {
        let outer = outer_fd(&self.outer);
        for (index, slot) in self.shards.iter_mut().enumerate() {
            let Some(shard) = slot else { continue };
            let first = (index as u64) << UNWIND_SHARD_BITS;
            if !space.is_free(first, u64::from(UNWIND_SHARD_ROWS)) {
                continue;
            }
            if let Err(err) = shard_map::set(outer, index as u32, None) {
                // Kept, and reused by the next table that lands in it.
                tracing::warn!(shard = index, %err, "releasing a shard of unwind rows");
                continue;
            }
            // SAFETY: the shard's own mapping; nothing reads it once it is out of the outer array.
            unsafe { libc::munmap(shard.rows.as_ptr().cast(), SHARD_BYTES as usize) };
            *slot = None;
        }
    }
}

/// The shards rows `first..first + rows` fall in.
fn shard_range(first: u32, rows: u32) -> std::ops::Range<usize> {
    if rows == 0 {
        return 0..0;
    }
    let last = u64::from(first) + u64::from(rows) - 1;
    (first >> UNWIND_SHARD_BITS) as usize..(last >> UNWIND_SHARD_BITS) as usize + 1
}

/// The descriptor of `UNWIND_SHARDS`.
fn outer_fd(outer: &Map) -> BorrowedFd<'_> {
    let Map::ArrayOfMaps(outer) = outer else { unreachable!("`new` took an array of maps") };
    outer.fd().as_fd()
}

impl super::deferred::Rows for Shards {
    fn row(&self, index: u32) -> Option<UnwindRow> {
        let shard = self.shards.get((index >> UNWIND_SHARD_BITS) as usize)?.as_ref()?;
        let offset = (index & (UNWIND_SHARD_ROWS - 1)) as usize * ROW_STRIDE;
        // SAFETY: inside the shard's mapping, which lives as long as `self`.
        Some(unsafe { shard.rows.as_ptr().add(offset).cast::<UnwindRow>().read() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_fall_in_the_shards_they_span() {
        let shard = UNWIND_SHARD_ROWS;
        assert_eq!(shard_range(0, 0), 0..0);
        assert_eq!(shard_range(0, 1), 0..1);
        assert_eq!(shard_range(shard - 1, 1), 0..1);
        assert_eq!(shard_range(shard - 1, 2), 0..2);
        assert_eq!(shard_range(shard, shard), 1..2);
        assert_eq!(shard_range(10, 3 * shard), 0..4);
        assert_eq!(shard_range(u32::MAX, 1), (u32::MAX >> UNWIND_SHARD_BITS) as usize..1 << 16);
    }
}
