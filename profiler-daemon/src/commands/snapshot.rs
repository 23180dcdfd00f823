//! `memprof snapshot`: one process's report in a file. Taken from the memprof daemon when it
//! traces the process (which then stays traced), else by attaching for `--duration` and
//! detaching. Either way the process keeps running.

use std::{
    io::{self, Read as _, Write as _},
    net::{SocketAddr, TcpStream, ToSocketAddrs as _},
    path::Path,
    time::Duration,
};

use anyhow::{bail, Context as _};
use clap::Parser;

use crate::{
    cli::{SnapshotArgs, SnapshotFormat, TraceArgs, MAX_SECONDS},
    commands::{output::ReportFile, session},
    error::UserError,
    format::{Format, MAX_INPUT_BYTES},
};

pub async fn run(args: &SnapshotArgs) -> anyhow::Result<i32> {
    let format = match args.format {
        Some(format) => format,
        None => format_of(&args.output)?,
    };
    let pid = args.pid.get();
    match from_daemon(&args.daemon, pid, format)? {
        Answer::Report(report) => {
            let error = |cause| UserError::Output { path: args.output.clone(), cause };
            ReportFile::create(&args.output).and_then(|mut file| file.append(&report)).map_err(error)?;
            eprintln!(
                "memprof: pid {pid} is traced by the daemon at {}: wrote its report to {}; it stays traced",
                args.daemon,
                args.output.display()
            );
        }
        Answer::NotTraced(why) => {
            eprintln!("memprof: {why}; attaching to pid {pid} for {} s", args.duration);
            session::attach(args.pid, &trace_args(args, format)).await?;
            // The session said where it wrote the report.
            eprintln!("memprof: pid {pid} keeps running, untraced");
        }
    }
    Ok(0)
}

fn format_of(path: &Path) -> Result<SnapshotFormat, anyhow::Error> {
    let name = path.to_string_lossy();
    if name.ends_with(".json") {
        Ok(SnapshotFormat::Json)
    } else if name.ends_with(".pb.gz") {
        Ok(SnapshotFormat::Pprof)
    } else {
        bail!("cannot tell the format from the name {name}; end it in .pb.gz or .json, or give --format pprof|json")
    }
}

/// `memprof attach` settings for one final report at `--duration`: every other setting at its
/// command-line default.
fn trace_args(args: &SnapshotArgs, format: SnapshotFormat) -> TraceArgs {
    #[derive(Parser)]
    struct Attach {
        #[command(flatten)]
        trace: TraceArgs,
    }
    let mut trace = Attach::parse_from(["attach"]).trace;
    trace.format = match format {
        SnapshotFormat::Pprof => Format::Pprof,
        SnapshotFormat::Json => Format::Json,
    };
    trace.output = Some(args.output.clone());
    trace.duration = Some(args.duration);
    // No report before the final one.
    trace.interval = MAX_SECONDS;
    trace.maps = args.maps;
    trace
}

enum Answer {
    Report(Vec<u8>),
    /// Why the daemon cannot give the report: none answers, or it does not trace the process.
    NotTraced(String),
}

/// Asks the daemon at `url` (`http://HOST:PORT`, on this host) for the report of `pid`.
fn from_daemon(url: &str, pid: u32, format: SnapshotFormat) -> anyhow::Result<Answer> {
    let Some(authority) = url.strip_prefix("http://").map(|rest| rest.trim_end_matches('/')) else {
        bail!("--daemon {url} is not an http:// URL; give it as http://HOST:PORT");
    };
    let path = match format {
        SnapshotFormat::Pprof => format!("/debug/pprof/heap?pid={pid}"),
        SnapshotFormat::Json => format!("/api/v1/leaks?pid={pid}"),
    };
    let address = authority
        .to_socket_addrs()
        .ok()
        .and_then(|mut addresses| addresses.next())
        .with_context(|| format!("--daemon {url} names no address; give it as http://HOST:PORT"))?;
    if !address.ip().is_loopback() {
        bail!(
            "--daemon {url} is not on this host, and memprof trusts only a daemon it can check is root's; \
             fetch a remote daemon's /debug/pprof/heap with curl over https instead"
        );
    }
    // Anyone may listen on an unprivileged port: the answer is trusted only from root's or our own.
    match listener_owner(address) {
        Some(uid) if uid == 0 || uid == effective_uid() => {}
        Some(uid) => bail!(
            "the listener at {url} belongs to uid {uid}, not root or you: refusing its answer (is the memprof daemon running, on that port?)"
        ),
        None => return Ok(Answer::NotTraced(format!("no memprof daemon answers at {url} (nothing listens there)"))),
    }
    let (status, body) = match get(address, authority, &path) {
        Ok(answer) => answer,
        Err(err) if err.kind() == io::ErrorKind::FileTooLarge => bail!("the daemon at {url}: {err}"),
        Err(err) => return Ok(Answer::NotTraced(format!("no memprof daemon answers at {url} ({err})"))),
    };
    match status {
        200 if format == SnapshotFormat::Json => Ok(Answer::Report([body, b"\n".to_vec()].concat())),
        200 => Ok(Answer::Report(body)),
        404 => Ok(Answer::NotTraced(format!("the daemon at {url} does not trace pid {pid}"))),
        _ => bail!(
            "the daemon at {url} answered {path} with {status}: {}",
            String::from_utf8_lossy(&body[..body.len().min(200)]).trim()
        ),
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

/// `GET path` over HTTP/1.0, which keeps the body unchunked; returns the status and body, at
/// most `MAX_INPUT_BYTES` of it (more is an error of kind `FileTooLarge`).
fn get(address: SocketAddr, authority: &str, path: &str) -> io::Result<(u16, Vec<u8>)> {
    let mut stream = TcpStream::connect_timeout(&address, Duration::from_secs(5))?;
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {authority}\r\n\r\n")?;
    let mut response = Vec::new();
    // The head is small; one byte over the limit tells a body at the limit from a larger one.
    (&mut stream).take(MAX_INPUT_BYTES + 64 * 1024 + 1).read_to_end(&mut response)?;
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
