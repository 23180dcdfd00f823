//! Resident memory against the heap: a process's anonymous resident memory (`RssAnon`), the bytes
//! its program has in use through the allocator, the difference (the allocator's overhead,
//! fragmentation and caches, and anonymous memory not from malloc: thread stacks, mmap), and the
//! resident pages its live blocks pin with few live bytes (`pinned`).

use std::{
    cell::Cell,
    collections::HashSet,
    time::{Duration, Instant},
};

use aya::Ebpf;
use serde::{Deserialize, Serialize};

use crate::{
    heap::pinned::{self, Pinned},
    kernel::{
        aggregate::Snapshot,
        live::{self, LiveBlock},
    },
    process::procfs,
};

/// One reading.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
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
    /// How old that reading is: it is read within a budget (`PinnedBudget`), not every interval.
    /// None before the first reading: the pinned figures' 0 then says nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pinned_age_s: Option<f64>,
    /// How old the rest is: 0 while the process runs. Once it has exited, the time since its last
    /// reading, whose `heap_inuse_bytes` is the heap then, not the report's final one.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub age_s: f64,
}

fn is_zero(seconds: &f64) -> bool {
    *seconds == 0.0
}

/// When `Resident::read_all` walks `LIVE` for the pages the blocks pin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PinnedWalk {
    /// When the budget allows: each interval.
    IfDue,
    /// Whatever the budget: a final report.
    Now,
    /// Not: a reading of a few processes between intervals, whose walk would take the
    /// interval's budget for them alone.
    Not,
}

/// When the pinned pages are read. Their walk of `LIVE` costs time per live block (docs:
/// guide/resident-memory.md#resident-memory-against-the-heap gives the measure), so it may take at most a
/// hundredth of the time: a walk is due once the time since the last one is 99 times what it
/// is expected to take, the last walk's time per block times the blocks live now. A few
/// thousand blocks are read every interval. Past `MOST_BLOCKS_WALKED` live blocks (all traced
/// processes together) only a final report walks them: the daemon, tracing a million blocks,
/// cost several times the CPU and memory with a twentieth than without the walk (docs:
/// performance.md#the-daemons-own-cost).
#[derive(Debug, Default)]
pub struct PinnedBudget {
    /// When the last walk ended, and what it took per block.
    last: Option<(Instant, f64)>,
}

impl PinnedBudget {
    fn due(&self, live_blocks: u64) -> bool {
        live_blocks <= MOST_BLOCKS_WALKED
            && self.last.is_none_or(|(ended, per_block)| {
                ended.elapsed().as_secs_f64() >= IDLE_PER_WALK * per_block * live_blocks as f64
            })
    }

    fn spent(&mut self, took: Duration, blocks: usize) {
        // A walk of few blocks is mostly the fixed cost of the map's empty buckets: counted as
        // one of `FEW_BLOCKS`, it does not make each block look dear.
        self.last = Some((Instant::now(), took.as_secs_f64() / blocks.max(FEW_BLOCKS) as f64));
    }
}

/// The time left between walks for each unit of time a walk takes.
const IDLE_PER_WALK: f64 = 99.0;

/// See `PinnedBudget`.
const MOST_BLOCKS_WALKED: u64 = 200_000;

/// See `PinnedBudget::spent`.
const FEW_BLOCKS: usize = 10_000;

/// The latest reading of one traced process. A `Cell`, as reports are built from a shared borrow.
#[derive(Debug, Default)]
pub struct Resident {
    /// The last reading, and when it was taken.
    last: Cell<Option<(Memory, Instant)>>,
    pinned: Pinned,
    /// When `pinned` was read: none before the first reading.
    pinned_at: Option<Instant>,
    /// Readings of `pinned` that differed from the one before.
    pinned_changes: u64,
}

/// What the kernel's counters say of a process's heap, for `Resident::read_all`.
#[derive(Debug, Clone, Copy)]
pub struct HeapNow {
    pub outstanding_bytes: u64,
    pub sampled: bool,
}

impl HeapNow {
    pub fn of(snapshot: Option<&Snapshot>) -> Self {
        Self {
            outstanding_bytes: snapshot.map_or(0, Snapshot::outstanding_bytes),
            sampled: snapshot.is_some_and(|s| s.sample_bytes > 0),
        }
    }
}

impl Resident {
    /// Reads the pages `blocks`, the process's live blocks now, pin; once the process has exited,
    /// the last reading taken while it ran stays.
    fn read_pinned(&mut self, pid: u32, blocks: &[LiveBlock]) {
        // No block pins anything: nothing to ask of /proc (most targets at rest hold none).
        let reading = if blocks.is_empty() { Some(Pinned::default()) } else { pinned::read(pid, blocks) };
        if let Some(pinned) = reading {
            if pinned != self.pinned {
                self.pinned_changes += 1;
            }
            self.pinned = pinned;
            self.pinned_at = Some(Instant::now());
        }
    }

    /// Reads the memory of each of `processes` (pid, its readings, its heap now), with
    /// `live_entries` blocks live in all: every interval, so that a report written once, after the process exited, has
    /// the last reading taken while it ran. The pinned pages take one walk of `LIVE` for all,
    /// as `walk` says, logged at debug level. A sampled process's blocks are a sample: its pages
    /// would look emptier than they are, so they are not read (0).
    pub fn read_all<'a>(
        ebpf: &Ebpf,
        live_entries: u64,
        processes: impl IntoIterator<Item = (u32, &'a mut Resident, HeapNow)>,
        budget: &mut PinnedBudget,
        walk: PinnedWalk,
    ) -> anyhow::Result<()> {
        let started = Instant::now();
        let mut processes: Vec<_> = processes.into_iter().collect();
        for (pid, resident, heap) in &mut processes {
            if heap.sampled {
                (resident.pinned, resident.pinned_at) = (Pinned::default(), None);
            }
            resident.current(*pid, heap.outstanding_bytes);
        }
        let due = match walk {
            PinnedWalk::Now => true,
            PinnedWalk::IfDue => budget.due(live_entries),
            PinnedWalk::Not => false,
        };
        if !due {
            return Ok(());
        }
        let pids: HashSet<u32> =
            processes.iter().filter(|(_, _, heap)| !heap.sampled).map(|(pid, _, _)| *pid).collect();
        let mut blocks = live::by_process(ebpf, &pids)?;
        let walked = started.elapsed();
        let count: usize = blocks.values().map(Vec::len).sum();
        for (pid, resident, _) in processes.into_iter().filter(|(pid, _, _)| pids.contains(pid)) {
            resident.read_pinned(pid, &blocks.remove(&pid).unwrap_or_default());
        }
        let took = started.elapsed();
        budget.spent(took, count);
        tracing::debug!(blocks = count, ?walked, ?took, "live blocks read and the pages they pin");
        Ok(())
    }

    /// The latest reading, taken by `current` (or `read_all`).
    pub fn last(&self) -> Option<Memory> {
        self.last.get().map(|(memory, _)| memory)
    }

    /// Readings of the pinned pages that differed from the one before, so far.
    pub fn pinned_changes(&self) -> u64 {
        self.pinned_changes
    }

    /// The latest reading of the pages the process's blocks pin.
    pub fn pinned(&self) -> &Pinned {
        &self.pinned
    }

    /// The process's memory now, given the bytes in use its report counts; once it has exited,
    /// the last reading taken while it ran, with its age (its final report's heap may have
    /// changed since).
    pub fn current(&self, pid: u32, heap_inuse_bytes: u64) -> Option<Memory> {
        if let Some(rss_anon_bytes) = procfs::anon_resident_bytes(pid) {
            let difference_bytes = rss_anon_bytes as i64 - heap_inuse_bytes as i64;
            let memory = Memory {
                rss_anon_bytes,
                heap_inuse_bytes,
                difference_bytes,
                pinned_pages: self.pinned.pages,
                pinned_bytes: self.pinned.bytes,
                // Milliseconds are enough, and keep the JSON short.
                pinned_age_s: self.pinned_at.map(seconds_since),
                age_s: 0.0,
            };
            self.last.set(Some((memory, Instant::now())));
            return Some(memory);
        }
        self.last.get().map(|(memory, at)| Memory { age_s: seconds_since(at), ..memory })
    }
}

/// Milliseconds are enough, and keep the JSON short.
fn seconds_since(at: Instant) -> f64 {
    at.elapsed().as_millis() as f64 / 1000.0
}
