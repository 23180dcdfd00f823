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

/// What `DoubleFrees::take` made of a second free.
#[derive(Debug)]
pub enum Taken<'a> {
    /// The allocator freeing what it caches (see `DoubleFreeFilter`): no double free.
    AllocatorOwn,
    /// Counted by `add_unconfirmed`.
    Unconfirmed,
    /// Kept in full, to be said.
    Kept(&'a DoubleFreeReport),
    /// Past the first `KEPT`, counted only; `first` for the first of them.
    Counted { first: bool },
}

impl DoubleFrees {
    pub const KEPT: usize = 100;

    /// Takes the second free `double_free`: first told from the allocator's own frees by
    /// `filter` (none: not told), then counted unconfirmed unless its first free came once the
    /// process's probes were all in (`seen_whole`), else kept or counted.
    pub fn take(
        &mut self,
        double_free: DoubleFreeReport,
        filter: Option<&DoubleFreeFilter>,
        seen_whole: bool,
    ) -> Taken<'_> {
        if filter.is_some_and(|filter| !filter.is_user(&double_free)) {
            return Taken::AllocatorOwn;
        }
        if !seen_whole {
            self.add_unconfirmed();
            return Taken::Unconfirmed;
        }
        if self.add(double_free) {
            return Taken::Kept(self.kept.last().expect("just kept"));
        }
        Taken::Counted { first: self.not_kept == 1 }
    }

    /// Keeps `double_free` if there is room; returns whether it did.
    fn add(&mut self, double_free: DoubleFreeReport) -> bool {
        if self.kept.len() < Self::KEPT {
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
    fn add_unconfirmed(&mut self) {
        self.unconfirmed += 1;
    }

    /// Those counted by `add_unconfirmed`: in no other count.
    pub fn unconfirmed(&self) -> u64 {
        self.unconfirmed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A second free whose caller is `function` in `module`.
    fn second_free(function: &str, module: &str) -> DoubleFreeReport {
        let site = |frames: serde_json::Value| serde_json::json!({ "tid": 1, "time_s": 0.0, "truncated": false, "frames": frames });
        let caller = serde_json::json!([{ "address": "0x1", "function": function, "file": null, "line": null, "module": module, "inlined": false }]);
        serde_json::from_value(serde_json::json!({
            "address": "0x10", "size": 16,
            "alloc": site(serde_json::json!([])), "first_free": site(serde_json::json!([])), "second_free": site(caller),
        }))
        .expect("a double free")
    }

    #[test]
    fn the_allocators_own_frees_go_before_unconfirmed_ones_are_counted() {
        let filter = DoubleFreeFilter { allocator_modules: vec!["/lib/libc.so.6".into()] };
        let mut frees = DoubleFrees::default();
        let cache = second_free("tcache_thread_shutdown", "/lib/libc.so.6");
        assert!(matches!(frees.take(cache.clone(), Some(&filter), false), Taken::AllocatorOwn));
        assert!(matches!(frees.take(cache, None, false), Taken::Unconfirmed));
        assert!(matches!(frees.take(second_free("main", "/bin/app"), Some(&filter), false), Taken::Unconfirmed));
        assert_eq!((frees.count(), frees.unconfirmed()), (0, 2));
        for _ in 0..DoubleFrees::KEPT {
            assert!(matches!(frees.take(second_free("main", "/bin/app"), Some(&filter), true), Taken::Kept(_)));
        }
        let past = || second_free("main", "/bin/app");
        assert!(matches!(frees.take(past(), Some(&filter), true), Taken::Counted { first: true }));
        assert!(matches!(frees.take(past(), Some(&filter), true), Taken::Counted { first: false }));
        assert_eq!((frees.count(), frees.not_kept(), frees.unconfirmed()), (DoubleFrees::KEPT as u64 + 2, 2, 2));
    }
}
