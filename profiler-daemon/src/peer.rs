//! Who is at the other end of a Unix socket, as the kernel recorded it when the connection was
//! made (`SO_PEERCRED`, `SO_PEERGROUPS`): nothing the peer sends can change it. The daemon decides
//! with it who may read its reports; `memprof inspect` and `snapshot`, whose answer they trust.
//! `tcp`: who made the other end of a TCP connection from this host, from the kernel's table.

pub mod tcp;

use std::{io, mem, os::fd::AsRawFd};

/// The peer's user and groups when it connected (or, seen from a client, when the server listened).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    pub uid: u32,
    /// Its effective group and its supplementary groups.
    pub groups: Vec<u32>,
}

/// Groups read at most; a peer in more is judged by its first ones (and its effective group).
const MAX_GROUPS: usize = 1024;

/// The credentials of the peer of `socket`, a connected Unix stream socket.
pub fn credentials(socket: &impl AsRawFd) -> io::Result<Credentials> {
    let fd = socket.as_raw_fd();
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is a ucred and `len` its size, as SO_PEERCRED writes; the kernel checks fd.
    let done =
        unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_PEERCRED, (&raw mut cred).cast(), &raw mut len) };
    if done != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut groups = vec![0 as libc::gid_t; MAX_GROUPS];
    let mut len = mem::size_of_val(groups.as_slice()) as libc::socklen_t;
    // SAFETY: `groups` holds `len` bytes of gid_t, the array SO_PEERGROUPS writes.
    let done = unsafe {
        libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_PEERGROUPS, groups.as_mut_ptr().cast(), &raw mut len)
    };
    // ERANGE: more than MAX_GROUPS; the peer is then judged without them.
    groups.truncate(if done == 0 { len as usize / mem::size_of::<libc::gid_t>() } else { 0 });
    groups.insert(0, cred.gid);
    Ok(Credentials { uid: cred.uid, groups })
}

/// The gid of the group named `name` on this host (or `name` itself when it is a number).
pub fn group_id(name: &str) -> Option<u32> {
    if let Ok(gid) = name.parse() {
        return Some(gid);
    }
    let name = std::ffi::CString::new(name).ok()?;
    let mut buffer = vec![0 as libc::c_char; 16 * 1024];
    // SAFETY: all-zero bytes are a valid `group` (null pointers, zero ids) for getgrnam_r to fill.
    let mut group: libc::group = unsafe { mem::zeroed() };
    let mut found: *mut libc::group = std::ptr::null_mut();
    // SAFETY: every pointer is to a live local of the type getgrnam_r takes, and the buffer's
    // length is given with it.
    let failed =
        unsafe { libc::getgrnam_r(name.as_ptr(), &raw mut group, buffer.as_mut_ptr(), buffer.len(), &raw mut found) };
    (failed == 0 && !found.is_null()).then_some(group.gr_gid)
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;

    use super::*;

    #[test]
    fn a_socket_pair_sees_its_own_process() {
        let (a, _b) = UnixStream::pair().unwrap();
        let cred = credentials(&a).unwrap();
        // SAFETY: getuid and getgid cannot fail.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        assert_eq!((cred.uid, cred.groups[0]), (uid, gid));
    }

    #[test]
    fn groups_are_named_or_numbered() {
        assert_eq!(group_id("root"), Some(0));
        assert_eq!(group_id("4242"), Some(4242));
        assert_eq!(group_id("no-such-group-memprof"), None);
    }
}
