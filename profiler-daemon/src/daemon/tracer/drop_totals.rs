//! Every event the probes dropped, of every process traced since the daemon started, by reason.
//! A process's own counters go with it when it exits and start again at an exec, and their
//! series appear at their first count, which Prometheus's `increase()` never sees grow: this
//! total keeps them all, from 0 for every reason.

use std::collections::{BTreeMap, HashMap};

use profiler_common::DropReason;

use crate::heap::report::MISSED_GENERATIONS;

#[derive(Debug)]
pub struct DropTotals {
    totals: BTreeMap<&'static str, u64>,
    /// Each traced process's counts when last seen.
    last: HashMap<u32, BTreeMap<&'static str, u64>>,
}

impl Default for DropTotals {
    fn default() -> Self {
        let reasons = DropReason::ALL.iter().map(|r| r.name()).chain([MISSED_GENERATIONS]);
        Self { totals: reasons.map(|name| (name, 0)).collect(), last: HashMap::new() }
    }
}

impl DropTotals {
    /// Counts what `pid`'s counters say it dropped since they were last seen.
    pub fn observe(&mut self, pid: u32, dropped: &BTreeMap<&'static str, u64>) {
        let last = self.last.entry(pid).or_default();
        for (&reason, &count) in dropped {
            let before = last.insert(reason, count).unwrap_or(0);
            // Fewer than before: an exec, whose new program counts from zero.
            let new = if count >= before { count - before } else { count };
            *self.totals.entry(reason).or_default() += new;
        }
    }

    /// `pid` is no longer traced: counts its last drops, and forgets it.
    pub fn retire(&mut self, pid: u32, dropped: &BTreeMap<&'static str, u64>) {
        self.observe(pid, dropped);
        self.last.remove(&pid);
    }

    pub fn totals(&self) -> &BTreeMap<&'static str, u64> {
        &self.totals
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(live_map_full: u64) -> BTreeMap<&'static str, u64> {
        BTreeMap::from([(DropReason::LiveMapFull.name(), live_map_full)])
    }

    #[test]
    fn every_reason_starts_at_zero_and_drops_outlive_their_process_and_its_execs() {
        let mut drops = DropTotals::default();
        assert!(drops.totals().len() > DropReason::COUNT && drops.totals().values().all(|&n| n == 0));
        let full = |drops: &DropTotals| drops.totals()[DropReason::LiveMapFull.name()];
        drops.observe(7, &counts(100));
        drops.observe(7, &counts(150));
        assert_eq!(full(&drops), 150);
        // An exec: the new program's 20 are new.
        drops.observe(7, &counts(20));
        assert_eq!(full(&drops), 170);
        drops.retire(7, &counts(25));
        drops.observe(8, &counts(5));
        assert_eq!(full(&drops), 180);
    }
}
