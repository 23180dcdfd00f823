//! Several processes' reports as one profile.

use super::Report;
use crate::symbolize::{Frame, FrameInfo, Frames};

/// One report of `root` and its children for formats that draw one profile (pprof, folded,
/// flame graph, HTML): every process's stacks, each under an outermost frame naming the process
/// (`comm (pid N)`), so that a process is a root of the flame graph and call tree; totals summed.
pub fn merge_processes(root: &Report) -> Report {
    let mut merged = Report { children: Vec::new(), ..root.clone() };
    merged.stacks.clear();
    merged.mappings.stacks.clear();
    for process in std::iter::once(root).chain(&root.children) {
        let process_frame = process_frame(process);
        for stack in &process.stacks {
            let mut stack = stack.clone();
            stack.frames = with_outermost(&stack.frames, &process_frame);
            merged.stacks.push(stack);
        }
        for stack in &process.mappings.stacks {
            let mut stack = stack.clone();
            stack.frames = with_outermost(&stack.frames, &process_frame);
            merged.mappings.stacks.push(stack);
        }
        if process.pid != root.pid {
            merged.mappings.outstanding_bytes += process.mappings.outstanding_bytes;
            merged.mappings.allocator_bytes += process.mappings.allocator_bytes;
            let (t, c) = (&mut merged.totals, &process.totals);
            t.outstanding_bytes += c.outstanding_bytes;
            t.outstanding_allocations += c.outstanding_allocations;
            t.allocations += c.allocations;
            t.allocated_bytes += c.allocated_bytes;
            t.frees += c.frees;
            t.freed_bytes += c.freed_bytes;
            t.unknown_frees += c.unknown_frees;
            t.internal_frees += c.internal_frees;
            t.failed_allocations += c.failed_allocations;
            t.temporary_allocations += c.temporary_allocations;
            for (reason, count) in &process.dropped {
                *merged.dropped.entry(reason).or_default() += count;
            }
            merged.modules.extend(process.modules.iter().cloned());
            merged.double_frees.extend(process.double_frees.iter().cloned());
            merged.double_frees_not_kept += process.double_frees_not_kept;
            merged.double_frees_unconfirmed += process.double_frees_unconfirmed;
        }
    }
    merged.stacks.sort_by_key(|s| std::cmp::Reverse(s.outstanding_bytes));
    merged.mappings.stacks.sort_by_key(|s| std::cmp::Reverse(s.outstanding_bytes));
    merged
}

/// `frames` with `outermost` after them.
fn with_outermost(frames: &[Frame], outermost: &Frame) -> Frames {
    frames.iter().chain(std::iter::once(outermost)).cloned().collect()
}

/// The outermost frame of a process's stacks when several processes share one profile:
/// `comm (pid N)`.
pub fn process_frame(process: &Report) -> Frame {
    Frame::new(FrameInfo {
        address: "0x0".into(),
        function: format!("{} (pid {})", process.comm, process.pid),
        file: None,
        line: None,
        module: process.exe.clone(),
        inlined: false,
        mangled: None,
    })
}

/// Whether `frame` is a `process_frame`, as a profile read back has it.
pub fn is_process_frame(frame: &Frame) -> bool {
    let pid = frame.function.strip_suffix(')').and_then(|rest| rest.rsplit_once(" (pid ")).map(|(_, pid)| pid);
    frame.address == "0x0" && pid.is_some_and(|pid| pid.parse::<u32>().is_ok())
}
