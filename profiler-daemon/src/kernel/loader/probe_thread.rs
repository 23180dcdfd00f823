//! A process's perf-event uprobes kept on a thread that runs (see `probe_threads`).

use std::{num::NonZeroU32, path::Path};

use profiler_common::{DropReason, ProcDrops};

use super::Loaded;
use crate::{
    kernel::{aggregate::monotonic_now_ns, probes::Attachment},
    process::{
        file_cache::{FileId, Opened},
        procfs,
    },
};

/// Threads tried in turn when each exits before the probes are open on it.
const THREADS_TRIED: usize = 16;

/// A process's perf-event uprobes opened again on another thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Moved {
    pub thread: u32,
    /// From the exit of the thread they were on to their opening on `thread`: the process's calls
    /// then were not seen.
    pub gap_ns: u64,
}

impl Loaded {
    /// The thread `pid`'s perf-event uprobes are opened on (see `probe_threads`).
    pub(super) fn probe_thread(&mut self, pid: u32) -> anyhow::Result<u32> {
        self.probe_threads.thread_of(&mut self.ebpf, pid)
    }

    /// Thread `tid` of `pid` exited alone at `exited_ns` (`PROBE_THREAD_EXIT`): when
    /// `attachment`'s perf-event uprobes were on it, they fire no more, and are opened again on a
    /// thread that stays, the gap counted (see `probe_threads`). None when they were not on it
    /// (they were moved already).
    pub fn probe_thread_exited(
        &mut self,
        pid: NonZeroU32,
        tid: u32,
        exited_ns: u64,
        attachment: &mut Attachment,
    ) -> Option<anyhow::Result<Moved>> {
        if self.probe_threads.thread(pid.get()) != Some(tid) {
            return None;
        }
        self.probe_threads.count_gap(pid.get());
        let mut exited = tid;
        for _ in 0..THREADS_TRIED {
            // None when the rest of the process went too, after that thread.
            let Some(thread) = procfs::staying_thread(pid.get(), exited) else {
                return Some(Err(anyhow::anyhow!("no thread of it stays")));
            };
            if let Err(err) = self.probe_threads.watch(&mut self.ebpf, pid.get(), thread) {
                return Some(Err(err));
            }
            let open_file = |path: &Path, file: FileId| Opened::open_mapped(pid.get(), path, file);
            let (replaced, moved) = attachment.move_to_thread(&mut self.ebpf, thread, open_file);
            // None fired in the gap, and they went in again one at a time.
            self.probes_in_place(pid.get());
            self.detach_in_background(replaced);
            // A thread that began to exit before it was noted in `PROBE_THREADS` is not
            // reported: it is looked at here, and another tried.
            if procfs::thread_stays(pid.get(), thread) {
                return Some(moved.map(|()| Moved { thread, gap_ns: monotonic_now_ns().saturating_sub(exited_ns) }));
            }
            exited = thread;
        }
        Some(Err(anyhow::anyhow!("its threads exited as fast as {THREADS_TRIED} of them were tried")))
    }

    /// `tgid`'s gaps in its probes, with its drops (see `probe_threads`).
    pub(super) fn add_gaps(&self, tgid: u32, drops: &mut ProcDrops) {
        drops.counts[DropReason::ProbeThreadExited as usize] += self.probe_threads.gaps(tgid);
    }
}
