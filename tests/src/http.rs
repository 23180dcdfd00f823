//! Talking to servers on loopback and to the daemon's socket.

use std::{
    io::{Read, Write},
    path::{Path, PathBuf},
    sync::Mutex,
};

use crate::time_scale;

/// A free TCP port on loopback (bound and released), never one given to another test of this
/// binary: the kernel may hand a released port out again at once, and two servers of tests
/// running side by side then share it (a client of one talking to the other's).
pub fn free_port() -> u16 {
    static GIVEN: Mutex<std::collections::BTreeSet<u16>> = Mutex::new(std::collections::BTreeSet::new());
    loop {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binding loopback");
        let port = listener.local_addr().expect("local address").port();
        if GIVEN.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(port) {
            return port;
        }
    }
}

/// `GET path` from a server on loopback; returns (status, body).
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    http(port, "GET", path)
}

/// `METHOD path` from a server on loopback; returns (status, body).
pub fn http(port: u16, method: &str, path: &str) -> Option<(u16, String)> {
    http_answer(port, method, path).map(|answer| (answer.status, answer.body))
}

/// What a server answered.
pub struct HttpAnswer {
    pub status: u16,
    /// The header lines, as sent.
    pub headers: String,
    pub body: String,
}

impl HttpAnswer {
    /// The value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.lines().find_map(|line| {
            let (key, value) = line.split_once(':')?;
            key.eq_ignore_ascii_case(name).then_some(value.trim())
        })
    }
}

/// `METHOD path` from a server on loopback. HTTP/1.0 keeps bodies unchunked.
pub fn http_answer(port: u16, method: &str, path: &str) -> Option<HttpAnswer> {
    use std::net::TcpStream;
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(std::time::Duration::from_secs(10 * time_scale()))).ok()?;
    write!(stream, "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let (headers, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    Some(HttpAnswer { status, headers: headers.to_string(), body: body.to_string() })
}

/// A web config file in `dir` giving the daemon's listener the user `user` with `password`
/// (bcrypt at its lowest cost: a test's).
pub fn web_config_user(dir: &Path, user: &str, password: &str) -> PathBuf {
    std::fs::create_dir_all(dir).expect("creating the web config's directory");
    let hash = bcrypt::hash(password, 4).expect("hashing the password");
    let web = dir.join("web.yml");
    std::fs::write(&web, format!("basic_auth_users:\n  {user}: '{hash}'\n")).expect("writing the web config");
    web
}

/// `METHOD path` on the daemon's API socket at `socket`, as the caller's user.
pub fn socket_answer(socket: &Path, method: &str, path: &str) -> Option<HttpAnswer> {
    let mut stream = std::os::unix::net::UnixStream::connect(socket).ok()?;
    stream.set_read_timeout(Some(std::time::Duration::from_secs(300))).ok()?;
    write!(stream, "{method} {path} HTTP/1.0\r\nHost: localhost\r\nContent-Length: 0\r\n\r\n").ok()?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).ok()?;
    // A profile's body is binary: its text is only looked into.
    let response = String::from_utf8_lossy(&response);
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let (headers, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    Some(HttpAnswer { status, headers: headers.to_string(), body: body.to_string() })
}
