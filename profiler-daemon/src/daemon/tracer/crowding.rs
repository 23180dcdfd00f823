//! The live table (`LIVE`) and the stack table (`STACKS`) are one each for every traced process.
//! Once one process holds most of either, the table fills and the others' allocations go
//! unrecorded, or recorded without their stacks: that process, whoever runs it, blinds memprof to
//! the rest, and so do two or three together. When another process's allocations find a table
//! full, the one holding the most of it, if more than a quarter (`CROWDING_SHARE`), is moved to
//! growth mode, which keeps none of its blocks or call stacks there: the others are traced whole
//! again, and it is still traced, by the pages it touches. Below that share, the table is too
//! small for the processes it serves: moving one would free little, and the reports say to raise
//! it.

use std::{borrow::Cow, cmp::Reverse, collections::HashMap};

use profiler_common::DropReason;

use super::{Target, Tracer};
use crate::{
    heap::sampling::MaxRate,
    kernel::aggregate::{self, KernelSnapshot, Sampler, Snapshot},
};

/// The share of a table (one in this many entries) past which the process holding the most of it
/// is moved out when another finds it full: a quarter, so that two or three large holders are
/// moved too, one at a time, and at most three processes at once are past it.
const CROWDING_SHARE: u64 = 4;

/// The fill (in eighths) a table must still have for a process to be moved out of it, counting
/// the entries of the processes still traced: room made since it was found full, or about to be
/// (an exited process's entries, purged at the next interval), needs no move.
const STILL_FULL_EIGHTHS: u64 = 7;

/// A table every traced process shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Table {
    Live,
    Stacks,
}

impl Table {
    pub const ALL: [Table; 2] = [Table::Live, Table::Stacks];

    /// What an allocation that found it full counts.
    fn full(self) -> DropReason {
        match self {
            Table::Live => DropReason::LiveMapFull,
            Table::Stacks => DropReason::StackTableFull,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Table::Live => "live table",
            Table::Stacks => "stack table",
        }
    }

    /// The setting that sizes it.
    pub fn setting(self) -> &'static str {
        match self {
            Table::Live => "max_live",
            Table::Stacks => "max_stacks",
        }
    }
}

/// A process that crowds the others out of a table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Crowder {
    pub table: Table,
    pub pid: u32,
    /// Its entries in the table, of `capacity`.
    pub entries: u64,
    pub capacity: u64,
    /// Another process whose allocations found the table full since the last read.
    pub crowded_out: u32,
}

impl Crowder {
    /// Logs what it did, and `done`, what the daemon did about it.
    pub fn say(&self, comm: &str, done: &str) {
        let table = self.table.name();
        tracing::warn!(
            pid = self.pid,
            comm,
            table,
            entries = self.entries,
            capacity = self.capacity,
            crowded_out = self.crowded_out,
            "holds the most of the {table} ({} of {} entries), and another process's allocations found it full: {done}",
            self.entries,
            self.capacity
        );
    }
}

impl Target {
    /// Whether its allocations found `table` full since the last read.
    pub(super) fn found_full(&mut self, snapshot: &Snapshot, table: Table) -> bool {
        let full = snapshot.drops.counts[table.full() as usize];
        let last = std::mem::replace(&mut self.tables_full[table as usize], full);
        // Below the last count, it started again (an exec): any is new.
        full > last || (full < last && full > 0)
    }
}

impl Tracer {
    /// The process to move out of `table` this interval, if any, of those not `moving` already.
    /// `max_rate = off` keeps every process traced by its calls, whatever it holds.
    pub(super) fn crowder(
        &self,
        table: Table,
        kernel: &KernelSnapshot,
        found_full: &[u32],
        moving: &[u32],
    ) -> anyhow::Result<Option<Crowder>> {
        if self.config.sampling.max_rate == Some(MaxRate::Off) || found_full.is_empty() {
            return Ok(None);
        }
        // A sampled process's counts are estimates, not entries of the live table, and so are
        // those its allocator's own sampler gives: only a process whose every block is an entry.
        // Any process traced by its calls keeps its stacks.
        let entries_counted = |t: &Target| {
            table == Table::Stacks
                || match kernel.processes.get(&t.id.pid) {
                    Some(snapshot) => snapshot.sample_bytes == 0 && snapshot.sampler == Sampler::None,
                    None => t
                        .last_view
                        .as_ref()
                        .is_some_and(|(view, _)| view.sample_bytes == 0 && view.report.usdt_samples.is_none()),
                }
        };
        let movable = self.targets.values().filter(|t| {
            entries_counted(t)
                && !t.pages_refused
                && self.loaded.blocks_not_kept(t.id.pid).is_none()
                && !moving.contains(&t.id.pid)
        });
        let (capacity, held) = match table {
            Table::Live => (self.config.maps.max_live, Cow::Borrowed(&kernel.live_by_process)),
            // Walked only when a process found the table full.
            Table::Stacks => {
                (self.config.maps.max_stacks, Cow::Owned(aggregate::stacks_by_process(&self.loaded.ebpf)?))
            }
        };
        let traced: u64 = self.targets.keys().map(|pid| held.get(pid).copied().unwrap_or(0)).sum();
        Ok(crowder(table, capacity.into(), &held, traced, movable.map(|t| t.id.pid), found_full))
    }
}

/// The process to move out of `table`, if any: of `movable` (those whose blocks or stacks are in
/// it), the one holding the most entries, when that is more than a quarter of `capacity`, a
/// process other than it is among `found_full`, and the entries of the processes still traced
/// (`traced`) fill the table nearly whole.
fn crowder(
    table: Table,
    capacity: u64,
    held: &HashMap<u32, u64>,
    traced: u64,
    movable: impl IntoIterator<Item = u32>,
    found_full: &[u32],
) -> Option<Crowder> {
    let (pid, entries) = movable
        .into_iter()
        .map(|pid| (pid, held.get(&pid).copied().unwrap_or(0)))
        .max_by_key(|&(pid, entries)| (entries, Reverse(pid)))?;
    if entries.saturating_mul(CROWDING_SHARE) <= capacity {
        return None;
    }
    if traced.saturating_mul(8) < capacity.saturating_mul(STILL_FULL_EIGHTHS) {
        return None;
    }
    let crowded_out = found_full.iter().copied().find(|&other| other != pid)?;
    Some(Crowder { table, pid, entries, capacity, crowded_out })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The (holder, crowded out) moved of a table of 1000 entries held as `held` by processes
    /// still traced, where `movable` keep their blocks in it and `found_full` found it full.
    fn moved(held: &[(u32, u64)], movable: &[u32], found_full: &[u32]) -> Option<(u32, u32)> {
        let live = held.iter().copied().collect();
        let traced = held.iter().map(|(_, entries)| entries).sum();
        crowder(Table::Live, 1000, &live, traced, movable.iter().copied(), found_full).map(|c| (c.pid, c.crowded_out))
    }

    #[test]
    fn the_process_holding_most_of_a_full_table_is_moved_when_another_finds_it_full() {
        assert_eq!(moved(&[(10, 700), (20, 300)], &[10, 20], &[20]), Some((10, 20)));
    }

    #[test]
    fn nobody_is_moved_while_only_the_holder_finds_the_table_full() {
        // One process alone past the table: raising max_live is the fix, said in its report.
        assert_eq!(moved(&[(10, 1000)], &[10], &[10]), None);
        assert_eq!(moved(&[(10, 900), (20, 100)], &[10, 20], &[]), None);
    }

    #[test]
    fn the_larger_of_two_holding_half_each_is_moved() {
        assert_eq!(moved(&[(10, 490), (20, 500), (30, 10)], &[10, 20, 30], &[30]), Some((20, 30)));
        assert_eq!(moved(&[(10, 260), (20, 250), (30, 250), (40, 240)], &[10, 20, 30, 40], &[40]), Some((10, 40)));
    }

    #[test]
    fn nobody_is_moved_once_the_table_has_room_again() {
        // A process that held 400 entries exited: purged before the read, or about to be.
        assert_eq!(moved(&[(10, 500), (20, 100)], &[10, 20], &[20]), None);
        let live = HashMap::from([(10, 500), (20, 100), (30, 400)]);
        assert_eq!(crowder(Table::Live, 1000, &live, 600, [10, 20], &[20]), None);
        assert_eq!(moved(&[(10, 500), (20, 375)], &[10, 20], &[20]), Some((10, 20)));
    }

    #[test]
    fn nobody_is_moved_when_no_process_holds_more_than_a_quarter() {
        assert_eq!(moved(&[(10, 250), (20, 250), (30, 250), (40, 250)], &[10, 20, 30, 40], &[40]), None);
    }

    #[test]
    fn a_holder_whose_blocks_are_not_in_the_table_is_not_counted() {
        // Process 10 is traced by its pages already: its old count is no entry of the table.
        assert_eq!(moved(&[(10, 900), (20, 600)], &[20, 30], &[30]), Some((20, 30)));
    }
}
