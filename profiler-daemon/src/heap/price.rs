//! The price of tracing a process, said once after its first second traced (and once more a
//! second after `--max-rate` switches it to sampling): how often it calls its allocator, the CPU
//! time tracing adds to each second of its run, and the cheaper mode to use when that time is
//! worth saving. Where `attach`'s default switched it, sampling that still costs more than
//! `PAGES_ABOVE` moves it on to growth mode.
//!
//! The probes' traps and the programs they run take the process's own kernel time, so the price
//! is measured where it is paid: the rise of the process's system time once traced, against its
//! system time before (`attach` reads it while memprof loads). A process traced from its start
//! (`run`'s command, a followed child) has no before: its system time is said, but no more than
//! its calls can cost at a bound above any call measured, since the rest is its own. A rise
//! within the clock ticks' noise is said under the same bound. The kernel
//! splits time between user and system by where its timer tick lands, and some of the traps'
//! time lands in user time: the price said is the part the system time shows (docs:
//! guide/sampling.md#the-price-of-tracing).

use crate::{kernel::aggregate::monotonic_now_ns, process::procfs};

/// How long a process is traced before its price is said.
pub const MEASURED_NS: u64 = 1_000_000_000;

/// CPU seconds a second above which tracing's price is worth a cheaper mode: a twentieth of a
/// core.
pub const SIGNIFICANT: f64 = 0.05;

/// CPU seconds a second above which a process that `attach`'s default `--max-rate` switched to
/// sampling is moved on to its pages (growth mode): a tenth of a core. Each sampled call still
/// traps, and on a busy service that alone halves its throughput (docs:
/// guide/sampling.md#when-sampling-is-not-enough).
pub const PAGES_ABOVE: f64 = 0.1;

/// More than any traced call was measured to cost, traps included (docs:
/// performance.md#attachs-default-rate-and-the-price-line-issue-29): it bounds the price of a
/// process with no before, whose system time may be mostly its own system calls.
const CALL_COST_BOUND_S: f64 = 10e-6;

/// The shortest stretch a system time rate is taken over: the kernel counts that time in clock
/// ticks, and a shorter stretch holds too few of them to say anything.
const SHORTEST_NS: u64 = 200_000_000;

/// System seconds a second that two clock ticks make over the measured second: a rise this small
/// may be the ticks' noise alone.
const TICKS_NOISE: f64 = 0.02;

/// What the cheaper modes cost, said when the price is worth saving.
const ADVICE: &str =
    "--sample-bytes 524288 costs a fraction of that, --growth (heap growth by page, any rate) nearly nothing";

/// The same, to a process sampled already: each call still traps.
const SAMPLED_ADVICE: &str = "--growth (heap growth by page, any rate) costs nearly nothing";

/// A process's system time (its threads' time in the kernel) read at one moment.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SystemCpu {
    /// CLOCK_MONOTONIC when read, in ns.
    pub at_ns: u64,
    pub seconds: f64,
}

impl SystemCpu {
    /// None once the process is gone.
    pub fn read(pid: u32) -> Option<Self> {
        let stat = procfs::stat(pid)?;
        Some(Self { at_ns: monotonic_now_ns(), seconds: stat.system_ticks as f64 / procfs::clock_ticks_per_second() })
    }

    /// How long until a rate since this reading can be taken (see `rate_since`): zero once it can.
    pub fn wait_for_rate(&self) -> std::time::Duration {
        std::time::Duration::from_nanos((self.at_ns + SHORTEST_NS).saturating_sub(monotonic_now_ns()))
    }

    /// System seconds a second from `earlier` to this; none over too short a stretch.
    pub fn rate_since(&self, earlier: &Self) -> Option<f64> {
        let ns = self.at_ns.checked_sub(earlier.at_ns).filter(|&ns| ns >= SHORTEST_NS)?;
        Some((self.seconds - earlier.seconds).max(0.0) * 1e9 / ns as f64)
    }
}

/// How a process's calls are recorded when its price is said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Every call, and on from now.
    Exact,
    /// One allocation in every so many bytes (the call rate is an estimate).
    Sampled,
    /// Every call so far, sampled from now on (`--max-rate`, which says so in a line of its own).
    Switched,
    /// Sampled so far, traced by its pages from now on (see `PAGES_ABOVE`; said in a line of its
    /// own).
    ToPages,
}

/// A traced process whose price is not said yet.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PriceWatch {
    /// Its system time when tracing began.
    start: SystemCpu,
    /// Its system seconds a second before tracing, when measured.
    before: Option<f64>,
    /// Its allocator calls counted when the watch began.
    calls: u64,
    /// Begun when `attach`'s default `--max-rate` switched it to sampling: a price above
    /// `PAGES_ABOVE` moves it to its pages.
    pages_if_dear: bool,
}

impl PriceWatch {
    /// Starts watching `pid`, whose tracing begins now; none once it is gone.
    pub fn start(pid: u32, before: Option<f64>) -> Option<Self> {
        Some(Self { start: SystemCpu::read(pid)?, before, calls: 0, pages_if_dear: false })
    }

    /// The watch of the same process from now on, which has made `calls` allocator calls since
    /// tracing began: the price of the mode it has just been switched to. With `pages_if_dear`
    /// (`attach`'s default switched it), a price above `PAGES_ABOVE` is `Mode::ToPages`. None
    /// once it is gone.
    pub fn again(&self, pid: u32, calls: u64, pages_if_dear: bool) -> Option<Self> {
        Some(Self { start: SystemCpu::read(pid)?, before: self.before, calls, pages_if_dear })
    }

    /// When the price is to be said (CLOCK_MONOTONIC, ns).
    pub fn due_ns(&self) -> u64 {
        self.start.at_ns + MEASURED_NS
    }

    /// The price of `pid`, which has made `calls` allocator calls since tracing began and whose
    /// system time is `now`.
    pub fn price(&self, pid: u32, now: SystemCpu, calls: u64, mode: Mode) -> Option<Price> {
        let traced = now.rate_since(&self.start)?;
        let seconds = (now.at_ns - self.start.at_ns) as f64 / 1e9;
        let calls = calls.saturating_sub(self.calls);
        let mut price = Price { pid, calls_per_second: calls as f64 / seconds, before: self.before, traced, mode };
        if self.pages_if_dear && price.added() > PAGES_ABOVE {
            price.mode = Mode::ToPages;
        }
        Some(price)
    }
}

/// What tracing a process costs it, measured over its first second traced.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Price {
    pub pid: u32,
    pub calls_per_second: f64,
    /// System seconds a second before tracing, when measured.
    pub before: Option<f64>,
    /// System seconds a second while traced.
    pub traced: f64,
    pub mode: Mode,
}

impl Price {
    /// CPU seconds a second tracing adds: the rise of the system time, no more than the calls
    /// can have cost where it is within the clock ticks' noise (a few calls a second); without a
    /// before, the system time, but no more than the calls can have cost.
    pub fn added(&self) -> f64 {
        let bound = self.calls_per_second * CALL_COST_BOUND_S;
        match self.before {
            Some(before) => {
                let rise = (self.traced - before).max(0.0);
                if rise <= TICKS_NOISE {
                    rise.min(bound)
                } else {
                    rise
                }
            }
            None => self.traced.min(bound),
        }
    }

    pub fn significant(&self) -> bool {
        self.added() > SIGNIFICANT
    }

    /// The line said on stderr.
    pub fn line(&self) -> String {
        let (pid, traced) = (self.pid, self.traced);
        let rate = grouped(self.calls_per_second.round() as u64);
        let noun = if rate == "1" { "call" } else { "calls" };
        let calls = match self.mode {
            Mode::Sampled | Mode::ToPages => {
                format!("about {rate} allocator {noun} a second (estimated from the samples); sampling them")
            }
            Mode::Exact | Mode::Switched => format!("{rate} allocator {noun} a second; tracing them"),
        };
        let cost = match self.before {
            Some(before) => format!(
                "adds about {:.2} s of CPU a second (its system time went from {before:.2} to {traced:.2} s/s)",
                self.added()
            ),
            None => format!(
                "costs it about {:.2} s of CPU a second (not measured before tracing: its system time, {traced:.2} s/s, \
                 or {} µs a call if less)",
                self.added(),
                CALL_COST_BOUND_S * 1e6
            ),
        };
        let advice = match self.mode {
            _ if !self.significant() => String::new(),
            Mode::Exact => format!("; {ADVICE}"),
            Mode::Sampled => format!("; {SAMPLED_ADVICE}"),
            // The switch's own line follows.
            Mode::Switched | Mode::ToPages => String::new(),
        };
        format!("memprof: pid {pid} makes {calls} {cost}{advice}")
    }
}

/// `n` with its thousands set apart by commas.
pub fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, digit) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(digit);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpu(at_s: f64, seconds: f64) -> SystemCpu {
        SystemCpu { at_ns: (at_s * 1e9) as u64, seconds }
    }

    fn watch(before: Option<f64>) -> PriceWatch {
        PriceWatch { start: cpu(10.0, 3.0), before, calls: 0, pages_if_dear: false }
    }

    #[test]
    fn a_rate_is_waited_for_until_its_shortest_stretch_has_passed() {
        let now = monotonic_now_ns();
        let fresh = SystemCpu { at_ns: now, seconds: 0.0 };
        let wait = fresh.wait_for_rate().as_nanos() as u64;
        assert!(wait <= SHORTEST_NS && wait > SHORTEST_NS - 100_000_000, "{wait} ns");
        let old = SystemCpu { at_ns: now.saturating_sub(SHORTEST_NS), seconds: 0.0 };
        assert_eq!(old.wait_for_rate(), std::time::Duration::ZERO);
        let later = SystemCpu { at_ns: fresh.at_ns + SHORTEST_NS, seconds: 0.1 };
        assert!(later.rate_since(&fresh).is_some());
    }

    #[test]
    fn the_price_is_the_rise_of_the_system_time() {
        let price = watch(Some(0.05)).price(1234, cpu(11.0, 3.67), 180_000, Mode::Exact).unwrap();
        assert!((price.added() - 0.62).abs() < 1e-9, "{price:?}");
        assert_eq!(
            price.line(),
            "memprof: pid 1234 makes 180,000 allocator calls a second; tracing them adds about 0.62 s of CPU a second \
             (its system time went from 0.05 to 0.67 s/s); --sample-bytes 524288 costs a fraction of that, \
             --growth (heap growth by page, any rate) nearly nothing"
        );
    }

    #[test]
    fn a_small_price_is_said_without_advice() {
        let price = watch(Some(0.02)).price(7, cpu(12.0, 3.1), 500, Mode::Exact).unwrap();
        assert_eq!(price.calls_per_second, 250.0);
        assert!(!price.significant());
        assert!(price.line().ends_with("(its system time went from 0.02 to 0.05 s/s)"), "{}", price.line());
        let one = watch(Some(0.0)).price(7, cpu(11.0, 3.0), 1, Mode::Exact).unwrap();
        assert!(one.line().contains("makes 1 allocator call a second;"), "{}", one.line());
    }

    #[test]
    fn without_a_before_the_system_time_is_said() {
        let price = watch(None).price(7, cpu(11.0, 3.5), 2_000_000, Mode::Exact).unwrap();
        assert!(price.significant());
        assert!(price.line().starts_with(
            "memprof: pid 7 makes 2,000,000 allocator calls a second; tracing them costs it about 0.50 s of CPU a \
             second (not measured before tracing: its system time, 0.50 s/s, or 10 µs a call if less); --sample-bytes"
        ));
    }

    #[test]
    fn without_a_before_a_few_calls_cannot_cost_the_system_calls_time() {
        // `dd` copying through the kernel: 264 calls a second and 0.79 s/s of system time.
        let price = watch(None).price(7, cpu(11.0, 3.79), 264, Mode::Exact).unwrap();
        assert!((price.added() - 0.00264).abs() < 1e-9, "{price:?}");
        assert!(!price.significant());
        assert!(price.line().ends_with("costs it about 0.00 s of CPU a second (not measured before tracing: its system time, 0.79 s/s, or 10 µs a call if less)"), "{}", price.line());
    }

    #[test]
    fn sampling_is_told_of_growth_mode_alone_and_a_switch_of_nothing() {
        let sampled = watch(Some(0.0)).price(7, cpu(11.0, 3.5), 90_000, Mode::Sampled).unwrap();
        assert!(sampled.significant());
        assert!(sampled.line().ends_with(
            "makes about 90,000 allocator calls a second (estimated from the samples); sampling them adds about 0.50 s \
             of CPU a second (its system time went from 0.00 to 0.50 s/s); --growth (heap growth by page, any rate) \
             costs nearly nothing"
        ), "{}", sampled.line());
        let cheap = watch(Some(0.0)).price(7, cpu(11.0, 3.01), 900, Mode::Sampled).unwrap();
        assert!(!cheap.line().contains("--growth"), "{}", cheap.line());
        let switched = watch(Some(0.0)).price(7, cpu(11.0, 3.5), 90_000, Mode::Switched).unwrap();
        assert!(!switched.line().contains("--growth"));
    }

    #[test]
    fn a_watch_begun_again_prices_the_calls_since() {
        let first = watch(Some(0.1));
        let again = first.again(std::process::id(), 1_000_000, false).expect("this process");
        assert_eq!((again.before, again.calls), (Some(0.1), 1_000_000));
        let later = SystemCpu { at_ns: again.start.at_ns + 1_000_000_000, seconds: again.start.seconds + 0.3 };
        let price = again.price(7, later, 1_200_000, Mode::Sampled).unwrap();
        assert!((price.calls_per_second - 200_000.0).abs() < 1e-6, "{price:?}");
        assert!((price.added() - 0.2).abs() < 1e-9, "{price:?}");
    }

    #[test]
    fn sampling_that_attachs_default_chose_moves_to_pages_above_a_tenth_of_a_core() {
        let chosen = PriceWatch { pages_if_dear: true, ..watch(Some(0.3)) };
        let dear = chosen.price(7, cpu(11.0, 3.75), 800_000, Mode::Sampled).unwrap();
        assert_eq!(dear.mode, Mode::ToPages);
        assert!(
            dear.line().ends_with(
                "sampling them adds about 0.45 s of CPU a second (its system time went from 0.30 to 0.75 s/s)"
            ),
            "{}",
            dear.line()
        );
        let bearable = chosen.price(7, cpu(11.0, 3.38), 80_000, Mode::Sampled).unwrap();
        assert_eq!(bearable.mode, Mode::Sampled, "a twentieth of a core is named, not moved from");
        assert!(bearable.line().ends_with("--growth (heap growth by page, any rate) costs nearly nothing"));
        let asked = watch(Some(0.3)).price(7, cpu(11.0, 3.75), 800_000, Mode::Sampled).unwrap();
        assert_eq!(asked.mode, Mode::Sampled, "sampling asked for stays");
    }

    #[test]
    fn a_rise_few_calls_cannot_cost_is_the_ticks_noise() {
        // 875 calls a second, and a rise of a clock tick: at most 10 µs each, 0.009 s.
        let price = watch(Some(0.0)).price(7, cpu(11.0, 3.01), 875, Mode::Exact).unwrap();
        assert!((price.added() - 0.00875).abs() < 1e-9, "{price:?}");
        assert!(price.line().contains("adds about 0.01 s of CPU a second"), "{}", price.line());
    }

    #[test]
    fn a_system_time_that_fell_adds_nothing() {
        let price = watch(Some(0.3)).price(7, cpu(11.0, 3.1), 10, Mode::Exact).unwrap();
        assert_eq!(price.added(), 0.0);
    }

    #[test]
    fn too_short_a_stretch_has_no_rate() {
        assert_eq!(cpu(11.1, 3.0).rate_since(&cpu(11.0, 2.0)), None);
        assert_eq!(cpu(12.0, 3.0).rate_since(&cpu(11.0, 2.0)), Some(1.0));
        assert_eq!(watch(None).price(7, cpu(10.1, 3.0), 10, Mode::Exact), None);
    }

    #[test]
    fn thousands_are_set_apart() {
        assert_eq!(grouped(0), "0");
        assert_eq!(grouped(999), "999");
        assert_eq!(grouped(1000), "1,000");
        assert_eq!(grouped(1_234_567), "1,234,567");
    }

    #[test]
    fn a_live_process_has_a_system_time() {
        let now = SystemCpu::read(std::process::id()).unwrap();
        assert!(now.seconds >= 0.0 && now.at_ns > 0);
        assert!(PriceWatch::start(std::process::id(), None).is_some());
    }
}
