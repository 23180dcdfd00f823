//! What the tracer publishes every interval and the HTTP side serves: built once per interval,
//! so scrapes and API calls never touch BPF maps.

use std::{collections::BTreeMap, sync::Arc};

use profiler_common::{DropReason, Log2Histogram};

use super::{heavy::Built, host::HostProfiles};
use crate::{
    heap::report::{Report, StackReport},
    unwind::TableUse,
};

/// One traced process. Shared, not copied, by the requests that read it.
#[derive(Debug)]
pub struct TargetView {
    pub pid: u32,
    /// Which of the traced processes of its command name it is (see `slots`): its series' identity.
    pub slot: u32,
    pub comm: String,
    /// Its cgroup in the unified hierarchy (a container, a service), when known.
    pub cgroup: Option<String>,
    /// Seconds since the Unix epoch when its probes were attached.
    pub attached_at: f64,
    pub double_frees: u64,
    /// In-use bytes of the stacks the leak rule flags, and how many.
    pub leak_candidate_bytes: u64,
    pub leak_candidates: u64,
    /// The leak rule has not seen a window of intervals yet: the two above are not verdicts.
    pub leak_warming_up: bool,
    /// Mean bytes between recorded allocations when sampled; 0 when every call is recorded.
    pub sample_bytes: u64,
    pub sizes: Log2Histogram,
    /// The exported stacks (leak candidates first, then the largest by in-use bytes), then the
    /// rest summed up.
    pub top_stacks: Vec<StackSeries>,
    pub other_stack_bytes: u64,
    /// The full report, as `memprof attach --json` prints it at the end.
    pub report: Report,
    /// Stacks that freed all they allocated, left out of `report`: the allocation profile counts them.
    pub freed_stacks: Vec<StackReport>,
    /// The answers built from this interval's report so far.
    pub built: Built,
}

#[derive(Debug, Clone, PartialEq)]
pub struct StackSeries {
    /// The report's stack id: stable across runs.
    pub stack: String,
    /// `function (file:line)` of the allocator's caller.
    pub site: String,
    /// The site's function alone: the leak alert pages once per function, however many of its
    /// lines leak.
    pub function: String,
    pub bytes: u64,
    pub leak_candidate: bool,
}

/// A BPF map that fills up: entries in use and capacity.
#[derive(Debug, Clone, Copy, Default)]
pub struct MapUse {
    pub name: &'static str,
    pub entries: u64,
    pub capacity: u64,
}

#[derive(Debug, Clone, Default)]
pub struct DaemonView {
    /// By pid.
    pub targets: BTreeMap<u32, Arc<TargetView>>,
    /// Drops no process's counters had room for (each target's are in its report).
    pub unattributed_drops: [u64; DropReason::COUNT],
    /// Every drop of every process traced since the daemon started, by reason.
    pub all_drops: BTreeMap<&'static str, u64>,
    pub maps: Vec<MapUse>,
    /// The unwind tables of every traced process's files.
    pub unwind: TableUse,
    /// Matching processes not traced because `max_targets` were traced already.
    pub refused_targets: u64,
    /// Matching processes gone before they could be attached.
    pub missed_targets: u64,
    /// Children of traced processes attached from their fork event, and those that matched the
    /// rules but were gone (or could not be probed) by the time memprof attached.
    pub children_followed: u64,
    pub children_missed: u64,
    /// How long the followed children ran between their fork and their probes, unseen: in
    /// all, and the longest one.
    pub children_unseen_ns: u64,
    pub longest_child_unseen_ns: u64,
    /// How long the other matching processes that started while the daemon ran went unseen
    /// before their probes: in all, and the longest one.
    pub started_unseen_ns: u64,
    pub longest_started_unseen_ns: u64,
    /// Processes not traced that map a file whose probe links are shared, and so take a trap
    /// at each of its probed calls.
    pub untraced_sharing: u64,
    /// Where memprof's programs run for every process on the machine now (see
    /// `kernel::mapping_programs::MachineWide`).
    pub machine_wide: Vec<&'static str>,
    /// `memprof_allocation_size_bytes` is exported (`Config::size_histograms`).
    pub size_histograms: bool,
    /// Every per-process series carries `pid` too (`Config::pid_labels`).
    pub pid_labels: bool,
    /// Targets whose stacks are not read while they stay still (see `settled`).
    pub settled_targets: u64,
    /// Scans of /proc for processes to trace (see `Config::resync`).
    pub discovery_scans: u64,
    /// Execs and forks of processes not traced the kernel reported for the rules to judge.
    pub discovery_events: u64,
    pub symbolization_failures: Vec<(&'static str, u64)>,
    /// Set once the first snapshot is published.
    pub ready: bool,
    /// When the kernel's maps were read for this view, in seconds since the Unix epoch: a view
    /// that stops moving says that the daemon's thread is held up.
    pub read_at_seconds: f64,
    /// The profiles of every target together, built from this interval's reports on request.
    pub host_profiles: Arc<HostProfiles>,
}
