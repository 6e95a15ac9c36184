//! The HTTP server: routing, the protocol routes, graceful shutdown.
//!
//! Harness routes exist twice: under `/rollouts/{id}/v1/...` (authorized by
//! the rollout's token or the admin key) and under `/v1/...` (the rollout is
//! the one whose token is the key). Keys come as `Authorization: Bearer` or
//! `x-api-key`. Errors on a protocol route are answered in that protocol's
//! error shape; everything else in OpenAI's.

pub mod admin;
pub mod online;
pub mod rollouts;

use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::service::service_fn;
use hyper::{Method, Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::json;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

use crate::config::Config;
use crate::error::{ApiError, GatewayError};
use crate::http::{error_response, error_response_with, full, json_response, query_params, Body};
use crate::protocol::anthropic_messages::{self, AnthropicMessages};
use crate::protocol::openai::OpenAi;
use crate::protocol::openai_responses::OpenAiResponses;
use crate::protocol::Protocol;
use crate::proxy;
use crate::state::{RolloutInfo, State};
use crate::wire::engine::Kind;

/// The address a request's connection reached (this side of the socket),
/// which `Host` may name (`crate::http::HostRule`).
#[derive(Debug, Clone, Copy)]
struct LocalIp(std::net::IpAddr);

/// The protocol adapters the routes serve (the fuzz targets drive the same ones).
pub(crate) static CHAT: OpenAi = OpenAi(Kind::Chat);
pub(crate) static COMPLETIONS: OpenAi = OpenAi(Kind::Completion);
pub(crate) static RESPONSES: OpenAiResponses = OpenAiResponses;
pub(crate) static MESSAGES: AnthropicMessages = AnthropicMessages;

/// What a path under `.../v1/` asks for.
#[derive(Debug, Clone)]
enum V1 {
    /// Proxy one call in this protocol.
    Call(&'static dyn Protocol),
    /// `GET /v1/models`: the engine's model list.
    Models,
    /// `GET /v1/responses/{id}`: a response kept in the store.
    GetResponse(String),

    /// `POST /v1/messages/count_tokens`: the engine counts the translated prompt.
    CountTokens,
}

/// The route under `.../v1/` and the protocol whose error shape it answers in.
fn v1_route(method: &Method, rest: &[&str]) -> Option<(V1, &'static dyn Protocol)> {
    let call = |p: &'static dyn Protocol| Some((V1::Call(p), p));
    match (method, rest) {
        (&Method::POST, ["chat", "completions"]) => call(&CHAT),
        (&Method::POST, ["completions"]) => call(&COMPLETIONS),
        (&Method::POST, ["responses"]) => call(&RESPONSES),
        (&Method::GET, ["responses", id]) => Some((V1::GetResponse(id.to_string()), &RESPONSES)),

        (&Method::POST, ["messages"]) => call(&MESSAGES),
        (&Method::POST, ["messages", "count_tokens"]) => Some((V1::CountTokens, &MESSAGES)),
        (&Method::GET, ["models"]) => Some((V1::Models, &CHAT as &dyn Protocol)),
        _ => None,
    }
}

async fn handle(st: Arc<State>, req: Request<Incoming>) -> Response<Body> {
    st.metrics.http_requests.fetch_add(1, Ordering::Relaxed);
    // The protocol of a harness route decides the error shape, auth errors included.
    let segs: Vec<&str> = req.uri().path().trim_matches('/').split('/').collect();
    let proto = match segs.as_slice() {
        ["rollouts", _, "v1", rest @ ..] | ["v1", rest @ ..] => {
            v1_route(req.method(), rest).map(|(_, p)| p)
        }
        _ => None,
    };
    match route(&st, req).await {
        Ok(r) => r,
        Err(e) => {
            st.metrics.error(e.code);
            if e.status >= 500 {
                tracing::warn!(status = e.status, code = e.code, message = %e.message, "request failed");
            } else {
                tracing::debug!(status = e.status, code = e.code, message = %e.message, "request refused");
            }
            match proto {
                Some(p) => error_response_with(&e, p.error_body(&e)),
                None => error_response(&e),
            }
        }
    }
}

async fn route(st: &Arc<State>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = query_params(req.uri().query());
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let local = req.extensions().get::<LocalIp>().map(|l| l.0);
    st.hosts.check(req.headers(), local)?;
    // Every method that carries a body here is a POST (DELETE carries none).
    if method == Method::POST {
        crate::http::json_content_type(req.headers())?;
    }
    let not_found = || {
        ApiError::not_found(
            "route_not_found",
            format!(
                "no route {method} {path}; harness calls go to /rollouts/{{id}}/v1/chat/completions (or /completions, /responses, /messages)"
            ),
        )
    };
    match (&method, segs.as_slice()) {
        (&Method::GET, ["healthz"] | ["health"]) => Ok(health(st)),
        // Harnesses probe the base URL they were given: Claude Code sends
        // `HEAD` to its ANTHROPIC_BASE_URL (`HEAD /`, or `HEAD /rollouts/{id}`
        // for a rollout's URL, 2.1.197). A reachable gateway, not a routing
        // error: 200 without authentication, the same for any id, so the
        // probe says nothing about which rollouts exist.
        (&Method::HEAD | &Method::GET, [""]) | (&Method::HEAD, ["rollouts", _]) => {
            Ok(json_response(200, &json!({"status": "ok"})))
        }
        (&Method::GET, ["metrics"]) => {
            let text = st.metrics.render(
                &st.store.stats,
                st.paused.load(Ordering::Relaxed),
                st.pool.weight_version(),
            );
            let mut r = Response::new(full(text));
            r.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            Ok(r)
        }
        // Harness routes.
        (_, ["rollouts", id, "v1", rest @ ..]) => {
            let info = st.authorize(req.headers(), id).await?;
            let (v1, _) = v1_route(&method, rest).ok_or_else(not_found)?;
            harness_route(st, info, v1, req).await
        }
        (&Method::POST, ["v1", "feedback"]) => online::feedback(st, req).await,
        (_, ["v1", rest @ ..]) => {
            let info = st.rollout_from_key(req.headers()).await?;
            let (v1, _) = v1_route(&method, rest).ok_or_else(not_found)?;
            harness_route(st, info, v1, req).await
        }
        // Rollout API.
        (&Method::POST, ["rollouts"]) => rollouts::create(st, req).await,
        (&Method::GET, ["rollouts"]) => rollouts::list(st, req, &query).await,
        (&Method::GET, ["rollouts", id]) => rollouts::get(st, id, req).await,
        (&Method::POST, ["rollouts", id, "status"]) => rollouts::set_status(st, id, req).await,
        (&Method::POST, ["rollouts", id, "reward"]) => rollouts::reward(st, id, req).await,
        (&Method::POST, ["rollouts", id, "events"]) => rollouts::post_event(st, id, req).await,
        (&Method::GET, ["rollouts", id, "events"]) => rollouts::events(st, id, req).await,
        (&Method::GET, ["rollouts", id, "trace"]) => rollouts::trace(st, id, req, &query).await,
        // Admin.
        (&Method::POST, ["admin", "pause"]) => admin::pause(st, req).await,
        (&Method::POST, ["admin", "resume"]) => admin::resume(st, req).await,
        (&Method::GET, ["admin", "state"]) => admin::state(st, req).await,
        (&Method::GET, ["admin", "upstreams"]) => admin::upstreams(st, req).await,
        (&Method::POST, ["admin", "upstreams"]) => admin::replace_upstreams(st, req).await,
        (&Method::POST, ["admin", "keys"]) => online::create_key(st, req).await,
        (&Method::GET, ["admin", "keys"]) => online::list_keys(st, req).await,
        (&Method::DELETE, ["admin", "keys", id]) => online::revoke_key(st, id, req).await,
        (&Method::POST, ["admin", "online", "sweep"]) => online::sweep(st, req).await,
        (&Method::POST, ["admin", "online", "trained"]) => online::mark_trained(st, req).await,
        (&Method::GET, ["admin", "online", "sessions"]) => {
            online::list_sessions(st, req, &query).await
        }
        _ => Err(not_found()),
    }
}

async fn harness_route(
    st: &Arc<State>,
    info: Arc<RolloutInfo>,
    v1: V1,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    match v1 {
        V1::Models => proxy::forward::models(st).await,
        V1::GetResponse(id) => {
            // An application key's responses live in its sessions, not in
            // its `online:key-…` stand-in rollout.
            let object = match &info.online {
                Some(o) => crate::online::kept_object(st, &o.key.id, &id).await?,
                None => {
                    let key = id.clone();
                    let row = st.read_store(move |s| s.kept(&info.id, &key)).await?;
                    // Rows with no public object (Messages' tool-call texts) are not responses.
                    row.map(|(object, _)| object).filter(|o| !o.is_null())
                }
            };
            match object {
                Some(object) => Ok(json_response(200, &object)),
                None => Err(ApiError::not_found(
                    "response_not_found",
                    format!("no stored response {id:?} for this key (responses created with store: false are not kept)"),
                )),
            }
        }
        V1::CountTokens => {
            let (_, body) = st.read_body(req).await?;
            count_tokens(st, &info, body).await
        }
        V1::Call(proto) => {
            st.check_not_paused()?;
            st.check_store_writable()?;
            // Admitted before the body is read: a refused call costs no memory.
            let permit = st.limits.admit_call(&info.id)?;
            let (parts, body) = st.read_body(req).await?;
            let info = crate::online::bind_call(info, &parts.headers, &body)?;
            proxy::call(st, info, proto, &parts.headers, body, permit).await
        }
    }
}

/// `GET /healthz`: 503 while the gateway refuses calls because its store
/// cannot write; `store.error` says why.
fn health(st: &State) -> Response<Body> {
    let h = &st.store.stats.health;
    let refusing = st.check_store_writable().is_err();
    let status = match (h.writable(), refusing) {
        (true, _) => "ok",
        (false, true) => "store_unwritable",
        (false, false) => "serving_unrecorded",
    };
    json_response(
        if refusing { 503 } else { 200 },
        &json!({
            "status": status,
            "paused": st.paused.load(Ordering::Relaxed),
            "weight_version": st.pool.weight_version(),
            "store": {"writable": h.writable(), "error": h.error()},
        }),
    )
}

/// While the store cannot write, a one-row probe every `STORE_PROBE`
/// notices the disk recovering (nothing else writes while calls are refused).
async fn store_watch(st: Arc<State>) {
    const STORE_PROBE: Duration = Duration::from_millis(250);
    loop {
        tokio::time::sleep(STORE_PROBE).await;
        if !st.store.stats.health.writable() {
            let _ = st.store.probe().await;
        }
    }
}

/// A write past `RLIMIT_FSIZE` fails with `EFBIG` (the store reports the disk
/// full) instead of killing the process with `SIGXFSZ`.
/// tokio's handler stays installed for the life of the process (must run
/// inside the runtime).
fn ignore_sigxfsz() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Err(e) = signal(SignalKind::from_raw(libc::SIGXFSZ)) {
            tracing::warn!(error = %e, "cannot catch SIGXFSZ; a file-size limit would kill the gateway");
        }
    }
}

/// Anthropic's `count_tokens`: the exact number of prompt tokens the engine
/// would see for this request, counted by the engine's own `/tokenize` on the
/// same translation `POST /v1/messages` makes (so the template, the tools and
/// the generation prompt are all counted).
async fn count_tokens(
    st: &Arc<State>,
    info: &RolloutInfo,
    body: bytes::Bytes,
) -> Result<Response<Body>, ApiError> {
    let v = crate::http::parse_json(&body)?;
    let mut req = anthropic_messages::tokenize_request(v)?;
    anthropic_messages::restore_arguments(&mut req, &st.tool_args);
    let payload = bytes::Bytes::from(serde_json::Value::Object(req).to_string());
    let (status, answer) = proxy::forward::tokenize(st, &info.id, payload).await?;
    if !status.is_success() {
        let e = anthropic_messages::engine_error(status.as_u16(), &answer);
        return Ok(json_response(status.as_u16(), &e));
    }
    match anthropic_messages::count_tokens_answer(&answer) {
        Ok(v) => Ok(json_response(200, &v)),
        Err(m) => Err(ApiError::new(502, "server_error", "upstream_failed", m)),
    }
}

/// A bound, not yet running server.
#[derive(Debug)]
pub struct Server {
    state: Arc<State>,
    listener: TcpListener,
    addr: SocketAddr,
}

impl Server {
    /// Opens the store and binds the listener (must run inside a tokio runtime).
    pub async fn bind(cfg: Config) -> Result<Server, GatewayError> {
        cfg.validate()?;
        ignore_sigxfsz();
        let listener = TcpListener::bind(&cfg.listen)
            .await
            .map_err(|e| GatewayError::Bind {
                addr: cfg.listen.clone(),
                source: e,
            })?;
        let addr = listener.local_addr()?;
        // `validate` judged the name; this judges the address it resolved to.
        let keyless = cfg.admin_key.as_deref().is_none_or(str::is_empty);
        if keyless && !addr.ip().is_loopback() {
            return Err(GatewayError::Config(format!(
                "insecure_local (no admin key) bound {addr}, which is not a loopback address; listen on 127.0.0.1 or set admin_key"
            )));
        }
        let public_url = cfg
            .public_url
            .clone()
            .map(|u| u.trim_end_matches('/').to_string())
            .unwrap_or_else(|| format!("http://{addr}"));
        let state = Arc::new(State::new(cfg, public_url)?);
        Ok(Server {
            state,
            listener,
            addr,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn state(&self) -> Arc<State> {
        self.state.clone()
    }

    /// Serves until `shutdown` resolves, then stops accepting, lets in-flight
    /// calls finish (up to `drain_timeout_s`) and flushes the store.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), GatewayError> {
        let Server {
            state,
            listener,
            addr,
        } = self;
        tracing::info!(%addr, db = %state.store.path().display(), upstreams = state.cfg.upstreams.len(), "gateway listening");
        let sweeper = tokio::spawn(crate::online::sweeper(state.clone()));
        let watch = tokio::spawn(store_watch(state.clone()));
        let graceful = hyper_util::server::graceful::GracefulShutdown::new();
        // hyper starts the header clock whenever a connection waits for a
        // request, so it bounds a slow head and an idle keep-alive alike.
        let mut http = hyper::server::conn::http1::Builder::new();
        http.keep_alive(true)
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(Duration::from_secs_f64(state.cfg.header_read_timeout_s));
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                accepted = listener.accept() => {
                    let (stream, _) = match accepted {
                        Ok(x) => x,
                        Err(e) => {
                            tracing::warn!(error = %e, "accept failed");
                            tokio::time::sleep(Duration::from_millis(10)).await;
                            continue;
                        }
                    };
                    let _ = stream.set_nodelay(true);
                    let local = stream.local_addr().ok().map(|a| LocalIp(a.ip()));
                    let st = state.clone();
                    let svc = service_fn(move |mut req: Request<Incoming>| {
                        let st = st.clone();
                        if let Some(l) = local {
                            req.extensions_mut().insert(l);
                        }
                        async move { Ok::<_, Infallible>(handle(st, req).await) }
                    });
                    let conn = http.serve_connection(TokioIo::new(stream), svc);
                    let conn = graceful.watch(conn);
                    tokio::spawn(async move {
                        if let Err(e) = conn.await {
                            tracing::debug!(error = %e, "connection ended with an error");
                        }
                    });
                }
                _ = &mut shutdown => break,
            }
        }
        drop(listener);
        sweeper.abort();
        watch.abort();
        tracing::info!("shutting down: draining in-flight calls");
        let drain = Duration::from_secs_f64(state.cfg.drain_timeout_s.max(0.0));
        if tokio::time::timeout(drain, graceful.shutdown())
            .await
            .is_err()
        {
            tracing::warn!("drain timed out; closing remaining connections");
        }
        let _ = state.store.barrier().await;
        let store = state.store.clone();
        let _ = tokio::task::spawn_blocking(move || store.close()).await;
        tracing::info!("gateway stopped; store flushed");
        Ok(())
    }
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// Builds a multi-threaded runtime and serves until SIGINT/SIGTERM.
pub fn serve_blocking(cfg: Config, threads: usize) -> Result<(), GatewayError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let server = Server::bind(cfg).await?;
        server.run(shutdown_signal()).await
    })
}
