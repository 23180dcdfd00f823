//! Who owns the other end of a TCP connection made on this host, as the kernel's socket table
//! says: one `SOCK_DIAG_BY_FAMILY` request over `NETLINK_SOCK_DIAG` for the exact 4-tuple of the
//! peer's socket, which the kernel answers from its hash of connections (O(1), where reading
//! /proc/net/tcp costs one line per socket on the host). The owner is the user that made the
//! socket (its `idiag_uid`); nothing the peer sends can change it.

use std::{
    io, mem,
    net::{IpAddr, SocketAddr},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

/// `linux/sock_diag.h`: the request and answer type of a socket's description.
const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// `linux/inet_diag.h`: a cookie the kernel does not check.
const NO_COOKIE: u32 = !0;
const HEADER: usize = mem::size_of::<libc::nlmsghdr>();
/// `struct inet_diag_req_v2` and `struct inet_diag_msg`.
const REQUEST: usize = 56;
const ANSWER: usize = 72;
/// Where `struct inet_diag_sockid` starts in `struct inet_diag_msg`, and its ports' and
/// addresses' bytes.
const SOCKID_IN_ANSWER: usize = 4;
const ADDRESSES: usize = 4 + 2 * 16;
/// `linux/netdevice.h`: loopback's interface index, in every network namespace.
const LOOPBACK_IFINDEX: u32 = 1;
/// In `struct inet_diag_msg`.
const UID: usize = 64;
const INODE: usize = 68;

#[derive(Debug, thiserror::Error)]
pub enum OwnerError {
    #[error("a connection between an IPv4 and an IPv6 address: {0} and {1}")]
    MixedFamilies(IpAddr, IpAddr),
    #[error("opening a NETLINK_SOCK_DIAG socket: {0}")]
    Socket(io::Error),
    #[error("asking the kernel: {0}")]
    Send(io::Error),
    #[error("reading the kernel's answer: {0}")]
    Receive(io::Error),
    #[error("the kernel knows no such socket")]
    NotFound,
    #[error("the kernel refused the request: {0}")]
    Refused(io::Error),
    #[error("the kernel's answer is cut short or of an unknown kind")]
    Malformed,
    #[error("the kernel found another socket, from {0} to {1}")]
    OtherSocket(SocketAddr, SocketAddr),
    /// A socket no process holds: closed by its owner (in `TIME_WAIT` its description says uid 0,
    /// whoever made it).
    #[error("no process holds the socket any more")]
    Orphaned,
}

/// The uid that made the socket at `peer` connected to `local`, where `local` is this end of a
/// connection accepted here: that socket's own address is `peer`, and its destination `local`.
/// Fails when no such socket is in this network namespace's table (a peer on another host), or
/// when no process holds it any more.
pub fn owner(peer: SocketAddr, local: SocketAddr) -> Result<u32, OwnerError> {
    let (peer, local) = (canonical(peer), canonical(local));
    let family = match (peer.ip(), local.ip()) {
        (IpAddr::V4(_), IpAddr::V4(_)) => libc::AF_INET,
        (IpAddr::V6(_), IpAddr::V6(_)) => libc::AF_INET6,
        (peer, local) => return Err(OwnerError::MixedFamilies(peer, local)),
    };
    let answer = ask(&request(family as u8, peer, local))?;
    read_answer(&answer, peer, local)
}

/// An IPv4-mapped IPv6 address (a dual-stack listener's view of an IPv4 client) as IPv4: the
/// kernel keeps such connections in its IPv4 table.
fn canonical(address: SocketAddr) -> SocketAddr {
    SocketAddr::new(address.ip().to_canonical(), address.port())
}

/// `struct inet_diag_sockid`'s ports and addresses: an IPv4 address in the first 4 of 16 bytes.
fn sockid(source: SocketAddr, destination: SocketAddr) -> [u8; ADDRESSES] {
    let wide = |ip: IpAddr| match ip {
        IpAddr::V4(ip) => {
            let mut wide = [0; 16];
            wide[..4].copy_from_slice(&ip.octets());
            wide
        }
        IpAddr::V6(ip) => ip.octets(),
    };
    let mut id = [0; ADDRESSES];
    id[..2].copy_from_slice(&source.port().to_be_bytes());
    id[2..4].copy_from_slice(&destination.port().to_be_bytes());
    id[4..20].copy_from_slice(&wide(source.ip()));
    id[20..].copy_from_slice(&wide(destination.ip()));
    id
}

/// A `SOCK_DIAG_BY_FAMILY` request for the TCP socket from `source` to `destination`, in any
/// state, bound to no device or to loopback.
fn request(family: u8, source: SocketAddr, destination: SocketAddr) -> Vec<u8> {
    let mut request = Vec::with_capacity(HEADER + REQUEST);
    request.extend_from_slice(&((HEADER + REQUEST) as u32).to_ne_bytes());
    request.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    // Not a dump: the one socket of the exact tuple.
    request.extend_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
    request.extend_from_slice(&1u32.to_ne_bytes());
    request.extend_from_slice(&0u32.to_ne_bytes());
    request.extend_from_slice(&[family, libc::IPPROTO_TCP as u8, 0, 0]);
    request.extend_from_slice(&(!0u32).to_ne_bytes());
    request.extend_from_slice(&sockid(source, destination));
    // The kernel matches a socket bound to this device, or to none: with 0, a peer that bound
    // its socket to `lo` (which Linux 5.7 and later let any user do) would not be found.
    request.extend_from_slice(&LOOPBACK_IFINDEX.to_ne_bytes());
    request.extend_from_slice(&NO_COOKIE.to_ne_bytes());
    request.extend_from_slice(&NO_COOKIE.to_ne_bytes());
    debug_assert_eq!(request.len(), HEADER + REQUEST);
    request
}

/// Sends `request` to the kernel and returns its answer, on a socket of its own: no answer to
/// another request can be read in its place.
fn ask(request: &[u8]) -> Result<Vec<u8>, OwnerError> {
    // SAFETY: socket takes no pointers; the descriptor it returns is owned below.
    let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, libc::NETLINK_SOCK_DIAG) };
    if fd < 0 {
        return Err(OwnerError::Socket(io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just opened here and nothing else owns it.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: all-zero bytes are a valid sockaddr_nl; pid 0 is the kernel.
    let mut kernel: libc::sockaddr_nl = unsafe { mem::zeroed() };
    kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: `request` is valid for its length, and `kernel` is a sockaddr_nl of the size given.
    let sent = unsafe {
        libc::sendto(
            socket.as_raw_fd(),
            request.as_ptr().cast(),
            request.len(),
            0,
            (&raw const kernel).cast(),
            mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if sent < 0 {
        return Err(OwnerError::Send(io::Error::last_os_error()));
    }
    // The kernel answers an exact request within sendto (sock_diag's handler queues its answer on
    // this socket before returning): the answer is there, and this never waits on the async
    // thread. Room for the description and the attributes the kernel adds to it.
    let mut answer = vec![0u8; 8192];
    // SAFETY: `answer` is valid for writes of its length.
    let read = unsafe { libc::recv(socket.as_raw_fd(), answer.as_mut_ptr().cast(), answer.len(), libc::MSG_DONTWAIT) };
    if read < 0 {
        return Err(OwnerError::Receive(io::Error::last_os_error()));
    }
    answer.truncate(read as usize);
    Ok(answer)
}

/// The owner's uid in the kernel's `answer` to a request for the socket from `source` to
/// `destination`.
fn read_answer(answer: &[u8], source: SocketAddr, destination: SocketAddr) -> Result<u32, OwnerError> {
    let u32_at = |at: usize| answer.get(at..at + 4).map(|b| u32::from_ne_bytes(b.try_into().expect("4 bytes")));
    let kind = answer.get(4..6).map(|b| u16::from_ne_bytes(b.try_into().expect("2 bytes")));
    match kind {
        Some(kind) if kind == libc::NLMSG_ERROR as u16 => {
            let error = u32_at(HEADER).ok_or(OwnerError::Malformed)? as i32;
            match -error {
                libc::ENOENT => Err(OwnerError::NotFound),
                errno => Err(OwnerError::Refused(io::Error::from_raw_os_error(errno))),
            }
        }
        Some(SOCK_DIAG_BY_FAMILY) if answer.len() >= HEADER + ANSWER => {
            let message = &answer[HEADER..HEADER + ANSWER];
            // The socket found may be of the other family (an IPv6 socket connected to an
            // IPv4-mapped address is kept in the IPv4 table), and, where no connection has this
            // tuple, a listener on the peer's port: then its tuple is not the one asked for.
            let (found_source, found_destination) =
                endpoints(message[0], &message[SOCKID_IN_ANSWER..SOCKID_IN_ANSWER + ADDRESSES])
                    .ok_or(OwnerError::Malformed)?;
            if (found_source, found_destination) != (source, destination) {
                return Err(OwnerError::OtherSocket(found_source, found_destination));
            }
            if u32_at(HEADER + INODE) == Some(0) {
                return Err(OwnerError::Orphaned);
            }
            u32_at(HEADER + UID).ok_or(OwnerError::Malformed)
        }
        _ => Err(OwnerError::Malformed),
    }
}

/// The source and destination of a socket of `family` in `struct inet_diag_sockid`'s bytes `id`,
/// IPv4-mapped addresses as IPv4.
fn endpoints(family: u8, id: &[u8]) -> Option<(SocketAddr, SocketAddr)> {
    let port = |at: usize| u16::from_be_bytes([id[at], id[at + 1]]);
    let ip = |at: usize| -> Option<IpAddr> {
        match i32::from(family) {
            libc::AF_INET => Some(IpAddr::from(<[u8; 4]>::try_from(&id[at..at + 4]).ok()?)),
            libc::AF_INET6 => Some(IpAddr::from(<[u8; 16]>::try_from(&id[at..at + 16]).ok()?).to_canonical()),
            _ => None,
        }
    };
    Some((SocketAddr::new(ip(4)?, port(0)), SocketAddr::new(ip(20)?, port(2))))
}

#[cfg(test)]
mod tests {
    use std::net::{TcpListener, TcpStream};

    use super::*;

    /// The accepted end's peer and local addresses of `client`'s connection to `listener`.
    fn accept(listener: &TcpListener) -> (SocketAddr, SocketAddr) {
        let (server, peer) = listener.accept().unwrap();
        (peer, server.local_addr().unwrap())
    }

    fn euid() -> u32 {
        // SAFETY: geteuid has no arguments and cannot fail.
        unsafe { libc::geteuid() }
    }

    #[test]
    fn the_owner_of_a_loopback_connection_is_this_process_user() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let _client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (peer, local) = accept(&listener);
        assert_eq!(owner(peer, local).unwrap(), euid());
    }

    #[test]
    fn ipv6_and_ipv4_mapped_loopback_connections_are_found_too() {
        let listener = TcpListener::bind("[::1]:0").unwrap();
        let _client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (peer, local) = accept(&listener);
        assert_eq!(owner(peer, local).unwrap(), euid());
        // A dual-stack listener sees an IPv4 client at an IPv4-mapped address.
        let listener = TcpListener::bind("[::]:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let _client = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (peer, local) = accept(&listener);
        assert!(matches!(peer.ip(), IpAddr::V6(ip) if ip.to_ipv4_mapped().is_some()), "{peer}");
        assert_eq!(owner(peer, local).unwrap(), euid());
        // An IPv6 client of an IPv4 listener, through an IPv4-mapped address.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let _client = TcpStream::connect(format!("[::ffff:127.0.0.1]:{port}")).unwrap();
        let (peer, local) = accept(&listener);
        assert_eq!(owner(peer, local).unwrap(), euid());
    }

    #[test]
    fn a_client_bound_to_the_loopback_device_is_found() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        // SAFETY: a socket made here, owned by the TcpStream below.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        assert!(fd >= 0, "{}", io::Error::last_os_error());
        // SAFETY: `fd` is open and owned by nothing else yet.
        let _client = unsafe { TcpStream::from_raw_fd(fd) };
        let device = b"lo\0";
        // SAFETY: `device` is a NUL-terminated interface name of the length given.
        let bound = unsafe {
            libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_BINDTODEVICE, device.as_ptr().cast(), device.len() as u32)
        };
        assert_eq!(bound, 0, "{}", io::Error::last_os_error());
        let to = match listener.local_addr().unwrap() {
            SocketAddr::V4(to) => to,
            SocketAddr::V6(_) => unreachable!("bound to IPv4"),
        };
        let address = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: to.port().to_be(),
            sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(to.ip().octets()) },
            sin_zero: [0; 8],
        };
        // SAFETY: `address` is a sockaddr_in of the size given.
        let connected = unsafe {
            libc::connect(fd, (&raw const address).cast(), mem::size_of::<libc::sockaddr_in>() as libc::socklen_t)
        };
        assert_eq!(connected, 0, "{}", io::Error::last_os_error());
        let (peer, local) = accept(&listener);
        assert_eq!(owner(peer, local).unwrap(), euid());
    }

    #[test]
    fn a_closed_or_unknown_peer_has_no_owner() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (peer, local) = accept(&listener);
        drop(client);
        // Closed first, its socket waits in TIME_WAIT or FIN_WAIT2, held by no process.
        let closed = owner(peer, local);
        assert!(matches!(closed, Err(OwnerError::Orphaned | OwnerError::NotFound)), "{closed:?}");
        let unknown = owner("127.0.0.1:1".parse().unwrap(), local);
        assert!(matches!(unknown, Err(OwnerError::NotFound)), "{unknown:?}");
    }
}
