//! Attaching a process's probes and hooks, and taking them back.

use std::{
    collections::{HashMap, HashSet},
    num::NonZeroU32,
    path::{Path, PathBuf},
};

use anyhow::Context as _;
use profiler_common::{c_library_free_cookie, moved_arguments_cookie, FREE_WRAPPER};

use crate::kernel::probes::Attachment;
use crate::{
    kernel::aggregate,
    kernel::events::{self, ProcessEvent},
    kernel::faults,
    kernel::mapping_programs::MachineWide,
    kernel::mappings::MappedRanges,
    kernel::probes::{Method, ENTRY_PROGRAM, FREE_PROGRAM, MAPPINGS_PROGRAM, RETURN_PROGRAM, SESSION_PROGRAM},
    kernel::shared::{FileId, ProbeLinks},
    kernel::uprobe_multi::Point,
    process::allocator::{self, Allocator},
    process::file_cache::Opened,
    process::mapping_calls,
    process::procfs::{self, FileMapping},
};

use super::{own_probes::OwnProbe, Loaded};

/// `ld-linux-x86-64.so.2` and the like, under any directory.
fn is_dynamic_linker(path: &str) -> bool {
    path.rsplit('/').next().is_some_and(|name| name.starts_with("ld-linux") || name.starts_with("ld-musl"))
}

/// The program of a process's own probes at its mapping calls' wrappers.
const MAPPING_CALLS_PROGRAM: &str = "mapping_call_return";

/// Whose memory and files a process about to be traced has.
#[derive(Debug, Clone, Copy)]
enum Program<'a> {
    /// Its own: it runs its program.
    Running,
    /// memprof's, as `run`'s fork before its exec into a command that will map `files`.
    BeforeExec(&'a [PathBuf]),
}

/// The mapping calls' sites in the C library and the program `pid` maps, or will map once it
/// runs `program`, if they have wrappers memprof understands and no other (`mapping_calls`).
fn own_mapping_calls(pid: u32, program: Program) -> Option<Vec<mapping_calls::Sites>> {
    match program {
        Program::Running => mapping_calls::of_process(pid, &procfs::file_mappings(pid).ok()?),
        Program::BeforeExec(files) => mapping_calls::of_files(files.first()?, files),
    }
}

/// The dynamic linker calls it before and after every change to the loaded libraries.
const DL_HOOK: &str = "_dl_debug_state";
/// The dynamic linker's `struct r_debug`, whose `r_map` lists the loaded objects.
const R_DEBUG: &str = "_r_debug";

impl Loaded {
    /// Traces the processes attached from now on by the pages they touch instead of their
    /// allocator calls (`--growth`): their allocator gets no probe. Its programs are loaded now
    /// (a kernel that refuses them fails the start), and run for every process on the machine
    /// only once a first process is traced so.
    pub fn trace_page_faults(&mut self) -> anyhow::Result<()> {
        self.load_fault_programs()?;
        self.growth = true;
        Ok(())
    }

    /// Growth mode's programs, loaded once (`load_fault_programs`), and those of them that run
    /// for every process on the machine, attached while a process is traced by its pages.
    fn load_page_faults(&mut self) -> anyhow::Result<()> {
        self.load_fault_programs()?;
        if self.machine_wide_faults.is_none() {
            self.machine_wide_faults = Some(faults::attach_machine_wide(&mut self.ebpf)?);
        }
        Ok(())
    }

    /// Loads growth mode's programs (the page-fault program, the ring its pages go through, and
    /// the mapping calls' programs) the first time, attached to nothing.
    fn load_fault_programs(&mut self) -> anyhow::Result<()> {
        if !self.faults_loaded {
            super::room_to_verify()?;
            faults::load(&mut self.ebpf)?;
            self.faults_loaded = true;
        }
        self.load_mapped_ranges()?;
        Ok(())
    }

    /// Loads the mapping calls' programs the first time, attached to nothing (`MappedRanges::load`).
    fn load_mapped_ranges(&mut self) -> anyhow::Result<&MappedRanges> {
        if self.mappings.is_none() {
            super::room_to_verify()?;
            self.mappings = Some(MappedRanges::load(&mut self.ebpf)?);
        }
        Ok(self.mappings.as_ref().expect("loaded just above"))
    }

    /// Whether tracing `pid` by its pages leaves the other processes' system calls alone: where
    /// the kernel refuses `fexit` programs, its mapping calls are read by probes of its own at
    /// the wrappers of its C library or its program (`own_mapping_calls`); a process without
    /// wrappers memprof understands (a static C program stripped of its symbols) would need the
    /// program at the return of every system call on the machine (`MachineWide::SYSTEM_CALLS`),
    /// unless `--mappings` has it there already. Loads the mapping calls' programs to find out,
    /// attaching none.
    pub fn pages_spare_system_calls(&mut self, pid: u32) -> anyhow::Result<bool> {
        let needs_own = self.own_mapping_calls_needed()?;
        Ok(!needs_own || own_mapping_calls(pid, Program::Running).is_some())
    }

    /// Whether a process traced by its pages needs probes of its own for its mapping calls: the
    /// programs that read them for every process would run at every system call, and
    /// `--mappings` does not have them there already.
    fn own_mapping_calls_needed(&mut self) -> anyhow::Result<bool> {
        let would_run_at = self.load_mapped_ranges()?.programs_would_run_at();
        Ok(!self.mappings_asked && would_run_at == MachineWide::SYSTEM_CALLS)
    }

    /// Has `pid`'s mapping calls read from now on, by probes of its own where it needs them and
    /// its `program` has wrappers memprof understands, else by the programs for every process,
    /// attached if they rest.
    fn read_mapping_calls(
        &mut self,
        pid: NonZeroU32,
        program: Program,
        attachment: &mut Attachment,
    ) -> anyhow::Result<()> {
        use profiler_common::traced::OWN_MAPPING_CALLS;
        if self.own_mapping_calls_needed()? {
            if let Some(files) = own_mapping_calls(pid.get(), program) {
                let probes: Vec<OwnProbe> = files
                    .iter()
                    .flat_map(|file| {
                        file.sites.iter().map(|site| OwnProbe {
                            path: &file.path,
                            offset: site.offset,
                            semaphore: None,
                            cookie: u64::from(site.call),
                        })
                    })
                    .collect();
                self.attach_own(MAPPING_CALLS_PROGRAM, &probes, pid.get(), attachment)?;
                let files: Vec<_> = files.iter().map(|file| file.path.display().to_string()).collect();
                tracing::debug!(pid = pid.get(), ?files, "mapping calls read at the process's own wrappers");
                self.update_traced(pid.get(), |flags| flags | OWN_MAPPING_CALLS)?;
                // An exec from a program without such wrappers may leave no process needing
                // the programs for every process.
                self.read_machine_wide.remove(&pid.get());
                self.rest_unneeded_mapping_programs();
                return Ok(());
            }
        }
        // After an exec into a program without such wrappers, the programs for every process read
        // its calls again.
        self.update_traced(pid.get(), |flags| flags & !OWN_MAPPING_CALLS)?;
        self.mappings.as_mut().expect("loaded by load_page_faults").wake(&mut self.ebpf)?;
        self.read_machine_wide.insert(pid.get());
        Ok(())
    }

    /// Where memprof's programs run for every process on the machine now (`MachineWide`).
    pub fn machine_wide(&self) -> Vec<&'static str> {
        let faults = self.machine_wide_faults.as_ref().map(|_| MachineWide::PAGE_FAULTS);
        faults.into_iter().chain(self.mappings.as_ref().and_then(MappedRanges::programs_run_at)).collect()
    }

    /// Once no process is traced by its pages, takes off the programs that run for every process
    /// on the machine for them (at each page fault, and, without `--mappings`, at the mapping
    /// calls or at every system call), until `load_page_faults` wants them again: under
    /// `--growth` too, between one target and the next.
    pub(super) fn rest_page_faults(&mut self) {
        self.rest_unneeded_mapping_programs();
        if self.mappings.as_ref().is_some_and(MappedRanges::watches_pages) {
            return;
        }
        let Some(links) = self.machine_wide_faults.take() else { return };
        faults::detach_machine_wide(&mut self.ebpf, links);
        if let Some(mappings) = self.mappings.as_mut().filter(|_| !self.mappings_asked) {
            mappings.rest(&mut self.ebpf, &self.ages.clock);
        }
        tracing::info!("no process is traced by its pages any more: memprof's programs at the machine's page faults, page allocations and mapping calls are detached");
    }

    /// Takes off the programs that read every process's mapping calls once no process traced by
    /// its pages needs them (each left has probes of its own at its wrappers) and `--mappings`
    /// did not ask for them: a static program stripped of its symbols that exits no longer
    /// leaves every system call on the host slowed. The ranges the other processes' probes keep
    /// stay.
    fn rest_unneeded_mapping_programs(&mut self) {
        if self.mappings_asked || !self.read_machine_wide.is_empty() {
            return;
        }
        let Some(mappings) = &mut self.mappings else { return };
        if let Some(at) = mappings.rest_programs(&mut self.ebpf) {
            tracing::info!(
                at,
                "no process traced by its pages needs memprof's programs for every process's mapping calls any more: detached"
            );
        }
    }

    /// A process too busy for its calls to be traced one by one (`--max-rate`), or holding most
    /// of the live table (`daemon::tracer::crowding`): from now on it is traced by the pages it
    /// touches (see `watch_pages`), and what its calls recorded goes. Its `attachment` is
    /// replaced.
    pub fn switch_to_pages(&mut self, pid: NonZeroU32, attachment: &mut Attachment) -> anyhow::Result<()> {
        // Before its calls' probes go (`watch_pages` finds them loaded): a kernel that refuses
        // the page-fault programs leaves it traced by its calls.
        self.load_page_faults()?;
        // Its pages show Go's heap too: a sampler beside its calls goes with them.
        self.usdt.forget(pid.get());
        // Links shared per file still fire in it: they record its calls no more, from before
        // what they recorded is forgotten.
        self.update_traced(pid.get(), |flags| flags & !profiler_common::traced::SHARED)?;
        let old = std::mem::take(attachment);
        *attachment = self.restart(pid, old);
        attachment.merge(self.watch_pages(pid, Program::Running)?);
        self.moved_to_pages.insert(pid.get());
        Ok(())
    }

    /// Whether `pid` is traced by the pages it touches: every process with `--growth`, and one
    /// moved there (`switch_to_pages`).
    pub fn traces_pages(&self, pid: u32) -> bool {
        self.growth || self.moved_to_pages.contains(&pid)
    }

    /// Attaches every probe to `allocator` for `pid` only: the free probes, the return probes, one
    /// entry probe per allocation function (its `AllocFn` as cookie) and the dynamic linker's.
    /// On failure nothing stays attached; see `probe_allocator` for the order.
    pub fn attach(&mut self, allocator: &Allocator, pid: NonZeroU32) -> anyhow::Result<Attachment> {
        let mappings = procfs::file_mappings(pid.get()).unwrap_or_default();
        self.attach_child(allocator, pid, &mappings).inspect_err(|_| self.forget_state(&HashSet::from([pid.get()])))
    }

    /// `attach` for a child a traced process forked, which often exits before its probes are in
    /// place (a database session). On failure only `TRACED` lets go of it at once: the caller
    /// has `forget_exited` purge what the maps hold about it later, with the other children that
    /// went, in one walk of the maps instead of one each.
    /// `mappings`, the child's as read just before (none once it is gone), give its unwind tables
    /// and its dynamic linker.
    pub fn attach_child(
        &mut self,
        allocator: &Allocator,
        pid: NonZeroU32,
        mappings: &[FileMapping],
    ) -> anyhow::Result<Attachment> {
        // Tables first: the first allocation's stack needs them. Its dynamic linker is not hooked
        // yet, so the count of its code changes is none, read before or after the mappings.
        let before = self.before_mappings(pid.get());
        if !mappings.is_empty() {
            self.sync_mappings_with(pid.get(), mappings, before);
        }
        self.attach_probes(allocator, pid, Program::Running, mappings)
            .inspect_err(|_| self.let_go(&HashSet::from([pid.get()])))
    }

    /// `attach` for `memprof run`'s command, still memprof's forked image before its exec into
    /// `files` (see `allocator::for_command`): their tables are built now, and its mappings read
    /// once it has exec'd (see `commands::family`).
    pub fn attach_before_exec(
        &mut self,
        allocator: &Allocator,
        pid: NonZeroU32,
        files: &[PathBuf],
    ) -> anyhow::Result<Attachment> {
        self.unwind.preload(pid.get(), files);
        // Its memory is memprof's until the exec: none of it is the command's.
        let mappings = procfs::file_mappings(pid.get()).unwrap_or_default();
        self.attach_probes(allocator, pid, Program::BeforeExec(files), &mappings)
            .inspect_err(|_| self.forget_exited(&HashSet::from([pid.get()])))
    }

    /// Probes `allocator`'s files for `pid`, which may never map them (see `allocator::standby`):
    /// the kernel puts a file's probes in place when the process maps it.
    pub fn attach_standby(&mut self, allocator: &Allocator, pid: NonZeroU32) -> anyhow::Result<Attachment> {
        self.probe_allocator_or_forget(allocator, pid)
    }

    /// The process is in `TRACED` first, as shared links that exist already record it from then on.
    /// On failure the caller forgets it.
    fn attach_probes(
        &mut self,
        allocator: &Allocator,
        pid: NonZeroU32,
        program: Program,
        mappings: &[FileMapping],
    ) -> anyhow::Result<Attachment> {
        self.track(pid.get())?;
        // Checked before each set of breakpoints goes in, each taking milliseconds.
        allocator::refuse_valgrind(pid.get())?;
        let probed = if self.growth { self.watch_pages(pid, program) } else { self.probe_allocator(allocator, pid) };
        let mut attachment = probed?;
        if let Err(err) = allocator::refuse_valgrind(pid.get()) {
            // At once, not in the background: valgrind may reach the breakpoints any moment.
            self.detach(attachment);
            return Err(err.into());
        }
        self.hook_linker(&mut attachment, pid, mappings);
        Ok(attachment)
    }

    /// Reports every exec (and fork) on the host too, as `flags` (`discover::`) say: how the
    /// daemon finds the processes its rules match as they start.
    pub fn discover(&mut self, flags: u32, exec_names: &[[u8; profiler_common::COMM_BYTES]]) -> anyhow::Result<()> {
        events::discover(&mut self.ebpf, flags, exec_names)
    }

    /// No exec or fork in cgroup `id`, which no rule contains, is reported from now on (see
    /// `discover::CGROUPS`).
    pub fn keep_back_cgroup(&mut self, id: u64) -> anyhow::Result<()> {
        events::keep_back_cgroup(&mut self.ebpf, id)
    }

    /// Every exec and fork is reported again, whatever its cgroup.
    pub fn forget_kept_back_cgroups(&mut self) -> anyhow::Result<()> {
        events::forget_kept_back_cgroups(&mut self.ebpf)
    }

    /// Which links the processes attached from now on get (see `shared`); `PerProcess` until set.
    pub fn set_probe_links(&mut self, policy: ProbeLinks) {
        self.shared.set_policy(policy);
    }

    /// Processes are about to be attached one after the other, `files` of them mapping each file
    /// (see `SharedLinks::attaching`).
    pub fn attaching(&mut self, files: HashMap<FileId, usize>) {
        self.shared.attaching(files);
    }

    /// Whether `pid`, about to get its first link, in `file`, is to share links (see `shared`);
    /// always for a process whose main thread has exited (pthread_exit), which a link's pid
    /// filter cannot name any more (the kernel compares the leader's memory, which is gone).
    /// Perf-event uprobes are per process.
    fn to_share(&self, pid: NonZeroU32, file: FileId) -> bool {
        self.method != Method::PerfEvents && (self.shared.should_share(file) || procfs::leader_exited(pid.get()))
    }

    /// Attaches program `name` at `points` of the file at `path` for `pid`: links of its own, or
    /// its share of the links every traced process mapping the file uses (see `shared`).
    fn add_probes(
        &mut self,
        attachment: &mut Attachment,
        name: &'static str,
        (path, opened): (&Path, &Opened),
        points: &[Point],
        pid: NonZeroU32,
    ) -> anyhow::Result<()> {
        let file = opened.id();
        let shares = match self.shared.shares(pid.get()) {
            Some(shares) => shares,
            None => {
                let shares = self.to_share(pid, file);
                // Before its first link: shared links record the process from then on.
                self.track_sharing(pid.get(), shares)?;
                self.shared.decide(pid.get(), shares);
                shares
            }
        };
        self.shared.uses(pid.get(), file);
        if !shares {
            let thread = if self.method == Method::PerfEvents { self.probe_thread(pid.get())? } else { pid.get() };
            return attachment.add(&mut self.ebpf, self.method, name, (path, opened), points, Some((pid, thread)));
        }
        let (ebpf, method) = (&mut self.ebpf, self.method);
        let links = self.shared.get_or_attach(path, file, name, points, || {
            let points: Vec<Point> =
                points.iter().map(|p| Point { cookie: p.cookie | profiler_common::SHARED_LINK, ..*p }).collect();
            let mut links = Attachment::default();
            links.add(ebpf, method, name, (path, opened), &points, None)?;
            Ok(links)
        })?;
        attachment.share(links);
        Ok(())
    }

    /// The files whose probe links are shared: every process that maps one takes a trap at
    /// each of its probed calls, traced or not.
    pub fn shared_files(&self) -> HashSet<FileId> {
        self.shared.shared_files()
    }

    /// Detaches `attachment` and forgets what the maps hold about `pid`: after an attach that
    /// failed part of the way (typically, the process exited meanwhile), whose first probes may
    /// have recorded some of its allocations already, and after an exec.
    pub(super) fn take_back(&mut self, attachment: Attachment, pid: NonZeroU32) {
        self.withdraw(attachment, pid);
        self.forget_state(&HashSet::from([pid.get()]));
    }

    /// `take_back` but the forgetting, which walks every map: left to the caller.
    fn withdraw(&mut self, attachment: Attachment, pid: NonZeroU32) {
        self.detach(attachment);
        self.shared.leave(pid.get());
        self.probe_threads.forget(&mut self.ebpf, pid.get());
    }

    /// `probe_allocator`, forgetting what its first probes recorded when it fails.
    fn probe_allocator_or_forget(&mut self, allocator: &Allocator, pid: NonZeroU32) -> anyhow::Result<Attachment> {
        self.probe_allocator(allocator, pid).inspect_err(|_| self.forget_state(&HashSet::from([pid.get()])))
    }

    /// The allocator's probes alone (see `attach`), in each of its files, after its tables.
    pub fn attach_allocator(&mut self, allocator: &Allocator, pid: NonZeroU32) -> anyhow::Result<Attachment> {
        // Tables first: the first allocation's stack needs them.
        self.sync_mappings(pid.get());
        if self.traces_pages(pid.get()) {
            return self.watch_pages(pid, Program::Running);
        }
        self.probe_allocator_or_forget(allocator, pid)
    }

    /// `--growth`: the page-fault events of `pid`'s threads, and the pages of the anonymous
    /// memory it has now (when it runs its `program`) and maps from now on kept (see `mappings`).
    fn watch_pages(&mut self, pid: NonZeroU32, program: Program) -> anyhow::Result<Attachment> {
        // Taken off when the last process traced by its pages went (`rest_page_faults`).
        self.load_page_faults()?;
        let mut attachment = Attachment::default();
        // Before its ranges are read: a mapping made in between is not missed.
        self.read_mapping_calls(pid, program, &mut attachment)?;
        let existing: Vec<(u64, u64)> = if matches!(program, Program::Running) {
            let regions = procfs::regions(pid.get()).with_context(|| format!("reading the mappings of pid {}", pid))?;
            let anonymous = |r: &&procfs::Region| r.writable && !r.shared && (r.path.is_empty() || r.path == "[heap]");
            regions.iter().filter(anonymous).map(|r| (r.start, r.end)).collect()
        } else {
            Vec::new()
        };
        if let Some(mappings) = &mut self.mappings {
            mappings.watch_pages(pid.get(), &existing);
        }
        // Before its first fault: a page it touches is given back by `madvise` too from then on.
        self.update_traced(pid.get(), |flags| flags | profiler_common::traced::GROWTH)?;
        attachment.add_page_faults(faults::open(&mut self.ebpf, pid.get())?);
        Ok(attachment)
    }

    /// The process runs meanwhile (a child just forked allocates at once), so the order matters.
    /// Free probes go first, in every file (a block one file allocates, another's free may free):
    /// an allocation recorded before its free probe is in place is seen never freed, and its
    /// address, given out again, counted a missed free. A free before the allocation probes is
    /// only an unknown free. Return probes go before entry probes: an entry probe that fires
    /// before its return probe exists would leave in-flight state behind that nothing clears.
    /// Meanwhile the process is `traced::ATTACHING`: the returns of calls that entered before
    /// their entry probe was in place are no drops.
    /// On failure nothing stays attached, and the caller forgets what the first probes recorded.
    fn probe_allocator(&mut self, allocator: &Allocator, pid: NonZeroU32) -> anyhow::Result<Attachment> {
        use profiler_common::traced::ATTACHING;
        self.update_traced(pid.get(), |flags| flags | ATTACHING)?;
        let attached = self.attach_allocator_probes(allocator, pid);
        // All in, or all withdrawn on a failure: either way, from now on.
        self.probes_in_place(pid.get());
        let settled = self.update_traced(pid.get(), |flags| flags & !ATTACHING);
        match (attached, settled) {
            (Ok(attachment), Ok(())) => Ok(attachment),
            (Ok(attachment), Err(err)) => {
                self.withdraw(attachment, pid);
                Err(err)
            }
            (Err(err), _) => Err(err),
        }
    }

    /// `probe_allocator`'s links, in its order.
    fn attach_allocator_probes(&mut self, allocator: &Allocator, pid: NonZeroU32) -> anyhow::Result<Attachment> {
        let points = |file: &allocator::AllocatorFile| {
            let allocs: Vec<Point> =
                file.allocs.iter().map(|p| Point { offset: p.offset, cookie: p.cookie() }).collect();
            // A completion site's calls end there: no return probe.
            let returns: Vec<Point> = file
                .allocs
                .iter()
                .filter(|p| p.completion.is_none())
                .map(|p| Point { offset: p.offset, cookie: p.return_cookie() })
                .collect();
            let frees: Vec<Point> = file
                .frees
                .iter()
                .map(|p| {
                    let c_library = p.c_library_code.and_then(|(below, above)| c_library_free_cookie(below, above));
                    let kind = if p.wrapper { FREE_WRAPPER } else { c_library.unwrap_or(0) };
                    Point { offset: p.offset, cookie: kind | moved_arguments_cookie(&p.moved) }
                })
                .collect();
            (allocs, returns, frees)
        };
        // Each file opened for all its links, and only if it is the file whose entry points were
        // read: its path may name another by now.
        let opened = allocator
            .files
            .iter()
            .map(|file| {
                Opened::open_same(&file.attach_path, file.id)
                    .with_context(|| format!("{} changed since memprof read it", file.display_path))
            })
            .collect::<anyhow::Result<Vec<Opened>>>()?;
        let files: Vec<_> = allocator
            .files
            .iter()
            .zip(&opened)
            .map(|(file, opened)| ((&*file.attach_path, opened), points(file)))
            .collect();
        let frees = files.iter().map(|(path, (_, _, frees))| (FREE_PROGRAM, *path, frees));
        let alloc_programs: &[&'static str] = match self.method {
            Method::Sessions => &[SESSION_PROGRAM],
            _ => &[RETURN_PROGRAM, ENTRY_PROGRAM],
        };
        let allocs = alloc_programs.iter().flat_map(|&name| {
            files.iter().map(move |(path, (allocs, returns, _))| {
                (name, *path, if name == RETURN_PROGRAM { returns } else { allocs })
            })
        });
        let mut attachment = Attachment::default();
        for (name, path, points) in frees.chain(allocs) {
            if let Err(err) = self.add_probes(&mut attachment, name, path, points, pid) {
                // What the first probes recorded the caller forgets.
                self.withdraw(attachment, pid);
                return Err(err);
            }
        }
        Ok(attachment)
    }

    /// After `pid` exec'd (`exec`, its event): its old program's probes go (they were on the old
    /// program's files), with what the old program left in the maps; what the new one recorded
    /// meanwhile, through the probes of files both map (the C library), stays. The new program's
    /// dynamic linker is hooked at once; its allocator is probed by `attach_allocator` once
    /// mapped (`allocator::find`), which for a dynamic program is after the dynamic linker has
    /// loaded the C library.
    pub fn exec_happened(&mut self, pid: NonZeroU32, old: Attachment, exec: &ProcessEvent) -> Attachment {
        self.withdraw(old, pid);
        // Its sampler's probes went with the old program: the new one is traced as it is found.
        self.usdt.forget(pid.get());
        self.image_replaced(pid, exec);
        self.unwind.forget(&mut self.ebpf, pid.get());
        self.sync_mappings(pid.get());
        let mut attachment = Attachment::default();
        self.attach_dl_hook(&mut attachment, pid);
        attachment
    }

    /// After `pid` exec'd (`exec`, its event) with its probes kept: what its old program left in
    /// the maps goes, and what the new program recorded since its first instruction stays (the
    /// kernel restarted its heap figures and counters at the exec, see `ProcessEvent::image`).
    pub fn image_replaced(&mut self, pid: NonZeroU32, exec: &ProcessEvent) {
        let doomed = aggregate::Doomed::OldImage { tgid: pid.get(), image: exec.image, exec_ns: exec.time_ns };
        // Ranges other processes map hold stacks; the new program's may too by now.
        if let Err(err) = self.purge(doomed, &HashSet::new()) {
            tracing::warn!(pid = pid.get(), "dropping what the old program left in the maps failed: {err:#}");
        }
        (self.walked_entries, self.stack_entries) = (None, None);
        self.stillness.forget(pid.get());
        self.probe_threads.exec_happened(pid.get());
        self.unwind_events.exec_happened(pid.get(), exec.time_ns);
        self.unwind.exec_happened(pid.get(), exec.time_ns);
        if let Some(mappings) = &mut self.mappings {
            mappings.forget(pid.get(), &self.ages.clock);
        }
    }

    /// `aggregate::purge`, and a new generation: no walk the kernel remembered gives a stack id
    /// the purge removed. The stacks that the ranges and pages of every process but those in
    /// `except` hold are kept, with those of the events still in the ring: a page touched just
    /// before keeps its stack.
    pub(super) fn purge(&mut self, doomed: aggregate::Doomed<'_>, except: &HashSet<u32>) -> anyhow::Result<()> {
        let (mappings, clock) = (&mut self.mappings, &self.ages.clock);
        let held = || {
            let Some(mappings) = mappings else { return HashSet::new() };
            mappings.drain(clock);
            mappings.stack_ids(except)
        };
        let purged = aggregate::purge(&mut self.ebpf, doomed, held);
        // A purge that failed part way may have removed stacks already.
        self.unwind.new_generation(&mut self.ebpf)?;
        purged
    }

    /// Starts `pid`'s tracing again with nothing of what was recorded: its probes go with
    /// everything the maps hold about it, and its dynamic linker is hooked again.
    pub fn restart(&mut self, pid: NonZeroU32, old: Attachment) -> Attachment {
        self.take_back(old, pid);
        self.sync_mappings(pid.get());
        let mut attachment = Attachment::default();
        self.attach_dl_hook(&mut attachment, pid);
        attachment
    }

    /// Hooks the dynamic linker of `pid`, so that libraries it loads later get unwind tables
    /// (see `mappings_changed` in the eBPF programs). A static binary has none, and is not hooked.
    pub(super) fn attach_dl_hook(&mut self, attachment: &mut Attachment, pid: NonZeroU32) {
        let mappings = procfs::file_mappings(pid.get()).unwrap_or_default();
        self.hook_linker(attachment, pid, &mappings);
    }

    /// `attach_dl_hook` with `pid`'s mappings read already.
    fn hook_linker(&mut self, attachment: &mut Attachment, pid: NonZeroU32, mappings: &[FileMapping]) {
        let Some(linker) = mappings.iter().find(|m| m.executable && is_dynamic_linker(&m.path)) else { return };
        let Some((path, opened)) = linker.reachable_paths(pid.get()).into_iter().find_map(|path| {
            let opened = Opened::open(Path::new(&path)).ok()?;
            Some((path, opened))
        }) else {
            return;
        };
        let path = Path::new(&path);
        let attached = allocator::function_file_offset(&opened, DL_HOOK)
            .with_context(|| format!("{DL_HOOK} not found in {}", path.display()))
            .and_then(|offset| {
                // Where the linker's list of objects is, from the probe's address (see the program).
                let cookie = allocator::symbol_distance(&opened, DL_HOOK, R_DEBUG).unwrap_or(0);
                let hook = [Point { offset, cookie }];
                self.add_probes(attachment, MAPPINGS_PROGRAM, (path, &opened), &hook, pid)
            });
        match attached {
            Ok(()) => self.unwind.linker_hooked(pid.get()),
            Err(err) => tracing::warn!("libraries pid {pid} loads later may lack unwind tables: {err:#}"),
        }
    }

    /// Detaches one process's probes (see `probes` for what it costs), with the shared links no
    /// other traced process uses.
    pub fn detach(&mut self, attachment: Attachment) {
        drop(self.release(attachment));
    }

    /// Detaches one process's probes on the detacher thread, for a process that has exited or
    /// when memprof stops: the caller goes on at once (`wait_detached` waits for them).
    pub fn detach_in_background(&mut self, attachment: Attachment) {
        let own = self.release(attachment);
        if let Some(detacher) = &self.detacher {
            detacher.detach(own);
        }
    }

    /// Returns once every probe detached in the background is gone.
    pub fn wait_detached(&mut self) {
        if let Some(detacher) = self.detacher.take() {
            detacher.finish();
        }
    }

    /// `wait_detached` at the end of `attach` or `run`. Perf-event uprobes close one at a time
    /// under a kernel-wide lock (docs: reference/kernels.md#kernel-requirements), so those are left to a child that closes them
    /// after memprof has ended (see `Detacher::hand_over`): the processes memprof traced keep
    /// taking their traps until it has. Not for the daemon: the child holds every descriptor it
    /// had, its listening sockets too, which a restarted daemon could not bind meanwhile.
    pub fn leave_detached(&mut self) {
        match self.detacher.take() {
            Some(detacher) if self.method == Method::PerfEvents => detacher.hand_over(),
            Some(detacher) => detacher.finish(),
            None => {}
        }
    }

    /// Takes `attachment`'s share of shared links out of it, and detaches at once the shared
    /// links no traced process uses any more: before anything new is attached, so that a file's
    /// old and new links never both fire. Returns the process's own links.
    fn release(&mut self, mut attachment: Attachment) -> Attachment {
        attachment.unshare();
        let mut unused = Attachment::default();
        for links in self.shared.take_unused() {
            unused.merge(links);
        }
        drop(unused);
        attachment
    }
}
