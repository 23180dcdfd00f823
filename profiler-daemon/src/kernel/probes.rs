//! How the programs are attached to a process: one `uprobe_multi` link per program where the kernel
//! has them, else one perf-event uprobe per probe. A link may fire for one process, or for every
//! process and be shared (see `shared`).
//!
//! Detaching is what differs: closing a perf-event uprobe waits for RCU grace periods under a
//! kernel-wide mutex (`perf_trace_destroy`), one at a time (docs: reference/limits.md#detaching); they
//! are closed by the same thread as links, and at the end of `attach` and `run` by a child
//! process after memprof has gone (`Detacher::hand_over`); more threads were no faster on 6.18
//! (measured), as the mutex serialises them. A uprobe_multi link waits for its grace periods
//! once for all of its probes. Perf-event uprobes are what Linux 6.1 gets (no uprobe_multi
//! links).

use std::{
    collections::{BTreeSet, HashMap},
    num::NonZeroU32,
    os::fd::{AsFd as _, AsRawFd as _, OwnedFd, RawFd},
    path::{Path, PathBuf},
    sync::Arc,
};

use anyhow::Context as _;
use aya::{
    programs::{ProbeKind, UProbe},
    Ebpf,
};

use crate::{
    kernel::{
        helper, perf_event,
        uprobe_multi::{self, Fires, Point},
    },
    process::file_cache::{FileId, Opened},
};

/// At every allocation function's entry; each probe's cookie is its `AllocFn`.
pub const ENTRY_PROGRAM: &str = "alloc_entry";
/// At every allocation function's return.
pub const RETURN_PROGRAM: &str = "alloc_return";
/// Entry and return of every allocation function in one uprobe session, instead of the two above.
pub const SESSION_PROGRAM: &str = "alloc_session";
pub const FREE_PROGRAM: &str = "free";
/// At the dynamic linker's `_dl_debug_state`.
pub const MAPPINGS_PROGRAM: &str = "mappings_changed";
/// Attached and detached at once on a process's probe sites (see `sweep_copies`).
const SWEEP_PROGRAM: &str = "sweep";
const PROGRAMS: [&str; 4] = [ENTRY_PROGRAM, RETURN_PROGRAM, FREE_PROGRAM, MAPPINGS_PROGRAM];

/// `MEMPROF_UPROBE_MULTI=0` makes memprof attach perf-event uprobes even where the kernel has
/// uprobe_multi links, and `MEMPROF_UPROBE_SESSION=0` entry and return links even where it has
/// uprobe sessions (troubleshooting switches, docs: reference/kernels.md#kernel-requirements; the tests use them to run each
/// kernel's way here).
const MULTI_SWITCH: &str = "MEMPROF_UPROBE_MULTI";
const SESSION_SWITCH: &str = "MEMPROF_UPROBE_SESSION";

/// Whether the switch `name` is set to 0.
fn switched_off(name: &str) -> bool {
    std::env::var_os(name).is_some_and(|value| value == "0")
}

/// How probes are attached, decided once when the programs are loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// uprobe_multi links, with allocation functions in one uprobe session (Linux 6.13+): a call
    /// that sampled mode does not draw skips its return probe.
    Sessions,
    /// One uprobe_multi link per program and process (Linux 6.10+, or a stable kernel with the
    /// process-wide pid filter).
    MultiLinks,
    /// One perf-event uprobe per probe.
    PerfEvents,
}

/// Loads the programs for uprobe_multi links where the kernel makes them (and `MEMPROF_UPROBE_MULTI`
/// is not 0), else for perf-event uprobes, saying so in one line. `links_wanted` false: for
/// perf-event uprobes, for a reason the caller has said.
pub fn load(ebpf: &mut Ebpf, links_wanted: bool) -> anyhow::Result<Method> {
    if !links_wanted {
        load_for_perf_events(ebpf)?;
        return Ok(Method::PerfEvents);
    }
    let fallback = if switched_off(MULTI_SWITCH) {
        format!("{MULTI_SWITCH}=0")
    } else {
        match load_for_multi_links(ebpf) {
            Ok(method) => return Ok(method),
            Err(why) => {
                for name in PROGRAMS.iter().chain(&[SESSION_PROGRAM, SWEEP_PROGRAM]) {
                    // Those not loaded yet have nothing to unload.
                    let _ = program(ebpf, name)?.unload();
                }
                format!("{why:#}")
            }
        }
    };
    tracing::warn!("{fallback}: attaching perf-event uprobes, which take about 90 ms each to detach");
    load_for_perf_events(ebpf)?;
    Ok(Method::PerfEvents)
}

fn load_for_perf_events(ebpf: &mut Ebpf) -> anyhow::Result<()> {
    for name in PROGRAMS {
        program(ebpf, name)?.load().map_err(missing_helper).with_context(|| format!("loading program {name}"))?;
    }
    // A link of another memprof (the daemon's, say) on a probed function keeps the breakpoints
    // a fork copied in the child, where a perf-event uprobe alone has the kernel take them out
    // at its first call: the sweep takes them out then (see `sweep_copies`).
    let sweep = program(ebpf, SWEEP_PROGRAM)?;
    let load = |sweep: &mut UProbe| -> anyhow::Result<()> {
        sweep.load_with_attach_type(uprobe_multi::ATTACH_TYPE)?;
        Ok(uprobe_multi::check_support(sweep.fd()?.as_fd())?)
    };
    if let Err(why) = load(sweep) {
        // The kernel has no uprobe_multi links, so nothing keeps a breakpoint in a child.
        let _ = sweep.unload();
        tracing::debug!("no sweep of forked children's breakpoints: {why:#}");
    }
    Ok(())
}

/// Helpers the programs call that older kernels lack, by the number their verifier names an
/// unknown one with (`invalid func unknown#N`), and the first kernel that has each.
const NEWER_HELPERS: [(u32, &str, &str); 1] = [(181, "bpf_loop", "5.17")];

/// The last way to load the programs failed: one line naming the helper the kernel lacks, where
/// that is why, rather than the verifier's log.
fn missing_helper(err: aya::programs::ProgramError) -> anyhow::Error {
    if let aya::programs::ProgramError::LoadError { verifier_log, .. } = &err {
        let log = verifier_log.to_string();
        if let Some(&(_, helper, since)) =
            NEWER_HELPERS.iter().find(|(id, _, _)| log.contains(&format!("invalid func unknown#{id}\n")))
        {
            return crate::error::UserError::KernelTooOld { helper, since }.into();
        }
    }
    err.into()
}

/// Loads the programs for uprobe_multi links: the session program where the kernel makes uprobe
/// session links (and `MEMPROF_UPROBE_SESSION` is not 0), else an entry and a return program for
/// the allocation functions. Only the programs used are kept: verifying each allocation program
/// takes the better part of a second.
fn load_for_multi_links(ebpf: &mut Ebpf) -> anyhow::Result<Method> {
    let load = |ebpf: &mut Ebpf, names: &[&str]| -> anyhow::Result<()> {
        for name in names {
            program(ebpf, name)?
                .load_with_attach_type(uprobe_multi::ATTACH_TYPE)
                .with_context(|| format!("loading program {name} for uprobe_multi links"))?;
        }
        Ok(())
    };
    load(ebpf, &[FREE_PROGRAM, MAPPINGS_PROGRAM, SWEEP_PROGRAM])?;
    uprobe_multi::check_support(program(ebpf, FREE_PROGRAM)?.fd()?.as_fd())?;
    let sessions =
        if switched_off(SESSION_SWITCH) { Err(anyhow::anyhow!("{SESSION_SWITCH}=0")) } else { load_sessions(ebpf) };
    match sessions {
        Ok(()) => Ok(Method::Sessions),
        Err(why) => {
            // Loaded on a kernel that makes no session links: not used.
            let _ = program(ebpf, SESSION_PROGRAM)?.unload();
            tracing::info!("no uprobe sessions ({why:#}): a sampled call's return probe still fires");
            load(ebpf, &[ENTRY_PROGRAM, RETURN_PROGRAM])?;
            Ok(Method::MultiLinks)
        }
    }
}

/// Loads the session program and checks that the kernel makes links for it.
fn load_sessions(ebpf: &mut Ebpf) -> anyhow::Result<()> {
    let session = program(ebpf, SESSION_PROGRAM)?;
    session.load_with_attach_type(uprobe_multi::SESSION_ATTACH_TYPE)?;
    uprobe_multi::check_sessions(session.fd()?.as_fd())?;
    Ok(())
}

fn program<'a>(ebpf: &'a mut Ebpf, name: &str) -> anyhow::Result<&'a mut UProbe> {
    ebpf.program_mut(name)
        .with_context(|| format!("program {name} missing from the eBPF object"))?
        .try_into()
        .with_context(|| format!("program {name} is not a uprobe"))
}

/// The probes attached to one process: its own links, and its share of links every traced
/// process that maps a file uses (see `shared`). Dropping it detaches its own links: entry probes
/// before return probes, since an entry probe left without its return probe would leave
/// in-flight state that nothing clears.
#[derive(Debug, Default)]
pub struct Attachment {
    links: Vec<Link>,
    probes: usize,
    shared: Vec<Arc<Attachment>>,
    /// The files (a path to each, and which file it named) and offsets of its own probes (see
    /// `sweep_copies`).
    sites: Vec<(PathBuf, FileId, Vec<u64>)>,
}

/// Attached probes: detached when the last copy of their descriptors closes (`detach_together`).
#[derive(Debug)]
struct Link {
    probes: Probes,
    wave: Wave,
}

/// When a link is detached among a process's, wave by wave (see `Attachment`'s `drop`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wave {
    /// The dynamic linker's hook, before all: a program valgrind runs has its code read, and its
    /// dynamic linker's first calls reach the hook at once (see `Family::on_exec`).
    LinkerHook,
    /// `free`'s probes, then: a free seen once its allocations no longer are would find an
    /// address the process reused meanwhile among the recent frees, a false double free.
    Frees,
    Entries,
    /// Return probes, last: an entry probe left without its return would leave state behind.
    Returns,
}

impl Wave {
    /// The order links are attached in (see `Loaded::probe_allocator`), the reverse of their
    /// detaching's but for the dynamic linker's hook, attached last.
    fn attach_rank(self) -> u8 {
        match self {
            Self::Frees => 0,
            Self::Returns => 1,
            Self::Entries => 2,
            Self::LinkerHook => 3,
        }
    }

    fn of(name: &str, at_return: bool) -> Self {
        match (name, at_return) {
            (_, true) => Self::Returns,
            (FREE_PROGRAM, false) => Self::Frees,
            (MAPPINGS_PROGRAM, false) => Self::LinkerHook,
            _ => Self::Entries,
        }
    }
}

/// Each holds what detaches its probes when the last copy of its descriptors closes.
#[derive(Debug)]
enum Probes {
    Multi(OwnedFd),
    /// A perf-event uprobe and its link: where the kernel makes no uprobe_multi links, and a USDT
    /// probe's (`--usdt`), which gives the kernel its semaphore; with what it was opened with.
    PerfEvent(perf_event::Uprobe, PerfOpening),
    /// A thread's page-fault event (`--growth`): closing it takes its program off.
    PageFaults(OwnedFd),
}

/// What a perf-event uprobe was opened with: enough to open it again on another thread of its
/// process when the one it is on exits (see `Attachment::move_to_thread`).
#[derive(Debug, Clone)]
pub struct PerfOpening {
    pub program: &'static str,
    pub site: perf_event::UprobeSite,
    /// The file `site.path` named when the probe was opened.
    pub file: FileId,
    pub cookie: u64,
    /// The thread it is opened on.
    pub thread: u32,
}

impl PerfOpening {
    /// Opens it on `thread`, the file reached at `path` (`site.path` may name another by now).
    fn open(&self, ebpf: &mut Ebpf, path: PathBuf, thread: u32) -> anyhow::Result<(perf_event::Uprobe, Self)> {
        let program = program(ebpf, self.program)?.fd()?.as_fd();
        let site = perf_event::UprobeSite { path, ..self.site.clone() };
        let probe = perf_event::uprobe(program, &site, self.cookie, thread)
            .with_context(|| format!("attaching {} to {} again", self.program, self.site.path.display()))?;
        Ok((probe, Self { thread, ..self.clone() }))
    }
}

impl Link {
    /// Its descriptors, whose last copies detach it as they close.
    fn descriptors(&self) -> Vec<RawFd> {
        match &self.probes {
            Probes::Multi(fd) | Probes::PageFaults(fd) => vec![fd.as_raw_fd()],
            Probes::PerfEvent(probe, _) => probe.descriptors(),
        }
    }

    /// A perf-event uprobe's opening, where it is on another thread than `thread`.
    fn elsewhere(&self, thread: u32) -> Option<&PerfOpening> {
        match &self.probes {
            Probes::PerfEvent(_, opening) if opening.thread != thread => Some(opening),
            _ => None,
        }
    }
}

impl Attachment {
    /// How many probes fire for the process (offsets, not links), shared ones included.
    pub fn probes(&self) -> usize {
        self.probes + self.shared.iter().map(|shared| shared.probes()).sum::<usize>()
    }

    /// Takes over `other`'s probes: they are detached with these.
    pub fn merge(&mut self, mut other: Attachment) {
        self.links.append(&mut other.links);
        self.probes += std::mem::take(&mut other.probes);
        self.shared.append(&mut other.shared);
        self.sites.append(&mut other.sites);
    }

    /// Takes over the page-fault events of a process traced by them (see `faults`).
    pub fn add_page_faults(&mut self, events: Vec<OwnedFd>) {
        self.probes += events.len();
        self.links.extend(events.into_iter().map(|fd| Link { probes: Probes::PageFaults(fd), wave: Wave::Entries }));
    }

    /// Attaches a uprobe of this process's own at `opening` (see `loader::own_probes`).
    pub fn add_own(&mut self, ebpf: &mut Ebpf, opening: PerfOpening) -> anyhow::Result<()> {
        let (probe, opening) = opening.open(ebpf, opening.site.path.clone(), opening.thread)?;
        self.probes += 1;
        self.links.push(Link { probes: Probes::PerfEvent(probe, opening), wave: Wave::Entries });
        Ok(())
    }

    /// Takes over a uprobe_multi link of this process's own probes at `offsets` of `path`, the
    /// file `id`.
    pub fn add_own_link(&mut self, link: OwnedFd, (path, id): (&Path, FileId), offsets: Vec<u64>) {
        self.probes += offsets.len();
        self.links.push(Link { probes: Probes::Multi(link), wave: Wave::Entries });
        self.sites.push((path.to_path_buf(), id, offsets));
    }

    /// Makes `links`, shared with other processes, part of this process's probes.
    pub fn share(&mut self, links: Arc<Attachment>) {
        self.shared.push(links);
    }

    /// Gives up this process's share of links shared with others (see `shared::SharedLinks`).
    pub fn unshare(&mut self) {
        self.shared.clear();
    }

    /// Attaches program `name` at `points` of `file` (at `path`, for messages), for process `pid`
    /// only, or for every process with `None` (uprobe_multi links only): at the functions' return
    /// if the program is a uretprobe. Perf-event uprobes are opened on `pid`'s thread `thread`
    /// (see `probe_threads`).
    #[allow(clippy::too_many_arguments)]
    pub fn add(
        &mut self,
        ebpf: &mut Ebpf,
        method: Method,
        name: &'static str,
        (path, file): (&Path, &Opened),
        points: &[Point],
        pid: Option<(NonZeroU32, u32)>,
    ) -> anyhow::Result<()> {
        let program = program(ebpf, name)?;
        let at_return = matches!(program.kind(), ProbeKind::Return);
        let wave = Wave::of(name, at_return);
        let context = || format!("attaching {name} to {}", path.display());
        // Links of every process's find the file through memprof's descriptor, the very file
        // read: a path swapped since would put the offsets read in one file into every process
        // that maps another. A process's own links name it by its path, which the process
        // controls: a swap there harms no other process.
        let kernel_path = &if pid.is_some() { path.to_path_buf() } else { file.kernel_path() };
        let own = pid.is_some();
        match method {
            Method::Sessions | Method::MultiLinks => {
                let fires = match (name, at_return) {
                    (SESSION_PROGRAM, _) => Fires::Session,
                    (_, true) => Fires::AtReturn,
                    (_, false) => Fires::AtEntry,
                };
                let pid = pid.map_or(0, |(pid, _)| pid.get());
                let link = uprobe_multi::attach(program.fd()?.as_fd(), kernel_path, points, fires, pid)
                    .with_context(context)?;
                self.links.push(Link { probes: Probes::Multi(link), wave });
            }
            Method::PerfEvents => {
                let (pid, thread) = pid.context("perf-event uprobes are attached per process")?;
                for point in points {
                    // A return's program runs in other processes too on Linux 6.1: it keeps its
                    // own (see `RETURN_OWNER_SHIFT`).
                    let cookie = if at_return {
                        profiler_common::with_return_owner(point.cookie, pid.get())
                    } else {
                        point.cookie
                    };
                    let site = perf_event::UprobeSite {
                        path: kernel_path.clone(),
                        offset: point.offset,
                        semaphore: None,
                        at_return,
                    };
                    let opening = PerfOpening { program: name, site, file: file.id(), cookie, thread };
                    let (probe, opening) = opening.open(ebpf, kernel_path.clone(), thread).with_context(context)?;
                    self.links.push(Link { probes: Probes::PerfEvent(probe, opening), wave });
                }
            }
        }
        if own {
            self.sites.push((path.to_path_buf(), file.id(), points.iter().map(|point| point.offset).collect()));
        }
        self.probes += points.len();
        Ok(())
    }

    /// Opens again on `thread` this process's perf-event uprobes that are on another (the
    /// thread they were opened on exited: see `probe_threads`), in the order they were attached;
    /// `open_file` opens each file again by its identity, from the path it was opened at. The
    /// return programs of those it replaces come off first: Linux 6.1 runs a uretprobe's program
    /// without its event's filter, so an old one would record each return again beside the new
    /// one (an entry program's event passes no thread once its own has exited). Returns the
    /// replaced events, for the caller to close (slow, see the module's doc), and whether all
    /// were opened; on failure those not opened yet stay here, for a move to another thread.
    pub fn move_to_thread(
        &mut self,
        ebpf: &mut Ebpf,
        thread: u32,
        mut open_file: impl FnMut(&Path, FileId) -> std::io::Result<Opened>,
    ) -> (Attachment, anyhow::Result<()>) {
        let returns =
            self.links.iter_mut().filter(|link| link.wave == Wave::Returns).filter_map(|link| match &mut link.probes {
                Probes::PerfEvent(probe, opening) if opening.thread != thread => Some(probe),
                _ => None,
            });
        let start = std::time::Instant::now();
        let unlinked = unlink_together(returns.collect());
        let unlinking = start.elapsed();
        let mut moving: Vec<usize> =
            (0..self.links.len()).filter(|&i| self.links[i].elsewhere(thread).is_some()).collect();
        moving.sort_by_key(|&i| self.links[i].wave.attach_rank());
        let mut replaced = Attachment::default();
        let mut files: HashMap<FileId, Opened> = HashMap::new();
        for i in moving {
            let Some(opening) = self.links[i].elsewhere(thread).cloned() else { continue };
            let file = match files.entry(opening.file) {
                std::collections::hash_map::Entry::Occupied(known) => known.into_mut(),
                std::collections::hash_map::Entry::Vacant(new) => match open_file(&opening.site.path, opening.file) {
                    Ok(opened) => new.insert(opened),
                    Err(err) => {
                        let path = opening.site.path.display();
                        return (replaced, Err(anyhow::Error::new(err).context(format!("opening {path} again"))));
                    }
                },
            };
            match opening.open(ebpf, file.kernel_path(), thread) {
                Ok((probe, opening)) => {
                    let old = std::mem::replace(&mut self.links[i].probes, Probes::PerfEvent(probe, opening));
                    replaced.links.push(Link { probes: old, wave: self.links[i].wave });
                }
                Err(err) => return (replaced, Err(err)),
            }
        }
        tracing::debug!(
            thread,
            unlinked,
            unlink_ms = unlinking.as_millis() as u64,
            opened = replaced.links.len(),
            elapsed_ms = start.elapsed().as_millis() as u64,
            "perf-event uprobes moved"
        );
        (replaced, Ok(()))
    }
}

impl Drop for Attachment {
    /// Detaches the links wave by wave (see `Wave`), each wave's at once: each uprobe_multi link
    /// waits for its own grace periods, and links closed together share them.
    fn drop(&mut self) {
        let start = std::time::Instant::now();
        let links = self.links.len();
        let mut links_of = |wave| self.links.extract_if(.., |link| link.wave == wave).collect::<Vec<Link>>();
        let hook = links_of(Wave::LinkerHook);
        let (frees, entries, returns) = (links_of(Wave::Frees), links_of(Wave::Entries), links_of(Wave::Returns));
        detach_together(hook);
        detach_together(frees);
        detach_together(entries);
        detach_together(returns);
        tracing::debug!(probes = self.probes, links, elapsed_ms = start.elapsed().as_millis() as u64, "detached");
    }
}

/// Takes the breakpoints of `traced` processes (each with its probes) out of the processes that
/// have copies of them and no link of their own: the children they forked, which memprof does not
/// trace. A fork copies the pages the breakpoints are written in. At the child's first trap on
/// one, the kernel takes it out only if every probe on that function agrees: a perf-event
/// uprobe's filter does, a uprobe_multi link's never (this memprof's, or another's on another
/// process, as the daemon's), and the child then traps at every call. Closing a link has the
/// kernel take a site's breakpoint out of every process no remaining link wants it in; so a link
/// of the program that does nothing is made on each process's sites, for it, and all are closed
/// together (sharing their waits).
pub fn sweep_copies<'a>(
    ebpf: &mut Ebpf,
    traced: impl IntoIterator<Item = (&'a Attachment, NonZeroU32)>,
) -> anyhow::Result<()> {
    let start = std::time::Instant::now();
    // Not loaded where the kernel makes no uprobe_multi links: no link keeps a copy there.
    let Ok(program) = program(ebpf, SWEEP_PROGRAM)?.fd() else {
        return Ok(());
    };
    let mut links = Vec::new();
    for (attachment, pid) in traced {
        let mut by_file: HashMap<(&Path, FileId), BTreeSet<u64>> = HashMap::new();
        for (path, id, offsets) in &attachment.sites {
            by_file.entry((path, *id)).or_default().extend(offsets);
        }
        for ((path, id), offsets) in by_file {
            let points: Vec<Point> = offsets.into_iter().map(|offset| Point { offset, cookie: 0 }).collect();
            // Only into the file probed: its path may name another by now.
            let attached = Opened::open_same(path, id)
                .and_then(|_| uprobe_multi::attach(program.as_fd(), path, &points, Fires::AtEntry, pid.get()));
            match attached {
                Ok(link) => links.push(Link { probes: Probes::Multi(link), wave: Wave::Entries }),
                // Gone since, say: its children are swept with those of the next.
                Err(err) => tracing::debug!(pid = pid.get(), path = %path.display(), "not swept: {err}"),
            }
        }
    }
    if links.is_empty() {
        return Ok(());
    }
    let count = links.len();
    detach_together(links);
    tracing::debug!(links = count, elapsed_ms = start.elapsed().as_millis() as u64, "swept");
    Ok(())
}

/// Threads that take programs off perf-event uprobes together (see `unlink_together`).
const UNLINKING_THREADS: usize = 32;

/// Takes the programs off `probes`, spread over `UNLINKING_THREADS` threads: on 6.18 each waits
/// for a grace period of its own (about 30 ms, measured), which threads waiting together share.
/// Returns how many it took off.
fn unlink_together(mut probes: Vec<&mut perf_event::Uprobe>) -> usize {
    let per_thread = probes.len().div_ceil(UNLINKING_THREADS).max(1);
    std::thread::scope(|scope| {
        for share in probes.chunks_mut(per_thread) {
            scope.spawn(move || share.iter_mut().for_each(|probe| probe.unlink()));
        }
    });
    probes.len()
}

/// Detaches `links`, and returns when all are detached.
fn detach_together(links: Vec<Link>) {
    if links.is_empty() {
        return;
    }
    let descriptors: Vec<RawFd> = links.iter().flat_map(Link::descriptors).collect();
    // A helper makes the last closes (`helper`); memprof's own are only references dropped.
    if let Some(holder) = helper::Holder::give(&descriptors) {
        drop(links);
        holder.release();
        return;
    }
    helper::close_together(links);
}
