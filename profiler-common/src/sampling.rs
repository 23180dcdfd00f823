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

/// The bytes one sample of `size` bytes stands for when the sampler picks a byte every `mean`
/// bytes on average, at exponentially distributed intervals (Go's runtime, jemalloc): it is
/// picked with probability `1 - exp(-size / mean)`, so it stands for `size / (1 - exp(-size /
/// mean))` bytes. That is `mean + size * g(size / mean)` with `g(x) = 1 / (1 - exp(-x)) - 1 / x`,
/// which rises smoothly from 1/2 to 1 and is read from `EXPONENTIAL_G` (linearly between its
/// points: off by less than 0.01%). `mean` 1 or less: every allocation is sampled.
pub fn exponential_weight(size: u64, mean: u64) -> u64 {
    if mean <= 1 || size >= 1 << 47 {
        return size;
    }
    // x in 1/65536 units.
    let x = (size << 16) / mean;
    let step = (1 << 16) >> EXPONENTIAL_G_STEP_BITS;
    let index = (x / step) as usize;
    let (Some(&low), Some(&high)) = (EXPONENTIAL_G.get(index), EXPONENTIAL_G.get(index + 1)) else {
        // x of 16 or more: g(x) is 1 - 1/x within exp(-16), and the weight the size itself.
        return size;
    };
    let g = low + (high - low) * (x % step) / step;
    mean + ((size * g) >> 16)
}

/// Points of `exponential_weight`'s `g` apart by 1/2^EXPONENTIAL_G_STEP_BITS.
const EXPONENTIAL_G_STEP_BITS: u32 = 3;

/// `g(k / 8)` in 1/65536 units for k from 0 to 128 (x from 0 to 16; `g(0)` is its limit, 1/2).
const EXPONENTIAL_G: [u64; 129] = [
    32768, 33450, 34132, 34811, 35487, 36159, 36826, 37487, 38140, 38786, 39423, 40051, 40668, 41275, 41871, 42454,
    43026, 43584, 44130, 44663, 45182, 45688, 46180, 46659, 47124, 47576, 48015, 48440, 48852, 49251, 49638, 50012,
    50375, 50725, 51064, 51392, 51709, 52015, 52311, 52597, 52873, 53141, 53399, 53648, 53889, 54122, 54348, 54566,
    54776, 54980, 55177, 55368, 55552, 55731, 55904, 56071, 56234, 56391, 56543, 56691, 56834, 56973, 57108, 57239,
    57366, 57489, 57609, 57726, 57839, 57949, 58057, 58161, 58262, 58361, 58457, 58551, 58642, 58731, 58818, 58903,
    58985, 59066, 59145, 59221, 59296, 59369, 59441, 59511, 59579, 59646, 59711, 59775, 59838, 59899, 59959, 60018,
    60075, 60131, 60186, 60240, 60293, 60345, 60396, 60446, 60495, 60543, 60590, 60636, 60682, 60726, 60770, 60813,
    60855, 60896, 60937, 60977, 61016, 61055, 61093, 61130, 61167, 61203, 61239, 61274, 61308, 61342, 61375, 61408,
    61440,
];

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
    fn exponential_weights_are_the_inverse_odds_of_an_exponential_sampler() {
        let exact = |size: f64, mean: f64| size / (1.0 - (-size / mean).exp());
        for mean in [4096u64, 524_288, 1 << 20] {
            for size in [1u64, 8, 100, 1000, 4096, 10_000, 65_536, 524_288, 1 << 20, 3 << 20, 16 << 20, 64 << 20] {
                let got = exponential_weight(size, mean) as f64;
                let want = exact(size as f64, mean as f64);
                assert!((got - want).abs() <= want * 1e-4 + 1.0, "size {size}, mean {mean}: {got}, not {want}");
            }
        }
        // Every allocation sampled (Go's MemProfileRate 1): each stands for itself.
        assert_eq!((exponential_weight(8, 1), exponential_weight(1024, 1)), (8, 1024));
        // The table is g's own, point by point.
        for (k, &point) in EXPONENTIAL_G.iter().enumerate().skip(1) {
            let x = k as f64 / 8.0;
            let g = 1.0 / (1.0 - (-x).exp()) - 1.0 / x;
            assert!(((point as f64) / 65536.0 - g).abs() < 1e-5, "g({x})");
        }
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
