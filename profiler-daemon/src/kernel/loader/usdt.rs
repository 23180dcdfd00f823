//! `--usdt`: a process's `otel_memory` probe sites (see `process::usdt`) attached in place of its
//! allocator's probes. Perf-event uprobes on every kernel, made by memprof (see
//! `perf_event::uprobe`): a process has a few sites, their programs are loaded only when a
//! process is traced this way, and the kernel sets a probe's semaphore while it is attached.

use std::{
    collections::HashSet,
    num::NonZeroU32,
    os::fd::{AsFd as _, BorrowedFd},
    path::PathBuf,
};

use anyhow::Context as _;
use aya::{maps::Array, programs::UProbe};
use profiler_common::usdt::{ProbeSpec, MAX_SPECS};

use super::Loaded;
use crate::{
    kernel::{perf_event, probes::Attachment},
    process::usdt::{Probe, Site},
};

const ALLOC_PROGRAM: &str = "usdt_alloc";
const FREE_PROGRAM: &str = "usdt_free";

/// The processes traced through their probes, and the argument specs given to the programs.
#[derive(Debug, Default)]
pub struct UsdtProbes {
    pids: HashSet<u32>,
    /// `USDT_SPECS`'s entries in use, by index (a probe's cookie).
    specs: Vec<ProbeSpec>,
}

impl UsdtProbes {
    /// Whether `pid` is traced through its `otel_memory` probes.
    pub fn traces(&self, pid: u32) -> bool {
        self.pids.contains(&pid)
    }

    pub fn forget(&mut self, pid: u32) {
        self.pids.remove(&pid);
    }
}

impl Loaded {
    /// Attaches `sites`, `pid`'s `otel_memory` probes, and no allocator probe: `pid` is recorded
    /// only as its allocator reports. Free sites first, as for allocator probes (see
    /// `probe_allocator`). `before_exec`: the files `run`'s command will map, not exec'd yet (see
    /// `attach_before_exec`).
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
        self.usdt.pids.insert(pid.get());
        let mut attachment = Attachment::default();
        let ordered =
            sites.iter().filter(|s| s.probe == Probe::Free).chain(sites.iter().filter(|s| s.probe == Probe::Alloc));
        for site in ordered {
            let name = if site.probe == Probe::Alloc { ALLOC_PROGRAM } else { FREE_PROGRAM };
            let attached = self.spec_index(&site.spec).and_then(|cookie| {
                let program = load_once(&mut self.ebpf, name)?;
                let probe =
                    perf_event::uprobe(program, &site.path, site.offset, site.semaphore, cookie, pid.get(), false)
                        .with_context(|| format!("attaching {name} to {}", site.path.display()))?;
                attachment.add_usdt(probe);
                Ok(())
            });
            if let Err(err) = attached {
                self.take_back(attachment, pid);
                return Err(err);
            }
        }
        self.attach_dl_hook(&mut attachment, pid);
        Ok(attachment)
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

/// Loads program `name` for perf-event uprobes, unless it is loaded.
fn load_once<'a>(ebpf: &'a mut aya::Ebpf, name: &str) -> anyhow::Result<BorrowedFd<'a>> {
    let program: &mut UProbe = ebpf
        .program_mut(name)
        .with_context(|| format!("program {name} missing from the eBPF object"))?
        .try_into()
        .with_context(|| format!("program {name} is not a uprobe"))?;
    if program.fd().is_err() {
        program.load().with_context(|| format!("loading program {name}"))?;
    }
    Ok(program.fd()?.as_fd())
}
