//! What the maps hold of each traced process: which are tracked, their counts read, their
//! mapping lists, their sampling.

use std::{
    collections::{HashMap, HashSet},
    num::NonZeroU32,
    time::Instant,
};

use anyhow::Context as _;
use aya::Ebpf;
use profiler_common::{DeferredUnwind, DoubleFreeEvent, ProcMappings, StackEnd};

use crate::{
    bell::EdgeBell,
    kernel::aggregate::{self, KernelSnapshot},
    kernel::early_stacks,
    kernel::events,
    kernel::probes::{self, Attachment},
    kernel::sample_rates,
    process::{
        link_map,
        procfs::{self, FileMapping},
    },
    unwind::{Completion, DeferredCopy, Reads, Registry},
};

use super::Loaded;

/// What is known of a process just before its mappings are read (`Loaded::before_mappings`).
#[derive(Debug, Clone, Copy)]
pub struct BeforeMappings {
    /// When (monotonic ns).
    read_ns: u64,
    /// Its count of code changes (see `unwind::Registry::code_changes`).
    changes: u64,
    /// The program it runs (`early_stacks::program_image`), which each exec moves.
    image: Option<u32>,
}

impl Loaded {
    /// Makes `pid`'s execs and forks reported in `process_events`.
    pub(super) fn track(&mut self, pid: u32) -> anyhow::Result<()> {
        let shares = self.shared.shares(pid).unwrap_or(false);
        self.track_sharing(pid, shares)
    }

    /// `track`, and whether links shared per file record `pid` (`traced::SHARED`). A process
    /// traced by its pages stays so (`traced::GROWTH` and `traced::OWN_MAPPING_CALLS`, see
    /// `watch_pages`), and one whose probes are being attached too (`traced::ATTACHING`, see
    /// `probe_allocator`).
    pub(super) fn track_sharing(&mut self, pid: u32, shares: bool) -> anyhow::Result<()> {
        use profiler_common::traced::{ATTACHING, GROWTH, OWN_MAPPING_CALLS, SHARED};
        let flags = if shares { SHARED } else { 0 };
        self.update_traced(pid, |old| flags | old & (GROWTH | ATTACHING | OWN_MAPPING_CALLS))
    }

    /// Writes `pid`'s `TRACED` entry as `update` makes it from the flags it has (0 when none).
    /// Only the daemon's thread writes the map.
    pub(super) fn update_traced(&mut self, pid: u32, update: impl FnOnce(u32) -> u32) -> anyhow::Result<()> {
        let mut traced: aya::maps::HashMap<_, u32, u32> =
            aya::maps::HashMap::try_from(self.ebpf.map_mut("TRACED").context("map TRACED missing")?)?;
        let flags = update(traced.get(&pid, 0).unwrap_or(0));
        traced.insert(pid, flags, 0)?;
        Ok(())
    }

    /// Removes everything memprof holds about `pids`, which have exited (or were detached while
    /// running): map entries, unwind tables, ages, process-event tracking.
    pub fn forget_exited(&mut self, pids: &HashSet<u32>) {
        self.let_go(pids);
        self.forget_state(pids);
        self.rest_page_faults();
    }

    /// `forget_exited`'s first part, which costs next to nothing: `pids` are out of `TRACED`, so
    /// that shared links stop recording a process still running.
    pub(super) fn let_go(&mut self, pids: &HashSet<u32>) {
        if let Some(Ok(mut traced)) = self.ebpf.map_mut("TRACED").map(aya::maps::HashMap::<_, u32, u32>::try_from) {
            for pid in pids {
                let _ = traced.remove(pid);
            }
        }
        for &pid in pids {
            self.probed_since.remove(&pid);
            self.moved_to_pages.remove(&pid);
            self.read_machine_wide.remove(&pid);
            self.shared.forget(pid);
            self.usdt.forget(pid);
            self.probe_threads.forget(&mut self.ebpf, pid);
        }
        // Last: a shared link records nothing of them once they are out of `TRACED`.
        self.unwind_events.drop_events_of(pids);
    }

    /// `forget_exited`, but what the maps hold about `pids` goes at the next `purge_exited`,
    /// with the entries of every process let go meanwhile. A purge walks every map whatever the
    /// number of processes: a thousand exits at once are one walk, not a thousand.
    pub fn forget_exited_later(&mut self, pids: &HashSet<u32>) {
        self.let_go(pids);
        self.forget_kept(pids);
        // Walks remembered under the unwind rows just given up (freed, or idle and so free to be
        // taken) are not taken again (the purge started a new generation at once when it came
        // with the rest).
        if let Err(err) = self.unwind.new_generation(&mut self.ebpf) {
            tracing::warn!("starting a new generation of unwind rows failed: {err:#}");
        }
        self.rest_page_faults();
        self.unpurged.extend(pids);
    }

    /// Purges what the processes `forget_exited_later` let go left in the maps.
    pub fn purge_exited(&mut self) {
        if !self.unpurged.is_empty() {
            let pids = std::mem::take(&mut self.unpurged);
            self.purge_maps(&pids);
        }
    }

    /// `purge_exited` when `pid` is among the processes it would purge: before `pid` is traced
    /// again, so that a purge does not take the new process's entries.
    pub fn purge_exited_before_tracing(&mut self, pid: u32) {
        if self.unpurged.contains(&pid) {
            self.purge_exited();
        }
    }

    /// What the maps, the stack walk and the ages hold about `pids`.
    pub(super) fn forget_state(&mut self, pids: &HashSet<u32>) {
        self.purge_maps(pids);
        self.forget_kept(pids);
    }

    /// Everything the maps hold about `pids`.
    fn purge_maps(&mut self, pids: &HashSet<u32>) {
        // The stacks other processes' ranges and pages hold are theirs to keep.
        if let Err(err) = self.purge(aggregate::Doomed::Processes(pids), pids) {
            tracing::warn!("purging the maps of {} processes failed: {err:#}", pids.len());
        }
        (self.walked_entries, self.stack_entries) = (None, None);
    }

    /// What memprof keeps about `pids` outside the maps' entries: stillness, unwind tables,
    /// ages, mappings.
    fn forget_kept(&mut self, pids: &HashSet<u32>) {
        for &pid in pids {
            self.stillness.forget(pid);
            self.unwind.forget(&mut self.ebpf, pid);
            self.unwind_events.forget(pid);
            self.ages.forget(pid);
            if let Some(mappings) = &mut self.mappings {
                mappings.forget(pid, &self.ages.clock);
            }
        }
    }

    /// Applies the mapping calls and first touches that arrived; none without `--mappings` or
    /// growth mode.
    pub fn drain_mappings(&mut self) {
        if let Some(mappings) = &mut self.mappings {
            mappings.drain(&self.ages.clock);
        }
    }

    /// Rung when a burst of mapping events fills a quarter of their ring; none without
    /// `--mappings` or growth mode.
    pub fn mapping_bell(&self) -> Option<&EdgeBell> {
        self.mappings.as_ref().map(|mappings| mappings.bell())
    }

    /// `drain_mappings` when the kernel rang for a burst, not at every wake-up of the caller: a
    /// fault's event comes before its page, and a transparent huge page still being zeroed
    /// would count as one page.
    pub fn drain_rung_mappings(&mut self) {
        if self.mapping_bell().is_some_and(EdgeBell::take) {
            self.drain_mappings();
        }
    }

    /// Takes the breakpoints of the `traced` processes out of their children that are not traced
    /// (see `probes::sweep_copies`).
    pub fn sweep_copies<'a>(&mut self, traced: impl IntoIterator<Item = (&'a Attachment, NonZeroU32)>) {
        if let Err(err) = probes::sweep_copies(&mut self.ebpf, traced) {
            tracing::warn!("children not traced keep their parents' breakpoints: {err:#}");
        }
    }

    /// Whether double free `event` is one: its first free came once every allocator probe of
    /// its process was in place (`probes_in_place`). The probes go in one function at a time
    /// while the process runs, so a block freed meanwhile may be given out again by a function
    /// not probed yet, and its next free would pass for a second one.
    pub fn double_free_seen_whole(&self, event: &DoubleFreeEvent) -> bool {
        let whole = self.probed_since.get(&event.tgid).is_none_or(|&since| event.first.free.time_ns >= since);
        if !whole {
            tracing::debug!(
                pid = event.tgid,
                "a free while the probes went in, then another: not told from a double free"
            );
        }
        whole
    }

    /// Every allocator probe of `pid` is in place now, or withdrawn: a free remembered before
    /// may have been followed by an allocation no probe saw (see `double_free_seen_whole`).
    pub(super) fn probes_in_place(&mut self, pid: u32) {
        self.probed_since.insert(pid, aggregate::monotonic_now_ns());
    }

    /// Why `tgid`'s blocks are not kept one by one, so that an inspection has nothing to class:
    /// it is traced by the pages it touches, or only through its allocator's own sampler.
    pub fn blocks_not_kept(&self, tgid: u32) -> Option<&'static str> {
        if self.mappings.as_ref().is_some_and(|mappings| mappings.pages(tgid).is_some()) {
            return Some("traced by the pages it touches (growth mode), which keeps its heap by stack and no block");
        }
        (self.usdt.sampler_of(tgid) == aggregate::Sampler::Only)
            .then_some("traced through its allocator's own sampler, which keeps a sample of its blocks, not each one")
    }

    /// `tgid`'s events not recorded now (see `aggregate::drops_of`).
    pub fn drops_of(&self, tgid: u32) -> anyhow::Result<profiler_common::ProcDrops> {
        let mut drops = aggregate::drops_of(&self.ebpf, &self.unwind, tgid)?;
        self.add_gaps(tgid, &mut drops);
        Ok(drops)
    }

    /// Reads the maps for `tgids` (see `aggregate::read`), with the ranges each maps.
    pub fn read(&mut self, tgids: &HashSet<u32>, min_age_ns: u64) -> anyhow::Result<KernelSnapshot> {
        self.drain_mappings();
        if let (true, Some((live_entries, stack_stats_entries))) = (tgids.is_empty(), self.walked_entries) {
            let unattributed_drops = aggregate::unattributed_drops(&self.ebpf)?;
            return Ok(KernelSnapshot { live_entries, stack_stats_entries, unattributed_drops, ..Default::default() });
        }
        let pages = |tgid: u32| self.mappings.as_ref().and_then(|mappings| mappings.pages(tgid));
        let mut kernel = aggregate::read(&self.ebpf, &self.unwind, &mut self.ages, tgids, min_age_ns, &pages)?;
        if let Some(mappings) = &self.mappings {
            for (&tgid, process) in &mut kernel.processes {
                process.mappings = mappings.stacks(tgid);
            }
        }
        for (&tgid, process) in &mut kernel.processes {
            process.sampler = self.usdt.sampler_of(tgid);
            self.add_gaps(tgid, &mut process.drops);
        }
        (self.walked_entries, self.stack_entries) = (Some((kernel.live_entries, kernel.stack_stats_entries)), None);
        Ok(kernel)
    }

    /// The entries of `STACKS` and `FREE_STACKS`: counted again only after a read that walked
    /// the maps (a stack is stored only by a process that moved) or a purge.
    pub fn stack_entries(&mut self) -> anyhow::Result<(u64, u64)> {
        if let Some(entries) = self.stack_entries {
            return Ok(entries);
        }
        let entries = (
            aggregate::stack_entries(&self.ebpf, aggregate::StackTable::Allocations)?,
            aggregate::stack_entries(&self.ebpf, aggregate::StackTable::Frees)?,
        );
        self.stack_entries = Some(entries);
        Ok(entries)
    }

    /// For each of `tgids`, the intervals in a row it has been still (see `stillness`).
    pub fn still_intervals(&mut self, tgids: &HashSet<u32>) -> anyhow::Result<HashMap<u32, u32>> {
        self.drain_mappings();
        let mappings = self.mappings.as_ref();
        let learned = |tgid| mappings.map_or(0, |m| m.events(tgid)) + self.unwind.deferred_finished(tgid);
        self.stillness.update(&self.ebpf, tgids, learned)
    }

    /// `tgid` is read whole at the next interval, still or not.
    pub fn unsettle(&mut self, tgid: u32) {
        self.stillness.forget(tgid);
    }

    /// `tgids` have been still since `since_ns` at least and are not read (see `AgeBook::rest`).
    pub fn rest(&mut self, tgids: &HashSet<u32>, since_ns: u64) {
        for &tgid in tgids {
            self.ages.rest(tgid, since_ns);
        }
    }

    /// The allocator calls of `tgids` so far (see `aggregate::calls`).
    pub fn calls(&self, tgids: &HashSet<u32>) -> anyhow::Result<HashMap<u32, aggregate::Calls>> {
        aggregate::calls(&self.ebpf, tgids)
    }

    /// How many processes the kernel reports execs and forks of, and how many of those events
    /// found the ring buffer full.
    pub fn tracked(&self) -> (u64, u64) {
        let entries = self.ebpf.map("TRACED").map_or(0, |map| {
            let mut n = 0;
            let _ = crate::kernel::batch::for_each(map, |_: &u32, _: &u32| n += 1);
            n
        });
        (entries, events::events_lost(&self.ebpf))
    }

    /// Gives the stack walk the current executable mappings of `pid` and their tables; returns
    /// whether the files it maps with code changed.
    pub fn sync_mappings(&mut self, pid: u32) -> bool {
        let before = self.before_mappings(pid);
        // An exited process not yet reaped has no mappings left: keep what it had.
        match procfs::file_mappings(pid) {
            Ok(mappings) if !mappings.is_empty() => self.sync_mappings_with(pid, &mappings, before),
            _ => false,
        }
    }

    /// Process `pid` exec'd at `exec_ns` (its event's time): the walks its old program sent are
    /// not finished on the new one's mappings. Told before they are read, which
    /// `image_replaced` follows.
    pub fn exec_seen(&mut self, pid: u32, exec_ns: u64) {
        self.unwind_events.exec_happened(pid, exec_ns);
    }

    /// What `sync_mappings_with` needs of `pid`, read just before its mappings.
    pub fn before_mappings(&mut self, pid: u32) -> BeforeMappings {
        BeforeMappings {
            read_ns: aggregate::monotonic_now_ns(),
            changes: self.unwind.code_changes(&mut self.ebpf, pid),
            image: early_stacks::program_image(&self.ebpf, pid),
        }
    }

    /// `sync_mappings` with `pid`'s mappings read already, after `before_mappings` gave `before`.
    /// The walks `pid` deferred that wait their turn are finished on the way (see `early_stacks`).
    pub fn sync_mappings_with(&mut self, pid: u32, mappings: &[FileMapping], before: BeforeMappings) -> bool {
        let waiting = self.unwind_events.take_deferred(pid);
        self.sync_finishing(pid, mappings, before, &waiting.iter().collect::<Vec<_>>())
    }

    /// `sync_mappings_with`, finishing `walks`, deferred walks of `pid`, on the new mapping list
    /// before the kernel has it (see `early_stacks`). Then, unless `pid` exec'd since its
    /// mappings were read, the walks it sent that are still in the ring (while the list's tables
    /// were built): finished after the kernel walked their stacks whole on the list, they would
    /// count apart. Last, to leave the kernel the least time to walk a stack whole before its
    /// walk is finished. Those the list cannot serve go back to the reader, collected with the
    /// records read before them and finished at the process's next sync on whatever list it
    /// reads. Not for a process traced by its pages: its walks have no totals per stack to keep
    /// together. When the list is held back (see `Registry::waits_for_libraries`), `walks` wait
    /// for the next.
    fn sync_finishing(
        &mut self,
        pid: u32,
        mappings: &[FileMapping],
        before: BeforeMappings,
        walks: &[&DeferredCopy],
    ) -> bool {
        let by_calls = !self.traces_pages(pid);
        // (See `Registry::waits_for_libraries`.)
        let list_may_wait = by_calls && self.unwind_events.objects(pid).is_none();
        let unwind_events = &mut self.unwind_events;
        let mut finished = false;
        let finish = |ebpf: &mut Ebpf, unwind: &mut Registry, list: &ProcMappings| {
            finished = true;
            finish_walks(ebpf, unwind, walks, Some(list), |_| by_calls);
            if !by_calls || early_stacks::program_image(ebpf, pid) != before.image {
                return;
            }
            let mut event = DeferredCopy::blank();
            let mut waiting = Vec::new();
            for copy in unwind_events.take_uncollected_walks(pid) {
                copy.write_into(&mut event);
                let completion = unwind.walk_deferred(&event, list);
                if completion.end == StackEnd::NoTable {
                    waiting.push(copy);
                } else {
                    count_finished(ebpf, unwind, &event, completion, by_calls);
                }
            }
            unwind_events.return_to_reader(waiting);
        };
        let synced = self.unwind.sync_with(&mut self.ebpf, pid, mappings, before.changes, list_may_wait, finish);
        if !finished {
            self.unwind_events.keep_for_next_drain(walks.iter().map(|copy| (*copy).clone()).collect());
        }
        synced.unwrap_or_else(|err| {
            tracing::warn!("reading the unwind tables of pid {pid}: {err:#}");
            false
        })
    }

    /// Syncs the mappings of every process that reported new ones or has a deferred walk, then
    /// finishes those walks on the tables just loaded; returns the pids.
    pub fn sync_changed_mappings(&mut self) -> Vec<u32> {
        self.sync_changed_mappings_with(Reads::Due, procfs::exe_path, |_, _| {})
    }

    /// `sync_changed_mappings`, giving each process's mappings to `on_read` as soon as they are
    /// read, before the tables are built: a short-lived process may be gone a moment later. A
    /// process already gone has the mappings of the linker's last list of objects (`link_map`),
    /// or, without a dynamic linker, those of an executable loaded where it says; its
    /// executable's path from `exe_of`.
    pub fn sync_changed_mappings_with(
        &mut self,
        reads: Reads,
        exe_of: impl Fn(u32) -> Option<String>,
        mut on_read: impl FnMut(u32, &[FileMapping]),
    ) -> Vec<u32> {
        let drained = self.unwind_events.drain(aggregate::monotonic_now_ns(), reads);
        let mut finished = HashSet::new();
        for &pid in &drained.pids {
            let started = Instant::now();
            let before = self.before_mappings(pid);
            let mappings = match procfs::file_mappings(pid) {
                Ok(mappings) if !mappings.is_empty() => mappings,
                _ => match self.unwind_events.objects(pid) {
                    Some(objects) => link_map::mappings(objects, exe_of(pid).as_deref()),
                    None => match exe_of(pid).and_then(|exe| link_map::fixed_executable(&exe)) {
                        Some(mappings) => mappings,
                        None => continue,
                    },
                },
            };
            on_read(pid, &mappings);
            let walks: Vec<&DeferredCopy> = drained.deferred.iter().filter(|copy| copy.tgid() == pid).collect();
            self.sync_finishing(pid, &mappings, before, &walks);
            finished.insert(pid);
            self.unwind_events.mappings_read(pid, before.read_ns, started.elapsed());
        }
        // Those of processes whose mappings could not be read.
        let left: Vec<&DeferredCopy> =
            drained.deferred.iter().filter(|copy| !finished.contains(&copy.tgid())).collect();
        self.finish_on_kernel_lists(&left);
        drained.pids
    }

    /// For a final report, which no later list serves: the walks collected and not finished
    /// yet, finished on the lists the kernel has, so that those still cut are counted. (A
    /// library loaded since the last sync has no table there: its frames end the walk as cut.)
    pub fn finish_waiting_walks(&mut self) {
        let drained = self.unwind_events.drain(aggregate::monotonic_now_ns(), Reads::Every);
        tracing::debug!("{} walks finished on the kernel's lists for the final report", drained.deferred.len());
        self.finish_on_kernel_lists(&drained.deferred.iter().collect::<Vec<_>>());
    }

    /// `walks` finished on the mapping lists the kernel has of their processes.
    fn finish_on_kernel_lists(&mut self, walks: &[&DeferredCopy]) {
        let by_pages: HashSet<u32> =
            walks.iter().map(|copy| copy.tgid()).filter(|&pid| self.traces_pages(pid)).collect();
        finish_walks(&mut self.ebpf, &mut self.unwind, walks, None, |pid| !by_pages.contains(&pid));
    }

    /// When the next process whose mapping changes wait for their gap may be synced (monotonic
    /// ns; see `unwind::pacing`).
    pub fn next_mappings_sync_ns(&self) -> Option<u64> {
        self.unwind_events.next_due_ns()
    }

    /// Records `pid`'s allocations by sampling from now on (see `sample_rates::set`).
    pub fn sample(&mut self, pid: u32, sample_bytes: u64) -> anyhow::Result<()> {
        sample_rates::set(&mut self.ebpf, pid, sample_bytes)
    }
}

/// Finishes `walks`, deferred walks, on `list` (None: the list the kernel has), each whole stack
/// then counted under its early id (see `early_stacks`); `by_calls` tells, of a process, whether
/// it is traced by its allocator calls.
fn finish_walks(
    ebpf: &mut Ebpf,
    unwind: &mut Registry,
    walks: &[&DeferredCopy],
    list: Option<&ProcMappings>,
    by_calls: impl Fn(u32) -> bool,
) {
    if walks.is_empty() {
        return;
    }
    let mut event = DeferredCopy::blank();
    for copy in walks {
        copy.write_into(&mut event);
        let completion = unwind.walk_deferred_on(ebpf, &event, list);
        count_finished(ebpf, unwind, &event, completion, by_calls(event.tgid));
    }
}

/// Keeps `completion`, deferred walk `event` finished, and counts its allocation stack under its
/// early id (see `early_stacks`).
fn count_finished(
    ebpf: &mut Ebpf,
    unwind: &mut Registry,
    event: &DeferredUnwind,
    completion: Completion,
    by_calls: bool,
) {
    let completion = unwind.record_deferred(event, completion);
    if early_stacks::count_whole_under_early_id(ebpf, event, completion, by_calls) == early_stacks::Counted::Apart {
        unwind.deferred_split();
    }
}
