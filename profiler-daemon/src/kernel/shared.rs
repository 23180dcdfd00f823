//! Which links each traced process gets: links of its own, or its share of the links every
//! traced process mapping a file uses.
//!
//! A uprobe belongs to a file's inode: registering or unregistering one makes the kernel visit
//! every process that maps the file, whatever the link's pid filter. A link per process on the C
//! library thus costs N walks over N processes, which stalled a host for minutes at a few
//! hundred processes (docs: performance.md#measurements-behind-design-choices).
//! One link per (file, program) for every process (pid 0) costs one walk, and starting or
//! stopping to trace a process is a map update; but the kernel then puts its breakpoints in
//! every process that maps the file, traced or not, and each of them takes a trap per call.
//! So by default (`ProbeLinks::Auto`) a file's traced processes get links of their own until
//! `crossover` of them map it, and share from then on.
//!
//! A process's kind of links is decided at its first link and kept while it is traced (the
//! `SHARED` flag of its `TRACED` entry; shared links' cookies carry `SHARED_LINK`): the
//! programs record a process only through the kind of links it was given, so a process with
//! links of its own is not seen a second time by a file's shared links, whenever those come.
//! Moving a running process from one kind to the other cannot be exact: the two links' programs
//! run one after the other at each trap, and the flag could change between them.

use std::{
    collections::{HashMap, HashSet},
    path::Path,
    sync::Arc,
};

pub use crate::process::file_cache::FileId;
use crate::{
    kernel::{probes::Attachment, uprobe_multi::Point},
    process::allocator::Allocator,
};

/// Which links the daemon gives the processes it traces (`--probe-links`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProbeLinks {
    /// Links of each process's own while few traced processes map a file, links shared per
    /// file past that: the rest of the host pays nothing until then.
    Auto,
    /// One set per allocator file for every traced process: attached and let go by the thousand
    /// in seconds; every other process mapping the file takes the probes' trap too.
    Shared,
    /// Links of each process's own: the rest of the host pays nothing, but attaching or letting
    /// go of one visits every process that maps the file (for a few processes).
    PerProcess,
}

/// Under `ProbeLinks::Auto`, the number of traced processes mapping a file from which its
/// processes share links (BENCHMARKS.md, "Scale", has the measurements behind it).
pub const CROSSOVER: usize = 32;

/// `MEMPROF_SHARE_FROM=N` sets the crossover (for tests that cross it with a few processes).
const CROSSOVER_VAR: &str = "MEMPROF_SHARE_FROM";

/// The files of `allocator`, as the kernel tells them apart.
pub fn file_ids(allocator: &Allocator) -> HashSet<FileId> {
    allocator.files.iter().map(|file| file.id).collect()
}

/// `allocator` without the files in `probed`: what a process whose probes stayed through an exec
/// still lacks. A probe attached twice would count each call twice.
pub fn unprobed(allocator: &Allocator, probed: &HashSet<FileId>) -> Allocator {
    let mut missing = allocator.clone();
    missing.files.retain(|file| !probed.contains(&file.id));
    missing
}

/// What makes two processes' links the same: the file, the program and its probes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    file: FileId,
    program: &'static str,
    points: Vec<Point>,
}

/// The shared links, each held by the traced processes that use it and by this registry, and
/// which traced processes use which files and which kind of links.
#[derive(Debug)]
pub struct SharedLinks {
    links: HashMap<Key, Arc<Attachment>>,
    policy: ProbeLinks,
    crossover: usize,
    /// The traced processes with probes in each file.
    users: HashMap<FileId, HashSet<u32>>,
    /// Each traced process's kind of links: shared (true) or its own.
    sharing: HashMap<u32, bool>,
    /// Processes about to be attached together, by the files they map (see `attaching`).
    attaching: HashMap<FileId, usize>,
}

impl SharedLinks {
    pub fn new(policy: ProbeLinks) -> Self {
        let crossover = std::env::var(CROSSOVER_VAR).ok().and_then(|n| n.parse().ok()).unwrap_or(CROSSOVER);
        Self {
            links: HashMap::new(),
            policy,
            crossover,
            users: HashMap::new(),
            sharing: HashMap::new(),
            attaching: HashMap::new(),
        }
    }

    /// Processes are about to be attached one after the other (the daemon's first scan finds
    /// them all at once), `files` of them mapping each file: counted as its users already, so
    /// that a thousand do not begin with `crossover` links of their own, each visiting the
    /// thousand at attach and at exit. Counted by file: a file only one of them maps keeps links
    /// of its own, and the untraced processes that map it take no trap.
    pub fn attaching(&mut self, files: HashMap<FileId, usize>) {
        self.attaching = files;
    }

    /// The traced processes that map `file`, with those about to be attached, or at least the
    /// one about to get its links.
    fn users_of(&self, file: FileId) -> usize {
        self.users.get(&file).map_or(0, HashSet::len) + self.attaching.get(&file).copied().unwrap_or(0).max(1)
    }

    pub fn set_policy(&mut self, policy: ProbeLinks) {
        self.policy = policy;
    }

    /// Whether `pid` shares links, once decided.
    pub fn shares(&self, pid: u32) -> Option<bool> {
        self.sharing.get(&pid).copied()
    }

    /// Whether a process about to get its first link, in `file`, is to share: under `Auto`,
    /// where the file's links are shared already or `crossover` traced processes map it.
    pub fn should_share(&self, file: FileId) -> bool {
        match self.policy {
            ProbeLinks::Shared => true,
            ProbeLinks::PerProcess => false,
            ProbeLinks::Auto => self.links.keys().any(|key| key.file == file) || self.users_of(file) >= self.crossover,
        }
    }

    /// Records `pid`'s kind of links, kept until `forget`.
    pub fn decide(&mut self, pid: u32, shares: bool) {
        self.sharing.insert(pid, shares);
    }

    /// Records that `pid` has probes in `file`.
    pub fn uses(&mut self, pid: u32, file: FileId) {
        self.users.entry(file).or_default().insert(pid);
    }

    /// `pid` has no probes in any file any more (it exec'd), its kind of links kept.
    pub fn leave(&mut self, pid: u32) {
        self.users.retain(|_, pids| {
            pids.remove(&pid);
            !pids.is_empty()
        });
    }

    /// `pid` is no longer traced.
    pub fn forget(&mut self, pid: u32) {
        self.leave(pid);
        self.sharing.remove(&pid);
    }

    /// The links of `program` at `points` of `file` (at `path`), attached by `attach` unless a
    /// traced process uses them already.
    pub fn get_or_attach(
        &mut self,
        path: &Path,
        file: FileId,
        program: &'static str,
        points: &[Point],
        attach: impl FnOnce() -> anyhow::Result<Attachment>,
    ) -> anyhow::Result<Arc<Attachment>> {
        let key = Key { file, program, points: points.to_vec() };
        if let Some(links) = self.links.get(&key) {
            return Ok(links.clone());
        }
        let first = !self.links.keys().any(|key| key.file == file);
        let links = Arc::new(attach()?);
        tracing::debug!(path = %path.display(), program, probes = points.len(), "shared links attached");
        if first && self.policy == ProbeLinks::Auto {
            let traced = self.users_of(file);
            // `path` may be a link in /proc that names no file once its process is gone.
            let named = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
            tracing::warn!(
                "{traced} traced processes map {}: its probes are shared from now on, and every untraced process \
                 mapping it takes a trap per probed call",
                named.display()
            );
        }
        self.links.insert(key, links.clone());
        Ok(links)
    }

    /// The files that have shared links.
    pub fn shared_files(&self) -> HashSet<FileId> {
        self.links.keys().map(|key| key.file).collect()
    }

    /// Takes out the links no traced process uses any more, to be detached.
    pub fn take_unused(&mut self) -> Vec<Attachment> {
        let unused: Vec<Key> =
            self.links.iter().filter(|(_, links)| Arc::strong_count(links) == 1).map(|(key, _)| key.clone()).collect();
        unused.iter().filter_map(|key| Arc::into_inner(self.links.remove(key)?)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_maps_line_names_its_file() {
        let line = "7f1c2a000000-7f1c2a028000 r--p 00000000 fe:01 1835345                    /usr/lib/x86_64-linux-gnu/libc.so.6";
        assert_eq!(FileId::of_maps_line(line), Some(FileId { device: libc::makedev(0xfe, 1), inode: 1_835_345 }));
        assert_eq!(FileId::of_maps_line("7ffd0000-7ffd1000 rw-p 00000000 00:00 0   [stack]"), None);
    }

    #[test]
    fn auto_shares_from_the_crossover() {
        let mut links = SharedLinks { crossover: 3, ..SharedLinks::new(ProbeLinks::Auto) };
        let file = FileId { device: 1, inode: 2 };
        for pid in [10, 11] {
            assert!(!links.should_share(file));
            links.uses(pid, file);
        }
        assert!(links.should_share(file), "the third");
        links.forget(10);
        assert!(!links.should_share(file));
        let other = FileId { device: 1, inode: 3 };
        links.attaching(HashMap::from([(file, 2), (other, 1)]));
        assert!(links.should_share(file), "one traced and two about to be");
        assert!(!links.should_share(other), "one about to be");
        assert!(SharedLinks::new(ProbeLinks::Shared).should_share(file));
        assert!(!SharedLinks { crossover: 1, ..SharedLinks::new(ProbeLinks::PerProcess) }.should_share(file));
    }
}
