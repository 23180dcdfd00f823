//! Resident memory against the heap: a process's anonymous resident memory (`RssAnon`), the bytes
//! its program has in use through the allocator, the difference (the allocator's overhead,
//! fragmentation and caches, and anonymous memory not from malloc: thread stacks, mmap), and the
//! resident pages its live blocks pin with few live bytes (`pinned`).

use std::{cell::Cell, collections::HashSet, time::Instant};

use aya::Ebpf;
use serde::{Deserialize, Serialize};

use crate::{
    heap::pinned::{self, Pinned},
    kernel::{
        aggregate::{KernelSnapshot, Snapshot},
        live::{self, LiveBlock},
    },
    process::procfs,
};

/// One reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Memory {
    pub rss_anon_bytes: u64,
    /// Bytes allocated and not freed since tracing began (the report's `outstanding_bytes`).
    pub heap_inuse_bytes: u64,
    /// `rss_anon_bytes - heap_inuse_bytes`: negative when allocated memory is not touched yet
    /// (or was allocated before attach and counts as resident only).
    pub difference_bytes: i64,
    /// Resident pages that hold live blocks but less than a quarter of their bytes live (see
    /// `heap::pinned`), and their bytes; 0 when not read (sampled mode).
    #[serde(default)]
    pub pinned_pages: u64,
    #[serde(default)]
    pub pinned_bytes: u64,
}

/// The latest reading of one traced process. A `Cell`, as reports are built from a shared borrow.
#[derive(Debug, Default)]
pub struct Resident {
    last: Cell<Option<Memory>>,
    pinned: Pinned,
}

impl Resident {
    /// Reads the pages `blocks`, the process's live blocks now, pin; once the process has exited,
    /// the last reading taken while it ran stays. A sampled process's blocks are a sample: its
    /// pages would look emptier than they are, so nothing is read (`sampled`).
    fn read_pinned(&mut self, pid: u32, blocks: &[LiveBlock], sampled: bool) {
        if sampled {
            self.pinned = Pinned::default();
        } else if let Some(pinned) = pinned::read(pid, blocks) {
            self.pinned = pinned;
        }
    }

    /// Reads the memory of each of `processes` (pid, its readings), whose kernel counters are
    /// in `kernel`: every interval, so that a report written once, after the process exited, has
    /// the last reading taken while it ran. The pinned pages take one walk of `LIVE` for all,
    /// whose cost grows with every traced process's live blocks (README: Resident memory),
    /// logged at debug level.
    pub fn read_all<'a>(
        ebpf: &Ebpf,
        kernel: &KernelSnapshot,
        processes: impl IntoIterator<Item = (u32, &'a mut Resident)>,
    ) -> anyhow::Result<()> {
        let started = Instant::now();
        let processes: Vec<_> = processes.into_iter().collect();
        let pids: HashSet<u32> = processes.iter().map(|(pid, _)| *pid).collect();
        let mut blocks = live::by_process(ebpf, &pids)?;
        let walked = started.elapsed();
        let count: usize = blocks.values().map(Vec::len).sum();
        for (pid, resident) in processes {
            let snapshot = kernel.processes.get(&pid);
            let sampled = snapshot.is_some_and(|s| s.sample_bytes > 0);
            resident.read_pinned(pid, &blocks.remove(&pid).unwrap_or_default(), sampled);
            resident.current(pid, snapshot.map_or(0, Snapshot::outstanding_bytes));
        }
        tracing::debug!(blocks = count, ?walked, total = ?started.elapsed(), "live blocks read and the pages they pin");
        Ok(())
    }

    /// The latest reading of the pages the process's blocks pin.
    pub fn pinned(&self) -> &Pinned {
        &self.pinned
    }

    /// The process's memory now, given the bytes in use its report counts; once it has exited,
    /// the last reading taken while it ran (its final report's heap may have changed since).
    pub fn current(&self, pid: u32, heap_inuse_bytes: u64) -> Option<Memory> {
        if let Some(rss_anon_bytes) = procfs::anon_resident_bytes(pid) {
            let difference_bytes = rss_anon_bytes as i64 - heap_inuse_bytes as i64;
            self.last.set(Some(Memory {
                rss_anon_bytes,
                heap_inuse_bytes,
                difference_bytes,
                pinned_pages: self.pinned.pages,
                pinned_bytes: self.pinned.bytes,
            }));
        }
        self.last.get()
    }
}
