//! What could not be recorded, and why: every drop is counted and said.

/// Why an event could not be recorded, or was recorded with less than a whole stack. Indexes a
/// process's `ProcDrops`, and the per-CPU `DROPS` array of drops that found no room there.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropReason {
    /// `LIVE` was full: the allocation is neither tracked nor counted.
    LiveMapFull = 0,
    /// `STACK_STATS` was full: the allocation is tracked but its stack totals are not.
    StatsMapFull = 1,
    /// `STACKS` (or `FREE_STACKS`) was full: the allocation is counted under `NO_STACK`.
    StackTableFull = 2,
    /// Another stack had the same 64-bit hash: counted under `NO_STACK`, never merged with it.
    StackCollision = 3,
    /// `INFLIGHT` was full: a call's arguments could not be kept until its return.
    InflightMapFull = 4,
    /// A return probe found no entry state (the call began before the probes were attached), or
    /// an entry state turned out stale (its return never came: the thread died inside the call).
    InflightMissing = 5,
    /// The double-free ring buffer was full.
    DoubleFreeEventLost = 6,
    /// An address was returned again while still live: its free was never seen.
    MissedFree = 7,
    /// `PROC_COUNTERS` or `PROC_HEAP` was full: a per-process counter could not be bumped.
    ProcessTableFull = 8,
    /// A frame's address was in no mapping with an unwind table (JIT code, or a library mapped
    /// moments ago and not read yet): the stack ends there, marked truncated.
    UnwindNoTable = 9,
    /// A frame's unwind rule is one memprof does not follow, or needs a register lost earlier:
    /// the stack ends there, marked truncated.
    UnwindBadRule = 10,
    /// Reading the target's stack failed (a corrupt frame, or a page not present): the stack
    /// ends there, marked truncated.
    UnwindReadFailed = 11,
    /// The stack was deeper than the frame limit: its outermost frames are cut, marked truncated.
    StackTooDeep = 12,
    /// A stack walk began while another, preempted on the same CPU, held its scratch space:
    /// counted under `NO_STACK` (see `stack_id` in the BPF crate).
    StackPreempted = 13,
    /// The ring buffer telling the daemon of new mappings was full: it finds them at its next
    /// refresh instead.
    MappingEventLost = 14,
    /// The table of thread pairs (who frees whose allocations) was full: the free is counted,
    /// its pair is not.
    ThreadPairTableFull = 15,
    /// A walk stopped at a file with no table yet, and its stack copy could not be sent to the
    /// daemon to finish (the ring of deferred walks was full): the stack ends there, truncated.
    DeferredWalkLost = 16,
    /// The ring buffer of anonymous `mmap`, `munmap`, `mremap` and `brk` calls was full: the
    /// process's mappings miss that call.
    MmapEventLost = 17,
    /// The same ring was full at a page's first touch (`--growth`): the page is not counted.
    FaultEventLost = 18,
    /// `--growth`: a large folio (a transparent huge page) a thread was given could not be tied
    /// to its fault (given outside a fault, or its fault's code lost and the folio not found
    /// mapped at the fault's page), or not kept: the fault counts one page.
    FaultSizeUnknown = 19,
    /// Counted by memprof, not by the programs: the thread the process's perf-event uprobes
    /// were opened on exited while other threads ran on, and they fired no more until memprof
    /// opened them again on a live thread. Counts such gaps, not the calls in them.
    ProbeThreadExited = 20,
}

impl DropReason {
    pub const COUNT: usize = 21;
    pub const ALL: [DropReason; DropReason::COUNT] = [
        DropReason::LiveMapFull,
        DropReason::StatsMapFull,
        DropReason::StackTableFull,
        DropReason::StackCollision,
        DropReason::InflightMapFull,
        DropReason::InflightMissing,
        DropReason::DoubleFreeEventLost,
        DropReason::MissedFree,
        DropReason::ProcessTableFull,
        DropReason::UnwindNoTable,
        DropReason::UnwindBadRule,
        DropReason::UnwindReadFailed,
        DropReason::StackTooDeep,
        DropReason::StackPreempted,
        DropReason::MappingEventLost,
        DropReason::ThreadPairTableFull,
        DropReason::DeferredWalkLost,
        DropReason::MmapEventLost,
        DropReason::FaultEventLost,
        DropReason::FaultSizeUnknown,
        DropReason::ProbeThreadExited,
    ];

    /// The snake_case name used in reports and metrics.
    pub fn name(self) -> &'static str {
        match self {
            DropReason::LiveMapFull => "live_map_full",
            DropReason::StatsMapFull => "stats_map_full",
            DropReason::StackTableFull => "stack_table_full",
            DropReason::StackCollision => "stack_collision",
            DropReason::InflightMapFull => "inflight_map_full",
            DropReason::InflightMissing => "inflight_missing",
            DropReason::DoubleFreeEventLost => "double_free_event_lost",
            DropReason::MissedFree => "missed_free",
            DropReason::ProcessTableFull => "process_table_full",
            DropReason::UnwindNoTable => "unwind_no_table",
            DropReason::UnwindBadRule => "unwind_bad_rule",
            DropReason::UnwindReadFailed => "unwind_read_failed",
            DropReason::StackTooDeep => "stack_too_deep",
            DropReason::StackPreempted => "stack_preempted",
            DropReason::MappingEventLost => "mapping_event_lost",
            DropReason::ThreadPairTableFull => "thread_pair_table_full",
            DropReason::DeferredWalkLost => "deferred_walk_lost",
            DropReason::MmapEventLost => "mmap_event_lost",
            DropReason::FaultEventLost => "fault_event_lost",
            DropReason::FaultSizeUnknown => "fault_size_unknown",
            DropReason::ProbeThreadExited => "probe_thread_exited",
        }
    }
}

/// A process's drops, by `DropReason`, in `PROC_DROPS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcDrops {
    pub counts: [u64; DropReason::COUNT],
}

impl Default for ProcDrops {
    fn default() -> Self {
        Self { counts: [0; DropReason::COUNT] }
    }
}
