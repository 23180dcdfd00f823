//! What the tracer publishes: each interval, the kernel's maps read into one `DaemonView` (a
//! settled target's last view brought up to date instead), and in between the targets that came;
//! the double frees as they arrive; a target's view with an inspection on request.

use std::{
    cmp::Reverse,
    collections::{HashMap, HashSet},
    sync::Arc,
    time::{Duration, Instant, UNIX_EPOCH},
};

use profiler_common::{DoubleFreeEvent, DropReason};
use tracing::{info, warn};

use super::{crowding::Table, to_pages::ToPages, InspectFailure, Target, Tracer};
use crate::{
    daemon::{
        discovery::{self, ProcessId},
        heavy::Built,
        settled,
        view::{DaemonView, MapUse, StackSeries, TargetView},
    },
    format,
    heap::double_free::{DoubleFrees, Taken},
    heap::heuristics::Heuristics,
    heap::inspect,
    heap::report::{self, Report, Selection, StackReport},
    heap::resident::{HeapNow, PinnedWalk, Resident},
    kernel::aggregate::{self, KernelSnapshot, Snapshot},
    kernel::loader,
    process::{allocator, procfs},
    text,
    unwind::TableUse,
};

impl Tracer {
    pub(super) fn stacks<'a>(&'a self, target: &'a Target) -> report::Stacks<'a> {
        report::Stacks {
            ebpf: &self.loaded.ebpf,
            unwind: &self.loaded.unwind,
            symbolizer: &self.symbolizer,
            pid: target.id.pid,
            start_ns: target.start_ns,
            known: Some(&target.known_stacks),
            wrappers: &self.config.wrappers,
        }
    }

    /// Symbolizes the double frees that arrived (while the maps of their stacks are fresh) and
    /// logs them: a process that aborted on one is gone before anyone reads its report.
    pub(super) fn collect_double_frees(&mut self) {
        let events = self.double_free_reader.drain();
        self.add_double_frees(events);
    }

    pub(super) fn add_double_frees(&mut self, events: Vec<DoubleFreeEvent>) {
        let site =
            |frames: &[crate::symbolize::Frame]| frames.first().map_or_else(|| "[no stack]".into(), format::site);
        for event in events {
            let Some(target) = self.targets.get(&event.tgid) else { continue };
            let double_free = self.stacks(target).double_free(&event);
            let seen_whole = self.loaded.double_free_seen_whole(&event);
            let Some(target) = self.targets.get_mut(&event.tgid) else { continue };
            match target.double_frees.take(double_free, Some(&target.double_free_filter), seen_whole) {
                Taken::Kept(double_free) => warn!(
                    pid = event.tgid,
                    comm = target.comm,
                    "double free of {} ({} bytes): allocated at {}, freed at {}, freed again at {}",
                    double_free.address,
                    double_free.size,
                    site(&double_free.alloc.frames),
                    site(&double_free.first_free.frames),
                    site(&double_free.second_free.frames),
                ),
                Taken::Counted { first: true } => warn!(
                    pid = event.tgid,
                    comm = target.comm,
                    "more than {} double frees: the next ones are counted (memprof_double_frees_total), not logged",
                    DoubleFrees::KEPT
                ),
                Taken::AllocatorOwn | Taken::Unconfirmed | Taken::Counted { first: false } => {}
            }
        }
    }

    /// Reads the maps and publishes the view. `interval`: this is an interval's snapshot, which
    /// the leak rule counts as one of its window, the timeline keeps and settling counts; a
    /// snapshot that shows a target come or go in between is none of these, so that the window
    /// stays `leak_window` intervals long however often targets come and go. Between intervals
    /// it reads only the targets with no view yet.
    pub(super) fn publish(&mut self, interval: bool) -> anyhow::Result<()> {
        self.collect_double_frees();
        if interval {
            self.loaded.purge_exited();
        }
        // A target gone without its exit seen (its main thread exited long before its last
        // thread), or whose pid a new process took already: what the maps hold under that pid
        // may be the new process's, and its mappings are. Not shown as the old one's; the new
        // one is traced afresh if the rules match it. (Other exits are reported by the kernel;
        // one whose report was lost, the ring full, is found at the next scan of /proc.)
        self.leaderless.retain(|pid| self.targets.contains_key(pid));
        let gone: Vec<u32> = self
            .leaderless
            .iter()
            .filter(|&&pid| self.targets.get(&pid).is_some_and(|t| ProcessId::current(pid) != Some(t.id)))
            .copied()
            .collect();
        for pid in gone {
            self.detach(pid);
            self.found(pid);
        }
        let pids: HashSet<u32> = self.targets.keys().copied().collect();
        let still_since_ns = aggregate::monotonic_now_ns();
        // Between intervals a snapshot shows the targets that came or went: the others keep their
        // view, and nothing of theirs is read (a host where processes come and go would otherwise
        // pay a whole interval's reading for each). Those an exec, a rename or a reload left with
        // no view are read.
        let (kept, settled): (HashSet<u32>, HashSet<u32>) = if interval {
            let still = self.loaded.still_intervals(&pids)?;
            let settle_after = settled::intervals(self.config.leak);
            let settled = (self.targets.values())
                .filter(|t| t.last_view.as_ref().is_some_and(|(last, _)| last.double_frees == t.double_frees.count()))
                .filter(|t| still.get(&t.id.pid).is_some_and(|&n| n >= settle_after))
                .map(|t| t.id.pid)
                .collect();
            self.settled.clone_from(&settled);
            (HashSet::new(), settled)
        } else {
            let kept: HashSet<u32> = (self.targets.values())
                .filter(|t| t.last_view.as_ref().is_some_and(|(last, _)| last.comm == t.comm))
                .map(|t| t.id.pid)
                .collect();
            self.settled.retain(|pid| kept.contains(pid));
            (kept, HashSet::new())
        };
        let read: HashSet<u32> =
            pids.iter().filter(|pid| !settled.contains(pid) && !kept.contains(pid)).copied().collect();
        let kernel = self.loaded.read(&read, 0)?;
        self.loaded.rest(&settled, still_since_ns);
        let residents = self.targets.values_mut().filter(|t| !kept.contains(&t.id.pid)).map(|t| {
            let heap = match (&t.last_view, kernel.processes.get(&t.id.pid)) {
                (Some((last, _)), None) => {
                    HeapNow { outstanding_bytes: last.report.totals.outstanding_bytes, sampled: last.sample_bytes > 0 }
                }
                (_, snapshot) => HeapNow::of(snapshot),
            };
            (t.id.pid, &mut t.resident, heap)
        });
        let walk = if interval { PinnedWalk::IfDue } else { PinnedWalk::Not };
        Resident::read_all(&self.loaded.ebpf, kernel.live_entries, residents, &mut self.pinned_budget, walk)?;
        // Moved to growth mode once this interval's views are built: the switch takes the stacks
        // their calls recorded, which the views name.
        let mut switching = Vec::new();
        // The targets whose allocations found each shared table full since the last read.
        let mut found_full: [Vec<u32>; Table::ALL.len()] = Default::default();
        for target in self.targets.values_mut() {
            if settled.contains(&target.id.pid) {
                let time_s = still_since_ns.saturating_sub(target.start_ns) as f64 / 1e9;
                if interval {
                    target.leaks.rest(still_since_ns, time_s);
                }
                if target.last_view.as_ref().is_some_and(|(_, pinned)| *pinned != target.resident.pinned_changes()) {
                    // Its pages moved though its stacks did not: read and built whole next time.
                    self.loaded.unsettle(target.id.pid);
                }
            } else if let Some(snapshot) = kernel.processes.get(&target.id.pid) {
                // A program may rename itself: one that called its allocator since the last
                // interval is read again; an idle one at each scan of /proc (`consider`). (The
                // symbolizer learns of the libraries a target loads from the dynamic linker's
                // hook, `sync_changed_mappings`, not from a read of every target's maps.)
                let cut_walks = snapshot.drops.counts[DropReason::UnwindNoTable as usize];
                target.cut_since_read |= cut_walks > target.cut_walks;
                target.cut_walks = cut_walks;
                let calls = calls_counted(snapshot);
                if calls != target.calls {
                    target.calls = calls;
                    if let Some(comm) = procfs::comm(target.id.pid) {
                        target.comm = comm;
                    }
                }
                let time_s = snapshot.now_ns.saturating_sub(target.start_ns) as f64 / 1e9;
                if interval {
                    target.leaks.observe(snapshot, &self.loaded.ages.clock, time_s);
                }
                if let Some(switch) = target.rate_guard.check(snapshot) {
                    switching.push((target.id.pid, ToPages::AboveMaxRate(switch)));
                }
                for table in Table::ALL {
                    if target.found_full(snapshot, table) {
                        found_full[table as usize].push(target.id.pid);
                    }
                }
            }
        }
        let mut moving: Vec<u32> = switching.iter().map(|(pid, _)| *pid).collect();
        for table in Table::ALL {
            if let Some(crowder) = self.crowder(table, &kernel, &found_full[table as usize], &moving)? {
                moving.push(crowder.pid);
                switching.push((crowder.pid, ToPages::Crowding(crowder)));
            }
        }
        // A reload keeps them as loaded (see `Config::keep_read_at_start`).
        let sizes = self.config.maps;
        let tables = self.loaded.unwind.table_use();
        let (stack_entries, free_stack_entries) = self.loaded.stack_entries()?;
        let mut view = DaemonView {
            unattributed_drops: kernel.unattributed_drops,
            maps: vec![
                MapUse { name: "live", entries: kernel.live_entries, capacity: sizes.max_live.into() },
                MapUse { name: "stacks", entries: stack_entries, capacity: sizes.max_stacks.into() },
                MapUse { name: "free_stacks", entries: free_stack_entries, capacity: loader::FREE_STACKS.into() },
                MapUse {
                    name: "stack_stats",
                    entries: kernel.stack_stats_entries,
                    capacity: loader::stack_stats_capacity(sizes).into(),
                },
                MapUse { name: "unwind_rows", entries: tables.rows_used, capacity: tables.rows_max },
                MapUse { name: "traced", entries: self.loaded.tracked().0, capacity: loader::TRACED_CAPACITY.into() },
            ],
            refused_targets: self.refused_total,
            missed_targets: self.missed_total,
            children_followed: self.children_followed,
            children_missed: self.children_missed,
            children_unseen_ns: self.children_unseen_ns,
            longest_child_unseen_ns: self.longest_child_unseen_ns,
            started_unseen_ns: self.started_unseen_ns,
            longest_started_unseen_ns: self.longest_started_unseen_ns,
            untraced_sharing: self.untraced_sharing(&pids),
            machine_wide: self.loaded.machine_wide(),
            discovery_scans: self.scans,
            discovery_events: self.discovery_events,
            settled_targets: self.settled.len() as u64,
            size_histograms: self.config.size_histograms,
            pid_labels: self.config.pid_labels,
            unwind: tables,
            symbolization_failures: self.symbolizer.failures().into_iter().map(|(f, n)| (f.name(), n)).collect(),
            ready: true,
            read_at_seconds: UNIX_EPOCH.elapsed().unwrap_or_default().as_secs_f64(),
            ..DaemonView::default()
        };
        let slots = self.slots.assign(self.targets.values().map(|t| (t.id.pid, t.comm.as_str())));
        // Each view, and whether it was built now.
        let views: Vec<(Arc<TargetView>, bool)> = (self.targets.values())
            .map(|target| {
                let mut view = match (&target.last_view, settled.contains(&target.id.pid)) {
                    (Some((last, _)), _) if kept.contains(&target.id.pid) => return (last.clone(), false),
                    (Some((last, _)), true) => self.settled_view(target, last, still_since_ns, &kernel, &tables),
                    _ => {
                        target.known_stacks.next_interval();
                        self.target_view(target, &kernel, &tables)
                    }
                };
                view.slot = slots[&target.id.pid];
                (Arc::new(view), true)
            })
            .collect();
        for (target_view, built) in views {
            if !built {
                view.targets.insert(target_view.pid, target_view);
                continue;
            }
            let Some(target) = self.targets.get_mut(&target_view.pid) else { continue };
            target.last_view = Some((target_view.clone(), target.resident.pinned_changes()));
            self.drops.observe(target_view.pid, &target_view.report.dropped);
            view.targets.insert(target_view.pid, target_view);
        }
        view.all_drops = self.drops.totals().clone();
        for (pid, why) in switching {
            self.move_out(pid, why);
        }
        let old = std::mem::replace(&mut *self.view.write().unwrap_or_else(|e| e.into_inner()), view);
        // Freed after the lock is released: the last interval's stacks take a while to free, and
        // scrapes wait for the lock.
        drop(old);
        Ok(())
    }

    /// The processes not traced that map a shared-linked file, counted again when the shared
    /// files changed and after each scan of /proc.
    pub(super) fn untraced_sharing(&mut self, traced: &HashSet<u32>) -> u64 {
        let files = self.loaded.shared_files();
        let (counted, count, next) = &mut self.sharing;
        if files != *counted || Instant::now() >= *next {
            *count = discovery::untraced_sharing(&files, traced);
            *counted = files;
            *next = Instant::now() + Duration::from_secs_f64(self.config.resync);
        }
        *count
    }

    /// `pid`'s view with an inspection made now: the process is held still meanwhile, and this
    /// thread busy (milliseconds to seconds with the heap's size; `/metrics` reads the last view).
    pub(super) fn inspect(&mut self, pid: u32, heuristics: Heuristics) -> Result<TargetView, InspectFailure> {
        if !self.targets.contains_key(&pid) {
            return Err(InspectFailure::NotTraced(pid));
        }
        if let Some(why) = self.loaded.blocks_not_kept(pid) {
            return Err(InspectFailure::NoBlocks { pid, why });
        }
        let failed = |err: anyhow::Error| InspectFailure::Failed { pid, why: format!("{err:#}") };
        let glibc = allocator::find(pid).is_ok_and(|allocator| allocator.is_glibc());
        // The daemon did not see the allocations made before it attached.
        let settings =
            inspect::Settings { glibc, complete: false, precopy: crate::heap::capture::Precopy::default(), heuristics };
        let inspection = inspect::inspect(&self.loaded.ebpf, pid, settings).map_err(failed)?;
        info!(pid, pause_ms = inspection.pause_ms, "inspected");
        self.symbolizer.refresh(pid);
        let pids = HashSet::from([pid]);
        let kernel =
            aggregate::read(&self.loaded.ebpf, &self.loaded.unwind, &mut self.loaded.ages, &pids, 0, &|_| None)
                .map_err(failed)?;
        let target = &self.targets[&pid];
        let mut view = self.target_view(target, &kernel, &self.loaded.unwind.table_use());
        report::add_inspection(&mut view.report, inspection, &self.stacks(target));
        Ok(view)
    }

    /// A settled target's `last` view brought up to `now_ns` (see `settled`).
    pub(super) fn settled_view(
        &self,
        target: &Target,
        last: &TargetView,
        now_ns: u64,
        kernel: &KernelSnapshot,
        tables: &TableUse,
    ) -> TargetView {
        let update = |report: &mut Report| {
            report.memory = target.resident.last();
            report.blind_spots = target.blind_spots.current(report);
            report.unwind_tables = Some(*tables);
            report.unattributed_dropped = report::unattributed_dropped(kernel);
            report.timeline = target.leaks.timeline_as_named();
            // A second free changes no kernel counter: a still process may have had one.
            report.double_frees_unconfirmed = target.double_frees.unconfirmed();
        };
        settled::bring_up_to_date(last, settled::Now { now_ns, start_ns: target.start_ns, update: &update })
    }

    pub(super) fn target_view(&self, target: &Target, kernel: &KernelSnapshot, tables: &TableUse) -> TargetView {
        let pid = target.id.pid;
        let none = Snapshot::default();
        let snapshot = kernel.processes.get(&pid).unwrap_or(&none);
        let ctx = report::Context {
            stacks: self.stacks(target),
            comm: &target.comm,
            ns_pid: target.ns_pid,
            double_frees: &target.double_frees,
            leaks: &target.leaks,
            pinned: target.resident.pinned(),
        };
        let selection = Selection { is_final: true, top: None, aged_only: false, freed: true, whole_peak: false };
        let mut report = report::build(&ctx, snapshot, kernel, selection);
        self.config.suppressions.apply(&mut report);
        report.exe = target.exe.clone().unwrap_or_default();
        report.live = true;
        // This interval's reading (`Resident::read_all`): /proc is read once a target an interval.
        report.memory = target.resident.last();
        report.blind_spots = target.blind_spots.current(&report);
        report.unwind_tables = Some(*tables);
        // The report lists the stacks that hold memory, as `memprof attach --json` does; those
        // that freed all they allocated are kept aside for the allocation profile.
        let freed_stacks: Vec<StackReport> = report.stacks.extract_if(.., |s| s.outstanding_allocations == 0).collect();
        // Two stack ids can resolve to the same code locations (and so the same label): merged,
        // since a scrape with two series of one name and labels fails.
        let mut by_label: HashMap<&str, (u64, bool, &StackReport)> = HashMap::new();
        for stack in &report.stacks {
            let (bytes, leak, _) = by_label.entry(&stack.stack_id).or_insert((0, false, stack));
            *bytes += stack.outstanding_bytes;
            *leak |= stack.leak.candidate;
        }
        let mut by_label: Vec<(&str, (u64, bool, &StackReport))> = by_label.into_iter().collect();
        // Leak candidates first, so that an alert on one can always name its site. Only the
        // exported few are sorted.
        fn order<'a>(
            &(label, (bytes, leak, _)): &(&'a str, (u64, bool, &StackReport)),
        ) -> (bool, Reverse<u64>, &'a str) {
            (!leak, Reverse(bytes), label)
        }
        let top = self.config.top_stacks.min(by_label.len());
        if top < by_label.len() {
            by_label.select_nth_unstable_by_key(top, order);
        }
        // `top_stacks = 0` exports no stack series, "other" included.
        let other_stack_bytes = if top == 0 { 0 } else { by_label[top..].iter().map(|(_, (bytes, _, _))| bytes).sum() };
        by_label.truncate(top);
        by_label.sort_by_key(order);
        // Only the exported few are described.
        let by_label: Vec<StackSeries> = by_label
            .into_iter()
            .map(|(label, (bytes, leak_candidate, stack))| StackSeries {
                stack: label.to_string(),
                site: stack.frames.first().map_or_else(|| "[no stack]".to_string(), format::site),
                function: stack
                    .frames
                    .first()
                    .map_or_else(|| "[no stack]".to_string(), |frame| text::printable(&frame.function).into_owned()),
                bytes,
                leak_candidate,
            })
            .collect();
        TargetView {
            pid,
            slot: 0,
            comm: target.comm.clone(),
            cgroup: target.cgroup.clone(),
            attached_at: target.attached_at.duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64()),
            double_frees: target.double_frees.count(),
            leak_candidate_bytes: report.stacks.iter().filter(|s| s.leak.candidate).map(|s| s.outstanding_bytes).sum(),
            leak_candidates: report.stacks.iter().filter(|s| s.leak.candidate).count() as u64,
            leak_warming_up: target.leaks.warming_up(),
            sample_bytes: report.sample_bytes,
            sizes: snapshot.sizes,
            top_stacks: by_label,
            other_stack_bytes,
            report,
            freed_stacks,
            built: Built::default(),
        }
    }
}

/// The calls a process's probes counted, recorded or dropped: it changes with each.
fn calls_counted(snapshot: &Snapshot) -> u64 {
    let stacks: u64 = snapshot.stacks.iter().map(|s| s.stats.allocations + s.stats.frees).sum();
    let drops: u64 = snapshot.drops.counts.iter().sum();
    let counters = &snapshot.counters;
    stacks + counters.unknown_frees + counters.internal_frees + counters.failed_allocations + drops
}
