//! The profile of the host: every traced process's stacks in one pprof profile, each sample
//! labelled with its process (pid, comm, exe, cgroup) and whether the leak rule flags its stack,
//! so that a continuous-profiling server scraping pprof endpoints (Pyroscope's or Parca's) gets
//! one profile per host, and `go tool pprof -tagfocus=pid=N` picks one process out of it.
//!
//! Its size is bounded as a process's profile is: the kernel's stack tables, which every traced
//! process shares, hold at most `--max-stacks` stacks.

use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::OnceCell;

use super::view::TargetView;
use crate::format::pprof::{self, DefaultType, Part};

/// The host's profiles of one interval, built on first request.
#[derive(Debug, Default)]
pub struct HostProfiles {
    pub heap: OnceCell<Bytes>,
    pub allocs: OnceCell<Bytes>,
}

impl HostProfiles {
    pub fn cell(&self, default: DefaultType) -> &OnceCell<Bytes> {
        match default {
            DefaultType::InuseSpace => &self.heap,
            DefaultType::AllocSpace => &self.allocs,
        }
    }
}

/// The profile of `targets`, in pid order; the stacks that freed all they allocated included (they
/// count in `alloc_*`).
pub fn render(targets: &[Arc<TargetView>], default: DefaultType) -> Vec<u8> {
    let parts: Vec<Part> = targets
        .iter()
        .map(|target| Part::labelled(&target.report, &target.freed_stacks, target.cgroup.as_deref()))
        .collect();
    pprof::render_parts(&parts, default)
}
