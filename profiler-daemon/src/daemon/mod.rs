//! `memprof daemon`: traces the processes its rules match, serves /metrics and the HTTP API,
//! reloads its config on SIGHUP and detaches every probe on SIGTERM or SIGINT.

mod access;
mod cgroup_verdicts;
mod clients;
mod config;
mod deadline;
mod descriptors;
mod discovery;
mod exposition;
mod guard;
mod heavy;
mod host;
mod http;
mod metrics;
mod notify;
mod query;
mod seats;
mod server;
mod settled;
mod slots;
mod socket;
mod tracer;
mod view;
mod wakeup;
mod web_config;

use std::sync::{atomic::AtomicBool, Arc, RwLock};

use anyhow::Context as _;
use tokio::signal::unix::{signal, SignalKind};
use tracing::{error, info, warn};

use crate::cli::DaemonArgs;
use crate::console::say;

/// The one line that says why a daemon without rules traces nothing, and what to do.
fn warn_of_idle_rules(config: &config::Config, args: &DaemonArgs) {
    // Without a config file, no rule is an error `load` reported already.
    if let (true, Some(file)) = (config.rules.is_empty(), &args.config) {
        warn!("{}", config::idle_notice(file));
    }
    // Named one by one, they were meant to exist: a typo would otherwise trace nothing, quietly.
    for pid in config.rules.pids.iter().filter(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists()) {
        warn!("the rules name pid {pid}, and no such process runs: it is not traced");
    }
    for cgroup in config.rules.cgroups.iter().filter(|cgroup| !cgroup_exists(cgroup)) {
        warn!("the rules name cgroup {cgroup}, and /sys/fs/cgroup has no such directory: no process in it is traced until it appears");
    }
}

/// Whether `/sys/fs/cgroup` has the cgroup at `path` (as processes see it), under cgroup v2 or in
/// any hierarchy of v1; true when that cannot be told.
fn cgroup_exists(path: &str) -> bool {
    let root = std::path::Path::new("/sys/fs/cgroup");
    let relative = path.trim_start_matches('/');
    root.join(relative).exists()
        || std::fs::read_dir(root)
            .map_or(true, |hierarchies| hierarchies.flatten().any(|hierarchy| hierarchy.path().join(relative).exists()))
}

pub async fn run(args: &DaemonArgs) -> anyhow::Result<i32> {
    // First of all: until a handler is installed, SIGHUP's default action kills the daemon, and
    // loading the BPF programs below takes about a second (a `systemctl reload` right after start).
    // Signals that arrive before the loop waits for them are kept and handled then.
    let mut hangup = signal(SignalKind::hangup())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    let config = config::load(args)?;
    let descriptor_limit = descriptors::raise_limit();
    // Before the listener and the socket: an unprivileged user hears what is missing, not that a
    // socket's directory refused them.
    crate::kernel::loader::check_support()?;
    warn_of_idle_rules(&config, args);
    let web = match &config.http.web_config_file {
        Some(path) => web_config::load(path)?,
        None => web_config::WebConfig::default(),
    };
    if !config.listen.ip().is_loopback() && (web.tls.is_none() || web.auth.is_none()) {
        warn!(
            "listening on {} without {}: anyone who can reach it can read the traced processes' stacks; see docs: daemon/securing.md#securing-the-listener",
            config.listen,
            match (web.tls.is_none(), web.auth.is_none()) {
                (true, true) => "TLS or basic auth",
                (true, false) => "TLS",
                _ => "basic auth",
            }
        );
    }
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}; choose another address with --listen", config.listen))?;
    // Port 0 is the kernel's choice: said as bound.
    let serving = listener.local_addr().unwrap_or(config.listen);
    let socket = config.access.socket.as_deref().map(socket::Socket::bind).transpose()?;
    let view = Arc::new(RwLock::new(view::DaemonView::default()));
    let alive = Arc::new(AtomicBool::new(false));
    let tracer = tracer::Tracer::new(config.clone(), descriptor_limit, view.clone(), alive.clone())?;
    let (commands, receiver) = wakeup::channel()?;
    let tracer_thread = std::thread::Builder::new().name("tracer".into()).spawn(move || tracer.run(receiver))?;

    let (stop_http, http_stopped) = tokio::sync::oneshot::channel::<()>();
    let stats = Arc::new(server::Stats::default());
    let access = Arc::new(config.access.clone());
    let guard = guard::Guard { stats: stats.clone(), auth: web.auth, access: access.clone() };
    let app = http::router(view, alive, guard, commands.clone());
    let scheme = if web.tls.is_some() { "https" } else { "http" };
    let settings = config.http.clone();
    let served = access.clone();
    let server = tokio::spawn(async move {
        let local = socket.as_ref().map(|socket| &socket.listener);
        let listeners = server::Listeners::new(app, settings, web.tls, stats, served);
        listeners
            .serve(listener, local, async {
                let _ = http_stopped.await;
            })
            .await;
        // The socket's file goes with it.
        drop(socket);
    });
    match &access.socket {
        Some(path) => say!(
            "memprof: daemon serving {scheme}://{serving}/metrics, and the API to root on {}; SIGHUP reloads the config, SIGTERM stops",
            path.display()
        ),
        None => say!(
            "memprof: daemon serving {scheme}://{serving}/metrics; SIGHUP reloads the config, SIGTERM stops"
        ),
    }
    notify::ready();

    loop {
        tokio::select! {
            _ = hangup.recv() => {
                notify::reloading();
                match config::load(args) {
                    Ok(config) => {
                        warn_of_idle_rules(&config, args);
                        let _ = commands.send(tracer::Command::Reload(Box::new(config)));
                    }
                    Err(err) => error!("keeping the old configuration: {err}"),
                }
                notify::ready();
            }
            _ = interrupt.recv() => break,
            _ = terminate.recv() => break,
        }
    }
    info!("stopping: detaching every probe");
    notify::stopping();
    let _ = commands.send(tracer::Command::Shutdown);
    let _ = stop_http.send(());
    tokio::task::spawn_blocking(move || tracer_thread.join()).await.ok();
    let _ = server.await;
    Ok(0)
}
