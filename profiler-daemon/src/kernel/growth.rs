//! `--growth`: a process's heap as the pages its anonymous memory holds, each with the stack that
//! first touched it (`profiler-ebpf/src/growth.rs`), until the process gives it back (`munmap`,
//! a `brk` that shrinks, `madvise(MADV_DONTNEED)` and its kind). Each stack's pages are kept as
//! the kernel keeps an allocation's counts (`StackStats`, with the same generations), so that the
//! rest of memprof reads them as it reads any stack's: a page is one allocation of a page's bytes.

use std::collections::{BTreeMap, HashMap};

use profiler_common::{
    generations::{self, FROZEN_AGE},
    StackStats, COUNT_SCALE,
};

use crate::kernel::ages::Clock;

pub const PAGE: u64 = 4096;

/// One process's pages and what each stack holds of them.
#[derive(Debug, Default)]
pub struct Pages {
    /// Each page held, by address: the stack that touched it and the generation it did in.
    held: BTreeMap<u64, Touch>,
    stacks: HashMap<u64, StackStats>,
    /// Pages touched outside the anonymous memory memprof knows the process has (a file's
    /// private copy, memory mapped before a lost event): not heap, not counted.
    pub outside: u64,
    /// The most bytes held at once, and when.
    pub peak: (u64, u64),
    held_bytes: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Touch {
    stack_id: u64,
    generation: u64,
}

impl Pages {
    /// `stack_id` touched the page at `page` at `time_ns`: held from now on, unless it was
    /// already (a page swapped back in, copied after a fork: its first toucher keeps it).
    pub fn touch(&mut self, clock: &Clock, page: u64, stack_id: u64, time_ns: u64) {
        let generation = clock.generation(time_ns);
        if self.held.contains_key(&page) {
            return;
        }
        self.held.insert(page, Touch { stack_id, generation });
        let stats = self.stacks.entry(stack_id).or_insert(StackStats::EMPTY);
        stats.allocations += COUNT_SCALE;
        stats.allocated_bytes += PAGE;
        let slot = generations::slot(generation);
        stats.generation_bytes[slot] = stats.generation_bytes[slot].wrapping_add(PAGE);
        stats.generation_allocations[slot] = stats.generation_allocations[slot].wrapping_add(COUNT_SCALE);
        let outstanding = stats.allocated_bytes - stats.freed_bytes;
        stats.max_outstanding_bytes = stats.max_outstanding_bytes.max(outstanding);
        self.held_bytes += PAGE;
        if self.held_bytes > self.peak.0 {
            self.peak = (self.held_bytes, time_ns);
        }
    }

    /// `touch` for each page of `[start, end)`: a huge page, which one fault filled.
    pub fn touch_all(&mut self, clock: &Clock, start: u64, end: u64, stack_id: u64, time_ns: u64) {
        for page in (start..end).step_by(PAGE as usize) {
            self.touch(clock, page, stack_id, time_ns);
        }
    }

    /// The pages of `[start, end)` were given back at `now_ns`.
    pub fn release(&mut self, clock: &Clock, start: u64, end: u64, now_ns: u64) {
        let now = clock.generation(now_ns);
        for (_, touch) in self.take(start, end) {
            let stats = self.stacks.entry(touch.stack_id).or_insert(StackStats::EMPTY);
            stats.frees += COUNT_SCALE;
            stats.freed_bytes += PAGE;
            if now.saturating_sub(touch.generation) >= FROZEN_AGE {
                stats.old_frees += COUNT_SCALE;
                stats.old_freed_bytes += PAGE;
            } else {
                let slot = generations::slot(touch.generation);
                stats.generation_bytes[slot] = stats.generation_bytes[slot].wrapping_sub(PAGE);
                stats.generation_allocations[slot] = stats.generation_allocations[slot].wrapping_sub(COUNT_SCALE);
            }
            self.held_bytes -= PAGE;
        }
    }

    /// `mremap` moved `[old, old + len)` to `new`: its pages went with it, still held.
    pub fn moved(&mut self, old: u64, len: u64, new: u64) {
        let pages = self.take(old, old.saturating_add(len));
        for (page, touch) in pages {
            self.held.insert(page - old + new, touch);
        }
    }

    fn take(&mut self, start: u64, end: u64) -> Vec<(u64, Touch)> {
        let pages: Vec<(u64, Touch)> = self.held.range(start..end).map(|(&p, &t)| (p, t)).collect();
        for (page, _) in &pages {
            self.held.remove(page);
        }
        pages
    }

    /// Each stack's counts, as the kernel keeps an allocation stack's (in `COUNT_SCALE` units).
    pub fn stacks(&self) -> impl Iterator<Item = (u64, &StackStats)> {
        self.stacks.iter().map(|(&id, stats)| (id, stats))
    }

    #[cfg(test)]
    pub fn held_bytes(&self) -> u64 {
        self.held_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A transparent huge page, which one fault can give a process (x86-64's PMD size).
    const HUGE_PAGE: u64 = 2 << 20;

    const CLOCK: Clock = Clock { base_ns: 0, length_ns: 1_000 };

    fn outstanding(pages: &Pages, stack: u64) -> u64 {
        pages.stacks.get(&stack).map_or(0, |s| s.allocated_bytes - s.freed_bytes)
    }

    #[test]
    fn a_page_is_held_by_its_first_toucher_until_given_back() {
        let mut pages = Pages::default();
        pages.touch(&CLOCK, 0x1000, 7, 10);
        pages.touch(&CLOCK, 0x2000, 7, 20);
        // Touched again (after a fork's copy, a swap-in): still the first toucher's.
        pages.touch(&CLOCK, 0x1000, 9, 30);
        assert_eq!((outstanding(&pages, 7), outstanding(&pages, 9)), (2 * PAGE, 0));
        pages.release(&CLOCK, 0x1000, 0x2000, 40);
        assert_eq!(outstanding(&pages, 7), PAGE);
        // Given back, a page's next touch is a new one.
        pages.touch(&CLOCK, 0x1000, 9, 50);
        assert_eq!((outstanding(&pages, 7), outstanding(&pages, 9), pages.held_bytes()), (PAGE, PAGE, 2 * PAGE));
        assert_eq!(pages.peak, (2 * PAGE, 20));
    }

    #[test]
    fn generations_count_as_the_kernels_do() {
        let mut pages = Pages::default();
        pages.touch(&CLOCK, 0x1000, 1, 500);
        pages.touch(&CLOCK, 0x2000, 1, 2_500);
        pages.touch(&CLOCK, 0x3000, 1, 2_600);
        let stats = pages.stacks.get(&1).copied().unwrap();
        assert_eq!((stats.generation_bytes[0], stats.generation_bytes[2]), (PAGE, 2 * PAGE));
        assert_eq!(stats.generation_allocations[2], 2 * COUNT_SCALE);
        // A young page's release takes it from its generation, an old one's from the old frees.
        pages.release(&CLOCK, 0x2000, 0x3000, 3_000);
        pages.release(&CLOCK, 0x1000, 0x2000, (FROZEN_AGE + 1) * 1_000);
        let stats = pages.stacks.get(&1).copied().unwrap();
        assert_eq!((stats.generation_bytes[0], stats.generation_bytes[2]), (PAGE, PAGE));
        assert_eq!((stats.old_freed_bytes, stats.old_frees), (PAGE, COUNT_SCALE));
        assert_eq!(stats.max_outstanding_bytes, 3 * PAGE);
    }

    #[test]
    fn a_huge_page_holds_each_of_its_pages_once() {
        let mut pages = Pages::default();
        pages.touch(&CLOCK, HUGE_PAGE + PAGE, 5, 0);
        pages.touch_all(&CLOCK, HUGE_PAGE, 2 * HUGE_PAGE, 4, 0);
        assert_eq!((outstanding(&pages, 5), outstanding(&pages, 4)), (PAGE, HUGE_PAGE - PAGE));
        assert_eq!(pages.held_bytes(), HUGE_PAGE);
    }

    #[test]
    fn moved_pages_stay_held_at_their_new_address() {
        let mut pages = Pages::default();
        pages.touch(&CLOCK, 0x10000, 3, 0);
        pages.touch(&CLOCK, 0x11000, 3, 0);
        pages.moved(0x10000, 2 * PAGE, 0x80000);
        pages.release(&CLOCK, 0x10000, 0x12000, 0);
        assert_eq!(outstanding(&pages, 3), 2 * PAGE);
        pages.release(&CLOCK, 0x81000, 0x82000, 0);
        assert_eq!(outstanding(&pages, 3), PAGE);
    }
}
