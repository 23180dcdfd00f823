//! `--usdt`: a process's `otel_memory` probe sites (see `process::usdt`) attached in place of its
//! allocator's probes, with uprobe_multi links where the allocator's probes have them, else
//! perf-event uprobes. The programs are loaded only when a process is traced this way, and the
//! kernel sets a probe's semaphore while it is attached.

use std::{
    collections::HashMap,
    num::NonZeroU32,
    os::fd::{AsFd as _, BorrowedFd},
    path::{Path, PathBuf},
};

use anyhow::Context as _;
use aya::{maps::Array, programs::UProbe};
use profiler_common::usdt::{ProbeSpec, MAX_SPECS};

use super::Loaded;
use crate::{
    kernel::{
        aggregate::Sampler,
        perf_event,
        probes::{Attachment, Method, PerfOpening},
        uprobe_multi::{self, Fires, Point},
    },
    process::allocator::Allocator,
    process::file_cache::FileId,
    process::usdt::{Probe, Site},
};

const ALLOC_PROGRAM: &str = "usdt_alloc";
const FREE_PROGRAM: &str = "usdt_free";

/// The processes traced through their probes, and the argument specs given to the programs.
#[derive(Debug, Default)]
pub struct UsdtProbes {
    pids: HashMap<u32, Sampler>,
    /// `USDT_SPECS`'s entries in use, by index (a probe's cookie).
    specs: Vec<ProbeSpec>,
}

impl UsdtProbes {
    /// What of `pid` its probes record.
    pub fn sampler_of(&self, pid: u32) -> Sampler {
        self.pids.get(&pid).copied().unwrap_or_default()
    }

    pub fn forget(&mut self, pid: u32) {
        self.pids.remove(&pid);
    }
}

impl Loaded {
    /// Attaches `sites`, `pid`'s `otel_memory` probes, and no allocator probe: `pid` is recorded
    /// only as its allocator reports. `before_exec`: the files `run`'s command will map, not
    /// exec'd yet (see `attach_before_exec`).
    pub fn attach_usdt(
        &mut self,
        sites: &[Site],
        pid: NonZeroU32,
        before_exec: Option<&[PathBuf]>,
    ) -> anyhow::Result<Attachment> {
        match before_exec {
            Some(files) => self.unwind.preload(pid.get(), files),
            None => {
                self.sync_mappings(pid.get());
            }
        }
        self.track(pid.get())?;
        self.usdt.pids.insert(pid.get(), Sampler::Only);
        let mut attachment = Attachment::default();
        if let Err(err) = self.attach_every_site(sites, pid.get(), &mut attachment) {
            self.take_back(attachment, pid);
            return Err(err);
        }
        self.attach_dl_hook(&mut attachment, pid);
        Ok(attachment)
    }

    /// Attaches `sites`, Go's runtime sampler in `pid` (see `go_program::sampler_beside_calls`),
    /// to `attachment`, beside the allocator probes attached to it already: its Go heap is
    /// recorded as the runtime samples it, the rest by its calls, and is no blind spot of
    /// `allocator` any more. On failure nothing of them stays, and its calls are traced on.
    pub fn attach_beside_calls(
        &mut self,
        sites: &[Site],
        pid: NonZeroU32,
        allocator: &mut Allocator,
        attachment: &mut Attachment,
    ) -> anyhow::Result<()> {
        let mut probes = Attachment::default();
        if let Err(err) = self.attach_every_site(sites, pid.get(), &mut probes) {
            self.detach(probes);
            return Err(err);
        }
        self.usdt.pids.insert(pid.get(), Sampler::BesideCalls);
        attachment.merge(probes);
        allocator.seen_through(sites);
        Ok(())
    }

    /// Free sites first, as for allocator probes (see `probe_allocator`).
    fn attach_every_site(&mut self, sites: &[Site], pid: u32, attachment: &mut Attachment) -> anyhow::Result<()> {
        for probe in [Probe::Free, Probe::Alloc] {
            let of_probe: Vec<&Site> = sites.iter().filter(|site| site.probe == probe).collect();
            self.attach_sites(probe, &of_probe, pid, attachment)?;
        }
        Ok(())
    }

    /// Attaches `probe`'s program at `sites`: a uprobe_multi link per file where the kernel makes
    /// them, which detaches behind one grace period; else a perf-event uprobe per site, each of
    /// which waits for its own (a daemon tracing a thousand Go programs took minutes to stop).
    fn attach_sites(
        &mut self,
        probe: Probe,
        sites: &[&Site],
        pid: u32,
        attachment: &mut Attachment,
    ) -> anyhow::Result<()> {
        let name = if probe == Probe::Alloc { ALLOC_PROGRAM } else { FREE_PROGRAM };
        let cookies = sites.iter().map(|site| self.spec_index(&site.spec)).collect::<anyhow::Result<Vec<u64>>>()?;
        let context = |path: &Path| format!("attaching {name} to {}", path.display());
        if self.method == Method::PerfEvents {
            load_once(&mut self.ebpf, name, None)?;
            let thread = self.probe_thread(pid)?;
            for (site, cookie) in sites.iter().zip(cookies) {
                let file = FileId::of(&site.path).with_context(|| context(&site.path))?;
                let at = perf_event::UprobeSite {
                    path: site.path.clone(),
                    offset: site.offset,
                    semaphore: site.semaphore,
                    at_return: false,
                };
                let opening = PerfOpening { program: name, site: at, file, cookie, thread };
                attachment.add_usdt(&mut self.ebpf, opening).with_context(|| context(&site.path))?;
            }
            return Ok(());
        }
        let program = load_once(&mut self.ebpf, name, Some(uprobe_multi::ATTACH_TYPE))?;
        let mut paths: Vec<&Path> = sites.iter().map(|site| site.path.as_path()).collect();
        paths.sort();
        paths.dedup();
        for path in paths {
            let in_file: Vec<(&Site, u64)> =
                sites.iter().zip(&cookies).filter(|(site, _)| site.path == path).map(|(s, c)| (*s, *c)).collect();
            let points: Vec<Point> =
                in_file.iter().map(|(site, cookie)| Point { offset: site.offset, cookie: *cookie }).collect();
            let semaphores: Vec<u64> = in_file.iter().map(|(site, _)| site.semaphore.unwrap_or(0)).collect();
            let semaphores = if semaphores.iter().all(|&offset| offset == 0) { Vec::new() } else { semaphores };
            // A process's own links put breakpoints in it alone: a file swapped meanwhile at
            // `path` harms no other (the shared links of allocator files are placed by
            // descriptor, `Attachment::add`).
            let id = FileId::of(path).with_context(|| context(path))?;
            let link = uprobe_multi::attach_with_semaphores(program, path, &points, &semaphores, Fires::AtEntry, pid)
                .with_context(|| context(path))?;
            attachment.add_usdt_link(link, (path, id), points.iter().map(|point| point.offset).collect());
        }
        Ok(())
    }

    /// The index of `spec` in `USDT_SPECS`, added there if new.
    fn spec_index(&mut self, spec: &ProbeSpec) -> anyhow::Result<u64> {
        if let Some(index) = self.usdt.specs.iter().position(|known| known == spec) {
            return Ok(index as u64);
        }
        let index = self.usdt.specs.len() as u32;
        anyhow::ensure!(index < MAX_SPECS, "more than {MAX_SPECS} kinds of otel_memory probe sites");
        let mut specs: Array<_, ProbeSpec> =
            Array::try_from(self.ebpf.map_mut("USDT_SPECS").context("map USDT_SPECS missing")?)?;
        specs.set(index, spec, 0)?;
        self.usdt.specs.push(*spec);
        Ok(u64::from(index))
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
