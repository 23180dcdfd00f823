//! The page-fault events `--growth` traces a process by: a software event counting minor page
//! faults on each of its threads, with the `page_fault` program run at every one, once the kernel
//! has handled it. Events opened on a task are inherited by the threads it starts (not by the
//! processes it forks: memprof follows those itself, with events of their own), and go when
//! their descriptors close. While a process is
//! traced by its pages, programs run at tracepoints of every process on the machine: at every
//! fault, `fault_code` keeps the fault's error code, by which `page_fault` drops the faults on
//! pages already present before their walk; at every allocation and free of pages,
//! `large_folio_alloc` and `large_folio_free` keep the transparent huge page a fault of a traced
//! thread was given, by which `page_fault` tells what the fault mapped.

use std::{
    collections::HashSet,
    io,
    os::fd::{AsFd as _, AsRawFd as _, OwnedFd},
};

use anyhow::Context as _;
use aya::{
    programs::{raw_trace_point::RawTracePointLinkId, PerfEvent, RawTracePoint},
    Ebpf,
};

use super::perf_event::{self, PerfEventAttr};
use crate::process::procfs;

const PROGRAM: &str = "page_fault";
/// The programs that run for every process on the machine, and their tracepoints: a fault's
/// error code, in user code and in the kernel on a process's memory; the large folios a traced
/// thread is given and gives back.
const MACHINE_WIDE: [(&str, &str); 4] = [
    ("fault_code", "page_fault_user"),
    ("fault_code", "page_fault_kernel"),
    ("large_folio_alloc", "mm_page_alloc"),
    ("large_folio_free", "mm_page_free"),
];

/// `PERF_TYPE_SOFTWARE`, `PERF_COUNT_SW_PAGE_FAULTS_MIN`: counted at the end of a fault that
/// mapped a page without waiting for a read (`mm_account_fault`), as every first touch of
/// anonymous memory is.
const PERF_TYPE_SOFTWARE: u32 = 1;
const PERF_COUNT_SW_PAGE_FAULTS_MIN: u64 = 5;
/// `perf_event_attr`'s flag bits: `inherit`, and `inherit_thread` (Linux 5.13): inherited by
/// threads only.
const INHERIT: u64 = 1 << 1;
const INHERIT_THREAD: u64 = 1 << 35;
/// `PERF_EVENT_IOC_SET_BPF`: `_IOW('$', 8, __u32)`.
const PERF_EVENT_IOC_SET_BPF: libc::c_ulong = 0x4004_2408;

/// The links of the programs that run for every process on the machine, by program.
pub type MachineWideLinks = Vec<(&'static str, RawTracePointLinkId)>;

/// Loads the page-fault program and the machine-wide ones (once, before the first `open`), for
/// as long as `ebpf` lives.
pub fn load(ebpf: &mut Ebpf) -> anyhow::Result<()> {
    let mut names: Vec<&str> = MACHINE_WIDE.iter().map(|(name, _)| *name).collect();
    names.dedup();
    for name in names {
        tracepoint_program(ebpf, name)?.load().with_context(|| format!("loading program {name}"))?;
    }
    program(ebpf)?.load().context("loading the page-fault program")
}

/// Attaches the programs that run for every process on the machine: only while a process is
/// traced by its pages (see `detach_machine_wide`).
pub fn attach_machine_wide(ebpf: &mut Ebpf) -> anyhow::Result<MachineWideLinks> {
    let mut links = Vec::new();
    for (name, tracepoint) in MACHINE_WIDE {
        let link = tracepoint_program(ebpf, name).and_then(|program| Ok(program.attach(tracepoint)?));
        match link.with_context(|| format!("attaching {name} to the {tracepoint} tracepoint")) {
            Ok(link) => links.push((name, link)),
            Err(err) => {
                detach_machine_wide(ebpf, links);
                return Err(err);
            }
        }
    }
    Ok(links)
}

/// Takes the machine-wide programs off the machine's tracepoints.
pub fn detach_machine_wide(ebpf: &mut Ebpf, links: MachineWideLinks) {
    for (name, link) in links {
        let detached = tracepoint_program(ebpf, name).and_then(|program| Ok(program.detach(link)?));
        if let Err(err) = detached {
            tracing::warn!("detaching {name}: {err:#}");
        }
    }
}

fn tracepoint_program<'a>(ebpf: &'a mut Ebpf, name: &str) -> anyhow::Result<&'a mut RawTracePoint> {
    let program = ebpf.program_mut(name).with_context(|| format!("program {name} missing from the eBPF object"))?;
    Ok(program.try_into()?)
}

fn program(ebpf: &mut Ebpf) -> anyhow::Result<&mut PerfEvent> {
    let program =
        ebpf.program_mut(PROGRAM).with_context(|| format!("program {PROGRAM} missing from the eBPF object"))?;
    Ok(program.try_into()?)
}

/// Opens the events of every thread of `pid`: threads started while this runs are found by a
/// second look (or inherit the event of the thread that started them).
pub fn open(ebpf: &mut Ebpf, pid: u32) -> anyhow::Result<Vec<OwnedFd>> {
    let program = program(ebpf)?.fd()?.as_fd().as_raw_fd();
    let (mut events, mut seen) = (Vec::new(), HashSet::new());
    loop {
        let threads = threads(pid).with_context(|| format!("listing the threads of pid {pid}"))?;
        let new: Vec<u32> = threads.into_iter().filter(|tid| seen.insert(*tid)).collect();
        if new.is_empty() {
            break;
        }
        for tid in new {
            match open_one(tid, program) {
                Ok(fd) => events.push(fd),
                // A thread that exited meanwhile.
                Err(err) if err.raw_os_error() == Some(libc::ESRCH) => {}
                Err(err) => return Err(err).with_context(|| format!("opening the page-fault event of thread {tid}")),
            }
        }
    }
    Ok(events)
}

fn threads(pid: u32) -> io::Result<Vec<u32>> {
    let dir = std::fs::read_dir(format!("{}/task", procfs::dir(pid)))?;
    Ok(dir.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok()).collect())
}

fn open_one(tid: u32, program: i32) -> io::Result<OwnedFd> {
    let attr = PerfEventAttr {
        kind: PERF_TYPE_SOFTWARE,
        config: PERF_COUNT_SW_PAGE_FAULTS_MIN,
        // The program runs at every fault.
        sample_period: 1,
        flags: INHERIT | INHERIT_THREAD,
        ..PerfEventAttr::default()
    };
    let fd = perf_event::open(attr, tid)?;
    // SAFETY: the ioctl takes a program descriptor by value.
    if unsafe { libc::ioctl(fd.as_raw_fd(), PERF_EVENT_IOC_SET_BPF, program) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}
