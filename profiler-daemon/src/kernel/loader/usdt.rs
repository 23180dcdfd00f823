//! `--usdt`: a process's `otel_memory` probe sites (see `process::usdt`) attached in place of its
//! allocator's probes, with uprobe_multi links where the allocator's probes have them, else
//! perf-event uprobes. The programs are loaded only when a process is traced this way, and the
//! kernel sets a probe's semaphore while it is attached.

use std::{collections::HashMap, num::NonZeroU32, path::PathBuf};

use anyhow::Context as _;
use aya::maps::Array;
use profiler_common::usdt::{ProbeSpec, MAX_SPECS};

use super::{own_probes::OwnProbe, Loaded};
use crate::{
    kernel::{aggregate::Sampler, probes::Attachment},
    process::allocator::Allocator,
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

    /// Attaches `probe`'s program at `sites` (see `attach_own`).
    fn attach_sites(
        &mut self,
        probe: Probe,
        sites: &[&Site],
        pid: u32,
        attachment: &mut Attachment,
    ) -> anyhow::Result<()> {
        let name = if probe == Probe::Alloc { ALLOC_PROGRAM } else { FREE_PROGRAM };
        let cookies = sites.iter().map(|site| self.spec_index(&site.spec)).collect::<anyhow::Result<Vec<u64>>>()?;
        let probes: Vec<OwnProbe> = sites
            .iter()
            .zip(cookies)
            .map(|(site, cookie)| OwnProbe { path: &site.path, offset: site.offset, semaphore: site.semaphore, cookie })
            .collect();
        self.attach_own(name, &probes, pid, attachment)
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
