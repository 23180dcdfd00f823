//! Perf events opened with the raw `perf_event_open` syscall: a thread's page-fault counter
//! (`--growth`, see `faults`), and uprobes, opened by memprof's helper (see `helper`): those of
//! kernels without uprobe_multi links, and those of USDT probes with the semaphore's reference
//! counter the kernel can keep (see `uprobe`).

use std::{
    ffi::{CStr, CString},
    io,
    os::{
        fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd, RawFd},
        unix::ffi::OsStrExt as _,
    },
    path::PathBuf,
};

use super::{
    helper::{self, Request},
    uprobe_multi,
};

/// `PERF_FLAG_FD_CLOEXEC`.
const FD_CLOEXEC: libc::c_ulong = 1 << 3;
/// Where the uprobe PMU takes a semaphore's file offset in `config`
/// (`PERF_UPROBE_REF_CTR_OFFSET_SHIFT` of kernel/events/core.c; its sysfs format says `config:32-63`).
const REF_CTR_OFFSET_SHIFT: u32 = 32;
/// Where the uprobe PMU takes whether the probe is at the function's return (its sysfs format
/// says `retprobe` is `config:0`).
const RETPROBE_BIT: u32 = 0;
/// The uprobe PMU's type is assigned at boot, and listed here.
const UPROBE_PMU_TYPE: &str = "/sys/bus/event_source/devices/uprobe/type";
/// `BPF_PERF_EVENT` of `enum bpf_attach_type`.
const BPF_PERF_EVENT: u32 = 41;

/// `struct perf_event_attr` up to `config2` (`PERF_ATTR_SIZE_VER1`): the kernel takes the
/// fields after it as zero.
#[repr(C)]
#[derive(Default)]
pub struct PerfEventAttr {
    pub kind: u32,
    pub size: u32,
    pub config: u64,
    pub sample_period: u64,
    pub sample_type: u64,
    pub read_format: u64,
    pub flags: u64,
    pub wakeup_events: u32,
    pub bp_type: u32,
    pub config1: u64,
    pub config2: u64,
}

/// Opens the event `attr` describes on thread `pid`, on every CPU, in the calling thread.
pub fn open(mut attr: PerfEventAttr, pid: u32) -> io::Result<OwnedFd> {
    attr.size = size_of::<PerfEventAttr>() as u32;
    // SAFETY: perf_event_open with a valid attribute struct of the size it states, whose pointers
    // (a uprobe's path) outlive the call; no group.
    let fd =
        unsafe { libc::syscall(libc::SYS_perf_event_open, &attr as *const PerfEventAttr, pid, -1, -1, FD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor the kernel just gave this process, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Opens a uprobe's event on thread `pid` in the calling thread: at file offset `offset` of the
/// file at `path`, on the uprobe PMU `kind` with `config`'s bits (see `uprobe`).
pub(super) fn open_uprobe(path: &CStr, kind: u32, config: u64, offset: u64, pid: u32) -> io::Result<OwnedFd> {
    let attr =
        PerfEventAttr { kind, config, config1: path.as_ptr() as u64, config2: offset, ..PerfEventAttr::default() };
    open(attr, pid)
}

/// A uprobe with its program: both go when this is dropped, the link first.
#[derive(Debug)]
pub struct Uprobe {
    /// None once the program is taken off (`unlink`).
    link: Option<OwnedFd>,
    event: OwnedFd,
}

impl Uprobe {
    pub fn descriptors(&self) -> Vec<RawFd> {
        self.link.iter().chain([&self.event]).map(|fd| fd.as_raw_fd()).collect()
    }

    /// Takes the program off the event at once, leaving the event, whose close is the slow part
    /// (see `probes`), for later.
    pub fn unlink(&mut self) {
        self.link = None;
    }
}

/// Where a uprobe goes, as `uprobe` opens it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UprobeSite {
    /// The file, as the kernel is to find it.
    pub path: PathBuf,
    /// The probed instruction's file offset.
    pub offset: u64,
    /// A USDT probe's semaphore, a file offset in a writable mapping of the same file: the
    /// kernel increments the 2-byte counter there in the process while the probe is on, and
    /// decrements it when the probe goes, as USDT semaphores want.
    pub semaphore: Option<u64>,
    /// At the function's return, not its entry.
    pub at_return: bool,
}

/// Attaches `program` (a kprobe-type program) at `site` for the process of thread `task`, its
/// `bpf_get_attach_cookie` being `cookie`.
///
/// The event is opened on that thread, and fires in every thread whose memory is that thread's
/// (the kernel's `__uprobe_perf_filter`): in the whole process until that thread exits, and in
/// none after, since an exited thread has no memory (see `probe_threads`). The kernel refuses an
/// event on an exited thread (`ESRCH`).
pub fn uprobe(program: BorrowedFd<'_>, site: &UprobeSite, cookie: u64, task: u32) -> io::Result<Uprobe> {
    let kind = std::fs::read_to_string(UPROBE_PMU_TYPE)?.trim().parse().map_err(io::Error::other)?;
    let path = CString::new(site.path.as_os_str().as_bytes()).map_err(|_| io::ErrorKind::InvalidInput)?;
    let ref_ctr_offset = site.semaphore.unwrap_or(0);
    if ref_ctr_offset >> (64 - REF_CTR_OFFSET_SHIFT) != 0 {
        return Err(io::Error::other(format!("the semaphore's offset {ref_ctr_offset:#x} is past 4 GiB")));
    }
    let config = ref_ctr_offset << REF_CTR_OFFSET_SHIFT | u64::from(site.at_return) << RETPROBE_BIT;
    // By the helper: a uprobe's event puts its breakpoints in as it opens.
    let request = Request::PerfUprobe { path, kind, config, offset: site.offset, pid: task };
    let event = helper::make(&request, None)?;
    let link = link_create(program, &event, cookie)?;
    Ok(Uprobe { link: Some(link), event })
}

/// The `link_create` member of `union bpf_attr` with its `perf_event` variant, as in
/// include/uapi/linux/bpf.h.
#[repr(C)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
    bpf_cookie: u64,
}

/// `BPF_LINK_CREATE` of a perf-event link: `program` runs at `event`'s hits, with `cookie`.
fn link_create(program: BorrowedFd<'_>, event: &OwnedFd, cookie: u64) -> io::Result<OwnedFd> {
    let attr = LinkCreateAttr {
        prog_fd: program.as_raw_fd() as u32,
        target_fd: event.as_raw_fd() as u32,
        attach_type: BPF_PERF_EVENT,
        flags: 0,
        bpf_cookie: cookie,
    };
    // SAFETY: `attr` is the kernel's link_create layout for a perf event (tested below), with
    // no pointers.
    unsafe { uprobe_multi::bpf_link_create(&attr) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_attrs_have_the_kernels_layout() {
        // PERF_ATTR_SIZE_VER1, and link_create's union starting at byte 16.
        assert_eq!(size_of::<PerfEventAttr>(), 72);
        assert_eq!(std::mem::offset_of!(PerfEventAttr, config2), 64);
        assert_eq!(std::mem::offset_of!(LinkCreateAttr, bpf_cookie), 16);
    }
}
