//! The embedded eBPF object: loading it with the chosen map sizes and attaching its probes.

mod usdt;

use std::{
    collections::{HashMap, HashSet},
    fs,
    num::NonZeroU32,
    path::Path,
};

use anyhow::Context as _;
use aya::{Ebpf, EbpfLoader};
use profiler_common::{c_library_free_cookie, FREE_WRAPPER};

pub use crate::kernel::probes::Attachment;
use crate::{
    error::UserError,
    kernel::ages::{AgeBook, Clock},
    kernel::aggregate::{self, KernelSnapshot},
    kernel::btf,
    kernel::detacher::Detacher,
    kernel::events::{self, ProcessEvent, ProcessEvents},
    kernel::faults,
    kernel::mappings::MappedRanges,
    kernel::probes::{self, Method, ENTRY_PROGRAM, FREE_PROGRAM, MAPPINGS_PROGRAM, RETURN_PROGRAM, SESSION_PROGRAM},
    kernel::sample_rates,
    kernel::settings::LoadSettings,
    kernel::shared::{FileId, ProbeLinks, SharedLinks},
    kernel::stillness::Stillness,
    kernel::uprobe_multi::Point,
    process::allocator::{self, Allocator},
    process::{
        link_map,
        procfs::{self, FileMapping},
    },
    unwind::{Registry, UnwindEvents},
};

/// `ld-linux-x86-64.so.2` and the like, under any directory.
fn is_dynamic_linker(path: &str) -> bool {
    path.rsplit('/').next().is_some_and(|name| name.starts_with("ld-linux") || name.starts_with("ld-musl"))
}

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/profiler-ebpf"));

/// The dynamic linker calls it before and after every change to the loaded libraries.
const DL_HOOK: &str = "_dl_debug_state";
/// The dynamic linker's `struct r_debug`, whose `r_map` lists the loaded objects.
const R_DEBUG: &str = "_r_debug";

/// Loaded programs and maps; what is attached to each process is its `Attachment`.
pub struct Loaded {
    pub ebpf: Ebpf,
    /// How the programs attach: uprobe_multi links, or perf-event uprobes where the kernel lacks them.
    method: Method,
    /// The unwind tables of the traced processes' files.
    pub unwind: Registry,
    /// Processes that loaded or unloaded libraries, and walks left to finish.
    pub unwind_events: UnwindEvents,
    /// What userspace keeps of the ages of outstanding memory.
    pub ages: AgeBook,
    /// Execs and forks of the traced processes.
    pub process_events: ProcessEvents,
    /// The anonymous memory they map outside their allocator's blocks (with `--mappings`), and
    /// the pages they touch (`--growth`).
    mappings: Option<MappedRanges>,
    /// Whether processes are traced by their page faults instead of their allocator calls
    /// (`--growth`, see `trace_page_faults`).
    growth: bool,
    /// The page-fault program is loaded, for `--growth` or a process switched to it.
    faults_loaded: bool,
    /// Whether the processes attached from now on report their forks (`--follow-forks`).
    pub follow_forks: bool,
    /// Which processes share links with every traced process that maps the same file, rather
    /// than get links of their own (see `shared`).
    shared: SharedLinks,
    /// Detaches the probes of processes that exited.
    detacher: Option<Detacher>,
    /// The processes traced through their allocator's `otel_memory` probes (`--usdt`).
    usdt: usdt::UsdtProbes,
    /// Which processes did nothing since the last interval.
    stillness: Stillness,
    /// The entries of `LIVE` and `STACK_STATS` at the last walk of the maps, while no process
    /// has been purged since: a read of no process then needs no walk.
    walked_entries: Option<(u64, u64)>,
    /// The entries of `STACKS` and `FREE_STACKS` (see `stack_entries`) since the last walk.
    stack_entries: Option<(u64, u64)>,
}

/// Checks what loading needs before trying, so the error can say what is missing.
pub fn check_support() -> Result<(), UserError> {
    if !Path::new("/sys/kernel/btf/vmlinux").exists() {
        return Err(UserError::KernelSupport("BTF (/sys/kernel/btf/vmlinux)"));
    }
    if !Path::new("/sys/bus/event_source/devices/uprobe").exists() {
        return Err(UserError::KernelSupport("the uprobe perf event source"));
    }
    check_privileges()
}

/// The capabilities memprof needs, each with what it is for (docs: install.md#permissions), as numbered
/// in linux/capability.h. CAP_SYS_ADMIN is needed for uprobes on current kernels, and the kernel
/// lets it stand for CAP_BPF and CAP_PERFMON too (`bpf_capable`, `perfmon_capable`), so those
/// add nothing. Each one was checked to be needed: without it a step fails, or a file is skipped.
const NEEDED: [(u32, &str); 3] = [
    (21, "CAP_SYS_ADMIN (BPF programs, uprobes, /proc/PID/map_files)"),
    (19, "CAP_SYS_PTRACE (other users' processes' maps, memory and files in /proc)"),
    (2, "CAP_DAC_READ_SEARCH (a process's executable and libraries where only their owner may read them)"),
];

fn check_privileges() -> Result<(), UserError> {
    let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
    let effective = status
        .lines()
        .find_map(|line| line.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .unwrap_or(0);
    let missing: Vec<&str> =
        NEEDED.iter().filter(|(bit, _)| effective & (1 << bit) == 0).map(|(_, name)| *name).collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(UserError::Privileges { missing: missing.join(" and ") })
    }
}

/// Loads the programs; ages are kept in generations of a quarter of `interval_s` (see `ages`).
/// `usdt`: processes are traced through their `otel_memory` probes, whose weights take a table as
/// large as `LIVE`; without it that table gets one entry, not `--max-live`'s buckets.
pub fn load(sizes: LoadSettings, interval_s: f64, usdt: bool) -> anyhow::Result<Loaded> {
    let clock = Clock::for_interval(crate::kernel::aggregate::monotonic_now_ns(), interval_s);
    let task = btf::kernel_member_offsets("task_struct", &["pid", "tgid", "mm", "utask"])
        .context("finding task_struct in BTF")?;
    // The return addresses uretprobes took: task->utask->return_instances, a list.
    let utask =
        btf::kernel_member_offsets("uprobe_task", &["return_instances"]).context("finding uprobe_task in BTF")?;
    let taken = btf::kernel_member_offsets("return_instance", &["orig_ret_vaddr", "chained", "next", "stack"])
        .context("finding return_instance in BTF")?;
    // The way to a process's uretprobe trampoline: task->mm->uprobes_state.xol_area->vaddr.
    let mm = btf::kernel_member_offsets("mm_struct", &["uprobes_state"]).context("finding mm_struct in BTF")?;
    let uprobes = btf::kernel_member_offsets("uprobes_state", &["xol_area"]).context("finding uprobes_state in BTF")?;
    let xol = btf::kernel_member_offsets("xol_area", &["vaddr"]).context("finding xol_area in BTF")?;
    // The path an exec ran (see `ProcessEvent::path`); without it, an exec'd program is named
    // from `/proc` only.
    let bprm = btf::kernel_member_offsets("linux_binprm", &["filename"]).map_or(0, |offsets| offsets[0]);
    let ebpf = EbpfLoader::new()
        .map_max_entries("LIVE", sizes.max_live)
        .map_max_entries("USDT_WEIGHTS", if usdt { sizes.max_live } else { 1 })
        .map_max_entries("STACKS", sizes.max_stacks)
        .map_max_entries("FREE_STACKS", FREE_STACKS)
        .map_max_entries("STACK_STATS", stack_stats_capacity(sizes))
        .map_max_entries("UNWIND_SHARDS", sizes.max_unwind_rows.div_ceil(profiler_common::UNWIND_SHARD_ROWS))
        .override_global("FRAME_LIMIT", &sizes.max_frames, true)
        .override_global("FULL_FREE_STACKS", &u32::from(sizes.full_free_stacks), true)
        .override_global("CLOCK_BASE_NS", &clock.base_ns, true)
        .override_global("GENERATION_NS", &clock.length_ns, true)
        .override_global("TASK_PID_OFFSET", &task[0], true)
        .override_global("TASK_TGID_OFFSET", &task[1], true)
        .override_global("BPRM_FILENAME_OFFSET", &bprm, true)
        .override_global("TASK_MM_OFFSET", &task[2], true)
        .override_global("MM_XOL_AREA_OFFSET", &(mm[0] + uprobes[0]), true)
        .override_global("XOL_AREA_VADDR_OFFSET", &xol[0], true)
        .override_global("TASK_UTASK_OFFSET", &task[3], true)
        .override_global("UTASK_RETURNS_OFFSET", &utask[0], true)
        .override_global("RETURN_ADDRESS_OFFSET", &taken[0], true)
        .override_global("RETURN_CHAINED_OFFSET", &taken[1], true)
        .override_global("RETURN_NEXT_OFFSET", &taken[2], true)
        .override_global("RETURN_STACK_OFFSET", &taken[3], true)
        .load(OBJECT)
        .context("loading the eBPF programs")?;
    let mut ebpf = ebpf;
    let unwind = Registry::new(&mut ebpf, sizes.unwind, sizes.max_unwind_rows, sizes.max_frames)?;
    let unwind_events = UnwindEvents::new(&mut ebpf)?;
    let method = probes::load(&mut ebpf)?;
    let process_events = events::attach(&mut ebpf)?;
    // Only when asked for: the programs run at every mapping call on the host.
    let mappings = if sizes.mappings { Some(MappedRanges::attach(&mut ebpf)?) } else { None };
    Ok(Loaded {
        ebpf,
        method,
        unwind,
        unwind_events,
        ages: AgeBook::new(clock),
        process_events,
        mappings,
        growth: false,
        faults_loaded: false,
        follow_forks: false,
        shared: SharedLinks::new(ProbeLinks::PerProcess),
        detacher: Some(Detacher::spawn().context("starting the detacher thread")?),
        usdt: usdt::UsdtProbes::default(),
        stillness: Stillness::default(),
        walked_entries: None,
        stack_entries: None,
    })
}

/// Capacity of `TRACED`, the processes whose execs and forks are reported (the eBPF default).
pub const TRACED_CAPACITY: u32 = 4_096;

/// Capacity of `FREE_STACKS`, where free sites' stacks are kept for double-free reports.
pub const FREE_STACKS: u32 = 16_384;

/// One totals row per (process, stack): as many as stacks, with room for stacks shared by processes.
pub fn stack_stats_capacity(sizes: LoadSettings) -> u32 {
    sizes.max_stacks.saturating_mul(2)
}

impl Loaded {
    /// Traces the processes attached from now on by the pages they touch instead of their
    /// allocator calls (`--growth`): their allocator gets no probe.
    pub fn trace_page_faults(&mut self) -> anyhow::Result<()> {
        self.load_page_faults()?;
        self.growth = true;
        Ok(())
    }

    /// The page-fault program and the ring its pages go through, once.
    fn load_page_faults(&mut self) -> anyhow::Result<()> {
        if self.faults_loaded {
            return Ok(());
        }
        faults::load(&mut self.ebpf)?;
        if self.mappings.is_none() {
            self.mappings = Some(MappedRanges::attach(&mut self.ebpf)?);
        }
        self.faults_loaded = true;
        Ok(())
    }

    /// A process too busy for its calls to be traced one by one (`--max-rate`): from now on it
    /// is traced by the pages it touches (see `watch_pages`), and what its calls recorded goes.
    /// Its `attachment` is replaced.
    pub fn switch_to_pages(&mut self, pid: NonZeroU32, attachment: &mut Attachment) -> anyhow::Result<()> {
        self.load_page_faults()?;
        let old = std::mem::take(attachment);
        *attachment = self.restart(pid, old);
        attachment.merge(self.watch_pages(pid, true)?);
        Ok(())
    }

    /// Attaches every probe to `allocator` for `pid` only: the free probes, the return probes, one
    /// entry probe per allocation function (its `AllocFn` as cookie) and the dynamic linker's.
    /// On failure nothing stays attached; see `probe_allocator` for the order.
    pub fn attach(&mut self, allocator: &Allocator, pid: NonZeroU32) -> anyhow::Result<Attachment> {
        // Tables first: the first allocation's stack needs them.
        self.sync_mappings(pid.get());
        self.attach_probes(allocator, pid, true)
    }

    /// `attach` for `memprof run`'s command, still memprof's forked image before its exec into
    /// `files` (see `allocator::for_command`): their tables are built now, and its mappings read
    /// once it has exec'd (see `commands::family`).
    pub fn attach_before_exec(
        &mut self,
        allocator: &Allocator,
        pid: NonZeroU32,
        files: &[std::path::PathBuf],
    ) -> anyhow::Result<Attachment> {
        self.unwind.preload(pid.get(), files);
        // Its memory is memprof's until the exec: none of it is the command's.
        self.attach_probes(allocator, pid, false)
    }

    /// Probes `allocator`'s files for `pid`, which may never map them (see `allocator::standby`):
    /// the kernel puts a file's probes in place when the process maps it.
    pub fn attach_standby(&mut self, allocator: &Allocator, pid: NonZeroU32) -> anyhow::Result<Attachment> {
        self.probe_allocator(allocator, pid)
    }

    /// The process is in `TRACED` first, as shared links that exist already record it from then on.
    fn attach_probes(
        &mut self,
        allocator: &Allocator,
        pid: NonZeroU32,
        has_memory: bool,
    ) -> anyhow::Result<Attachment> {
        self.track(pid.get())?;
        let probed = if self.growth { self.watch_pages(pid, has_memory) } else { self.probe_allocator(allocator, pid) };
        let mut attachment = match probed {
            Ok(attachment) => attachment,
            Err(err) => {
                self.forget_exited(&HashSet::from([pid.get()]));
                return Err(err);
            }
        };
        self.attach_dl_hook(&mut attachment, pid);
        Ok(attachment)
    }

    /// Reports every exec (and fork) on the host too, as `flags` (`discover::`) say: how the
    /// daemon finds the processes its rules match as they start.
    pub fn discover(&mut self, flags: u32) -> anyhow::Result<()> {
        events::discover(&mut self.ebpf, flags)
    }

    /// Which links the processes attached from now on get (see `shared`); `PerProcess` until set.
    pub fn set_probe_links(&mut self, policy: ProbeLinks) {
        self.shared.set_policy(policy);
    }

    /// `n` processes are about to be attached one after the other (see `SharedLinks::attaching`).
    pub fn attaching(&mut self, n: usize) {
        self.shared.attaching(n);
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
        path: &Path,
        points: &[Point],
        pid: NonZeroU32,
    ) -> anyhow::Result<()> {
        let file = FileId::of(path)?;
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
        let (ebpf, method) = (&mut self.ebpf, self.method);
        if !shares {
            return attachment.add(ebpf, method, name, path, points, Some(pid));
        }
        let links = self.shared.get_or_attach(path, file, name, points, || {
            let points: Vec<Point> =
                points.iter().map(|p| Point { cookie: p.cookie | profiler_common::SHARED_LINK, ..*p }).collect();
            let mut links = Attachment::default();
            links.add(ebpf, method, name, path, &points, None)?;
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
    fn take_back(&mut self, attachment: Attachment, pid: NonZeroU32) {
        self.detach(attachment);
        self.shared.leave(pid.get());
        self.forget_state(&HashSet::from([pid.get()]));
    }

    /// The allocator's probes alone (see `attach`), in each of its files, after its tables.
    pub fn attach_allocator(&mut self, allocator: &Allocator, pid: NonZeroU32) -> anyhow::Result<Attachment> {
        // Tables first: the first allocation's stack needs them.
        self.sync_mappings(pid.get());
        if self.growth {
            return self.watch_pages(pid, true);
        }
        self.probe_allocator(allocator, pid)
    }

    /// `--growth`: the page-fault events of `pid`'s threads, and the pages of the anonymous
    /// memory it has now (`has_memory`) and maps from now on kept (see `mappings`).
    fn watch_pages(&mut self, pid: NonZeroU32, has_memory: bool) -> anyhow::Result<Attachment> {
        let existing: Vec<(u64, u64)> = if has_memory {
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
        let mut attachment = Attachment::default();
        attachment.add_page_faults(faults::open(&mut self.ebpf, pid.get())?);
        Ok(attachment)
    }

    /// The process runs meanwhile (a child just forked allocates at once), so the order matters.
    /// Free probes go first, in every file (a block one file allocates, another's free may free):
    /// an allocation recorded before its free probe is in place is seen never freed, and its
    /// address, given out again, counted a missed free. A free before the allocation probes is
    /// only an unknown free. Return probes go before entry probes: an entry probe that fires
    /// before its return probe exists would leave in-flight state behind that nothing clears.
    fn probe_allocator(&mut self, allocator: &Allocator, pid: NonZeroU32) -> anyhow::Result<Attachment> {
        let points = |file: &allocator::AllocatorFile| {
            let allocs: Vec<Point> =
                file.allocs.iter().map(|p| Point { offset: p.offset, cookie: p.func as u64 }).collect();
            let frees: Vec<Point> = file
                .frees
                .iter()
                .map(|p| {
                    let c_library = p.c_library_code.and_then(|(below, above)| c_library_free_cookie(below, above));
                    Point { offset: p.offset, cookie: if p.wrapper { FREE_WRAPPER } else { c_library.unwrap_or(0) } }
                })
                .collect();
            (allocs, frees)
        };
        let files: Vec<_> = allocator.files.iter().map(|file| (&file.attach_path, points(file))).collect();
        let frees = files.iter().map(|(path, (_, frees))| (FREE_PROGRAM, *path, frees));
        let alloc_programs: &[&'static str] = match self.method {
            Method::Sessions => &[SESSION_PROGRAM],
            _ => &[RETURN_PROGRAM, ENTRY_PROGRAM],
        };
        let allocs =
            alloc_programs.iter().flat_map(|&name| files.iter().map(move |(path, (allocs, _))| (name, *path, allocs)));
        let mut attachment = Attachment::default();
        for (name, path, points) in frees.chain(allocs) {
            if let Err(err) = self.add_probes(&mut attachment, name, path, points, pid) {
                self.take_back(attachment, pid);
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
        self.detach(old);
        self.shared.leave(pid.get());
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
        let held = self.mappings.as_ref().map(|mappings| mappings.stack_ids(&HashSet::new())).unwrap_or_default();
        if let Err(err) = self.purge(doomed, &held) {
            tracing::warn!(pid = pid.get(), "dropping what the old program left in the maps failed: {err:#}");
        }
        (self.walked_entries, self.stack_entries) = (None, None);
        self.stillness.forget(pid.get());
        self.unwind_events.exec_happened(pid.get(), exec.time_ns);
        self.unwind.exec_happened(pid.get(), exec.time_ns);
        if let Some(mappings) = &mut self.mappings {
            mappings.forget(pid.get(), &self.ages.clock);
        }
    }

    /// `aggregate::purge`, and a new generation: no walk the kernel remembered gives a stack id
    /// the purge removed.
    fn purge(&mut self, doomed: aggregate::Doomed<'_>, held: &HashSet<u64>) -> anyhow::Result<()> {
        aggregate::purge(&mut self.ebpf, doomed, held)?;
        self.unwind.new_generation(&mut self.ebpf)
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

    /// Makes `pid`'s execs (and, with `follow_forks`, forks) reported in `process_events`.
    fn track(&mut self, pid: u32) -> anyhow::Result<()> {
        let shares = self.shared.shares(pid).unwrap_or(false);
        self.track_sharing(pid, shares)
    }

    /// `track`, and whether links shared per file record `pid` (`traced::SHARED`). A process
    /// traced by its pages stays so (`traced::GROWTH`, see `watch_pages`).
    fn track_sharing(&mut self, pid: u32, shares: bool) -> anyhow::Result<()> {
        use profiler_common::traced::{FOLLOW_FORKS, GROWTH, SHARED};
        let flags = if self.follow_forks { FOLLOW_FORKS } else { 0 } | if shares { SHARED } else { 0 };
        self.update_traced(pid, |old| flags | old & GROWTH)
    }

    /// Writes `pid`'s `TRACED` entry as `update` makes it from the flags it has (0 when none).
    /// Only the daemon's thread writes the map.
    fn update_traced(&mut self, pid: u32, update: impl FnOnce(u32) -> u32) -> anyhow::Result<()> {
        let mut traced: aya::maps::HashMap<_, u32, u32> =
            aya::maps::HashMap::try_from(self.ebpf.map_mut("TRACED").context("map TRACED missing")?)?;
        let flags = update(traced.get(&pid, 0).unwrap_or(0));
        traced.insert(pid, flags, 0)?;
        Ok(())
    }

    /// Removes everything memprof holds about `pids`, which have exited (or were detached while
    /// running): map entries, unwind tables, ages, process-event tracking.
    pub fn forget_exited(&mut self, pids: &HashSet<u32>) {
        // Out of `TRACED` first: shared links stop recording a process still running.
        if let Some(Ok(mut traced)) = self.ebpf.map_mut("TRACED").map(aya::maps::HashMap::<_, u32, u32>::try_from) {
            for pid in pids {
                let _ = traced.remove(pid);
            }
        }
        for &pid in pids {
            self.shared.forget(pid);
            self.usdt.forget(pid);
        }
        self.forget_state(pids);
    }

    /// What the maps, the stack walk and the ages hold about `pids`.
    fn forget_state(&mut self, pids: &HashSet<u32>) {
        // The stacks other processes' ranges and pages hold are theirs to keep.
        let held = self.mappings.as_ref().map(|mappings| mappings.stack_ids(pids)).unwrap_or_default();
        if let Err(err) = self.purge(aggregate::Doomed::Processes(pids), &held) {
            tracing::warn!("purging the maps of {} processes failed: {err:#}", pids.len());
        }
        (self.walked_entries, self.stack_entries) = (None, None);
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

    /// Reads the maps for `tgids` (see `aggregate::read`), with the ranges each maps.
    pub fn read(&mut self, tgids: &HashSet<u32>, min_age_ns: u64) -> anyhow::Result<KernelSnapshot> {
        if let Some(mappings) = &mut self.mappings {
            mappings.drain(&self.ages.clock);
        }
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
            process.usdt = self.usdt.traces(tgid);
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
        if let Some(mappings) = &mut self.mappings {
            mappings.drain(&self.ages.clock);
        }
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
        self.unwind.sync(&mut self.ebpf, pid).unwrap_or_else(|err| {
            tracing::warn!("reading the unwind tables of pid {pid}: {err:#}");
            false
        })
    }

    /// `pid`'s count of code changes, to read before its mappings for `sync_mappings_with` (see
    /// `unwind::Registry::code_changes`).
    pub fn code_changes(&mut self, pid: u32) -> u64 {
        self.unwind.code_changes(&mut self.ebpf, pid)
    }

    /// `sync_mappings` with `pid`'s mappings read already, after `code_changes` gave `changes`.
    pub fn sync_mappings_with(&mut self, pid: u32, mappings: &[FileMapping], changes: u64) {
        if let Err(err) = self.unwind.sync_with(&mut self.ebpf, pid, mappings, changes) {
            tracing::warn!("reading the unwind tables of pid {pid}: {err:#}");
        }
    }

    /// Syncs the mappings of every process that reported new ones or has a deferred walk, then
    /// finishes those walks on the tables just loaded; returns the pids.
    pub fn sync_changed_mappings(&mut self) -> Vec<u32> {
        self.sync_changed_mappings_with(procfs::exe_path, |_, _| {})
    }

    /// `sync_changed_mappings`, giving each process's mappings to `on_read` as soon as they are
    /// read, before the tables are built: a short-lived process may be gone a moment later. A
    /// process already gone has the mappings of the linker's last list of objects (`link_map`),
    /// or, without a dynamic linker, those of an executable loaded where it says; its
    /// executable's path from `exe_of`.
    pub fn sync_changed_mappings_with(
        &mut self,
        exe_of: impl Fn(u32) -> Option<String>,
        mut on_read: impl FnMut(u32, &[FileMapping]),
    ) -> Vec<u32> {
        let drained = self.unwind_events.drain();
        for &pid in &drained.pids {
            let changes = self.code_changes(pid);
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
            self.sync_mappings_with(pid, &mappings, changes);
        }
        for event in &drained.deferred {
            self.unwind.finish_deferred(&self.ebpf, event);
        }
        drained.pids
    }

    /// Records `pid`'s allocations by sampling from now on (see `sample_rates::set`).
    pub fn sample(&mut self, pid: u32, sample_bytes: u64) -> anyhow::Result<()> {
        sample_rates::set(&mut self.ebpf, pid, sample_bytes)
    }

    /// Hooks the dynamic linker of `pid`, so that libraries it loads later get unwind tables
    /// (see `mappings_changed` in the eBPF programs). A static binary has none, and is not hooked.
    fn attach_dl_hook(&mut self, attachment: &mut Attachment, pid: NonZeroU32) {
        let Ok(mappings) = procfs::file_mappings(pid.get()) else { return };
        let Some(linker) = mappings.iter().find(|m| m.executable && is_dynamic_linker(&m.path)) else { return };
        let Some(path) = linker.reachable_paths(pid.get()).into_iter().find(|p| Path::new(p).exists()) else { return };
        let path = Path::new(&path);
        let attached = allocator::function_file_offset(path, DL_HOOK)
            .with_context(|| format!("{DL_HOOK} not found in {}", path.display()))
            .and_then(|offset| {
                // Where the linker's list of objects is, from the probe's address (see the program).
                let cookie = allocator::symbol_distance(path, DL_HOOK, R_DEBUG).unwrap_or(0);
                let hook = [Point { offset, cookie }];
                self.add_probes(attachment, MAPPINGS_PROGRAM, path, &hook, pid)
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
