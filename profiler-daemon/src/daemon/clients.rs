//! Who a client of the listener is, for its limits (`max_connections_per_client`, a password
//! check at a time), and the connections each has open. A client on this host is its user, as the
//! kernel says: on the socket by the peer's credentials, over TCP by the owner of the peer's
//! socket (`peer::tcp`), so that a local user's connections, from whichever loopback address,
//! never count against another user's share (root's, Prometheus's). Any other client is its
//! address.

use std::{
    collections::HashMap,
    fmt,
    net::{IpAddr, SocketAddr},
    sync::{Arc, Mutex},
};

use tracing::debug;

use crate::peer::{tcp, Credentials};

/// Who a client is, for limits per client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ClientId {
    /// Another host, or a connection from this host whose socket's owner the kernel could not
    /// tell (its socket closed already).
    Address(IpAddr),
    /// A user of this host: on the socket, or over TCP.
    User(u32),
}

impl ClientId {
    /// The client at `peer` of a TCP connection accepted at `local`: the user who made its
    /// socket when that socket is on this host, else its address.
    pub fn over_tcp(peer: SocketAddr, local: Option<SocketAddr>) -> Self {
        let address = ClientId::Address(peer.ip().to_canonical());
        let Some(local) = local else { return address };
        // Asked for every client: a local user may connect from any address of the host, not
        // only loopback; for another host's, the kernel finds no socket.
        match tcp::owner(peer, local) {
            Ok(uid) => ClientId::User(uid),
            Err(err) => {
                if peer.ip().to_canonical().is_loopback() {
                    debug!("http: the user of the loopback client {peer} is unknown ({err}); limited by its address");
                }
                address
            }
        }
    }
}

impl fmt::Display for ClientId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientId::Address(ip) => write!(f, "client address {ip}"),
            ClientId::User(uid) => write!(f, "local user {uid}"),
        }
    }
}

/// Where a request came from (`guard`).
#[derive(Debug, Clone)]
pub struct Client {
    pub id: ClientId,
    /// Over the Unix socket: who connected, as the kernel says. Never set over TCP: a local
    /// user's TCP connection is limited as that user's, not trusted as the socket trusts it.
    pub local: Option<Credentials>,
}

/// Connections open per client.
#[derive(Clone)]
pub struct Clients {
    open: Arc<Mutex<HashMap<ClientId, usize>>>,
    limit: usize,
}

impl Clients {
    pub fn new(limit: usize) -> Self {
        Self { open: Arc::default(), limit }
    }

    /// One more connection of `client`, unless it has `limit` open.
    pub fn take(&self, client: ClientId) -> Option<Share> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let count = open.entry(client).or_default();
        if *count >= self.limit {
            return None;
        }
        *count += 1;
        Some(Share { clients: self.clone(), client })
    }
}

/// A client's connection, counted until dropped.
pub struct Share {
    clients: Clients,
    client: ClientId,
}

impl Drop for Share {
    fn drop(&mut self) {
        let mut open = self.clients.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = open.get_mut(&self.client) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.client);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{
        net::{TcpListener, TcpStream},
        os::fd::FromRawFd as _,
    };

    use super::*;

    #[test]
    fn loopback_clients_are_their_user_from_any_loopback_address() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        // SAFETY: geteuid has no arguments and cannot fail.
        let uid = unsafe { libc::geteuid() };
        for from in [[127, 0, 0, 1], [127, 0, 0, 2], [127, 9, 9, 9]] {
            let _client = connect_from(from, port);
            let (server, peer) = listener.accept().unwrap();
            assert_eq!(peer.ip(), IpAddr::from(from));
            assert_eq!(ClientId::over_tcp(peer, server.local_addr().ok()), ClientId::User(uid), "from {peer}");
        }
    }

    /// A connection to 127.0.0.1:`port` from the address `from`.
    fn connect_from(from: [u8; 4], port: u16) -> TcpStream {
        let sockaddr = |ip: [u8; 4], port: u16| libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(ip) },
            sin_zero: [0; 8],
        };
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        let (local, remote) = (sockaddr(from, 0), sockaddr([127, 0, 0, 1], port));
        // SAFETY: a socket made here and owned by the TcpStream; sockaddr_ins of the length given.
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            assert!(fd >= 0, "{}", std::io::Error::last_os_error());
            let stream = TcpStream::from_raw_fd(fd);
            assert_eq!(libc::bind(fd, (&raw const local).cast(), len), 0, "{}", std::io::Error::last_os_error());
            assert_eq!(libc::connect(fd, (&raw const remote).cast(), len), 0, "{}", std::io::Error::last_os_error());
            stream
        }
    }

    #[test]
    fn a_client_whose_socket_is_not_on_this_host_is_its_address() {
        let peer: SocketAddr = "192.0.2.7:40000".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:9464".parse().unwrap();
        assert_eq!(ClientId::over_tcp(peer, Some(local)), ClientId::Address(peer.ip()));
        let mapped: SocketAddr = "[::ffff:192.0.2.7]:40000".parse().unwrap();
        assert_eq!(ClientId::over_tcp(mapped, None), ClientId::Address(peer.ip()));
    }

    #[test]
    fn a_client_over_its_share_is_refused_until_one_of_its_connections_ends() {
        let clients = Clients::new(2);
        let (root, nobody) = (ClientId::User(0), ClientId::User(65534));
        let first = clients.take(nobody).unwrap();
        let _second = clients.take(nobody).unwrap();
        assert!(clients.take(nobody).is_none());
        assert!(clients.take(root).is_some(), "another user's share is its own");
        drop(first);
        assert!(clients.take(nobody).is_some());
    }
}
