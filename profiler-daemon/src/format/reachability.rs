//! The table's lines for `--inspect`: a stack's blocks by class and C++ type, and the
//! inspection's summary.

use std::fmt::Write as _;

use crate::heap::{
    capture::Method,
    inspect::{Inspection, Reachability},
    types::TypeCount,
};

/// `definitely lost 64 B in 1 (retaining 224 B), reachable 80 B in 1 (of which via heuristic
/// newarray 56 B in 1)`: the classes a stack has blocks in.
pub fn classes(r: &Reachability) -> String {
    let mut parts = Vec::new();
    if r.definitely_lost_blocks > 0 {
        parts.push(format!(
            "definitely lost {} in {} (retaining {})",
            super::table::bytes(r.definitely_lost_bytes),
            r.definitely_lost_blocks,
            super::table::bytes(r.retained_bytes)
        ));
    }
    for (name, bytes, blocks) in [
        ("indirectly lost", r.indirectly_lost_bytes, r.indirectly_lost_blocks),
        ("possibly lost", r.possibly_lost_bytes, r.possibly_lost_blocks),
        ("reachable", r.reachable_bytes, r.reachable_blocks),
    ] {
        if blocks > 0 {
            parts.push(format!("{name} {} in {blocks}", super::table::bytes(bytes)));
        }
    }
    let via: Vec<String> = r
        .reachable_via_heuristic
        .each()
        .iter()
        .filter(|(_, _, blocks)| *blocks > 0)
        .map(|(heuristic, bytes, blocks)| format!("{} {} in {blocks}", heuristic.name(), super::table::bytes(*bytes)))
        .collect();
    let classes = parts.join(", ");
    if via.is_empty() {
        classes
    } else {
        format!("{classes} (of which via heuristic {})", via.join(", "))
    }
}

/// `ns::Widget 80 B in 2, Circle 48 B in 3`.
pub fn types(types: &[TypeCount]) -> String {
    let parts: Vec<String> =
        types.iter().map(|t| format!("{} {} in {}", t.name, super::table::bytes(t.bytes), t.blocks)).collect();
    parts.join(", ")
}

/// The inspection's summary lines.
pub fn summary(out: &mut String, inspection: &Inspection) {
    let _ = writeln!(
        out,
        "  inspection: {} threads held still {:.1} ms ({}); {} of roots and {} of blocks scanned, {} unreadable; {} of the heap not classified{}",
        inspection.threads,
        inspection.pause_ms,
        match inspection.method {
            Method::SingleStop => format!("{} copied", super::table::bytes(inspection.bytes_copied_in_pause)),
            Method::SoftDirty | Method::WriteProtect => format!(
                "memory copied while it ran, {} written since read again",
                super::table::bytes(inspection.bytes_copied_in_pause)
            ),
            Method::Recopy => format!(
                "memory copied while it ran, then {} again",
                super::table::bytes(inspection.bytes_copied_in_pause)
            ),
        },
        super::table::bytes(inspection.root_bytes_scanned),
        super::table::bytes(inspection.block_bytes_scanned),
        super::table::bytes(inspection.bytes_unreadable),
        super::table::bytes(inspection.heap_bytes_not_classified),
        if inspection.unclassified_heap_scanned { " (scanned as roots)" } else { "" },
    );
    let all = classes(&inspection.totals);
    let _ = writeln!(
        out,
        "  all blocks: {}; heuristics: {}",
        if all.is_empty() { "none tracked" } else { &all },
        inspection.heuristics
    );
    match (inspection.untracked_blocks, inspection.untracked_bytes) {
        (Some(blocks), Some(bytes)) if blocks > 0 => {
            let _ = writeln!(
                out,
                "  not classified: {} in {blocks} blocks in use that memprof did not see made (before it attached, or not sampled)",
                super::table::bytes(bytes)
            );
            // In no stack's figures: what is lost there was lost before the attach, or holds
            // the blocks a stack's "indirectly lost" counts.
            if let Some(unseen) = inspection.untracked_classes.as_ref().map(classes).filter(|c| !c.is_empty()) {
                let _ = writeln!(out, "  of those in the heap, by class: {unseen}");
            } else if let Some(why) = &inspection.untracked_not_classed {
                let _ = writeln!(out, "  not classed by memprof: {why}");
            }
        }
        (Some(_), Some(_)) => {}
        _ if !inspection.unclassified_heap_scanned => {}
        _ => {
            let _ = writeln!(
                out,
                "  not classified: the blocks memprof did not see made (before it attached, or not sampled), not counted for this allocator"
            );
        }
    }
    if !inspection.types.is_empty() {
        let _ = writeln!(out, "  C++ objects by type: {}", types(&inspection.types));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heap::inspect::ViaHeuristic;

    #[test]
    fn only_the_classes_with_blocks_are_named() {
        let r = Reachability {
            definitely_lost_bytes: 64,
            definitely_lost_blocks: 1,
            retained_bytes: 224,
            reachable_bytes: 2048,
            reachable_blocks: 2,
            ..Reachability::default()
        };
        assert_eq!(classes(&r), "definitely lost 64 B in 1 (retaining 224 B), reachable 2.0 KiB in 2");
    }

    #[test]
    fn blocks_made_before_tracing_are_counted_not_read_as_no_problem() {
        let inspection = Inspection {
            untracked_blocks: Some(9),
            untracked_bytes: Some(209_328),
            unclassified_heap_scanned: true,
            heuristics: "all".into(),
            ..Inspection::default()
        };
        let mut out = String::new();
        summary(&mut out, &inspection);
        let lines: Vec<&str> = out.lines().skip(1).collect();
        assert_eq!(
            lines,
            [
                "  all blocks: none tracked; heuristics: all",
                "  not classified: 204.4 KiB in 9 blocks in use that memprof did not see made (before it attached, or not sampled)"
            ]
        );
    }

    #[test]
    fn the_heuristics_that_held_blocks_are_named() {
        let r = Reachability {
            reachable_bytes: 96,
            reachable_blocks: 2,
            reachable_via_heuristic: ViaHeuristic { newarray_bytes: 56, newarray_blocks: 1, ..ViaHeuristic::default() },
            ..Reachability::default()
        };
        assert_eq!(classes(&r), "reachable 96 B in 2 (of which via heuristic newarray 56 B in 1)");
    }
}
