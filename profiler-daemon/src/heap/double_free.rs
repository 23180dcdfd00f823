//! Which double frees are the program's own, and which are the allocator freeing what it caches.

use crate::{heap::report::DoubleFreeReport, process::allocator::Allocator};

/// glibc functions that free blocks sitting in the allocator's own caches: at thread exit, the
/// thread's tcache; at `__libc_freeres`, everything. They free addresses the program freed
/// already, which is no double free.
const ALLOCATOR_INTERNAL_FREES: [&str; 4] =
    ["tcache_thread_shutdown", "__malloc_arena_thread_freeres", "__libc_thread_freeres", "__libc_freeres"];

/// Tells a program's double frees from the allocator freeing blocks it caches.
pub struct DoubleFreeFilter {
    /// The allocator's files as `/proc/PID/maps` names them, but for the executable: a static
    /// binary (or Rust's static jemalloc) holds the allocator and the program in one file, where
    /// only names tell them apart.
    allocator_modules: Vec<String>,
}

impl DoubleFreeFilter {
    pub fn new(allocator: &Allocator, executable: Option<&str>) -> Self {
        let mut allocator_modules = allocator.modules();
        allocator_modules.retain(|module| Some(module.as_str()) != executable);
        Self { allocator_modules }
    }

    /// Whether the second free was the program's own.
    pub fn is_user(&self, double_free: &DoubleFreeReport) -> bool {
        let Some(caller) = double_free.second_free.frames.first() else { return true };
        let internal_name = ALLOCATOR_INTERNAL_FREES.contains(&caller.function.as_str());
        let internal_module = self.allocator_modules.contains(&caller.module);
        !(internal_name || internal_module)
    }
}

/// A process's double frees: the first `KEPT` in full, the rest counted. A program that frees
/// twice in a loop (an allocator that does not abort on it) would otherwise grow memprof's
/// memory and its log at the loop's rate.
#[derive(Debug, Default)]
pub struct DoubleFrees {
    kept: Vec<DoubleFreeReport>,
    not_kept: u64,
    unconfirmed: u64,
}

impl DoubleFrees {
    pub const KEPT: usize = 100;

    /// Whether the next one will be counted only.
    pub fn is_full(&self) -> bool {
        self.kept.len() >= Self::KEPT
    }

    /// Keeps `double_free` if there is room; returns whether it did.
    pub fn add(&mut self, double_free: DoubleFreeReport) -> bool {
        if !self.is_full() {
            self.kept.push(double_free);
            return true;
        }
        self.not_kept += 1;
        false
    }

    pub fn kept(&self) -> &[DoubleFreeReport] {
        &self.kept
    }

    /// Those past the first `KEPT`, counted only.
    pub fn not_kept(&self) -> u64 {
        self.not_kept
    }

    /// All of them, kept or not.
    pub fn count(&self) -> u64 {
        self.kept.len() as u64 + self.not_kept
    }

    /// Counts a second free of an address whose first free came while the process's probes
    /// went in (see `Loaded::double_free_seen_whole`): it may be one, or a reuse no probe saw.
    pub fn add_unconfirmed(&mut self) {
        self.unconfirmed += 1;
    }

    /// Those counted by `add_unconfirmed`: in no other count.
    pub fn unconfirmed(&self) -> u64 {
        self.unconfirmed
    }
}
