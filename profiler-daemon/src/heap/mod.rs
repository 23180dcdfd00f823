//! Heap analysis on the kernel's snapshots: reports per stack, the leak rule, sampling decisions,
//! filters and double frees. Imports `kernel`, `symbolize`, `process` and `error`; never a map.

pub mod blind_spots;
pub mod context;
pub mod double_free;
pub mod filter;
pub mod leak;
pub mod report;
pub mod resident;
pub mod sampling;
pub mod stack_cache;
