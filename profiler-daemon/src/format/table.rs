//! The human-readable table: a summary line, the top stacks, mappings, drops and double frees.

use std::fmt::Write as _;

use super::reachability;
use crate::{
    heap::{mappings::Mappings, report::Report},
    symbolize::Frame,
    text::printable,
};

/// The traced process's section, then each followed child's, each naming its parent.
pub fn render(report: &Report) -> String {
    let mut out = section(report);
    if let Some(forks) = &report.forks {
        let _ = writeln!(
            out,
            "  children: {} followed ({} of them there at attach), {} missed (gone before their probes were attached), {} exited and not listed; {} events lost",
            forks.followed, forks.at_attach, forks.missed, forks.exited_not_listed, forks.events_lost
        );
        if forks.unseen_after_fork_ns != 0 {
            let _ = writeln!(
                out,
                "  a child runs until its probes are attached, here up to {:.1} ms after its fork: what it allocated and freed then is not seen",
                forks.unseen_after_fork_ns as f64 / 1e6
            );
        }
    }
    for child in &report.children {
        out.push_str(&section(child));
    }
    out
}

/// The heap in use by thread (`--threads`).
fn threads(out: &mut String, report: &Report) {
    if report.threads.is_empty() {
        return;
    }
    let estimates = if report.sample_bytes != 0 { "; sampled: estimates, each block scaled by its weight" } else { "" };
    let _ = writeln!(out, "  threads: in use by the thread that allocated it{estimates}");
    let _ = writeln!(out, "  {:>12} {:>9}  THREAD", "BYTES", "COUNT");
    for thread in &report.threads {
        let name = thread.name.as_deref().map_or_else(String::new, |name| format!(" ({name})"));
        let _ = writeln!(
            out,
            "  {:>12} {:>9}  tid {}{name}",
            thread.outstanding_bytes, thread.outstanding_allocations, thread.tid
        );
    }
}

fn section(report: &Report) -> String {
    let mut out = String::new();
    let t = &report.totals;
    let family = match (report.parent, report.exited) {
        (Some(parent), false) => format!(", child of pid {parent},"),
        (Some(parent), true) => format!(", child of pid {parent}, exited,"),
        (None, true) => ", exited,".to_string(),
        (None, false) => String::new(),
    };
    let ns_pid = report.ns_pid.map_or_else(String::new, |ns_pid| format!(", pid {ns_pid} in its namespace"));
    if report.at_peak {
        let _ = writeln!(
            out,
            "memprof: pid {} ({}{ns_pid}){family} at its peak, {:.1}s after tracing began: {} in use; the peak keeps each stack's bytes, no counts",
            report.pid,
            report.comm,
            report.duration_s,
            bytes(t.outstanding_bytes),
        );
    } else {
        // Only when there are some: glibc's own frees of its per-thread caches, not the program's.
        let internal = match t.internal_frees {
            0 => String::new(),
            n => format!("; {n} frees of the C library's own blocks"),
        };
        let _ = writeln!(
            out,
            "memprof: pid {} ({}{ns_pid}){family} {} after {:.1}s: {} outstanding in {} allocations; {} allocations ({}) and {} frees ({}) seen; {} unknown frees{internal}; {} failed",
            report.pid,
            report.comm,
            if report.is_final { "final report" } else { "report" },
            report.duration_s,
            bytes(t.outstanding_bytes),
            t.outstanding_allocations,
            t.allocations,
            bytes(t.allocated_bytes),
            t.frees,
            bytes(t.freed_bytes),
            t.unknown_frees,
            t.failed_allocations,
        );
    }
    if report.peak.bytes > 0 && !report.at_peak {
        let _ = writeln!(
            out,
            "  peak: {} in use at {:.1}s; {} temporary allocations ({:.1}% of all)",
            bytes(report.peak.bytes),
            report.peak.at_s,
            t.temporary_allocations,
            percent(t.temporary_allocations, t.allocations)
        );
        for held in report.peak.stacks.iter().take(SITES_LISTED) {
            let _ = writeln!(out, "    held at the peak: {:>12}  {}", held.bytes, site_of(&held.frames));
        }
        for temporary in report.temporary_stacks.iter().take(SITES_LISTED) {
            let _ = writeln!(
                out,
                "    temporary: {} of {} allocations  {}",
                temporary.temporary_allocations,
                temporary.allocations,
                site_of(&temporary.frames)
            );
        }
    }
    if let Some(memory) = &report.memory {
        // Allocations memprof had no room for are the likeliest owners of the gap; a runtime's
        // heap it does not see and blocks from before an attach are never seen (`run` traces
        // from the exec: it has none of the latter, hence "if any").
        let unrecorded = report.dropped.get("live_map_full").copied().unwrap_or(0);
        let gap = match report.blind_spots.iter().find_map(|spot| spot.heap) {
            _ if unrecorded > 0 => format!(
                "outside the heap memprof sees: most likely the {unrecorded} allocations it had no room to record \
                 (live_map_full: raise --max-live), then allocator overhead and caches"
            ),
            // Neither is known to hold more: a process attached to after long use of malloc
            // may hold more from before than its runtime's heap does.
            Some(heap) => format!(
                "outside the heap memprof sees: {heap} (not seen, below), allocator overhead and caches, \
                 and blocks made before tracing began, if any"
            ),
            None => {
                "not in blocks memprof saw allocated (blocks made before tracing began, if any; allocator overhead \
                     and caches, fragmentation, memory not from malloc)"
                    .to_string()
            }
        };
        // After the process exited: the figures of its last reading, not of this report.
        let when = if memory.age_s > 0.0 {
            format!(" {:.1} s before the end (its last reading)", memory.age_s)
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "  resident{when}: {} anonymous against {} of heap in use: {}{} {gap}; {} pages ({}) pinned by blocks with less than a quarter of them live",
            bytes(memory.rss_anon_bytes),
            bytes(memory.heap_inuse_bytes),
            if memory.difference_bytes < 0 { "-" } else { "" },
            bytes(memory.difference_bytes.unsigned_abs()),
            memory.pinned_pages,
            bytes(memory.pinned_bytes)
        );
    }
    for spot in &report.blind_spots {
        let _ = writeln!(out, "  not seen: {}; {}", spot.what, spot.advice);
    }
    if report.sample_bytes != 0 {
        let _ = writeln!(
            out,
            "  sampled: one allocation in every {} recorded; counts and bytes are estimates",
            bytes(report.sample_bytes)
        );
    }
    if let Some(growth) = report.growth {
        let _ = writeln!(
            out,
            "  growth: pages of anonymous memory by the stack that first touched each, not allocator calls ({} touched outside it)",
            growth.outside_pages
        );
    }
    if let Some(samples) = report.usdt_samples {
        let _ = writeln!(out, "  {}", crate::heap::sampling::usdt_mode(samples, report.usdt_beside_calls));
    }
    if report.stacks.is_empty() && report.totals.outstanding_allocations > 0 {
        // Filters (--focus, --min-bytes, suppressions) left none of them.
        let _ = writeln!(out, "  no stack with outstanding allocations passes the filters given");
    } else if report.stacks.is_empty() {
        let _ = writeln!(out, "  no outstanding allocations");
    } else if report.at_peak {
        let _ = writeln!(out, "  {:>12} {:>5}  STACK", "BYTES", "LEAK");
    } else {
        let _ = writeln!(
            out,
            "  {:>12} {:>9} {:>12} {:>9} {:>12} {:>9} {:>5}  STACK",
            "BYTES", "COUNT", "MAX BYTES", "TEMPORARY", "PINNED", "OLDEST", "LEAK"
        );
    }
    for stack in &report.stacks {
        // A leak candidate's score is marked with `!`; a stack the rule has no verdict on yet, `-`.
        let leak = match stack.leak.warming_up {
            Some(_) => "- ".to_string(),
            None => format!("{:.2}{}", stack.leak.score, if stack.leak.candidate { "!" } else { " " }),
        };
        let lead = if report.at_peak {
            format!("  {:>12} {:>5}  ", stack.outstanding_bytes, leak)
        } else {
            format!(
                "  {:>12} {:>9} {:>12} {:>9} {:>12} {:>8.1}s {:>5}  ",
                stack.outstanding_bytes,
                stack.outstanding_allocations,
                stack.max_outstanding_bytes,
                stack.temporary_allocations,
                stack.pinned_bytes,
                stack.oldest_age_s,
                leak
            )
        };
        write_frames(&mut out, &lead, &stack.frames, stack.truncated);
        write_via(&mut out, lead.len(), &stack.via);
        if let Some(rule) = &stack.suppressed {
            let _ = writeln!(out, "{}[suppressed by {rule}]", " ".repeat(lead.len()));
        } else if let Some(warming_up) = stack.leak.warming_up {
            let _ = writeln!(out, "{}[leak rule {warming_up}]", " ".repeat(lead.len()));
        } else if stack.leak.candidate {
            let _ = writeln!(out, "{}[{}]", " ".repeat(lead.len()), stack.leak.reason);
        }
        if let Some(reachability) = &stack.reachability {
            let _ = writeln!(out, "{}[{}]", " ".repeat(lead.len()), reachability::classes(reachability));
        }
        if !stack.types.is_empty() {
            let _ = writeln!(out, "{}[types: {}]", " ".repeat(lead.len()), reachability::types(&stack.types));
        }
    }
    if let Some(inspection) = &report.inspection {
        reachability::summary(&mut out, inspection);
    }
    threads(&mut out, report);
    if let Some(suppressed) = &report.suppressed {
        let _ = writeln!(out, "  suppressed: {}", suppressed.line());
    }
    mappings(&mut out, &report.mappings);
    if let Some(dropped) = report.dropped_line() {
        let _ = writeln!(out, "  {dropped}");
    }
    let unattributed: Vec<String> = report.unattributed_dropped.iter().map(|(r, n)| format!("{r}={n}")).collect();
    if !unattributed.is_empty() {
        let _ = writeln!(out, "  dropped by no process in particular: {}", unattributed.join(" "));
    }
    if let Some(tables) = &report.unwind_tables {
        let _ = write!(
            out,
            "  unwind tables: {} files, {} rows used, {}{} free of {} ({} of kernel memory)",
            tables.files,
            tables.rows_used,
            // Tables kept for the next process that maps their files (`--keep-unwind-tables`).
            if tables.rows_idle > 0 { format!("{} idle, ", tables.rows_idle) } else { String::new() },
            tables.rows_free,
            tables.rows_max,
            bytes(tables.kernel_bytes)
        );
        if tables.tables_not_loaded > 0 {
            let _ = write!(
                out,
                "; {} tables not loaded ({} rows): their frames end stacks (unwind_no_table)",
                tables.tables_not_loaded, tables.rows_not_loaded
            );
        }
        if tables.deferred_walks > 0 {
            let _ = write!(
                out,
                "; {} walks finished from a stack copy ({} of them cut)",
                tables.deferred_walks, tables.deferred_unfinished
            );
        }
        if tables.deferred_split > 0 {
            let _ = write!(
                out,
                "; {} of them of stacks counted under two ids, whose max_outstanding_bytes adds both highs (an upper bound)",
                tables.deferred_split
            );
        }
        out.push('\n');
    }
    for double_free in &report.double_frees {
        let _ = writeln!(out, "  DOUBLE FREE of {} ({} bytes):", double_free.address, double_free.size);
        for (what, site) in [
            ("allocated", &double_free.alloc),
            ("freed", &double_free.first_free),
            ("freed again", &double_free.second_free),
        ] {
            let lead = format!("    {what} by tid {} at {:.3}s: ", site.tid, site.time_s);
            write_frames(&mut out, &lead, &site.frames, site.truncated && !site.caller_only);
            if site.caller_only {
                let _ = writeln!(
                    out,
                    "{}[its caller only: --full-free-stacks walks a free's whole stack]",
                    " ".repeat(lead.len())
                );
            }
            write_via(&mut out, lead.len(), &site.via);
        }
    }
    if report.double_frees_not_kept > 0 {
        let _ = writeln!(out, "  and {} more double frees, counted, not kept", report.double_frees_not_kept);
    }
    if report.double_frees_unconfirmed > 0 {
        let _ = writeln!(
            out,
            "  second frees of addresses first freed while memprof's probes went in: {} (not told from double frees, not shown)",
            report.double_frees_unconfirmed
        );
    }
    out
}

/// Memory from `mmap`, `mremap` and `brk`, by stack: apart from the heap's figures, which count
/// what the allocator mapped for its blocks already.
fn mappings(out: &mut String, mappings: &Mappings) {
    if mappings.stacks.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "  mapped (anonymous mmap, mremap, brk; apart from the heap): {} outside the allocator, {} by the allocator for its blocks",
        bytes(mappings.outstanding_bytes),
        bytes(mappings.allocator_bytes)
    );
    let _ = writeln!(out, "  {:>12} {:>9}  STACK", "MAPPED", "RANGES");
    for stack in &mappings.stacks {
        let by = if stack.in_allocator { "[allocator] " } else { "" };
        let lead = format!("  {:>12} {:>9}  {by}", stack.outstanding_bytes, stack.ranges);
        // A mapping's cut walk is not in `dropped`, which counts the heap's.
        write_frames(out, &lead, &stack.frames, false);
        if stack.truncated {
            let _ = writeln!(out, "{}[truncated]", " ".repeat(lead.len()));
        }
    }
}

fn write_frames(out: &mut String, lead: &str, frames: &[Frame], truncated: bool) {
    if frames.is_empty() {
        let _ = writeln!(out, "{lead}[no stack]");
        return;
    }
    for (i, frame) in frames.iter().enumerate() {
        let pad = if i == 0 { lead.to_string() } else { " ".repeat(lead.len()) };
        let _ = writeln!(out, "{pad}{}", describe(frame));
    }
    if truncated {
        let _ = writeln!(out, "{}[truncated: see dropped]", " ".repeat(lead.len()));
    }
}

/// The allocation wrappers folded away from a stack, the caller's first:
/// `[via zmalloc > ztrymalloc_usable]`.
fn write_via(out: &mut String, indent: usize, via: &[String]) {
    if !via.is_empty() {
        let chain: Vec<&str> = via.iter().rev().map(String::as_str).collect();
        let _ = writeln!(out, "{}[via {}]", " ".repeat(indent), printable(&chain.join(" > ")));
    }
}

/// `function (file:line) [module]`, safe to print (`diff` reads frames from any file).
pub fn describe(frame: &Frame) -> String {
    let module = frame.module.rsplit('/').next().unwrap_or(&frame.module);
    let inlined = if frame.inlined { " [inlined]" } else { "" };
    format!("{} [{}]{inlined}", site(frame), printable(module))
}

/// `function (file:line)`, or just `function` without debug info; safe to print.
pub fn site(frame: &Frame) -> String {
    let site = match (&frame.file, frame.line) {
        (Some(file), Some(line)) => format!("{} ({}:{line})", frame.function, file.rsplit('/').next().unwrap_or(file)),
        (Some(file), None) => format!("{} ({file})", frame.function),
        _ => frame.function.clone(),
    };
    printable(&site).into_owned()
}

/// Sites listed under the peak line for the peak's stacks and for the temporary allocations:
/// the JSON report has them all.
const SITES_LISTED: usize = 5;

/// The allocation site of a stack's frames, for one-line mentions.
fn site_of(frames: &[Frame]) -> String {
    frames.first().map_or_else(|| "[no stack]".to_string(), describe)
}

/// `part` as a percentage of `whole` (0 for none).
fn percent(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 * 100.0 / whole as f64
    }
}

pub(super) fn bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64;
    let mut unit = "B";
    for u in UNITS {
        if value < 1024.0 {
            break;
        }
        value /= 1024.0;
        unit = u;
    }
    format!("{value:.1} {unit}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heap::report::samples::frame;

    #[test]
    fn frames_read_function_file_line_module() {
        assert_eq!(describe(&frame("leak_here", Some("/src/leaky.c"), Some(12))), "leak_here (leaky.c:12) [leaky]");
        assert_eq!(describe(&frame("leaky+0x1139", None, None)), "leaky+0x1139 [leaky]");
    }

    #[test]
    fn the_header_names_the_namespace_pid_when_it_differs() {
        let mut report = crate::heap::report::samples::report();
        assert!(render(&report).starts_with("memprof: pid 1 (leaky) final report"));
        report.ns_pid = Some(7);
        assert!(render(&report).starts_with("memprof: pid 1 (leaky, pid 7 in its namespace) final report"));
    }

    #[test]
    fn the_c_librarys_internal_frees_are_said_apart_when_there_are_some() {
        let mut report = crate::heap::report::samples::report();
        assert!(!render(&report).contains("C library"));
        report.totals.internal_frees = 8;
        let table = render(&report);
        assert!(table.contains(" unknown frees; 8 frees of the C library's own blocks; "), "{table}");
    }

    #[test]
    fn second_frees_not_told_from_double_frees_are_counted_apart() {
        let mut report = crate::heap::report::samples::report();
        assert!(!render(&report).contains("second frees"));
        report.double_frees_unconfirmed = 2;
        let table = render(&report);
        assert!(
            table.contains("  second frees of addresses first freed while memprof's probes went in: 2 (not told from double frees, not shown)\n"),
            "{table}"
        );
        assert!(!table.contains("DOUBLE FREE"), "{table}");
    }

    #[test]
    fn a_stack_without_a_verdict_yet_says_it_is_warming_up() {
        let mut report = crate::heap::report::samples::report();
        report.stacks[0].leak.warming_up = Some(crate::heap::leak::WarmUp { seen: 2, window: 6 });
        let table = render(&report);
        assert!(table.contains("0.5s    -   leak_here"), "{table}");
        assert!(table.contains("[leak rule warming up (2 of 6 intervals)]"), "{table}");
        assert!(!table.contains("0.00"), "{table}");
    }

    #[test]
    fn sizes_are_human_readable() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(3 << 20), "3.0 MiB");
    }
}
