//! Which traced processes did nothing since the last interval that their stacks would show: no
//! allocation, no free, no drop, no mapping call or page touched, no deferred walk finished.
//! The tracer need not read or rebuild the stacks of such a process (see `daemon::settled`).
//!
//! Every allocation and free the kernel records moves the process's `PROC_HEAP` row (its size
//! and lifetime histograms only grow, its bytes in use change) or, when that row found no room, a
//! drop count. An unchanged row, counters and drops thus mean unchanged `STACK_STATS` rows.

use std::collections::{HashMap, HashSet};

use aya::{maps::PerCpuArray, Ebpf};
use profiler_common::{DropReason, ProcCounters, ProcDrops, ProcHeap};

use crate::kernel::{aggregate::map, batch};

/// Everything of one process that changes when its stacks do.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Fingerprint {
    heap: Option<ProcHeap>,
    counters: Option<ProcCounters>,
    drops: Option<ProcDrops>,
    sample_bytes: Option<u64>,
    /// Allocations of any process that found `PROC_HEAP` full: one of this process's would
    /// leave its row unchanged.
    heap_table_full: u64,
    /// What userspace learned of it: its mapping events applied and deferred walks finished.
    learned: u64,
}

/// The processes' fingerprints at the last interval, and how many intervals in a row each has
/// kept its own.
#[derive(Debug, Default)]
pub struct Stillness {
    seen: HashMap<u32, (Fingerprint, u32)>,
}

impl Stillness {
    /// For each of `tgids`, the intervals in a row it has been still, this one included (0: it
    /// moved since the last). `learned` is what userspace learned of a process so far (a count
    /// that grows with each thing learned).
    pub fn update(
        &mut self,
        ebpf: &Ebpf,
        tgids: &HashSet<u32>,
        learned: impl Fn(u32) -> u64,
    ) -> anyhow::Result<HashMap<u32, u32>> {
        // Each map read whole in a few calls, not one call per process: a thousand idle targets
        // are most of the daemon's work at rest.
        let heaps: HashMap<u32, ProcHeap> = whole(ebpf, "PROC_HEAP")?;
        let counters: HashMap<u32, ProcCounters> = whole(ebpf, "PROC_COUNTERS")?;
        let drops: HashMap<u32, ProcDrops> = whole(ebpf, "PROC_DROPS")?;
        let sampling: HashMap<u32, u64> = whole(ebpf, "SAMPLING")?;
        let global: PerCpuArray<_, u64> = PerCpuArray::try_from(map(ebpf, "DROPS")?)?;
        let heap_table_full =
            global.get(&(DropReason::ProcessTableFull as u32), 0).map(|per_cpu| per_cpu.iter().sum()).unwrap_or(0);
        self.seen.retain(|tgid, _| tgids.contains(tgid));
        let mut still = HashMap::with_capacity(tgids.len());
        for &tgid in tgids {
            let now = Fingerprint {
                heap: heaps.get(&tgid).copied(),
                counters: counters.get(&tgid).copied(),
                drops: drops.get(&tgid).copied(),
                sample_bytes: sampling.get(&tgid).copied(),
                heap_table_full,
                learned: learned(tgid),
            };
            let intervals = match self.seen.get(&tgid) {
                Some((before, intervals)) if *before == now => intervals + 1,
                _ => 0,
            };
            self.seen.insert(tgid, (now, intervals));
            still.insert(tgid, intervals);
        }
        Ok(still)
    }

    /// The process exited or exec'd: its next reading starts afresh.
    pub fn forget(&mut self, tgid: u32) {
        self.seen.remove(&tgid);
    }
}

/// Every entry of the per-process map `name`.
fn whole<V: aya::Pod>(ebpf: &Ebpf, name: &str) -> anyhow::Result<HashMap<u32, V>> {
    let mut entries = HashMap::new();
    batch::for_each(map(ebpf, name)?, |&tgid: &u32, value: &V| {
        entries.insert(tgid, *value);
    })?;
    Ok(entries)
}
