//! The tracer thread: attaches to the processes the rules match, detaches from those that exit,
//! and publishes a `DaemonView` every interval. Everything here blocks (BPF syscalls, detaching,
//! far slower with perf-event uprobes: docs: reference/limits.md#detaching), so it runs on a
//! thread of its own, not on the async runtime. Here its loop; `targets` decides which processes
//! it traces, `publish` builds the view.

mod crowding;
mod drop_totals;
mod means;
mod publish;
mod targets;
mod to_pages;

use std::{
    collections::{HashMap, HashSet},
    os::fd::AsFd,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, RwLock,
    },
    time::{Duration, Instant, SystemTime},
};

use profiler_common::discover;
use tokio::sync::oneshot;
use tracing::{info, warn};

use super::{
    cgroup_verdicts::CgroupVerdicts,
    config::Config,
    discovery::{self, ProcessId},
    slots::Slots,
    view::{DaemonView, TargetView},
    wakeup::{Inbox, Woken},
};
use crate::{
    heap::heuristics::Heuristics,
    heap::known_stacks::KnownStacks,
    heap::leak::LeakTracker,
    heap::sampling::RateGuard,
    heap::{
        blind_spots::BlindSpots,
        double_free::{DoubleFreeFilter, DoubleFrees},
        resident::{PinnedBudget, Resident},
    },
    kernel::aggregate::{self, DoubleFreeReader},
    kernel::loader::{self, Attachment, Loaded},
    kernel::shared::{FileId, ProbeLinks},
    symbolize::SymbolizerHandle,
};

/// How soon a target that came or went is shown: not at once for each, so that a thousand
/// processes started together are not a thousand snapshots.
const CHANGE_SHOWN: Duration = Duration::from_millis(200);

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
    #[error("pid {pid} has no blocks to inspect: it is {why}; `memprof snapshot -p {pid}` writes its heap by stack")]
    NoBlocks { pid: u32, why: &'static str },
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
    double_frees: DoubleFrees,
    leaks: LeakTracker,
    /// `--max-rate`: switches the process to sampling when it calls the allocator too often.
    rate_guard: RateGuard,
    /// Its allocator is probed: not between an exec and the new program mapping its allocator.
    probed: bool,
    /// Go's runtime sampler is attached beside its calls (a Go program with cgo): its probes go
    /// with the program at an exec.
    sampler_beside_calls: bool,
    /// Forked a child the rules do not trace since the last snapshot: the child has copies of
    /// this process's breakpoints until they are swept (`Loaded::sweep_copies`).
    forked_untraced: bool,
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
    /// Its allocations that found each shared table full, at the last interval (see `crowding`).
    tables_full: [u64; crowding::Table::ALL.len()],
    /// A switch to growth mode failed: it is not tried again to make room in a shared table.
    pages_refused: bool,
    /// The view published last, and the pinned pages' `Resident::pinned_changes` it shows. None
    /// until its first snapshot, and again once it shows no more what the target runs (an exec)
    /// or how memprof is configured (a reload).
    last_view: Option<(Arc<TargetView>, u64)>,
}

pub struct Tracer {
    config: Config,
    loaded: Loaded,
    symbolizer: SymbolizerHandle,
    double_free_reader: DoubleFreeReader,
    targets: HashMap<u32, Target>,
    /// Processes not to try again: no allocator, or attaching failed.
    unattachable: HashSet<ProcessId>,
    /// Processes refused for the cap or the open files left, each counted once in
    /// `refused_total`.
    refused: HashSet<ProcessId>,
    refused_total: u64,
    /// Processes the rules matched that were gone before they could be attached (see
    /// `Tracer::missed`).
    missed_total: u64,
    /// Every drop of every process traced, exited ones included.
    drops: drop_totals::DropTotals,
    /// The soft limit on open files (see `descriptors`).
    descriptor_limit: u64,
    children_followed: u64,
    children_missed: u64,
    /// How long followed children ran between their fork and their probes, unseen: in all, and
    /// the longest one.
    children_unseen_ns: u64,
    longest_child_unseen_ns: u64,
    /// Children that matched at their fork, with its time (CLOCK_MONOTONIC), until their fate is
    /// known: followed once attached (at once, or by a later attempt if caught dying or
    /// mid-exec), missed once they are gone.
    pending_children: HashMap<ProcessId, u64>,
    /// How long the other matching processes that started (fork or exec) while the daemon ran
    /// went unseen before their probes: in all, and the longest one. A daemon held up (a long
    /// inspection) attaches late.
    started_unseen_ns: u64,
    longest_started_unseen_ns: u64,
    /// Those processes, with the time they started (CLOCK_MONOTONIC), until attached or gone.
    pending_started: HashMap<ProcessId, u64>,
    /// New matching processes not attachable yet, with their command name, when to try again
    /// and the wait after that.
    starting: HashMap<ProcessId, (String, Instant, Duration)>,
    /// Targets whose main thread exited, watched until gone.
    exiting: HashMap<u32, Instant>,
    /// Targets whose main thread exited while others run on: looked for gone each interval,
    /// since the exit of their last thread is not reported.
    leaderless: HashSet<u32>,
    /// The targets settled at the last interval (see `settled`).
    settled: HashSet<u32>,
    /// When /proc is next scanned (`Config::resync`), and the scans so far.
    next_resync: Instant,
    scans: u64,
    /// The execs and forks of processes not traced the kernel reported for the rules to judge.
    discovery_events: u64,
    cgroup_verdicts: CgroupVerdicts,
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
    pub fn new(
        config: Config,
        descriptor_limit: u64,
        view: Arc<RwLock<DaemonView>>,
        alive: Arc<AtomicBool>,
    ) -> anyhow::Result<Self> {
        // A Go program without cgo is traced through its runtime's sampler even without `--usdt`.
        let samplers = if config.sampling.usdt { loader::Samplers::Every } else { loader::Samplers::Some };
        let mut loaded = loader::load(config.maps, config.interval, samplers, true)?;
        loaded.unwind.bound_per_user(config.unwind_rows_per_user);
        loaded.unwind.keep_idle(config.keep_unwind_tables);
        if config.sampling.growth {
            loaded.trace_page_faults()?;
        }
        // Rules match any number of processes: by default links of their own while few map a
        // file, one set per file past that (docs: internals/probes.md#probes-and-detaching).
        loaded.set_probe_links(config.probe_links);
        let (flags, exec_names) = discovery_of(&config);
        loaded.discover(flags, &exec_names)?;
        if config.probe_links == ProbeLinks::Shared {
            info!(
                "--probe-links shared: every process that maps a traced process's allocator or dynamic linker \
                 gets memprof's breakpoints, traced or not"
            );
        }
        let double_free_reader = DoubleFreeReader::new(&mut loaded.ebpf)?;
        let cgroup_verdicts = CgroupVerdicts::new(&config.rules);
        alive.store(true, Ordering::Relaxed);
        Ok(Self {
            config,
            loaded,
            symbolizer: SymbolizerHandle::spawn(),
            double_free_reader,
            targets: HashMap::new(),
            unattachable: HashSet::new(),
            refused: HashSet::new(),
            refused_total: 0,
            missed_total: 0,
            drops: drop_totals::DropTotals::default(),
            descriptor_limit,
            children_followed: 0,
            children_missed: 0,
            children_unseen_ns: 0,
            longest_child_unseen_ns: 0,
            pending_children: HashMap::new(),
            started_unseen_ns: 0,
            longest_started_unseen_ns: 0,
            pending_started: HashMap::new(),
            starting: HashMap::new(),
            exiting: HashMap::new(),
            leaderless: HashSet::new(),
            settled: HashSet::new(),
            next_resync: Instant::now(),
            scans: 0,
            discovery_events: 0,
            cgroup_verdicts,
            view,
            pinned_budget: PinnedBudget::default(),
            sharing: (HashSet::new(), 0, Instant::now()),
            slots: Slots::default(),
            alive,
        })
    }

    /// Runs until `Shutdown` (or the sender is dropped), then detaches every probe.
    pub fn run(mut self, commands: Inbox<Command>) {
        let mut next_interval = Instant::now();
        let mut next_snapshot = next_interval;
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
                self.sweep_forked();
                let interval = now >= next_interval;
                if let Err(err) = self.publish(interval) {
                    warn!("reading the kernel maps failed: {err:#}");
                }
                if interval {
                    next_interval = now + Duration::from_secs_f64(self.config.interval);
                }
                next_snapshot = next_interval;
            }
            for pid in self.loaded.sync_changed_mappings() {
                self.mappings_read(pid);
            }
            self.loaded.unwind.drop_expired();
            // Every ring is read before the wait, which would otherwise end at once.
            self.collect_double_frees();
            self.loaded.drain_rung_mappings();
            let mut until = self.next_resync.min(next_snapshot);
            if let Some(expiry) = self.loaded.unwind.next_idle_expiry() {
                until = until.min(expiry);
            }
            if let Some(due_ns) = self.loaded.next_mappings_sync_ns() {
                let wait_ns = due_ns.saturating_sub(aggregate::monotonic_now_ns());
                until = until.min(Instant::now() + Duration::from_nanos(wait_ns));
            }
            if !self.starting.is_empty() || !self.exiting.is_empty() {
                until = until.min(self.next_retry());
            }
            // Woken by the kernel's rings: a library a process loads gets its table within
            // milliseconds, a new process is attached as it starts.
            let mut rings = vec![
                self.loaded.process_events.ring().as_fd(),
                self.loaded.unwind_events.bell(),
                self.double_free_reader.ring().as_fd(),
            ];
            rings.extend(self.loaded.mapping_bell().map(AsFd::as_fd));
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
        let kept = config.keep_read_at_start(&self.config);
        if !kept.is_empty() {
            warn!("read at start, kept as they were until the next start: {}", kept.join(", "));
        }
        let (flags, exec_names) = discovery_of(&config);
        if let Err(err) = self.loaded.discover(flags, &exec_names) {
            warn!("the kernel's report of new processes could not follow the new rules: processes they match may be found at the next scan of /proc only: {err:#}");
        }
        self.cgroup_verdicts.review(&config.rules);
        self.cgroup_verdicts.forget();
        self.loaded.unwind.keep_idle(config.keep_unwind_tables);
        self.config = config;
        // Every view is built anew under the new configuration (its suppressions, its top stacks,
        // its leak rule).
        for target in self.targets.values_mut() {
            target.last_view = None;
            target.leaks.reconfigure(self.config.leak);
        }
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
        if self.cgroup_verdicts.review(&self.config.rules) {
            self.forget_kept_back_cgroups();
        }
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
        let new = matches.iter().filter(|(id, _)| self.targets.get(&id.pid).is_none_or(|t| t.id != *id));
        self.loaded.attaching(mapped_files(new.map(|(id, _)| id.pid)));
        for (id, comm) in matches {
            changed |= self.consider(id, comm);
        }
        self.loaded.attaching(HashMap::new());
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
}

/// Which execs and forks of untraced processes the kernel reports (`discover::`), and the
/// names that limit the execs: execs where a rule names commands (a program's name is set at its
/// exec; only those to the names the rules match, when the kernel can tell them) or cgroups (a
/// service manager moves its child into the service's cgroup, then execs); forks where one names
/// cgroups or all (a child starts in its parent's cgroup, and may never exec). Where a rule names
/// cgroups, the kernel keeps back those in the cgroups found to be no rule's (see
/// `cgroup_verdicts`). A rule on pids needs neither.
fn discovery_of(config: &Config) -> (u32, Vec<[u8; profiler_common::COMM_BYTES]>) {
    let rules = &config.rules;
    let execs = rules.all || !rules.comms.is_empty() || rules.needs_cgroup();
    let forks = rules.all || rules.needs_cgroup();
    let exec_names = if execs { rules.exec_names() } else { None };
    let by_cgroup = rules.needs_cgroup() && !rules.all;
    let flags = (if execs { discover::EXECS } else { 0 })
        | (if forks { discover::FORKS } else { 0 })
        | (if exec_names.is_some() { discover::NAMED_EXECS } else { 0 })
        | if by_cgroup { discover::CGROUPS } else { 0 };
    (flags, exec_names.unwrap_or_default())
}

impl Drop for Tracer {
    fn drop(&mut self) {
        self.alive.store(false, Ordering::Relaxed);
    }
}

/// How many of `pids` map each file, from their `/proc/PID/maps`.
fn mapped_files(pids: impl Iterator<Item = u32>) -> HashMap<FileId, usize> {
    let mut files = HashMap::new();
    for pid in pids {
        let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else { continue };
        let mapped: HashSet<FileId> = maps.lines().filter_map(FileId::of_maps_line).collect();
        for file in mapped {
            *files.entry(file).or_default() += 1;
        }
    }
    files
}
