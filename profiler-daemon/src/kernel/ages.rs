//! How old the outstanding memory of each stack is, from the kernel's generation counters (see
//! `profiler_common::generations`): a read costs a few steps per stack, however many allocations
//! are live.
//!
//! The kernel keeps the last `GENERATIONS` generations of each stack apart. This book takes each
//! generation over once it is frozen and keeps what is left of it; frees of frozen generations
//! arrive as one total, applied to the oldest generations first (exact for leaks, caches that
//! evict their oldest entries and pools freed whole; an approximation for other orders).

use std::collections::{HashMap, VecDeque};

use profiler_common::{
    generations::{self, FROZEN_AGE, GENERATIONS},
    StackKey, StackStats,
};

/// The kernel's generation clock, as loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Clock {
    pub base_ns: u64,
    pub length_ns: u64,
}

impl Clock {
    /// Generations of a quarter interval: the book is read every interval, well within the
    /// `GENERATIONS - FROZEN_AGE` generations a frozen one stays in the kernel.
    pub fn for_interval(base_ns: u64, interval_s: f64) -> Self {
        Self { base_ns, length_ns: ((interval_s * 1e9 / 4.0) as u64).max(1_000_000) }
    }

    pub fn generation(&self, time_ns: u64) -> u64 {
        generations::generation(time_ns, self.base_ns, self.length_ns)
    }

    pub fn start_ns(&self, generation: u64) -> u64 {
        self.base_ns + generation * self.length_ns
    }
}

/// Outstanding memory allocated in generations `first..=last`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AgeSpan {
    pub first: u64,
    pub last: u64,
    pub bytes: u64,
    pub allocations: u64,
}

/// Frozen spans kept per stack; older ones are merged, keeping the oldest generation exact.
const MAX_SPANS: usize = 64;

#[derive(Debug, Default)]
struct StackAges {
    /// Each slot's sums when its current generation took it over.
    baseline_bytes: [u64; GENERATIONS],
    baseline_allocations: [u64; GENERATIONS],
    /// Every generation before this one has been taken over.
    frozen_through: u64,
    /// What is left of the frozen generations, oldest first.
    frozen: VecDeque<AgeSpan>,
    /// Old frees already applied to `frozen`.
    old_freed_bytes: u64,
    old_frees: u64,
    /// At the last observation: the generation then, and the stack's allocations so far.
    observed: u64,
    allocations: u64,
}

#[derive(Debug)]
pub struct AgeBook {
    pub clock: Clock,
    /// Boxed: a table of tens of thousands of stacks holds a pointer per empty slot, not a
    /// whole `StackAges`.
    stacks: HashMap<StackKey, Box<StackAges>>,
    /// Generations reused in the kernel before the book took them over (reads too far apart),
    /// by process: their memory is counted as younger than it is.
    missed_generations: HashMap<u32, u64>,
    /// By process: the generation before which it wrote nothing the book has not taken over,
    /// as `rest` was told; its stacks were not observed meanwhile.
    rested_until: HashMap<u32, u64>,
}

impl AgeBook {
    pub fn new(clock: Clock) -> Self {
        Self { clock, stacks: HashMap::new(), missed_generations: HashMap::new(), rested_until: HashMap::new() }
    }

    /// Process `tgid` has changed none of its stacks since `since_ns`, and each was observed
    /// after its last change had frozen: the generations until then hold nothing new, and
    /// not observing its stacks meanwhile misses none.
    pub fn rest(&mut self, tgid: u32, since_ns: u64) {
        let until = self.clock.generation(since_ns);
        let rested = self.rested_until.entry(tgid).or_default();
        *rested = (*rested).max(until);
    }

    /// Brings one stack up to `now_ns` and returns its outstanding memory by age, oldest first.
    pub fn observe(&mut self, key: StackKey, stats: &StackStats, now_ns: u64) -> Vec<AgeSpan> {
        let now = self.clock.generation(now_ns);
        // Generations still in the kernel's ring, and the frozen ones among them.
        let in_ring = (now + 1).saturating_sub(GENERATIONS as u64);
        let unfrozen = (now + 1).saturating_sub(FROZEN_AGE);
        let ages = self
            .stacks
            .entry(key)
            .or_insert_with(|| Box::new(StackAges { frozen_through: in_ring, ..Default::default() }));
        // Generations the process spent at rest were empty: nothing to take over.
        let rested = self.rested_until.get(&key.tgid).map_or(0, |&until| until.min(in_ring));
        ages.frozen_through = ages.frozen_through.max(rested);
        // Only an allocation reuses a slot. Without one since the last observation, however long
        // ago, the generations up to it are still in their slots and those after it are empty.
        let allocated = stats.allocations != ages.allocations;
        if allocated && ages.frozen_through < in_ring {
            *self.missed_generations.entry(key.tgid).or_default() += in_ring - ages.frozen_through;
            ages.frozen_through = in_ring;
        }
        let written_before = if allocated { unfrozen } else { unfrozen.min(ages.observed + 1) };
        for generation in ages.frozen_through..written_before {
            let span = take_slot(ages, stats, generation);
            if span.bytes != 0 || span.allocations != 0 {
                ages.frozen.push_back(span);
            }
        }
        ages.frozen_through = ages.frozen_through.max(unfrozen);
        (ages.observed, ages.allocations) = (now, stats.allocations);
        apply_old_frees(ages, stats);
        merge_oldest(&mut ages.frozen);
        let live = (unfrozen..=now).map(|generation| slot_span(ages, stats, generation));
        ages.frozen.iter().copied().chain(live).filter(|s| s.bytes != 0 || s.allocations != 0).collect()
    }

    /// Process `tgid`'s stacks were all observed after its rest: it is no longer resting.
    pub fn woke(&mut self, tgid: u32) {
        self.rested_until.remove(&tgid);
    }

    /// The generations of process `tgid` that were missed (see `missed_generations`).
    pub fn missed_generations(&self, tgid: u32) -> u64 {
        self.missed_generations.get(&tgid).copied().unwrap_or(0)
    }

    /// Forgets a process that has exited.
    pub fn forget(&mut self, tgid: u32) {
        self.stacks.retain(|key, _| key.tgid != tgid);
        self.missed_generations.remove(&tgid);
        self.rested_until.remove(&tgid);
    }
}

/// What generation `generation`'s slot holds beyond its baseline: what is left of the generation.
fn slot_span(ages: &StackAges, stats: &StackStats, generation: u64) -> AgeSpan {
    let slot = generations::slot(generation);
    AgeSpan {
        first: generation,
        last: generation,
        bytes: stats.generation_bytes[slot].wrapping_sub(ages.baseline_bytes[slot]),
        allocations: stats.generation_allocations[slot].wrapping_sub(ages.baseline_allocations[slot]),
    }
}

/// Takes generation `generation`'s slot over: what it holds now is what is left of it.
fn take_slot(ages: &mut StackAges, stats: &StackStats, generation: u64) -> AgeSpan {
    let span = slot_span(ages, stats, generation);
    let slot = generations::slot(generation);
    ages.baseline_bytes[slot] = stats.generation_bytes[slot];
    ages.baseline_allocations[slot] = stats.generation_allocations[slot];
    span
}

/// Takes the frees of frozen generations since the last read off the oldest spans first.
fn apply_old_frees(ages: &mut StackAges, stats: &StackStats) {
    let mut bytes = stats.old_freed_bytes.wrapping_sub(ages.old_freed_bytes);
    let mut allocations = stats.old_frees.wrapping_sub(ages.old_frees);
    ages.old_freed_bytes = stats.old_freed_bytes;
    ages.old_frees = stats.old_frees;
    for span in ages.frozen.iter_mut() {
        let (b, a) = (bytes.min(span.bytes), allocations.min(span.allocations));
        span.bytes -= b;
        span.allocations -= a;
        bytes -= b;
        allocations -= a;
    }
    ages.frozen.retain(|s| s.bytes != 0 || s.allocations != 0);
}

/// Keeps at most `MAX_SPANS` spans by merging the second and third oldest: the oldest stays
/// exact, and the merged ones are long past any window a report looks at.
fn merge_oldest(frozen: &mut VecDeque<AgeSpan>) {
    while frozen.len() > MAX_SPANS {
        let (a, b) = (frozen[1], frozen[2]);
        frozen[1] = AgeSpan {
            first: a.first,
            last: b.last,
            bytes: a.bytes + b.bytes,
            allocations: a.allocations + b.allocations,
        };
        frozen.remove(2);
    }
}

/// Sums of `spans` whose every allocation was made at least `min_age_ns` before `now_ns`.
pub fn aged(clock: &Clock, spans: &[AgeSpan], now_ns: u64, min_age_ns: u64) -> (u64, u64) {
    spans
        .iter()
        .filter(|s| clock.start_ns(s.last + 1) + min_age_ns <= now_ns)
        .fold((0, 0), |(bytes, count), s| (bytes + s.bytes, count + s.allocations))
}

/// Bytes of `spans` whose generation began before `time_ns` (the generation that straddles it
/// included: it may hold a few later allocations too).
pub fn allocated_before(clock: &Clock, spans: &[AgeSpan], time_ns: u64) -> u64 {
    spans.iter().filter(|s| clock.start_ns(s.first) < time_ns).map(|s| s.bytes).sum()
}

/// The earliest time the oldest outstanding allocation can have been made.
pub fn oldest_ns(clock: &Clock, spans: &[AgeSpan]) -> Option<u64> {
    spans.first().map(|s| clock.start_ns(s.first))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLOCK: Clock = Clock { base_ns: 0, length_ns: 10 };

    /// A stack's row as the kernel would keep it, from (allocation generation, bytes, freed at).
    fn row(events: &[(u64, u64, Option<u64>)]) -> StackStats {
        let mut stats = StackStats::EMPTY;
        for &(born, bytes, freed) in events {
            let slot = generations::slot(born);
            stats.generation_bytes[slot] = stats.generation_bytes[slot].wrapping_add(bytes);
            stats.generation_allocations[slot] += 1;
            stats.allocations += 1;
            if let Some(freed) = freed {
                if freed - born >= FROZEN_AGE {
                    stats.old_freed_bytes += bytes;
                    stats.old_frees += 1;
                } else {
                    stats.generation_bytes[slot] = stats.generation_bytes[slot].wrapping_sub(bytes);
                    stats.generation_allocations[slot] -= 1;
                }
            }
        }
        stats
    }

    fn key() -> StackKey {
        StackKey { tgid: 1, image: 0, stack_id: 7 }
    }

    #[test]
    fn a_leak_keeps_every_generation() {
        let mut book = AgeBook::new(CLOCK);
        let mut events = Vec::new();
        // One 100-byte leak per generation, read every 4 generations for 40 generations.
        for now in 0..40u64 {
            events.push((now, 100, None));
            if now % 4 == 3 {
                let spans = book.observe(key(), &row(&events), now * 10 + 5);
                let total: u64 = spans.iter().map(|s| s.bytes).sum();
                assert_eq!(total, 100 * (now + 1), "at generation {now}");
                assert_eq!(oldest_ns(&CLOCK, &spans), Some(0));
            }
        }
        assert_eq!(book.missed_generations(key().tgid), 0);
        let spans = book.observe(key(), &row(&events), 395);
        assert_eq!(aged(&CLOCK, &spans, 395, 100), (100 * 29, 29), "generations 0..=28 ended by 295");
    }

    #[test]
    fn old_frees_come_off_the_oldest_first() {
        let mut book = AgeBook::new(CLOCK);
        let before = row(&[(0, 10, None), (1, 20, None)]);
        assert_eq!(book.observe(key(), &before, 15).len(), 2);
        assert_eq!(book.observe(key(), &before, 95).len(), 2, "both frozen and taken over at generation 9");
        // Generation 0's block is freed at generation 12.
        let spans = book.observe(key(), &row(&[(0, 10, Some(12)), (1, 20, None)]), 125);
        assert_eq!(spans, [AgeSpan { first: 1, last: 1, bytes: 20, allocations: 1 }]);
    }

    #[test]
    fn reads_too_far_apart_are_counted() {
        let mut book = AgeBook::new(CLOCK);
        let _ = book.observe(key(), &row(&[(0, 10, None)]), 5);
        // An allocation between: it may have reused a slot not taken over yet.
        let _ = book.observe(key(), &row(&[(0, 10, None), (90, 5, None)]), 1000);
        assert!(book.missed_generations(key().tgid) > 0);
    }

    #[test]
    fn reads_far_apart_miss_nothing_of_a_stack_that_allocated_nothing_between() {
        let mut book = AgeBook::new(CLOCK);
        // Read at generation 5; then generation 0's block freed at 6 (from its slot) and
        // generation 2's at 50 (an old free), and nothing allocated.
        let _ = book.observe(key(), &row(&[(0, 10, None), (2, 20, None), (5, 40, None)]), 55);
        let later = row(&[(0, 10, Some(6)), (2, 20, Some(50)), (5, 40, None)]);
        let spans = book.observe(key(), &later, 1000);
        assert_eq!(book.missed_generations(key().tgid), 0);
        assert_eq!(spans, [AgeSpan { first: 5, last: 5, bytes: 40, allocations: 1 }]);
        // Read again as far apart: still nothing missed, nothing new.
        assert_eq!(book.observe(key(), &later, 2000), spans);
        assert_eq!(book.missed_generations(key().tgid), 0);
    }

    #[test]
    fn a_rest_is_not_a_missed_read_and_ages_stay_exact() {
        let mut book = AgeBook::new(CLOCK);
        let early = [(0, 10, None)];
        let _ = book.observe(key(), &row(&early), 5);
        let _ = book.observe(key(), &row(&early), 95);
        // Still from generation 9 to 100, not read; then one block at generation 101 (slot 5,
        // generation 0's).
        book.rest(key().tgid, 1000);
        let later = [(0, 10, None), (101, 30, None)];
        let spans = book.observe(key(), &row(&later), 1015);
        book.woke(key().tgid);
        assert_eq!(book.missed_generations(key().tgid), 0);
        assert_eq!(oldest_ns(&CLOCK, &spans), Some(0));
        assert_eq!(spans.iter().map(|s| (s.first, s.bytes)).collect::<Vec<_>>(), [(0, 10), (101, 30)]);
    }

    #[test]
    fn old_spans_merge_but_the_oldest_stays() {
        let mut book = AgeBook::new(CLOCK);
        let mut events = Vec::new();
        for now in 0..200u64 {
            events.push((now, 1, None));
            let spans = book.observe(key(), &row(&events), now * 10 + 5);
            assert!(spans.len() <= MAX_SPANS + FROZEN_AGE as usize);
            assert_eq!(spans.iter().map(|s| s.bytes).sum::<u64>(), now + 1);
            assert_eq!(spans[0].first, 0);
        }
    }
}
