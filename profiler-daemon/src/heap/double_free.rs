//! Which double frees are the program's own, and which are the allocator freeing what it caches.

use crate::heap::report::DoubleFreeReport;

/// glibc functions that free blocks sitting in the allocator's own caches: at thread exit, the
/// thread's tcache; at `__libc_freeres`, everything. They free addresses the program freed
/// already, which is no double free.
const ALLOCATOR_INTERNAL_FREES: [&str; 4] =
    ["tcache_thread_shutdown", "__malloc_arena_thread_freeres", "__libc_thread_freeres", "__libc_freeres"];

/// Tells a program's double frees from the allocator freeing blocks it caches.
pub struct DoubleFreeFilter {
    /// The allocator's file as `/proc/PID/maps` names it.
    allocator_module: String,
    /// Static binaries hold the allocator and the program in one file: only names tell them apart.
    allocator_in_executable: bool,
}

impl DoubleFreeFilter {
    pub fn new(allocator_module: &str, executable: Option<&str>) -> Self {
        Self {
            allocator_module: allocator_module.to_string(),
            allocator_in_executable: executable == Some(allocator_module),
        }
    }

    /// Whether the second free was the program's own.
    pub fn is_user(&self, double_free: &DoubleFreeReport) -> bool {
        let Some(caller) = double_free.second_free.frames.first() else { return true };
        let internal_name = ALLOCATOR_INTERNAL_FREES.contains(&caller.function.as_str());
        let internal_module = !self.allocator_in_executable && caller.module == self.allocator_module;
        !(internal_name || internal_module)
    }
}
