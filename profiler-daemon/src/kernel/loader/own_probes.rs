//! Uprobes of one process's own at given sites of its files (its `otel_memory` probes, its C
//! library's mapping calls): uprobe_multi links where the allocator's probes have them, else
//! perf-event uprobes. The kernel puts their breakpoints in that process alone.

use std::{
    os::fd::{AsFd as _, BorrowedFd},
    path::Path,
};

use anyhow::Context as _;
use aya::programs::UProbe;

use super::Loaded;
use crate::{
    kernel::{
        perf_event,
        probes::{Attachment, Method, PerfOpening},
        uprobe_multi::{self, Fires, Point},
    },
    process::file_cache::FileId,
};

/// One probe site: a file offset in the file at `path`, the semaphore the kernel increments while
/// it is attached (a file offset too), and the cookie its program reads.
pub(super) struct OwnProbe<'a> {
    pub path: &'a Path,
    pub offset: u64,
    pub semaphore: Option<u64>,
    pub cookie: u64,
}

impl Loaded {
    /// Attaches program `name` at `probes`, for `pid` only: a uprobe_multi link per file where the
    /// kernel makes them, which detaches behind one grace period; else a perf-event uprobe per
    /// site, each of which waits for its own (a daemon tracing a thousand Go programs took
    /// minutes to stop).
    pub(super) fn attach_own(
        &mut self,
        name: &'static str,
        probes: &[OwnProbe],
        pid: u32,
        attachment: &mut Attachment,
    ) -> anyhow::Result<()> {
        let context = |path: &Path| format!("attaching {name} to {}", path.display());
        if self.method == Method::PerfEvents {
            load_once(&mut self.ebpf, name, None)?;
            let thread = self.probe_thread(pid)?;
            for probe in probes {
                let file = FileId::of(probe.path).with_context(|| context(probe.path))?;
                let at = perf_event::UprobeSite {
                    path: probe.path.to_path_buf(),
                    offset: probe.offset,
                    semaphore: probe.semaphore,
                    at_return: false,
                };
                let opening = PerfOpening { program: name, site: at, file, cookie: probe.cookie, thread };
                attachment.add_own(&mut self.ebpf, opening).with_context(|| context(probe.path))?;
            }
            return Ok(());
        }
        let program = load_once(&mut self.ebpf, name, Some(uprobe_multi::ATTACH_TYPE))?;
        let mut paths: Vec<&Path> = probes.iter().map(|probe| probe.path).collect();
        paths.sort();
        paths.dedup();
        for path in paths {
            let in_file: Vec<&OwnProbe> = probes.iter().filter(|probe| probe.path == path).collect();
            let points: Vec<Point> =
                in_file.iter().map(|probe| Point { offset: probe.offset, cookie: probe.cookie }).collect();
            let semaphores: Vec<u64> = in_file.iter().map(|probe| probe.semaphore.unwrap_or(0)).collect();
            let semaphores = if semaphores.iter().all(|&offset| offset == 0) { Vec::new() } else { semaphores };
            // A process's own links put breakpoints in it alone: a file swapped meanwhile at
            // `path` harms no other (the shared links of allocator files are placed by
            // descriptor, `Attachment::add`).
            let id = FileId::of(path).with_context(|| context(path))?;
            let link = uprobe_multi::attach_with_semaphores(program, path, &points, &semaphores, Fires::AtEntry, pid)
                .with_context(|| context(path))?;
            attachment.add_own_link(link, (path, id), points.iter().map(|point| point.offset).collect());
        }
        Ok(())
    }
}

/// Loads program `name`, unless it is loaded: for perf-event uprobes, or for links of
/// `attach_type`.
fn load_once<'a>(ebpf: &'a mut aya::Ebpf, name: &str, attach_type: Option<u32>) -> anyhow::Result<BorrowedFd<'a>> {
    let program: &mut UProbe = ebpf
        .program_mut(name)
        .with_context(|| format!("program {name} missing from the eBPF object"))?
        .try_into()
        .with_context(|| format!("program {name} is not a uprobe"))?;
    if program.fd().is_err() {
        match attach_type {
            Some(attach_type) => program.load_with_attach_type(attach_type),
            None => program.load(),
        }
        .with_context(|| format!("loading program {name}"))?;
    }
    Ok(program.fd()?.as_fd())
}
