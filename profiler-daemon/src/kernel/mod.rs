//! Everything that talks to the kernel: the embedded eBPF object and its map sizes, the probes and
//! the links that attach them, BTF offsets, batched map reads, the exec/fork/exit events, the
//! ranges processes map (`mappings`), and the reading of the maps into snapshots (with the ages of
//! outstanding memory that go with them).
//! Imports `process`, `unwind` and `error` only.

pub mod ages;
pub mod aggregate;
pub mod batch;
pub mod btf;
pub mod detacher;
pub mod early_stacks;
pub mod events;
pub mod faults;
pub mod growth;
pub mod helper;
pub mod live;
pub mod live_filter;
pub mod live_watch;
pub mod loader;
pub mod map_memory;
pub mod mapping_programs;
pub mod mappings;
pub mod perf_event;
pub mod probe_threads;
pub mod probes;
pub mod sample_rates;
pub mod settings;
pub mod shared;
pub mod stillness;
pub mod uprobe_multi;
