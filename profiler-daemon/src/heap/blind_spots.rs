//! What memprof knows it does not see in a process: allocators found but not probed (from
//! `process::allocator`), and anonymous memory that grows while no probed call is made, the sign
//! of an allocator memprof does not know at all (whose mappings then show where it asked for it).

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

/// One traced process's blind spots.
#[derive(Debug, Clone)]
pub struct BlindSpots {
    unprobed: Vec<BlindSpot>,
    /// The least anonymous resident memory seen since its allocator was probed: growth is
    /// measured from it. The least, not the first: a command `memprof run` starts is a copy of
    /// memprof until it execs. `Cell`s, as reports are built from a shared borrow.
    anon_floor: Cell<u64>,
    /// The most it grew above the floor while it could be read: the final report of a process
    /// that has exited still says so.
    grown: Cell<u64>,
    /// The files with code mapped that were looked into for allocators memprof does not probe.
    scanned: HashSet<String>,
}

impl BlindSpots {
    pub fn new(pid: u32, allocator: &Allocator) -> Self {
        let anon = procfs::anon_resident_bytes(pid).unwrap_or(u64::MAX);
        let mut spots = Self {
            unprobed: Vec::new(),
            anon_floor: Cell::new(anon),
            grown: Cell::new(0),
            scanned: allocator.looked_into.clone(),
        };
        spots.add(pid, allocator.unprobed.clone());
        spots
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
    /// Growth mode sees every page a heap first touches, a runtime's too: it has none.
    pub fn current(&self, report: &Report) -> Vec<BlindSpot> {
        if report.growth.is_some() {
            return Vec::new();
        }
        let (memory, allocations_seen, mapped_bytes) =
            (report.memory, report.totals.allocations, report.mappings.outstanding_bytes);
        let mut spots = self.unprobed.clone();
        if let Some(anon) = memory.map(|m| m.rss_anon_bytes) {
            self.anon_floor.set(self.anon_floor.get().min(anon));
            self.grown.set(self.grown.get().max(anon - self.anon_floor.get()));
        }
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
                unless_env: None,
            });
        }
        spots
    }
}
