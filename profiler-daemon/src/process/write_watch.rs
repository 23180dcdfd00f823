//! Which pages of a process's heap it writes while memprof copies it, on kernels without
//! soft-dirty bits but with userfaultfd's asynchronous write protection (Linux 6.7+).
//!
//! In a first brief stop, one thread of the process opens a userfaultfd and registers its
//! private anonymous mappings for write protection (`inject`); then, the process running again,
//! a `PAGEMAP_SCAN` of memprof's on its pagemap write-protects their pages. A write to such a
//! page faults once and the kernel, not the file, lets it through, clearing the page's
//! protection (`UFFD_FEATURE_WP_ASYNC`): bit 57 of the page's pagemap entry tells, in the final
//! stop, whether it was written since. Closing the file in that stop (injected again)
//! unregisters the mappings and drops the protection.

use std::{fs, io, os::fd::AsRawFd as _};

use crate::process::{
    freeze::{FreezeError, Frozen},
    inject::{InjectError, Injector},
    mm_uapi::{self, PmScanArg, UffdioApi, UffdioRegister},
    pagemap::{Pagemap, PAGE},
    procfs::Region,
};

/// Bit 57 of a pagemap entry: the page is write-protected by userfaultfd
/// (Documentation/admin-guide/mm/pagemap.rst).
pub const WRITE_PROTECTED: u64 = 1 << 57;

/// `PAGEMAP_SCAN`'s categories (include/uapi/linux/fs.h): pages with memory behind them. Only
/// those are protected: a page with none reads as zeros, and once written it has memory and no
/// protection; protecting holes would fill a sparse mapping's page tables.
const PAGE_IS_PRESENT: u64 = 1 << 3;
const PAGE_IS_SWAPPED: u64 = 1 << 4;

#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error(transparent)]
    Freeze(#[from] FreezeError),
    #[error(transparent)]
    Inject(#[from] InjectError),
    #[error("{call} in pid {pid} failed: {cause}")]
    Call { pid: u32, call: &'static str, cause: io::Error },
    #[error("pid {0} has no private anonymous mapping to watch")]
    Nothing(u32),
    #[error("PAGEMAP_SCAN on pid {pid}: {cause}")]
    Scan { pid: u32, cause: io::Error },
}

/// The process's userfaultfd and the ranges registered with it, until closed: dropped unclosed
/// (an error between the stops), it stops the process again to close the file.
pub struct WriteWatch {
    pid: u32,
    uffd: i32,
    /// Sorted and apart.
    ranges: Vec<(u64, u64)>,
    closed: bool,
}

impl WriteWatch {
    /// Watches the private anonymous mappings among `regions` of `pid`: stops it to register
    /// them, then write-protects their pages while it runs.
    pub fn begin(pid: u32, regions: &[Region]) -> Result<Self, WatchError> {
        let ranges = watchable(regions);
        if ranges.is_empty() {
            return Err(WatchError::Nothing(pid));
        }
        let mut frozen = Frozen::stop(pid)?;
        let watch = Self::register(pid, &mut frozen, &ranges)?;
        drop(frozen);
        watch.protect()?;
        Ok(watch)
    }

    fn register(pid: u32, frozen: &mut Frozen, ranges: &[(u64, u64)]) -> Result<Self, WatchError> {
        let mut injector = Injector::new(pid, frozen)?;
        let flags = (libc::O_CLOEXEC | libc::O_NONBLOCK) as u64 | mm_uapi::UFFD_USER_MODE_ONLY;
        let uffd = call(pid, "userfaultfd", injector.syscall(libc::SYS_userfaultfd, [flags, 0, 0, 0, 0, 0]))? as i32;
        let mut watch = Self { pid, uffd, ranges: Vec::new(), closed: false };
        match watch.set_up(&mut injector, ranges) {
            Ok(()) => Ok(watch),
            Err(err) => {
                watch.close_with(&mut injector);
                Err(err)
            }
        }
    }

    fn set_up(&mut self, injector: &mut Injector, ranges: &[(u64, u64)]) -> Result<(), WatchError> {
        let (pid, uffd) = (self.pid, self.uffd as u64);
        let features = mm_uapi::UFFD_FEATURE_WP_ASYNC | mm_uapi::UFFD_FEATURE_WP_UNPOPULATED;
        let api = injector.put(&UffdioApi { api: mm_uapi::UFFD_API, features, ioctls: 0 })?;
        call(pid, "UFFDIO_API", injector.syscall(libc::SYS_ioctl, [uffd, mm_uapi::UFFDIO_API, api, 0, 0, 0]))?;
        for &(start, end) in ranges {
            let register =
                UffdioRegister { start, len: end - start, mode: mm_uapi::UFFDIO_REGISTER_MODE_WP, ioctls: 0 };
            let arg = injector.put(&register)?;
            let args = [uffd, mm_uapi::UFFDIO_REGISTER, arg, 0, 0, 0];
            // A mapping the kernel will not register (one another userfaultfd holds) is read
            // again whole in the stop, as if not watched.
            match call(pid, "UFFDIO_REGISTER", injector.syscall(libc::SYS_ioctl, args)) {
                Ok(_) => self.ranges.push((start, end)),
                Err(WatchError::Call { cause, .. }) => tracing::debug!(pid, start, end, %cause, "not watched"),
                Err(err) => return Err(err),
            }
        }
        if self.ranges.is_empty() {
            return Err(WatchError::Nothing(pid));
        }
        Ok(())
    }

    /// Write-protects every page with memory behind it in the registered ranges.
    fn protect(&self) -> Result<(), WatchError> {
        let pagemap = Pagemap::open(self.pid).map_err(|cause| WatchError::Scan { pid: self.pid, cause })?;
        for &(start, end) in &self.ranges {
            let mut arg = PmScanArg {
                size: std::mem::size_of::<PmScanArg>() as u64,
                flags: mm_uapi::PM_SCAN_WP_MATCHING | mm_uapi::PM_SCAN_CHECK_WPASYNC,
                start,
                end,
                category_anyof_mask: PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
                ..Default::default()
            };
            // SAFETY: PAGEMAP_SCAN reads and writes `arg`; with no output vector it writes nothing else.
            let done = unsafe { libc::ioctl(pagemap.file().as_raw_fd(), mm_uapi::PAGEMAP_SCAN as _, &mut arg) };
            if done < 0 || arg.walk_end != end {
                let cause = if done < 0 { io::Error::last_os_error() } else { io::ErrorKind::UnexpectedEof.into() };
                return Err(WatchError::Scan { pid: self.pid, cause });
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

    /// Closes the process's userfaultfd, its threads held still in `frozen`. Should no thread
    /// be fit to run the call now, the file is left open (and said so): the threads are
    /// memprof's, so it cannot stop them again to try later.
    pub fn close(mut self, frozen: &mut Frozen) {
        match Injector::new(self.pid, frozen) {
            Ok(mut injector) => self.close_with(&mut injector),
            Err(err) => {
                self.closed = true;
                tracing::warn!(pid = self.pid, fd = self.uffd, %err, "cannot close the userfaultfd memprof opened in the process");
            }
        }
    }

    /// Closes the file if it still is the process's userfaultfd: a process that ran `exec`
    /// meanwhile lost it, and its number may name another file now.
    fn close_with(&mut self, injector: &mut Injector) {
        self.closed = true;
        let link = fs::read_link(format!("/proc/{}/fd/{}", self.pid, self.uffd)).unwrap_or_default();
        if link.to_str() != Some("anon_inode:[userfaultfd]") {
            tracing::debug!(pid = self.pid, fd = self.uffd, ?link, "the userfaultfd is gone");
            return;
        }
        let closed = call(self.pid, "close", injector.syscall(libc::SYS_close, [self.uffd as u64, 0, 0, 0, 0, 0]));
        if let Err(err) = closed {
            tracing::warn!(pid = self.pid, fd = self.uffd, %err, "cannot close the userfaultfd memprof opened in the process");
        }
    }
}

impl Drop for WriteWatch {
    fn drop(&mut self) {
        if self.closed {
            return;
        }
        let closed = Frozen::stop(self.pid).map_err(WatchError::from).and_then(|mut frozen| {
            let mut injector = Injector::new(self.pid, &mut frozen)?;
            self.close_with(&mut injector);
            Ok(())
        });
        if let Err(err) = closed {
            tracing::warn!(pid = self.pid, fd = self.uffd, %err, "cannot close the userfaultfd memprof opened in the process");
        }
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
