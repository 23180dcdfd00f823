//! The processes one `attach` or `run` session traces: the target, and with `--follow-forks` the
//! children it forks (and theirs). Each keeps its own probes, leak history and double frees; an
//! exec re-probes a process for its new program; an exited child leaves its last report.

use std::{
    collections::{BTreeMap, HashSet},
    num::NonZeroU32,
};

use profiler_common::{process_event, DropReason, ProcessEvent};
use tokio::sync::mpsc;

use crate::{
    commands::target::ExitWatch,
    console::say,
    error::UserError,
    heap::leak::{LeakSettings, LeakTracker},
    heap::price::PriceWatch,
    heap::report::{Forks, Report},
    heap::sampling::{RateGuard, Sampling},
    heap::{
        blind_spots::BlindSpots,
        double_free::{DoubleFreeFilter, DoubleFrees},
        resident::Resident,
    },
    kernel::aggregate::monotonic_now_ns,
    kernel::events,
    kernel::loader::{Attachment, Loaded},
    kernel::shared::{self, file_ids, FileId},
    process::allocator::{self, Allocator},
    process::{go_program, procfs, usdt},
    symbolize::SymbolizerHandle,
};

/// Reports of exited children kept for the session's reports; more are only counted.
const KEPT_EXITED: usize = 100;

/// One traced process.
pub struct Process {
    pub pid: u32,
    /// The traced process that forked it.
    pub parent: Option<u32>,
    pub comm: String,
    /// Its pid in its own pid namespace, when that differs (see `Report::ns_pid`).
    pub ns_pid: Option<u32>,
    pub exe: String,
    /// When its probes were attached (`monotonic_now_ns`): its reports' times count from it.
    pub start_ns: u64,
    attachment: Attachment,
    /// The files whose allocator probes `attachment` holds. They stay through execs (a new
    /// program that maps one again is recorded from its first call) and are not attached twice.
    probed_files: HashSet<FileId>,
    /// The allocator probed; none between an exec and the new program mapping its allocator.
    allocator: Option<Allocator>,
    pub double_free_filter: Option<DoubleFreeFilter>,
    pub rate_guard: RateGuard,
    /// Until its price is said, after its first second traced.
    pub price: Option<PriceWatch>,
    pub leaks: LeakTracker,
    pub double_frees: DoubleFrees,
    /// What memprof does not see in it; none until its allocator is probed.
    pub blind_spots: Option<BlindSpots>,
    pub resident: Resident,
    /// `memprof run`'s command, whose exec into the command is prepared for before it happens.
    expect_exec: bool,
    /// Forked a child memprof does not trace since the last flush: the child has copies of this
    /// process's breakpoints until they are swept (`Loaded::sweep_copies`).
    forked_untraced: bool,
    /// Go's runtime sampler is attached beside its calls (a Go program with cgo): its probes go
    /// with the program at an exec.
    pub sampler_beside_calls: bool,
    /// A child found to have exec'd when it was followed, already handled: the exec event that
    /// may still come for it must not handle it again (detaching the probes its new program
    /// already runs under). Cleared at the next flush, by when such an event has come.
    exec_handled_early: bool,
    /// The program it was last said to run: a fast chain of execs (`env`, a shell's `exec`)
    /// is handled once the chain has ended, and each exec's handling finds the last program.
    said_exe: Option<String>,
    /// It exec'd valgrind: let go for good (see `on_exec`).
    under_valgrind: bool,
}

impl Process {
    /// `attachment` holds probes on `files` too (see `allocator::standby`).
    pub fn also_probed(&mut self, attachment: Attachment, files: &Allocator) {
        self.attachment.merge(attachment);
        self.probed_files.extend(file_ids(files));
    }

    /// A process whose probes are attached; `expect_exec` for `memprof run`'s command, not yet
    /// exec'd.
    pub fn new(
        pid: u32,
        comm: String,
        exe: Option<String>,
        attachment: Attachment,
        allocator: Allocator,
        settings: (Sampling, LeakSettings),
        expect_exec: bool,
    ) -> Self {
        let exe = exe.unwrap_or_default();
        // The price is that of tracing calls: no line for the modes that do not, nor for a
        // process with no allocator probed.
        let priced = settings.0.traces_calls() && !allocator.files.is_empty();
        let start_ns = monotonic_now_ns();
        Self {
            pid,
            parent: None,
            comm,
            ns_pid: procfs::ns_pid(pid),
            double_free_filter: Some(DoubleFreeFilter::new(&allocator, Some(&exe))),
            blind_spots: Some(if expect_exec {
                BlindSpots::after_exec(pid, &allocator)
            } else {
                BlindSpots::new(pid, &allocator, settings.0.growth)
            }),
            resident: Resident::default(),
            exe,
            attachment,
            probed_files: file_ids(&allocator),
            allocator: Some(allocator),
            // Its counts start now: its probes are attached.
            start_ns,
            rate_guard: RateGuard::starting(settings.0, start_ns),
            price: priced.then(|| PriceWatch::start(pid, None)).flatten(),
            leaks: LeakTracker::new(settings.1),
            double_frees: DoubleFrees::default(),
            expect_exec,
            forked_untraced: false,
            sampler_beside_calls: false,
            exec_handled_early: false,
            said_exe: None,
            under_valgrind: false,
        }
    }
}

/// How a process is traced, for the lines that say so: by `probes` in its allocator, or by the
/// `pages` it touches (`--growth`, or moved there), whose probes are page-fault events.
pub fn how_traced(pages: bool, probes: usize, allocator: &Allocator) -> String {
    if pages {
        "by the pages its heap first touches (--growth: no allocator probes)".to_string()
    } else {
        format!("with {probes} probes in {}", allocator.describe())
    }
}

/// Gives the symbolizer and the stack walk the mappings of `pid`, which now runs another program.
/// Read once, symbols first: a short-lived program may be gone a moment later. One that has
/// exited already (a zombie until reaped) lists no mappings: what the dynamic linker sent
/// meanwhile is all there is of it then, and forgetting it here left a whole report unnamed and
/// unwound (1 run in 60).
fn new_program_mappings(loaded: &mut Loaded, symbolizer: &SymbolizerHandle, pid: u32) {
    let before = loaded.before_mappings(pid);
    if let Some(mappings) = procfs::file_mappings(pid).ok().filter(|mappings| !mappings.is_empty()) {
        // Nothing of the program before the exec is kept.
        symbolizer.forget(pid);
        symbolizer.refresh_with(pid, mappings.clone());
        loaded.sync_mappings_with(pid, &mappings, before);
    }
}

pub struct Family {
    pub root: u32,
    processes: BTreeMap<u32, Process>,
    /// The last reports of exited children, in the order they exited.
    exited: Vec<Report>,
    forks: Forks,
    follow_forks: bool,
    settings: (Sampling, LeakSettings),
    /// Children that exited, or whose attach failed, whose map entries go at the next `flush`:
    /// one walk of the maps for all.
    gone: HashSet<u32>,
    /// Where each child's exit watcher sends its pid.
    exits: mpsc::UnboundedSender<u32>,
}

impl Family {
    pub fn new(
        root: Process,
        settings: (Sampling, LeakSettings),
        follow_forks: bool,
        exits: mpsc::UnboundedSender<u32>,
    ) -> Self {
        Self {
            root: root.pid,
            processes: BTreeMap::from([(root.pid, root)]),
            exited: Vec::new(),
            forks: Forks::default(),
            follow_forks,
            settings,
            gone: HashSet::new(),
            exits,
        }
    }

    pub fn pids(&self) -> HashSet<u32> {
        self.processes.keys().copied().collect()
    }

    pub fn get(&self, pid: u32) -> Option<&Process> {
        self.processes.get(&pid)
    }

    pub fn get_mut(&mut self, pid: u32) -> Option<&mut Process> {
        self.processes.get_mut(&pid)
    }

    pub fn processes(&self) -> impl Iterator<Item = &Process> {
        self.processes.values()
    }

    pub fn processes_mut(&mut self) -> impl Iterator<Item = &mut Process> {
        self.processes.values_mut()
    }

    /// The summary of following forks, for the root's report; none without `--follow-forks`.
    pub fn forks(&self, loaded: &Loaded) -> Option<Forks> {
        self.follow_forks.then(|| Forks { events_lost: loaded.tracked().1, ..self.forks })
    }

    pub fn exited_reports(&self) -> &[Report] {
        &self.exited
    }

    /// Handles the execs and forks the kernel reported, `events`.
    pub fn on_process_events(&mut self, loaded: &mut Loaded, symbolizer: &SymbolizerHandle, events: Vec<ProcessEvent>) {
        for event in events {
            tracing::debug!(?event, "process event");
            match event.kind {
                process_event::EXEC => self.on_exec(loaded, symbolizer, event.tgid, Some(&event)),
                process_event::FORK if self.follow_forks => {
                    self.on_fork(loaded, symbolizer, event.tgid, event.pid, Some(event.time_ns))
                }
                process_event::FORK => self.forked_untraced(event.tgid),
                process_event::PROBE_THREAD_EXIT => self.on_probe_thread_exit(loaded, &event),
                _ => {}
            }
        }
    }

    /// The thread a process's perf-event uprobes were opened on exited: they are opened again on
    /// a thread that stays, and the gap is said (see `probe_threads`).
    fn on_probe_thread_exit(&mut self, loaded: &mut Loaded, event: &ProcessEvent) {
        let (Some(process), Some(pid)) = (self.processes.get_mut(&event.tgid), NonZeroU32::new(event.tgid)) else {
            return;
        };
        let (tid, comm) = (event.pid, &process.comm);
        match loaded.probe_thread_exited(pid, tid, event.time_ns, &mut process.attachment) {
            None => {}
            Some(Ok(moved)) => say!(
                "memprof: pid {pid} ({comm}): thread {tid}, which its probes were opened on, exited; they are open again on thread {}: its calls in the {:.1} ms between were not seen (dropped: {})",
                moved.thread,
                moved.gap_ns as f64 / 1e6,
                DropReason::ProbeThreadExited.name()
            ),
            Some(Err(err)) => say!(
                "memprof: pid {pid} ({comm}): thread {tid}, which its probes were opened on, exited, and they could not be opened again: its calls are not seen from then on (dropped: {}): {err:#}",
                DropReason::ProbeThreadExited.name()
            ),
        }
    }

    /// The process runs another program (`exec`, its event; none for an exec found late): what
    /// was known of the old one goes but its double frees, facts of the process, and the new one
    /// is probed in its own allocator. Calls are
    /// traced through the exec: the probes stay, and those on files the new program maps again
    /// (the C library, a preloaded allocator `run` probed beforehand) record it from its first
    /// call, with nothing lost in between.
    fn on_exec(&mut self, loaded: &mut Loaded, symbolizer: &SymbolizerHandle, pid: u32, exec: Option<&ProcessEvent>) {
        let traced_by_calls = self.traced_by_calls(loaded, pid);
        let Some(process) = self.processes.get_mut(&pid).filter(|process| !process.under_valgrind) else { return };
        if let Some(valgrind) = allocator::valgrind_of(pid, exec.and_then(|exec| events::exec_path(pid, exec))) {
            // valgrind reads the code of the program it runs: a breakpoint of memprof's there,
            // kept through the exec, would stop it with SIGTRAP. Its probes go at once, from its
            // launcher on, before valgrind runs that code; `allocator::find` refuses its tool.
            loaded.detach(std::mem::take(&mut process.attachment));
            process.probed_files.clear();
            process.allocator = None;
            process.under_valgrind = true;
            say!("memprof: pid {pid} runs valgrind ({valgrind}): no longer traced (memprof's breakpoints would stop its program)");
            return;
        }
        if let Some(exec) = exec {
            loaded.exec_seen(pid, exec.time_ns);
        }
        if std::mem::take(&mut process.expect_exec) {
            // `memprof run`'s command is in its own program now, probed since before its exec:
            // its executable and dynamic linker get their tables and symbols (its libraries, when
            // the dynamic linker reports them).
            new_program_mappings(loaded, symbolizer, pid);
            return;
        }
        if std::mem::take(&mut process.exec_handled_early) {
            return;
        }
        let Some(nonzero) = NonZeroU32::new(pid) else { return };
        match exec {
            // Probes that followed the task the exec ended (another thread exec'd) no longer fire.
            Some(exec) if traced_by_calls && !exec.exec_by_other_thread() && !process.sampler_beside_calls => {
                // Mappings first: until they are written, each of its walks is deferred.
                new_program_mappings(loaded, symbolizer, pid);
                loaded.image_replaced(nonzero, exec);
            }
            _ => {
                let old = std::mem::take(&mut process.attachment);
                process.attachment = match exec {
                    Some(exec) => loaded.exec_happened(nonzero, old, exec),
                    None => loaded.restart(nonzero, old),
                };
                process.probed_files.clear();
                process.sampler_beside_calls = false;
                symbolizer.forget(pid);
                symbolizer.refresh(pid);
            }
        }
        process.allocator = None;
        process.double_free_filter = None;
        process.comm = procfs::comm(pid).or_else(|| exec.and_then(events::exec_comm)).unwrap_or_default();
        // The path the exec ran, for a program gone already (its mappings then come from the
        // list its dynamic linker sent, which names every file but the executable).
        let ran = || exec.and_then(|exec| events::exec_path(pid, exec)).map(|path| path.display().to_string());
        process.exe = procfs::exe_path(pid).or_else(ran).unwrap_or_default();
        process.leaks = LeakTracker::new(self.settings.1);
        process.rate_guard = RateGuard::new(self.settings.0);
        self.probe(loaded, pid);
    }

    /// Attaches the allocator probes of `pid` if it has none and its allocator is mapped now.
    pub fn probe(&mut self, loaded: &mut Loaded, pid: u32) {
        let traced_by_calls = self.traced_by_calls(loaded, pid);
        let Some(process) = self.processes.get_mut(&pid) else { return };
        if process.allocator.is_some() || process.under_valgrind {
            return;
        }
        let (Ok(mut allocator), Some(nonzero)) = (allocator::find(pid), NonZeroU32::new(pid)) else { return };
        // The files it maps whose probes it kept through its exec are not probed twice.
        let missing = shared::unprobed(&allocator, &process.probed_files);
        // With --usdt, the new program's own probes, and none of its allocator's.
        let attached = if self.settings.0.usdt {
            usdt::in_process(pid).map_err(anyhow::Error::from).and_then(|sites| {
                allocator.seen_through(&sites);
                loaded.attach_usdt(&sites, nonzero, None)
            })
        } else if missing.files.is_empty() && !allocator.files.is_empty() {
            Ok(Attachment::default())
        } else {
            loaded.attach_allocator(&missing, nonzero)
        };
        match attached {
            Ok(probes) => {
                process.attachment.merge(probes);
                process.probed_files.extend(file_ids(&missing));
                // Its pages show Go's heap too.
                let beside = traced_by_calls
                    .then(|| go_program::sampler_beside_calls(&mut allocator, || usdt::in_process(pid)))
                    .flatten();
                process.sampler_beside_calls =
                    attach_beside_calls(beside, &mut allocator, loaded, nonzero, &mut process.attachment);
                if let Some(sample_bytes) = process.rate_guard.initial() {
                    if let Err(err) = loaded.sample(pid, sample_bytes) {
                        tracing::warn!(pid, "sampling: {err:#}");
                    }
                }
                if let Some(exe) = procfs::exe_path(pid) {
                    process.exe = exe;
                }
                process.double_free_filter = Some(DoubleFreeFilter::new(&allocator, Some(&process.exe)));
                process.blind_spots = Some(BlindSpots::after_exec(pid, &allocator));
                if process.said_exe.as_ref() != Some(&process.exe) {
                    say!(
                        "memprof: pid {pid} ({}) runs {}: tracing it {}",
                        process.comm,
                        process.exe,
                        how_traced(loaded.traces_pages(pid), process.attachment.probes(), &allocator)
                    );
                    process.said_exe = Some(process.exe.clone());
                }
                process.allocator = Some(allocator);
            }
            Err(err) => tracing::debug!(pid, "probing the allocator: {err:#}"),
        }
    }

    /// Traces `pid` by the pages it touches from now on, not its calls (see
    /// `Loaded::switch_to_pages`): what its calls hold goes, the double frees they found stay,
    /// and it stays so through an exec.
    pub fn switch_to_pages(&mut self, loaded: &mut Loaded, pid: u32) -> anyhow::Result<()> {
        let (Some(process), Some(nonzero)) = (self.processes.get_mut(&pid), NonZeroU32::new(pid)) else {
            return Ok(());
        };
        loaded.switch_to_pages(nonzero, &mut process.attachment)?;
        process.probed_files.clear();
        process.sampler_beside_calls = false;
        process.leaks = LeakTracker::new(self.settings.1);
        if let Some(spots) = &process.blind_spots {
            spots.pages_from_now(pid);
        }
        Ok(())
    }

    /// Whether `pid` is traced by its allocator calls now: not in growth or usdt mode, nor moved
    /// to its pages.
    fn traced_by_calls(&self, loaded: &Loaded, pid: u32) -> bool {
        self.settings.0.traces_calls() && !loaded.traces_pages(pid)
    }

    /// Probes every process still waiting for its allocator (after an exec).
    pub fn probe_waiting(&mut self, loaded: &mut Loaded) {
        let waiting: Vec<u32> = self.processes.values().filter(|p| p.allocator.is_none()).map(|p| p.pid).collect();
        for pid in waiting {
            self.probe(loaded, pid);
        }
    }

    /// A traced process forked (at `forked_ns`; None: a child it had at attach): the child is
    /// traced from now on. Its blocks copied from the parent
    /// were never allocated in it, so their frees are unknown frees, never the parent's.
    fn on_fork(
        &mut self,
        loaded: &mut Loaded,
        symbolizer: &SymbolizerHandle,
        parent: u32,
        child: u32,
        forked_ns: Option<u64>,
    ) {
        // Followed already: a child forked while the existing ones were being adopted is both
        // listed and reported by the kernel.
        if self.processes.contains_key(&child) {
            return;
        }
        let Some(parent_process) = self.processes.get(&parent) else { return };
        let Some(pid) = NonZeroU32::new(child) else { return };
        // Opened before attaching: a child gone in between is then known gone, not missed silently.
        let watch = match ExitWatch::attached(child) {
            Ok(watch) => watch,
            Err(err) => {
                tracing::debug!(child, "not followed, gone: {err}");
                self.forks.missed += 1;
                return;
            }
        };
        if allocator::refuse_valgrind(child).is_err() {
            // It exec'd valgrind before memprof heard of its fork (see `on_exec`).
            self.forked_into_valgrind(parent, child);
            return;
        }
        // Read before attaching, which takes milliseconds a short-lived child (a database
        // session) may not outlive. Until it execs, a child has its parent's name and mappings:
        // those serve when the child's cannot be read any more.
        let comm = procfs::comm(child).unwrap_or_else(|| parent_process.comm.clone());
        // Read once for the symbolizer, the unwind tables and the dynamic linker's hook.
        let mappings = procfs::file_mappings(child).unwrap_or_default();
        symbolizer.inherit(parent, child, mappings.clone());
        // The child maps its parent's files (its /proc maps may not show them yet): the parent's
        // allocator, unless the child exec'd already (checked below).
        let parent_exe = parent_process.exe.clone();
        let inherited = parent_process.allocator.clone();
        let allocator = match inherited.map(Ok).unwrap_or_else(|| allocator::find(child)) {
            Ok(allocator) => allocator,
            Err(err) => {
                tracing::debug!(child, "not followed: {err}");
                self.forks.missed += 1;
                self.forked_untraced(parent);
                return;
            }
        };
        let attachment = match loaded.attach_child(&allocator, pid, &mappings) {
            Ok(attachment) => attachment,
            Err(err) if matches!(err.downcast_ref::<UserError>(), Some(UserError::UnderValgrind(_))) => {
                // It exec'd valgrind while it was being attached.
                self.forked_into_valgrind(parent, child);
                self.gone.insert(child);
                return;
            }
            Err(err) => {
                tracing::debug!(child, "not followed: {err:#}");
                self.forks.missed += 1;
                self.forked_untraced(parent);
                self.gone.insert(child);
                return;
            }
        };
        self.forks.followed += 1;
        if let Some(forked_ns) = forked_ns {
            let unseen_ns = monotonic_now_ns().saturating_sub(forked_ns);
            self.forks.unseen_after_fork_ns = self.forks.unseen_after_fork_ns.max(unseen_ns);
        }
        say!(
            "memprof: tracing pid {child} ({comm}), child of pid {parent}, {}",
            how_traced(loaded.traces_pages(child), attachment.probes(), &allocator)
        );
        let exe_now = procfs::exe_path(child);
        let exe = exe_now.clone().unwrap_or_else(|| parent_exe.clone());
        let mut process = Process::new(child, comm, Some(exe), attachment, allocator, self.settings, false);
        process.parent = Some(parent);
        if let Some(sample_bytes) = process.rate_guard.initial() {
            if let Err(err) = loaded.sample(child, sample_bytes) {
                tracing::warn!(child, "sampling: {err:#}");
            }
        }
        self.processes.insert(child, process);
        // A child that exec'd before it was tracked (vfork and exec) reported no exec event. (One
        // still inside execve reports it: its exec tracepoint fires once the new program is in.)
        if exe_now.is_some_and(|exe| exe != parent_exe) {
            self.on_exec(loaded, symbolizer, child, None);
            if let Some(process) = self.processes.get_mut(&child) {
                process.exec_handled_early = true;
            }
        }
        let exits = self.exits.clone();
        tokio::spawn(async move {
            let mut watch = watch;
            watch.exited().await;
            let _ = exits.send(child);
        });
    }

    /// Follows the descendants the root had when it was attached to, parents before their
    /// children, as if each had just forked: their allocations before now are unknown, as the
    /// root's are. One line says so when they cannot be listed.
    pub fn adopt_existing_children(&mut self, loaded: &mut Loaded, symbolizer: &SymbolizerHandle) {
        let mut parents = vec![self.root];
        while let Some(parent) = parents.pop() {
            let children = match procfs::children(parent) {
                Ok(children) => children,
                Err(err) => {
                    say!("memprof: the children pid {parent} has now cannot be listed ({err}): they are not traced; only those it forks from now on are");
                    continue;
                }
            };
            for child in children {
                if self.processes.contains_key(&child) {
                    continue;
                }
                self.on_fork(loaded, symbolizer, parent, child, None);
                if self.processes.contains_key(&child) {
                    self.forks.at_attach += 1;
                    parents.push(child);
                }
            }
        }
    }

    /// Detaches an exited child's probes in the background, before its last report is read: a
    /// link left on a process gone is one more that the kernel calls at each trap in the file's
    /// other processes (BENCHMARKS.md: the last reports of children that exit within 250 ms).
    pub fn detach_exited(&mut self, loaded: &mut Loaded, pid: u32) {
        if let Some(process) = self.processes.get_mut(&pid) {
            loaded.detach_in_background(std::mem::take(&mut process.attachment));
        }
    }

    /// A child exited: `last` is its final report. What is left of its probes is detached in the
    /// background and its map entries purged at the next `flush`.
    pub fn on_child_exit(&mut self, loaded: &mut Loaded, pid: u32, last: Option<Report>) {
        let Some(process) = self.processes.remove(&pid) else { return };
        if process.allocator.is_none() && process.parent.is_some() {
            // Gone before its program was probed: not followed after all.
            self.forks.followed = self.forks.followed.saturating_sub(1);
            self.forks.missed += 1;
        }
        match last {
            Some(report) if self.exited.len() < KEPT_EXITED => self.exited.push(report),
            _ => self.forks.exited_not_listed += 1,
        }
        loaded.detach_in_background(process.attachment);
        self.gone.insert(pid);
    }

    /// `parent`'s child runs valgrind: not traced, and said so.
    fn forked_into_valgrind(&mut self, parent: u32, child: u32) {
        let valgrind = allocator::valgrind_of(child, None).unwrap_or_else(|| "valgrind".into());
        say!("memprof: pid {child}, child of pid {parent}, runs valgrind ({valgrind}): not traced (memprof's breakpoints would stop its program)");
        self.forked_untraced(parent);
    }

    fn forked_untraced(&mut self, parent: u32) {
        if let Some(process) = self.processes.get_mut(&parent) {
            process.forked_untraced = true;
        }
    }

    /// Purges the maps of the children that exited since the last flush, in one walk; takes the
    /// breakpoints out of the children that are not traced.
    pub fn flush(&mut self, loaded: &mut Loaded) {
        for process in self.processes.values_mut() {
            process.exec_handled_early = false;
        }
        let forked = self.processes.values_mut().filter_map(|process| {
            let forked = std::mem::take(&mut process.forked_untraced);
            let process: &Process = process;
            forked.then_some((&process.attachment, NonZeroU32::new(process.pid)?))
        });
        loaded.sweep_copies(forked);
        if !self.gone.is_empty() {
            loaded.forget_exited(&std::mem::take(&mut self.gone));
        }
    }

    /// Detaches every probe (see `Loaded::leave_detached`); the maps go with the programs.
    pub fn finish(self, loaded: &mut Loaded) {
        for process in self.processes.into_values() {
            loaded.detach_in_background(process.attachment);
        }
        loaded.leave_detached();
    }
}

/// Attaches `sites`, Go's runtime sampler in a Go program with cgo (see
/// `go_program::sampler_beside_calls`), to `attachment` beside its calls, its Go heap then no
/// blind spot of `allocator`; returns whether it did. One that fails leaves it traced by its
/// calls alone, and says so.
pub fn attach_beside_calls(
    sites: Option<Vec<usdt::Site>>,
    allocator: &mut Allocator,
    loaded: &mut Loaded,
    pid: NonZeroU32,
    attachment: &mut Attachment,
) -> bool {
    let Some(sites) = sites else { return false };
    let attached = loaded.attach_beside_calls(&sites, pid, allocator, attachment);
    match &attached {
        Ok(()) => say!("memprof: pid {pid} is a Go program with cgo: reading its Go heap through its runtime's own sampler, beside its calls"),
        Err(err) => say!("memprof: pid {pid}'s Go heap stays unseen: attaching its runtime's sampler: {err:#}"),
    }
    attached.is_ok()
}
