//! How often a process's mappings are read again after its libraries change. Each read costs
//! memprof a read of the process's maps (and of its mounts, when it maps files from a FUSE or
//! network file system), a sync of its unwind tables and its probes. A process that loads and
//! unloads libraries without pause would otherwise take the tracer's thread for as much as it
//! likes, from every other process, at no cost of its own. The first change after a quiet
//! moment is read at once; the next waits for its gap, and every change in between is read with it.

use std::{collections::HashMap, time::Duration};

/// Which processes' mapping changes are read now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reads {
    /// Those whose gap since their last read has passed.
    Due,
    /// Every one: before a report, whose walks must be finished.
    Every,
}

/// The least time between two reads of one process's mappings.
const LEAST_GAP: Duration = Duration::from_millis(10);
/// And at least this many times what the last read took: a read that costs more (tens of
/// thousands of mounts, a large library) is made less often.
const GAP_PER_READ_TIME: u32 = 20;

/// When each process's mappings may be read next (monotonic ns, `aggregate::monotonic_now_ns`).
#[derive(Default)]
pub struct Pacing {
    next_ns: HashMap<u32, u64>,
}

impl Pacing {
    /// Whether `pid`'s mappings may be read at `now_ns`.
    pub fn due(&self, pid: u32, now_ns: u64) -> bool {
        self.next_ns.get(&pid).is_none_or(|&next| next <= now_ns)
    }

    /// `pid`'s mappings were read from `started_ns` for `took`.
    pub fn read(&mut self, pid: u32, started_ns: u64, took: Duration) {
        let gap = LEAST_GAP.max(took.saturating_mul(GAP_PER_READ_TIME));
        self.next_ns.insert(pid, started_ns.saturating_add(gap.as_nanos() as u64));
    }

    /// When the first of `waiting` may be read.
    pub fn next_due_ns(&self, waiting: impl Iterator<Item = u32>) -> Option<u64> {
        waiting.filter_map(|pid| self.next_ns.get(&pid).copied()).min()
    }

    pub fn forget(&mut self, pid: u32) {
        self.next_ns.remove(&pid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn a_read_holds_the_next_for_its_gap_longer_for_a_costly_one() {
        let mut pacing = Pacing::default();
        assert!(pacing.due(7, 0));
        pacing.read(7, 100 * MS, Duration::from_micros(200));
        assert!(!pacing.due(7, 109 * MS) && pacing.due(7, 110 * MS) && pacing.due(8, 100 * MS));
        pacing.read(7, 200 * MS, Duration::from_millis(5));
        assert!(!pacing.due(7, 299 * MS) && pacing.due(7, 300 * MS));
        assert_eq!(pacing.next_due_ns([7, 8].into_iter()), Some(300 * MS));
        pacing.forget(7);
        assert!(pacing.due(7, 0));
    }
}
