//! The session's loop: what it reads and reports from, every interval and at the end.

use std::{
    collections::{HashMap, HashSet},
    time::Duration,
};

use std::os::fd::{AsFd as _, OwnedFd};

use profiler_common::{DoubleFreeEvent, DropReason};

use tokio::io::unix::AsyncFd;

use crate::{
    cli::{TraceArgs, MAX_SECONDS},
    commands::family::{Family, Process},
    commands::recording::Settings,
    commands::suppress,
    commands::target::{self, ExitWatch},
    console::say,
    format::{self, Flame, Format},
    heap::blind_spots::BlindSpots,
    heap::context::RunContext,
    heap::inspect::{self, Inspection},
    heap::known_stacks::KnownStacks,
    heap::price::{Mode, PriceWatch, SystemCpu},
    heap::report::{self, Report, Selection},
    heap::resident::{HeapNow, PinnedBudget, PinnedWalk, Resident},
    heap::sampling::{MaxRate, Switch},
    heap::suppressions::Suppressions,
    heap::threads::{self, ThreadNames},
    heap::wrappers::Wrappers,
    kernel::aggregate::{self, DoubleFreeReader},
    kernel::loader::{Loaded, Reads},
    process::procfs,
    symbolize::SymbolizerHandle,
};

use super::{say_not_seen, settings, Opened};

/// How a trace ended.
pub(super) struct Traced {
    /// The target's exit code when memprof started it.
    pub(super) code: Option<i32>,
    /// What `--fail-on-leak-bytes` judges from the final report.
    pub(super) gate: LeakGate,
    /// The target ended by itself before the session did.
    pub(super) ended: bool,
}

/// The final report's in-use bytes by the leak rule's verdict, children included.
#[derive(Default)]
pub(super) struct LeakGate {
    /// Held by leak candidates.
    pub(super) candidates: u64,
    /// Held by processes the rule has no verdict on at all yet: traced for fewer intervals than
    /// its window (a short command, or child). A young stack of a process the rule judges is
    /// left to the rule, as in any report: it is no leak before it has grown for a window.
    pub(super) unjudged: u64,
    /// How long the root process was traced, in seconds.
    pub(super) traced_s: f64,
}

impl LeakGate {
    fn of(root: &Report) -> Self {
        let reports = || std::iter::once(root).chain(&root.children);
        let unjudged = reports().filter(|report| report.stacks.iter().all(|s| s.leak.warming_up.is_some()));
        Self {
            candidates: reports()
                .flat_map(|r| &r.stacks)
                .filter(|s| s.leak.candidate)
                .map(|s| s.outstanding_bytes)
                .sum(),
            unjudged: unjudged.flat_map(|r| &r.stacks).map(|s| s.outstanding_bytes).sum(),
            traced_s: root.duration_s,
        }
    }
}

/// What a session reads and reports from.
struct Tracer<'a> {
    loaded: Loaded,
    symbolizer: SymbolizerHandle,
    family: Family,
    double_free_reader: DoubleFreeReader,
    args: &'a TraceArgs,
    start_ns: u64,
    min_age_ns: u64,
    context: RunContext,
    /// Every report is built whole (every stack) for the recording; the format takes its part.
    recording: bool,
    /// The root process's inspection, for its final report.
    inspection: Option<Inspection>,
    pinned_budget: PinnedBudget,
    wrappers: Wrappers,
    suppressions: &'a Suppressions,
    /// With `--threads`, each process's threads' names, read each interval.
    thread_names: HashMap<u32, ThreadNames>,
    /// The processes whose allocations found the live table full, said once each.
    said_full: HashSet<u32>,
    /// Followed children that exited, in the order they did, whose last reports are read
    /// together when `exits_due_ns` (CLOCK_MONOTONIC) comes: each read walks the maps of every
    /// process.
    exited: Vec<u32>,
    exits_due_ns: Option<u64>,
}

/// How long a followed child's exit waits for others to be read with it.
const EXITS_GATHERED_NS: u64 = 250_000_000;

impl Tracer<'_> {
    /// `pid`'s stacks; those symbolized for one report kept in `known`, which a report's build
    /// fills a few hundred at a time (see `Stacks::symbolize_all`).
    fn stacks<'s>(&'s self, pid: u32, known: Option<&'s KnownStacks>) -> report::Stacks<'s> {
        report::Stacks {
            ebpf: &self.loaded.ebpf,
            unwind: &self.loaded.unwind,
            symbolizer: &self.symbolizer,
            pid,
            // A child's times count from when it was followed, not from the session's start.
            start_ns: self.family.get(pid).map_or(self.start_ns, |process| process.start_ns),
            known,
            wrappers: &self.wrappers,
        }
    }

    /// New libraries get their tables (and are probed when they hold the allocator), and walks
    /// the kernel deferred are finished on them.
    fn on_unwind_events(&mut self, reads: Reads) {
        // Read, then the execs, then used: a program's mapping changes come after the exec that
        // started it, whose path names its executable when it is gone before its mappings are
        // read (see `UnwindEvents::collect`).
        self.loaded.unwind_events.collect();
        self.on_process_events();
        let (symbolizer, family) = (&self.symbolizer, &self.family);
        let exe_of = |pid| family.get(pid).map(|process| process.exe.clone());
        let on_read = |pid, mappings: &[_]| symbolizer.refresh_with(pid, mappings.to_vec());
        for pid in self.loaded.sync_changed_mappings_with(reads, exe_of, on_read) {
            self.family.probe(&mut self.loaded, pid);
            if let Some(spots) = self.family.get_mut(pid).and_then(|process| process.blind_spots.as_mut()) {
                spots.learn_new_files(pid).iter().for_each(|spot| say_not_seen(pid, spot));
            }
        }
    }

    /// Before the final report: the walks that still wait for a list (sent during `collect`,
    /// or put back by its syncs) finished on the lists the kernel has, so that a cut one is
    /// counted (`dropped.unwind_no_table`).
    fn finish_waiting_walks(&mut self) {
        // As `on_unwind_events`: read, then the execs, then used.
        self.loaded.unwind_events.collect();
        self.on_process_events();
        self.loaded.finish_waiting_walks();
    }

    /// Execs, forks and exits; first the double frees of the programs that exec'd.
    fn on_process_events(&mut self) {
        let events = self.loaded.process_events.drain();
        let before = self.double_free_reader.drain_before_execs(&events);
        self.add_double_frees(before);
        self.family.on_process_events(&mut self.loaded, &self.symbolizer, events);
    }

    /// Refreshes what is known of the live processes and collects their double frees.
    fn collect(&mut self) {
        // Before the reports: a walk deferred since the last event is finished for them.
        self.on_unwind_events(Reads::Every);
        let pids = self.family.pids();
        for pid in pids {
            if let Some(current) = procfs::comm(pid) {
                if let Some(process) = self.family.get_mut(pid) {
                    process.comm = current;
                    // Unreadable for a moment while the process execs.
                    if let Some(exe) = procfs::exe_path(pid) {
                        process.exe = exe;
                    }
                }
                self.loaded.sync_mappings(pid);
                self.symbolizer.refresh(pid);
                if self.args.threads {
                    self.thread_names.entry(pid).or_default().refresh(pid);
                }
            }
        }
        self.family.probe_waiting(&mut self.loaded);
        self.collect_double_frees();
    }

    /// Symbolizes the double frees that arrived, while the maps still hold their stacks.
    fn collect_double_frees(&mut self) {
        let events = self.double_free_reader.drain();
        self.add_double_frees(events);
    }

    fn add_double_frees(&mut self, events: Vec<DoubleFreeEvent>) {
        for event in events {
            let double_free = self.stacks(event.tgid, None).double_free(&event);
            let seen_whole = self.loaded.double_free_seen_whole(&event);
            let Some(process) = self.family.get_mut(event.tgid) else { continue };
            process.double_frees.take(double_free, process.double_free_filter.as_ref(), seen_whole);
        }
    }

    /// Reads the kernel's counters (the leak rule needs every interval's); returns the root's
    /// report with its children's, when one is to be written.
    fn read(&mut self, is_final: bool) -> anyhow::Result<Option<Report>> {
        let Some(mut reports) = self.read_reports(is_final, &self.family.pids(), true)? else { return Ok(None) };
        let root_at = reports.iter().position(|r| r.pid == self.family.root);
        let Some(mut root) = root_at.map(|at| reports.remove(at)) else { return Ok(None) };
        root.forks = self.family.forks(&self.loaded);
        root.unwind_tables = Some(self.loaded.unwind.table_use());
        root.context = Some(self.context.clone());
        root.children = self.family.exited_reports().iter().cloned().chain(reports).collect();
        Ok(Some(root))
    }

    /// Reads the kernel's counters for `pids`, all of the session's when `whole`, in one walk of
    /// the maps; returns their reports, when they are to be written.
    fn read_reports(
        &mut self,
        is_final: bool,
        pids: &HashSet<u32>,
        whole: bool,
    ) -> anyhow::Result<Option<Vec<Report>>> {
        let kernel = self.loaded.read(pids, self.min_age_ns)?;
        let clock = self.loaded.ages.clock;
        let mut switches = Vec::new();
        // The session's final report reads the pinned pages whatever the budget (a child's
        // exit, which may come in storms, does not).
        let residents = self
            .family
            .processes_mut()
            .filter(|p| pids.contains(&p.pid))
            .map(|p| (p.pid, &mut p.resident, HeapNow::of(kernel.processes.get(&p.pid))));
        Resident::read_all(
            &self.loaded.ebpf,
            kernel.live_entries,
            residents,
            &mut self.pinned_budget,
            if is_final && whole { PinnedWalk::Now } else { PinnedWalk::IfDue },
        )?;
        for process in self.family.processes_mut().filter(|p| pids.contains(&p.pid)) {
            let Some(snapshot) = kernel.processes.get(&process.pid) else { continue };
            // A final read switches nothing: the tracing ends.
            if let Some(switch) = process.rate_guard.check(snapshot).filter(|_| !is_final) {
                switches.push((process.pid, switch));
            }
            let unrecorded = snapshot.drops.counts[DropReason::LiveMapFull as usize];
            if unrecorded > 0 && self.said_full.insert(process.pid) {
                say!(
                    "memprof: pid {}: the table of live allocations is full: {unrecorded} allocations not recorded so far, and the totals are lower bounds; give a larger --max-live",
                    process.pid
                );
            }
            let time_s = (snapshot.now_ns.saturating_sub(process.start_ns)) as f64 / 1e9;
            // A final read moments after the last interval is no interval of its own: it stands
            // in for the last (see `observe_instead_of_last`).
            let since_last = time_s - process.leaks.last_time_s().unwrap_or(f64::NEG_INFINITY);
            if is_final && since_last < self.args.interval / 2.0 {
                process.leaks.observe_instead_of_last(snapshot, &clock, time_s);
            } else {
                process.leaks.observe(snapshot, &clock, time_s);
            }
        }
        for (pid, switch) in switches {
            self.switch(pid, switch)?;
        }
        let format = self.args.output.format();
        if !is_final && !format.streams() && !self.recording && !self.args.live {
            return Ok(None);
        }
        let selection = Selection {
            is_final,
            // Filters, suppressions and generated rules see every stack; the format shows the top.
            top: (format == Format::Table
                && self.args.filters.is_empty()
                && self.suppressions.is_empty()
                && !self.args.suppress.gen_suppressions
                && !self.recording
                && !self.args.live)
                .then_some(self.args.top),
            aged_only: self.min_age_ns > 0,
            freed: format == Format::Pprof || self.recording,
            whole_peak: self.recording,
        };
        let mut by_thread = if self.args.threads {
            let sample_bytes = |pid| kernel.processes.get(&pid).map_or(0, |s| s.sample_bytes);
            threads::read(&self.loaded.ebpf, pids, sample_bytes)?
        } else {
            HashMap::new()
        };
        // The root's inspection, given to its report before suppressions take their blocks out.
        let mut inspection = self.inspection.take();
        let reports: Vec<Report> = self
            .family
            .processes()
            .filter(|p| pids.contains(&p.pid))
            .map(|process| {
                // For this report only: the session reads every process's mappings again each
                // interval, which may name its stacks anew.
                let known = KnownStacks::default();
                let ctx = report::Context {
                    stacks: self.stacks(process.pid, Some(&known)),
                    comm: &process.comm,
                    ns_pid: process.ns_pid,
                    double_frees: &process.double_frees,
                    leaks: &process.leaks,
                    pinned: process.resident.pinned(),
                };
                let snapshot = kernel.processes.get(&process.pid).cloned().unwrap_or_default();
                let mut report = report::build(&ctx, &snapshot, &kernel, selection);
                report.exe = process.exe.clone();
                report.parent = process.parent;
                report.memory = process.resident.current(process.pid, report.totals.outstanding_bytes);
                report.blind_spots = process.blind_spots.as_ref().map_or_else(Vec::new, |b| b.current(&report));
                if let Some(tally) = by_thread.remove(&process.pid) {
                    report.threads = tally.view(self.thread_names.get(&process.pid));
                }
                if let Some(inspection) = inspection.take_if(|_| process.pid == self.family.root) {
                    report::add_inspection(&mut report, inspection, &self.stacks(process.pid, Some(&known)));
                }
                self.suppressions.apply(&mut report);
                if !self.args.filters.is_empty() {
                    self.args.filters.apply(&mut report);
                }
                report
            })
            .collect();
        Ok(Some(reports))
    }

    /// Samples `pid` from now on, and says so.
    fn switch(&mut self, pid: u32, switch: Switch) -> anyhow::Result<()> {
        self.loaded.sample(pid, switch.sample_bytes)?;
        say!("{}", switch.line(pid));
        Ok(())
    }

    /// When the next process's price is due (CLOCK_MONOTONIC, ns), if any is still to be said.
    fn next_price_ns(&self) -> Option<u64> {
        self.family.processes().filter_map(|p| p.price.map(|watch| watch.due_ns())).min()
    }

    /// Says the price of each process traced for a second now: the root's always, a followed
    /// child's when it is worth saving (a build's compilers would fill the terminal otherwise).
    /// The count read for it is checked against `--max-rate` too, so that a busy process is
    /// switched to sampling after its first second, not its first intervals; a second later,
    /// what sampling costs it is said the same way (each call still traps), and where `attach`'s
    /// default made the switch, a process sampling still costs more than `PAGES_ABOVE` is moved
    /// to its pages (except with `--inspect`, which needs its blocks).
    fn say_prices(&mut self) -> anyhow::Result<()> {
        let now_ns = aggregate::monotonic_now_ns();
        // Taken whatever happens next: each price is said once at most.
        let due: HashMap<u32, PriceWatch> = self
            .family
            .processes_mut()
            .filter(|p| p.price.is_some_and(|watch| watch.due_ns() <= now_ns))
            .filter_map(|p| Some((p.pid, p.price.take()?)))
            .collect();
        if due.is_empty() {
            return Ok(());
        }
        let calls = self.loaded.calls(&due.keys().copied().collect())?;
        let root = self.family.root;
        let mut switches = Vec::new();
        let mut to_pages = Vec::new();
        for process in self.family.processes_mut() {
            let (Some(watch), Some(count)) = (due.get(&process.pid), calls.get(&process.pid)) else { continue };
            let Some(now) = SystemCpu::read(process.pid) else { continue };
            let switch = process.rate_guard.check_calls(now.at_ns, count.calls, count.sample_bytes);
            let mode = match (switch, count.sample_bytes) {
                (Some(_), _) => Mode::Switched,
                (None, 0) => Mode::Exact,
                (None, _) => Mode::Sampled,
            };
            if let Some(price) = watch.price(process.pid, now, count.calls, mode) {
                if process.pid == root || price.significant() {
                    say!("{}", price.line());
                }
                if price.mode == Mode::ToPages {
                    to_pages.push((process.pid, count.sample_bytes));
                }
            }
            switches.extend(switch.map(|switch| (process.pid, switch, watch, count.calls)));
        }
        for (pid, switch, watch, calls) in switches {
            self.switch(pid, switch)?;
            let pages_if_dear = switch.max_rate == MaxRate::Default && !self.args.inspect;
            if let Some(process) = self.family.get_mut(pid) {
                process.price = watch.again(pid, calls, pages_if_dear);
            }
        }
        for (pid, sample_bytes) in to_pages {
            self.move_to_pages(pid, sample_bytes);
        }
        Ok(())
    }

    /// Traces `pid`, which sampling still costs too much, by the pages it touches from now on,
    /// and says so; says why not when it cannot be. Not where that would slow every system call
    /// of every process on the machine: the default never makes another process pay.
    fn move_to_pages(&mut self, pid: u32, sample_bytes: u64) {
        match self.loaded.pages_spare_system_calls(pid) {
            Ok(true) => {}
            Ok(false) => {
                say!(
                    "memprof: pid {pid} stays sampled: growth mode would slow every system call on this host: its kernel refuses fexit programs and the process maps memory through no wrapper memprof can probe (docs: reference/limits.md#mappings); --growth traces it by its pages all the same"
                );
                return;
            }
            Err(err) => {
                say!("memprof: pid {pid} stays sampled: growth mode cannot be loaded: {err:#}");
                return;
            }
        }
        let keep = format!("--sample-bytes {sample_bytes} keeps it sampled, --max-rate off records every call");
        // Before its calls' stacks go with them.
        self.collect_double_frees();
        match self.family.switch_to_pages(&mut self.loaded, pid) {
            Ok(()) => {
                say!(
                    "memprof: pid {pid} costs more than a tenth of a core even sampled: traced by the pages its heap first touches from now on (growth mode, as --growth), its calls' records dropped; {keep}"
                );
                // What it holds already, its pages cannot show: said now, as the reports will.
                let spots = self.family.get(pid).and_then(|process| process.blind_spots.as_ref());
                if let Some(spot) = spots.and_then(BlindSpots::held_before_pages) {
                    say_not_seen(pid, &spot);
                }
            }
            // One that exited meanwhile is said so by its exit line.
            Err(_) if procfs::stat(pid).is_none_or(|stat| stat.zombie || stat.exiting) => {}
            Err(err) => say!("memprof: pid {pid} could not be moved to growth mode: {err:#}"),
        }
    }

    /// A followed child exited: its probes go now, and it is read with the others that exit
    /// within `EXITS_GATHERED_NS`.
    fn child_exited(&mut self, pid: u32) {
        self.family.detach_exited(&mut self.loaded, pid);
        if !self.exited.contains(&pid) {
            self.exited.push(pid);
        }
        self.exits_due_ns.get_or_insert(aggregate::monotonic_now_ns() + EXITS_GATHERED_NS);
    }

    /// The children that exited: their last reports are kept, their probes and map entries go.
    fn read_exited(&mut self) {
        self.exits_due_ns = None;
        if self.exited.is_empty() {
            return;
        }
        // Their walks finished first, for their last reports: once they are let go, the walks
        // still waiting are dropped (see `UnwindEvents::drop_events_of`). Theirs only: the others
        // keep their pace.
        self.loaded.unwind_events.make_due(&self.exited);
        self.on_unwind_events(Reads::Due);
        // Theirs may be the last events they sent: a program that aborts on a double free.
        self.collect_double_frees();
        let pids = std::mem::take(&mut self.exited);
        let mut reports = match self.read_reports(true, &pids.iter().copied().collect(), false) {
            Ok(reports) => reports.unwrap_or_default(),
            Err(err) => {
                tracing::warn!(?pids, "reading the maps: {err:#}");
                Vec::new()
            }
        };
        for pid in pids {
            let last = reports.iter().position(|report| report.pid == pid).map(|at| {
                let mut report = reports.swap_remove(at);
                report.exited = true;
                report
            });
            self.family.on_child_exit(&mut self.loaded, pid, last);
        }
    }
}

/// Reports every interval until the target exits, a signal arrives or the duration is up; then
/// prints the final report.
pub(super) async fn trace(
    mut loaded: Loaded,
    symbolizer: SymbolizerHandle,
    root: Process,
    exit: &mut ExitWatch,
    args: &TraceArgs,
    opened: Opened,
    inspect: Option<inspect::Settings>,
) -> anyhow::Result<Traced> {
    let Opened { mut output, mut recording, mut stop, suppressing, mut live } = opened;
    // SAFETY: new fds of our own, open as long as the AsyncFds that own them.
    let unwind_events = unsafe { AsyncFd::register(loaded.unwind_events.bell().try_clone_to_owned()?) }
        .map_err(|err| err.into_parts().1)?;
    let process_events = unsafe { AsyncFd::register(loaded.process_events.ring().as_fd().try_clone_to_owned()?) }
        .map_err(|err| err.into_parts().1)?;
    let mut mapping_bell = mapping_bell_of(&loaded)?;
    let double_free_reader = DoubleFreeReader::new(&mut loaded.ebpf)?;
    let (exits, mut exited) = tokio::sync::mpsc::unbounded_channel();
    let follow_forks = super::follows_forks(args, matches!(exit, ExitWatch::Attached(..)));
    let mut tracer = Tracer {
        loaded,
        symbolizer,
        family: Family::new(root, settings(args), follow_forks, exits),
        double_free_reader,
        args,
        start_ns: aggregate::monotonic_now_ns(),
        min_age_ns: (args.min_age * 1e9) as u64,
        context: RunContext::now(),
        recording: recording.is_some(),
        inspection: None,
        pinned_budget: PinnedBudget::default(),
        wrappers: Wrappers::new(&args.wrappers),
        suppressions: &suppressing.rules,
        thread_names: HashMap::new(),
        said_full: HashSet::new(),
        exited: Vec::new(),
        exits_due_ns: None,
    };
    // A process attached to may have children already; `run`'s command has none before its exec.
    if follow_forks && matches!(exit, ExitWatch::Attached(..)) {
        tracer.family.adopt_existing_children(&mut tracer.loaded, &tracer.symbolizer);
    }
    if let Some(recording) = &mut recording {
        recording.start(Settings { top: args.top, interval_s: args.interval })?;
    }
    let mut ticks = tokio::time::interval(Duration::from_secs_f64(args.interval));
    ticks.tick().await;
    let duration = tokio::time::sleep(Duration::from_secs_f64(args.duration.unwrap_or(MAX_SECONDS)));
    tokio::pin!(duration);
    let format = args.output.format();
    // Returns whether the reports are still read.
    let mut write = |report: Option<Report>| -> anyhow::Result<bool> {
        if let Some(report) = report {
            if let Some(recording) = &mut recording {
                recording.report(&report)?;
            }
            if let Some(view) = &mut live {
                if !report.is_final {
                    view.draw(&format::select(&report, Format::Table, usize::MAX))?;
                    return Ok(true);
                }
            }
            // Off the live screen before the final report.
            live = None;
            if report.is_final || format.streams() {
                output.write_report(&format::select(&report, format, args.top), format, Flame::Bytes)?;
                if let (true, Some(line)) = (report.is_final, format::left_out_of(&report, format)) {
                    say!("{line}");
                }
                if let (true, false, Some(path)) = (report.is_final, format.streams(), output.path()) {
                    say!("memprof: wrote {}", path.display());
                }
            }
        }
        Ok(output.is_read())
    };

    let mut target_ended = false;
    // A stop signal came and `run`'s command outlived it (see below).
    let mut asked_to_stop = false;
    let code = loop {
        let price_due = tracer.next_price_ns();
        tokio::select! {
            () = until_monotonic(price_due) => {
                if let Err(err) = tracer.say_prices() {
                    tracing::warn!("saying the price of tracing: {err:#}");
                }
                // A process moved to its pages has them rung for from now on.
                if mapping_bell.is_none() {
                    mapping_bell = mapping_bell_of(&tracer.loaded)?;
                }
            }
            () = until_monotonic(tracer.exits_due_ns) => tracer.read_exited(),
            _ = ticks.tick() => {
                tracer.collect();
                // Before the purge of the maps, and out of this interval's report.
                tracer.read_exited();
                tracer.family.flush(&mut tracer.loaded);
                // `attach ... | head -1`: nobody reads any more, so end quietly as --duration does.
                if !write(tracer.read(false)?)? {
                    break None;
                }
            }
            ready = process_events.readable() => {
                if let Ok(mut ready) = ready {
                    ready.clear_ready();
                }
                tracer.on_process_events();
            }
            Some(ready) = async { Some(mapping_bell.as_ref()?.readable().await) } => {
                if let Ok(mut ready) = ready {
                    ready.clear_ready();
                }
                tracer.loaded.drain_rung_mappings();
            }
            Some(pid) = exited.recv() => tracer.child_exited(pid),
            ready = unwind_events.readable() => {
                if let Ok(mut ready) = ready {
                    ready.clear_ready();
                }
                tracer.on_unwind_events(Reads::Due);
            }
            () = until_monotonic(tracer.loaded.next_mappings_sync_ns()) => tracer.on_unwind_events(Reads::Due),
            code = exit.exited() => {
                target_ended = true;
                break code;
            }
            signal = stop.recv() => {
                let code = match asked_to_stop {
                    false => exit.settle().await,
                    true if exit.ended() => exit.exited().await,
                    true => None,
                };
                // `run`'s command may take its time to shut down: traced to its end, which the
                // report then covers, and whose code memprof exits with. Unless asked again.
                let outlived = code.is_none() && matches!(exit, ExitWatch::Child(..));
                if outlived && !asked_to_stop {
                    asked_to_stop = true;
                    let root = tracer.family.root;
                    let comm = tracer.family.get(root).map(|process| process.comm.clone()).unwrap_or_default();
                    say!(
                        "memprof: pid {root} ({comm}) still runs 2 s after {}: traced until it exits; signal memprof again to end now and leave it running untraced",
                        target::signal_name(signal)
                    );
                    continue;
                }
                if let Some(asked) = args.duration {
                    let traced_s = aggregate::monotonic_now_ns().saturating_sub(tracer.start_ns) as f64 / 1e9;
                    say!("memprof: stopped by a signal after {traced_s:.1} s of the {asked} s asked (--duration): the report covers {traced_s:.1} s");
                }
                if outlived {
                    let root = tracer.family.root;
                    say!("memprof: pid {root} runs on untraced; memprof exits with {}", 128 + signal);
                    break Some(128 + signal);
                }
                break code;
            }
            _ = &mut duration => break None,
        }
    };
    // Children that forked or exited meanwhile are counted in the final report.
    tracer.on_process_events();
    while let Ok(pid) = exited.try_recv() {
        tracer.child_exited(pid);
    }
    // Children whose exit watchers have not run yet.
    let root = tracer.family.root;
    for pid in tracer.family.pids() {
        if pid != root && procfs::stat(pid).is_none_or(|stat| stat.zombie) {
            tracer.child_exited(pid);
        }
    }
    tracer.read_exited();
    if let Some(settings) = inspect {
        tracer.inspection = inspect_root(&tracer, settings);
    }
    tracer.collect();
    tracer.finish_waiting_walks();
    let mut result = tracer.read(true);
    // A process attached to ended by itself: said, as an on-call engineer needs to know (its
    // parent may have reaped it already, and its exit status with it on kernels before 6.15).
    if let (true, ExitWatch::Attached(..), Ok(Some(root))) = (target_ended, &*exit, &mut result) {
        root.exited = true;
        let how = exit.how_it_ended().map_or_else(String::new, |how| format!(" ({how})"));
        say!("memprof: pid {} ({}) exited{how} after {:.1}s of tracing", root.pid, root.comm, root.duration_s);
    }
    let gate = result.as_ref().ok().and_then(Option::as_ref).map_or_else(LeakGate::default, LeakGate::of);
    let generated = result.as_ref().ok().and_then(Option::as_ref).and_then(|root| suppressing.generated(root));
    let written = result.and_then(&mut write).and_then(|read| suppress::print(generated).map(|()| read));
    let Tracer { mut loaded, family, .. } = tracer;
    family.finish(&mut loaded);
    written.map(|_| Traced { code, gate, ended: target_ended })
}

/// With `--mappings` or growth mode: rung so that a burst of first touches is read before it
/// fills its ring.
fn mapping_bell_of(loaded: &Loaded) -> anyhow::Result<Option<AsyncFd<OwnedFd>>> {
    let Some(bell) = loaded.mapping_bell() else { return Ok(None) };
    // SAFETY: a new fd of our own, open as long as the AsyncFd that owns it.
    Ok(Some(unsafe { AsyncFd::register(bell.as_fd().try_clone_to_owned()?) }.map_err(|err| err.into_parts().1)?))
}

/// Waits until CLOCK_MONOTONIC reaches `at_ns`; forever when none.
async fn until_monotonic(at_ns: Option<u64>) {
    match at_ns {
        Some(at_ns) => {
            tokio::time::sleep(Duration::from_nanos(at_ns.saturating_sub(aggregate::monotonic_now_ns()))).await;
        }
        None => std::future::pending().await,
    }
}

/// Inspects the root process if it is still there; says why not otherwise.
fn inspect_root(tracer: &Tracer, settings: inspect::Settings) -> Option<Inspection> {
    let pid = tracer.family.root;
    if procfs::stat(pid).is_none_or(|stat| stat.zombie) {
        say!("memprof: pid {pid} exited before it could be inspected; no inspection in the report");
        return None;
    }
    match inspect::inspect(&tracer.loaded.ebpf, pid, settings) {
        Ok(inspection) => {
            say!(
                "memprof: inspected pid {pid}: held still {:.1} ms, {} bytes of roots and {} of blocks scanned",
                inspection.pause_ms,
                inspection.root_bytes_scanned,
                inspection.block_bytes_scanned
            );
            Some(inspection)
        }
        Err(err) => {
            say!("memprof: could not inspect pid {pid}: {err:#}; no inspection in the report");
            None
        }
    }
}
