//! Which processes the tracer traces: attaching to those the rules match as they start, fork or
//! are found by a scan of /proc, probing a target's new program after an exec, and letting go
//! of those that exit or no longer match.

use std::{
    collections::{HashMap, HashSet},
    num::NonZeroU32,
    time::{Duration, Instant, SystemTime},
};

use anyhow::Context as _;
use profiler_common::{process_event, DropReason, ProcessEvent};
use tracing::{debug, info, warn};

use super::{means::Means, Target, Tracer};
use crate::{
    daemon::descriptors,
    daemon::discovery::{self, ProcessId},
    error::UserError,
    heap::known_stacks::KnownStacks,
    heap::leak::LeakTracker,
    heap::sampling::RateGuard,
    heap::{
        blind_spots::BlindSpots,
        double_free::{DoubleFreeFilter, DoubleFrees},
        report,
        resident::Resident,
    },
    kernel::aggregate::{self, Snapshot},
    kernel::loader::Attachment,
    kernel::shared::{self, file_ids},
    process::allocator,
    process::procfs,
};

/// The first wait before a new process that cannot be attached yet is tried again (caught between
/// its exec and its dynamic linker mapping its allocator), doubled at each try.
const FIRST_RETRY: Duration = Duration::from_millis(5);
/// How long after a traced process's main thread exited it is looked for gone, each
/// `FIRST_RETRY`: it is gone moments after its exit event; one whose other threads run on is
/// checked each interval.
const EXIT_WATCH: Duration = Duration::from_secs(1);
/// How long a new process that cannot be attached to is tried again.
const GRACE_SECONDS: f64 = 5.0;

impl Tracer {
    /// Counts each pending child once its fate is known: attached since (with the time it ran
    /// unseen), or gone; and the other processes that started, once attached (those gone are
    /// counted missed by `retry`).
    pub(super) fn settle_pending_children(&mut self) {
        let children = settle(&mut self.pending_children, &self.targets);
        self.children_followed += children.attached;
        self.children_missed += children.gone;
        self.children_unseen_ns += children.unseen_ns;
        self.longest_child_unseen_ns = self.longest_child_unseen_ns.max(children.longest_ns);
        let started = settle(&mut self.pending_started, &self.targets);
        self.started_unseen_ns += started.unseen_ns;
        self.longest_started_unseen_ns = self.longest_started_unseen_ns.max(started.longest_ns);
    }

    /// Attaches to a matching process unless it is traced already, cannot be, or would be one
    /// too many; returns whether it was attached.
    pub(super) fn consider(&mut self, id: ProcessId, comm: String) -> bool {
        if let Some(target) = self.targets.get_mut(&id.pid).filter(|t| t.id == id) {
            // The scan read its name: a program may rename itself.
            target.comm = comm;
            return false;
        }
        if self.unattachable.contains(&id) {
            return false;
        }
        if self.targets.len() >= self.config.max_targets {
            let traced = self.targets.len();
            self.refuse(id, &comm, || {
                format!(
                    "{traced} processes are traced already, as many as --max-targets (max_targets) allows; raise it \
                     (docs: daemon/index.md#daemon-mode gives what each target costs) or narrow the rules"
                )
            });
            return false;
        }
        if !descriptors::room_for_another(self.targets.len(), self.descriptor_limit) {
            let limit = self.descriptor_limit;
            self.refuse(id, &comm, || {
                format!(
                    "{} of the daemon's {limit} open files are in use, and a target may take 30 more; raise its \
                     limit (LimitNOFILE in its systemd unit, ulimit -n) or narrow the rules",
                    descriptors::open()
                )
            });
            return false;
        }
        match self.attach(id, comm) {
            // Tries left from before (it was found before its allocator was mapped, and attached
            // at an exec) would count it missed once it exits.
            Ok(()) => {
                self.starting.remove(&id);
                true
            }
            // It runs valgrind, which would meet memprof's breakpoints in the code it runs, and
            // leaves it only by an exec, which is reported: not tried again.
            Err(err) if matches!(err.downcast_ref::<UserError>(), Some(UserError::UnderValgrind(_))) => {
                info!(pid = id.pid, "not traced: {err:#}");
                self.unattachable.insert(id);
                false
            }
            // A process caught between exec and the dynamic loader mapping its C library has
            // no allocator yet: only give up on processes old enough to have one.
            Err(err) if id.age_seconds() < GRACE_SECONDS => {
                debug!(pid = id.pid, "not traced yet: {err:#}");
                false
            }
            // A pid the rules name is one the user asked for by name: they are told why not.
            Err(err) if self.config.rules.pids.contains(&id.pid) => {
                warn!(pid = id.pid, "not traced, though the rules name it: {err:#}");
                self.unattachable.insert(id);
                false
            }
            Err(err) => {
                debug!(pid = id.pid, "not traced: {err:#}");
                self.unattachable.insert(id);
                false
            }
        }
    }

    /// Counts `id` refused, once, and says why (`why` is asked only then).
    fn refuse(&mut self, id: ProcessId, comm: &str, why: impl FnOnce() -> String) {
        if self.refused.insert(id) {
            self.refused_total += 1;
            warn!(pid = id.pid, comm, "not traced: {}", why());
        }
    }

    /// Execs, forks and exits: an exec re-probes a target for its new program; a target's child
    /// that matches the rules is attached at once, as is any other new process that does (from
    /// its exec, or its fork when the rules name cgroups); a target whose main thread exited is
    /// let go once gone. Returns whether the set of targets changed.
    pub(super) fn on_process_events(&mut self) -> bool {
        let events = self.loaded.process_events.drain();
        // First the double frees of the programs that exec'd.
        let before = self.double_free_reader.drain_before_execs(&events);
        self.add_double_frees(before);
        let mut changed = false;
        for event in events {
            let traced = self.targets.contains_key(&event.tgid);
            match event.kind {
                process_event::EXEC if traced => changed |= self.on_exec(&event),
                process_event::EXEC => {
                    changed |= self.found_exec(&event);
                    self.discovered(event.cgroup_id, event.tgid, None);
                }
                process_event::FORK if traced => self.on_fork(event.tgid, event.pid, event.time_ns),
                process_event::FORK => {
                    if let Some((id, comm)) = discovery::matching(&self.config.rules, event.pid) {
                        changed |= self.attach_started(id, comm, event.time_ns);
                    }
                    self.discovered(event.cgroup_id, event.pid, Some(event.tgid));
                }
                process_event::EXIT if traced => {
                    self.exiting.insert(event.tgid, Instant::now() + EXIT_WATCH);
                }
                process_event::PROBE_THREAD_EXIT if traced => self.on_probe_thread_exit(&event),
                _ => {}
            }
        }
        self.settle_pending_children();
        changed
    }

    /// Process `pid`, not traced, was reported at its exec or fork (by `parent`), in cgroup
    /// `cgroup_id`: counted, and when no rule contains that cgroup, the kernel reports no more
    /// of its processes (see `cgroup_verdicts`).
    fn discovered(&mut self, cgroup_id: u64, pid: u32, parent: Option<u32>) {
        self.discovery_events += 1;
        if self.cgroup_verdicts.is_full() {
            self.forget_kept_back_cgroups();
        }
        let Some(id) = self.cgroup_verdicts.unmatched(&self.config.rules, cgroup_id, pid, parent) else { return };
        match self.loaded.keep_back_cgroup(id) {
            Ok(()) => {
                debug!(pid, cgroup_id, "no rule contains its cgroup: its processes' execs and forks are kept back")
            }
            Err(err) => debug!(pid, cgroup_id, "its cgroup, which no rule contains, could not be kept back: {err:#}"),
        }
    }

    /// Has the kernel report every exec and fork again, whatever its cgroup, and judge their
    /// cgroups anew.
    pub(super) fn forget_kept_back_cgroups(&mut self) {
        match self.loaded.forget_kept_back_cgroups() {
            Ok(()) => self.cgroup_verdicts.forget(),
            Err(err) => warn!("the kernel could not be told to report every exec and fork again: processes the rules match in cgroups kept back may be found at the next scan of /proc only: {err:#}"),
        }
    }

    /// The thread a target's perf-event uprobes were opened on exited: they are opened again on
    /// a thread that stays, and the gap is logged (see `probe_threads`).
    fn on_probe_thread_exit(&mut self, event: &ProcessEvent) {
        let (Some(target), Some(pid)) = (self.targets.get_mut(&event.tgid), NonZeroU32::new(event.tgid)) else {
            return;
        };
        let (tid, comm) = (event.pid, target.comm.as_str());
        let reason = DropReason::ProbeThreadExited.name();
        match self.loaded.probe_thread_exited(pid, tid, event.time_ns, &mut target.attachment) {
            None => {}
            Some(Ok(moved)) => warn!(
                pid = pid.get(),
                comm,
                "thread {tid}, which its probes were opened on, exited; they are open again on thread {}: its calls in the {:.1} ms between were not seen (dropped: {reason})",
                moved.thread,
                moved.gap_ns as f64 / 1e6
            ),
            Some(Err(err)) => warn!(
                pid = pid.get(),
                comm,
                "thread {tid}, which its probes were opened on, exited, and they could not be opened again: its calls are not seen from then on (dropped: {reason}): {err:#}"
            ),
        }
    }

    /// A process that exec'd or started: attached if the rules match it.
    pub(super) fn found(&mut self, pid: u32) -> bool {
        match discovery::matching(&self.config.rules, pid) {
            Some((id, comm)) => self.try_attach(id, comm),
            None => false,
        }
    }

    /// `try_attach` for a matching process that started at `started_ns` (its fork or exec): the
    /// time it runs unseen until attached is counted (see `settle_pending_children`).
    fn attach_started(&mut self, id: ProcessId, comm: String, started_ns: u64) -> bool {
        self.pending_started.insert(id, started_ns);
        self.try_attach(id, comm)
    }

    /// A process that exec'd, as `found`; one gone already is counted missed when the name its
    /// exec gave it (its program's file name, as the kernel names it) matches the rules. /proc
    /// is read again only for those: most execs on the host match nothing. (One matched but
    /// gone before its attach waits in `starting`, which counts it.)
    fn found_exec(&mut self, event: &ProcessEvent) -> bool {
        let named = crate::kernel::events::exec_comm(event);
        // Most execs on the host: a name no rule can match costs no read of /proc. One that
        // renames itself to match later is found by the next scan of /proc, as it would be had
        // it renamed itself after that read.
        if named.as_deref().is_some_and(|comm| !self.config.rules.may_match(event.tgid, comm)) {
            return false;
        }
        if let Some((id, comm)) = discovery::matching(&self.config.rules, event.tgid) {
            return self.attach_started(id, comm, event.time_ns);
        }
        if named.is_some_and(|comm| self.config.rules.matches(event.tgid, &comm, &[]))
            && ProcessId::current(event.tgid).is_none()
        {
            self.missed(event.tgid);
        }
        false
    }

    /// A process the rules matched, gone before it could be attached: counted
    /// (`memprof_targets_missed`), and logged at debug level.
    fn missed(&mut self, pid: u32) {
        debug!(pid, "matched the rules, but exited before it could be attached");
        self.missed_total += 1;
    }

    /// `consider`, and when the process cannot be attached yet, a later try (see `retry`).
    pub(super) fn try_attach(&mut self, id: ProcessId, comm: String) -> bool {
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
    pub(super) fn next_retry(&self) -> Instant {
        let starting = self.starting.values().map(|&(_, at, _)| at);
        let exiting = self.exiting.values().map(|&until| until.min(Instant::now() + FIRST_RETRY));
        starting.chain(exiting).min().unwrap_or_else(Instant::now)
    }

    /// Tries again the starting processes due, and lets go of the exiting targets now gone.
    /// Returns whether the set of targets changed.
    pub(super) fn retry(&mut self) -> bool {
        let now = Instant::now();
        let mut changed = false;
        let due: Vec<ProcessId> =
            self.starting.iter().filter(|(_, &(_, at, _))| at <= now).map(|(id, _)| *id).collect();
        for id in due {
            let Some((comm, _, wait)) = self.starting.remove(&id) else { continue };
            if ProcessId::current(id.pid) != Some(id) {
                // A traced process's child is counted with the children (`settle_pending_children`).
                if !self.pending_children.contains_key(&id) {
                    self.missed(id.pid);
                }
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

    /// A target forked `child` at `forked_ns`: the child is counted once, followed or missed. One
    /// that matches waits in `pending_children` until it is attached or gone, whoever attaches
    /// it: this event, a later try, or discovery, which may have found it between its fork and
    /// this event.
    pub(super) fn on_fork(&mut self, parent: u32, child: u32, forked_ns: u64) {
        match discovery::matching(&self.config.rules, child) {
            Some((id, comm)) => {
                if self.targets.get(&child).is_none_or(|target| target.id != id) {
                    self.try_attach(id, comm);
                }
                self.pending_children.insert(id, forked_ns);
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
            None => {
                if let Some(target) = self.targets.get_mut(&parent) {
                    target.forked_untraced = true;
                }
            }
        }
    }

    /// Takes the breakpoints out of the children not traced that traced processes forked since
    /// the last snapshot (see `Loaded::sweep_copies`).
    pub(super) fn sweep_forked(&mut self) {
        let forked = self.targets.iter_mut().filter_map(|(&pid, target)| {
            let forked = std::mem::take(&mut target.forked_untraced);
            let target: &Target = target;
            forked.then_some((&target.attachment, NonZeroU32::new(pid)?))
        });
        self.loaded.sweep_copies(forked);
    }

    /// Returns whether the target was let go: a process the rules match no more after its exec
    /// (its new program's name, say) is detached at once, not at the next scan.
    pub(super) fn on_exec(&mut self, event: &ProcessEvent) -> bool {
        let pid = event.tgid;
        let ran = || allocator::valgrind_of(pid, crate::kernel::events::exec_path(pid, event));
        if let Some(valgrind) = self.targets.contains_key(&pid).then(ran).flatten() {
            // valgrind reads the code of the program it runs: a breakpoint of memprof's there,
            // kept through the exec, would stop it with SIGTRAP. Let go at once (the dynamic
            // linker's hook first, see `probes::Wave`); discovery refuses valgrind's tool.
            warn!(
                pid,
                program = valgrind,
                "runs valgrind: no longer traced (memprof's breakpoints would stop its program)"
            );
            self.detach(pid);
            return true;
        }
        // Gone already (its name unreadable), or out of the rules: let go.
        let Some((now, comm)) = discovery::matching(&self.config.rules, pid) else {
            self.detach(pid);
            return true;
        };
        let Some(target) = self.targets.get_mut(&pid) else { return false };
        let Some(nonzero) = NonZeroU32::new(pid) else { return false };
        // The target exited and its pid went to a new process, which exec'd before discovery saw
        // the old one go: the kernel reported the exec since the pid was still traced. The new
        // process, which the rules want (above), is traced from its exec on, with nothing of the
        // old one's (the exec below drops the old stacks, counts and mappings).
        let reused = now != target.id;
        if reused {
            info!(pid, old_comm = target.comm, "pid reused by a new process: tracing it afresh");
            target.id = now;
            target.attached_at = SystemTime::now();
            target.start_ns = aggregate::monotonic_now_ns();
            target.ns_pid = procfs::ns_pid(pid);
        }
        if reused || event.exec_by_other_thread() || target.probed_files.is_empty() || target.sampler_beside_calls {
            // Its probes no longer fire (they followed the task the exec ended), or they are not
            // allocator probes: attached anew once the new program maps its allocator.
            let old = std::mem::take(&mut target.attachment);
            target.attachment = self.loaded.exec_happened(nonzero, old, event);
            target.probed_files.clear();
            target.sampler_beside_calls = false;
        } else {
            // Its probes stay: what the old program left goes, what the new one recorded stays.
            // Mappings first: until they are written, each of its walks is deferred.
            self.loaded.exec_seen(pid, event.time_ns);
            self.loaded.sync_mappings(pid);
            self.loaded.image_replaced(nonzero, event);
        }
        target.probed = false;
        target.comm = comm;
        target.exe = procfs::exe_path(pid);
        target.cgroup = procfs::cgroup(pid);
        target.leaks = LeakTracker::new(self.config.leak);
        target.rate_guard = RateGuard::new(self.config.sampling);
        target.known_stacks.forget();
        target.last_view = None;
        self.symbolizer.forget(pid);
        self.symbolizer.refresh(pid);
        info!(pid, comm = target.comm, "exec: tracing the new program");
        self.probe(pid);
        false
    }

    /// Probes the allocator of a target that exec'd once its new program has mapped one.
    /// A process whose only allocator is a runtime's (a pure Go binary) is traced by what it maps
    /// or touches, when that is traced.
    pub(super) fn runtime_only(&self) -> allocator::RuntimeOnly {
        let (maps, sampling) = (&self.config.maps, &self.config.sampling);
        allocator::RuntimeOnly::accepted_if(maps.mappings || sampling.growth || sampling.usdt)
    }

    pub(super) fn probe(&mut self, pid: u32) {
        if self.targets.get(&pid).is_none_or(|target| target.probed) {
            return;
        }
        let (Ok(mut means), Some(nonzero)) = (self.means_of(pid), NonZeroU32::new(pid)) else {
            return;
        };
        let Some(target) = self.targets.get(&pid) else { return };
        // The files whose probes it kept through its exec are not probed twice.
        let missing = shared::unprobed(&means.allocator, &target.probed_files);
        let attached = if let Some(sites) = &means.sampler {
            self.loaded.attach_usdt(sites, nonzero, None)
        } else if missing.files.is_empty() && !means.allocator.files.is_empty() {
            Ok(Attachment::default())
        } else {
            self.loaded.attach_allocator(&missing, nonzero)
        };
        let attached = attached.map(|mut probes| {
            let beside = self.attach_beside_calls(&mut means, nonzero, &mut probes);
            (probes, beside)
        });
        let Some(target) = self.targets.get_mut(&pid) else { return };
        match attached {
            Ok((probes, beside)) => {
                target.attachment.merge(probes);
                target.sampler_beside_calls = beside;
                // A process moved to its pages is watched anew at each exec (see `on_exec`).
                if means.traces_calls(self.config.sampling) && !self.loaded.traces_pages(pid) {
                    target.probed_files.extend(file_ids(&missing));
                }
                target.probed = true;
                target.double_free_filter = DoubleFreeFilter::new(&means.allocator, target.exe.as_deref());
                target.blind_spots = BlindSpots::after_exec(pid, &means.allocator);
                target.rate_guard = means.rate_guard(self.config.sampling);
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

    pub(super) fn attach(&mut self, id: ProcessId, comm: String) -> anyhow::Result<()> {
        self.loaded.purge_exited_before_tracing(id.pid);
        let mut means = self.means_of(id.pid)?;
        let pid = NonZeroU32::new(id.pid).context("pid 0")?;
        let mut attachment = match &means.sampler {
            Some(sites) => self.loaded.attach_usdt(sites, pid, None)?,
            None => self.loaded.attach(&means.allocator, pid)?,
        };
        let sampler_beside_calls = self.attach_beside_calls(&mut means, pid, &mut attachment);
        let rate_guard = means.rate_guard(self.config.sampling);
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
            double_free_filter: DoubleFreeFilter::new(&means.allocator, exe.as_deref()),
            blind_spots: BlindSpots::new(id.pid, &means.allocator, self.config.sampling.growth),
            resident: Resident::default(),
            exe,
            cgroup: procfs::cgroup(id.pid),
            attached_at: SystemTime::now(),
            start_ns: aggregate::monotonic_now_ns(),
            double_frees: DoubleFrees::default(),
            leaks: LeakTracker::new(self.config.leak),
            rate_guard,
            probed: true,
            sampler_beside_calls,
            forked_untraced: false,
            probed_files: if means.traces_calls(self.config.sampling) {
                file_ids(&means.allocator)
            } else {
                HashSet::new()
            },
            known_stacks: KnownStacks::default(),
            calls: 0,
            cut_walks: 0,
            cut_since_read: false,
            tables_full: Default::default(),
            pages_refused: false,
            last_view: None,
        };
        self.targets.insert(id.pid, target);
        // An exit that began before the kernel knew the process traced sent no exit event: it
        // would be held as traced until the next scan. Looked at again as any exiting target is.
        if procfs::stat(id.pid).is_none_or(|stat| stat.zombie || stat.exiting) {
            self.exiting.insert(id.pid, Instant::now() + EXIT_WATCH);
        }
        Ok(())
    }

    /// Attaches Go's runtime sampler beside the calls of a Go program with cgo (see
    /// `Means::beside_calls`) to `attachment`, its Go heap then no blind spot; returns whether it
    /// did. One that fails leaves it traced by its calls alone.
    fn attach_beside_calls(&mut self, means: &mut Means, pid: NonZeroU32, attachment: &mut Attachment) -> bool {
        let Some(sites) = means.beside_calls.take() else { return false };
        let attached = self.loaded.attach_beside_calls(&sites, pid, &mut means.allocator, attachment);
        if let Err(err) = &attached {
            warn!(pid = pid.get(), "its Go heap stays unseen: attaching its runtime's sampler: {err:#}");
        }
        attached.is_ok()
    }

    /// Detaches from `pid` and removes what the kernel and the symbolizer hold about it.
    pub(super) fn detach(&mut self, pid: u32) {
        let Some(target) = self.targets.remove(&pid) else { return };
        // Its drops since the last interval, read before the kernel forgets them.
        match self.loaded.drops_of(pid) {
            // Named as its report names them.
            Ok(drops) => self.drops.retire(pid, &report::dropped(&Snapshot { drops, ..Snapshot::default() })),
            Err(err) => warn!(pid, "its last drops are not counted: {err:#}"),
        }
        if ProcessId::current(pid) == Some(target.id) {
            // Still running (the rules changed): its probes must be gone before its state is.
            self.loaded.detach(target.attachment);
        } else {
            // Exited: nothing fires any more, and discovery need not wait for the detach.
            self.loaded.detach_in_background(target.attachment);
        }
        // Purged at the next interval or before the pid is traced again: a thousand processes
        // that exit together cost one walk of the maps.
        self.loaded.forget_exited_later(&HashSet::from([pid]));
        self.symbolizer.forget(pid);
        info!(pid, comm = target.comm, "no longer traced");
    }
}

/// What `settle` found of the pending processes.
#[derive(Default)]
struct Settled {
    attached: u64,
    gone: u64,
    /// The time those attached ran before their probes: in all, and the longest.
    unseen_ns: u64,
    longest_ns: u64,
}

/// Takes out of `pending` (processes with the time they started, CLOCK_MONOTONIC) those traced
/// since, with the time each ran unseen, and those gone.
fn settle(pending: &mut HashMap<ProcessId, u64>, targets: &HashMap<u32, Target>) -> Settled {
    let mut settled = Settled::default();
    pending.retain(|id, &mut started_ns| {
        if let Some(target) = targets.get(&id.pid).filter(|target| target.id == *id) {
            let ran_ns = target.start_ns.saturating_sub(started_ns);
            settled.attached += 1;
            settled.unseen_ns += ran_ns;
            settled.longest_ns = settled.longest_ns.max(ran_ns);
            false
        } else if ProcessId::current(id.pid) != Some(*id) {
            settled.gone += 1;
            false
        } else {
            true
        }
    });
    settled
}
