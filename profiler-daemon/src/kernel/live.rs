//! The live allocations the kernel tracks (`LIVE`): what `--inspect` classifies, and the pages
//! the heap's blocks pin.

use std::collections::{HashMap, HashSet};

use aya::{
    maps::{HashMap as BpfHashMap, MapData},
    Ebpf,
};
use profiler_common::{AddrKey, LiveAlloc, ProcHeap, SAMPLED, USDT};

use crate::kernel::{aggregate, batch, sample_rates};

/// One outstanding allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveBlock {
    pub addr: u64,
    pub size: u64,
    /// The kernel's id of its allocation stack (as `StackSnapshot::stored_id`).
    pub stack_id: u64,
    /// The bytes it stands for: `size`, or for a block recorded by sampling, its estimate
    /// (`profiler_common::weight`).
    pub weighted_bytes: u64,
}

/// Every block `tgid` holds now, sorted by address.
pub fn blocks(ebpf: &Ebpf, tgid: u32) -> anyhow::Result<Vec<LiveBlock>> {
    Ok(by_process(ebpf, &[tgid].into())?.remove(&tgid).unwrap_or_default())
}

/// Every block each of `tgids` holds now, sorted by address. One walk of `LIVE`, whose size is
/// that of every traced process's live allocations together.
pub fn by_process(ebpf: &Ebpf, tgids: &HashSet<u32>) -> anyhow::Result<HashMap<u32, Vec<LiveBlock>>> {
    let mut blocks: HashMap<u32, Vec<LiveBlock>> = HashMap::new();
    let weights = Weights::of(ebpf)?;
    batch::for_each(aggregate::map(ebpf, "LIVE")?, |key: &AddrKey, live: &LiveAlloc| {
        if tgids.contains(&key.tgid) {
            blocks.entry(key.tgid).or_default().push(weights.block(key, live));
        }
    })?;
    for process in blocks.values_mut() {
        process.sort_unstable_by_key(|block| block.addr);
    }
    Ok(blocks)
}

/// `tgid`'s blocks now, from `listed` (its blocks at an earlier moment, sorted by address) and
/// the addresses of those that changed since (`live_watch`): each is looked up again.
pub fn with_changes(
    ebpf: &Ebpf,
    tgid: u32,
    mut listed: Vec<LiveBlock>,
    changed: &[u64],
) -> anyhow::Result<Vec<LiveBlock>> {
    let changed: HashSet<u64> = changed.iter().copied().collect();
    listed.retain(|block| !changed.contains(&block.addr));
    let weights = Weights::of(ebpf)?;
    let live: BpfHashMap<_, AddrKey, LiveAlloc> = BpfHashMap::try_from(aggregate::map(ebpf, "LIVE")?)?;
    for &addr in &changed {
        let key = AddrKey { tgid, _pad: 0, addr };
        match live.get(&key, 0) {
            Ok(alloc) => listed.push(weights.block(&key, &alloc)),
            Err(aya::maps::MapError::KeyNotFound) => {}
            Err(err) => return Err(err.into()),
        }
    }
    listed.sort_unstable_by_key(|block| block.addr);
    Ok(listed)
}

/// What a block stands for: the rates the kernel weighs blocks by at their free (`rate_of` in
/// the programs).
struct Weights<'a> {
    rates: HashMap<u32, u64>,
    usdt: BpfHashMap<&'a MapData, AddrKey, u64>,
}

impl<'a> Weights<'a> {
    fn of(ebpf: &'a Ebpf) -> anyhow::Result<Self> {
        let usdt = BpfHashMap::try_from(aggregate::map(ebpf, "USDT_WEIGHTS")?)?;
        Ok(Weights { rates: sample_rates::of(ebpf)?, usdt })
    }

    fn block(&self, key: &AddrKey, live: &LiveAlloc) -> LiveBlock {
        let rate = if live.func & USDT != 0 {
            self.usdt.get(key, 0).unwrap_or(0)
        } else if live.func & SAMPLED != 0 {
            self.rates.get(&key.tgid).copied().unwrap_or(0)
        } else {
            0
        };
        let weighted_bytes = profiler_common::weight(rate, live.size).1;
        LiveBlock { addr: key.addr, size: live.size, stack_id: live.stack_id, weighted_bytes }
    }
}

/// One live block as the per-thread view counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThreadBlock {
    pub tid: u32,
    pub size: u64,
    /// Recorded by sampling (`profiler_common::SAMPLED`): it stands for more than itself.
    pub sampled: bool,
}

/// Calls `each` with every block of `tgids` and its process. One walk of `LIVE`.
pub fn for_each_thread_block(
    ebpf: &Ebpf,
    tgids: &HashSet<u32>,
    mut each: impl FnMut(u32, ThreadBlock),
) -> anyhow::Result<()> {
    batch::for_each(aggregate::map(ebpf, "LIVE")?, |key: &AddrKey, live: &LiveAlloc| {
        if tgids.contains(&key.tgid) {
            let sampled = live.func & profiler_common::SAMPLED != 0;
            each(key.tgid, ThreadBlock { tid: live.tid, size: live.size, sampled });
        }
    })
}

/// `tgid`'s heap figures (`PROC_HEAP`), which every allocation and free it makes changes after
/// changing `LIVE`: the same at two moments, `LIVE` held the same blocks of `tgid`'s at both
/// (it bumps its size histogram at each allocation, its lifetime histogram or bytes in use at
/// each free). `None` before its first allocation, or when the table was full.
pub fn heap_state(ebpf: &Ebpf, tgid: u32) -> anyhow::Result<Option<ProcHeap>> {
    let heaps: BpfHashMap<_, u32, ProcHeap> = BpfHashMap::try_from(aggregate::map(ebpf, "PROC_HEAP")?)?;
    Ok(heaps.get(&tgid, 0).ok())
}
