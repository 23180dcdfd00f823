//! The report of one process: built from a snapshot and symbolized stacks, printed as a table or
//! as one JSON object per line (docs: reference/json-schema.md#the-json-schema).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use aya::Ebpf;
use profiler_common::{DoubleFreeEvent, DropReason, FreeSite, StackEnd, NO_STACK};
use serde::{Deserialize, Serialize};

use crate::{
    heap::{
        context::RunContext,
        inspect::{Inspection, Reachability},
        known_stacks::{KnownStacks, Symbolized},
        leak::{LeakTracker, LeakVerdict, Timeline},
        mappings::{self, Mappings},
        pinned::Pinned,
        resident::Memory,
        suppressions::Suppressed,
        threads::ThreadUse,
        types::{self, TypeCount},
        wrappers::Wrappers,
    },
    kernel::aggregate::{self, Growth, KernelSnapshot, Snapshot, StackSnapshot, StackTable},
    process::allocator::BlindSpot,
    symbolize::{Frame, FrameInfo, Frames, Module, Resolved, SymbolizerHandle},
    unwind::{Registry, TableUse},
};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    #[serde(rename = "final")]
    pub is_final: bool,
    /// When, where and by which memprof the trace was made: in the traced process's report (not
    /// its children's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<RunContext>,
    pub pid: u32,
    /// The process's pid in its own pid namespace (a container's), when it differs from `pid`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ns_pid: Option<u32>,
    pub comm: String,
    /// The executable (`/proc/PID/exe`); after an exec, the new program's.
    pub exe: String,
    /// The traced process that forked this one, for a child's report.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<u32>,
    /// A child that has exited: its report as it stood then.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub exited: bool,
    /// The daemon's view of a process it traces still: whole like a final report, but the
    /// process goes on.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub live: bool,
    /// The process at its peak (`memprof report --at peak`): `duration_s` is the peak's time and
    /// each stack holds its bytes then; the peak keeps no counts, so those are 0.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub at_peak: bool,
    pub duration_s: f64,
    /// Mean bytes between recorded allocations when the process is sampled (counts and bytes are
    /// then estimates); 0 when every call is recorded.
    pub sample_bytes: u64,
    /// Traced by the pages it touched, not its allocator calls (`--growth`): each stack holds
    /// the pages it touched first, and allocations count pages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub growth: Option<Growth>,
    /// Recorded only as the allocator's own sampler reports through its `otel_memory` probes
    /// (`--usdt`): how many allocations they reported (counts and bytes are then estimates).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usdt_samples: Option<u64>,
    pub totals: Totals,
    /// The most bytes the process had in use since tracing began, when, and which stacks held them.
    #[serde(default)]
    pub peak: Peak,
    /// The stacks with temporary allocations, most first (at most `LISTED_MAX`, or the report's top): most
    /// hold nothing now, so `stacks` does not list them.
    #[serde(default)]
    pub temporary_stacks: Vec<TemporaryStack>,
    /// Anonymous resident memory against the heap in use (docs: guide/resident-memory.md#resident-memory-against-the-heap); absent for a
    /// process never read while it ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<Memory>,
    /// Anonymous memory from `mmap`, `mremap` and `brk`, by stack: its own view, never added to
    /// the heap's (docs: guide/mappings.md#memory-outside-malloc-mappings).
    #[serde(default)]
    pub mappings: Mappings,
    /// This process's events not recorded, by reason.
    #[serde(deserialize_with = "crate::names::deserialize_counts")]
    pub dropped: BTreeMap<&'static str, u64>,
    /// Events not recorded that no process's counters had room for (more processes than the
    /// per-process table holds), by reason: only those that happened.
    #[serde(
        default,
        skip_serializing_if = "BTreeMap::is_empty",
        deserialize_with = "crate::names::deserialize_counts"
    )]
    pub unattributed_dropped: BTreeMap<&'static str, u64>,
    pub stacks: Vec<StackReport>,
    /// Stacks left out of this page or graph to keep it within its size (the daemon's `/report`
    /// and flame graph): the largest are shown; the JSON report and profiles have them all.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub stacks_not_shown: u64,
    /// The stacks `--suppressions` accepted, counted by rule: they stay in `stacks`, marked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suppressed: Option<Suppressed>,
    /// The executable mappings that hold the stacks' frames (pprof's mappings).
    pub modules: Vec<Module>,
    pub double_frees: Vec<DoubleFreeReport>,
    /// What memprof knows it does not see in the process (docs: guide/allocators.md#blind-spots).
    pub blind_spots: Vec<BlindSpot>,
    /// Sizes of the allocations seen, in power-of-two buckets.
    pub sizes: Vec<Bucket>,
    /// How long freed allocations lived, in power-of-two buckets of nanoseconds.
    pub lifetimes: Vec<Bucket>,
    /// Allocations freed by another thread than the one that made them.
    pub thread_pairs: Vec<ThreadPair>,
    /// The heap in use by the thread that allocated it (`--threads`), most bytes first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub threads: Vec<ThreadUse>,
    /// In-use bytes at each interval so far; only in the final report.
    #[serde(default, skip_serializing_if = "Timeline::is_empty")]
    pub timeline: Timeline,
    /// The traced process's followed children (and theirs), each a report of its own
    /// (`--follow-forks`; see `Forks`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<Report>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forks: Option<Forks>,
    /// The unwind tables of every traced process's files (shared by all): in the root process's
    /// report and the daemon's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unwind_tables: Option<TableUse>,
    /// What `--inspect` found: the final report's, when the process was still there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inspection: Option<Inspection>,
}

/// A process's high-water mark of bytes in use (docs: guide/peaks.md#peaks-and-temporary-allocations).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Peak {
    pub bytes: u64,
    /// Seconds since tracing began.
    pub at_s: f64,
    /// The stacks that held memory then, most bytes first (at most `LISTED_MAX`, or the report's
    /// top; all of them in a recording's, for `memprof report --at peak`).
    pub stacks: Vec<PeakStack>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PeakStack {
    pub stack_id: String,
    pub bytes: u64,
    /// Its frames: a stack that has freed all it held then is not among the report's stacks.
    pub frames: Frames,
}

/// Allocations of one stack freed by their thread before it allocated or freed anything else (docs:
/// guide/peaks.md#peaks-and-temporary-allocations).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TemporaryStack {
    pub stack_id: String,
    pub temporary_allocations: u64,
    pub allocations: u64,
    pub frames: Frames,
}

/// What following forks did (`--follow-forks`), for the root process's report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Forks {
    /// Children attached to.
    pub followed: u64,
    /// Of those, the ones the process already had when memprof attached (`attach
    /// --follow-forks`).
    #[serde(default)]
    pub at_attach: u64,
    /// Children that exited (or exec'd a program without an allocator) before their probes
    /// could be attached: not traced.
    pub missed: u64,
    /// Children that exited and whose reports were not kept (past the first 100).
    pub exited_not_listed: u64,
    /// Exec and fork events the kernel's ring buffer had no room for.
    pub events_lost: u64,
}

/// One bucket of a histogram: values in `min..=max`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Bucket {
    pub min: u64,
    pub max: u64,
    pub count: u64,
}

/// Allocations made by one thread and freed by another.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ThreadPair {
    pub alloc_tid: u32,
    pub free_tid: u32,
    pub frees: u64,
    pub freed_bytes: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Totals {
    pub outstanding_bytes: u64,
    pub outstanding_allocations: u64,
    pub allocations: u64,
    pub allocated_bytes: u64,
    pub frees: u64,
    pub freed_bytes: u64,
    pub unknown_frees: u64,
    /// Frees of blocks never seen allocated that the C library's own code made: blocks it
    /// allocated inside itself (glibc's per-thread caches, freed as each thread exits).
    #[serde(default)]
    pub internal_frees: u64,
    pub failed_allocations: u64,
    /// Allocations freed by their thread before it allocated or freed anything else (full mode only).
    pub temporary_allocations: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StackReport {
    /// A hash of the frames' (module, file offset): stable across runs and processes.
    pub stack_id: String,
    pub outstanding_bytes: u64,
    pub outstanding_allocations: u64,
    pub allocations: u64,
    pub allocated_bytes: u64,
    /// The most bytes the stack had outstanding at once since tracing began.
    pub max_outstanding_bytes: u64,
    /// Its allocations freed by their thread before it allocated or freed anything else (full mode only).
    pub temporary_allocations: u64,
    /// Resident pages its live blocks are on that hold less than a quarter of their bytes live,
    /// and its share of their bytes (see `heap::pinned`): the fragmentation it causes.
    #[serde(default)]
    pub pinned_pages: u64,
    #[serde(default)]
    pub pinned_bytes: u64,
    pub oldest_age_s: f64,
    /// The earliest its oldest outstanding allocation can have been made (CLOCK_MONOTONIC, not
    /// before tracing began): `aged_at` brings `oldest_age_s` to another moment.
    #[serde(skip)]
    pub oldest_ns: Option<u64>,
    /// The walk did not reach the thread's outermost frame (see `dropped` for why).
    pub truncated: bool,
    /// The allocation wrappers folded into the allocator (`heap::wrappers`), innermost first:
    /// `frames` start at the code that called the first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub via: Vec<String>,
    pub leak: LeakVerdict,
    /// Its blocks by class, when the report's process was inspected (`--inspect`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reachability: Option<Reachability>,
    /// Its C++ objects by type, when inspected (`--inspect`): most bytes first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub types: Vec<TypeCount>,
    /// The suppression (`--suppressions`) that accepted it, by name: it is no leak candidate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suppressed: Option<String>,
    pub frames: Frames,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DoubleFreeReport {
    pub address: String,
    pub size: u64,
    pub alloc: SiteReport,
    pub first_free: SiteReport,
    pub second_free: SiteReport,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SiteReport {
    pub tid: u32,
    /// Seconds since tracing began.
    pub time_s: f64,
    pub truncated: bool,
    /// As a stack's: the allocation wrappers folded away from `frames`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub via: Vec<String>,
    pub frames: Frames,
}

/// Turns a traced process's stack ids and times into frames and seconds.
pub struct Stacks<'a> {
    pub ebpf: &'a Ebpf,
    /// For the walks the kernel deferred (see `unwind::Registry::completion`).
    pub unwind: &'a Registry,
    pub symbolizer: &'a SymbolizerHandle,
    pub pid: u32,
    /// CLOCK_MONOTONIC when tracing began.
    pub start_ns: u64,
    /// The process's stacks symbolized in earlier intervals (the daemon's), if kept.
    pub known: Option<&'a KnownStacks>,
    /// Folded into the allocator at each stack's leaf end.
    pub wrappers: &'a Wrappers,
}

impl Stacks<'_> {
    fn seconds_since_start(&self, time_ns: u64) -> f64 {
        seconds(time_ns.saturating_sub(self.start_ns))
    }

    /// Symbolizes a stored stack and hashes it, its wrappers folded (the hash is the whole
    /// walk's); an allocation stack known already is not read again.
    fn symbolize(&self, table: StackTable, stack_id: u64) -> Symbolized {
        let whole = match self.known {
            Some(known) if table == StackTable::Allocations => {
                known.get_or(stack_id, || self.symbolize_stored(table, stack_id))
            }
            _ => self.symbolize_stored(table, stack_id),
        };
        let (frames, via) = self.wrappers.fold(whole.frames);
        Symbolized { frames, via, ..whole }
    }

    fn symbolize_stored(&self, table: StackTable, stack_id: u64) -> Symbolized {
        let (addresses, end) = aggregate::stack_frames(self.ebpf, self.unwind, self.pid, table, stack_id);
        self.symbolize_frames(addresses, end != StackEnd::Complete)
    }

    fn symbolize_frames(&self, addresses: Vec<u64>, truncated: bool) -> Symbolized {
        if addresses.is_empty() {
            return Symbolized { frames: Frames::default(), via: Vec::new(), id: "none".to_string(), truncated };
        }
        let resolved = self.symbolizer.symbolize(self.pid, addresses);
        let id = stack_hash(&resolved);
        Symbolized { frames: resolved.into_iter().flat_map(|r| r.frames).collect(), via: Vec::new(), id, truncated }
    }

    fn site_report(&self, table: StackTable, stack_id: u64, tid: u32, time_ns: u64) -> SiteReport {
        let stack = self.symbolize(table, stack_id);
        SiteReport {
            tid,
            time_s: self.seconds_since_start(time_ns),
            truncated: stack.truncated,
            via: stack.via,
            frames: stack.frames,
        }
    }

    /// A free's stack, or only its caller where the stack was not walked (marked truncated).
    fn free_site(&self, site: &FreeSite) -> SiteReport {
        if site.stack_id != NO_STACK || site.caller == 0 {
            return self.site_report(StackTable::Frees, site.stack_id, site.tid, site.time_ns);
        }
        let frames = self.symbolize_frames(vec![site.caller], true).frames;
        SiteReport {
            tid: site.tid,
            time_s: self.seconds_since_start(site.time_ns),
            truncated: true,
            via: Vec::new(),
            frames,
        }
    }

    /// The code mappings that hold `frames`.
    fn modules<'f>(&self, frames: impl Iterator<Item = &'f Frame>) -> Vec<Module> {
        // Borrowed while deduplicated: a report has a module name per frame, its modules are few,
        // and a stack's frames come in runs of one module (a set's insert per frame was a
        // quarter of a daemon's time at rest with 65,536 deep stacks).
        let mut paths: BTreeSet<&str> = BTreeSet::new();
        let mut last = None;
        for module in frames.map(|f| f.module.as_str()) {
            if last != Some(module) {
                paths.insert(module);
                last = Some(module);
            }
        }
        let paths = paths.into_iter().map(str::to_string).collect();
        let ask = |paths| self.symbolizer.modules(self.pid, paths);
        match self.known {
            Some(known) => known.modules_or(paths, ask),
            None => ask(paths),
        }
    }

    /// Symbolizes a double free when it arrives: its free stacks may be replaced later.
    pub fn double_free(&self, event: &DoubleFreeEvent) -> DoubleFreeReport {
        DoubleFreeReport {
            address: format!("{:#x}", event.addr),
            size: event.first.alloc.size,
            alloc: self.site_report(
                StackTable::Allocations,
                event.first.alloc.stack_id,
                event.first.alloc.tid,
                event.first.alloc.time_ns,
            ),
            first_free: self.free_site(&event.first.free),
            second_free: self.free_site(&event.second),
        }
    }
}

/// What a report needs besides the snapshot.
pub struct Context<'a> {
    pub stacks: Stacks<'a>,
    pub comm: &'a str,
    /// See `Report::ns_pid`: read once at attach, since a pid namespace is for life.
    pub ns_pid: Option<u32>,
    pub double_frees: &'a [DoubleFreeReport],
    pub leaks: &'a LeakTracker,
    /// The pages the process's live blocks pin, by kernel stack id.
    pub pinned: &'a Pinned,
}

/// How much of a snapshot a report shows.
#[derive(Debug, Clone, Copy)]
pub struct Selection {
    pub is_final: bool,
    /// At most this many stacks; `None` keeps all.
    pub top: Option<usize>,
    /// Count only allocations at least min-age old (the snapshot's aged figures).
    pub aged_only: bool,
    /// Also list the stacks that hold nothing now, after those that do: pprof's allocation
    /// profile counts every allocation.
    pub freed: bool,
    /// List every stack held at the peak: a recording keeps them for `memprof report --at
    /// peak`, and `format::select` shows the `LISTED_MAX` largest.
    pub whole_peak: bool,
}

/// Builds the report of one process's `snapshot`.
pub fn build(ctx: &Context, snapshot: &Snapshot, kernel: &KernelSnapshot, selection: Selection) -> Report {
    let mut totals = Totals {
        outstanding_bytes: snapshot.outstanding_bytes(),
        unknown_frees: snapshot.counters.unknown_frees,
        internal_frees: snapshot.counters.internal_frees,
        failed_allocations: snapshot.counters.failed_allocations,
        ..Totals::default()
    };
    for stack in &snapshot.stacks {
        totals.allocations += stack.stats.allocations;
        totals.allocated_bytes += stack.stats.allocated_bytes;
        totals.frees += stack.stats.frees;
        totals.freed_bytes += stack.stats.freed_bytes;
        totals.outstanding_allocations += stack.stats.allocations.saturating_sub(stack.stats.frees);
        totals.temporary_allocations += stack.stats.temporary_allocations;
    }
    let counted = |s: &StackSnapshot| {
        if selection.aged_only {
            (s.aged_bytes, s.aged_allocations)
        } else {
            (s.outstanding_bytes, s.outstanding_allocations)
        }
    };
    let mut listed: Vec<_> =
        snapshot.stacks.iter().filter(|s| counted(s).1 > 0 || (selection.freed && s.stats.allocations > 0)).collect();
    listed.sort_by_key(|s| std::cmp::Reverse((counted(s), s.stats.allocated_bytes)));
    listed.truncate(selection.top.unwrap_or(usize::MAX));
    // Kernel stack id to the report's, for the timeline.
    let mut report_ids = HashMap::new();
    let stacks: Vec<StackReport> = listed
        .into_iter()
        .map(|stack| {
            let symbolized = ctx.stacks.symbolize(StackTable::Allocations, stack.stored_id);
            report_ids.insert(stack.stack_id, symbolized.id.clone());
            let (outstanding_bytes, outstanding_allocations) = counted(stack);
            // Live blocks carry the id their stack was stored under; a stack the kernel
            // deferred counts under both. (A second deferred walk of the same stack, absorbed
            // into it, is counted in the process's total only.)
            let mut pinned = ctx.pinned.of(stack.stack_id);
            if stack.stored_id != stack.stack_id {
                pinned.add(ctx.pinned.of(stack.stored_id));
            }
            StackReport {
                stack_id: symbolized.id,
                outstanding_bytes,
                outstanding_allocations,
                allocations: stack.stats.allocations,
                allocated_bytes: stack.stats.allocated_bytes,
                max_outstanding_bytes: stack.stats.max_outstanding_bytes,
                temporary_allocations: stack.stats.temporary_allocations,
                pinned_pages: pinned.pages,
                pinned_bytes: pinned.bytes,
                // Ages are known to the generation: none is older than tracing.
                oldest_age_s: 0.0,
                oldest_ns: stack.oldest_ns.map(|t| t.max(ctx.stacks.start_ns)),
                truncated: symbolized.truncated,
                via: symbolized.via,
                leak: ctx.leaks.verdict(stack.stack_id),
                reachability: None,
                types: Vec::new(),
                suppressed: None,
                frames: symbolized.frames,
            }
            .aged_at(snapshot.now_ns)
        })
        .collect();
    let stacks = merge_same_stacks(stacks);
    let names = Names::new(ctx, &report_ids, &stacks);
    let peak =
        peak(&names, snapshot, if selection.whole_peak { None } else { Some(selection.top.unwrap_or(LISTED_MAX)) });
    let temporary_stacks = temporary_stacks(&names, snapshot, selection.top);
    let mappings = mappings::build(&snapshot.mappings, selection.top.unwrap_or(LISTED_MAX).min(LISTED_MAX), |id| {
        let symbolized = ctx.stacks.symbolize(StackTable::Allocations, id);
        (symbolized.id, symbolized.truncated, symbolized.frames)
    });
    let frames =
        stacks.iter().flat_map(|s| s.frames.iter()).chain(mappings.stacks.iter().flat_map(|s| s.frames.iter()));
    let modules = ctx.stacks.modules(frames);
    Report {
        is_final: selection.is_final,
        context: None,
        pid: ctx.stacks.pid,
        ns_pid: ctx.ns_pid,
        comm: ctx.comm.to_string(),
        exe: String::new(),
        parent: None,
        blind_spots: Vec::new(),
        exited: false,
        live: false,
        at_peak: false,
        duration_s: ctx.stacks.seconds_since_start(snapshot.now_ns),
        sample_bytes: snapshot.sample_bytes,
        growth: snapshot.growth,
        usdt_samples: snapshot.usdt.then_some(snapshot.counters.usdt_samples),
        totals,
        peak,
        temporary_stacks,
        memory: None,
        mappings,
        dropped: dropped(snapshot),
        unattributed_dropped: unattributed_dropped(kernel),
        stacks_not_shown: 0,
        suppressed: None,
        modules,
        stacks,
        double_frees: ctx.double_frees.to_vec(),
        sizes: power_of_two_buckets(&snapshot.sizes.buckets),
        lifetimes: power_of_two_buckets(&snapshot.lifetimes.buckets),
        thread_pairs: thread_pairs(snapshot),
        threads: Vec::new(),
        timeline: if selection.is_final {
            ctx.leaks.timeline(|id| report_ids.get(&id).cloned())
        } else {
            Timeline::default()
        },
        children: Vec::new(),
        forks: None,
        unwind_tables: None,
        inspection: None,
    }
}

/// Gives `report` its inspection, and each of its stacks its blocks' classes and types.
pub fn add_inspection(report: &mut Report, inspection: Inspection, stacks: &Stacks) {
    // Kernel ids to the report's: two kernel ids may hold the same frames (see `merge_same_stacks`).
    let mut report_id: HashMap<u64, String> = HashMap::new();
    let mut id = |kernel_id: u64| {
        report_id.entry(kernel_id).or_insert_with(|| stacks.symbolize(StackTable::Allocations, kernel_id).id).clone()
    };
    let mut by_id: HashMap<String, Reachability> = HashMap::new();
    for (&kernel_id, reachability) in &inspection.per_stack {
        by_id.entry(id(kernel_id)).or_default().add(reachability);
    }
    let mut types_by_id: HashMap<String, Vec<TypeCount>> = HashMap::new();
    for (&kernel_id, counts) in &inspection.per_stack_types {
        types::merge(types_by_id.entry(id(kernel_id)).or_default(), counts);
    }
    for stack in &mut report.stacks {
        stack.reachability = by_id.get(&stack.stack_id).copied();
        stack.types = types_by_id.remove(&stack.stack_id).unwrap_or_default();
    }
    report.inspection = Some(inspection);
}

/// Names a snapshot's stacks as the report does: `ids` maps kernel ids to the report ids of the
/// stacks listed, `listed` those by report id; others are symbolized.
struct Names<'a> {
    ctx: &'a Context<'a>,
    ids: &'a HashMap<u64, String>,
    listed: HashMap<&'a str, &'a StackReport>,
}

impl<'a> Names<'a> {
    fn new(ctx: &'a Context<'a>, ids: &'a HashMap<u64, String>, listed: &'a [StackReport]) -> Self {
        Self { ctx, ids, listed: listed.iter().map(|s| (s.stack_id.as_str(), s)).collect() }
    }

    fn of(&self, stack: &StackSnapshot) -> (String, Frames) {
        let known = self.ids.get(&stack.stack_id).and_then(|id| self.listed.get(id.as_str()));
        match known {
            Some(listed) => (listed.stack_id.clone(), listed.frames.clone()),
            None => {
                let symbolized = self.ctx.stacks.symbolize(StackTable::Allocations, stack.stored_id);
                (symbolized.id, symbolized.frames)
            }
        }
    }

    /// The `top` stacks of `snapshot` by `value` (those above 0), named, each stack's value
    /// summed with its deferred walk's twin's (the same frames: see `merge_same_stacks`).
    fn top<'s>(
        &self,
        snapshot: &'s Snapshot,
        top: Option<usize>,
        value: impl Fn(&StackSnapshot) -> u64,
    ) -> Vec<(String, Frames, Vec<&'s StackSnapshot>)> {
        let mut chosen: Vec<&StackSnapshot> = snapshot.stacks.iter().filter(|s| value(s) > 0).collect();
        chosen.sort_by_key(|s| std::cmp::Reverse(value(s)));
        let mut named: Vec<(String, Frames, Vec<&'s StackSnapshot>)> = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        for stack in chosen {
            let (id, frames) = self.of(stack);
            match index.get(&id) {
                Some(&same) => named[same].2.push(stack),
                None if named.len() < top.unwrap_or(usize::MAX) => {
                    index.insert(id.clone(), named.len());
                    named.push((id, frames, vec![stack]));
                }
                None => {}
            }
        }
        named
    }
}

/// Stacks listed at most at the peak, for temporary allocations and mappings, whatever `top` says: each
/// carries its frames, and a daemon's process of 65,536 stacks listed them all twice more.
pub const LISTED_MAX: usize = 100;

/// The process's peak and the stacks that held memory then: at most `top` of them and
/// `LISTED_MAX`, or all of them without `top`.
fn peak(names: &Names, snapshot: &Snapshot, top: Option<usize>) -> Peak {
    let top = top.map(|top| top.min(LISTED_MAX));
    let stacks = names
        .top(snapshot, top, |s| s.peak_bytes)
        .into_iter()
        .map(|(stack_id, frames, parts)| PeakStack {
            stack_id,
            bytes: parts.iter().map(|s| s.peak_bytes).sum(),
            frames,
        })
        .collect();
    let at_ns = snapshot.peak.at_ns;
    Peak {
        bytes: snapshot.peak.bytes,
        at_s: if at_ns == 0 { 0.0 } else { names.ctx.stacks.seconds_since_start(at_ns) },
        stacks,
    }
}

/// The stacks with the most temporary allocations, at most `top` of them.
fn temporary_stacks(names: &Names, snapshot: &Snapshot, top: Option<usize>) -> Vec<TemporaryStack> {
    let top = Some(top.unwrap_or(LISTED_MAX).min(LISTED_MAX));
    names
        .top(snapshot, top, |s| s.stats.temporary_allocations)
        .into_iter()
        .map(|(stack_id, frames, parts)| TemporaryStack {
            stack_id,
            temporary_allocations: parts.iter().map(|s| s.stats.temporary_allocations).sum(),
            allocations: parts.iter().map(|s| s.stats.allocations).sum(),
            frames,
        })
        .collect()
}

impl Report {
    /// Calls `each` with this report and each of its children's, theirs too.
    pub fn for_each_process(&mut self, each: &mut impl FnMut(&mut Report)) {
        each(self);
        for child in &mut self.children {
            child.for_each_process(each);
        }
    }

    /// Folds `wrappers` into the allocator in a report made already (`memprof report
    /// --wrapper`), its children's too: the same stacks, each site moved to the wrappers' caller.
    pub fn fold_wrappers(&mut self, wrappers: &Wrappers) {
        let fold = |frames: &mut Frames, via: &mut Vec<String>| {
            let (kept, folded) = wrappers.fold(std::mem::take(frames));
            *frames = kept;
            // Folded before are the innermost.
            via.extend(folded);
        };
        for stack in &mut self.stacks {
            fold(&mut stack.frames, &mut stack.via);
        }
        for double_free in &mut self.double_frees {
            fold(&mut double_free.alloc.frames, &mut double_free.alloc.via);
        }
        let peak = self.peak.stacks.iter_mut().map(|s| &mut s.frames);
        for frames in peak.chain(self.temporary_stacks.iter_mut().map(|s| &mut s.frames)) {
            fold(frames, &mut Vec::new());
        }
        for child in &mut self.children {
            child.fold_wrappers(wrappers);
        }
    }
}

impl StackReport {
    /// Adds `other`'s counts, another stack with the same frames (or folded into this one).
    pub fn add_counts(&mut self, other: &StackReport) {
        self.outstanding_bytes += other.outstanding_bytes;
        self.outstanding_allocations += other.outstanding_allocations;
        self.allocations += other.allocations;
        self.allocated_bytes += other.allocated_bytes;
        // Their highs need not have come at once: the sum bounds the merged stack's from above.
        self.max_outstanding_bytes += other.max_outstanding_bytes;
        self.temporary_allocations += other.temporary_allocations;
        self.pinned_pages += other.pinned_pages;
        self.pinned_bytes += other.pinned_bytes;
        self.oldest_age_s = self.oldest_age_s.max(other.oldest_age_s);
        self.oldest_ns = match (self.oldest_ns, other.oldest_ns) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }

    /// Its `oldest_age_s` at `now_ns`.
    pub fn aged_at(mut self, now_ns: u64) -> Self {
        self.oldest_age_s = self.oldest_ns.map_or(0.0, |t| seconds(now_ns.saturating_sub(t)));
        self
    }
}

/// Stacks with the same frames as one: a walk the kernel deferred (see `unwind::deferred`) is
/// stored apart from the same stack walked whole once the table was loaded. The larger one's
/// leak verdict stands for both.
fn merge_same_stacks(mut merged: Vec<StackReport>) -> Vec<StackReport> {
    // Merged in place: the list is a process's every stack, twins are rare.
    let mut first: HashMap<&str, usize> = HashMap::new();
    let twins: Vec<(usize, usize)> = (0..merged.len())
        .filter_map(|i| match first.get(merged[i].stack_id.as_str()) {
            Some(&into) => Some((into, i)),
            None => {
                first.insert(&merged[i].stack_id, i);
                None
            }
        })
        .collect();
    drop(first);
    for &(into, twin) in &twins {
        let twin = merged[twin].clone();
        merged[into].add_counts(&twin);
        merged[into].truncated &= twin.truncated;
    }
    if !twins.is_empty() {
        let gone: BTreeSet<usize> = twins.iter().map(|&(_, twin)| twin).collect();
        let mut index = 0;
        merged.retain(|_| {
            index += 1;
            !gone.contains(&(index - 1))
        });
    }
    merged.sort_by_key(|s| std::cmp::Reverse(((s.outstanding_bytes, s.outstanding_allocations), s.allocated_bytes)));
    merged
}

/// One report of `root` and its children for formats that draw one profile (pprof, folded,
/// flame graph, HTML): every process's stacks, each under an outermost frame naming the process
/// (`comm (pid N)`), so that a process is a root of the flame graph and call tree; totals summed.
pub fn merge_processes(root: &Report) -> Report {
    let mut merged = Report { children: Vec::new(), ..root.clone() };
    merged.stacks.clear();
    merged.mappings.stacks.clear();
    for process in std::iter::once(root).chain(&root.children) {
        let process_frame = process_frame(process);
        for stack in &process.stacks {
            let mut stack = stack.clone();
            stack.frames = with_outermost(&stack.frames, &process_frame);
            merged.stacks.push(stack);
        }
        for stack in &process.mappings.stacks {
            let mut stack = stack.clone();
            stack.frames = with_outermost(&stack.frames, &process_frame);
            merged.mappings.stacks.push(stack);
        }
        if process.pid != root.pid {
            merged.mappings.outstanding_bytes += process.mappings.outstanding_bytes;
            merged.mappings.allocator_bytes += process.mappings.allocator_bytes;
            let (t, c) = (&mut merged.totals, &process.totals);
            t.outstanding_bytes += c.outstanding_bytes;
            t.outstanding_allocations += c.outstanding_allocations;
            t.allocations += c.allocations;
            t.allocated_bytes += c.allocated_bytes;
            t.frees += c.frees;
            t.freed_bytes += c.freed_bytes;
            t.unknown_frees += c.unknown_frees;
            t.internal_frees += c.internal_frees;
            t.failed_allocations += c.failed_allocations;
            t.temporary_allocations += c.temporary_allocations;
            for (reason, count) in &process.dropped {
                *merged.dropped.entry(reason).or_default() += count;
            }
            merged.modules.extend(process.modules.iter().cloned());
            merged.double_frees.extend(process.double_frees.iter().cloned());
        }
    }
    merged.stacks.sort_by_key(|s| std::cmp::Reverse(s.outstanding_bytes));
    merged.mappings.stacks.sort_by_key(|s| std::cmp::Reverse(s.outstanding_bytes));
    merged
}

/// `frames` with `outermost` after them.
fn with_outermost(frames: &[Frame], outermost: &Frame) -> Frames {
    frames.iter().chain(std::iter::once(outermost)).cloned().collect()
}

/// The outermost frame of a process's stacks when several processes share one profile:
/// `comm (pid N)`.
pub fn process_frame(process: &Report) -> Frame {
    Frame::new(FrameInfo {
        address: "0x0".into(),
        function: format!("{} (pid {})", process.comm, process.pid),
        file: None,
        line: None,
        module: process.exe.clone(),
        inlined: false,
    })
}

/// What the process could not record, by reason: its drops in the kernel and the age
/// generations missed.
pub fn dropped(snapshot: &Snapshot) -> BTreeMap<&'static str, u64> {
    let mut dropped: BTreeMap<_, _> =
        DropReason::ALL.iter().map(|r| (r.name(), snapshot.drops.counts[*r as usize])).collect();
    dropped.insert(MISSED_GENERATIONS, snapshot.missed_generations);
    dropped
}

/// The drops of no process in particular that happened, by reason; with the bytes of records
/// memprof's rings skipped (`ring::SKIPPED_REASON`).
pub fn unattributed_dropped(kernel: &KernelSnapshot) -> BTreeMap<&'static str, u64> {
    DropReason::ALL
        .iter()
        .map(|r| (r.name(), kernel.unattributed_drops[*r as usize]))
        .chain([(crate::ring::SKIPPED_REASON, crate::ring::skipped_bytes())])
        .filter(|(_, count)| *count > 0)
        .collect()
}

/// Reason of the generations whose ages were lost because reads came too far apart.
pub const MISSED_GENERATIONS: &str = "age_generation_missed";

/// Thread pairs, most bytes first.
fn thread_pairs(snapshot: &Snapshot) -> Vec<ThreadPair> {
    let mut pairs: Vec<ThreadPair> = snapshot
        .thread_pairs
        .iter()
        .map(|(key, stats)| ThreadPair {
            alloc_tid: key.alloc_tid,
            free_tid: key.free_tid,
            frees: stats.frees,
            freed_bytes: stats.freed_bytes,
        })
        .collect();
    pairs.sort_by_key(|p| (std::cmp::Reverse(p.freed_bytes), p.alloc_tid, p.free_tid));
    pairs
}

/// The non-empty buckets of a histogram whose bucket `i` counts values in `2^(i-1)+1 ..= 2^i`.
fn power_of_two_buckets(counts: &[u64]) -> Vec<Bucket> {
    let bound = |i: usize| if i >= 64 { u64::MAX } else { 1u64 << i };
    counts
        .iter()
        .enumerate()
        .filter(|(_, count)| **count > 0)
        .map(|(i, &count)| Bucket { min: if i == 0 { 0 } else { bound(i - 1) + 1 }, max: bound(i), count })
        .collect()
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

pub fn seconds(ns: u64) -> f64 {
    // Millisecond precision keeps the JSON short; nobody reads nanoseconds of heap age.
    (ns / 1_000_000) as f64 / 1000.0
}

/// FNV-1a over the frames' (module, file offset), as 16 hex digits.
fn stack_hash(resolved: &[Resolved]) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for r in resolved {
        for byte in r.module.bytes().chain(r.file_offset.to_le_bytes()) {
            hash = (hash ^ byte as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("{hash:016x}")
}

/// Reports for the unit tests of the formats.
#[cfg(test)]
pub mod samples {
    use super::*;

    pub fn frame(function: &str, file: Option<&str>, line: Option<u32>) -> Frame {
        Frame::new(FrameInfo {
            address: "0x1234".into(),
            function: function.into(),
            file: file.map(Into::into),
            line,
            module: "/usr/bin/leaky".into(),
            inlined: false,
        })
    }

    /// A final report with one stack: 48 bytes outstanding in one allocation at `leak_here`.
    pub fn report() -> Report {
        Report {
            is_final: true,
            context: None,
            pid: 1,
            ns_pid: None,
            comm: "leaky".into(),
            exe: "/usr/bin/leaky".into(),
            parent: None,
            blind_spots: Vec::new(),
            exited: false,
            live: false,
            at_peak: false,
            duration_s: 1.5,
            sample_bytes: 0,
            growth: None,
            usdt_samples: None,
            totals: Totals::default(),
            peak: Peak::default(),
            temporary_stacks: Vec::new(),
            memory: None,
            mappings: Mappings::default(),
            dropped: DropReason::ALL.iter().map(|r| (r.name(), 0)).collect(),
            unattributed_dropped: BTreeMap::new(),
            stacks_not_shown: 0,
            suppressed: None,
            stacks: vec![StackReport {
                stack_id: "00".into(),
                outstanding_bytes: 48,
                outstanding_allocations: 1,
                allocations: 1,
                allocated_bytes: 48,
                max_outstanding_bytes: 48,
                temporary_allocations: 0,
                pinned_pages: 0,
                pinned_bytes: 0,
                oldest_age_s: 0.5,
                oldest_ns: None,
                truncated: false,
                via: Vec::new(),
                leak: LeakVerdict::default(),
                reachability: None,
                types: Vec::new(),
                suppressed: None,
                frames: vec![frame("leak_here", Some("leaky.c"), Some(12))].into(),
            }],
            modules: vec![Module {
                path: "/usr/bin/leaky".into(),
                start: 0x1000,
                limit: 0x2000,
                file_offset: 0x1000,
                build_id: "0badc0de".into(),
            }],
            double_frees: vec![],
            sizes: vec![],
            lifetimes: vec![],
            thread_pairs: vec![],
            threads: Vec::new(),
            timeline: Timeline::default(),
            children: Vec::new(),
            forks: None,
            unwind_tables: None,
            inspection: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_cover_powers_of_two() {
        let buckets = power_of_two_buckets(&[1, 0, 2, 0, 3]);
        assert_eq!(
            buckets,
            [
                Bucket { min: 0, max: 1, count: 1 },
                Bucket { min: 3, max: 4, count: 2 },
                Bucket { min: 9, max: 16, count: 3 }
            ]
        );
    }

    #[test]
    fn stack_ids_depend_on_file_offsets_not_addresses() {
        let at = |module: &str, file_offset| Resolved { module: module.into(), file_offset, frames: vec![] };
        assert_eq!(stack_hash(&[at("/a", 1)]), stack_hash(&[at("/a", 1)]));
        assert_ne!(stack_hash(&[at("/a", 1)]), stack_hash(&[at("/a", 2)]));
        assert_eq!(stack_hash(&[at("/a", 1)]).len(), 16);
    }
}
