//! `/proc/PID/pagemap`: 8 bytes per page of a process saying whether the page is in memory,
//! swapped out, and written since its soft-dirty bits were cleared
//! (Documentation/admin-guide/mm/pagemap.rst).

use std::{fs, io, os::unix::fs::FileExt as _};

/// The kernel's page: what an entry describes, and what a read fails or succeeds for at once.
pub const PAGE: u64 = 4096;

pub const SOFT_DIRTY: u64 = 1 << 55;
const SWAPPED: u64 = 1 << 62;
const PRESENT: u64 = 1 << 63;

pub struct Pagemap(fs::File);

impl Pagemap {
    pub fn open(pid: u32) -> io::Result<Self> {
        fs::File::open(format!("/proc/{pid}/pagemap")).map(Self)
    }

    /// The entries of the pages from `start` to `end`. Entries that cannot be read (the mapping
    /// went away meanwhile) read as in memory and written.
    pub fn entries(&self, start: u64, end: u64) -> io::Result<Vec<u64>> {
        let pages = (end - start).div_ceil(PAGE) as usize;
        let mut bytes = vec![0u8; pages * 8];
        let mut done = 0;
        while done < bytes.len() {
            match self.0.read_at(&mut bytes[done..], start / PAGE * 8 + done as u64)? {
                0 => break,
                n => done += n,
            }
        }
        bytes[done..].fill(0xff);
        Ok(bytes.chunks_exact(8).map(|e| u64::from_ne_bytes(e.try_into().expect("8 bytes"))).collect())
    }
}

/// Whether a page holds anything but zeros, or the file's own bytes: in memory or swapped out.
/// A page of a private mapping that is neither was never written by the process (or given back),
/// so it holds no pointer of its.
pub fn holds_data(entry: u64) -> bool {
    entry & (PRESENT | SWAPPED) != 0
}

/// The runs of pages (offset from `start`, length) whose entry satisfies `wanted`, the last cut
/// at `end`.
pub fn runs(entries: &[u64], start: u64, end: u64, wanted: impl Fn(usize, u64) -> bool) -> Vec<(usize, usize)> {
    let len = (end - start) as usize;
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for (page, &entry) in entries.iter().enumerate() {
        if !wanted(page, entry) {
            continue;
        }
        let offset = page * PAGE as usize;
        let size = (PAGE as usize).min(len - offset);
        match runs.last_mut() {
            Some((at, run)) if *at + *run == offset => *run += size,
            _ => runs.push((offset, size)),
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_join_neighbouring_pages_and_the_last_is_cut_at_the_end() {
        let entries = [PRESENT, PRESENT, 0, SWAPPED, PRESENT];
        let runs = runs(&entries, 0, 4 * PAGE + 16, |_, e| holds_data(e));
        assert_eq!(runs, [(0, 2 * PAGE as usize), (3 * PAGE as usize, PAGE as usize + 16)]);
    }
}
