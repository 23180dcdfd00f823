//! `uprobe_multi` links (Linux 6.6+), made with the raw `bpf(BPF_LINK_CREATE)` syscall: one link
//! puts one program on many offsets of one file, for one process. Closing the link removes all of
//! its probes behind one wait for the kernel's grace periods, where perf-event uprobes wait once
//! per probe, under a kernel-wide lock.

use std::{
    ffi::{CStr, CString},
    io,
    os::{
        fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
};

use super::helper::{self, Request};

/// `BPF_TRACE_UPROBE_MULTI` of the kernel's `enum bpf_attach_type`: programs in these links must be
/// loaded with it as their expected attach type.
pub const ATTACH_TYPE: u32 = 48;
/// `BPF_TRACE_UPROBE_SESSION` (Linux 6.13+): a uprobe_multi link whose program runs at the entry
/// and at the return, where the entry's non-zero result skips the return. Linux 6.12 loads a
/// program for it but makes no such link (see `check_sessions`).
pub const SESSION_ATTACH_TYPE: u32 = 57;
/// `BPF_LINK_CREATE` of `enum bpf_cmd`.
const BPF_LINK_CREATE: libc::c_long = 28;
/// `BPF_F_UPROBE_MULTI_RETURN`: every probe of the link fires at its function's return.
const RETURN_PROBES: u32 = 1;

/// The `link_create` member of `union bpf_attr` with its `uprobe_multi` variant, field for field as
/// in include/uapi/linux/bpf.h (the `__aligned_u64` pointers fall on 8-byte offsets unpadded).
#[repr(C)]
struct LinkCreateAttr {
    prog_fd: u32,
    /// Must be 0 for uprobe_multi.
    target_fd: u32,
    attach_type: u32,
    /// `link_create.flags`; must be 0 for uprobe_multi.
    flags: u32,
    /// A NUL-terminated path.
    path: u64,
    /// `cnt` file offsets (u64 each).
    offsets: u64,
    /// `cnt` USDT semaphores' file offsets (0: none), or 0 for none at all.
    ref_ctr_offsets: u64,
    /// `cnt` cookies (u64 each), one per offset, read with `bpf_get_attach_cookie`.
    cookies: u64,
    cnt: u32,
    /// `uprobe_multi.flags`: `RETURN_PROBES` or 0.
    multi_flags: u32,
    /// The process the probes fire for; 0 for every process.
    pid: u32,
    /// The struct's tail padding: zero, as the kernel wants every byte past the fields it knows.
    _tail: u32,
}

/// One probe: where in the file, and the cookie its program reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Point {
    /// A file offset, as uprobes take them (not a virtual address).
    pub offset: u64,
    pub cookie: u64,
}

/// Where a link's program runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fires {
    AtEntry,
    AtReturn,
    /// At the entry and, unless the entry said not to, at the return (`SESSION_ATTACH_TYPE`).
    Session,
}

/// Attaches `program`, loaded with `ATTACH_TYPE` (or `SESSION_ATTACH_TYPE` for a session), at
/// `points` of the file at `path`, firing for process `pid` only (all of its threads). Closing
/// the returned link detaches every one of these probes.
/// The link is made by memprof's helper: it puts the breakpoints in as it is made (see `helper`).
pub fn attach(program: BorrowedFd<'_>, path: &Path, points: &[Point], fires: Fires, pid: u32) -> io::Result<OwnedFd> {
    attach_with_semaphores(program, path, points, &[], fires, pid)
}

/// `attach`, with USDT probes' semaphores (`semaphores[i]`, the file offset of `points[i]`'s; 0:
/// none), which the kernel increments in the process while the link holds the probe.
pub fn attach_with_semaphores(
    program: BorrowedFd<'_>,
    path: &Path,
    points: &[Point],
    semaphores: &[u64],
    fires: Fires,
    pid: u32,
) -> io::Result<OwnedFd> {
    let path = CString::new(path.as_os_str().as_bytes()).map_err(|_| io::ErrorKind::InvalidInput)?;
    let offsets = points.iter().map(|p| p.offset).collect();
    let cookies = points.iter().map(|p| p.cookie).collect();
    let (attach_type, multi_flags) = match fires {
        Fires::AtEntry => (ATTACH_TYPE, 0),
        Fires::AtReturn => (ATTACH_TYPE, RETURN_PROBES),
        Fires::Session => (SESSION_ATTACH_TYPE, 0),
    };
    let semaphores = semaphores.to_vec();
    let request = Request::UprobeMulti { path, offsets, cookies, semaphores, attach_type, multi_flags, pid };
    helper::make(&request, Some(program))
}

/// `BPF_LINK_CREATE` of a uprobe_multi link with a probe at each of `offsets`, `cookies` and
/// `semaphores` (empty: none) alongside, made by the calling thread.
#[allow(clippy::too_many_arguments)]
pub(super) fn link_create(
    program: BorrowedFd<'_>,
    path: &CStr,
    offsets: &[u64],
    cookies: &[u64],
    semaphores: &[u64],
    attach_type: u32,
    multi_flags: u32,
    pid: u32,
) -> io::Result<OwnedFd> {
    let count = u32::try_from(offsets.len()).map_err(|_| io::ErrorKind::InvalidInput)?;
    if cookies.len() != offsets.len() || !(semaphores.is_empty() || semaphores.len() == offsets.len()) {
        return Err(io::ErrorKind::InvalidInput.into());
    }
    let attr = LinkCreateAttr {
        prog_fd: program.as_raw_fd() as u32,
        target_fd: 0,
        attach_type,
        flags: 0,
        path: path.as_ptr() as u64,
        offsets: offsets.as_ptr() as u64,
        ref_ctr_offsets: if semaphores.is_empty() { 0 } else { semaphores.as_ptr() as u64 },
        cookies: cookies.as_ptr() as u64,
        cnt: count,
        multi_flags,
        pid,
        _tail: 0,
    };
    // SAFETY: `attr` is the kernel's link_create layout (tested below), and the memory its
    // pointers name outlives the call, which only reads it.
    unsafe { bpf_link_create(&attr) }
}

/// `bpf(BPF_LINK_CREATE, attr)`: the new link's descriptor.
///
/// # Safety
/// `attr` must be a valid prefix of the kernel's `union bpf_attr` for `BPF_LINK_CREATE` (each
/// kind of link has its own struct), and the memory its pointers name must outlive the call.
pub(super) unsafe fn bpf_link_create<A>(attr: &A) -> io::Result<OwnedFd> {
    // SAFETY: as the caller promises; the kernel reads `size_of::<A>()` bytes of it.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_LINK_CREATE, attr as *const A, size_of::<A>()) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: BPF_LINK_CREATE returned a new file descriptor, ours alone.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Why this kernel's uprobe_multi links cannot serve.
#[derive(Debug, thiserror::Error)]
pub enum Unsupported {
    #[error("this kernel has no uprobe_multi links (Linux 6.6+): {0}")]
    Missing(io::Error),
    #[error("this kernel's uprobe_multi links fire for one thread, not the whole process (fixed in Linux 6.10)")]
    ThreadFilter,
    #[error("this kernel makes no uprobe session links (Linux 6.13+): {0}")]
    NoSessions(io::Error),
}

/// Asks the kernel, as libbpf does, whether it makes uprobe_multi links that fire for every thread
/// of a process: two links that must fail, on `/`. Where the links exist the first fails with
/// EBADF (not a regular file); the second, with pid -1, fails with EINVAL before the path is looked
/// at only where the pid filter is by process (Linux 6.10 and the stable kernels that took the fix;
/// 6.6 to 6.9 filtered by thread and would miss every other thread's calls).
pub fn check_support(program: BorrowedFd<'_>) -> Result<(), Unsupported> {
    let root = c"/";
    let offsets = [0u64];
    let cookies = [0u64];
    match link_create(program, root, &offsets, &cookies, &[], ATTACH_TYPE, 0, 0) {
        Err(err) if err.raw_os_error() == Some(libc::EBADF) => {}
        Err(err) => return Err(Unsupported::Missing(err)),
        Ok(_link) => return Err(Unsupported::Missing(io::Error::other("a link on / was accepted"))),
    }
    match link_create(program, root, &offsets, &cookies, &[], ATTACH_TYPE, 0, u32::MAX) {
        Err(err) if err.raw_os_error() == Some(libc::EINVAL) => Ok(()),
        _ => Err(Unsupported::ThreadFilter),
    }
}

/// Asks the kernel whether it makes uprobe session links for `program`, loaded with
/// `SESSION_ATTACH_TYPE`: a session link on `/` that fails with EBADF (not a regular file) where
/// it would make one. Loading is no test: Linux 6.12 verifies such a program, then refuses the
/// link with EINVAL.
pub fn check_sessions(program: BorrowedFd<'_>) -> Result<(), Unsupported> {
    match link_create(program, c"/", &[0], &[0], &[], SESSION_ATTACH_TYPE, 0, 0) {
        Err(err) if err.raw_os_error() == Some(libc::EBADF) => Ok(()),
        Err(err) => Err(Unsupported::NoSessions(err)),
        Ok(_link) => Err(Unsupported::NoSessions(io::Error::other("a link on / was accepted"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_attr_has_the_kernels_layout() {
        // Offsets in include/uapi/linux/bpf.h: the union's variants start at byte 16.
        assert_eq!(std::mem::offset_of!(LinkCreateAttr, path), 16);
        assert_eq!(std::mem::offset_of!(LinkCreateAttr, cookies), 40);
        assert_eq!(std::mem::offset_of!(LinkCreateAttr, cnt), 48);
        assert_eq!(std::mem::offset_of!(LinkCreateAttr, pid), 56);
        assert_eq!(size_of::<LinkCreateAttr>(), 64);
    }
}
