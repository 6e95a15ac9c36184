//! The HTTP server: routing, authentication, the rollout API, admin routes and
//! graceful shutdown. Proxying itself lives in `proxy`.

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{
    HeaderMap, HeaderValue, AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE, RETRY_AFTER,
};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;

use crate::auth;
use crate::capture::Kind;
use crate::config::{Config, UpstreamConfig};
use crate::error::{ApiError, GatewayError};
use crate::metrics::Metrics;
use crate::proxy;
use crate::store::{NewRollout, Store};
use crate::upstream::Pool;

pub type Body = BoxBody<Bytes, std::io::Error>;
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).map_err(|never| match never {}).boxed()
}

pub fn json_response(status: u16, v: &Value) -> Response<Body> {
    let mut r = Response::new(full(v.to_string()));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

pub fn error_response(e: &ApiError) -> Response<Body> {
    let mut r = Response::new(full(e.body()));
    *r.status_mut() = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some(s) = e.retry_after {
        if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
            r.headers_mut().insert(RETRY_AFTER, v);
        }
    }
    r
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Train,
    Eval,
}

/// What the hot path needs to know about a rollout, cached in memory.
#[derive(Debug)]
pub struct RolloutInfo {
    pub id: String,
    pub mode: Mode,
    pub token_hash: String,
    /// Still `queued`: the first call flips it to `running` in the same commit.
    pub queued: AtomicBool,
}

#[derive(Debug)]
pub struct State {
    pub cfg: Config,
    pub store: Arc<Store>,
    pub pool: Pool,
    pub client: HttpClient,
    pub paused: AtomicBool,
    pub metrics: Metrics,
    pub public_url: String,
    rollouts: RwLock<HashMap<String, Arc<RolloutInfo>>>,
    tokens: RwLock<HashMap<String, String>>,
}

impl State {
    pub fn new(cfg: Config, public_url: String) -> Result<State, GatewayError> {
        cfg.validate()?;
        let store = Arc::new(Store::open(&cfg.db, cfg.sync)?);
        let pool = Pool::new(
            &cfg.upstreams,
            cfg.mark_down_after,
            Duration::from_secs_f64(cfg.down_for_s.max(0.0)),
        )
        .map_err(GatewayError::Config)?;
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(1024)
            .build(connector);
        Ok(State {
            cfg,
            store,
            pool,
            client,
            paused: AtomicBool::new(false),
            metrics: Metrics::default(),
            public_url,
            rollouts: RwLock::new(HashMap::new()),
            tokens: RwLock::new(HashMap::new()),
        })
    }

    fn cached(&self, id: &str) -> Option<Arc<RolloutInfo>> {
        self.rollouts.read().ok().and_then(|m| m.get(id).cloned())
    }

    fn cache(&self, row: &crate::store::RolloutRow) -> Arc<RolloutInfo> {
        let info = Arc::new(RolloutInfo {
            id: row.rollout_id.clone(),
            mode: if row.mode == "eval" {
                Mode::Eval
            } else {
                Mode::Train
            },
            token_hash: row.token_hash.clone(),
            queued: AtomicBool::new(row.status == "queued"),
        });
        if let Ok(mut m) = self.rollouts.write() {
            m.insert(info.id.clone(), info.clone());
        }
        if let Ok(mut m) = self.tokens.write() {
            m.insert(info.token_hash.clone(), info.id.clone());
        }
        info
    }

    fn forget(&self, id: &str) {
        if let Ok(mut m) = self.rollouts.write() {
            m.remove(id);
        }
    }

    /// The rollout with this id, from memory or the store.
    pub async fn rollout(self: &Arc<Self>, id: &str) -> Result<Arc<RolloutInfo>, ApiError> {
        if let Some(r) = self.cached(id) {
            return Ok(r);
        }
        let st = self.clone();
        let key = id.to_string();
        let row = tokio::task::spawn_blocking(move || st.store.get_rollout(&key))
            .await
            .map_err(|e| ApiError::internal(format!("reader task failed: {e}")))??;
        match row {
            Some(row) => Ok(self.cache(&row)),
            None => Err(ApiError::not_found(
                "rollout_not_found",
                format!("rollout {id:?} does not exist; create it with POST /rollouts first"),
            )),
        }
    }

    async fn rollout_by_token(
        self: &Arc<Self>,
        hash: &str,
    ) -> Result<Option<Arc<RolloutInfo>>, ApiError> {
        let id = self.tokens.read().ok().and_then(|m| m.get(hash).cloned());
        if let Some(id) = id {
            return self.rollout(&id).await.map(Some);
        }
        let st = self.clone();
        let key = hash.to_string();
        let row = tokio::task::spawn_blocking(move || st.store.rollout_by_token_hash(&key))
            .await
            .map_err(|e| ApiError::internal(format!("reader task failed: {e}")))??;
        Ok(row.map(|r| self.cache(&r)))
    }

    fn is_admin(&self, headers: &HeaderMap) -> bool {
        match (bearer(headers), &self.cfg.admin_key) {
            (Some(t), Some(k)) => auth::constant_time_eq(t.as_bytes(), k.as_bytes()),
            _ => false,
        }
    }

    fn require_admin(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        if self.is_admin(headers) {
            return Ok(());
        }
        if bearer(headers).is_none() {
            return Err(ApiError::unauthorized(
                "missing admin key; send 'Authorization: Bearer <admin key>'",
            ));
        }
        Err(ApiError::unauthorized(
            "wrong admin key; use the key the gateway was started with",
        ))
    }

    /// Authorizes a rollout-scoped route: the admin key or this rollout's token.
    pub async fn authorize(
        self: &Arc<Self>,
        headers: &HeaderMap,
        id: &str,
    ) -> Result<Arc<RolloutInfo>, ApiError> {
        let token = bearer(headers).ok_or_else(|| {
            ApiError::unauthorized("missing rollout token; send 'Authorization: Bearer <rollout token>' (the OpenAI api_key)")
        })?;
        let info = self.rollout(id).await?;
        if self.is_admin(headers) {
            return Ok(info);
        }
        let hash = auth::token_hash(token);
        if auth::constant_time_eq(hash.as_bytes(), info.token_hash.as_bytes()) {
            return Ok(info);
        }
        if self.rollout_by_token(&hash).await?.is_some() {
            return Err(ApiError::forbidden(format!(
                "this token belongs to another rollout, not {id:?}; use the token returned when {id:?} was created"
            )));
        }
        Err(ApiError::unauthorized(format!(
            "invalid token for rollout {id:?}; use the token returned by POST /rollouts"
        )))
    }

    /// For `/v1/...`: the rollout whose token is the bearer key.
    async fn rollout_from_bearer(
        self: &Arc<Self>,
        headers: &HeaderMap,
    ) -> Result<Arc<RolloutInfo>, ApiError> {
        let token = bearer(headers).ok_or_else(|| {
            ApiError::unauthorized(
                "missing rollout token; set the OpenAI api_key to the rollout token",
            )
        })?;
        match self.rollout_by_token(&auth::token_hash(token)).await? {
            Some(r) => Ok(r),
            None => Err(ApiError::unauthorized(
                "unknown rollout token; set the OpenAI api_key to a token from POST /rollouts, or use base_url /rollouts/{id}/v1",
            )),
        }
    }
}

pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(AUTHORIZATION)?.to_str().ok()?;
    let t = v
        .strip_prefix("Bearer ")
        .or_else(|| v.strip_prefix("bearer "))?
        .trim();
    if t.is_empty() {
        None
    } else {
        Some(t)
    }
}

/// Reads a request body, refusing more than the configured limit (413).
pub async fn read_body(
    st: &State,
    req: Request<Incoming>,
) -> Result<(hyper::http::request::Parts, Bytes), ApiError> {
    let limit = st.cfg.max_body_bytes;
    let too_big = || {
        ApiError::new(
            413,
            "invalid_request_error",
            "request_too_large",
            format!("request body exceeds {limit} bytes; send less, or raise max_body_bytes in the gateway config"),
        )
    };
    if let Some(len) = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse::<u64>().ok())
    {
        if len > limit as u64 {
            return Err(too_big());
        }
    }
    let (parts, body) = req.into_parts();
    match Limited::new(body, limit).collect().await {
        Ok(c) => Ok((parts, c.to_bytes())),
        Err(e) => {
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some()
            {
                Err(too_big())
            } else {
                Err(ApiError::bad_request(
                    "body_read_failed",
                    format!("could not read the request body: {e}"),
                ))
            }
        }
    }
}

fn parse_json(body: &[u8]) -> Result<Value, ApiError> {
    if body.is_empty() {
        return Ok(json!({}));
    }
    serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(
            "invalid_json",
            format!("request body is not valid JSON: {e}"),
        )
    })
}

fn query_params(q: Option<&str>) -> HashMap<String, String> {
    let mut out = HashMap::new();
    for pair in q.unwrap_or("").split('&').filter(|s| !s.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        out.insert(percent_decode(k), percent_decode(v));
    }
    out
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                let h = std::str::from_utf8(&b[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match h {
                    Some(v) => {
                        out.push(v);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

async fn handle(st: Arc<State>, req: Request<Incoming>) -> Response<Body> {
    st.metrics.http_requests.fetch_add(1, Ordering::Relaxed);
    match route(&st, req).await {
        Ok(r) => r,
        Err(e) => {
            st.metrics.error(e.code);
            if e.status >= 500 {
                tracing::warn!(status = e.status, code = e.code, message = %e.message, "request failed");
            } else {
                tracing::debug!(status = e.status, code = e.code, message = %e.message, "request refused");
            }
            error_response(&e)
        }
    }
}

async fn route(st: &Arc<State>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = query_params(req.uri().query());
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let not_found = || {
        ApiError::not_found(
            "route_not_found",
            format!(
                "no route {method} {path}; OpenAI calls go to /rollouts/{{id}}/v1/chat/completions"
            ),
        )
    };
    match (&method, segs.as_slice()) {
        (&Method::GET, ["healthz"]) => Ok(json_response(
            200,
            &json!({"status": "ok", "paused": st.paused.load(Ordering::Relaxed), "weight_version": st.pool.weight_version()}),
        )),
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
        // OpenAI-compatible routes.
        (_, ["rollouts", id, "v1", rest @ ..]) => {
            let info = st.authorize(req.headers(), id).await?;
            openai_route(st, info, &method, rest, req)
                .await
                .map_err(|e| {
                    if e.code == "route_not_found" {
                        not_found()
                    } else {
                        e
                    }
                })
        }
        (_, ["v1", rest @ ..]) => {
            let info = st.rollout_from_bearer(req.headers()).await?;
            openai_route(st, info, &method, rest, req)
                .await
                .map_err(|e| {
                    if e.code == "route_not_found" {
                        not_found()
                    } else {
                        e
                    }
                })
        }
        // Rollout API.
        (&Method::POST, ["rollouts"]) => {
            st.require_admin(req.headers())?;
            let (_, body) = read_body(st, req).await?;
            create_rollout(st, parse_json(&body)?).await
        }
        (&Method::GET, ["rollouts"]) => {
            st.require_admin(req.headers())?;
            let status = query.get("status").cloned();
            let group = query.get("group").cloned();
            let limit = query
                .get("limit")
                .and_then(|s| s.parse::<i64>().ok())
                .unwrap_or(10_000);
            let st2 = st.clone();
            let rows = tokio::task::spawn_blocking(move || {
                st2.store
                    .list_rollouts(status.as_deref(), group.as_deref(), limit)
            })
            .await
            .map_err(|e| ApiError::internal(format!("reader task failed: {e}")))??;
            Ok(json_response(200, &json!({ "rollouts": rows })))
        }
        (&Method::GET, ["rollouts", id]) => {
            st.authorize(req.headers(), id).await?;
            let st2 = st.clone();
            let key = id.to_string();
            let (row, (n_calls, reward)) = tokio::task::spawn_blocking(move || {
                Ok::<_, GatewayError>((
                    st2.store.get_rollout(&key)?,
                    st2.store.rollout_summary(&key)?,
                ))
            })
            .await
            .map_err(|e| ApiError::internal(format!("reader task failed: {e}")))??;
            let row = row.ok_or_else(|| {
                ApiError::not_found(
                    "rollout_not_found",
                    format!("rollout {id:?} does not exist"),
                )
            })?;
            let mut v =
                serde_json::to_value(&row).map_err(|e| ApiError::internal(e.to_string()))?;
            v["n_calls"] = json!(n_calls);
            v["reward"] = json!(reward);
            Ok(json_response(200, &v))
        }
        (&Method::POST, ["rollouts", id, "status"]) => {
            st.require_admin(req.headers())?;
            st.rollout(id).await?;
            let id = id.to_string();
            let (_, body) = read_body(st, req).await?;
            let v = parse_json(&body)?;
            let status = v.get("status").and_then(|s| s.as_str()).unwrap_or("");
            const STATUSES: [&str; 5] = ["queued", "running", "succeeded", "failed", "timed_out"];
            if !STATUSES.contains(&status) {
                return Err(ApiError::bad_request(
                    "invalid_status",
                    format!("status {status:?} is not one of {STATUSES:?}"),
                ));
            }
            st.store.set_status(&id, status).await?;
            st.forget(&id);
            Ok(json_response(
                200,
                &json!({"rollout_id": id, "status": status}),
            ))
        }
        (&Method::POST, ["rollouts", id, "reward"]) => {
            let info = st.authorize(req.headers(), id).await?;
            let (_, body) = read_body(st, req).await?;
            let v = parse_json(&body)?;
            let value = v
                .get("value")
                .and_then(|x| x.as_f64())
                .filter(|x| x.is_finite())
                .ok_or_else(|| {
                    ApiError::bad_request(
                        "invalid_reward",
                        "reward needs a finite number 'value', e.g. {\"value\": 1.0}",
                    )
                })?;
            let source = v.get("source").cloned().unwrap_or(Value::Null);
            if !(source.is_null() || source.is_string()) {
                return Err(ApiError::bad_request(
                    "invalid_reward",
                    "'source' must be a string",
                ));
            }
            let data = json!({"value": value, "source": source, "data": v.get("data").cloned().unwrap_or(Value::Null)});
            let seq = st
                .store
                .insert_event(&info.id, "reward", data.to_string())
                .await?;
            Ok(json_response(
                200,
                &json!({"rollout_id": info.id, "seq": seq, "value": value}),
            ))
        }
        (&Method::POST, ["rollouts", id, "events"]) => {
            let info = st.authorize(req.headers(), id).await?;
            let (_, body) = read_body(st, req).await?;
            let v = parse_json(&body)?;
            let kind = v
                .get("type")
                .and_then(|x| x.as_str())
                .filter(|s| !s.is_empty() && s.len() <= 128)
                .ok_or_else(|| {
                    ApiError::bad_request(
                        "invalid_event",
                        "an event needs a string 'type' (1..128 chars) and optional 'data'",
                    )
                })?;
            if kind == "reward" {
                let value = v
                    .get("data")
                    .and_then(|d| d.get("value"))
                    .and_then(|x| x.as_f64());
                if !value.is_some_and(f64::is_finite) {
                    return Err(ApiError::bad_request(
                        "invalid_reward",
                        "a 'reward' event needs data {\"value\": <finite number>}; or POST /rollouts/{id}/reward",
                    ));
                }
            }
            let data = v.get("data").cloned().unwrap_or(Value::Null).to_string();
            let seq = st.store.insert_event(&info.id, kind, data).await?;
            Ok(json_response(
                200,
                &json!({"rollout_id": info.id, "seq": seq}),
            ))
        }
        (&Method::GET, ["rollouts", id, "events"]) => {
            let info = st.authorize(req.headers(), id).await?;
            let st2 = st.clone();
            let key = info.id.clone();
            let events = tokio::task::spawn_blocking(move || st2.store.events(&key))
                .await
                .map_err(|e| ApiError::internal(format!("reader task failed: {e}")))??;
            Ok(json_response(
                200,
                &json!({"rollout_id": info.id, "events": events}),
            ))
        }
        (&Method::GET, ["rollouts", id, "trace"]) => {
            let info = st.authorize(req.headers(), id).await?;
            let format = query
                .get("format")
                .map(String::as_str)
                .unwrap_or("json")
                .to_string();
            let st2 = st.clone();
            let key = info.id.clone();
            let calls = tokio::task::spawn_blocking(move || st2.store.trace(&key))
                .await
                .map_err(|e| ApiError::internal(format!("reader task failed: {e}")))??;
            match format.as_str() {
                "json" => Ok(json_response(
                    200,
                    &json!({"rollout_id": info.id, "calls": calls}),
                )),
                "columnar" => {
                    let bytes = crate::columnar::encode(&info.id, &calls);
                    let mut r = Response::new(full(bytes));
                    r.headers_mut().insert(
                        CONTENT_TYPE,
                        HeaderValue::from_static("application/x-lightning-trace"),
                    );
                    Ok(r)
                }
                other => Err(ApiError::bad_request(
                    "invalid_format",
                    format!("trace format {other:?} is not 'json' or 'columnar'"),
                )),
            }
        }
        // Admin.
        (&Method::POST, ["admin", "pause"]) => {
            st.require_admin(req.headers())?;
            let (_, body) = read_body(st, req).await?;
            let v = parse_json(&body)?;
            st.paused.store(true, Ordering::SeqCst);
            tracing::info!("paused: new calls get 503");
            let drain = v.get("drain").and_then(|x| x.as_bool()).unwrap_or(true);
            let timeout = v
                .get("timeout_s")
                .and_then(|x| x.as_f64())
                .unwrap_or(60.0)
                .clamp(0.0, 3600.0);
            let mut drained = st.metrics.in_flight.load(Ordering::SeqCst) == 0;
            if drain {
                let deadline = Instant::now() + Duration::from_secs_f64(timeout);
                while !drained && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    drained = st.metrics.in_flight.load(Ordering::SeqCst) == 0;
                }
            }
            let mut s = admin_state(st);
            s["drained"] = json!(drained);
            Ok(json_response(200, &s))
        }
        (&Method::POST, ["admin", "resume"]) => {
            st.require_admin(req.headers())?;
            st.paused.store(false, Ordering::SeqCst);
            tracing::info!("resumed");
            Ok(json_response(200, &admin_state(st)))
        }
        (&Method::GET, ["admin", "state"]) => {
            st.require_admin(req.headers())?;
            Ok(json_response(200, &admin_state(st)))
        }
        (&Method::GET, ["admin", "upstreams"]) => {
            st.require_admin(req.headers())?;
            Ok(json_response(200, &st.pool.describe()))
        }
        (&Method::POST, ["admin", "upstreams"]) => {
            st.require_admin(req.headers())?;
            let (_, body) = read_body(st, req).await?;
            let v = parse_json(&body)?;
            let list = v.get("upstreams").cloned().unwrap_or(v);
            let cfgs: Vec<UpstreamConfig> = serde_json::from_value(list).map_err(|e| {
                ApiError::bad_request(
                    "invalid_upstreams",
                    format!("expected {{\"upstreams\": [{{\"url\": \"http://host:port/v1\", \"weight_version\": N}}]}}: {e}"),
                )
            })?;
            st.pool
                .replace(&cfgs)
                .map_err(|e| ApiError::bad_request("invalid_upstreams", e))?;
            tracing::info!(
                n = cfgs.len(),
                weight_version = st.pool.weight_version(),
                "upstreams replaced"
            );
            Ok(json_response(200, &st.pool.describe()))
        }
        _ => Err(not_found()),
    }
}

fn admin_state(st: &State) -> Value {
    json!({
        "paused": st.paused.load(Ordering::SeqCst),
        "in_flight": st.metrics.in_flight.load(Ordering::SeqCst),
        "weight_version": st.pool.weight_version(),
        "upstreams": st.pool.describe()["upstreams"],
    })
}

async fn openai_route(
    st: &Arc<State>,
    info: Arc<RolloutInfo>,
    method: &Method,
    rest: &[&str],
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let kind = match (method, rest) {
        (&Method::POST, ["chat", "completions"]) => Kind::Chat,
        (&Method::POST, ["completions"]) => Kind::Completion,
        (&Method::GET, ["models"]) => return proxy::models(st).await,
        _ => return Err(ApiError::not_found("route_not_found", "")),
    };
    if st.paused.load(Ordering::SeqCst) {
        let mut e = ApiError::new(
            503,
            "server_error",
            "paused",
            "the gateway is paused for a weight update; retry after the Retry-After seconds",
        );
        e.retry_after = Some(1);
        return Err(e);
    }
    let (parts, body) = read_body(st, req).await?;
    proxy::call(st, info, kind, &parts.headers, body).await
}

async fn create_rollout(st: &Arc<State>, v: Value) -> Result<Response<Body>, ApiError> {
    if !v.is_object() {
        return Err(ApiError::bad_request(
            "invalid_rollout",
            "POST /rollouts takes a JSON object",
        ));
    }
    let mode = v.get("mode").and_then(|x| x.as_str()).unwrap_or("train");
    if mode != "train" && mode != "eval" {
        return Err(ApiError::bad_request(
            "invalid_mode",
            format!("mode {mode:?} is not 'train' or 'eval'"),
        ));
    }
    let group = match v.get("group") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => {
            return Err(ApiError::bad_request(
                "invalid_group",
                "'group' must be a string",
            ))
        }
    };
    let id = match v.get("rollout_id") {
        None | Some(Value::Null) => format!("ro-{}", auth::random_hex(12)),
        Some(Value::String(s)) if auth::valid_rollout_id(s) => s.clone(),
        Some(other) => {
            return Err(ApiError::bad_request(
                "invalid_rollout_id",
                format!("rollout_id {other} must be 1..128 characters of [A-Za-z0-9._:-]"),
            ))
        }
    };
    let task = v.get("task").cloned().unwrap_or(Value::Null);
    let token = auth::rollout_token(st.store.secret(), &id);
    let (row, created) = st
        .store
        .create_rollout(NewRollout {
            id: id.clone(),
            group: group.clone(),
            task: task.to_string(),
            mode: mode.to_string(),
            token_hash: auth::token_hash(&token),
        })
        .await?;
    if !created && (row.group != group || row.mode != mode || row.task != task) {
        return Err(ApiError::new(
            409,
            "invalid_request_error",
            "rollout_exists",
            format!("rollout {id:?} already exists with a different task, group or mode; pick another rollout_id"),
        ));
    }
    st.cache(&row);
    Ok(json_response(
        if created { 201 } else { 200 },
        &json!({
            "rollout_id": id,
            "token": token,
            "base_url": format!("{}/rollouts/{}/v1", st.public_url, id),
            "group": row.group,
            "mode": row.mode,
            "status": row.status,
            "created": created,
        }),
    ))
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
        let listener = TcpListener::bind(&cfg.listen)
            .await
            .map_err(|e| GatewayError::Bind {
                addr: cfg.listen.clone(),
                source: e,
            })?;
        let addr = listener.local_addr()?;
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
        let graceful = hyper_util::server::graceful::GracefulShutdown::new();
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
                    let st = state.clone();
                    let svc = service_fn(move |req| {
                        let st = st.clone();
                        async move { Ok::<_, Infallible>(handle(st, req).await) }
                    });
                    let conn = hyper::server::conn::http1::Builder::new()
                        .keep_alive(true)
                        .serve_connection(TokioIo::new(stream), svc);
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
