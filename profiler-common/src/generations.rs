//! Ages of outstanding allocations without walking them: time is cut into generations (one per
//! reporting interval), and each stack's totals row counts the bytes still outstanding per
//! generation in a ring of `GENERATIONS` slots.
//!
//! An allocation adds to the slot of the generation it was made in; its free subtracts from the
//! same slot while the generation is younger than `FROZEN_AGE`, and from the row's "old" counters
//! after that. A slot's generation is thus frozen from `FROZEN_AGE` on: userspace reads it then
//! (it has `GENERATIONS - FROZEN_AGE` generations to do so) and keeps its remainder itself, before
//! the slot is reused for a new generation. Slots are never reset: userspace remembers each slot's
//! value when it took it over, which keeps every kernel update a plain atomic add.

/// Slots in each stack's ring.
pub const GENERATIONS: usize = 16;

/// From this age (in generations) a generation's frees go to the old counters.
pub const FROZEN_AGE: u64 = 8;

/// The generation of time `time_ns`: whole generations of `length_ns` since `base_ns`.
pub fn generation(time_ns: u64, base_ns: u64, length_ns: u64) -> u64 {
    // A zero length is never set by the loader; treat it as one generation for everything.
    if length_ns == 0 {
        return 0;
    }
    time_ns.saturating_sub(base_ns) / length_ns
}

/// The ring slot of generation `generation`.
pub fn slot(generation: u64) -> usize {
    (generation % GENERATIONS as u64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generations_count_whole_lengths_since_the_base() {
        assert_eq!(generation(100, 100, 10), 0);
        assert_eq!(generation(109, 100, 10), 0);
        assert_eq!(generation(110, 100, 10), 1);
        assert_eq!(generation(50, 100, 10), 0);
        assert_eq!(slot(GENERATIONS as u64 + 3), 3);
    }
}
