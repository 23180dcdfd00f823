//! Asking the memprof daemon on this host (`snapshot`, `inspect`): on its API socket by default,
//! where root is served everything on the kernel's word (no password), or plain HTTP to a loopback
//! listener, with basic auth when the daemon's web config asks for it. Either way an answer is
//! trusted only from a daemon that root or the caller runs, or that root gave the socket's place.

use std::{
    fs,
    io::{self, Read, Write},
    net::{SocketAddr, TcpStream, ToSocketAddrs as _},
    os::unix::{fs::MetadataExt as _, net::UnixStream},
    path::Path,
    time::Duration,
};

use anyhow::{bail, Context as _};
use base64::Engine as _;

use crate::{error::UserError, format::MAX_INPUT_BYTES, peer};

/// The environment variable that holds the password for `--daemon-user` (never an argument:
/// those are visible to every user in `ps`).
pub const PASSWORD_VARIABLE: &str = "MEMPROF_DAEMON_PASSWORD";

/// A daemon to ask.
pub struct Daemon<'a> {
    /// Its socket's path, or `http://HOST:PORT`.
    pub url: &'a str,
    /// User and password for basic auth.
    pub login: Option<(String, String)>,
    /// How long an answer may take.
    pub wait: Duration,
}

/// What the daemon said.
pub enum Reply {
    Answer {
        status: u16,
        body: Vec<u8>,
    },
    /// No daemon answers at the URL: why.
    NoDaemon(String),
    /// The daemon took the request and closed the connection without an answer (it stopped, or
    /// died): why.
    Lost(String),
}

impl<'a> Daemon<'a> {
    /// The daemon at `url`, logged in as `user` (the password from `PASSWORD_VARIABLE`) if given.
    pub fn new(url: &'a str, user: Option<&str>, wait: Duration) -> anyhow::Result<Self> {
        let login = match user {
            Some(user) => match std::env::var(PASSWORD_VARIABLE) {
                Ok(password) => Some((user.to_string(), password)),
                Err(_) => {
                    bail!("--daemon-user {user} needs the password in the environment variable {PASSWORD_VARIABLE}")
                }
            },
            None => None,
        };
        Ok(Self { url, login, wait })
    }

    /// `GET path` (with its query).
    pub fn get(&self, path: &str) -> anyhow::Result<Reply> {
        let url = self.url;
        if url.starts_with('/') {
            return self.get_local(Path::new(url), path);
        }
        let Some(authority) = url.strip_prefix("http://").map(|rest| rest.trim_end_matches('/')) else {
            return Err(UserError::Flags(format!(
                "--daemon {url} is neither a socket's path nor an http:// URL; give {} or http://HOST:PORT",
                crate::cli::DAEMON_SOCKET
            ))
            .into());
        };
        let Some((host, port)) = authority.rsplit_once(':').filter(|(_, port)| port.parse::<u16>().is_ok()) else {
            return Err(UserError::Flags(format!("--daemon {url} names no port; give it as http://HOST:PORT")).into());
        };
        // A name that does not resolve is said as such: the URL's form is right.
        let address = authority.to_socket_addrs().ok().and_then(|mut addresses| addresses.next()).ok_or_else(|| {
            UserError::Flags(format!(
                "--daemon {url}: the host name {host} does not resolve; give the daemon's address on this host, such as http://127.0.0.1:{port}"
            ))
        })?;
        if !address.ip().is_loopback() {
            return Err(UserError::Flags(format!(
                "--daemon {url} is not on this host, and memprof trusts only a daemon it can check is root's; \
                 fetch a remote daemon's answers with curl over https instead"
            ))
            .into());
        }
        // Anyone may listen on an unprivileged port: the answer is trusted only from root's or our
        // own, and the password is sent to no one else.
        match listener_owner(address) {
            Some(uid) if uid == 0 || uid == effective_uid() => {}
            Some(uid) => bail!(
                "the listener at {url} belongs to uid {uid}, not root or you: refusing its answer (is the memprof daemon running, on that port?)"
            ),
            None => return Ok(Reply::NoDaemon(format!("no memprof daemon answers at {url} (nothing listens there)"))),
        }
        let stream = match TcpStream::connect_timeout(&address, Duration::from_secs(5)) {
            Ok(stream) => stream,
            Err(err) => return Ok(Reply::NoDaemon(format!("no memprof daemon answers at {url} ({err})"))),
        };
        stream.set_read_timeout(Some(self.wait))?;
        self.exchange(stream, authority, path)
    }

    /// `GET path` on the socket at `socket`.
    fn get_local(&self, socket: &Path, path: &str) -> anyhow::Result<Reply> {
        let url = self.url;
        let stream = match UnixStream::connect(socket) {
            Ok(stream) => stream,
            Err(err) => return Ok(Reply::NoDaemon(format!("no memprof daemon answers on {url} ({err})"))),
        };
        let owner = peer::credentials(&stream).with_context(|| format!("cannot tell who serves {url}"))?.uid;
        // Anyone may make a socket where they may write: the answer is trusted (and the password
        // sent) only from root, us, or a user whose socket only root or that user could put there.
        if owner != 0 && owner != effective_uid() && !placed_by(socket, owner) {
            bail!(
                "the socket {url} belongs to uid {owner}, not root or you, in a directory others may write to: refusing its answer"
            );
        }
        stream.set_read_timeout(Some(self.wait))?;
        self.exchange(stream, "localhost", path)
    }

    /// The request and its answer on a connected `stream`.
    fn exchange(&self, stream: impl Read + Write, host: &str, path: &str) -> anyhow::Result<Reply> {
        let url = self.url;
        match self.request(stream, host, path) {
            Ok((status, body)) => Ok(Reply::Answer { status, body }),
            Err(err) if err.kind() == io::ErrorKind::FileTooLarge => bail!("the daemon at {url}: {err}"),
            Err(err) if matches!(err.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                bail!("the daemon at {url} did not answer within {} s; ask again later", self.wait.as_secs())
            }
            Err(err) => Ok(Reply::Lost(format!(
                "the daemon at {url} closed the connection before answering ({err}): it stopped or died; see its log"
            ))),
        }
    }

    /// `GET path` over HTTP/1.0, which keeps the body unchunked; returns the status and body, at
    /// most `MAX_INPUT_BYTES` of it (more is an error of kind `FileTooLarge`).
    fn request(&self, mut stream: impl Read + Write, host: &str, path: &str) -> io::Result<(u16, Vec<u8>)> {
        let mut head = format!("GET {path} HTTP/1.0\r\nHost: {host}\r\n");
        if let Some((user, password)) = &self.login {
            let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
            head.push_str(&format!("Authorization: Basic {token}\r\n"));
        }
        write!(stream, "{head}\r\n")?;
        let mut response = Vec::new();
        // The head is small; one byte over the limit tells a body at the limit from a larger one.
        (&mut stream).take(MAX_INPUT_BYTES + 64 * 1024 + 1).read_to_end(&mut response)?;
        if response.is_empty() {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "no answer"));
        }
        let not_http = || io::Error::new(io::ErrorKind::InvalidData, "not an HTTP response");
        let split = response.windows(4).position(|w| w == b"\r\n\r\n").ok_or_else(not_http)?;
        if (response.len() - split - 4) as u64 > MAX_INPUT_BYTES {
            return Err(io::Error::new(
                io::ErrorKind::FileTooLarge,
                format!("its answer is larger than {} MiB, more than any report memprof reads", MAX_INPUT_BYTES >> 20),
            ));
        }
        let head = String::from_utf8_lossy(&response[..split]);
        let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).ok_or_else(not_http)?;
        response.drain(..split + 4);
        Ok((status, response))
    }
}

/// Why the daemon at `url` refused with `status` (401 or 403), naming the fix; None for others.
/// `user`: the login given, if any.
pub fn refusal(url: &str, user: Option<&str>, status: u16, body: &[u8]) -> Option<String> {
    match (status, user) {
        (401, None) => Some(format!(
            "the daemon at {url} asks for a login: give --daemon-user USER, with the password in {PASSWORD_VARIABLE}"
        )),
        (401, Some(user)) => Some(format!(
            "the daemon at {url} refused the login of {user}: check the user and the password in {PASSWORD_VARIABLE}"
        )),
        (403, _) => Some(format!("the daemon at {url} refused: {}", error_message(body))),
        _ => None,
    }
}

/// Whether no one but root and `owner` could have put the socket at `path`: every directory on
/// its way belongs to one of them and no one else may write in it, or, as /tmp, is sticky and its
/// entry on the way (a directory) belongs to one of them. The socket's own directory is no
/// sticky exception: anyone may make a socket in /tmp under a name not taken yet, a daemon's
/// while it is down included.
fn placed_by(path: &Path, owner: u32) -> bool {
    let ours = |uid: u32| uid == 0 || uid == owner;
    let Ok(path) = fs::canonicalize(path) else { return false };
    let mut entry = path.as_path();
    while let Some(dir) = entry.parent() {
        let (Ok(meta), Ok(entry_meta)) = (fs::metadata(dir), fs::symlink_metadata(entry)) else { return false };
        let others_write = meta.mode() & 0o022 != 0;
        let sticky = meta.mode() & 0o1000 != 0;
        let kept = sticky && entry_meta.is_dir() && ours(entry_meta.uid());
        if !ours(meta.uid()) || (others_write && !kept) {
            return false;
        }
        entry = dir;
    }
    true
}

/// The message of the daemon's JSON error body (`{"error": "..."}`), or the body's start.
pub fn error_message(body: &[u8]) -> String {
    #[derive(serde::Deserialize)]
    struct Error {
        error: String,
    }
    match serde_json::from_slice::<Error>(body) {
        Ok(error) => error.error,
        Err(_) => String::from_utf8_lossy(&body[..body.len().min(200)]).trim().to_string(),
    }
}

fn effective_uid() -> u32 {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() }
}

/// The uid owning the TCP socket listening on `address` (or on every address, at its port),
/// from `/proc/net/tcp` and `tcp6`: the same network namespace the connection goes through.
fn listener_owner(address: SocketAddr) -> Option<u32> {
    const LISTEN: &str = "0A";
    let port = format!("{:04X}", address.port());
    let wanted = |local: &str| {
        let Some((ip, at)) = local.split_once(':') else { return false };
        // Every address, or the one asked for (in /proc's byte order).
        let exact = match address.ip() {
            std::net::IpAddr::V4(v4) => format!("{:08X}", u32::from_ne_bytes(v4.octets())),
            std::net::IpAddr::V6(v6) => {
                v6.octets().chunks(4).map(|w| format!("{:08X}", u32::from_ne_bytes(w.try_into().unwrap()))).collect()
            }
        };
        at == port && (ip.bytes().all(|b| b == b'0') || ip == exact)
    };
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().find_map(|table| {
        let text = std::fs::read_to_string(table).ok()?;
        text.lines().skip(1).find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            (fields.len() > 7 && fields[3] == LISTEN && wanted(fields[1])).then(|| fields[7].parse().ok()).flatten()
        })
    })
}
