//! The embedded eBPF object: loading it with the chosen map sizes and attaching its probes.

use std::{fs, num::NonZeroU32, path::Path};

use anyhow::Context as _;
use aya::{
    programs::{
        uprobe::{UProbeLinkId, UProbeScope},
        UProbe,
    },
    Ebpf, EbpfLoader,
};

use crate::{allocator::Allocator, cli::MapSizes, error::UserError};

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/profiler-ebpf"));

const RETURN_PROGRAM: &str = "alloc_return";
const FREE_PROGRAM: &str = "free";

/// Loaded programs and maps. Dropping it detaches every probe.
pub struct Loaded {
    pub ebpf: Ebpf,
}

/// Checks what loading needs before trying, so the error can say what is missing.
pub fn check_support() -> Result<(), UserError> {
    if !Path::new("/sys/kernel/btf/vmlinux").exists() {
        return Err(UserError::KernelSupport("BTF (/sys/kernel/btf/vmlinux)"));
    }
    if !Path::new("/sys/bus/event_source/devices/uprobe").exists() {
        return Err(UserError::KernelSupport("the uprobe perf event source"));
    }
    check_privileges()
}

fn check_privileges() -> Result<(), UserError> {
    // Capability numbers from linux/capability.h. Uprobes need CAP_SYS_ADMIN on current kernels.
    const NEEDED: [(u32, &str); 3] = [(21, "CAP_SYS_ADMIN"), (39, "CAP_BPF"), (38, "CAP_PERFMON")];
    let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
    let effective = status
        .lines()
        .find_map(|line| line.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .unwrap_or(0);
    let missing: Vec<&str> =
        NEEDED.iter().filter(|(bit, _)| effective & (1 << bit) == 0).map(|(_, name)| *name).collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(UserError::Privileges { missing: missing.join(", ") })
    }
}

pub fn load(sizes: MapSizes) -> anyhow::Result<Loaded> {
    let ebpf = EbpfLoader::new()
        .map_max_entries("LIVE", sizes.max_live)
        .map_max_entries("STACKS", sizes.max_stacks)
        .map_max_entries("FREE_STACKS", FREE_STACKS)
        .map_max_entries("STACK_STATS", stack_stats_capacity(sizes))
        .load(OBJECT)
        .context("loading the eBPF programs")?;
    let mut loaded = Loaded { ebpf };
    for name in program_names() {
        program(&mut loaded.ebpf, name)?.load().with_context(|| format!("loading program {name}"))?;
    }
    Ok(loaded)
}

/// Capacity of `FREE_STACKS`, where free sites' stacks are kept for double-free reports.
pub const FREE_STACKS: u32 = 16_384;

/// One totals row per (process, stack): as many as stacks, with room for stacks shared by processes.
pub fn stack_stats_capacity(sizes: MapSizes) -> u32 {
    sizes.max_stacks.saturating_mul(2)
}

fn program_names() -> impl Iterator<Item = &'static str> {
    profiler_common::AllocFn::ALL.iter().map(|func| func.symbol()).chain([RETURN_PROGRAM, FREE_PROGRAM])
}

fn program<'a>(ebpf: &'a mut Ebpf, name: &str) -> anyhow::Result<&'a mut UProbe> {
    ebpf.program_mut(name)
        .with_context(|| format!("program {name} missing from the eBPF object"))?
        .try_into()
        .with_context(|| format!("program {name} is not a uprobe"))
}

/// The probes attached for one process, to detach when it is no longer traced.
#[derive(Debug, Default)]
pub struct Attachment {
    links: Vec<(&'static str, UProbeLinkId)>,
}

impl Attachment {
    pub fn probes(&self) -> usize {
        self.links.len()
    }
}

impl Loaded {
    /// Attaches every probe to `allocator` for `pid` only.
    ///
    /// Return probes go first: an entry probe that fires before its return probe exists would
    /// leave in-flight state behind that nothing clears. On failure nothing stays attached.
    pub fn attach(&mut self, allocator: &Allocator, pid: NonZeroU32) -> anyhow::Result<Attachment> {
        let scope = UProbeScope::OneProcess(pid);
        let target = &allocator.attach_path;
        let points = allocator
            .allocs
            .iter()
            .map(|p| (RETURN_PROGRAM, p.offset))
            .chain(allocator.allocs.iter().map(|p| (p.func.symbol(), p.offset)))
            .chain([(FREE_PROGRAM, allocator.free_offset)]);
        let mut attachment = Attachment::default();
        for (name, offset) in points {
            let attached = program(&mut self.ebpf, name).and_then(|program| {
                program
                    .attach(offset, target, scope)
                    .with_context(|| format!("attaching {name} at {}+{offset:#x}", target.display()))
            });
            match attached {
                Ok(link) => attachment.links.push((name, link)),
                Err(err) => {
                    self.detach(attachment);
                    return Err(err);
                }
            }
        }
        Ok(attachment)
    }

    /// Detaches one process's probes.
    ///
    /// Slow: closing a uprobe's perf event waits for RCU grace periods under a kernel-wide mutex
    /// (`perf_trace_destroy`), about 90 ms a probe here, and closing several at once from threads
    /// is no faster (measured). Attaching is cheap; this is one reason memprof keeps to one probe
    /// per distinct address.
    ///
    /// Entry probes go first (the reverse of attaching): an entry probe left without its return
    /// probe would leave in-flight state that nothing clears.
    pub fn detach(&mut self, attachment: Attachment) {
        drop(self.take_links(attachment));
    }

    /// Detaches one process's probes on a thread of its own, for a process that has exited: the
    /// caller goes on at once instead of waiting ~90 ms a probe. Join the handle before exiting.
    pub fn detach_in_background(&mut self, attachment: Attachment) -> std::thread::JoinHandle<()> {
        let links = self.take_links(attachment);
        std::thread::spawn(move || drop(links))
    }

    /// The links of `attachment`, in the order they are to be dropped.
    fn take_links(&mut self, attachment: Attachment) -> Vec<aya::programs::uprobe::UProbeLink> {
        attachment
            .links
            .into_iter()
            .rev()
            .filter_map(|(name, link)| program(&mut self.ebpf, name).ok()?.take_link(link).ok())
            .collect()
    }
}
