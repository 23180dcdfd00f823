//! What memprof knows it does not see in a process: allocators found but not probed (from
//! `process::allocator`), and anonymous memory that grows while no probed call is made, the sign
//! of an allocator memprof does not know at all (whose mappings then show where it asked for it).
//! Traced by its pages (`--growth`), a process's blind spot is the memory it held before: blocks
//! placed there later touch no new page.

use std::{cell::Cell, collections::HashSet};

use crate::{
    heap::report::Report,
    process::{
        allocator::{self, Allocator, BlindSpot},
        procfs,
    },
};

/// Growth of anonymous resident memory, with no allocation seen, that is reported: a process's
/// stacks, TLS and libraries' data grow by less than this as it starts.
const UNSEEN_GROWTH_BYTES: u64 = 16 << 20;

/// Anonymous resident memory held before a process was traced by its pages that is reported: a
/// small program holds a few hundred KiB; an allocator's arena in a transparent huge page, 2 MiB.
const HELD_BEFORE_PAGES_BYTES: u64 = 1 << 20;

/// One traced process's blind spots.
#[derive(Debug, Clone)]
pub struct BlindSpots {
    unprobed: Vec<BlindSpot>,
    /// The least anonymous resident memory seen since its allocator was probed: growth is
    /// measured from it. The least, not the first: a command `memprof run` starts is a copy of
    /// memprof until it execs. `Cell`s, as reports are built from a shared borrow.
    anon_floor: Cell<u64>,
    /// The same since memprof traced its pages, when that began while it ran (not at its exec):
    /// the most that is left of what it held before (see `held_before_pages`). None otherwise.
    held_before: Cell<Option<u64>>,
    /// The most it grew above the floor while it could be read: the final report of a process
    /// that has exited still says so.
    grown: Cell<u64>,
    /// The files with code mapped that were looked into for allocators memprof does not probe.
    scanned: HashSet<String>,
}

impl BlindSpots {
    /// For a process that runs already; `pages`: traced by its pages (`--growth`).
    pub fn new(pid: u32, allocator: &Allocator, pages: bool) -> Self {
        let spots = Self::after_exec(pid, allocator);
        if pages {
            spots.pages_from_now(pid);
        }
        spots
    }

    /// For a process that has just exec'd (or is about to: `memprof run`'s command): it held
    /// nothing before.
    pub fn after_exec(pid: u32, allocator: &Allocator) -> Self {
        let anon = procfs::anon_resident_bytes(pid).unwrap_or(u64::MAX);
        let mut spots = Self {
            unprobed: Vec::new(),
            anon_floor: Cell::new(anon),
            held_before: Cell::new(None),
            grown: Cell::new(0),
            scanned: allocator.looked_into.clone(),
        };
        spots.add(pid, allocator.unprobed.clone());
        spots
    }

    /// `pid`'s pages could be traced from now on (it is attached, or the daemon moved it to
    /// growth mode): what it holds now is what that cannot see.
    pub fn pages_from_now(&self, pid: u32) {
        self.held_before.set(Some(procfs::anon_resident_bytes(pid).unwrap_or(0)));
    }

    /// Looks into the files `pid` mapped since: a runtime loaded later is a blind spot from then
    /// on. Returns the blind spots it adds.
    pub fn learn_new_files(&mut self, pid: u32) -> Vec<BlindSpot> {
        let found = allocator::unprobed_in_new_files(pid, &mut self.scanned);
        self.add(pid, found)
    }

    fn add(&mut self, pid: u32, found: Vec<BlindSpot>) -> Vec<BlindSpot> {
        let mut added = Vec::new();
        for spot in found {
            let routed = spot.unless_env.is_some_and(|entry| procfs::has_env(pid, entry));
            // Once per allocator: a file may be seen under two names (python3 and python3.11).
            let known = self.unprobed.iter().any(|s| (s.kind, s.heap) == (spot.kind, spot.heap));
            if !routed && !known {
                self.unprobed.push(spot.clone());
                added.push(spot);
            }
        }
        added
    }

    /// The process's blind spots now, given `report`: its memory (its latest reading), how many
    /// allocations memprof has seen in it and the bytes it holds from mappings made outside its
    /// allocator (`heap::mappings`), which name where memory unseen by the heap was asked for.
    /// Growth mode sees every page a heap first touches, a runtime's too: its one blind spot is
    /// the memory held before (`held_before_pages`).
    pub fn current(&self, report: &Report) -> Vec<BlindSpot> {
        if let Some(anon) = report.memory.map(|m| m.rss_anon_bytes) {
            self.held_before.set(self.held_before.get().map(|held| held.min(anon)));
            self.anon_floor.set(self.anon_floor.get().min(anon));
            self.grown.set(self.grown.get().max(anon - self.anon_floor.get()));
        }
        if report.growth.is_some() {
            return self.held_before_pages().into_iter().collect();
        }
        let (allocations_seen, mapped_bytes) = (report.totals.allocations, report.mappings.outstanding_bytes);
        let mut spots = self.unprobed.clone();
        let grown = self.grown.get();
        if allocations_seen == 0 && grown >= UNSEEN_GROWTH_BYTES {
            spots.push(BlindSpot {
                kind: "unseen_growth",
                what: format!(
                    "its anonymous memory grew by {} MiB while memprof saw no allocation: it allocates through code memprof does not probe",
                    grown >> 20
                ),
                advice: if mapped_bytes > 0 {
                    format!("its mappings ({} MiB) name where it asked for memory; docs: guide/mappings.md#memory-outside-malloc-mappings", mapped_bytes >> 20)
                } else {
                    "trace with --mappings to see where it maps memory, or see which allocator it uses (a static one, a language runtime) in its maps and symbols; docs: guide/allocators.md#blind-spots".to_string()
                },
                heap: None,
                bytes: Some(grown),
                unless_env: None,
            });
        }
        spots
    }

    /// The anonymous memory a process traced by its pages held before: the least it has held
    /// since, an upper bound on what is left of it. An allocator places blocks in it without a
    /// new page, and with transparent huge pages always on, an arena's first byte makes 2 MiB
    /// resident. None for a process not traced by its pages, or traced so from its exec.
    pub fn held_before_pages(&self) -> Option<BlindSpot> {
        let held = self.held_before.get()?;
        (held >= HELD_BEFORE_PAGES_BYTES).then(|| BlindSpot {
            kind: "held_before_pages",
            what: format!(
                "up to {:.1} MiB of its anonymous memory was resident before memprof traced its pages: blocks its allocator places there touch no new page and are not counted",
                held as f64 / f64::from(1 << 20)
            ),
            advice: "trace it from its start (memprof run --growth) to count every page, or by its calls (without --growth) to see every block; docs: guide/growth.md#what-it-sees-and-what-not".to_string(),
            heap: None,
            bytes: Some(held),
            unless_env: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This test process, holding `bytes` more of anonymous memory, resident.
    fn holding(bytes: usize) -> Vec<u8> {
        vec![1; bytes]
    }

    #[test]
    fn memory_held_before_is_a_blind_spot_only_when_pages_are_traced_from_now() {
        let held = holding(4 << 20);
        let pid = std::process::id();
        let allocator = Allocator::default();
        assert!(BlindSpots::new(pid, &allocator, false).held_before_pages().is_none());
        assert!(BlindSpots::after_exec(pid, &allocator).held_before_pages().is_none());
        let spot = BlindSpots::new(pid, &allocator, true).held_before_pages().expect("4 MiB held");
        assert!(spot.bytes.is_some_and(|bytes| bytes >= 4 << 20), "{spot:?}");
        // A process the daemon moves to growth mode later.
        let switched = BlindSpots::new(pid, &allocator, false);
        switched.pages_from_now(pid);
        assert!(switched.held_before_pages().is_some());
        drop(held);
    }
}
