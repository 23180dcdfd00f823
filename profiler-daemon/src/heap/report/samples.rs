//! Reports for the unit tests of the formats.

use profiler_common::DropReason;

use super::*;
use crate::symbolize::{Frame, FrameInfo};

pub fn frame(function: &str, file: Option<&str>, line: Option<u32>) -> Frame {
    Frame::new(FrameInfo {
        address: "0x1234".into(),
        function: function.into(),
        file: file.map(Into::into),
        line,
        module: "/usr/bin/leaky".into(),
        inlined: false,
        mangled: None,
    })
}

/// A final report with one stack: 48 bytes outstanding in one allocation at `leak_here`.
pub fn report() -> Report {
    Report {
        is_final: true,
        context: None,
        pid: 1,
        ns_pid: None,
        comm: "leaky".into(),
        exe: "/usr/bin/leaky".into(),
        parent: None,
        blind_spots: Vec::new(),
        exited: false,
        live: false,
        at_peak: false,
        duration_s: 1.5,
        sample_bytes: 0,
        growth: None,
        usdt_samples: None,
        usdt_beside_calls: false,
        totals: Totals::default(),
        peak: Peak::default(),
        temporary_stacks: Vec::new(),
        memory: None,
        mappings: Mappings::default(),
        dropped: DropReason::ALL.iter().map(|r| (r.name(), 0)).collect(),
        unattributed_dropped: BTreeMap::new(),
        stacks_not_shown: 0,
        suppressed: None,
        stacks: vec![StackReport {
            stack_id: "00".into(),
            outstanding_bytes: 48,
            outstanding_allocations: 1,
            allocations: 1,
            allocated_bytes: 48,
            max_outstanding_bytes: 48,
            temporary_allocations: 0,
            pinned_pages: 0,
            pinned_bytes: 0,
            oldest_age_s: 0.5,
            oldest_ns: None,
            truncated: false,
            via: Vec::new(),
            leak: LeakVerdict::default(),
            reachability: None,
            types: Vec::new(),
            suppressed: None,
            frames: vec![frame("leak_here", Some("leaky.c"), Some(12))].into(),
        }],
        modules: vec![Module {
            path: "/usr/bin/leaky".into(),
            start: 0x1000,
            limit: 0x2000,
            file_offset: 0x1000,
            build_id: "0badc0de".into(),
        }],
        double_frees: vec![],
        double_frees_not_kept: 0,
        double_frees_unconfirmed: 0,
        sizes: vec![],
        lifetimes: vec![],
        thread_pairs: vec![],
        threads: Vec::new(),
        timeline: Timeline::default(),
        children: Vec::new(),
        forks: None,
        unwind_tables: None,
        inspection: None,
    }
}
