//! The per-thread view (`--threads`): the bytes and blocks in use by the thread that allocated
//! them, from the live blocks the kernel keeps (each carries its thread), with the threads'
//! names read while they ran (a thread's name is gone with it).

use std::collections::{HashMap, HashSet};

use aya::Ebpf;
use profiler_common::COUNT_SCALE;
use serde::{Deserialize, Serialize};

use crate::{kernel::live, process::procfs};

/// One thread's share of the heap in use (JSON `"threads"`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ThreadUse {
    pub tid: u32,
    /// Its name (`/proc/PID/task/TID/comm`) when memprof saw it run; none for a thread that
    /// came and went between two intervals.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Estimates when the process is sampled: each block scaled by its weight.
    pub outstanding_bytes: u64,
    pub outstanding_allocations: u64,
}

/// The names of a process's threads, as last seen.
#[derive(Debug, Default)]
pub struct ThreadNames(HashMap<u32, String>);

impl ThreadNames {
    /// Adds the names of `pid`'s threads now: one read of `/proc/PID/task` a call.
    pub fn refresh(&mut self, pid: u32) {
        self.0.extend(procfs::thread_names(pid));
    }
}

/// Blocks and bytes in use per thread, in `COUNT_SCALE` units of blocks.
#[derive(Debug, Default)]
pub struct Tally(HashMap<u32, (u64, u64)>);

impl Tally {
    fn add(&mut self, block: live::ThreadBlock, sample_bytes: u64) {
        let (count, bytes) =
            if block.sampled { profiler_common::weight(sample_bytes, block.size) } else { (COUNT_SCALE, block.size) };
        let entry = self.0.entry(block.tid).or_default();
        entry.0 += count;
        entry.1 += bytes;
    }

    /// The view: most bytes first, then by thread id.
    pub fn view(&self, names: Option<&ThreadNames>) -> Vec<ThreadUse> {
        let mut threads: Vec<ThreadUse> = self
            .0
            .iter()
            .map(|(&tid, &(count, bytes))| ThreadUse {
                tid,
                name: names.and_then(|n| n.0.get(&tid).cloned()),
                outstanding_bytes: bytes,
                outstanding_allocations: (count + COUNT_SCALE / 2) / COUNT_SCALE,
            })
            .collect();
        threads.sort_by_key(|t| (std::cmp::Reverse(t.outstanding_bytes), t.tid));
        threads
    }
}

/// Each of `pids`' tally, from one walk of the live blocks; `sample_bytes` says each process's
/// sampling rate, by which its sampled blocks are scaled.
pub fn read(
    ebpf: &Ebpf,
    pids: &HashSet<u32>,
    sample_bytes: impl Fn(u32) -> u64,
) -> anyhow::Result<HashMap<u32, Tally>> {
    let mut tallies: HashMap<u32, Tally> = HashMap::new();
    live::for_each_thread_block(ebpf, pids, |pid, block| {
        tallies.entry(pid).or_default().add(block, sample_bytes(pid))
    })?;
    Ok(tallies)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampled_blocks_count_for_their_weight() {
        let mut tally = Tally::default();
        tally.add(live::ThreadBlock { tid: 7, size: 100, sampled: false }, 0);
        tally.add(live::ThreadBlock { tid: 7, size: 100, sampled: false }, 0);
        // One 1 KiB block sampled at one in 4 KiB stands for four.
        tally.add(live::ThreadBlock { tid: 9, size: 1024, sampled: true }, 4096);
        let mut names = ThreadNames::default();
        names.0.insert(9, "worker".into());
        assert_eq!(
            tally.view(Some(&names)),
            [
                ThreadUse { tid: 9, name: Some("worker".into()), outstanding_bytes: 4096, outstanding_allocations: 4 },
                ThreadUse { tid: 7, name: None, outstanding_bytes: 200, outstanding_allocations: 2 },
            ]
        );
    }
}
