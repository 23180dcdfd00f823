//! Resident memory against the heap: a process's anonymous resident memory (`RssAnon`), the bytes
//! its program has in use through the allocator, and the difference (the allocator's overhead,
//! fragmentation and caches, and anonymous memory not from malloc: thread stacks, mmap).

use std::cell::Cell;

use serde::{Deserialize, Serialize};

use crate::process::procfs;

/// One reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Memory {
    pub rss_anon_bytes: u64,
    /// Bytes allocated and not freed since tracing began (the report's `outstanding_bytes`).
    pub heap_inuse_bytes: u64,
    /// `rss_anon_bytes - heap_inuse_bytes`: negative when allocated memory is not touched yet
    /// (or was allocated before attach and counts as resident only).
    pub difference_bytes: i64,
}

/// The latest reading of one traced process. A `Cell`, as reports are built from a shared borrow.
#[derive(Debug, Default)]
pub struct Resident {
    last: Cell<Option<Memory>>,
}

impl Resident {
    /// The process's memory now, given the bytes in use its report counts; once it has exited,
    /// the last reading taken while it ran (its final report's heap may have changed since).
    pub fn current(&self, pid: u32, heap_inuse_bytes: u64) -> Option<Memory> {
        if let Some(rss_anon_bytes) = procfs::anon_resident_bytes(pid) {
            let difference_bytes = rss_anon_bytes as i64 - heap_inuse_bytes as i64;
            self.last.set(Some(Memory { rss_anon_bytes, heap_inuse_bytes, difference_bytes }));
        }
        self.last.get()
    }
}
