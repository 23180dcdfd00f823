//! The tracer thread: attaches to the processes the rules match, detaches from those that exit,
//! and publishes a `DaemonView` every interval. Everything here blocks (BPF syscalls, detaching,
//! far slower with perf-event uprobes: docs: reference/limits.md#detaching), so it runs on a thread of its own, not on
//! the async runtime.

use std::{
    cmp::Reverse,
    collections::{HashMap, HashSet},
    num::NonZeroU32,
    os::fd::AsFd,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, RwLock,
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::Context as _;
use profiler_common::{discover, process_event, DropReason, ProcessEvent};
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use super::{
    config::Config,
    discovery::{self, ProcessId},
    heavy::Built,
    settled,
    slots::Slots,
    view::{DaemonView, MapUse, StackSeries, TargetView},
    wakeup::{Inbox, Woken},
};
use crate::{
    format,
    heap::heuristics::Heuristics,
    heap::inspect,
    heap::known_stacks::KnownStacks,
    heap::leak::LeakTracker,
    heap::report::{self, DoubleFreeReport, Report, Selection, StackReport},
    heap::sampling::RateGuard,
    heap::{
        blind_spots::BlindSpots,
        double_free::DoubleFreeFilter,
        resident::{HeapNow, PinnedBudget, Resident},
    },
    kernel::aggregate::{self, DoubleFreeReader, KernelSnapshot, Snapshot},
    kernel::loader::{self, Attachment, Loaded},
    kernel::settings::LoadSettings,
    kernel::shared::{self, file_ids, FileId, ProbeLinks},
    process::allocator,
    process::{procfs, usdt},
    symbolize::SymbolizerHandle,
    text,
    unwind::TableUse,
};

/// How soon a target that came or went is shown: not at once for each, so that a thousand
/// processes started together are not a thousand snapshots.
const CHANGE_SHOWN: Duration = Duration::from_millis(200);
/// The first wait before a new process that cannot be attached yet is tried again (caught between
/// its exec and its dynamic linker mapping its allocator), doubled at each try.
const FIRST_RETRY: Duration = Duration::from_millis(5);
/// How long after a traced process's main thread exited it is looked for gone, each
/// `FIRST_RETRY`: it is gone moments after its exit event; one whose other threads run on is
/// checked each interval.
const EXIT_WATCH: Duration = Duration::from_secs(1);
/// How long a new process that cannot be attached to is tried again.
const GRACE_SECONDS: f64 = 5.0;
/// Double frees kept per process for its report; more are counted only.
const KEPT_DOUBLE_FREES: usize = 100;

pub enum Command {
    Reload(Box<Config>),
    /// Inspect a traced process now (`/api/v1/inspect`): its view with the inspection in its
    /// report, or why not.
    Inspect {
        pid: u32,
        heuristics: Heuristics,
        reply: oneshot::Sender<Result<TargetView, InspectFailure>>,
    },
    Shutdown,
}

#[derive(Debug, thiserror::Error)]
pub enum InspectFailure {
    #[error("pid {0} is not traced; /api/v1/targets lists those that are")]
    NotTraced(u32),
    #[error("inspecting pid {pid} failed: {why}")]
    Failed { pid: u32, why: String },
}

struct Target {
    id: ProcessId,
    comm: String,
    /// Its executable (`/proc/PID/exe`), the new program's after an exec.
    exe: Option<String>,
    /// Its cgroup in the unified hierarchy, read at attach and at each exec (a container's or a
    /// service's processes stay in theirs).
    cgroup: Option<String>,
    /// Its pid in its own pid namespace, when that is not ours.
    ns_pid: Option<u32>,
    attachment: Attachment,
    double_free_filter: DoubleFreeFilter,
    blind_spots: BlindSpots,
    resident: Resident,
    attached_at: SystemTime,
    /// CLOCK_MONOTONIC at attach, for the report's times.
    start_ns: u64,
    double_frees: Vec<DoubleFreeReport>,
    double_free_count: u64,
    leaks: LeakTracker,
    /// `--max-rate`: switches the process to sampling when it calls the allocator too often.
    rate_guard: RateGuard,
    /// Its allocator is probed: not between an exec and the new program mapping its allocator.
    probed: bool,
    /// The files whose allocator probes `attachment` holds. They stay through an exec (the new
    /// program is recorded from its first call through a file both map, the C library) and are
    /// not attached twice. Empty when it is not traced by its calls.
    probed_files: HashSet<FileId>,
    /// Its stacks symbolized already.
    known_stacks: KnownStacks,
    /// The calls its probes had counted at the last interval (`calls_counted`).
    calls: u64,
    /// Its walks cut at a frame in no listed file (`unwind_no_table`), at the last interval; and
    /// whether that count grew since its mappings were last read. They are read again at the next
    /// scan of /proc: code a loader of its own maps moves no count the walk trusts (see
    /// `unwind::Registry::code_changes`), and nothing else would have them read.
    cut_walks: u64,
    cut_since_read: bool,
    /// The view published last, and the pinned pages' `Resident::pinned_changes` it shows.
    last_view: Option<(Arc<TargetView>, u64)>,
}

pub struct Tracer {
    config: Config,
    /// The map sizes the programs were loaded with; a reload cannot change them.
    loaded_sizes: LoadSettings,
    loaded: Loaded,
    symbolizer: SymbolizerHandle,
    double_free_reader: DoubleFreeReader,
    targets: HashMap<u32, Target>,
    /// Processes not to try again: no allocator, or attaching failed.
    unattachable: HashSet<ProcessId>,
    /// Processes refused for the cap, each counted once in `refused_total`.
    refused: HashSet<ProcessId>,
    refused_total: u64,
    children_followed: u64,
    children_missed: u64,
    /// Children that matched at their fork but could not be attached then (dying, or caught
    /// mid-exec): followed if a later attempt attaches them, missed once they are gone.
    pending_children: HashSet<ProcessId>,
    /// New matching processes not attachable yet, with their command name, when to try again
    /// and the wait after that.
    starting: HashMap<ProcessId, (String, Instant, Duration)>,
    /// Targets whose main thread exited, watched until gone.
    exiting: HashMap<u32, Instant>,
    /// Targets whose main thread exited while others run on: looked for gone each interval,
    /// since the exit of their last thread is not reported.
    leaderless: HashSet<u32>,
    /// When /proc is next scanned (`Config::resync`), and the scans so far.
    next_resync: Instant,
    scans: u64,
    view: Arc<RwLock<DaemonView>>,
    pinned_budget: PinnedBudget,
    /// The files whose links were shared when the untraced processes mapping them were counted,
    /// that count, and when to count again.
    sharing: (HashSet<FileId>, u64, Instant),
    /// Cleared when the tracer stops, for whatever reason: the daemon is then unhealthy.
    alive: Arc<AtomicBool>,
    /// The series' `slot` label of each target (see `slots`).
    slots: Slots,
}

impl Tracer {
    pub fn new(config: Config, view: Arc<RwLock<DaemonView>>, alive: Arc<AtomicBool>) -> anyhow::Result<Self> {
        loader::check_support()?;
        let mut loaded = loader::load(config.maps, config.interval, config.sampling.usdt)?;
        // The rules decide which children are traced (`on_fork`).
        loaded.follow_forks = true;
        if config.sampling.growth {
            loaded.trace_page_faults()?;
        }
        // Rules match any number of processes: by default links of their own while few map a
        // file, one set per file past that (docs: internals/probes.md#probes-and-detaching).
        loaded.set_probe_links(config.probe_links);
        loaded.discover(discover_flags(&config))?;
        if config.probe_links == ProbeLinks::Shared {
            info!(
                "--probe-links shared: every process that maps a traced process's allocator or dynamic linker \
                 gets memprof's breakpoints, traced or not"
            );
        }
        let double_free_reader = DoubleFreeReader::new(&mut loaded.ebpf)?;
        alive.store(true, Ordering::Relaxed);
        Ok(Self {
            loaded_sizes: config.maps,
            config,
            loaded,
            symbolizer: SymbolizerHandle::spawn(),
            double_free_reader,
            targets: HashMap::new(),
            unattachable: HashSet::new(),
            refused: HashSet::new(),
            refused_total: 0,
            children_followed: 0,
            children_missed: 0,
            pending_children: HashSet::new(),
            starting: HashMap::new(),
            exiting: HashMap::new(),
            leaderless: HashSet::new(),
            next_resync: Instant::now(),
            scans: 0,
            view,
            pinned_budget: PinnedBudget::default(),
            sharing: (HashSet::new(), 0, Instant::now()),
            slots: Slots::default(),
            alive,
        })
    }

    /// Runs until `Shutdown` (or the sender is dropped), then detaches every probe.
    pub fn run(mut self, commands: Inbox<Command>) {
        let mut next_snapshot = Instant::now();
        loop {
            let now = Instant::now();
            let mut changed = false;
            if now >= self.next_resync {
                changed |= self.resync();
                self.next_resync = now + Duration::from_secs_f64(self.config.resync);
            }
            // Before the execs, used after them (see `UnwindEvents::collect`).
            self.loaded.unwind_events.collect();
            changed |= self.on_process_events();
            changed |= self.retry();
            if changed {
                next_snapshot = next_snapshot.min(now + CHANGE_SHOWN);
            }
            if now >= next_snapshot {
                if let Err(err) = self.publish() {
                    warn!("reading the kernel maps failed: {err:#}");
                }
                next_snapshot = now + Duration::from_secs_f64(self.config.interval);
            }
            for pid in self.loaded.sync_changed_mappings() {
                self.mappings_read(pid);
            }
            // Every ring is read before the wait, which would otherwise end at once.
            self.collect_double_frees();
            let mut until = self.next_resync.min(next_snapshot);
            if !self.starting.is_empty() || !self.exiting.is_empty() {
                until = until.min(self.next_retry());
            }
            // Woken by the kernel's rings: a library a process loads gets its table within
            // milliseconds, a new process is attached as it starts.
            let rings = [
                self.loaded.process_events.ring().as_fd(),
                self.loaded.unwind_events.bell(),
                self.double_free_reader.ring().as_fd(),
            ];
            match commands.wait(&rings, until.saturating_duration_since(Instant::now())) {
                Woken::Command(Command::Reload(config)) => self.reload(*config),
                Woken::Command(Command::Inspect { pid, heuristics, reply }) => {
                    // Nobody waits for the answer any more when the client has gone.
                    let _ = reply.send(self.inspect(pid, heuristics));
                }
                Woken::Command(Command::Shutdown) | Woken::Disconnected => break,
                Woken::Other => {}
            }
        }
        // Every target at once: their links, closed together, share the kernel's grace periods.
        // Nothing is purged, since the maps go with the programs.
        for (_, target) in self.targets.drain() {
            self.loaded.detach_in_background(target.attachment);
        }
        self.loaded.wait_detached();
    }

    fn reload(&mut self, mut config: Config) {
        if config.sampling.usdt != self.config.sampling.usdt {
            // The weights' table was sized for the mode loaded (see `loader::load`).
            warn!("usdt takes effect at the next start, not on reload: the sampling settings stay as they were");
            config.sampling = self.config.sampling;
        }
        if config.listen != self.config.listen
            || config.maps != self.loaded_sizes
            || config.probe_links != self.config.probe_links
        {
            warn!("listen address, map sizes and probe links take effect at the next start, not on reload");
        }
        if let Err(err) = self.loaded.discover(discover_flags(&config)) {
            warn!("new processes are found at the next scan of /proc only: {err:#}");
        }
        self.config = config;
        // The rules may have changed: the processes they match now are found at once.
        self.next_resync = Instant::now();
        info!("configuration reloaded");
    }

    /// Scans /proc: detaches from processes that exited or no longer match; attaches to new
    /// matches. Returns whether the set of targets changed.
    fn resync(&mut self) -> bool {
        self.scans += 1;
        // Processes that map a shared-linked file started or ended since the last count.
        self.sharing.2 = Instant::now();
        let matches = discovery::scan(&self.config.rules);
        let wanted: HashSet<ProcessId> = matches.iter().map(|(id, _)| *id).collect();
        let gone: Vec<u32> = self.targets.values().filter(|t| !wanted.contains(&t.id)).map(|t| t.id.pid).collect();
        let mut changed = !gone.is_empty();
        if changed {
            // A process that aborted on a double free is gone by now: read its last events first.
            self.collect_double_frees();
        }
        for pid in gone {
            self.detach(pid);
        }
        self.unattachable.retain(|id| wanted.contains(id));
        self.refused.retain(|id| wanted.contains(id));
        let new = matches.iter().filter(|(id, _)| self.targets.get(&id.pid).is_none_or(|t| t.id != *id)).count();
        self.loaded.attaching(new);
        for (id, comm) in matches {
            changed |= self.consider(id, comm);
        }
        self.loaded.attaching(0);
        self.settle_pending_children();
        let mut newly_mapped = Vec::new();
        for target in self.targets.values_mut().filter(|target| target.cut_since_read) {
            target.cut_since_read = false;
            // Most such cuts are code built at run time, in no file: nothing new to learn then.
            if self.loaded.sync_mappings(target.id.pid) {
                newly_mapped.push(target.id.pid);
            }
        }
        for pid in newly_mapped {
            self.mappings_read(pid);
        }
        changed
    }

    /// `pid`'s mappings were read again: its stacks are named anew, and its new files are
    /// probed if they hold its allocator, or said if they hold what memprof cannot see.
    fn mappings_read(&mut self, pid: u32) {
        if let Some(target) = self.targets.get_mut(&pid) {
            target.cut_since_read = false;
            target.known_stacks.forget();
            if target.probed {
                for spot in target.blind_spots.learn_new_files(pid) {
                    info!(pid, comm = target.comm, what = spot.what, "not seen");
                }
            }
        }
        self.probe(pid);
        self.symbolizer.refresh(pid);
    }

    /// Counts each pending child once its fate is known: attached since, or gone.
    fn settle_pending_children(&mut self) {
        let (mut followed, mut missed) = (0, 0);
        self.pending_children.retain(|id| {
            if self.targets.get(&id.pid).is_some_and(|target| target.id == *id) {
                followed += 1;
                false
            } else if ProcessId::current(id.pid) != Some(*id) {
                missed += 1;
                false
            } else {
                true
            }
        });
        self.children_followed += followed;
        self.children_missed += missed;
    }

    /// Attaches to a matching process unless it is traced already, cannot be, or would be one
    /// too many; returns whether it was attached.
    fn consider(&mut self, id: ProcessId, comm: String) -> bool {
        if let Some(target) = self.targets.get_mut(&id.pid).filter(|t| t.id == id) {
            // The scan read its name: a program may rename itself.
            target.comm = comm;
            return false;
        }
        if self.unattachable.contains(&id) {
            return false;
        }
        if self.targets.len() >= self.config.max_targets {
            if self.refused.insert(id) {
                self.refused_total += 1;
                warn!(
                    pid = id.pid,
                    comm,
                    "not traced: {} processes are traced already, as many as --max-targets (max_targets) allows; \
                     raise it (docs: daemon/index.md#daemon-mode gives what each target costs) or narrow the rules",
                    self.targets.len()
                );
            }
            return false;
        }
        match self.attach(id, comm) {
            Ok(()) => true,
            // A process caught between exec and the dynamic loader mapping its C library has
            // no allocator yet: only give up on processes old enough to have one.
            Err(err) if id.age_seconds() < GRACE_SECONDS => {
                debug!(pid = id.pid, "not traced yet: {err:#}");
                false
            }
            Err(err) => {
                debug!(pid = id.pid, "not traced: {err:#}");
                self.unattachable.insert(id);
                false
            }
        }
    }

    /// Execs, forks and exits: an exec re-probes a target for its new program; a target's child
    /// that matches the rules is attached at once, as is any other new process that does (from
    /// its exec, or its fork when the rules name cgroups); a target whose main thread exited is
    /// let go once gone. Returns whether the set of targets changed.
    fn on_process_events(&mut self) -> bool {
        let mut changed = false;
        for event in self.loaded.process_events.drain() {
            let traced = self.targets.contains_key(&event.tgid);
            match event.kind {
                process_event::EXEC if traced => self.on_exec(&event),
                process_event::EXEC => changed |= self.found(event.tgid),
                process_event::FORK if traced => self.on_fork(event.tgid, event.child),
                process_event::FORK => changed |= self.found(event.child),
                process_event::EXIT if traced => {
                    self.exiting.insert(event.tgid, Instant::now() + EXIT_WATCH);
                }
                _ => {}
            }
        }
        changed
    }

    /// A process that exec'd or started: attached if the rules match it.
    fn found(&mut self, pid: u32) -> bool {
        match discovery::matching(&self.config.rules, pid) {
            Some((id, comm)) => self.try_attach(id, comm),
            None => false,
        }
    }

    /// `consider`, and when the process cannot be attached yet, a later try (see `retry`).
    fn try_attach(&mut self, id: ProcessId, comm: String) -> bool {
        if self.consider(id, comm.clone()) {
            return true;
        }
        let waits = self.targets.get(&id.pid).is_none_or(|t| t.id != id)
            && !self.unattachable.contains(&id)
            && !self.refused.contains(&id);
        if waits {
            self.starting.entry(id).or_insert((comm, Instant::now() + FIRST_RETRY, FIRST_RETRY * 2));
        }
        false
    }

    /// When a starting process or an exiting target is next looked at.
    fn next_retry(&self) -> Instant {
        let starting = self.starting.values().map(|&(_, at, _)| at);
        let exiting = self.exiting.values().map(|&until| until.min(Instant::now() + FIRST_RETRY));
        starting.chain(exiting).min().unwrap_or_else(Instant::now)
    }

    /// Tries again the starting processes due, and lets go of the exiting targets now gone.
    /// Returns whether the set of targets changed.
    fn retry(&mut self) -> bool {
        let now = Instant::now();
        let mut changed = false;
        let due: Vec<ProcessId> =
            self.starting.iter().filter(|(_, &(_, at, _))| at <= now).map(|(id, _)| *id).collect();
        for id in due {
            let Some((comm, _, wait)) = self.starting.remove(&id) else { continue };
            if ProcessId::current(id.pid) != Some(id) {
                continue;
            }
            if self.consider(id, comm.clone()) {
                changed = true;
            } else if !self.unattachable.contains(&id) && !self.refused.contains(&id) {
                self.starting.insert(id, (comm, now + wait, wait * 2));
            }
        }
        let exiting: Vec<(u32, Instant)> = self.exiting.iter().map(|(&pid, &until)| (pid, until)).collect();
        for (pid, until) in exiting {
            let gone = self.targets.get(&pid).is_none_or(|t| ProcessId::current(pid) != Some(t.id));
            if gone && self.targets.contains_key(&pid) {
                // A process that aborted on a double free: its last events first.
                self.collect_double_frees();
                self.detach(pid);
                changed = true;
            }
            if gone || until <= now {
                self.exiting.remove(&pid);
            }
            if !gone && until <= now {
                self.leaderless.insert(pid);
            }
        }
        if changed {
            self.settle_pending_children();
        }
        changed
    }

    /// A target forked `child`: the child is counted once, followed or missed. One that matches
    /// waits in `pending_children` until it is attached or gone, whoever attaches it: this event,
    /// a later try, or discovery, which may have found it between its fork and this event.
    fn on_fork(&mut self, parent: u32, child: u32) {
        match discovery::matching(&self.config.rules, child) {
            Some((id, comm)) => {
                if self.targets.get(&child).is_none_or(|target| target.id != id) {
                    self.try_attach(id, comm);
                }
                self.pending_children.insert(id);
                self.settle_pending_children();
            }
            // Gone already: traced if discovery attached it in between (its target stays until
            // discovery sees it gone); otherwise whether it would have matched, only its comm
            // (its parent's) could tell.
            None if ProcessId::current(child).is_none() => {
                if self.targets.contains_key(&child) {
                    self.children_followed += 1;
                } else if self
                    .targets
                    .get(&parent)
                    .is_some_and(|t| self.config.rules.matches(child, &t.comm, &[]) || self.config.rules.needs_cgroup())
                {
                    self.children_missed += 1;
                }
            }
            // Runs, and does not match: not a child the rules follow.
            None => {}
        }
    }

    fn on_exec(&mut self, event: &ProcessEvent) {
        let pid = event.tgid;
        let Some(target) = self.targets.get(&pid) else { return };
        let Some(nonzero) = NonZeroU32::new(pid) else { return };
        let reused = match ProcessId::current(pid) {
            // The target exited and its pid went to a new process, which exec'd before discovery
            // saw the old one go: the kernel reported the exec since the pid was still traced.
            // The new process is traced from its exec on, if the rules want it, with nothing of
            // the old one's (the exec below drops the old stacks, counts and mappings).
            Some(now) if now != target.id => {
                if discovery::matching(&self.config.rules, pid).is_none() {
                    self.detach(pid);
                    return;
                }
                let target = self.targets.get_mut(&pid).expect("looked up above");
                info!(pid, old_comm = target.comm, "pid reused by a new process: tracing it afresh");
                target.id = now;
                target.attached_at = SystemTime::now();
                target.start_ns = aggregate::monotonic_now_ns();
                target.ns_pid = procfs::ns_pid(pid);
                true
            }
            // Gone already: its exit event detaches it.
            None => return,
            Some(_) => false,
        };
        let target = self.targets.get_mut(&pid).expect("looked up above");
        if reused || event.exec_by_other_thread() || target.probed_files.is_empty() {
            // Its probes no longer fire (they followed the task the exec ended), or they are not
            // allocator probes: attached anew once the new program maps its allocator.
            let old = std::mem::take(&mut target.attachment);
            target.attachment = self.loaded.exec_happened(nonzero, old, event);
            target.probed_files.clear();
        } else {
            // Its probes stay: what the old program left goes, what the new one recorded stays.
            // Mappings first: until they are written, each of its walks is deferred.
            self.loaded.sync_mappings(pid);
            self.loaded.image_replaced(nonzero, event);
        }
        target.probed = false;
        target.comm = procfs::comm(pid).unwrap_or_default();
        target.exe = procfs::exe_path(pid);
        target.cgroup = procfs::cgroup(pid);
        target.leaks = LeakTracker::new(self.config.leak);
        target.rate_guard = RateGuard::new(self.config.sampling);
        target.double_frees.clear();
        target.double_free_count = 0;
        target.known_stacks.forget();
        self.symbolizer.forget(pid);
        self.symbolizer.refresh(pid);
        info!(pid, comm = target.comm, "exec: tracing the new program");
        self.probe(pid);
    }

    /// Probes the allocator of a target that exec'd once its new program has mapped one.
    /// A process whose only allocator is a runtime's (a pure Go binary) is traced by what it maps
    /// or touches, when that is traced.
    fn runtime_only(&self) -> allocator::RuntimeOnly {
        allocator::RuntimeOnly::accepted_if(self.config.maps.mappings || self.config.sampling.growth)
    }

    fn probe(&mut self, pid: u32) {
        let runtime_only = self.runtime_only();
        let Some(target) = self.targets.get_mut(&pid) else { return };
        if target.probed {
            return;
        }
        let (Ok(allocator), Some(nonzero)) = (allocator::find_with(pid, runtime_only), NonZeroU32::new(pid)) else {
            return;
        };
        // The files whose probes it kept through its exec are not probed twice.
        let missing = shared::unprobed(&allocator, &target.probed_files);
        let attached = if self.config.sampling.usdt {
            usdt::in_process(pid)
                .map_err(anyhow::Error::from)
                .and_then(|sites| self.loaded.attach_usdt(&sites, nonzero, None))
        } else if missing.files.is_empty() && !allocator.files.is_empty() {
            Ok(Attachment::default())
        } else {
            self.loaded.attach_allocator(&missing, nonzero)
        };
        match attached {
            Ok(probes) => {
                target.attachment.merge(probes);
                if self.config.sampling.traces_calls() {
                    target.probed_files.extend(file_ids(&missing));
                }
                target.probed = true;
                target.double_free_filter = DoubleFreeFilter::new(&allocator, target.exe.as_deref());
                target.blind_spots = BlindSpots::new(pid, &allocator);
                if let Some(sample_bytes) = target.rate_guard.initial() {
                    if let Err(err) = self.loaded.sample(pid, sample_bytes) {
                        warn!(pid, "sampling: {err:#}");
                    }
                }
                info!(pid, comm = target.comm, probes = target.attachment.probes(), "tracing");
            }
            Err(err) => debug!(pid, "probing the allocator: {err:#}"),
        }
    }

    fn attach(&mut self, id: ProcessId, comm: String) -> anyhow::Result<()> {
        let allocator = allocator::find_with(id.pid, self.runtime_only())?;
        let pid = NonZeroU32::new(id.pid).context("pid 0")?;
        // With --usdt, the process's own otel_memory probes, and none of its allocator's.
        let attachment = if self.config.sampling.usdt {
            self.loaded.attach_usdt(&usdt::in_process(id.pid)?, pid, None)?
        } else {
            self.loaded.attach(&allocator, pid)?
        };
        let rate_guard = RateGuard::new(self.config.sampling);
        if let Some(sample_bytes) = rate_guard.initial() {
            self.loaded.sample(id.pid, sample_bytes)?;
        }
        self.symbolizer.refresh(id.pid);
        info!(pid = id.pid, comm, probes = attachment.probes(), "tracing");
        let exe = procfs::exe_path(id.pid);
        let target = Target {
            id,
            comm,
            ns_pid: procfs::ns_pid(id.pid),
            attachment,
            double_free_filter: DoubleFreeFilter::new(&allocator, exe.as_deref()),
            blind_spots: BlindSpots::new(id.pid, &allocator),
            resident: Resident::default(),
            exe,
            cgroup: procfs::cgroup(id.pid),
            attached_at: SystemTime::now(),
            start_ns: aggregate::monotonic_now_ns(),
            double_frees: Vec::new(),
            double_free_count: 0,
            leaks: LeakTracker::new(self.config.leak),
            rate_guard,
            probed: true,
            probed_files: if self.config.sampling.traces_calls() { file_ids(&allocator) } else { HashSet::new() },
            known_stacks: KnownStacks::default(),
            calls: 0,
            cut_walks: 0,
            cut_since_read: false,
            last_view: None,
        };
        self.targets.insert(id.pid, target);
        Ok(())
    }

    /// Detaches from `pid` and removes what the kernel and the symbolizer hold about it.
    fn detach(&mut self, pid: u32) {
        let Some(target) = self.targets.remove(&pid) else { return };
        if ProcessId::current(pid) == Some(target.id) {
            // Still running (the rules changed): its probes must be gone before its state is.
            self.loaded.detach(target.attachment);
        } else {
            // Exited: nothing fires any more, and discovery need not wait for the detach.
            self.loaded.detach_in_background(target.attachment);
        }
        self.loaded.forget_exited(&HashSet::from([pid]));
        self.symbolizer.forget(pid);
        info!(pid, comm = target.comm, "no longer traced");
    }

    fn stacks<'a>(&'a self, target: &'a Target) -> report::Stacks<'a> {
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
    fn collect_double_frees(&mut self) {
        for event in self.double_free_reader.drain() {
            let Some(target) = self.targets.get(&event.tgid) else { continue };
            let double_free = self.stacks(target).double_free(&event);
            if !target.double_free_filter.is_user(&double_free) {
                continue;
            }
            let site =
                |frames: &[crate::symbolize::Frame]| frames.first().map_or_else(|| "[no stack]".into(), format::site);
            warn!(
                pid = event.tgid,
                comm = target.comm,
                "double free of {} ({} bytes): allocated at {}, freed at {}, freed again at {}",
                double_free.address,
                double_free.size,
                site(&double_free.alloc.frames),
                site(&double_free.first_free.frames),
                site(&double_free.second_free.frames),
            );
            let Some(target) = self.targets.get_mut(&event.tgid) else { continue };
            target.double_free_count += 1;
            if target.double_frees.len() < KEPT_DOUBLE_FREES {
                target.double_frees.push(double_free);
            }
        }
    }

    /// Reads the maps and publishes the view.
    fn publish(&mut self) -> anyhow::Result<()> {
        self.collect_double_frees();
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
        let still = self.loaded.still_intervals(&pids)?;
        let settle_after = settled::intervals(self.config.leak);
        let settled: HashSet<u32> = (self.targets.values())
            .filter(|t| t.last_view.as_ref().is_some_and(|(last, _)| last.double_frees == t.double_free_count))
            .filter(|t| still.get(&t.id.pid).is_some_and(|&n| n >= settle_after))
            .map(|t| t.id.pid)
            .collect();
        let kernel = self.loaded.read(&pids.difference(&settled).copied().collect(), 0)?;
        self.loaded.rest(&settled, still_since_ns);
        let residents = self.targets.values_mut().map(|t| {
            let heap = match (&t.last_view, kernel.processes.get(&t.id.pid)) {
                (Some((last, _)), None) => {
                    HeapNow { outstanding_bytes: last.report.totals.outstanding_bytes, sampled: last.sample_bytes > 0 }
                }
                (_, snapshot) => HeapNow::of(snapshot),
            };
            (t.id.pid, &mut t.resident, heap)
        });
        Resident::read_all(&self.loaded.ebpf, kernel.live_entries, residents, &mut self.pinned_budget, false)?;
        for target in self.targets.values_mut() {
            if settled.contains(&target.id.pid) {
                let time_s = still_since_ns.saturating_sub(target.start_ns) as f64 / 1e9;
                target.leaks.rest(still_since_ns, time_s);
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
                target.leaks.observe(snapshot, &self.loaded.ages.clock, time_s);
                if let Some(switch) = target.rate_guard.check(snapshot) {
                    // The always-on mode: its cost follows the pages the process touches, not
                    // its calls. What its calls recorded goes with them.
                    let pid = target.id.pid;
                    let nonzero = NonZeroU32::new(pid).expect("a target's pid is positive");
                    if let Err(err) = self.loaded.switch_to_pages(nonzero, &mut target.attachment) {
                        warn!(pid, "switching to growth mode: {err:#}");
                        continue;
                    }
                    target.probed_files.clear();
                    target.leaks = LeakTracker::new(self.config.leak);
                    target.known_stacks.forget();
                    warn!(
                        pid,
                        comm = target.comm,
                        calls_per_second = switch.calls_per_second,
                        "above max_rate: traced by the pages it touches from now on (growth mode)"
                    );
                }
            }
        }
        let sizes = self.loaded_sizes;
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
            children_followed: self.children_followed,
            children_missed: self.children_missed,
            untraced_sharing: self.untraced_sharing(&pids),
            discovery_scans: self.scans,
            settled_targets: settled.len() as u64,
            size_histograms: self.config.size_histograms,
            pid_labels: self.config.pid_labels,
            unwind: tables,
            symbolization_failures: self.symbolizer.failures().into_iter().map(|(f, n)| (f.name(), n)).collect(),
            ready: true,
            ..DaemonView::default()
        };
        let slots = self.slots.assign(self.targets.values().map(|t| (t.id.pid, t.comm.as_str())));
        let views: Vec<Arc<TargetView>> = (self.targets.values())
            .map(|target| {
                let mut view = match (&target.last_view, settled.contains(&target.id.pid)) {
                    (Some((last, _)), true) => self.settled_view(target, last, still_since_ns, &kernel, &tables),
                    _ => {
                        target.known_stacks.next_interval();
                        self.target_view(target, &kernel, &tables)
                    }
                };
                view.slot = slots[&target.id.pid];
                Arc::new(view)
            })
            .collect();
        for target_view in views {
            let Some(target) = self.targets.get_mut(&target_view.pid) else { continue };
            target.last_view = Some((target_view.clone(), target.resident.pinned_changes()));
            view.targets.insert(target_view.pid, target_view);
        }
        let old = std::mem::replace(&mut *self.view.write().unwrap_or_else(|e| e.into_inner()), view);
        // Freed after the lock is released: the last interval's stacks take a while to free, and
        // scrapes wait for the lock.
        drop(old);
        Ok(())
    }

    /// The processes not traced that map a shared-linked file, counted again when the shared
    /// files changed and after each scan of /proc.
    fn untraced_sharing(&mut self, traced: &HashSet<u32>) -> u64 {
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
    fn inspect(&mut self, pid: u32, heuristics: Heuristics) -> Result<TargetView, InspectFailure> {
        if !self.targets.contains_key(&pid) {
            return Err(InspectFailure::NotTraced(pid));
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
    fn settled_view(
        &self,
        target: &Target,
        last: &TargetView,
        now_ns: u64,
        kernel: &KernelSnapshot,
        tables: &TableUse,
    ) -> TargetView {
        let update = |report: &mut Report| {
            report.memory = target.resident.last();
            report.blind_spots =
                target.blind_spots.current(report.memory, report.totals.allocations, report.mappings.outstanding_bytes);
            report.unwind_tables = Some(*tables);
            report.unattributed_dropped = report::unattributed_dropped(kernel);
            report.timeline = target.leaks.timeline_as_named();
        };
        settled::bring_up_to_date(last, settled::Now { now_ns, start_ns: target.start_ns, update: &update })
    }

    fn target_view(&self, target: &Target, kernel: &KernelSnapshot, tables: &TableUse) -> TargetView {
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
        report.blind_spots =
            target.blind_spots.current(report.memory, report.totals.allocations, report.mappings.outstanding_bytes);
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
        let other_stack_bytes = by_label[top..].iter().map(|(_, (bytes, _, _))| bytes).sum();
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
            double_frees: target.double_free_count,
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

/// Which execs and forks of untraced processes the kernel reports (`discover::`): execs where
/// a rule names commands (a program's name is set at its exec) or cgroups (a service manager
/// moves its child into the service's cgroup, then execs); forks where one names cgroups or all
/// (a child starts in its parent's cgroup, and may never exec). A rule on pids needs neither.
fn discover_flags(config: &Config) -> u32 {
    let rules = &config.rules;
    let execs = rules.all || !rules.comms.is_empty() || rules.needs_cgroup();
    let forks = rules.all || rules.needs_cgroup();
    (if execs { discover::EXECS } else { 0 }) | if forks { discover::FORKS } else { 0 }
}

impl Drop for Tracer {
    fn drop(&mut self) {
        self.alive.store(false, Ordering::Relaxed);
    }
}
