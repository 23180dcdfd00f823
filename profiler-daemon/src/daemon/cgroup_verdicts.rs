//! Which cgroups no cgroup rule contains, learned from the execs and forks the kernel reports:
//! once a cgroup is found to be no rule's, the kernel keeps its processes' execs and forks back
//! (`discover::CGROUPS`), and the host's other processes cost the daemon nothing at their start.
//!
//! A cgroup is the unified hierarchy's (v2), whose id the kernel gives with the event. It is
//! judged by the path a process in it shows in `/proc`, and kept back only when the directory at
//! that path under the cgroup2 mount has that id (its inode number): a process that moved in
//! between is not judged. On a host with v1 hierarchies too, a rule may name one of their
//! cgroups, which the v2 one does not tell: nothing is kept back while a rule names a directory
//! of a v1 hierarchy.

use std::{collections::HashSet, fs, os::unix::fs::MetadataExt, path::PathBuf};

use profiler_common::MAX_UNMATCHED_CGROUPS;

use super::config::Rules;
use crate::process::procfs;

pub struct CgroupVerdicts {
    /// Where the unified hierarchy is mounted (`/sys/fs/cgroup`), and its device; none: nothing
    /// is judged.
    mount: Option<(PathBuf, u64)>,
    /// A rule names a directory of a v1 hierarchy: nothing is judged.
    v1_named: bool,
    /// Ids of the cgroups judged since the kernel's list was last emptied, kept back or not: not
    /// judged again (a name the rules name, or a regex they hold, has the kernel report their
    /// execs still).
    judged: HashSet<u64>,
}

impl CgroupVerdicts {
    pub fn new(rules: &Rules) -> Self {
        let mount = procfs::cgroup_mounts("cgroup2").into_iter().next().and_then(|mount| {
            let dev = fs::metadata(&mount).ok()?.dev();
            Some((mount, dev))
        });
        Self { mount, v1_named: names_v1(rules), judged: HashSet::new() }
    }

    /// The id to keep back in the kernel, when no rule of `rules` contains cgroup `id` (0:
    /// unknown), the one process `pid` was reported in; judged by `pid` if it is there still,
    /// else by `parent` (for a fork, the process that forked it, in the same cgroup unless it
    /// started the child elsewhere: the id tells).
    pub fn unmatched(&mut self, rules: &Rules, id: u64, pid: u32, parent: Option<u32>) -> Option<u64> {
        if id == 0 || !rules.needs_cgroup() || self.v1_named || self.judged.contains(&id) {
            return None;
        }
        let path = [Some(pid), parent].into_iter().flatten().find_map(|pid| self.path_of(pid, id))?;
        self.judged.insert(id);
        (!rules.names_cgroup(&path)).then_some(id)
    }

    /// The path of the cgroup `pid` is in, when it is cgroup `id`.
    fn path_of(&self, pid: u32, id: u64) -> Option<String> {
        let (mount, dev) = self.mount.as_ref()?;
        let path = procfs::cgroup(pid)?;
        let dir = fs::metadata(mount.join(path.trim_start_matches('/'))).ok()?;
        (dir.ino() == id && dir.dev() == *dev).then_some(path)
    }

    /// Whether the kernel's list could not take one more: it is to be emptied, and `forget`
    /// called (cgroups come and go, and the host's live ones are judged again).
    pub fn is_full(&self) -> bool {
        self.judged.len() >= MAX_UNMATCHED_CGROUPS as usize
    }

    /// Whether the kernel is to forget the cgroups it kept back (then `forget`): a rule names a
    /// v1 cgroup now, which may have been made since the last look (at each scan of `/proc`), or
    /// `rules` are new (a reload).
    pub fn review(&mut self, rules: &Rules) -> bool {
        let was = std::mem::replace(&mut self.v1_named, names_v1(rules));
        self.v1_named && !was
    }

    /// The kernel has forgotten the cgroups it kept back: every cgroup is judged again.
    pub fn forget(&mut self) {
        self.judged.clear();
    }
}

/// Whether a cgroup rule of `rules` names a directory of a v1 hierarchy.
fn names_v1(rules: &Rules) -> bool {
    let mounts = if rules.needs_cgroup() { procfs::cgroup_mounts("cgroup") } else { Vec::new() };
    mounts.iter().any(|mount| rules.cgroups.iter().any(|rule| mount.join(rule.trim_start_matches('/')).is_dir()))
}
