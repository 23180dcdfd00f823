//! The daemon's HTTP listener under hostile clients: oversized requests, more connections than it
//! serves at once, clients that stall, a thousand scrapes at once; and TLS with basic auth, with a
//! real Prometheus scraping through them. Tracing must go on exactly through all of it.

use std::{
    io::{ErrorKind, Read, Write},
    net::TcpStream,
    path::{Path, PathBuf},
    process::Command,
    sync::{Arc, Barrier},
    time::Duration,
};

use memprof_tests::{
    fixture, http_get, memprof,
    prometheus::{self, Prometheus},
    site, wait_for, Daemon, Scratch, Waiting,
};

/// One at a time: a thousand scrapes would starve a neighbour's timing-free but deadline-bound waits.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn target() -> Waiting {
    Waiting::start(&fixture("daemon_target"), &[])
}

/// A daemon tracing `pid` with `http` as the `[http]` table of its config file, which is in the
/// directory returned with it: bound first, it is dropped after the daemon.
fn daemon_with(test: &str, pid: u32, http: &str) -> (Scratch, Daemon) {
    let dir = Scratch::new("http", test);
    let config = dir.join("memprof.toml");
    std::fs::write(&config, format!("pids = [{pid}]\n[http]\n{http}")).unwrap();
    let daemon = Daemon::start(&["--config", config.to_str().unwrap()]);
    (dir, daemon)
}

/// A connection that sent `bytes` and then nothing, with a read timeout as a safety net.
fn stalled(port: u16, bytes: &str) -> TcpStream {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connecting");
    stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    stream.write_all(bytes.as_bytes()).unwrap();
    stream
}

/// What the server answered to `request`, up to its closing the connection.
fn exchange(port: u16, request: &str) -> String {
    let mut stream = stalled(port, request);
    let mut answer = Vec::new();
    // A reset after the answer (the server closes with our bytes unread) is fine: the answer came.
    let _ = stream.read_to_end(&mut answer);
    String::from_utf8_lossy(&answer).into_owned()
}

fn status(answer: &str) -> u16 {
    answer.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("no status: {answer:?}"))
}

/// The server closes `stream` (a read ends, not the read timeout).
fn assert_closed(mut stream: TcpStream) {
    let mut rest = Vec::new();
    match stream.read_to_end(&mut rest) {
        Ok(_) => {}
        Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
        Err(e) => panic!("the server did not close a stalled connection: {e}"),
    }
}

/// The value of a sample line `series` in /metrics, which must have it.
fn metric(port: u16, series: &str) -> u64 {
    memprof_tests::metric(port, series).unwrap_or_else(|| panic!("{series} missing from /metrics"))
}

fn refused(port: u16, reason: &str) -> u64 {
    metric(port, &format!("memprof_http_refused_total{{reason=\"{reason}\"}}"))
}

/// The fixture's 50 held blocks, to the byte, through the API.
fn assert_tracing_exact(daemon: &Daemon, pid: u32) {
    let leaks = format!("/api/v1/leaks?pid={pid}");
    wait_for(20, "the held blocks, exactly", || {
        (site(&daemon.get_json(&leaks).1, "hold_site") == (50_000, 50)).then_some(())
    });
}

#[test]
fn oversized_requests_and_bodies_are_refused_with_their_status_and_counted() {
    let _serial = serial();
    let mut held = target();
    let daemon = Daemon::start(&["--pid", &held.pid().to_string()]);
    let big = "a".repeat(20_000);
    let answer = exchange(daemon.port, &format!("GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: {big}\r\n\r\n"));
    assert_eq!(status(&answer), 431, "{answer}");
    let answer = exchange(daemon.port, &format!("GET /metrics?{big} HTTP/1.1\r\nHost: x\r\n\r\n"));
    assert_eq!(status(&answer), 431, "a long URL counts in the head: {answer}");
    let many: String = (0..200).map(|i| format!("X-{i}: 1\r\n")).collect();
    let answer = exchange(daemon.port, &format!("GET /metrics HTTP/1.1\r\nHost: x\r\n{many}\r\n"));
    assert_eq!(status(&answer), 431, "{answer}");
    // Bodies are refused at once, even one that is never sent.
    let answer = exchange(daemon.port, "GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n");
    assert_eq!(status(&answer), 413, "{answer}");
    assert!(answer.contains("take no request body"), "{answer}");
    let answer = exchange(daemon.port, "POST /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n");
    assert_eq!(status(&answer), 413, "{answer}");
    let answer = exchange(daemon.port, "NOT HTTP AT ALL\r\n\r\n");
    assert_eq!(status(&answer), 400, "{answer}");

    assert_eq!(refused(daemon.port, "header_too_large"), 3);
    assert_eq!(refused(daemon.port, "request_body"), 2);
    assert_eq!(refused(daemon.port, "malformed_request"), 1);
    held.go();
    assert_tracing_exact(&daemon, held.pid());
}

#[test]
fn connections_beyond_the_cap_wait_their_turn_and_are_counted() {
    let _serial = serial();
    let held = target();
    let (_dir, daemon) = daemon_with("cap", held.pid(), "max_connections = 4\nheader_timeout = 2\n");
    let stalls: Vec<TcpStream> = (0..4).map(|_| stalled(daemon.port, "GET /metrics HTTP/1.1\r\nHost: x\r\n")).collect();
    std::thread::sleep(Duration::from_millis(500));
    // Every slot is held by a stalled client: this scrape waits until the oldest gives its slot
    // up (it has no answer under way) or is cut off.
    let (code, text) = http_get(daemon.port, "/metrics").expect("the scrape waits its turn, then is served");
    assert_eq!(code, 200);
    assert!(text.contains("memprof_build_info"), "{text}");
    for stream in stalls {
        assert_closed(stream);
    }
    assert!(metric(daemon.port, "memprof_http_connections_queued_total") >= 1);
    let (cut_off, gave_up) = (refused(daemon.port, "header_timeout"), refused(daemon.port, "gave_up_slot"));
    assert_eq!(cut_off + gave_up, 4, "{cut_off} cut off, {gave_up} gave their slot up");
}

/// Every slot held by a client that keeps its connections alive with a request a second, never
/// idle for `header_timeout`: a scrape has the oldest close once its answer is sent, and is
/// served while they go on, where it waited for as long as they liked.
#[test]
fn connections_kept_alive_by_requests_give_their_slots_to_a_scrape() {
    let _serial = serial();
    let held = target();
    let (_dir, daemon) = daemon_with("alive", held.pid(), "max_connections = 4\nheader_timeout = 2\n");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let port = daemon.port;
    let holders: Vec<_> = (0..4)
        .map(|_| {
            let stop = stop.clone();
            let mut stream = stalled(port, "");
            std::thread::spawn(move || {
                let mut answer = [0; 4096];
                // Returns whether the server closed the connection: one more request once told
                // to stop tells.
                loop {
                    let asked = stream.write_all(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n");
                    if asked.is_err() || matches!(stream.read(&mut answer), Ok(0) | Err(_)) {
                        return true;
                    }
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        return false;
                    }
                    std::thread::sleep(Duration::from_secs(1));
                }
            })
        })
        .collect();
    // Asked as root on the socket, whose slots are apart: the port's four and this one.
    wait_for(20, "the four slots to be held", || {
        daemon.get("/metrics")?.1.contains("memprof_http_connections_open 5").then_some(())
    });
    let (code, _) = http_get(port, "/metrics").expect("the scrape is served while they go on");
    assert_eq!(code, 200);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let closed = holders.into_iter().map(|holder| holder.join().unwrap()).filter(|&closed| closed).count();
    assert!(closed >= 1, "no holder gave its slot up");
    assert!(refused(port, "gave_up_slot") >= 1);
}

/// Every shared slot held (here by four connections from four loopback addresses: local users,
/// or other hosts, may fill them): root's requests on the socket are served all the same.
#[test]
fn connections_from_many_loopback_addresses_do_not_keep_root_waiting_on_the_socket() {
    let _serial = serial();
    let mut held = target();
    let http = "max_connections = 4\nheader_timeout = 120\n";
    let (_dir, daemon) = daemon_with("loopback", held.pid(), http);
    let stalls: Vec<TcpStream> = (2..6)
        .map(|host| {
            let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
            socket.bind(&std::net::SocketAddr::from(([127, 0, 0, host], 0)).into()).unwrap();
            socket.connect(&std::net::SocketAddr::from(([127, 0, 0, 1], daemon.port)).into()).unwrap();
            let mut stream = TcpStream::from(socket);
            stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n").unwrap();
            stream
        })
        .collect();
    wait_for(20, "the four shared slots to be taken", || {
        (daemon.get("/metrics")?.1.contains("memprof_http_connections_open 5")).then_some(())
    });
    // Their 120 s are far from over: root was not served by a slot they gave up.
    held.go();
    assert_tracing_exact(&daemon, held.pid());
    for mut stream in stalls {
        stream.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        let still_open = matches!(stream.read(&mut [0; 1]), Err(e) if e.kind() == ErrorKind::WouldBlock);
        assert!(still_open, "a stalled connection was closed: root's requests waited for its slot");
    }
}

/// `setpriv` running a program as nobody, in no group but its own.
fn as_nobody() -> Command {
    let mut command = Command::new("setpriv");
    command.args(["--reuid=65534", "--regid=65534", "--clear-groups"]);
    command
}

/// An unprivileged local user holds `max_connections_per_client` idle connections to the port
/// from 127.0.0.1, where root's scrapes come from: a client on this host is its user, not its
/// address, so root's scrapes are served; and that user's next connection, from another loopback
/// address, is over its share all the same.
#[test]
fn a_local_users_idle_connections_do_not_use_up_roots_share() {
    let _serial = serial();
    let held = target();
    // The idle connections are not cut off meanwhile: root is not served by a slot they gave up.
    let (dir, daemon) = daemon_with("local_user", held.pid(), "header_timeout = 120\n");
    const SHARE: usize = 64;
    // A copy nobody may run, whatever the modes of the directories above the build's.
    let program = dir.join("idle_connections");
    std::fs::copy(fixture("idle_connections"), &program).unwrap();
    let mut idle = as_nobody();
    idle.arg(&program).args(["--wait", &daemon.port.to_string(), &SHARE.to_string()]);
    let mut user = Waiting::start_command(idle);
    user.go();
    assert_eq!(user.next_line(), format!("held {SHARE}"));
    // Asked as root on the socket, whose slots are apart: nobody's connections and this one.
    let open = format!("memprof_http_connections_open {}", SHARE + 1);
    wait_for(20, "nobody's connections to be served", || daemon.get("/metrics")?.1.contains(&open).then_some(()));
    for _ in 0..5 {
        let scrape = http_get(daemon.port, "/metrics");
        let code = scrape.as_ref().map(|(code, _)| *code);
        assert_eq!(
            code,
            Some(200),
            "root's scrape over loopback was not served: nobody's connections used up its share"
        );
    }
    assert_eq!(refused(daemon.port, "client_limit"), 0);
    // Another loopback address makes no other client: the user's next connection is refused.
    user.go();
    assert_eq!(user.next_line(), "extra sent");
    wait_for(20, "nobody's connection past its share to be refused", || {
        (refused(daemon.port, "client_limit") == 1).then_some(())
    });
    user.go();
    assert_eq!(user.next_line(), "extra closed");
    assert_eq!(user.next_line(), format!("open {SHARE}"), "nobody's first connections are still open");
}

#[test]
fn slow_clients_are_cut_off_and_do_not_hold_up_scrapes_or_tracing() {
    let _serial = serial();
    let mut held = target();
    // All from one address here: its share is raised to see the timeouts, not the per-client limit.
    let http = "header_timeout = 1\nwrite_timeout = 1\nmax_connections_per_client = 1024\n";
    let (_dir, daemon) = daemon_with("slow", held.pid(), http);
    let half: Vec<TcpStream> =
        (0..50).map(|_| stalled(daemon.port, "GET /metrics HTTP/1.1\r\nHost: x\r\nAcc")).collect();
    let silent: Vec<TcpStream> = (0..50).map(|_| stalled(daemon.port, "")).collect();
    // A client that asks for thousands of answers and reads none: its answers fill the socket.
    let mut greedy = stalled(daemon.port, "");
    let port = daemon.port;
    let writer = std::thread::spawn(move || {
        let requests = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n".repeat(10_000);
        let _ = greedy.write_all(requests.as_bytes());
        greedy
    });
    held.go();
    for _ in 0..10 {
        assert_eq!(http_get(port, "/metrics").expect("a scrape").0, 200);
    }
    for stream in half.into_iter().chain(silent) {
        assert_closed(stream);
    }
    wait_for(30, "the greedy client to be cut off", || (refused(port, "write_timeout") == 1).then_some(()));
    drop(writer.join());
    assert_eq!(refused(port, "header_timeout"), 50);
    assert!(refused(port, "idle_timeout") >= 50, "the silent ones, and kept-alive scrapes");
    assert_tracing_exact(&daemon, held.pid());
}

#[test]
fn a_thousand_concurrent_scrapes_all_succeed_while_tracing_goes_on() {
    let _serial = serial();
    let mut held = target();
    // A thousand clients, here all of one address: its share is raised to the global cap's.
    let (_dir, daemon) = daemon_with("thousand", held.pid(), "max_connections_per_client = 512\n");
    const SCRAPES: usize = 1000;
    let start = Arc::new(Barrier::new(SCRAPES + 1));
    let port = daemon.port;
    let scrapers: Vec<_> = (0..SCRAPES)
        .map(|_| {
            let start = start.clone();
            std::thread::Builder::new()
                .stack_size(64 * 1024)
                .spawn(move || {
                    start.wait();
                    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
                    stream.set_read_timeout(Some(Duration::from_secs(60))).ok()?;
                    stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").ok()?;
                    let mut answer = String::new();
                    stream.read_to_string(&mut answer).ok()?;
                    answer.split_whitespace().nth(1)?.parse::<u16>().ok()
                })
                .expect("a scraper thread")
        })
        .collect();
    held.go();
    start.wait();
    let statuses: Vec<Option<u16>> = scrapers.into_iter().map(|s| s.join().unwrap()).collect();
    let served = statuses.iter().filter(|s| **s == Some(200)).count();
    let queued = metric(port, "memprof_http_connections_queued_total");
    eprintln!("{served} of {SCRAPES} scrapes served, {queued} waited for a free slot");
    let refusals: Vec<(&str, u64)> = ["accept_failed", "idle_timeout", "header_timeout", "write_timeout"]
        .into_iter()
        .map(|reason| (reason, refused(port, reason)))
        .collect();
    assert_eq!(served, SCRAPES, "refused: {refusals:?}; statuses: {statuses:?}");
    assert_tracing_exact(&daemon, held.pid());
}

/// A self-signed certificate for 127.0.0.1, made by the openssl command.
fn certificate(dir: &Path) -> PathBuf {
    let status = Command::new("openssl")
        .args(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1"])
        .args(["-subj", "/CN=memprof-test", "-addext", "subjectAltName=IP:127.0.0.1"])
        .arg("-keyout")
        .arg(dir.join("key.pem"))
        .arg("-out")
        .arg(dir.join("cert.pem"))
        .output()
        .expect("openssl (installed by xtask setup)");
    assert!(status.status.success(), "openssl: {}", String::from_utf8_lossy(&status.stderr));
    dir.join("cert.pem")
}

/// `curl` over TLS, trusting `ca`; returns (status, headers and body).
fn curl(ca: &Path, port: u16, path: &str, user: Option<&str>) -> (u16, String) {
    curl_as(Command::new("curl"), ca, port, path, user)
}

/// `curl` run by `command` (curl under `setpriv`, say).
fn curl_as(mut command: Command, ca: &Path, port: u16, path: &str, user: Option<&str>) -> (u16, String) {
    command.args(["-sS", "--max-time", "20", "-D", "-", "-w", "\n%{http_code}", "--cacert"]).arg(ca);
    if let Some(user) = user {
        command.args(["-u", user]);
    }
    let out = command.arg(format!("https://127.0.0.1:{port}{path}")).output().expect("curl (installed by xtask setup)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (answer, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), answer.to_string())
}

const USER: &str = "prometheus:scrape-secret";

#[test]
fn tls_and_basic_auth_guard_every_path_and_prometheus_scrapes_through_them() {
    let _serial = serial();
    let dir = Scratch::new("http", "tls");
    let ca = certificate(dir.path());
    let hash = bcrypt::hash("scrape-secret", 4).unwrap();
    let web = dir.join("web.yml");
    // Relative file names are relative to the web config's directory, as in the exporter toolkit.
    std::fs::write(
        &web,
        format!("tls_server_config:\n  cert_file: cert.pem\n  key_file: key.pem\nbasic_auth_users:\n  prometheus: '{hash}'\n"),
    )
    .unwrap();
    let mut held = target();
    let pid = held.pid();
    let daemon = Daemon::spawn(&["--pid", &pid.to_string(), "--web-config-file", web.to_str().unwrap()], &[]);
    let port = daemon.port;
    wait_for(20, "the daemon to be ready over TLS", || {
        (curl(&ca, port, "/-/ready", Some(USER)).0 == 200).then_some(())
    });
    let (code, text) = curl(&ca, port, "/metrics", Some(USER));
    assert_eq!(code, 200, "{text}");
    assert!(text.contains("memprof_target_attached"), "{text}");

    for path in ["/metrics", "/-/healthy", "/", &format!("/api/v1/leaks?pid={pid}"), "/no/such/path"] {
        let (code, text) = curl(&ca, port, path, None);
        assert_eq!(code, 401, "{path} without credentials: {text}");
        assert!(text.lines().any(|l| l.to_ascii_lowercase().starts_with("www-authenticate: basic")), "{text}");
    }
    assert_eq!(curl(&ca, port, "/metrics", Some("prometheus:wrong")).0, 401, "a wrong password");
    assert_eq!(curl(&ca, port, "/metrics", Some("alice:scrape-secret")).0, 401, "an unknown user");
    assert!(http_get(port, "/metrics").is_none_or(|(code, _)| code != 200), "plain HTTP gets nothing");

    held.go();
    let job = format!(
        "    scheme: https\n    tls_config:\n      ca_file: {}\n    basic_auth:\n      username: prometheus\n      password: scrape-secret\n",
        ca.display()
    );
    let prometheus = Prometheus::start_with(port, &job);
    let inuse = prometheus::of_pid("memprof_heap_inuse_bytes", pid);
    wait_for(60, &format!("{inuse} == 50000 in Prometheus over TLS"), || {
        (prometheus.query(&inuse)? == 50_000.0).then_some(())
    });
    let (_, text) = curl(&ca, port, "/metrics", Some(USER));
    let count = |reason: &str| {
        let series = format!("memprof_http_refused_total{{reason=\"{reason}\"}} ");
        text.lines().find_map(|l| l.strip_prefix(series.as_str())).unwrap().parse::<u64>().unwrap()
    };
    assert!(count("unauthorized") >= 7, "{text}");
    assert!(count("tls_handshake") >= 1, "{text}");
}

#[test]
fn a_bad_web_config_stops_the_daemon_with_one_line_and_an_open_listener_is_warned_about() {
    let _serial = serial();
    let dir = Scratch::new("http", "bad");
    let cases = [
        ("missing.yml", None, "cannot read it"),
        (
            "nocert.yml",
            Some("tls_server_config:\n  cert_file: nope.pem\n  key_file: nope.key\n"),
            "cannot read cert_file",
        ),
        ("hash.yml", Some("basic_auth_users:\n  alice: hunter2\n"), "the password of `alice` is not a bcrypt hash"),
        ("unknown.yml", Some("tls_server_config:\n  client_auth_type: RequireAnyClientCert\n"), "unknown field"),
    ];
    for (name, text, expected) in cases {
        let path = dir.join(name);
        if let Some(text) = text {
            std::fs::write(&path, text).unwrap();
        }
        let out = memprof(&["daemon", "--pid", "1", "--web-config-file", path.to_str().unwrap()]);
        assert!(!out.status.success(), "{name}");
        assert_eq!(out.stderr.lines().count(), 1, "{name}: {}", out.stderr);
        assert!(out.stderr.starts_with("memprof: error: invalid web config file"), "{name}: {}", out.stderr);
        assert!(out.stderr.contains(expected), "{name}: {}", out.stderr);
    }

    let held = target();
    let port = memprof_tests::free_port();
    let mut daemon = Command::new(memprof_tests::memprof_bin())
        .args(["daemon", "--listen", &format!("0.0.0.0:{port}"), "--socket", "", "--pid", &held.pid().to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = std::io::BufReader::new(daemon.stderr.take().unwrap());
    let mut seen = String::new();
    while !seen.contains("memprof: daemon serving") {
        assert!(std::io::BufRead::read_line(&mut stderr, &mut seen).unwrap() > 0, "the daemon ended: {seen}");
    }
    let _ = daemon.kill();
    let _ = daemon.wait();
    assert!(seen.contains("listening on 0.0.0.0") && seen.contains("without TLS or basic auth"), "{seen}");
}

/// A connection to the daemon on 127.0.0.1 from 127.0.0.2: another client address on the same
/// host (all of 127/8 is loopback).
fn from_second_address(port: u16) -> Option<TcpStream> {
    use std::os::fd::FromRawFd;
    // SAFETY: a socket made, bound and connected here, owned by the TcpStream or closed.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let address = |ip: [u8; 4], port: u16| libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(ip) },
            sin_zero: [0; 8],
        };
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        let local = address([127, 0, 0, 2], 0);
        let remote = address([127, 0, 0, 1], port);
        if libc::bind(fd, &local as *const _ as *const libc::sockaddr, len) != 0
            || libc::connect(fd, &remote as *const _ as *const libc::sockaddr, len) != 0
        {
            libc::close(fd);
            return None;
        }
        Some(TcpStream::from_raw_fd(fd))
    }
}

/// A web config with TLS (when `tls`) and the user `prometheus` (password `scrape-secret`,
/// bcrypt cost `cost`); returns the web config and the CA.
fn web_config(dir: &Path, tls: bool, cost: u32) -> (PathBuf, PathBuf) {
    let ca = certificate(dir);
    let hash = bcrypt::hash("scrape-secret", cost).unwrap();
    let tls = if tls { "tls_server_config:\n  cert_file: cert.pem\n  key_file: key.pem\n" } else { "" };
    let web = dir.join("web.yml");
    std::fs::write(&web, format!("{tls}basic_auth_users:\n  prometheus: '{hash}'\n")).unwrap();
    (web, ca)
}

#[test]
fn six_hundred_slow_clients_over_tls_do_not_starve_metrics() {
    let _serial = serial();
    let dir = Scratch::new("http", "slow600");
    let (web, ca) = web_config(dir.path(), true, 4);
    let held = target();
    let daemon = Daemon::spawn(&["--pid", &held.pid().to_string(), "--web-config-file", web.to_str().unwrap()], &[]);
    let port = daemon.port;
    wait_for(20, "the daemon to be ready over TLS", || {
        (curl(&ca, port, "/-/ready", Some(USER)).0 == 200).then_some(())
    });
    // 600 clients of one user of the host (root here, from 127.0.0.2), each sending one byte a
    // second of a TLS record that announces a 512-byte handshake, so that the server waits for
    // the rest; each reconnects when closed. The scrapes are another user's, as Prometheus's are.
    const HELLO: [u8; 5] = [0x16, 0x03, 0x01, 0x02, 0x00];
    let slow: Vec<(TcpStream, usize)> = (0..600).filter_map(|_| Some((from_second_address(port)?, 0))).collect();
    assert_eq!(slow.len(), 600, "connecting the slow clients");
    let dripping = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let dripper = {
        let dripping = dripping.clone();
        std::thread::spawn(move || {
            let mut slow = slow;
            while dripping.load(std::sync::atomic::Ordering::Relaxed) {
                for (stream, sent) in &mut slow {
                    let byte = HELLO.get(*sent).copied().unwrap_or(0);
                    if stream.write_all(&[byte]).is_ok() {
                        *sent += 1;
                    } else if let Some(again) = from_second_address(port) {
                        (*stream, *sent) = (again, 0);
                    }
                }
                std::thread::sleep(Duration::from_secs(1));
            }
        })
    };
    for _ in 0..10 {
        let started = std::time::Instant::now();
        let mut scraper = as_nobody();
        scraper.arg("curl");
        let (code, text) = curl_as(scraper, &ca, port, "/metrics", Some(USER));
        assert_eq!(code, 200, "{text}");
        // Generous: the requirement is that scrapes are not starved (they timed out).
        assert!(started.elapsed() < Duration::from_secs(5), "a scrape took {:?}", started.elapsed());
        std::thread::sleep(Duration::from_millis(500));
    }
    dripping.store(false, std::sync::atomic::Ordering::Relaxed);
    dripper.join().unwrap();
    let (_, text) = curl(&ca, port, "/metrics", Some(USER));
    let count = |reason: &str| {
        let series = format!("memprof_http_refused_total{{reason=\"{reason}\"}} ");
        text.lines().find_map(|l| l.strip_prefix(series.as_str())).unwrap().parse::<u64>().unwrap()
    };
    assert!(count("client_limit") >= 600 - 64, "{text}");
}

#[test]
fn a_flood_of_wrong_passwords_does_not_hold_up_a_first_login() {
    let _serial = serial();
    let dir = Scratch::new("http", "flood");
    // Cost 10, as htpasswd makes them: tens of milliseconds a check.
    let (web, _) = web_config(dir.path(), false, 10);
    let held = target();
    let daemon = Daemon::spawn(&["--pid", &held.pid().to_string(), "--web-config-file", web.to_str().unwrap()], &[]);
    let port = daemon.port;
    wait_for(20, "the daemon to answer", || http_get(port, "/-/ready").map(|_| ()));
    // 2,000 wrong passwords, 100 at a time, from another user of the host.
    let url = format!("http://127.0.0.1:{port}/metrics");
    let mut flood = as_nobody();
    flood.arg("curl").args([
        "-s",
        "--no-progress-meter",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}\n",
        "--parallel",
        "--parallel-max",
        "100",
    ]);
    flood.stdout(std::process::Stdio::piped());
    flood.args(["-u", "prometheus:wrong"]);
    for _ in 0..2000 {
        flood.arg(&url);
    }
    let mut flood = flood.spawn().expect("curl");
    std::thread::sleep(Duration::from_secs(1));
    assert!(flood.try_wait().unwrap().is_none(), "the flood is under way");
    let login = Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "10", "-u", USER, &url])
        .output()
        .expect("curl");
    assert_eq!(String::from_utf8_lossy(&login.stdout), "200", "the first login during the flood");
    let statuses = String::from_utf8_lossy(&flood.wait_with_output().unwrap().stdout).into_owned();
    assert_eq!(statuses.lines().count(), 2000);
    assert!(!statuses.lines().any(|status| status == "200"), "a wrong password got in");
    let auth = format!("-u{USER}");
    let metrics = Command::new("curl").args(["-s", &auth, &url]).output().expect("curl");
    let text = String::from_utf8_lossy(&metrics.stdout);
    let count = |reason: &str| {
        let series = format!("memprof_http_refused_total{{reason=\"{reason}\"}} ");
        text.lines().find_map(|l| l.strip_prefix(series.as_str())).unwrap().parse::<u64>().unwrap()
    };
    let refused = (count("unauthorized"), count("auth_busy"), count("client_limit"));
    eprintln!("flood: (wrong, a check of the client under way, too many connections) = {refused:?}");
    // curl retries a connection closed at once: more refusals than requests.
    assert!(refused.0 + refused.1 + refused.2 >= 2000, "{text}");
}
