//! What memprof knows about a process from `/proc`: its mappings and files, and which of them holds
//! the allocator and where its functions are. Imports `error` only.

pub mod allocator;
mod answers;
pub mod elf_bytes;
pub mod families;
pub mod fast_path;
pub mod file_cache;
pub mod freeze;
pub mod go_functions;
pub mod go_program;
pub mod go_runtime;
pub mod image;
pub mod inject;
pub mod link_map;
pub mod mapping_calls;
pub mod memory;
pub mod mm_uapi;
pub mod mounts;
pub mod pagemap;
pub mod placement;
pub mod precopy;
pub mod procfs;
pub mod usdt;
pub mod vtables;
pub mod write_watch;
