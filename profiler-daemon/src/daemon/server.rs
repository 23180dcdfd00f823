//! The HTTP listener's connections, on its TCP address and on the API's Unix socket: at most
//! `max_connections` served at once (the next ones wait in the kernel's accept queue), beside
//! slots of their own for root and `access.group` on the socket, and at most
//! `max_connections_per_client` per client (`clients`: a user of this host, whichever address
//! it connects from, or another host's address); a request head bounded in size
//! and in time, an answer the client does not read cut off, optional TLS (TCP only). Each
//! connection refused or cut off is counted in `memprof_http_refused_total`, so no client is
//! turned away silently.
//!
//! It runs on the daemon's async runtime; the tracer has its own thread, so nothing a client does
//! here slows tracing.

use std::{
    future::Future,
    io,
    path::PathBuf,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use axum::{Extension, Router};
use hyper::server::conn::http1;
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    service::TowerToHyperService,
};
use serde::Deserialize;
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::{TcpListener, UnixListener},
    sync::oneshot,
};
use tokio_rustls::TlsAcceptor;
use tracing::{debug, warn};

use super::{
    access,
    clients::{Client, ClientId, Clients, Share},
    deadline::{classify, Deadline, State},
    seats::{Seat, Seats},
};
use crate::{cli, peer};

/// The `[http]` table of the config file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SettingsFile {
    max_connections: Option<usize>,
    max_connections_per_client: Option<usize>,
    header_timeout: Option<f64>,
    write_timeout: Option<f64>,
    max_header_bytes: Option<usize>,
    web_config_file: Option<PathBuf>,
}

/// The listener's limits, fixed when the daemon starts.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// Connections served at once; more wait in the kernel's accept queue.
    pub max_connections: usize,
    /// Connections served at once from one client (`clients`: a user of this host, or another
    /// host's address); more are closed at once (counted), so that one client's slow or stalled
    /// connections cannot take every slot.
    pub max_connections_per_client: usize,
    /// Time a connection has to send a whole request head, from when it opens or its previous
    /// answer was sent: it bounds both slow clients and idle kept-alive connections.
    pub header_timeout: Duration,
    /// Time an answer may wait for a client that does not read it.
    pub write_timeout: Duration,
    /// Request line and headers together; more gets 431.
    pub max_header_bytes: usize,
    /// TLS and basic auth, in the format of the Prometheus exporter toolkit's web config.
    pub web_config_file: Option<PathBuf>,
}

pub const DEFAULT: Settings = Settings {
    max_connections: 512,
    max_connections_per_client: 64,
    header_timeout: Duration::from_secs(5),
    write_timeout: Duration::from_secs(10),
    max_header_bytes: 16 * 1024,
    web_config_file: None,
};

/// hyper's smallest read buffer.
const MIN_BUFFER: usize = 8192;
const MAX_HEADER_BYTES: usize = 1 << 20;

impl Settings {
    /// The file's settings over the defaults; `web_config_flag` overrides the file's.
    pub fn new(file: Option<SettingsFile>, web_config_flag: Option<PathBuf>) -> Result<Self, (&'static str, String)> {
        let file = file.unwrap_or_default();
        let seconds = |name, value: Option<f64>, default: Duration| match value {
            Some(secs) => cli::check_seconds(secs, false).map(Duration::from_secs_f64).map_err(|e| (name, e)),
            None => Ok(default),
        };
        let settings = Self {
            max_connections: file.max_connections.unwrap_or(DEFAULT.max_connections),
            max_connections_per_client: file.max_connections_per_client.unwrap_or(DEFAULT.max_connections_per_client),
            header_timeout: seconds("http.header_timeout", file.header_timeout, DEFAULT.header_timeout)?,
            write_timeout: seconds("http.write_timeout", file.write_timeout, DEFAULT.write_timeout)?,
            max_header_bytes: file.max_header_bytes.unwrap_or(DEFAULT.max_header_bytes),
            web_config_file: web_config_flag.or(file.web_config_file),
        };
        if settings.max_connections == 0 {
            return Err(("http.max_connections", "0 would serve nobody; give at least 1".into()));
        }
        if settings.max_connections_per_client == 0 {
            return Err(("http.max_connections_per_client", "0 would serve nobody; give at least 1".into()));
        }
        if !(1024..=MAX_HEADER_BYTES).contains(&settings.max_header_bytes) {
            return Err(("http.max_header_bytes", format!("give 1024 to {MAX_HEADER_BYTES}")));
        }
        Ok(settings)
    }
}

/// Why a connection or request was turned away; the `reason` label of `memprof_http_refused_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// accept(2) failed, e.g. out of file descriptors; the connection waits in the kernel's queue.
    AcceptFailed,
    TlsHandshake,
    /// A connection sent nothing within `header_timeout` (new, or kept alive after an answer).
    IdleTimeout,
    /// A request head was begun and not finished within `header_timeout`.
    HeaderTimeout,
    /// The client did not read its answer for `write_timeout`.
    WriteTimeout,
    HeaderTooLarge,
    Malformed,
    /// A request with a body: no endpoint takes one.
    Body,
    Unauthorized,
    /// A heavy answer (report, profile, flame graph) found no free turn in time: 503.
    Busy,
    /// A client (a local user, or another host) had `max_connections_per_client` connections
    /// open already.
    ClientLimit,
    /// A password check found its client's (or every) check slot taken: 429.
    AuthBusy,
    /// A path that shows or acts on processes, asked without credentials by a client the
    /// socket does not trust: 403.
    Forbidden,
    /// A connection closed after its answer to give its slot to one waiting (see `seats`).
    GaveUpSlot,
}

impl Refusal {
    pub const ALL: [Refusal; 14] = [
        Refusal::AcceptFailed,
        Refusal::TlsHandshake,
        Refusal::IdleTimeout,
        Refusal::HeaderTimeout,
        Refusal::WriteTimeout,
        Refusal::HeaderTooLarge,
        Refusal::Malformed,
        Refusal::Body,
        Refusal::Unauthorized,
        Refusal::Busy,
        Refusal::ClientLimit,
        Refusal::AuthBusy,
        Refusal::Forbidden,
        Refusal::GaveUpSlot,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Refusal::AcceptFailed => "accept_failed",
            Refusal::TlsHandshake => "tls_handshake",
            Refusal::IdleTimeout => "idle_timeout",
            Refusal::HeaderTimeout => "header_timeout",
            Refusal::WriteTimeout => "write_timeout",
            Refusal::HeaderTooLarge => "header_too_large",
            Refusal::Malformed => "malformed_request",
            Refusal::Body => "request_body",
            Refusal::Unauthorized => "unauthorized",
            Refusal::Busy => "busy",
            Refusal::ClientLimit => "client_limit",
            Refusal::AuthBusy => "auth_busy",
            Refusal::Forbidden => "forbidden",
            Refusal::GaveUpSlot => "gave_up_slot",
        }
    }
}

/// The listener's counters, exported by `metrics::http_collector`.
#[derive(Debug, Default)]
pub struct Stats {
    pub accepted: AtomicU64,
    pub open: AtomicU64,
    /// Connections that found `max_connections` open and waited for one to close.
    pub queued: AtomicU64,
    refused: [AtomicU64; Refusal::ALL.len()],
}

impl Stats {
    pub fn refuse(&self, why: Refusal) {
        self.refused[why as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn refused(&self, why: Refusal) -> u64 {
        self.refused[why as usize].load(Ordering::Relaxed)
    }
}

/// What the port and the socket share: the app, the limits, and the connection slots.
pub struct Listeners {
    app: Router,
    settings: Arc<Settings>,
    tls: Option<TlsAcceptor>,
    stats: Arc<Stats>,
    access: Arc<access::Settings>,
    clients: Clients,
    /// `max_connections`, for every connection but those the socket trusts.
    shared: Seats,
    /// Slots only root and `access.group` take, on the socket: however many users or hosts fill
    /// the shared slots, they cannot keep root's `inspect` waiting.
    trusted: Seats,
}

impl Listeners {
    pub fn new(
        app: Router,
        settings: Settings,
        tls: Option<TlsAcceptor>,
        stats: Arc<Stats>,
        access: Arc<access::Settings>,
    ) -> Self {
        Self {
            app,
            tls,
            stats,
            access,
            clients: Clients::new(settings.max_connections_per_client),
            shared: Seats::new(settings.max_connections),
            trusted: Seats::new(settings.max_connections_per_client),
            settings: Arc::new(settings),
        }
    }

    /// Serves on `listener`, and on `socket` if given, until `stop` resolves.
    pub async fn serve(&self, listener: TcpListener, socket: Option<&UnixListener>, stop: impl Future<Output = ()>) {
        tokio::select! {
            _ = stop => {}
            _ = self.port(listener) => {}
            _ = self.socket(socket) => {}
        }
    }

    /// Serves the TCP port. Waiting for a slot here, not accepting, leaves the connections behind
    /// this one in the kernel's accept queue: they are served in order as slots free up.
    async fn port(&self, listener: TcpListener) {
        loop {
            let Some((stream, peer)) = self.accepted(listener.accept().await).await else { continue };
            let client = Client { id: ClientId::over_tcp(peer, stream.local_addr().ok()), local: None };
            let Some(share) = self.share(client.id) else { continue };
            let seat = wait_for_seat(&self.shared, &self.stats).await;
            tokio::spawn(self.connection(client, share).run(stream, seat, self.tls.clone()));
        }
    }

    /// Serves the socket, if there is one. Each connection waits for its slot on its own task: a
    /// stranger's waiting for a shared slot must not hold up root's behind it. Each user's
    /// waiting connections are bounded by their share.
    async fn socket(&self, socket: Option<&UnixListener>) {
        let Some(socket) = socket else { return std::future::pending().await };
        loop {
            let accepted = socket.accept().await.and_then(|(stream, _)| Ok((peer::credentials(&stream)?, stream)));
            let Some((peer, stream)) = self.accepted(accepted).await else { continue };
            let seats = if self.access.trusts(&peer) { &self.trusted } else { &self.shared };
            let seats = seats.clone();
            let client = Client { id: ClientId::User(peer.uid), local: Some(peer) };
            let Some(share) = self.share(client.id) else { continue };
            let connection = self.connection(client, share);
            // Local: no TLS, nothing between the two ends to read it.
            tokio::spawn(async move {
                let seat = wait_for_seat(&seats, &connection.stats).await;
                connection.run(stream, seat, None).await
            });
        }
    }

    /// An accepted connection, counted; after a failed accept, such as out of descriptors, none
    /// for 100 ms, leaving the connection in the kernel's queue.
    async fn accepted<T>(&self, accepted: io::Result<T>) -> Option<T> {
        match accepted {
            Ok(accepted) => {
                self.stats.accepted.fetch_add(1, Ordering::Relaxed);
                Some(accepted)
            }
            Err(err) => {
                self.stats.refuse(Refusal::AcceptFailed);
                warn!("http: accepting a connection failed: {err}; retrying in 100 ms");
                tokio::time::sleep(Duration::from_millis(100)).await;
                None
            }
        }
    }

    /// One more connection of `client`, unless it is over its share: checked before waiting for
    /// a slot, so that a client over its share is not queued ahead of others.
    fn share(&self, client: ClientId) -> Option<Share> {
        let share = self.clients.take(client);
        if share.is_none() {
            self.stats.refuse(Refusal::ClientLimit);
            debug!(
                "http: {client} has {} connections open; closing its next",
                self.settings.max_connections_per_client
            );
        }
        share
    }

    fn connection(&self, client: Client, share: Share) -> Connection {
        let app = self.app.clone().layer(Extension(client));
        Connection { app, settings: self.settings.clone(), stats: self.stats.clone(), _share: share }
    }
}

/// A slot of `seats`, waiting (counted) when none is free.
async fn wait_for_seat(seats: &Seats, stats: &Stats) -> Seat {
    seats.take(|| _ = stats.queued.fetch_add(1, Ordering::Relaxed)).await
}

struct Connection {
    app: Router,
    settings: Arc<Settings>,
    stats: Arc<Stats>,
    _share: Share,
}

impl Connection {
    /// Serves `stream` while holding `seat`.
    async fn run<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
        self,
        stream: S,
        seat: Seat,
        tls: Option<TlsAcceptor>,
    ) {
        let Seat { _slot, mut give_up } = seat;
        self.stats.open.fetch_add(1, Ordering::Relaxed);
        let state = Arc::new(State::default());
        let stream = Deadline::new(stream, self.settings.write_timeout, state.clone());
        let result = match tls {
            None => self.http(stream, &mut give_up).await,
            Some(tls) => match tokio::time::timeout(self.settings.header_timeout, tls.accept(stream)).await {
                Ok(Ok(stream)) => self.http(stream, &mut give_up).await,
                Ok(Err(err)) => {
                    debug!("http: TLS handshake failed: {err}");
                    self.stats.refuse(Refusal::TlsHandshake);
                    Ok(())
                }
                Err(_) => {
                    self.stats.refuse(Refusal::TlsHandshake);
                    Ok(())
                }
            },
        };
        if let Err(err) = result {
            debug!("http: connection ended: {err}");
            if let Some(why) = classify(&err, &state) {
                self.stats.refuse(why);
            }
        }
        self.stats.open.fetch_sub(1, Ordering::Relaxed);
    }

    /// Serves HTTP on `stream` until the client is done, or, asked to `give_up` its slot, until
    /// the answer under way is sent.
    async fn http<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
        &self,
        stream: S,
        give_up: &mut oneshot::Receiver<()>,
    ) -> Result<(), hyper::Error> {
        let buffer = (self.settings.max_header_bytes + 1024).max(MIN_BUFFER);
        let connection = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(self.settings.header_timeout)
            .max_header_size(self.settings.max_header_bytes)
            .max_buf_size(buffer)
            .serve_connection(TokioIo::new(stream), TowerToHyperService::new(self.app.clone()));
        tokio::pin!(connection);
        tokio::select! {
            served = connection.as_mut() => served,
            Ok(()) = give_up => {
                connection.as_mut().graceful_shutdown();
                let served = connection.await;
                // A connection cut off meanwhile (a stalled request head) is counted for that.
                if served.is_ok() {
                    self.stats.refuse(Refusal::GaveUpSlot);
                }
                served
            }
        }
    }
}
