//! What memprof knows it does not see in a process: allocators found but not probed (from
//! `process::allocator`), and anonymous memory that grows while no probed call is made, the sign
//! of an allocator memprof does not know at all (whose mappings then show where it asked for it).

use std::cell::Cell;

use crate::{
    heap::resident::Memory,
    process::{
        allocator::{Allocator, BlindSpot},
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
}

impl BlindSpots {
    pub fn new(pid: u32, allocator: &Allocator) -> Self {
        let anon = procfs::anon_resident_bytes(pid).unwrap_or(u64::MAX);
        let mut unprobed = allocator.unprobed.clone();
        unprobed.retain(|spot| spot.unless_env.is_none_or(|entry| !procfs::has_env(pid, entry)));
        Self { unprobed, anon_floor: Cell::new(anon), grown: Cell::new(0) }
    }

    /// The process's blind spots now, given its memory (its latest reading), how many
    /// allocations memprof has seen in it and the bytes it holds from mappings made outside its
    /// allocator (`heap::mappings`), which name where memory unseen by the heap was asked for.
    pub fn current(&self, memory: Option<Memory>, allocations_seen: u64, mapped_bytes: u64) -> Vec<BlindSpot> {
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
                unless_env: None,
            });
        }
        spots
    }
}
