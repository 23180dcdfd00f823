//! The page-fault events `--growth` traces a process by: a software event counting page faults
//! on each of its threads, with the `page_fault` program run at every one. Events opened on a
//! task are inherited by the threads it starts (not by the processes it forks: memprof follows
//! those itself, with events of their own), and go when their descriptors close. The page-fault
//! tracepoints run `fault_code` at every fault on the machine while a process is traced by its
//! pages: it keeps the fault's error code, by which `page_fault` drops the faults on pages
//! already present before their walk.

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
/// The program that keeps each fault's error code, and the tracepoints it runs at: faults in
/// user code, and faults in the kernel on a process's memory.
const CODE_PROGRAM: &str = "fault_code";
const CODE_TRACEPOINTS: [&str; 2] = ["page_fault_user", "page_fault_kernel"];

/// `PERF_TYPE_SOFTWARE`, `PERF_COUNT_SW_PAGE_FAULTS`.
const PERF_TYPE_SOFTWARE: u32 = 1;
const PERF_COUNT_SW_PAGE_FAULTS: u64 = 2;
/// `perf_event_attr`'s flag bits: `inherit`, and `inherit_thread` (Linux 5.13): inherited by
/// threads only.
const INHERIT: u64 = 1 << 1;
const INHERIT_THREAD: u64 = 1 << 35;
/// `PERF_EVENT_IOC_SET_BPF`: `_IOW('$', 8, __u32)`.
const PERF_EVENT_IOC_SET_BPF: libc::c_ulong = 0x4004_2408;

/// Loads the page-fault program and the error codes' (once, before the first `open`), for as
/// long as `ebpf` lives.
pub fn load(ebpf: &mut Ebpf) -> anyhow::Result<()> {
    codes(ebpf)?.load().with_context(|| format!("loading program {CODE_PROGRAM}"))?;
    program(ebpf)?.load().context("loading the page-fault program")
}

/// Attaches the error codes' program, which runs at every fault on the machine: only while a
/// process is traced by its pages (see `detach_codes`).
pub fn attach_codes(ebpf: &mut Ebpf) -> anyhow::Result<Vec<RawTracePointLinkId>> {
    let codes = codes(ebpf)?;
    let mut links = Vec::new();
    for tracepoint in CODE_TRACEPOINTS {
        let link = codes.attach(tracepoint);
        match link.with_context(|| format!("attaching {CODE_PROGRAM} to the {tracepoint} tracepoint")) {
            Ok(link) => links.push(link),
            Err(err) => {
                detach_codes(ebpf, links);
                return Err(err);
            }
        }
    }
    Ok(links)
}

/// Takes the error codes' program off the machine's faults.
pub fn detach_codes(ebpf: &mut Ebpf, links: Vec<RawTracePointLinkId>) {
    let Ok(codes) = codes(ebpf) else { return };
    for link in links {
        if let Err(err) = codes.detach(link) {
            tracing::warn!("detaching {CODE_PROGRAM}: {err}");
        }
    }
}

fn codes(ebpf: &mut Ebpf) -> anyhow::Result<&mut RawTracePoint> {
    let program = ebpf
        .program_mut(CODE_PROGRAM)
        .with_context(|| format!("program {CODE_PROGRAM} missing from the eBPF object"))?;
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
        config: PERF_COUNT_SW_PAGE_FAULTS,
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
