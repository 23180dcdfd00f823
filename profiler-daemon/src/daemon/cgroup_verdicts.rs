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

use std::{collections::HashSet, os::unix::fs::MetadataExt, path::PathBuf};

use super::config::Rules;
use crate::process::procfs;

/// The cgroups a rule contains are remembered, so that their processes are not judged again;
/// past this many (containers come and go), they are forgotten and judged once more.
const KNOWN_MATCHING: usize = 4_096;

pub struct CgroupVerdicts {
    /// Where the unified hierarchy is mounted (`/sys/fs/cgroup`); none: nothing is judged.
    mount: Option<PathBuf>,
    /// A rule names a directory of a v1 hierarchy: nothing is judged.
    v1_named: bool,
    /// Ids of cgroups a rule contains.
    matching: HashSet<u64>,
}

impl CgroupVerdicts {
    pub fn new(rules: &Rules) -> Self {
        let mount = procfs::cgroup_mounts("cgroup2").into_iter().next();
        Self { mount, v1_named: names_v1(rules), matching: HashSet::new() }
    }

    /// The id to keep back in the kernel, when process `pid`, reported in cgroup `id` (0:
    /// unknown), is there still and no rule of `rules` contains that cgroup.
    pub fn unmatched(&mut self, rules: &Rules, pid: u32, id: u64) -> Option<u64> {
        if id == 0 || !rules.needs_cgroup() || self.v1_named || self.matching.contains(&id) {
            return None;
        }
        let path = procfs::cgroup(pid)?;
        let dir = self.mount.as_ref()?.join(path.trim_start_matches('/'));
        if std::fs::metadata(dir).ok()?.ino() != id {
            return None;
        }
        if rules.names_cgroup(&path) {
            if self.matching.len() >= KNOWN_MATCHING {
                self.matching.clear();
            }
            self.matching.insert(id);
            return None;
        }
        Some(id)
    }

    /// `rules` are new (a reload: the kernel forgets the cgroups it kept back), or v1 cgroups
    /// may have been made since the last look (a scan of `/proc`). Returns whether the kernel is
    /// to forget the cgroups it kept back: a rule names a v1 cgroup now.
    pub fn review(&mut self, rules: &Rules) -> bool {
        let was = std::mem::replace(&mut self.v1_named, names_v1(rules));
        self.v1_named && !was
    }

    /// The rules changed: every cgroup is judged again.
    pub fn forget(&mut self, rules: &Rules) {
        self.matching.clear();
        self.review(rules);
    }
}

/// Whether a cgroup rule of `rules` names a directory of a v1 hierarchy.
fn names_v1(rules: &Rules) -> bool {
    let mounts = if rules.needs_cgroup() { procfs::cgroup_mounts("cgroup") } else { Vec::new() };
    mounts.iter().any(|mount| rules.cgroups.iter().any(|rule| mount.join(rule.trim_start_matches('/')).is_dir()))
}
