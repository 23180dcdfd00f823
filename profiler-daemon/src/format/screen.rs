//! The live view's screen (`--live`): a report drawn to fit a terminal, top-like: a header
//! (process, heap in use, rates, mode), then the leak candidates, then the other stacks by bytes.

use std::fmt::Write as _;

use super::table::{bytes, site};
use crate::heap::report::{Report, StackReport};

/// What the screen shows besides the report: the rates since the last one.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Rates {
    pub allocations_per_s: f64,
    pub bytes_per_s: f64,
}

/// Lines the header takes, the column heads included.
const HEADER_LINES: usize = 4;

/// `report` as a screen of at most `rows` lines of at most `columns` characters.
pub fn render(report: &Report, rates: Rates, rows: usize, columns: usize) -> String {
    let t = &report.totals;
    let candidates: Vec<&StackReport> = report.stacks.iter().filter(|s| s.leak.candidate).collect();
    let mut lines = vec![
        format!(
            "memprof: pid {} ({}), {:.1} s traced, {}; Ctrl-C ends with the final report",
            report.pid,
            report.comm,
            report.duration_s,
            mode(report)
        ),
        format!(
            "heap: {} in use in {} blocks; {:.0} allocations/s, {}/s allocated; peak {}",
            bytes(t.outstanding_bytes),
            t.outstanding_allocations,
            rates.allocations_per_s,
            bytes(rates.bytes_per_s as u64),
            bytes(report.peak.bytes)
        ),
        format!(
            "leak candidates: {} stacks, {}{}",
            candidates.len(),
            bytes(candidates.iter().map(|s| s.outstanding_bytes).sum()),
            report.suppressed.as_ref().map_or_else(String::new, |s| format!("; suppressed: {}", s.line()))
        ),
        format!("{:>12} {:>9} {:>5}  SITE", "BYTES", "COUNT", "LEAK"),
    ];
    let others = report.stacks.iter().filter(|s| !s.leak.candidate);
    let room = rows.saturating_sub(HEADER_LINES);
    for stack in candidates.iter().copied().chain(others).take(room) {
        let leak = if stack.leak.candidate { format!("{:.2}!", stack.leak.score) } else { String::new() };
        let at = stack.frames.first().map_or_else(|| "[no stack]".to_string(), site);
        lines.push(format!("{:>12} {:>9} {:>5}  {at}", stack.outstanding_bytes, stack.outstanding_allocations, leak));
    }
    let mut screen = String::new();
    for line in lines.iter().take(rows) {
        let cut: String = line.chars().take(columns).collect();
        // Each line clears what the last screen left after it.
        let _ = writeln!(screen, "{cut}\x1b[K");
    }
    screen
}

/// How the process is traced, in a few words.
fn mode(report: &Report) -> String {
    if report.growth.is_some() {
        "growth mode (pages first touched)".to_string()
    } else if report.usdt_samples.is_some() && !report.usdt_beside_calls {
        "the allocator's own sampler (estimates)".to_string()
    } else {
        let calls = if report.sample_bytes != 0 {
            format!("sampled, one in every {} (estimates)", bytes(report.sample_bytes))
        } else {
            "every call traced".to_string()
        };
        if report.usdt_beside_calls {
            format!("{calls}, Go's heap by its sampler (estimates)")
        } else {
            calls
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heap::report::samples::{frame, report};

    #[test]
    fn leak_candidates_come_first_and_the_screen_fits() {
        let mut r = report();
        let mut big = r.stacks[0].clone();
        big.outstanding_bytes = 9000;
        big.frames = vec![frame("big_cache", Some("a.c"), Some(3))].into();
        r.stacks[0].leak.candidate = true;
        r.stacks[0].leak.score = 0.9;
        r.stacks.push(big);
        let screen = render(&r, Rates { allocations_per_s: 10.0, bytes_per_s: 2048.0 }, 6, 60);
        let lines: Vec<&str> = screen.lines().collect();
        assert_eq!(lines.len(), 6);
        assert!(lines[1] == "heap: 0 B in use in 0 blocks; 10 allocations/s, 2.0 KiB/s al\x1b[K", "{screen}");
        assert!(lines[4].contains("0.90!  leak_here (leaky.c:12)"), "{screen}");
        assert!(lines[5].contains("big_cache (a.c:3)"), "{screen}");
        assert!(lines.iter().all(|l| l.trim_end_matches("\x1b[K").chars().count() <= 60), "{screen}");
        assert_eq!(render(&r, Rates::default(), 2, 80).lines().count(), 2);
    }
}
