//! Sampled mode: which processes record one allocation in every `--sample-bytes` bytes rather
//! than every call, and the `--max-rate` guard that switches a busy process to it.
//!
//! `--usdt` leaves the sampling to the allocator (see `process::usdt`).
//!
//! Sampling is decided per call in the kernel (see `profiler_common::weight`): each recorded
//! allocation stands for the allocations it was drawn from, so totals are unbiased estimates.

use clap::Args;

use crate::{heap::price::grouped, kernel::aggregate::Snapshot};

/// The mean bytes between samples when `--max-rate` switches a process without `--sample-bytes`.
pub const DEFAULT_SAMPLE_BYTES: u64 = 64 * 1024;

/// The largest `--sample-bytes`: 1 GiB.
pub const MAX_SAMPLE_BYTES: u64 = 1 << 30;

/// `--max-rate` when none is given to `attach` or the daemon: the rate up to which tracing every call
/// costs the costliest service measured an affordable share of a core
/// (docs: guide/sampling.md#the-price-of-tracing).
pub const DEFAULT_MAX_RATE: u64 = 50_000;

#[derive(Debug, Args, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sampling {
    /// Record one allocation in every N bytes on average (unbiased estimates) instead of every
    /// call: far less work per call. Double frees are then not looked for.
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = sample_bytes)]
    pub sample_bytes: Option<u64>,
    /// Switch a process to sampling (the daemon: to growth mode, where that slows no other
    /// process) when it makes more than N allocator calls a second; `off` records every call
    /// whatever the rate [default: 50000 for attach and the daemon, off for run]. Given no N,
    /// attach moves on to growth mode a process that sampling still costs more than a tenth of a
    /// core, where that slows no other process.
    #[arg(long, value_name = "N|off", allow_negative_numbers = true, value_parser = max_rate)]
    pub max_rate: Option<MaxRate>,
    /// Trace the heap by the pages it grows into, not by allocator calls: each page of anonymous
    /// memory with the stack that first touched it, until the process gives it back. Costs a
    /// trap per new page, none per call: for busy processes. Sees pages, not blocks: no counts
    /// of allocations, no frees inside pages, no double frees.
    #[arg(long, conflicts_with_all = ["sample_bytes", "max_rate"])]
    pub growth: bool,
    /// Record only the allocations the allocator's own sampler reports through its
    /// `otel_memory:alloc` and `otel_memory:free` USDT probes, or a Go program's runtime samples
    /// of its heap, and attach no allocator probe: the cost is one trap per sampled allocation
    /// and free, whatever the allocation rate. A Go program without cgo, which has no allocator
    /// memprof probes, is traced so without it too.
    #[arg(long, conflicts_with_all = ["sample_bytes", "max_rate", "growth"])]
    pub usdt: bool,
}

/// `--max-rate`: when a process is switched to sampling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaxRate {
    /// Never: every call is recorded (`--max-rate off`).
    Off,
    /// Above this many calls a second (`--max-rate N`).
    Calls(u64),
    /// Above `DEFAULT_MAX_RATE`: `attach` or the daemon given no `--max-rate`.
    Default,
}

impl MaxRate {
    /// Calls a second above which a process is sampled; none when never.
    pub fn limit(self) -> Option<u64> {
        match self {
            MaxRate::Off => None,
            MaxRate::Calls(n) => Some(n),
            MaxRate::Default => Some(DEFAULT_MAX_RATE),
        }
    }
}

pub fn max_rate(value: &str) -> Result<MaxRate, String> {
    match value.parse::<u64>() {
        _ if value == "off" => Ok(MaxRate::Off),
        Ok(n) if n >= 1 => Ok(MaxRate::Calls(n)),
        _ => Err(format!("`{value}` is neither a number of calls a second (at least 1) nor `off`")),
    }
}

/// What a report traced through its allocator's own sampler is made from, and what it cannot
/// show: all of it, or Go's heap `beside_calls` traced as the rest of the report says.
pub fn usdt_mode(samples: u64, beside_calls: bool) -> String {
    if beside_calls {
        return format!(
            "usdt: Go's heap through its runtime's sampler, {samples} samples, beside the allocator calls; the Go heap's counts and bytes are estimates"
        );
    }
    format!(
        "usdt: the allocator's own sampler (otel_memory probes, or Go's runtime), {samples} samples; counts and bytes are estimates; no double frees, failed allocations or per-call counts"
    )
}

pub fn sample_bytes(value: &str) -> Result<u64, String> {
    match value.parse::<u64>() {
        Ok(n) if (1..=MAX_SAMPLE_BYTES).contains(&n) => Ok(n),
        _ => Err(format!("`{value}` is not a number of bytes from 1 to {MAX_SAMPLE_BYTES}")),
    }
}

impl Sampling {
    /// Whether the process's allocator calls are what is traced (every one, or sampled): not so
    /// in growth mode (pages) or usdt mode (the allocator's own samples).
    pub fn traces_calls(self) -> bool {
        !self.growth && !self.usdt
    }

    /// `attach`'s: `--max-rate` at `DEFAULT_MAX_RATE` unless given (`off` included), or growth
    /// or usdt mode, whose cost does not follow the calls.
    pub fn for_attach(self) -> Self {
        if !self.traces_calls() {
            return self;
        }
        Self { max_rate: Some(self.max_rate.unwrap_or(MaxRate::Default)), ..self }
    }
}

/// Watches one process's call rate against `--max-rate`: past it, `attach` and `run` sample the
/// process, the daemon traces it by the pages it touches (`--growth`).
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
    /// The `--max-rate` it was found above.
    pub max_rate: MaxRate,
}

impl Switch {
    /// What memprof says when it makes the switch: one line, with the way back when the limit
    /// was not asked for.
    pub fn line(&self, pid: u32) -> String {
        let calls = grouped(self.calls_per_second.round() as u64);
        let bytes = self.sample_bytes;
        match self.max_rate {
            MaxRate::Default => format!(
                "memprof: pid {pid} makes {calls} allocator calls a second, more than --max-rate {DEFAULT_MAX_RATE} (the default): sampling one in every {bytes} bytes from now on; --max-rate off records every call"
            ),
            _ => format!(
                "memprof: pid {pid} makes {calls} allocator calls a second, more than --max-rate: sampling one in every {bytes} bytes from now on"
            ),
        }
    }
}

impl RateGuard {
    pub fn new(sampling: Sampling) -> Self {
        Self { sampling, last: None }
    }

    /// The guard of a process whose counts start at `start_ns` (its probes attached then): its
    /// first check has a rate.
    pub fn starting(sampling: Sampling, start_ns: u64) -> Self {
        Self { sampling, last: Some((start_ns, 0)) }
    }

    /// The rate to sample a new process at from the start, if any.
    pub fn initial(&self) -> Option<u64> {
        self.sampling.sample_bytes
    }

    /// Checks the process's calls since the last snapshot; returns the switch to make when it is
    /// above `--max-rate` and not sampled yet.
    pub fn check(&mut self, snapshot: &Snapshot) -> Option<Switch> {
        // Traced by its pages: its counts are pages, and nothing is cheaper.
        if snapshot.growth.is_some() {
            return None;
        }
        let counted: u64 = snapshot.stacks.iter().map(|s| s.stats.allocations + s.stats.frees).sum();
        // What a sampler beside the calls counted are estimates, not calls.
        let calls = counted.saturating_sub(snapshot.counters.usdt_counts);
        self.check_calls(snapshot.now_ns, calls, snapshot.sample_bytes)
    }

    /// `check` on a count of calls read at `now_ns`, with the process's current sampling rate.
    pub fn check_calls(&mut self, now_ns: u64, calls: u64, sample_bytes: u64) -> Option<Switch> {
        let last = self.last.replace((now_ns, calls));
        let max_rate = self.sampling.max_rate?;
        let limit = max_rate.limit()?;
        let (then_ns, then_calls) = last?;
        if sample_bytes != 0 || now_ns <= then_ns {
            return None;
        }
        let calls_per_second = calls.saturating_sub(then_calls) as f64 * 1e9 / (now_ns - then_ns) as f64;
        (calls_per_second > limit as f64).then_some(Switch {
            calls_per_second,
            sample_bytes: self.sampling.sample_bytes.unwrap_or(DEFAULT_SAMPLE_BYTES),
            max_rate,
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
        let max_rate = MaxRate::Calls(1000);
        let mut guard = RateGuard::new(Sampling { max_rate: Some(max_rate), ..Sampling::default() });
        assert_eq!(guard.check(&snapshot(0, 0)), None, "no rate before two snapshots");
        assert_eq!(guard.check(&snapshot(1_000_000_000, 500)), None);
        let switch = guard.check(&snapshot(2_000_000_000, 5_500)).unwrap();
        assert_eq!(switch, Switch { calls_per_second: 5000.0, sample_bytes: DEFAULT_SAMPLE_BYTES, max_rate });
        assert!(switch.line(7).ends_with("more than --max-rate: sampling one in every 65536 bytes from now on"));
    }

    #[test]
    fn attach_samples_a_busy_process_from_its_first_count_and_says_how_not_to() {
        let sampling = Sampling::default().for_attach();
        let mut guard = RateGuard::starting(sampling, 1_000_000_000);
        let switch = guard.check_calls(2_000_000_000, DEFAULT_MAX_RATE + 1, 0).unwrap();
        assert_eq!(switch.max_rate, MaxRate::Default);
        assert!(switch.line(7).contains("more than --max-rate 50000 (the default)"), "{}", switch.line(7));
        assert!(switch.line(7).ends_with("; --max-rate off records every call"));
        let mut quiet = RateGuard::starting(sampling, 0);
        assert_eq!(quiet.check_calls(1_000_000_000, DEFAULT_MAX_RATE, 0), None, "at the limit is not above it");
    }

    #[test]
    fn max_rate_off_records_every_call() {
        assert_eq!(max_rate("off"), Ok(MaxRate::Off));
        assert_eq!(max_rate("20"), Ok(MaxRate::Calls(20)));
        assert!(max_rate("0").is_err() && max_rate("fast").is_err());
        let sampling = Sampling { max_rate: Some(MaxRate::Off), ..Sampling::default() }.for_attach();
        assert_eq!(sampling.max_rate, Some(MaxRate::Off));
        let mut guard = RateGuard::starting(sampling, 0);
        assert_eq!(guard.check_calls(1_000_000_000, 1 << 40, 0), None);
    }

    #[test]
    fn no_guard_without_max_rate() {
        let mut guard = RateGuard::new(Sampling { sample_bytes: Some(4096), ..Sampling::default() });
        assert_eq!(guard.initial(), Some(4096));
        guard.check(&snapshot(0, 0));
        assert_eq!(guard.check(&snapshot(1_000_000_000, 1 << 40)), None);
    }

    #[test]
    fn growth_and_usdt_trace_no_calls_and_get_no_default_rate() {
        for mode in [Sampling { growth: true, ..Sampling::default() }, Sampling { usdt: true, ..Sampling::default() }] {
            assert!(!mode.traces_calls());
            assert_eq!(mode.for_attach().max_rate, None);
        }
        assert!(Sampling::default().traces_calls());
    }
}
