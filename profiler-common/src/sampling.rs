//! Sampled recording: the odds of a draw, the weight of what is drawn, and each process's rate.

/// Counts of allocations and frees are kept in 1/`COUNT_SCALE` units, so that a sampled
/// allocation can stand for a fraction more than one (see `weight`).
pub const COUNT_SCALE: u64 = 256;

/// Set in `LiveAlloc::func` when the allocation was recorded by sampling.
pub const SAMPLED: u32 = 1 << 31;

/// Set in `LiveAlloc::func`, with `SAMPLED`, when the allocator's own sampler reported the
/// allocation through its `otel_memory` probe (see `usdt`): its weight is kept beside it.
pub const USDT: u32 = 1 << 30;

/// A sampling process's rate where the programs read it on every call: slot `rate_slot(tgid)` of
/// an array, an inlined lookup instead of a hash lookup. A process whose slot another holds
/// stays in the hash of rates alone, and its slot counts it in `collided`, so that a call finds
/// a process without either at the cost of the array lookup.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SampleRate {
    /// The process holding the slot (0: none).
    pub tgid: u32,
    /// Sampling processes whose slot this is but that another one holds.
    pub collided: u32,
    /// Its mean bytes between samples.
    pub sample_bytes: u64,
}

/// Slots of the rate array: a power of two, for an `and` instead of a division per call.
pub const RATE_SLOTS: u32 = 4096;

#[inline(always)]
pub fn rate_slot(tgid: u32) -> u32 {
    tgid & (RATE_SLOTS - 1)
}

impl SampleRate {
    /// Process `tgid`'s rate as its slot says: `None` when the slot cannot say (another process
    /// holds it and some process is in the hash alone), 0 when it does not sample.
    #[inline(always)]
    pub fn of(&self, tgid: u32) -> Option<u64> {
        if self.tgid == tgid {
            Some(self.sample_bytes)
        } else if self.collided == 0 {
            Some(0)
        } else {
            None
        }
    }

    /// Process `tgid` samples at `sample_bytes` from now on; `known`: it did already (one that
    /// collided stays in the hash alone, counted once).
    pub fn claim(&mut self, tgid: u32, sample_bytes: u64, known: bool) {
        if self.tgid == tgid || (self.tgid == 0 && !known) {
            (self.tgid, self.sample_bytes) = (tgid, sample_bytes);
        } else if !known {
            self.collided += 1;
        }
    }

    /// Process `tgid`, which sampled, has left.
    pub fn release(&mut self, tgid: u32) {
        if self.tgid == tgid {
            (self.tgid, self.sample_bytes) = (0, 0);
        } else {
            self.collided = self.collided.saturating_sub(1);
        }
    }
}

/// How much one recorded allocation of `size` bytes counts for, as (count in 1/`COUNT_SCALE`
/// units, bytes), when allocations are sampled with probability `min(1, size / sample_bytes)`
/// (every one when `sample_bytes` is 0): the inverse of its probability, so that sums are
/// unbiased estimates. A free takes off exactly what its allocation added.
pub fn weight(sample_bytes: u64, size: u64) -> (u64, u64) {
    let size_for_odds = if size == 0 { 1 } else { size };
    if sample_bytes == 0 || size_for_odds >= sample_bytes {
        (COUNT_SCALE, size)
    } else {
        (COUNT_SCALE * sample_bytes / size_for_odds, sample_bytes * size / size_for_odds)
    }
}

/// Whether an allocation of `size` is sampled, given a uniform random `draw`: with probability
/// `min(1, size / sample_bytes)`.
pub fn sampled(sample_bytes: u64, size: u64, draw: u32) -> bool {
    let size_for_odds = if size == 0 { 1 } else { size };
    sample_bytes == 0 || size_for_odds >= sample_bytes || (draw as u64) < (size_for_odds << 32) / sample_bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampled_weights_are_inverse_odds() {
        assert_eq!(weight(0, 100), (COUNT_SCALE, 100));
        assert_eq!(weight(4096, 8192), (COUNT_SCALE, 8192), "larger than the mean: always recorded");
        assert_eq!(weight(4096, 64), (COUNT_SCALE * 64, 4096), "1 in 64: stands for 64 allocations");
        assert_eq!(weight(4096, 0), (COUNT_SCALE * 4096, 0));
        assert!(sampled(4096, 64, 0) && !sampled(4096, 64, u32::MAX));
        // The odds: draws below 2^32 / 64.
        assert!(sampled(4096, 64, (1 << 26) - 1) && !sampled(4096, 64, 1 << 26));
    }

    #[test]
    fn a_rate_slot_says_who_samples_or_sends_to_the_hash() {
        let (a, b, c) = (5, 5 + RATE_SLOTS, 5 + 2 * RATE_SLOTS);
        assert_eq!(rate_slot(a), rate_slot(b));
        let mut slot = SampleRate::default();
        assert_eq!(slot.of(a), Some(0), "an empty slot: nobody samples");
        slot.claim(a, 4096, false);
        assert_eq!((slot.of(a), slot.of(b)), (Some(4096), Some(0)));
        // b collides: it is in the hash alone, and every other tgid of the slot must look there.
        slot.claim(b, 8192, false);
        slot.claim(b, 8192, true);
        assert_eq!((slot.of(a), slot.of(b), slot.of(c)), (Some(4096), None, None));
        // a leaves: the slot stays empty while b, in the hash, still counts, even when b's rate
        // is set again.
        slot.release(a);
        slot.claim(b, 8192, true);
        assert_eq!((slot.of(a), slot.of(b), slot.collided), (None, None, 1));
        slot.release(b);
        assert_eq!((slot.of(b), slot.of(c)), (Some(0), Some(0)));
        // The next to sample takes the free slot.
        slot.claim(c, 512, false);
        assert_eq!((slot.of(c), slot.of(a)), (Some(512), Some(0)));
    }
}
