//! The leak rule: which stacks are leaking, as opposed to caches, pools and churn.
//!
//! Over a window of the last `window` intervals a stack is scored on two things:
//! - growth: the share of the window's intervals in which its in-use bytes rose;
//! - retention: how much of what it held when the window began it still holds, i.e. the bytes of
//!   allocations made before the window that are not freed (from the age generations).
//!
//! score = growth × retention, from 0 to 1. A stack is a leak candidate when its score reaches
//! `threshold` and it holds more than at the window's start. A cache that fills and then plateaus
//! stops growing; a pool freed in bulk and churn do not retain their old memory: none is flagged.
//! The per-interval cost grows with the number of stacks, never with live allocations.

use std::{
    cell::RefCell,
    collections::{HashMap, HashSet, VecDeque},
};

use serde::{Deserialize, Serialize};

use crate::{
    kernel::ages::{self, Clock},
    kernel::aggregate::Snapshot,
};

/// Heap in use over time: one point per interval (the latest `timeline::MAX_POINTS` of them).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Timeline {
    /// Seconds since tracing began.
    pub time_s: Vec<f64>,
    pub outstanding_bytes: Vec<u64>,
    /// In-use bytes of the stacks that have been leak candidates, from the leak window before they
    /// were first flagged.
    pub stacks: Vec<StackTimeline>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StackTimeline {
    pub stack_id: String,
    /// Index in `Timeline::time_s` of the first value.
    pub first: usize,
    pub outstanding_bytes: Vec<u64>,
}

impl Timeline {
    pub fn is_empty(&self) -> bool {
        self.time_s.is_empty()
    }
}

/// The leak rule's verdict on one stack (see the module doc and docs: guide/leaks.md#leak-candidates).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LeakVerdict {
    pub candidate: bool,
    /// 0 (no sign of a leak) to 1 (grew every interval and freed none of its older memory).
    pub score: f64,
    /// The verdict in words, e.g. "grew in 6 of 6 intervals; holds 100% of what it held 30 s ago".
    pub reason: String,
    /// The rule has seen fewer of the stack's intervals than its window: no verdict yet (the
    /// score is 0 for want of history, not for want of growth).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warming_up: Option<WarmUp>,
}

/// How far a stack's history is from a full window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WarmUp {
    /// Intervals of the stack seen so far.
    pub seen: usize,
    /// `--leak-window`.
    pub window: usize,
}

impl std::fmt::Display for WarmUp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "warming up ({} of {} intervals)", self.seen, self.window)
    }
}

/// The rule's settings (`--leak-window`, `--leak-threshold`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LeakSettings {
    /// Intervals in the window.
    pub window: usize,
    /// Lowest score of a leak candidate.
    pub threshold: f64,
}

pub const DEFAULT_LEAK: LeakSettings = LeakSettings { window: 6, threshold: 0.5 };

/// Points kept in the timeline: at the default interval, almost three hours.
pub const MAX_POINTS: usize = 2048;

#[derive(Debug, Default)]
struct StackHistory {
    /// (read time, in-use bytes) at the last `window + 1` intervals, oldest first.
    recent: VecDeque<(u64, u64)>,
    verdict: LeakVerdict,
}

/// The leak rule's memory of one process: each stack's recent in-use bytes, and the timeline.
#[derive(Debug)]
pub struct LeakTracker {
    settings: LeakSettings,
    stacks: HashMap<u64, StackHistory>,
    time_s: VecDeque<f64>,
    total_bytes: VecDeque<u64>,
    /// Stacks that have been leak candidates: (index in the timeline of the first value, values).
    flagged: HashMap<u64, (usize, VecDeque<u64>)>,
    /// When the last snapshot was read (its `now_ns`).
    last_ns: Option<u64>,
    /// Read times of the intervals at `rest` (the latest `window + 1`), not yet in the stacks'
    /// histories.
    rested: VecDeque<u64>,
    /// The report's names of the flagged stacks, as the last `timeline` was given them.
    named: RefCell<HashMap<u64, String>>,
}

impl LeakTracker {
    pub fn new(settings: LeakSettings) -> Self {
        Self {
            settings,
            stacks: HashMap::new(),
            time_s: VecDeque::new(),
            total_bytes: VecDeque::new(),
            flagged: HashMap::new(),
            last_ns: None,
            rested: VecDeque::new(),
            named: RefCell::default(),
        }
    }

    /// Takes a snapshot read moments after the last interval's (a session's final read) in its
    /// place: a step of a few milliseconds would be one without growth, and the final verdicts
    /// would contradict the last interval's; replaced, the window keeps its length, and the
    /// timeline ends at the final figures.
    pub fn observe_instead_of_last(&mut self, snapshot: &Snapshot, clock: &Clock, time_s: f64) {
        self.replay_rests();
        if let Some(last_ns) = self.last_ns.take() {
            for history in self.stacks.values_mut() {
                if history.recent.back().is_some_and(|(read_ns, _)| *read_ns == last_ns) {
                    history.recent.pop_back();
                }
            }
            if self.time_s.pop_back().is_some() {
                self.total_bytes.pop_back();
            }
            let points = self.time_s.len();
            for (first, values) in self.flagged.values_mut() {
                if *first + values.len() > points {
                    values.pop_back();
                }
            }
            self.flagged.retain(|_, (_, values)| !values.is_empty());
        }
        self.observe(snapshot, clock, time_s);
    }

    /// New settings (a reload): each stack keeps the points of its history the new window
    /// looks at, and its verdict is judged by them at the next interval.
    pub fn reconfigure(&mut self, settings: LeakSettings) {
        self.settings = settings;
        let points = settings.window + 1;
        for history in self.stacks.values_mut() {
            let surplus = history.recent.len().saturating_sub(points);
            history.recent.drain(..surplus);
        }
        let surplus = self.rested.len().saturating_sub(points);
        self.rested.drain(..surplus);
    }

    /// Takes one interval's snapshot (`time_s`: seconds since tracing began).
    pub fn observe(&mut self, snapshot: &Snapshot, clock: &Clock, time_s: f64) {
        self.replay_rests();
        let window = self.settings.window;
        // A set, not a scan of the snapshot per stack: 65,536 stacks made that 4 billion
        // comparisons an interval, most of the daemon's CPU at rest.
        let present: HashSet<u64> = snapshot.stacks.iter().map(|s| s.stack_id).collect();
        self.stacks.retain(|id, _| present.contains(id));
        for stack in &snapshot.stacks {
            let history = self.stacks.entry(stack.stack_id).or_default();
            history.recent.push_back((snapshot.now_ns, stack.outstanding_bytes));
            if history.recent.len() > window + 1 {
                history.recent.pop_front();
            }
            // The window began when its first point was read.
            let window_start = history.recent[0].0;
            let window_ns = snapshot.now_ns.saturating_sub(window_start);
            let held_from_before = ages::allocated_before(clock, &stack.ages, window_start);
            let bytes: Vec<u64> = history.recent.iter().map(|(_, bytes)| *bytes).collect();
            history.verdict = judge(&bytes, held_from_before, self.settings, window_ns);
        }
        self.record_point(time_s, snapshot.stacks.iter().map(|s| s.outstanding_bytes).sum());
        self.last_ns = Some(snapshot.now_ns);
    }

    /// An interval read at `now_ns` at which the process was still: its stacks hold what they
    /// held at the last one. The timeline gets its point at once, the stacks' histories at the
    /// next `observe` (the verdicts of a process still for a whole window do not change).
    pub fn rest(&mut self, now_ns: u64, time_s: f64) {
        self.rested.push_back(now_ns);
        if self.rested.len() > self.settings.window + 1 {
            self.rested.pop_front();
        }
        self.record_point(time_s, self.total_bytes.back().copied().unwrap_or(0));
        self.last_ns = Some(now_ns);
    }

    /// Gives each stack's history the points of the intervals at rest.
    fn replay_rests(&mut self) {
        let window = self.settings.window;
        for history in self.stacks.values_mut() {
            let bytes = history.recent.back().map_or(0, |(_, bytes)| *bytes);
            history.recent.extend(self.rested.iter().map(|&read_ns| (read_ns, bytes)));
            let surplus = history.recent.len().saturating_sub(window + 1);
            history.recent.drain(..surplus);
        }
        self.rested.clear();
    }

    fn record_point(&mut self, time_s: f64, total_bytes: u64) {
        if self.time_s.len() == MAX_POINTS {
            self.time_s.pop_front();
            self.total_bytes.pop_front();
            for (first, values) in self.flagged.values_mut() {
                match first.checked_sub(1) {
                    Some(earlier) => *first = earlier,
                    None => drop(values.pop_front()),
                }
            }
            self.flagged.retain(|_, (_, values)| !values.is_empty());
        }
        self.time_s.push_back(time_s);
        self.total_bytes.push_back(total_bytes);
        let now = self.time_s.len() - 1;
        for (id, history) in &self.stacks {
            if let Some((_, values)) = self.flagged.get_mut(id) {
                values.push_back(history.recent.back().map_or(0, |(_, bytes)| *bytes));
            } else if history.verdict.candidate {
                // From the window before it was flagged: the growth that got it flagged.
                let known = history.recent.len().min(now + 1);
                let values = history.recent.iter().skip(history.recent.len() - known).map(|(_, b)| *b).collect();
                self.flagged.insert(*id, (now + 1 - known, values));
            }
        }
    }

    /// True until the rule has seen `window` intervals since tracing began: until then every
    /// verdict is "watching", which is not "no leak".
    pub fn warming_up(&self) -> bool {
        self.time_s.len() <= self.settings.window
    }

    /// The verdict on a stack by its kernel id: one not seen at an interval yet has none.
    pub fn verdict(&self, stack_id: u64) -> LeakVerdict {
        self.stacks.get(&stack_id).map_or_else(|| warming_up(0, self.settings.window), |h| h.verdict.clone())
    }

    /// When the last interval was observed, in seconds since tracing began.
    pub fn last_time_s(&self) -> Option<f64> {
        self.time_s.back().copied()
    }

    /// The timeline, with stack ids as the report names them (`report_id`; stacks it does not
    /// name are left out).
    pub fn timeline(&self, report_id: impl Fn(u64) -> Option<String>) -> Timeline {
        self.named.borrow_mut().clear();
        self.timeline_with(|id| {
            let name = report_id(id)?;
            self.named.borrow_mut().insert(id, name.clone());
            Some(name)
        })
    }

    /// The timeline, with stack ids as the last `timeline` was given them.
    pub fn timeline_as_named(&self) -> Timeline {
        let named = self.named.borrow().clone();
        self.timeline_with(|id| named.get(&id).cloned())
    }

    fn timeline_with(&self, report_id: impl Fn(u64) -> Option<String>) -> Timeline {
        let mut stacks: Vec<StackTimeline> = self
            .flagged
            .iter()
            .filter_map(|(id, (first, values))| {
                Some(StackTimeline {
                    stack_id: report_id(*id)?,
                    first: *first,
                    outstanding_bytes: values.iter().copied().collect(),
                })
            })
            .collect();
        stacks.sort_by(|a, b| a.stack_id.cmp(&b.stack_id));
        Timeline {
            time_s: self.time_s.iter().copied().collect(),
            outstanding_bytes: self.total_bytes.iter().copied().collect(),
            stacks,
        }
    }
}

/// The rule on one stack: `recent` in-use bytes (oldest first, up to window + 1 points), and the
/// bytes it still holds of allocations made before the window (`window_ns` long) began.
fn judge(recent: &[u64], held_from_before: u64, settings: LeakSettings, window_ns: u64) -> LeakVerdict {
    let steps = recent.len().saturating_sub(1);
    if steps < settings.window {
        return warming_up(steps, settings.window);
    }
    let (first, last) = (recent[0], recent[steps]);
    let rises = recent.windows(2).filter(|pair| pair[1] > pair[0]).count();
    let growth = rises as f64 / steps as f64;
    let retention = if first == 0 { 0.0 } else { (held_from_before as f64 / first as f64).min(1.0) };
    let score = growth * retention;
    let candidate = score >= settings.threshold && last > first;
    let change = if last >= first { format!("+{}", last - first) } else { format!("-{}", first - last) };
    let held = if first == 0 {
        "held nothing when the window began".to_string()
    } else {
        // Tenths under 10 s: a window of short intervals is not "0 s".
        let ago = window_ns as f64 / 1e9;
        let ago = if ago < 10.0 { format!("{ago:.1}") } else { format!("{ago:.0}") };
        format!("still holds {:.0}% of what it held {ago} s ago", retention * 100.0)
    };
    let verdict = if candidate { "leak candidate" } else { "not a leak candidate" };
    LeakVerdict {
        candidate,
        score: (score * 1000.0).round() / 1000.0,
        reason: format!("{verdict}: grew in {rises} of {steps} intervals ({change} bytes); {held}"),
        warming_up: None,
    }
}

/// No verdict yet: the rule has seen `seen` of the `window` intervals it needs.
pub fn warming_up(seen: usize, window: usize) -> LeakVerdict {
    let warm_up = WarmUp { seen, window };
    LeakVerdict { candidate: false, score: 0.0, reason: warm_up.to_string(), warming_up: Some(warm_up) }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SETTINGS: LeakSettings = LeakSettings { window: 4, threshold: 0.5 };

    const CLOCK: Clock = Clock { base_ns: 0, length_ns: 250_000_000 };

    /// Stack 1 holding `bytes` at `second`.
    fn snapshot(second: u64, bytes: u64) -> Snapshot {
        use crate::kernel::aggregate::StackSnapshot;
        Snapshot {
            now_ns: second * 1_000_000_000,
            stacks: vec![StackSnapshot { stack_id: 1, outstanding_bytes: bytes, ..StackSnapshot::default() }],
            ..Snapshot::default()
        }
    }

    fn judge_series(series: &[u64], held_from_before: u64) -> LeakVerdict {
        judge(series, held_from_before, SETTINGS, 4_000_000_000)
    }

    #[test]
    fn a_steady_leak_is_flagged() {
        let verdict = judge_series(&[100, 200, 300, 400, 500], 100);
        assert!(verdict.candidate, "{verdict:?}");
        assert_eq!(verdict.score, 1.0);
        assert_eq!(
            verdict.reason,
            "leak candidate: grew in 4 of 4 intervals (+400 bytes); still holds 100% of what it held 4.0 s ago"
        );
    }

    #[test]
    fn a_cache_that_plateaus_is_not() {
        let verdict = judge_series(&[1000, 1000, 1000, 1000, 1000], 1000);
        assert!(!verdict.candidate);
        assert_eq!(verdict.score, 0.0);
    }

    #[test]
    fn churn_and_pools_freed_in_bulk_are_not() {
        assert!(!judge_series(&[50, 60, 40, 70, 55], 0).candidate, "churn frees its old memory");
        assert!(!judge_series(&[100, 200, 300, 400, 0], 0).candidate, "a pool freed in bulk");
    }

    #[test]
    fn intervals_at_rest_count_as_observed_ones() {
        let (mut watched, mut rested) = (LeakTracker::new(SETTINGS), LeakTracker::new(SETTINGS));
        for (second, bytes) in [(0, 100), (1, 200), (2, 300), (3, 400), (4, 500)] {
            watched.observe(&snapshot(second, bytes), &CLOCK, second as f64);
            rested.observe(&snapshot(second, bytes), &CLOCK, second as f64);
        }
        for second in 5..12 {
            watched.observe(&snapshot(second, 500), &CLOCK, second as f64);
            rested.rest(second * 1_000_000_000, second as f64);
        }
        assert_eq!(watched.timeline(|_| Some("s".into())), rested.timeline(|_| Some("s".into())));
        watched.observe(&snapshot(12, 600), &CLOCK, 12.0);
        rested.observe(&snapshot(12, 600), &CLOCK, 12.0);
        assert_eq!(watched.verdict(1), rested.verdict(1));
        assert_eq!(watched.timeline(|_| Some("s".into())), rested.timeline_as_named());
    }

    #[test]
    fn a_reloaded_window_judges_the_history_kept() {
        let wide = LeakSettings { window: 8, ..SETTINGS };
        let (mut narrow, mut narrowed, mut widened) =
            (LeakTracker::new(SETTINGS), LeakTracker::new(wide), LeakTracker::new(SETTINGS));
        let series = [100, 200, 300, 400, 500, 600, 600, 700, 650, 800];
        for (second, bytes) in series.into_iter().enumerate() {
            for tracker in [&mut narrow, &mut narrowed, &mut widened] {
                tracker.observe(&snapshot(second as u64, bytes), &CLOCK, second as f64);
            }
        }
        narrowed.reconfigure(SETTINGS);
        widened.reconfigure(wide);
        for tracker in [&mut narrow, &mut narrowed, &mut widened] {
            tracker.observe(&snapshot(10, 900), &CLOCK, 10.0);
        }
        assert_eq!(narrowed.verdict(1), narrow.verdict(1), "judged as if the window had always been 4");
        assert_eq!(widened.verdict(1).warming_up, Some(WarmUp { seen: 5, window: 8 }), "4 intervals were kept");
    }

    #[test]
    fn too_little_history_is_watched() {
        let verdict = judge_series(&[100, 200], 100);
        assert!(!verdict.candidate);
        assert_eq!(verdict.reason, "warming up (1 of 4 intervals)");
        assert_eq!(verdict.warming_up, Some(WarmUp { seen: 1, window: 4 }));
    }
}
