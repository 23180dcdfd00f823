//! Heap analysis on the kernel's snapshots: reports per stack, the leak rule, sampling decisions,
//! filters and double frees. Imports `kernel`, `symbolize`, `process` and `error`; never a map.

pub mod blind_spots;
pub mod double_free;
pub mod filter;
pub mod leak;
pub mod report;
pub mod resident;
pub mod sampling;
