//! Folded stacks, the input of flamegraph.pl and inferno: one line per call path,
//! `outermost;...;innermost VALUE`, the value the bytes in use or another count (`Flame`).

use std::{cmp::Ordering, collections::HashMap, io};

use super::Flame;
use crate::{
    heap::report::{Report, StackReport},
    text::printable,
};

/// The root frame of a stack the unwinder could not walk to its outermost frame.
const TRUNCATED: &str = "[truncated]";
/// The only frame of a stack that was counted without frames (see `dropped`).
const NO_STACK: &str = "[no stack]";

/// The folded stacks of `report`, written to `out` a line at a time: a process of tens of
/// thousands of deep stacks makes gigabytes of lines, never held whole in memory.
pub fn write(report: &Report, flame: Flame, out: &mut dyn io::Write) -> io::Result<()> {
    let paths = Paths::of(report, flame);
    for (path, value) in &paths.summed {
        writeln!(out, "{} {value}", paths.text(path))?;
    }
    Ok(())
}

#[cfg(test)]
pub fn render(report: &Report, flame: Flame) -> String {
    let mut out = Vec::new();
    write(report, flame, &mut out).expect("writing to memory cannot fail");
    String::from_utf8(out).expect("names are text")
}

/// `flame`'s value per call path (`outermost;...;innermost`), sorted by path. Stacks that differ
/// only in lines or addresses share a path of function names and are summed, as flame graph
/// tools would merge them anyway. Paths of value 0 are left out: they draw nothing.
pub fn paths(report: &Report, flame: Flame) -> Vec<(String, u64)> {
    let paths = Paths::of(report, flame);
    paths.summed.iter().map(|(path, value)| (paths.text(path), *value)).collect()
}

/// Call paths as numbers of names (stacks share most of theirs), summed and sorted by their text.
struct Paths {
    names: Vec<String>,
    summed: Vec<(Path, u64)>,
}

/// A stack's path: its names' numbers, outermost first (none: `NO_STACK`).
struct Path {
    truncated: bool,
    names: Vec<u32>,
}

impl Paths {
    fn of(report: &Report, flame: Flame) -> Self {
        let mut numbers: HashMap<String, u32> = HashMap::new();
        let mut names = Vec::new();
        let mut number = |name: String| match numbers.get(&name) {
            Some(&known) => known,
            None => {
                let next = names.len() as u32;
                names.push(name.clone());
                numbers.insert(name, next);
                next
            }
        };
        let mut summed: Vec<(Path, u64)> = (report.stacks.iter())
            .filter_map(|stack: &StackReport| {
                let value = flame.value(stack);
                let names = (value > 0).then(|| stack.frames.iter().rev().map(|f| number(frame_name(&f.function))))?;
                Some((Path { truncated: stack.truncated, names: names.collect() }, value))
            })
            .collect();
        let mut paths = Self { names, summed: Vec::new() };
        summed.sort_by(|(a, _), (b, _)| paths.compare(a, b));
        summed.dedup_by(|(later, value), (earlier, sum)| {
            let same = paths.compare(later, earlier).is_eq();
            if same {
                // Saturating: only an edited recording's figures come near 2^64.
                *sum = sum.saturating_add(*value);
            }
            same
        });
        paths.summed = summed;
        paths
    }

    /// The order of the paths' texts. The names the two share at their start are passed over
    /// by number: stacks share most of their outer frames.
    fn compare(&self, a: &Path, b: &Path) -> Ordering {
        let shared =
            if root(a) == root(b) { a.names.iter().zip(&b.names).take_while(|(x, y)| x == y).count() } else { 0 };
        self.bytes_from(a, shared).cmp(self.bytes_from(b, shared))
    }

    /// The path's text past its root and first `from` names (all of it at 0), a byte at a time.
    fn bytes_from<'p>(&'p self, path: &'p Path, from: usize) -> impl Iterator<Item = u8> + 'p {
        let root = (from == 0).then(|| root(path)).filter(|root| !root.is_empty());
        let names = path.names[from..].iter().map(|&n| self.names[n as usize].as_str());
        // A `;` before each part but the text's first.
        let parts = root.into_iter().chain(names).enumerate();
        parts.flat_map(move |(at, part)| (at > 0 || from > 0).then_some(b';').into_iter().chain(part.bytes()))
    }

    fn text(&self, path: &Path) -> String {
        String::from_utf8(self.bytes_from(path, 0).collect()).expect("names are text")
    }
}

/// The root frame a path's text starts with, if any.
fn root(path: &Path) -> &'static str {
    match (path.names.is_empty(), path.truncated) {
        (true, _) => NO_STACK,
        (false, true) => TRUNCATED,
        (false, false) => "",
    }
}

/// A function name that cannot break a line apart: `;` separates frames and a newline ends the
/// line, so neither may appear inside one (Rust names like `[u8; 8]` contain `;`); no control
/// character either, which the SVG drawn from these lines could not hold. A blank name (a
/// hostile program's symbol, an edited recording) is named: a line of blank frames alone would
/// read as a count without a stack, which inferno drops.
pub(super) fn frame_name(function: &str) -> String {
    let name = printable(function).replace(';', ",");
    if name.trim().is_empty() {
        return UNNAMED.to_string();
    }
    name
}

/// A frame whose function's name is blank.
const UNNAMED: &str = "[unnamed]";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heap::report::samples::{self, frame};

    #[test]
    fn a_blank_name_is_named() {
        let mut report = samples::report();
        report.stacks[0].frames = vec![frame("", None, None), frame(" \u{a0}", None, None)].into();
        assert_eq!(render(&report, Flame::Bytes), "[unnamed];[unnamed] 48\n");
        assert!(!super::super::flamegraph::render(&report, Flame::Bytes).is_empty());
    }

    #[test]
    fn lines_run_from_the_outermost_frame_to_the_allocating_one() {
        let mut report = samples::report();
        report.stacks[0].frames = vec![frame("leak_here", None, None), frame("main", None, None)].into();
        assert_eq!(render(&report, Flame::Bytes), "main;leak_here 48\n");
    }

    #[test]
    fn stacks_with_the_same_functions_are_summed_and_empty_ones_left_out() {
        let mut report = samples::report();
        let mut other_line = report.stacks[0].clone();
        std::sync::Arc::make_mut(&mut other_line.frames)[0].line = Some(13);
        let mut zero_bytes = report.stacks[0].clone();
        zero_bytes.outstanding_bytes = 0;
        zero_bytes.frames = vec![frame("malloc_zero", None, None)].into();
        report.stacks.extend([other_line, zero_bytes]);
        assert_eq!(render(&report, Flame::Bytes), "leak_here 96\n");
    }

    #[test]
    fn truncated_and_frameless_stacks_are_named() {
        let mut report = samples::report();
        report.stacks[0].truncated = true;
        let mut frameless = report.stacks[0].clone();
        frameless.frames = Default::default();
        report.stacks.push(frameless);
        assert_eq!(render(&report, Flame::Bytes), "[no stack] 48\n[truncated];leak_here 48\n");
    }

    #[test]
    fn lines_are_sorted_by_their_text_and_each_path_once() {
        let mut report = samples::report();
        let one = report.stacks[0].clone();
        let names = ["foo", "foo::bar", "fo", "foo.isra.0", "z", "foo;x"];
        report.stacks = (0..names.len() * names.len() * 2)
            .map(|n| {
                let mut stack = one.clone();
                let (outer, inner) = (names[n % names.len()], names[n / names.len() % names.len()]);
                stack.frames = vec![frame(inner, None, None), frame(outer, None, None)].into();
                stack.truncated = n % 3 == 0;
                stack
            })
            .collect();
        let rendered = render(&report, Flame::Bytes);
        let paths: Vec<&str> = rendered.lines().map(|line| line.rsplit_once(' ').unwrap().0).collect();
        let mut sorted = paths.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(paths, sorted);
        let total: u64 = rendered.lines().map(|line| line.rsplit_once(' ').unwrap().1.parse::<u64>().unwrap()).sum();
        assert_eq!(total, 48 * report.stacks.len() as u64);
    }

    #[test]
    fn separators_inside_names_are_replaced() {
        let mut report = samples::report();
        report.stacks[0].frames = vec![frame("<[u8; 8] as Debug>::fmt", None, None)].into();
        assert_eq!(render(&report, Flame::Bytes), "<[u8, 8] as Debug>::fmt 48\n");
    }
}
