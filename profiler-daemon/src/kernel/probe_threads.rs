//! The thread each process's perf-event uprobes are opened on, where the kernel has no
//! uprobe_multi links (Linux 6.1, or `MEMPROF_UPROBE_MULTI=0`; docs:
//! reference/kernels.md#a-thread-that-exits-before-the-others).
//!
//! The kernel opens such an event on one thread, and fires it in every thread whose memory is
//! that thread's (`__uprobe_perf_filter` compares the event's task's `mm` with the current one's),
//! on 6.1 as on 6.18. A thread that exits drops its memory first (`exit_mm`, before the
//! `sched_process_exit` tracepoint): from then on the event passes no thread of the process, and
//! the first call that meets its breakpoint has the kernel take the breakpoint out of the process
//! (`UPROBE_HANDLER_REMOVE`), though the event stays open. A main thread that calls `pthread_exit`
//! while others run on, or the thread memprof chose when the main thread had exited already,
//! thus ends the tracing of the whole process.
//!
//! So the thread each process's events are on is noted in `PROBE_THREADS`, whose exit the
//! thread-exit program reports (`PROBE_THREAD_EXIT`), and memprof opens them again on a thread
//! that stays (see `Loaded::probe_thread_exited`). The calls in between are not seen: each such
//! gap is counted, `DropReason::ProbeThreadExited`, and said.

use std::collections::HashMap;

use anyhow::Context as _;
use aya::Ebpf;

use crate::process::procfs;

/// What memprof keeps, per process, of the threads its perf-event uprobes are opened on.
#[derive(Debug, Default)]
pub struct ProbeThreads {
    /// By process: the thread its perf-event uprobes are opened on.
    threads: HashMap<u32, u32>,
    /// By process: the gaps in its probes, since it was attached or last exec'd.
    gaps: HashMap<u32, u64>,
}

impl ProbeThreads {
    /// The thread to open `pid`'s perf-event uprobes on: the one its others are on, else its
    /// main thread, or a thread that stays once that has exited. Its exit is reported from now on.
    pub fn thread_of(&mut self, ebpf: &mut Ebpf, pid: u32) -> anyhow::Result<u32> {
        if let Some(&thread) = self.threads.get(&pid) {
            return Ok(thread);
        }
        let thread = procfs::memory_task(pid);
        self.watch(ebpf, pid, thread)?;
        Ok(thread)
    }

    /// The thread `pid`'s perf-event uprobes are opened on, if any.
    pub fn thread(&self, pid: u32) -> Option<u32> {
        self.threads.get(&pid).copied()
    }

    /// `pid`'s probes fired no more for a while (see the module's doc).
    pub fn count_gap(&mut self, pid: u32) {
        *self.gaps.entry(pid).or_default() += 1;
    }

    /// The gaps `pid`'s probes had, since it was attached or last exec'd.
    pub fn gaps(&self, pid: u32) -> u64 {
        self.gaps.get(&pid).copied().unwrap_or(0)
    }

    /// `pid` exec'd: its gaps were the old program's, whose drops the kernel forgot.
    pub fn exec_happened(&mut self, pid: u32) {
        self.gaps.remove(&pid);
    }

    /// `pid` is let go, or its probes went (an exec by another thread, which ended theirs).
    pub fn forget(&mut self, ebpf: &mut Ebpf, pid: u32) {
        if let Some(thread) = self.threads.remove(&pid) {
            if let Ok(mut map) = probe_threads_map(ebpf) {
                let _ = map.remove(&thread);
            }
        }
        self.gaps.remove(&pid);
    }

    /// Notes `thread` as `pid`'s, in `PROBE_THREADS` before any event is opened on it: the exit
    /// of a thread that had not begun exiting then is reported.
    pub fn watch(&mut self, ebpf: &mut Ebpf, pid: u32, thread: u32) -> anyhow::Result<()> {
        let mut map = probe_threads_map(ebpf)?;
        map.insert(thread, pid, 0).with_context(|| format!("noting thread {thread} of pid {pid} in PROBE_THREADS"))?;
        if let Some(old) = self.threads.insert(pid, thread).filter(|&old| old != thread) {
            let _ = map.remove(&old);
        }
        Ok(())
    }
}

fn probe_threads_map(ebpf: &mut Ebpf) -> anyhow::Result<aya::maps::HashMap<&mut aya::maps::MapData, u32, u32>> {
    let map = ebpf.map_mut("PROBE_THREADS").context("map PROBE_THREADS missing")?;
    Ok(aya::maps::HashMap::try_from(map)?)
}
