//! The HTTP listener: /metrics for Prometheus, and a small API and page for the on-call engineer.
//! Every handler reads the published `DaemonView` and none touches the kernel, but
//! `/api/v1/inspect`, which asks the tracer thread for an inspection. `server` owns the
//! connections and their limits, `guard` what a request must pass first.

use std::{
    collections::HashSet,
    fmt::Write as _,
    future::Future,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, RwLock,
    },
};

use axum::{
    body::Body,
    extract::{RawQuery, State},
    http::{header, HeaderMap, StatusCode},
    middleware,
    response::{Html, IntoResponse, Response},
    routing::get,
    Json, Router,
};
use prometheus_client::registry::Registry;
use serde::Serialize;

use super::{
    exposition::{self, Format as Exposition},
    guard::{self, Guard},
    heavy::{self, Busy},
    host, metrics, query,
    server::{Refusal, Stats},
    tracer::{Command, InspectFailure},
    view::{DaemonView, TargetView},
    wakeup::Commands,
};
use crate::format::{self, escape, pprof, Format};

struct Shared {
    view: Arc<RwLock<DaemonView>>,
    builder: heavy::Builder,
    stats: Arc<Stats>,
    registry: Registry,
    /// False once the tracer thread has stopped: the view is then frozen and probes detached.
    tracer_alive: Arc<AtomicBool>,
    /// To the tracer thread, for inspections.
    commands: Commands<Command>,
    /// The pids an inspection is asked for or under way of.
    inspecting: Mutex<HashSet<u32>>,
    /// `access.inspect`: false refuses every inspection.
    inspect: bool,
}

type AppState = State<Arc<Shared>>;

pub fn router(
    view: Arc<RwLock<DaemonView>>,
    tracer_alive: Arc<AtomicBool>,
    guard: Guard,
    commands: Commands<Command>,
) -> Router {
    let mut registry = metrics::registry(view.clone());
    metrics::register_http(&mut registry, guard.stats.clone());
    let shared = Arc::new(Shared {
        registry,
        view,
        tracer_alive,
        builder: heavy::Builder::default(),
        stats: guard.stats.clone(),
        commands,
        inspecting: Mutex::default(),
        inspect: guard.access.inspect,
    });
    Router::new()
        .route("/", get(index))
        .route("/metrics", get(scrape))
        .route("/api/v1/targets", get(targets))
        .route("/api/v1/leaks", get(leaks))
        .route("/api/v1/inspect", get(inspect))
        .route("/debug/pprof/heap", get(heap_profile))
        .route("/debug/pprof/allocs", get(allocs_profile))
        .route("/api/v1/flamegraph", get(flamegraph))
        .route("/report", get(html_report))
        .route("/-/healthy", get(healthy))
        .route("/-/ready", get(ready))
        .fallback(|| async { error(StatusCode::NOT_FOUND, "no such path; see / for what memprof serves") })
        .method_not_allowed_fallback(|| async { error(StatusCode::METHOD_NOT_ALLOWED, "only GET is served") })
        .with_state(shared)
        .layer(middleware::from_fn_with_state(guard, guard::check))
}

fn read(shared: &Shared) -> DaemonView {
    shared.view.read().unwrap_or_else(|e| e.into_inner()).clone()
}

fn error(status: StatusCode, message: &str) -> Response {
    #[derive(Serialize)]
    struct Body<'a> {
        error: &'a str,
    }
    (status, Json(Body { error: message })).into_response()
}

async fn scrape(State(shared): AppState, headers: HeaderMap) -> Response {
    let format = Exposition::negotiate(headers.get(header::ACCEPT).and_then(|accept| accept.to_str().ok()));
    match exposition::encode(&shared.registry, format) {
        Ok(text) => ([(header::CONTENT_TYPE, format.content_type()), (header::VARY, "Accept")], text).into_response(),
        Err(_) => error(StatusCode::INTERNAL_SERVER_ERROR, "encoding the metrics failed"),
    }
}

async fn healthy(State(shared): AppState) -> Response {
    if shared.tracer_alive.load(Ordering::Relaxed) {
        "memprof is healthy\n".into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "memprof's tracer has stopped; see its log\n").into_response()
    }
}

async fn ready(State(shared): AppState) -> Response {
    if read(&shared).ready {
        "memprof is ready\n".into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "memprof is starting\n").into_response()
    }
}

#[derive(Serialize)]
struct TargetSummary {
    pid: u32,
    comm: String,
    /// Seconds since the Unix epoch.
    attached_at: f64,
    inuse_bytes: u64,
    inuse_objects: u64,
    leak_candidate_bytes: u64,
    double_frees: u64,
    /// See the report's `double_frees_unconfirmed`.
    double_frees_unconfirmed: u64,
}

async fn targets(State(shared): AppState) -> Json<Vec<TargetSummary>> {
    let view = read(&shared);
    Json(
        view.targets
            .values()
            .map(|t| TargetSummary {
                pid: t.pid,
                comm: t.comm.clone(),
                attached_at: t.attached_at,
                inuse_bytes: t.report.totals.outstanding_bytes,
                inuse_objects: t.report.totals.outstanding_allocations,
                leak_candidate_bytes: t.leak_candidate_bytes,
                double_frees: t.double_frees,
                double_frees_unconfirmed: t.report.double_frees_unconfirmed,
            })
            .collect(),
    )
}

/// What the tracer published about the process that `query` names as `pid=N`, or the status and
/// message to refuse with.
fn target(shared: &Shared, query: Option<String>, path: &str) -> Result<Arc<TargetView>, (StatusCode, String)> {
    let pid = query::pid(query.as_deref(), path).map_err(|err| (StatusCode::BAD_REQUEST, err.to_string()))?;
    let view = shared.view.read().unwrap_or_else(|e| e.into_inner());
    match view.targets.get(&pid) {
        Some(target) => Ok(target.clone()),
        None => Err((StatusCode::NOT_FOUND, format!("pid {pid} is not traced; /api/v1/targets lists those that are"))),
    }
}

/// The answer for the process `query` names, from `answer`, or why there is none.
async fn heavy<F: Future<Output = Result<Response, Busy>>>(
    shared: &Shared,
    query: Option<String>,
    path: &str,
    answer: impl FnOnce(Arc<TargetView>) -> F,
) -> Response {
    let target = match target(shared, query, path) {
        Ok(target) => target,
        Err((status, message)) => return error(status, &message),
    };
    answer(target).await.unwrap_or_else(|busy| refuse_busy(shared, busy))
}

/// A heavy answer that found no turn, or failed: 503, counted.
fn refuse_busy(shared: &Shared, busy: Busy) -> Response {
    shared.stats.refuse(Refusal::Busy);
    error(StatusCode::SERVICE_UNAVAILABLE, &busy.to_string())
}

async fn leaks(State(shared): AppState, RawQuery(query): RawQuery) -> Response {
    let builder = &shared.builder;
    heavy(&shared, query, "/api/v1/leaks", |target| async move {
        let body = builder.json(target).await?;
        Ok(([(header::CONTENT_TYPE, "application/json")], Body::new(body)).into_response())
    })
    .await
}

/// `/api/v1/inspect?pid=N[&heuristics=SET]`: the report of a traced process with an inspection made now (docs:
/// guide/inspect.md#inspect-what-is-really-lost), as `/api/v1/leaks` gives it. Made by the tracer thread, which owns the kernel's
/// maps and stops the process; one at a time per process. Only for those `guard` lets through
/// to every path, and not at all with `access.inspect = false`.
async fn inspect(State(shared): AppState, RawQuery(query): RawQuery) -> Response {
    let asked =
        query::pid(query.as_deref(), "/api/v1/inspect").and_then(|pid| Ok((pid, query::heuristics(query.as_deref())?)));
    let (pid, heuristics) = match asked {
        Ok(asked) => asked,
        Err(err) => return error(StatusCode::BAD_REQUEST, &err.to_string()),
    };
    if !shared.inspect {
        let message = format!(
            "inspection through the daemon is switched off (inspect = false in its config's [access] table); \
             `memprof attach --pid {pid} --inspect --duration SECS` inspects without it"
        );
        return error(StatusCode::FORBIDDEN, &message);
    }
    let Some(_inspecting) = Inspecting::start(&shared.inspecting, pid) else {
        let message = format!("pid {pid} is being inspected already; ask again once that inspection has answered");
        return error(StatusCode::CONFLICT, &message);
    };
    let (reply, answer) = tokio::sync::oneshot::channel();
    let stopped = || error(StatusCode::SERVICE_UNAVAILABLE, "memprof's tracer has stopped; see its log");
    if shared.commands.send(Command::Inspect { pid, heuristics, reply }).is_err() {
        return stopped();
    }
    match answer.await {
        Ok(Ok(view)) => match shared.builder.json(Arc::new(view)).await {
            Ok(body) => ([(header::CONTENT_TYPE, "application/json")], Body::new(body)).into_response(),
            Err(busy) => refuse_busy(&shared, busy),
        },
        Ok(Err(failure @ InspectFailure::NotTraced(_))) => error(StatusCode::NOT_FOUND, &failure.to_string()),
        Ok(Err(failure @ InspectFailure::NoBlocks { .. })) => error(StatusCode::CONFLICT, &failure.to_string()),
        Ok(Err(failure)) => error(StatusCode::INTERNAL_SERVER_ERROR, &failure.to_string()),
        Err(_) => stopped(),
    }
}

/// A pid in `Shared::inspecting` until dropped (the answer sent, or the client gone).
struct Inspecting<'a> {
    set: &'a Mutex<HashSet<u32>>,
    pid: u32,
}

impl<'a> Inspecting<'a> {
    /// None when `pid` is in the set already.
    fn start(set: &'a Mutex<HashSet<u32>>, pid: u32) -> Option<Self> {
        // The lock is released before a guard exists: one made and dropped under it would deadlock.
        let inserted = set.lock().unwrap_or_else(|e| e.into_inner()).insert(pid);
        inserted.then(|| Self { set, pid })
    }
}

impl Drop for Inspecting<'_> {
    fn drop(&mut self) {
        self.set.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.pid);
    }
}

async fn flamegraph(State(shared): AppState, RawQuery(query): RawQuery) -> Response {
    let builder = &shared.builder;
    heavy(&shared, query, "/api/v1/flamegraph", |target| async move {
        let built = target.clone();
        let svg =
            builder.once(&target.built.flamegraph, move || format::render(&built.report, Format::Flamegraph)).await?;
        Ok(([(header::CONTENT_TYPE, "image/svg+xml")], svg).into_response())
    })
    .await
}

async fn html_report(State(shared): AppState, RawQuery(query): RawQuery) -> Response {
    let builder = &shared.builder;
    heavy(&shared, query, "/report", |target| async move {
        let built = target.clone();
        let page = builder.once(&target.built.html, move || format::render(&built.report, Format::Html)).await?;
        Ok(([(header::CONTENT_TYPE, "text/html; charset=utf-8")], page).into_response())
    })
    .await
}

/// `/debug/pprof/heap?pid=N`, as Go serves it for `go tool pprof`: in-use bytes by default;
/// without `pid`, the profile of every traced process (see `host`).
async fn heap_profile(State(shared): AppState, RawQuery(query): RawQuery) -> Response {
    profile(&shared, query, "/debug/pprof/heap", pprof::DefaultType::InuseSpace).await
}

/// `/debug/pprof/allocs?pid=N`: the same samples, allocated bytes by default.
async fn allocs_profile(State(shared): AppState, RawQuery(query): RawQuery) -> Response {
    profile(&shared, query, "/debug/pprof/allocs", pprof::DefaultType::AllocSpace).await
}

async fn profile(shared: &Shared, query: Option<String>, path: &str, default: pprof::DefaultType) -> Response {
    if matches!(query::pid(query.as_deref(), path), Err(query::QueryError::MissingPid(_))) {
        return host_profile(shared, path, default).await;
    }
    let builder = &shared.builder;
    heavy(shared, query, path, |target| async move {
        let built = target.clone();
        let cell = match default {
            pprof::DefaultType::InuseSpace => &target.built.heap,
            _ => &target.built.allocs,
        };
        let profile = builder
            .once(cell, move || {
                // Their allocations count too.
                let part = pprof::Part::labelled(&built.report, &built.freed_stacks, built.cgroup.as_deref());
                pprof::render_parts(&[part], default)
            })
            .await?;
        let name = path.rsplit('/').next().unwrap_or("profile");
        let headers = [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (header::CONTENT_DISPOSITION, format!("attachment; filename=\"{name}-{}.pb.gz\"", target.pid)),
        ];
        Ok((headers, profile).into_response())
    })
    .await
}

/// Every traced process's samples in one profile, once an interval.
async fn host_profile(shared: &Shared, path: &str, default: pprof::DefaultType) -> Response {
    let (targets, profiles) = {
        let view = shared.view.read().unwrap_or_else(|e| e.into_inner());
        (view.targets.values().cloned().collect::<Vec<_>>(), view.host_profiles.clone())
    };
    match shared.builder.once(profiles.cell(default), move || host::render(&targets, default)).await {
        Ok(profile) => {
            let name = path.rsplit('/').next().unwrap_or("profile");
            let headers = [
                (header::CONTENT_TYPE, "application/octet-stream".to_string()),
                (header::CONTENT_DISPOSITION, format!("attachment; filename=\"{name}-host.pb.gz\"")),
            ];
            (headers, profile).into_response()
        }
        Err(busy) => refuse_busy(shared, busy),
    }
}

async fn index(State(shared): AppState) -> Html<String> {
    let view = read(&shared);
    let mut page = String::from(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>memprof</title></head><body>\n\
         <h1>memprof</h1>\n<p><a href=\"/metrics\">/metrics</a> · <a href=\"/api/v1/targets\">/api/v1/targets</a></p>\n\
         <table border=\"1\" cellpadding=\"4\">\n<tr><th>pid</th><th>command</th><th>in use (bytes)</th>\
         <th>allocations in use</th><th>leak candidates (bytes)</th><th>double frees</th><th>report</th></tr>\n",
    );
    for t in view.targets.values() {
        let _ = writeln!(
            page,
            "<tr><td>{pid}</td><td>{comm}</td><td>{bytes}</td><td>{objects}</td><td>{leak}</td><td>{df}</td>\
             <td><a href=\"/report?pid={pid}\">report</a> · <a href=\"/api/v1/flamegraph?pid={pid}\">flame graph</a> · \
             <a href=\"/api/v1/leaks?pid={pid}\">leaks (JSON)</a></td></tr>",
            pid = t.pid,
            comm = escape(&t.comm),
            bytes = t.report.totals.outstanding_bytes,
            objects = t.report.totals.outstanding_allocations,
            leak = t.leak_candidate_bytes,
            df = t.double_frees,
        );
    }
    page.push_str("</table>\n</body></html>\n");
    Html(page)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_inspection_at_a_time_per_pid() {
        let set = Mutex::default();
        let first = Inspecting::start(&set, 7).expect("the first");
        assert!(Inspecting::start(&set, 7).is_none(), "a second of the same pid");
        let other = Inspecting::start(&set, 8).expect("another pid's");
        drop(first);
        assert!(Inspecting::start(&set, 7).is_some(), "once the first has answered");
        drop(other);
    }
}
