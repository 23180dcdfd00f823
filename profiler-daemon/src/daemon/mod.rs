//! `memprof daemon`: traces the processes its rules match, serves /metrics and the HTTP API,
//! reloads its config on SIGHUP and detaches every probe on SIGTERM or SIGINT.

mod config;
mod discovery;
mod http;
mod metrics;
mod tracer;
mod view;

use std::sync::{atomic::AtomicBool, mpsc, Arc, RwLock};

use anyhow::Context as _;
use tokio::signal::unix::{signal, SignalKind};
use tracing::{error, info};

use crate::cli::DaemonArgs;

pub async fn run(args: &DaemonArgs) -> anyhow::Result<i32> {
    let config = config::load(args)?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}; choose another address with --listen", config.listen))?;
    let view = Arc::new(RwLock::new(view::DaemonView::default()));
    let alive = Arc::new(AtomicBool::new(false));
    let tracer = tracer::Tracer::new(config.clone(), view.clone(), alive.clone())?;
    let (commands, receiver) = mpsc::channel();
    let tracer_thread = std::thread::Builder::new().name("tracer".into()).spawn(move || tracer.run(receiver))?;

    let (stop_http, http_stopped) = tokio::sync::oneshot::channel::<()>();
    let server = axum::serve(listener, http::router(view, alive)).with_graceful_shutdown(async {
        let _ = http_stopped.await;
    });
    let server = tokio::spawn(async move { server.await });
    eprintln!("memprof: daemon serving http://{}/metrics; SIGHUP reloads the config, SIGTERM stops", config.listen);

    let mut hangup = signal(SignalKind::hangup())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    loop {
        tokio::select! {
            _ = hangup.recv() => match config::load(args) {
                Ok(config) => {
                    let _ = commands.send(tracer::Command::Reload(Box::new(config)));
                }
                Err(err) => error!("keeping the old configuration: {err}"),
            },
            _ = interrupt.recv() => break,
            _ = terminate.recv() => break,
        }
    }
    info!("stopping: detaching every probe");
    let _ = commands.send(tracer::Command::Shutdown);
    let _ = stop_http.send(());
    tokio::task::spawn_blocking(move || tracer_thread.join()).await.ok();
    if let Ok(Err(err)) = server.await {
        error!("http server: {err}");
    }
    Ok(0)
}
