//! Folded stacks, the input of flamegraph.pl and inferno: one line per call path,
//! `outermost;...;innermost VALUE`, the value the bytes in use or another count (`Flame`).

use std::{collections::BTreeMap, fmt::Write as _};

use super::Flame;
use crate::{
    heap::report::{Report, StackReport},
    text::printable,
};

/// The root frame of a stack the unwinder could not walk to its outermost frame.
const TRUNCATED: &str = "[truncated]";
/// The only frame of a stack that was counted without frames (see `dropped`).
const NO_STACK: &str = "[no stack]";

pub fn render(report: &Report, flame: Flame) -> String {
    let mut out = String::new();
    for (path, value) in paths(report, flame) {
        let _ = writeln!(out, "{path} {value}");
    }
    out
}

/// `flame`'s value per call path, sorted by path. Stacks that differ only in lines or addresses
/// share a path of function names and are summed, as flame graph tools would merge them anyway.
/// Paths of value 0 are left out: they draw nothing.
pub fn paths(report: &Report, flame: Flame) -> BTreeMap<String, u64> {
    let mut paths = BTreeMap::new();
    for stack in &report.stacks {
        let value = flame.value(stack);
        if value > 0 {
            // Saturating: only an edited recording's figures come near 2^64.
            let sum = paths.entry(path(stack)).or_insert(0u64);
            *sum = sum.saturating_add(value);
        }
    }
    paths
}

/// `outermost;...;innermost`, inlined frames included.
fn path(stack: &StackReport) -> String {
    if stack.frames.is_empty() {
        return NO_STACK.to_string();
    }
    let root = stack.truncated.then_some(TRUNCATED.to_string());
    let frames = stack.frames.iter().rev().map(|f| frame_name(&f.function));
    root.into_iter().chain(frames).collect::<Vec<_>>().join(";")
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
    fn separators_inside_names_are_replaced() {
        let mut report = samples::report();
        report.stacks[0].frames = vec![frame("<[u8; 8] as Debug>::fmt", None, None)].into();
        assert_eq!(render(&report, Flame::Bytes), "<[u8, 8] as Debug>::fmt 48\n");
    }
}
