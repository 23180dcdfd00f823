//! Sampled mode: which processes record one allocation in every `--sample-bytes` bytes rather
//! than every call, and the `--max-rate` guard that switches a busy process to it.
//!
//! `--usdt` leaves the sampling to the allocator (see `process::usdt`).
//!
//! Sampling is decided per call in the kernel (see `profiler_common::weight`): each recorded
//! allocation stands for the allocations it was drawn from, so totals are unbiased estimates.

use clap::Args;

use crate::kernel::aggregate::Snapshot;

/// The mean bytes between samples when `--max-rate` switches a process without `--sample-bytes`.
pub const DEFAULT_SAMPLE_BYTES: u64 = 64 * 1024;

/// The largest `--sample-bytes`: 1 GiB.
pub const MAX_SAMPLE_BYTES: u64 = 1 << 30;

#[derive(Debug, Args, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sampling {
    /// Record one allocation in every N bytes on average (unbiased estimates) instead of every
    /// call: far less work per call. Double frees are then not looked for.
    #[arg(long, value_name = "N", value_parser = sample_bytes)]
    pub sample_bytes: Option<u64>,
    /// Switch a process to sampling when it makes more than N allocator calls a second.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_rate: Option<u64>,
    /// Record only the allocations the allocator's own sampler reports through its
    /// `otel_memory:alloc` and `otel_memory:free` USDT probes, and attach no allocator probe:
    /// the cost is one trap per sampled allocation and free, whatever the allocation rate.
    #[arg(long, conflicts_with_all = ["sample_bytes", "max_rate"])]
    pub usdt: bool,
}

/// What a report traced with `--usdt` is made from, and what it cannot show.
pub fn usdt_mode(samples: u64) -> String {
    format!(
        "usdt: the allocator's own sampler through otel_memory probes, {samples} samples; counts and bytes are estimates; no double frees, failed allocations or per-call counts"
    )
}

pub fn sample_bytes(value: &str) -> Result<u64, String> {
    match value.parse::<u64>() {
        Ok(n) if (1..=MAX_SAMPLE_BYTES).contains(&n) => Ok(n),
        _ => Err(format!("`{value}` is not a number of bytes from 1 to {MAX_SAMPLE_BYTES}")),
    }
}

/// Watches one process's call rate against `--max-rate`.
#[derive(Debug)]
pub struct RateGuard {
    sampling: Sampling,
    /// (time, allocator calls) at the last check.
    last: Option<(u64, u64)>,
}

/// A process found above `--max-rate`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Switch {
    pub calls_per_second: f64,
    pub sample_bytes: u64,
}

impl RateGuard {
    pub fn new(sampling: Sampling) -> Self {
        Self { sampling, last: None }
    }

    /// The rate to sample a new process at from the start, if any.
    pub fn initial(&self) -> Option<u64> {
        self.sampling.sample_bytes
    }

    /// Checks the process's calls since the last snapshot; returns the switch to make when it is
    /// above `--max-rate` and not sampled yet.
    pub fn check(&mut self, snapshot: &Snapshot) -> Option<Switch> {
        let calls: u64 = snapshot.stacks.iter().map(|s| s.stats.allocations + s.stats.frees).sum();
        let last = self.last.replace((snapshot.now_ns, calls));
        let max_rate = self.sampling.max_rate?;
        let (then_ns, then_calls) = last?;
        if snapshot.sample_bytes != 0 || snapshot.now_ns <= then_ns {
            return None;
        }
        let calls_per_second = calls.saturating_sub(then_calls) as f64 * 1e9 / (snapshot.now_ns - then_ns) as f64;
        (calls_per_second > max_rate as f64).then_some(Switch {
            calls_per_second,
            sample_bytes: self.sampling.sample_bytes.unwrap_or(DEFAULT_SAMPLE_BYTES),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::aggregate::StackSnapshot;

    fn snapshot(now_ns: u64, calls: u64) -> Snapshot {
        let mut stack = StackSnapshot::default();
        stack.stats.allocations = calls;
        Snapshot { now_ns, stacks: vec![stack], ..Snapshot::default() }
    }

    #[test]
    fn a_process_above_max_rate_is_switched_once_measured() {
        let mut guard = RateGuard::new(Sampling { max_rate: Some(1000), ..Sampling::default() });
        assert_eq!(guard.check(&snapshot(0, 0)), None, "no rate before two snapshots");
        assert_eq!(guard.check(&snapshot(1_000_000_000, 500)), None);
        let switch = guard.check(&snapshot(2_000_000_000, 5_500)).unwrap();
        assert_eq!(switch, Switch { calls_per_second: 5000.0, sample_bytes: DEFAULT_SAMPLE_BYTES });
    }

    #[test]
    fn no_guard_without_max_rate() {
        let mut guard = RateGuard::new(Sampling { sample_bytes: Some(4096), ..Sampling::default() });
        assert_eq!(guard.initial(), Some(4096));
        guard.check(&snapshot(0, 0));
        assert_eq!(guard.check(&snapshot(1_000_000_000, 1 << 40)), None);
    }
}
