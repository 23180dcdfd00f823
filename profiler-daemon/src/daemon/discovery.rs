//! Finds the processes the rules ask for, by polling /proc (kprobes are not available, and a
//! poll also catches processes that were running before the daemon started).

use std::collections::HashSet;

use super::config::Rules;
use crate::{kernel::shared::FileId, process::procfs};

/// A process, named for good by its pid and start time (pids are reused).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProcessId {
    pub pid: u32,
    pub start_time: u64,
}

impl ProcessId {
    /// Seconds since the process started.
    pub fn age_seconds(&self) -> f64 {
        procfs::seconds_since_boot() - self.start_time as f64 / procfs::clock_ticks_per_second()
    }

    /// The process now running under `pid`, if any (zombies are gone already).
    pub fn current(pid: u32) -> Option<Self> {
        let stat = procfs::stat(pid)?;
        (!stat.kernel_thread && !stat.zombie).then_some(Self { pid, start_time: stat.start_time })
    }
}

/// Every user-space process that matches `rules`, memprof itself excepted.
pub fn scan(rules: &Rules) -> Vec<(ProcessId, String)> {
    let own = std::process::id();
    let mut found = Vec::new();
    for pid in procfs::pids() {
        if pid != own {
            found.extend(matching(rules, pid));
        }
    }
    found
}

/// The process `pid` when it runs and matches `rules` (a traced process's new child is checked
/// at once, not at the next poll).
pub fn matching(rules: &Rules, pid: u32) -> Option<(ProcessId, String)> {
    let comm = procfs::comm(pid)?;
    let cgroups = if rules.needs_cgroup() { procfs::cgroups(pid) } else { Vec::new() };
    if !rules.matches(pid, &comm, &cgroups) {
        return None;
    }
    // `stat`, the dearest of the three reads, only for the few that match.
    Some((ProcessId::current(pid)?, comm))
}

/// How many processes that are not traced map one of `files` (files whose links are shared),
/// and so take a trap at each of their probed calls. Reads every process's maps: counted when
/// the shared files change and at each resync, never per interval.
pub fn untraced_sharing(files: &HashSet<FileId>, traced: &HashSet<u32>) -> u64 {
    if files.is_empty() {
        return 0;
    }
    let own = std::process::id();
    let maps_shared = |pid: u32| {
        crate::process::procfs::read_text(format!("/proc/{pid}/maps"))
            .is_ok_and(|maps| maps.lines().filter_map(FileId::of_maps_line).any(|file| files.contains(&file)))
    };
    procfs::pids().into_iter().filter(|&pid| pid != own && !traced.contains(&pid) && maps_shared(pid)).count() as u64
}
