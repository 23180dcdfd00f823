//! Heap analysis on the kernel's snapshots: reports per stack, the leak rule, sampling decisions and
//! the price of tracing (`price`),
//! filters, double frees, memory mapped outside malloc (`mappings`), and the reachability and C++
//! types of a process held still (`inspect`, `types`), the allocation wrappers folded into the
//! allocator (`wrappers`), the stacks a team accepted (`suppressions`), the heap in use by thread (`threads`). Imports `kernel`,
//! `symbolize`, `process` and `error`; never a map.

pub mod blind_spots;
pub mod block_index;
pub mod capture;
pub mod context;
pub mod double_free;
pub mod filter;
pub mod heuristics;
pub mod inspect;
pub mod known_stacks;
pub mod leak;
pub mod mappings;
pub mod pinned;
pub mod price;
pub mod reachability;
pub mod report;
pub mod resident;
pub mod sampling;
pub mod suppressions;
pub mod threads;
pub mod types;
pub mod untracked;
pub mod wrappers;
