//! The live allocations the kernel tracks for one process (`LIVE`): what `--inspect` classifies.

use aya::Ebpf;
use profiler_common::{AddrKey, LiveAlloc};

use crate::kernel::{aggregate, batch};

/// One outstanding allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveBlock {
    pub addr: u64,
    pub size: u64,
    /// The kernel's id of its allocation stack (as `StackSnapshot::stored_id`).
    pub stack_id: u64,
}

/// Every block `tgid` holds now, sorted by address. One walk of `LIVE`, whose size is that of
/// every traced process's live allocations together.
pub fn blocks(ebpf: &Ebpf, tgid: u32) -> anyhow::Result<Vec<LiveBlock>> {
    let mut blocks = Vec::new();
    batch::for_each(aggregate::map(ebpf, "LIVE")?, |key: &AddrKey, live: &LiveAlloc| {
        if key.tgid == tgid {
            blocks.push(LiveBlock { addr: key.addr, size: live.size, stack_id: live.stack_id });
        }
    })?;
    blocks.sort_unstable_by_key(|block| block.addr);
    Ok(blocks)
}
