//! The report of one process: built from a snapshot and symbolized stacks (`build`), printed as
//! a table or as one JSON object per line (docs: reference/json-schema.md#the-json-schema).
//! `stacks` turns the kernel's stack ids into frames, `merge` puts several processes in one
//! profile.

mod build;
mod merge;
#[cfg(test)]
pub mod samples;
mod stacks;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{
    heap::{
        context::RunContext,
        inspect::{Inspection, Reachability},
        leak::{LeakVerdict, Timeline},
        mappings::Mappings,
        resident::Memory,
        suppressions::Suppressed,
        threads::ThreadUse,
        types::TypeCount,
        wrappers::Wrappers,
    },
    kernel::aggregate::Growth,
    process::allocator::BlindSpot,
    symbolize::{Frames, Module},
    unwind::TableUse,
};

pub use build::{add_inspection, build, dropped, unattributed_dropped, Context, Selection};
pub use merge::{is_process_frame, merge_processes, process_frame};
pub use stacks::Stacks;

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
    /// A child that has exited, or a process `attach` traced until it exited: its report as it
    /// stood then.
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
    /// Those samples are Go's heap only, beside the allocator calls traced as the rest of the
    /// report says (a Go program with cgo).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub usdt_beside_calls: bool,
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
    /// Double frees past the first `DoubleFrees::KEPT` of a process: counted, not kept.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub double_frees_not_kept: u64,
    /// Second frees of addresses first freed while memprof's probes went in: a double free, or a
    /// block given out again by a function not probed yet. In no other count.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub double_frees_unconfirmed: u64,
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
    /// The longest a child forked during the session ran before its probes were attached: what
    /// it allocated and freed in that time is not seen.
    #[serde(default)]
    pub unseen_after_fork_ns: u64,
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
    /// A first free's stack, not walked: only its caller (`--full-free-stacks` walks it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub caller_only: bool,
    /// As a stack's: the allocation wrappers folded away from `frames`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub via: Vec<String>,
    pub frames: Frames,
}

/// Stacks listed at most at the peak, for temporary allocations and mappings, whatever `top` says: each
/// carries its frames, and a daemon's process of 65,536 stacks listed them all twice more.
pub const LISTED_MAX: usize = 100;

/// Reason of the generations whose ages were lost because reads came too far apart.
pub const MISSED_GENERATIONS: &str = "age_generation_missed";

impl Report {
    /// `dropped: reason=N ...` for the reasons with drops; None without any.
    pub fn dropped_line(&self) -> Option<String> {
        let dropped: Vec<String> =
            self.dropped.iter().filter(|&(_, &n)| n > 0).map(|(reason, n)| format!("{reason}={n}")).collect();
        (!dropped.is_empty()).then(|| format!("dropped: {}", dropped.join(" ")))
    }

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

fn is_zero(n: &u64) -> bool {
    *n == 0
}

pub fn seconds(ns: u64) -> f64 {
    // Millisecond precision keeps the JSON short; nobody reads nanoseconds of heap age.
    (ns / 1_000_000) as f64 / 1000.0
}
