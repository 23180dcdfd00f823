//! The programs that send the mapping calls' events (`profiler-ebpf/src/mapping.rs`): an
//! `fexit` program at each call's kernel function, or, where the kernel refuses those, one
//! program at the return of every system call on the machine. They run for every process on the
//! machine, so they are attached only while some process needs them (`--mappings`, or a process
//! traced by its pages) and detached in between (`rest`).

use anyhow::Context as _;
use aya::{
    programs::{fexit::FExitLinkId, raw_trace_point::RawTracePointLinkId, FExit, RawTracePoint},
    Btf, Ebpf,
};

/// (program, the kernel function it runs at the return of): one per system call, so that no
/// other system call on the machine pays for them.
const FUNCTION_PROGRAMS: [(&str, &str); 5] = [
    ("mmap_exit", "__x64_sys_mmap"),
    ("munmap_exit", "__x64_sys_munmap"),
    ("mremap_exit", "__x64_sys_mremap"),
    ("brk_exit", "__x64_sys_brk"),
    ("madvise_exit", "__x64_sys_madvise"),
];

/// Where the kernel refuses `fexit` programs: the program at the return of every system call on
/// the machine, and its tracepoint.
const TRACEPOINT_PROGRAM: (&str, &str) = ("syscall_exit_tracepoint", "sys_exit");

/// Where memprof's programs run for every process on the machine, as `/metrics` names it.
pub struct MachineWide;

impl MachineWide {
    pub const PAGE_FAULTS: &str = "page_faults";
    pub const MAPPING_CALLS: &str = "mapping_calls";
    pub const SYSTEM_CALLS: &str = "system_calls";
    pub const ALL: [&str; 3] = [Self::PAGE_FAULTS, Self::MAPPING_CALLS, Self::SYSTEM_CALLS];
}

/// The loaded programs, and their links while attached.
pub struct MappingPrograms {
    kind: Kind,
    links: Option<Links>,
}

enum Kind {
    Functions,
    /// The kernel refused the `fexit` programs, for this reason; `told`: memprof said what that
    /// costs the machine, at the tracepoint program's first attach.
    Tracepoint {
        refused: String,
        told: bool,
    },
}

enum Links {
    Functions(Vec<(&'static str, FExitLinkId)>),
    Tracepoint(RawTracePointLinkId),
}

impl MappingPrograms {
    /// Loads the programs, attached to nothing until `wake`: the `fexit` ones where the kernel
    /// takes them (tried on their functions and taken off at once: only those five calls run
    /// them meanwhile), else the tracepoint's. Nothing runs at every system call for it.
    pub fn load(ebpf: &mut Ebpf) -> anyhow::Result<Self> {
        let kind = match load_functions(ebpf).and_then(|()| attach_functions(ebpf)) {
            Ok(links) => {
                detach_functions(ebpf, links);
                Kind::Functions
            }
            Err(why) => {
                for (name, _) in FUNCTION_PROGRAMS {
                    if let Ok(program) = function_program(ebpf, name) {
                        // Not loaded, or loaded and refused its attach: either way it goes.
                        let _ = program.unload();
                    }
                }
                let (name, _) = TRACEPOINT_PROGRAM;
                tracepoint_program(ebpf)?.load().with_context(|| format!("loading program {name}"))?;
                Kind::Tracepoint { refused: format!("{why:#}"), told: false }
            }
        };
        Ok(Self { kind, links: None })
    }

    /// Attaches the programs, if they rest. The first time the tracepoint's is, says what it
    /// costs every other process.
    pub fn wake(&mut self, ebpf: &mut Ebpf) -> anyhow::Result<()> {
        if self.links.is_some() {
            return Ok(());
        }
        self.links = Some(match &mut self.kind {
            Kind::Functions => Links::Functions(attach_functions(ebpf)?),
            Kind::Tracepoint { refused, told } => {
                let link = attach_tracepoint(ebpf)?;
                if !std::mem::replace(told, true) {
                    tracing::warn!(
                        "this kernel refuses fexit programs ({refused}): memprof reads mmap, munmap, mremap, brk and \
                         madvise at the sys_exit tracepoint instead, which slows every system call on this host while \
                         a process needs them (docs: reference/limits.md#mappings)"
                    );
                }
                Links::Tracepoint(link)
            }
        });
        Ok(())
    }

    /// Detaches the programs, loaded still: no call on the machine runs them until `wake`.
    pub fn rest(&mut self, ebpf: &mut Ebpf) {
        match self.links.take() {
            Some(Links::Functions(links)) => detach_functions(ebpf, links),
            Some(Links::Tracepoint(link)) => {
                let detached = tracepoint_program(ebpf).and_then(|program| Ok(program.detach(link)?));
                if let Err(err) = detached {
                    tracing::warn!("detaching the system-call program: {err:#}");
                }
            }
            None => {}
        }
    }

    /// Where the programs run while attached: `MachineWide::MAPPING_CALLS` or
    /// `MachineWide::SYSTEM_CALLS`.
    pub fn runs_at(&self) -> Option<&'static str> {
        self.links.as_ref().map(|_| self.would_run_at())
    }

    /// Where the programs run once attached, attached or not.
    pub fn would_run_at(&self) -> &'static str {
        match self.kind {
            Kind::Functions => MachineWide::MAPPING_CALLS,
            Kind::Tracepoint { .. } => MachineWide::SYSTEM_CALLS,
        }
    }
}

fn load_functions(ebpf: &mut Ebpf) -> anyhow::Result<()> {
    let btf = Btf::from_sys_fs().context("reading the kernel's BTF")?;
    for (name, function) in FUNCTION_PROGRAMS {
        function_program(ebpf, name)?.load(function, &btf).with_context(|| format!("loading {name} at {function}"))?;
    }
    Ok(())
}

/// Attaches every `fexit` program, or none.
fn attach_functions(ebpf: &mut Ebpf) -> anyhow::Result<Vec<(&'static str, FExitLinkId)>> {
    let mut links = Vec::new();
    for (name, function) in FUNCTION_PROGRAMS {
        match function_program(ebpf, name).and_then(|program| Ok(program.attach()?)) {
            Ok(link) => links.push((name, link)),
            Err(err) => {
                detach_functions(ebpf, links);
                return Err(err.context(format!("attaching {name} to {function}")));
            }
        }
    }
    Ok(links)
}

fn detach_functions(ebpf: &mut Ebpf, links: Vec<(&'static str, FExitLinkId)>) {
    for (name, link) in links {
        if let Err(err) = function_program(ebpf, name).and_then(|program| Ok(program.detach(link)?)) {
            tracing::warn!("detaching {name}: {err:#}");
        }
    }
}

fn function_program<'a>(ebpf: &'a mut Ebpf, name: &str) -> anyhow::Result<&'a mut FExit> {
    let program = ebpf.program_mut(name).with_context(|| format!("program {name} missing from the eBPF object"))?;
    Ok(program.try_into()?)
}

fn attach_tracepoint(ebpf: &mut Ebpf) -> anyhow::Result<RawTracePointLinkId> {
    let (name, tracepoint) = TRACEPOINT_PROGRAM;
    let link = tracepoint_program(ebpf)?.attach(tracepoint);
    link.with_context(|| format!("attaching {name} to the {tracepoint} tracepoint"))
}

fn tracepoint_program(ebpf: &mut Ebpf) -> anyhow::Result<&mut RawTracePoint> {
    let (name, _) = TRACEPOINT_PROGRAM;
    let program = ebpf.program_mut(name).with_context(|| format!("program {name} missing from the eBPF object"))?;
    Ok(program.try_into()?)
}
