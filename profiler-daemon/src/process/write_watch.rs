//! Which pages of a process's heap it writes while memprof copies it, on kernels without
//! soft-dirty bits but with userfaultfd's asynchronous write protection (Linux 6.7+).
//!
//! A userfaultfd works on the memory of the process that opened it, whoever holds it. In a first
//! brief stop one thread of the process opens one (`inject`), memprof takes a descriptor of it
//! (`pidfd_getfd`) and the thread closes its own: the process is left with no new descriptor.
//! Then, the process running again, memprof registers its private anonymous mappings for write
//! protection and a `PAGEMAP_SCAN` on its pagemap write-protects their pages. A write to such a
//! page faults once and the kernel, not the file, lets it through, clearing the page's
//! protection (`UFFD_FEATURE_WP_ASYNC`): bit 57 of the page's pagemap entry tells, in the final
//! stop, whether it was written since. memprof's closing the file, once the process runs again,
//! unregisters the mappings and drops the protection.

use std::{
    io,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    time::Instant,
};

use crate::process::{
    freeze::{FreezeError, Frozen},
    inject::{InjectError, Injector},
    mm_uapi::{
        self, PageRegion, PmScanArg, UffdioApi, UffdioRegister, PAGE_IS_PRESENT, PAGE_IS_SWAPPED, PAGE_IS_WRITTEN,
    },
    pagemap::{Pagemap, PAGE},
    procfs::Region,
};

/// Bit 57 of a pagemap entry: the page is write-protected by userfaultfd
/// (Documentation/admin-guide/mm/pagemap.rst).
pub const WRITE_PROTECTED: u64 = 1 << 57;

/// Pages with memory behind them. Only those are protected: a page with none reads as zeros,
/// and once written it has memory and no protection; protecting holes would fill a sparse
/// mapping's page tables.
const HOLDS_DATA: u64 = PAGE_IS_PRESENT | PAGE_IS_SWAPPED;

/// Runs of pages a `PAGEMAP_SCAN` call may return: more, and the pagemap entries are read.
const REGIONS_PER_SCAN: usize = 4096;

/// Of a watched range, as the final stop finds it: the runs (offset, length) of pages written
/// since they were protected, and of pages with nothing behind them (given back since, or never
/// touched), which read as zeros.
pub struct Changes {
    pub written: Vec<(usize, usize)>,
    pub empty: Vec<(usize, usize)>,
}

#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error(transparent)]
    Freeze(#[from] FreezeError),
    #[error(transparent)]
    Inject(#[from] InjectError),
    #[error("{call} on pid {pid} failed: {cause}")]
    Call { pid: u32, call: &'static str, cause: io::Error },
    #[error("pid {0} has no private anonymous mapping to watch")]
    Nothing(u32),
    #[error("PAGEMAP_SCAN on pid {pid}: {cause}")]
    Scan { pid: u32, cause: io::Error },
}

/// A userfaultfd of the process's, held by memprof (the process keeps no descriptor of it), and
/// the ranges registered with it. Dropping it unregisters them and drops their protection,
/// which holds the process's mmap lock for a time that grows with the memory watched: it is
/// dropped once the process runs again (docs: performance.md#measurements-behind-design-choices).
pub struct WriteWatch {
    uffd: OwnedFd,
    /// Sorted and apart.
    ranges: Vec<(u64, u64)>,
    /// How long the process was held still for the file to be opened, in milliseconds.
    pub stop_ms: f64,
}

impl WriteWatch {
    /// Watches the private anonymous mappings among `regions` of `pid`: stops it for the file to
    /// be opened, then registers them and write-protects their pages while it runs.
    pub fn begin(pid: u32, regions: &[Region]) -> Result<Self, WatchError> {
        let wanted = watchable(regions);
        if wanted.is_empty() {
            return Err(WatchError::Nothing(pid));
        }
        let stopped = Instant::now();
        let uffd = {
            let mut frozen = Frozen::stop(pid)?;
            open_in(pid, &mut frozen)?
        };
        let mut watch = Self { uffd, ranges: Vec::new(), stop_ms: stopped.elapsed().as_secs_f64() * 1e3 };
        let features = mm_uapi::UFFD_FEATURE_WP_ASYNC | mm_uapi::UFFD_FEATURE_WP_UNPOPULATED;
        let mut api = UffdioApi { api: mm_uapi::UFFD_API, features, ioctls: 0 };
        watch.ioctl(pid, "UFFDIO_API", mm_uapi::UFFDIO_API, &mut api)?;
        for (start, end) in wanted {
            let mut register =
                UffdioRegister { start, len: end - start, mode: mm_uapi::UFFDIO_REGISTER_MODE_WP, ioctls: 0 };
            // A mapping the kernel will not register (one another userfaultfd holds, or gone
            // meanwhile) is read again whole in the stop, as if not watched.
            match watch.ioctl(pid, "UFFDIO_REGISTER", mm_uapi::UFFDIO_REGISTER, &mut register) {
                Ok(()) => watch.ranges.push((start, end)),
                Err(err) => tracing::debug!(pid, start, end, %err, "not watched"),
            }
        }
        if watch.ranges.is_empty() {
            return Err(WatchError::Nothing(pid));
        }
        watch.protect(pid)?;
        Ok(watch)
    }

    /// The userfaultfd's ioctl `request` with `arg`: it works on the process's memory whoever
    /// makes it.
    fn ioctl<T>(&self, pid: u32, call: &'static str, request: u64, arg: &mut T) -> Result<(), WatchError> {
        // SAFETY: `request` is the userfaultfd ioctl that reads and writes a `T`.
        if unsafe { libc::ioctl(self.uffd.as_raw_fd(), request as _, arg as *mut T) } != 0 {
            return Err(WatchError::Call { pid, call, cause: io::Error::last_os_error() });
        }
        Ok(())
    }

    /// Write-protects every page with memory behind it in the registered ranges.
    fn protect(&self, pid: u32) -> Result<(), WatchError> {
        let pagemap = Pagemap::open(pid).map_err(|cause| WatchError::Scan { pid, cause })?;
        for &(start, end) in &self.ranges {
            let mut arg = PmScanArg {
                size: std::mem::size_of::<PmScanArg>() as u64,
                flags: mm_uapi::PM_SCAN_WP_MATCHING | mm_uapi::PM_SCAN_CHECK_WPASYNC,
                start,
                end,
                category_anyof_mask: HOLDS_DATA,
                ..Default::default()
            };
            // SAFETY: PAGEMAP_SCAN reads and writes `arg`; with no output vector it writes nothing else.
            let done = unsafe { libc::ioctl(pagemap.file().as_raw_fd(), mm_uapi::PAGEMAP_SCAN as _, &mut arg) };
            if done < 0 || arg.walk_end != end {
                let cause = if done < 0 { io::Error::last_os_error() } else { io::ErrorKind::UnexpectedEof.into() };
                return Err(WatchError::Scan { pid, cause });
            }
        }
        Ok(())
    }

    /// Whether the page at `addr` was registered: then its pagemap entry's `WRITE_PROTECTED` bit
    /// says whether it was written since.
    pub fn covers(&self, addr: u64) -> bool {
        let at = self.ranges.partition_point(|&(start, _)| start <= addr);
        at > 0 && addr < self.ranges[at - 1].1
    }

    /// What changed in the pages from `start` to `end`, all registered, as two `PAGEMAP_SCAN`s
    /// say: a walk of the page tables with no pagemap entry per page to read, far faster on a
    /// large heap (docs: performance.md#measurements-behind-design-choices).
    /// `None` when they are not all registered now (unmapped and
    /// mapped again since), when the written runs are too many for one scan, or the scan fails:
    /// then the caller reads their pagemap entries.
    pub fn changes(&self, pagemap: &Pagemap, start: u64, end: u64) -> Option<Changes> {
        if !self.covers(start) || !self.covers(end - 1) || self.ranges.iter().any(|&(s, _)| start < s && s < end) {
            return None;
        }
        // A hole in the page tables counts as written (no protection), and holds nothing.
        let written = scan(pagemap, start, end, 0, PAGE_IS_WRITTEN, HOLDS_DATA)?;
        let empty = scan(pagemap, start, end, HOLDS_DATA, HOLDS_DATA, 0)?;
        Some(Changes { written, empty })
    }
}

/// The runs (offset from `start`, length) of pages from `start` to `end` whose categories,
/// those of `inverted` flipped, include all of `all` and one of `any` (if any); `None` if a
/// mapping in the range is not registered for asynchronous write protection, or the scan fails.
fn scan(pagemap: &Pagemap, start: u64, end: u64, inverted: u64, all: u64, any: u64) -> Option<Vec<(usize, usize)>> {
    let mut regions = vec![PageRegion::default(); REGIONS_PER_SCAN];
    let mut runs: Vec<(usize, usize)> = Vec::new();
    let mut from = start;
    while from < end {
        let mut arg = PmScanArg {
            size: std::mem::size_of::<PmScanArg>() as u64,
            flags: mm_uapi::PM_SCAN_CHECK_WPASYNC,
            start: from,
            end,
            vec: regions.as_mut_ptr() as u64,
            vec_len: regions.len() as u64,
            category_inverted: inverted,
            category_mask: all,
            category_anyof_mask: any,
            // Runs of pages that differ in no category asked about: a written run is one run,
            // swapped out or not.
            return_mask: all,
            ..Default::default()
        };
        // SAFETY: PAGEMAP_SCAN reads and writes `arg` and writes at most `vec_len` regions to `vec`.
        let found = unsafe { libc::ioctl(pagemap.file().as_raw_fd(), mm_uapi::PAGEMAP_SCAN as _, &mut arg) };
        if found < 0 || arg.walk_end <= from {
            return None;
        }
        // A full buffer: the pages written are many, their entries are read instead (a scan
        // resumed where it stopped is not relied on).
        if found as usize == regions.len() {
            return None;
        }
        for region in &regions[..found as usize] {
            let (offset, len) = ((region.start - start) as usize, (region.end - region.start) as usize);
            match runs.last_mut() {
                Some((at, run)) if *at + *run == offset => *run += len,
                _ => runs.push((offset, len)),
            }
        }
        from = arg.walk_end;
    }
    Some(runs)
}

/// Opens a userfaultfd in `pid` (its threads held still in `frozen`), takes a descriptor of it
/// for memprof (`pidfd_getfd`) and closes the process's.
fn open_in(pid: u32, frozen: &mut Frozen) -> Result<OwnedFd, WatchError> {
    let mut injector = Injector::new(pid, frozen)?;
    let flags = (libc::O_CLOEXEC | libc::O_NONBLOCK) as u64 | mm_uapi::UFFD_USER_MODE_ONLY;
    let fd = call(pid, "userfaultfd", injector.syscall(libc::SYS_userfaultfd, [flags, 0, 0, 0, 0, 0]))?;
    let ours = take_fd(pid, fd as i32).map_err(|cause| WatchError::Call { pid, call: "pidfd_getfd", cause });
    call(pid, "close", injector.syscall(libc::SYS_close, [fd as u64, 0, 0, 0, 0, 0]))?;
    ours
}

/// A descriptor of memprof's for the file `pid` has open as `fd`.
fn take_fd(pid: u32, fd: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open and pidfd_getfd take numbers; each returns a new descriptor or -1.
    unsafe {
        let pidfd = libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) as i32;
        if pidfd < 0 {
            return Err(io::Error::last_os_error());
        }
        let pidfd = OwnedFd::from_raw_fd(pidfd);
        let ours = libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) as i32;
        if ours < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(OwnedFd::from_raw_fd(ours))
    }
}

/// An injected call's return value, or its error.
fn call(pid: u32, call: &'static str, result: Result<i64, InjectError>) -> Result<i64, WatchError> {
    match result? {
        ret if ret < 0 => Err(WatchError::Call { pid, call, cause: io::Error::from_raw_os_error(-ret as i32) }),
        ret => Ok(ret),
    }
}

/// The private anonymous writable mappings among `regions` (the heap, `mmap`ed blocks, thread
/// stacks), neighbours joined: what userfaultfd protects. File mappings (`.data`, `.bss`) and
/// the main stack are small, and read again whole in the stop.
fn watchable(regions: &[Region]) -> Vec<(u64, u64)> {
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for region in regions.iter().filter(|r| r.writable && !r.shared && (r.path.is_empty() || r.path == "[heap]")) {
        match ranges.last_mut() {
            Some((_, end)) if *end == region.start => *end = region.end,
            _ => ranges.push((region.start, region.end)),
        }
    }
    debug_assert!(ranges.iter().all(|&(start, end)| start % PAGE == 0 && end % PAGE == 0));
    ranges
}
