//! Links shared by every traced process that maps a file.
//!
//! A uprobe belongs to a file's inode: registering or unregistering one makes the kernel visit
//! every process that maps the file, whatever the link's pid filter. A link per process on the C
//! library thus costs N walks over N processes (600 processes stalled a host for 20 minutes).
//! One link per (file, program) for every process (pid 0) costs one walk; the programs return at
//! once for a process not in `TRACED`, and starting or stopping to trace a process is a map
//! update. Each link set stays while a traced process uses it.

use std::{collections::HashMap, os::unix::fs::MetadataExt as _, path::Path, sync::Arc};

use anyhow::Context as _;

use crate::kernel::{probes::Attachment, uprobe_multi::Point};

/// Which links the daemon gives the processes it traces (`--probe-links`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProbeLinks {
    /// One set per allocator file for every traced process: attached and let go by the thousand
    /// in seconds; every other process mapping the file takes the probes' trap too.
    Shared,
    /// Links of each process's own: the rest of the host pays nothing, but attaching or letting
    /// go of one visits every process that maps the file (for a few processes).
    PerProcess,
}

/// What makes two processes' links the same: the file (device and inode, whatever path reaches
/// it), the program and its probes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    device: u64,
    inode: u64,
    program: &'static str,
    points: Vec<Point>,
}

/// The shared links, each held by the traced processes that use it and by this registry.
#[derive(Debug, Default)]
pub struct SharedLinks {
    links: HashMap<Key, Arc<Attachment>>,
}

impl SharedLinks {
    /// The links of `program` at `points` of the file at `path`, attached by `attach` unless a
    /// traced process uses them already.
    pub fn get_or_attach(
        &mut self,
        path: &Path,
        program: &'static str,
        points: &[Point],
        attach: impl FnOnce() -> anyhow::Result<Attachment>,
    ) -> anyhow::Result<Arc<Attachment>> {
        let file = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
        let key = Key { device: file.dev(), inode: file.ino(), program, points: points.to_vec() };
        if let Some(links) = self.links.get(&key) {
            return Ok(links.clone());
        }
        let links = Arc::new(attach()?);
        tracing::debug!(path = %path.display(), program, probes = points.len(), "shared links attached");
        self.links.insert(key, links.clone());
        Ok(links)
    }

    /// Takes out the links no traced process uses any more, to be detached.
    pub fn take_unused(&mut self) -> Vec<Attachment> {
        let unused: Vec<Key> =
            self.links.iter().filter(|(_, links)| Arc::strong_count(links) == 1).map(|(key, _)| key.clone()).collect();
        unused.iter().filter_map(|key| Arc::into_inner(self.links.remove(key)?)).collect()
    }
}
