//! `/proc/PID/pagemap`: 8 bytes per page of a process saying whether the page is in memory,
//! swapped out, and written since its soft-dirty bits were cleared
//! (Documentation/admin-guide/mm/pagemap.rst).

use std::{fs, io, os::unix::fs::FileExt as _};

use super::procfs;

/// The kernel's page: what an entry describes, and what a read fails or succeeds for at once.
pub const PAGE: u64 = 4096;

pub const SOFT_DIRTY: u64 = 1 << 55;
const SWAPPED: u64 = 1 << 62;
const PRESENT: u64 = 1 << 63;

pub struct Pagemap(fs::File);

impl Pagemap {
    pub fn open(pid: u32) -> io::Result<Self> {
        fs::File::open(format!("{}/pagemap", procfs::dir(pid))).map(Self)
    }

    pub fn file(&self) -> &fs::File {
        &self.0
    }

    /// The entries of the `count` pages from page number `first`: all of them, or an error (the
    /// process has exited).
    fn exact(&self, first: u64, count: u64) -> io::Result<Vec<u64>> {
        let mut bytes = vec![0u8; count as usize * 8];
        self.0.read_exact_at(&mut bytes, first * 8)?;
        Ok(decode(&bytes))
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
        Ok(decode(&bytes))
    }
}

fn decode(bytes: &[u8]) -> Vec<u64> {
    bytes.chunks_exact(8).map(|e| u64::from_ne_bytes(e.try_into().expect("8 bytes"))).collect()
}

/// Entries read at once by `present_pages`, at most (8 bytes each).
const PRESENT_SPAN: u64 = 4096;

/// Which of `pages` (page numbers, ascending) of process `pid` are in memory (resident, not
/// swapped out); none once the process has exited. Pages near each other are read in one go.
pub fn present_pages(pid: u32, pages: &[u64]) -> Option<Vec<bool>> {
    if pages.is_empty() {
        return Some(Vec::new());
    }
    let pagemap = Pagemap::open(pid).ok()?;
    let mut present = Vec::with_capacity(pages.len());
    let mut rest = pages;
    while let Some(&first) = rest.first() {
        let together = rest.partition_point(|&page| page - first < PRESENT_SPAN);
        let entries = pagemap.exact(first, rest[together - 1] - first + 1).ok()?;
        present.extend(rest[..together].iter().map(|&page| entries[(page - first) as usize] & PRESENT != 0));
        rest = &rest[together..];
    }
    Some(present)
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

/// Entries read at once by `runs_where`: a mapping reserved ahead can be terabytes (ASan's
/// shadow memory), whose entries, 8 bytes a page, would not fit in memory whole.
const ENTRIES_AT_ONCE: u64 = 1 << 16;

impl Pagemap {
    /// For each of `wanted`, the runs of pages (offset from `start`, length) from `start` to
    /// `end` whose entry it accepts (called with the page's number from `start` and its entry);
    /// the last run cut at `end`. Read a bounded number of entries at a time.
    pub fn runs_where<const N: usize>(
        &self,
        start: u64,
        end: u64,
        wanted: [&dyn Fn(usize, u64) -> bool; N],
    ) -> io::Result<[Vec<(usize, usize)>; N]> {
        let mut all: [Vec<(usize, usize)>; N] = std::array::from_fn(|_| Vec::new());
        let mut at = start;
        while at < end {
            let to = end.min(at.saturating_add(ENTRIES_AT_ONCE * PAGE));
            let entries = self.entries(at, to)?;
            let (first_page, base) = (((at - start) / PAGE) as usize, (at - start) as usize);
            for (runs, wanted) in all.iter_mut().zip(wanted) {
                for (offset, len) in self::runs(&entries, at, to, |page, entry| wanted(first_page + page, entry)) {
                    match runs.last_mut() {
                        Some((last, last_len)) if *last + *last_len == base + offset => *last_len += len,
                        _ => runs.push((base + offset, len)),
                    }
                }
            }
            at = to;
        }
        Ok(all)
    }
}

/// The runs (offset, length) in both `a` and `b`, each sorted and apart.
pub fn overlap(a: &[(usize, usize)], b: &[(usize, usize)]) -> Vec<(usize, usize)> {
    let (mut i, mut j, mut both) = (0, 0, Vec::new());
    while let (Some(&(a_at, a_len)), Some(&(b_at, b_len))) = (a.get(i), b.get(j)) {
        let (start, end) = (a_at.max(b_at), (a_at + a_len).min(b_at + b_len));
        if start < end {
            both.push((start, end - start));
        }
        if a_at + a_len < b_at + b_len {
            i += 1;
        } else {
            j += 1;
        }
    }
    both
}

/// The runs (offset, length) in `a` or `b`, each sorted and apart; neighbours are joined.
pub fn union(a: &[(usize, usize)], b: &[(usize, usize)]) -> Vec<(usize, usize)> {
    let mut all: Vec<(usize, usize)> = a.iter().chain(b).copied().collect();
    all.sort_unstable();
    let mut joined: Vec<(usize, usize)> = Vec::with_capacity(all.len());
    for (at, len) in all {
        match joined.last_mut() {
            Some((last, last_len)) if at <= *last + *last_len => *last_len = (*last_len).max(at + len - *last),
            _ => joined.push((at, len)),
        }
    }
    joined
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_keeps_what_both_hold() {
        assert_eq!(overlap(&[(0, 10), (20, 10)], &[(5, 20)]), [(5, 5), (20, 5)]);
        assert_eq!(overlap(&[(0, 10)], &[(10, 5)]), []);
        assert_eq!(overlap(&[], &[(0, 5)]), []);
    }

    #[test]
    fn runs_read_a_bounded_number_of_entries_at_a_time_are_whole() {
        // Our own memory: a buffer of ENTRIES_AT_ONCE + 3 pages, every page written.
        let len = ((ENTRIES_AT_ONCE + 3) * PAGE) as usize;
        let buffer = vec![1u8; len + PAGE as usize];
        let start = (buffer.as_ptr() as u64).next_multiple_of(PAGE);
        let pagemap = Pagemap::open(std::process::id()).unwrap();
        let [all, odd] = pagemap
            .runs_where(start, start + len as u64, [&|_, entry| holds_data(entry), &|page, _| page % 2 == 1])
            .unwrap();
        assert_eq!(all, [(0, len)]);
        assert_eq!(odd.len(), (ENTRIES_AT_ONCE as usize + 3) / 2);
        assert_eq!(odd[0], (PAGE as usize, PAGE as usize));
        assert_eq!(*odd.last().unwrap(), (len - 2 * PAGE as usize, PAGE as usize));
        drop(buffer);
    }

    #[test]
    fn union_joins_what_either_holds() {
        assert_eq!(union(&[(0, 10), (30, 5)], &[(5, 10), (15, 5), (40, 1)]), [(0, 20), (30, 5), (40, 1)]);
        assert_eq!(union(&[], &[]), []);
    }

    #[test]
    fn runs_join_neighbouring_pages_and_the_last_is_cut_at_the_end() {
        let entries = [PRESENT, PRESENT, 0, SWAPPED, PRESENT];
        let runs = runs(&entries, 0, 4 * PAGE + 16, |_, e| holds_data(e));
        assert_eq!(runs, [(0, 2 * PAGE as usize), (3 * PAGE as usize, PAGE as usize + 16)]);
    }
}
