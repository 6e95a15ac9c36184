//! Shared server state: configuration, the store, the upstream pool, the HTTP
//! client, the pause flag, metrics and the in-memory rollout cache, plus the
//! credential checks every route uses.

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::HeaderMap;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use crate::auth;
use crate::config::{Config, StoreFailure};
use crate::error::{ApiError, GatewayError};
use crate::http::api_key;
use crate::metrics::Metrics;
use crate::store::{reader, AppKey, OnlineCall, Store};
use crate::upstream::Pool;

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub use crate::store::Mode;

/// What the hot path needs to know about a rollout, cached in memory.
#[derive(Debug)]
pub struct RolloutInfo {
    pub id: String,
    pub mode: Mode,
    pub token_hash: String,
    /// Still `queued`: the first call flips it to `running` in the same commit.
    pub queued: AtomicBool,
    /// An application key's call (online mode): its session is resolved at commit.
    pub online: Option<Arc<OnlineCall>>,
}

#[derive(Debug)]
pub struct State {
    pub cfg: Config,
    pub store: Arc<Store>,
    pub pool: Pool,
    pub client: HttpClient,
    pub paused: AtomicBool,
    pub metrics: Metrics,
    pub limits: Arc<crate::limits::Limits>,
    pub public_url: String,
    /// The `Host` names served (`crate::http::HostRule`).
    pub hosts: crate::http::HostRule,
    rollouts: RwLock<HashMap<String, Arc<RolloutInfo>>>,
    tokens: RwLock<HashMap<String, String>>,
    pub online_keys: Keys,
    /// Tool-call arguments as the engine generated them (`protocol::ToolArgs`).
    pub tool_args: Arc<crate::protocol::ToolArgs>,
}

impl State {
    pub fn new(cfg: Config, public_url: String) -> Result<State, GatewayError> {
        cfg.validate()?;
        let secret = crate::store::SecretSource::configured(cfg.token_secret_file.as_deref())?;
        let store = Arc::new(Store::open_layout(
            &cfg.db,
            cfg.sync,
            secret,
            cfg.store_layout,
        )?);
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
            limits: Arc::new(crate::limits::Limits::new(&cfg)),
            hosts: crate::http::HostRule::new(&cfg.listen, Some(&public_url), &cfg.allowed_hosts),
            cfg,
            store,
            pool,
            client,
            paused: AtomicBool::new(false),
            metrics: Metrics::default(),
            public_url,
            rollouts: RwLock::new(HashMap::new()),
            tokens: RwLock::new(HashMap::new()),
            online_keys: Keys::default(),
            tool_args: Arc::default(),
        })
    }

    /// Reads a request body up to `max_body_bytes` (413 above), the client
    /// never silent longer than `idle_timeout_s` (408).
    pub async fn read_body(
        &self,
        req: hyper::Request<hyper::body::Incoming>,
    ) -> Result<(hyper::http::request::Parts, Bytes), ApiError> {
        let idle = Duration::from_secs_f64(self.cfg.idle_timeout_s);
        let total = Duration::from_secs_f64(self.cfg.body_timeout_s);
        crate::http::read_body(self.cfg.max_body_bytes, idle, total, req).await
    }

    /// An admin route's JSON body: the admin key is checked before a byte of
    /// the body is read, so an unauthenticated client cannot make it buffer.
    pub async fn admin_json(
        &self,
        req: hyper::Request<hyper::body::Incoming>,
    ) -> Result<serde_json::Value, ApiError> {
        self.require_admin(req.headers())?;
        let (_, body) = self.read_body(req).await?;
        crate::http::parse_json(&body)
    }

    /// 503 with `Retry-After` while paused for a weight update.
    pub fn check_not_paused(&self) -> Result<(), ApiError> {
        if !self.paused.load(std::sync::atomic::Ordering::SeqCst) {
            return Ok(());
        }
        let mut e = ApiError::new(
            503,
            "server_error",
            "paused",
            "the gateway is paused for a weight update; retry after the Retry-After seconds",
        );
        e.retry_after = Some(1);
        Err(e)
    }

    /// 503 with `Retry-After` while the store cannot write and the config
    /// says to refuse work it cannot record (`on_store_failure = "refuse"`).
    pub fn check_store_writable(&self) -> Result<(), ApiError> {
        let health = &self.store.stats.health;
        if health.writable() || self.cfg.on_store_failure == StoreFailure::Serve {
            return Ok(());
        }
        Err(ApiError::store_unavailable(format!(
            "the trace store cannot write ({}), so the gateway takes no call it cannot record; retry after the Retry-After seconds (free disk space or fix the file's permissions; the gateway recovers by itself)",
            health.error().unwrap_or_else(|| "disk error".into())
        )))
    }

    fn cached(&self, id: &str) -> Option<Arc<RolloutInfo>> {
        self.rollouts.read().ok().and_then(|m| m.get(id).cloned())
    }

    pub(crate) fn cache(&self, row: &crate::store::RolloutRow) -> Arc<RolloutInfo> {
        let info = Arc::new(RolloutInfo {
            id: row.rollout_id.clone(),
            mode: if row.mode == "eval" {
                Mode::Eval
            } else {
                Mode::Train
            },
            token_hash: row.token_hash.clone(),
            queued: AtomicBool::new(row.status == "queued"),
            online: None,
        });
        if let Ok(mut m) = self.rollouts.write() {
            m.insert(info.id.clone(), info.clone());
        }
        if let Ok(mut m) = self.tokens.write() {
            m.insert(info.token_hash.clone(), info.id.clone());
        }
        info
    }

    pub(crate) fn forget(&self, id: &str) {
        if let Ok(mut m) = self.rollouts.write() {
            m.remove(id);
        }
    }

    /// Runs a store read on tokio's blocking pool: SQLite reads must not stall
    /// the async workers that forward calls.
    pub async fn read_store<T, F>(self: &Arc<Self>, read: F) -> Result<T, ApiError>
    where
        F: FnOnce(&Store) -> Result<T, GatewayError> + Send + 'static,
        T: Send + 'static,
    {
        let st = self.clone();
        tokio::task::spawn_blocking(move || read(&st.store))
            .await
            .map_err(|e| ApiError::internal(format!("reader task failed: {e}")))?
            .map_err(ApiError::from)
    }

    /// The rollout with this id, from memory or the store.
    pub async fn rollout(self: &Arc<Self>, id: &str) -> Result<Arc<RolloutInfo>, ApiError> {
        if let Some(r) = self.cached(id) {
            return Ok(r);
        }
        let key = id.to_string();
        let row = self.read_store(move |s| s.get_rollout(&key)).await?;
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
        let key = hash.to_string();
        let row = self
            .read_store(move |s| s.rollout_by_token_hash(&key))
            .await?;
        Ok(row.map(|r| self.cache(&r)))
    }

    pub fn is_admin(&self, headers: &HeaderMap) -> bool {
        match (api_key(headers), &self.cfg.admin_key) {
            (Some(t), Some(k)) if !k.is_empty() => {
                auth::constant_time_eq(t.as_bytes(), k.as_bytes())
            }
            _ => false,
        }
    }

    pub fn require_admin(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        // `validate` allows a keyless gateway only with insecure_local on loopback.
        let keyless = self.cfg.admin_key.as_deref().is_none_or(str::is_empty);
        if self.is_admin(headers) || (keyless && self.cfg.insecure_local) {
            return Ok(());
        }
        if api_key(headers).is_none() {
            return Err(ApiError::unauthorized(
                "missing admin key; send 'Authorization: Bearer <admin key>' (or 'x-api-key')",
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
        let token = api_key(headers).ok_or_else(|| {
            ApiError::unauthorized("missing rollout token; send 'Authorization: Bearer <rollout token>' or 'x-api-key: <rollout token>' (the SDK's api_key)")
        })?;
        if self.is_admin(headers) {
            return self.rollout(id).await;
        }
        // Without the admin key a missing rollout answers exactly as a wrong
        // token does: the answer must not tell which rollout ids exist.
        let hash = auth::token_hash(token);
        match self.rollout(id).await {
            Ok(info) if auth::constant_time_eq(hash.as_bytes(), info.token_hash.as_bytes()) => {
                return Ok(info)
            }
            Ok(_) => {}
            Err(e) if e.status == 404 => {}
            Err(e) => return Err(e),
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

    /// For `/v1/...`: the rollout whose token is the bearer key, or an
    /// application key's online "rollout" (its calls go to sessions).
    pub async fn rollout_from_key(
        self: &Arc<Self>,
        headers: &HeaderMap,
    ) -> Result<Arc<RolloutInfo>, ApiError> {
        let token = api_key(headers).ok_or_else(|| {
            ApiError::unauthorized(
                "missing API key; set the SDK api_key to your key (an application key lk-…, or a rollout token)",
            )
        })?;
        let hash = auth::token_hash(token);
        if let Some(r) = self.rollout_by_token(&hash).await? {
            return Ok(r);
        }
        match key_rollout(self, &hash).await? {
            Some(r) => Ok(r),
            None => Err(ApiError::unauthorized(
                "unknown key; set the SDK api_key to a rollout token from POST /rollouts or an application key from POST /admin/keys (a revoked key stops working at once)",
            )),
        }
    }
}
/// Application keys (online mode) cached by token hash (a revoked key is dropped at once).
#[derive(Debug, Default)]
pub struct Keys {
    by_hash: RwLock<HashMap<String, Arc<AppKey>>>,
}

impl Keys {
    pub fn forget(&self, key_id: &str) {
        if let Ok(mut m) = self.by_hash.write() {
            m.retain(|_, k| k.id != key_id);
        }
    }
}

/// For `/v1/...`: the online "rollout" of an application key, or `None` if the
/// hash is no active key. The call's session is resolved when it commits.
pub async fn key_rollout(
    st: &Arc<State>,
    hash: &str,
) -> Result<Option<Arc<RolloutInfo>>, ApiError> {
    let cached = st
        .online_keys
        .by_hash
        .read()
        .ok()
        .and_then(|m| m.get(hash).cloned());
    let key = match cached {
        Some(k) => k,
        None => {
            let h = hash.to_string();
            let row = st
                .read_store(move |s| s.read(|c| reader::key_by_hash(c, &h)))
                .await?;
            let Some(row) = row else { return Ok(None) };
            let k = Arc::new(AppKey::from_row(&row));
            if let Ok(mut m) = st.online_keys.by_hash.write() {
                m.insert(hash.to_string(), k.clone());
            }
            k
        }
    };
    Ok(Some(Arc::new(RolloutInfo {
        id: format!("online:{}", key.id),
        mode: key.mode,
        token_hash: String::new(),
        queued: AtomicBool::new(false),
        online: Some(Arc::new(OnlineCall {
            key,
            session: None,
            previous_response: None,
            user: None,
            window_s: st.cfg.online.session_window_s,
            idle_s: st.cfg.online.idle_timeout_s,
        })),
    })))
}
