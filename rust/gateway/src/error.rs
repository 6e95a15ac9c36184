//! Errors of the gateway crate, and the OpenAI-shaped error bodies the HTTP
//! server answers with (`{"error": {"message", "type", "code"}}`).

use std::fmt;

/// Errors raised while configuring, starting or storing; request-level
/// failures become [`ApiError`] instead.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("invalid gateway configuration: {0}")]
    Config(String),
    #[error("cannot listen on {addr}: {source}; pick a free port or another address")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("store error on {path}: {message}")]
    Store { path: String, message: String },
    #[error("the store writer has stopped; restart the gateway")]
    StoreClosed,
    /// The disk refused the write (full, read-only, I/O error): nothing in
    /// the failed transaction is on disk.
    #[error("the trace store at {path} cannot write: {message}; free disk space or fix the file's permissions (the gateway recovers by itself)")]
    StoreUnwritable { path: String, message: String },
    /// Another writer (a gateway, or `mark_trained`) holds the store's lock.
    #[error("the store {path} already has a writer ({holder} holds its lock): a gateway is running on it, or an online pass is marking it. Stop that process or use another --db; for online mode with a gateway running on this store, set `gateway = URL` in the online config's source so marking goes through its writer")]
    StoreLocked { path: String, holder: String },
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
}

impl GatewayError {
    pub fn store(path: impl fmt::Display, err: impl fmt::Display) -> Self {
        GatewayError::Store {
            path: path.to_string(),
            message: err.to_string(),
        }
    }
}

/// An error the gateway itself answers with. The message says what to do.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: u16,
    pub kind: &'static str,
    pub code: &'static str,
    pub message: String,
    /// Seconds for a `Retry-After` header (503 while paused).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(
        status: u16,
        kind: &'static str,
        code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        ApiError {
            status,
            kind,
            code,
            message: message.into(),
            retry_after: None,
        }
    }
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(400, "invalid_request_error", code, message)
    }
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(401, "authentication_error", "invalid_api_key", message)
    }
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(403, "permission_error", "wrong_rollout", message)
    }
    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(404, "not_found_error", code, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, "server_error", "internal_error", message)
    }
    pub fn store(err: impl fmt::Display) -> Self {
        Self::new(
            500,
            "server_error",
            "store_error",
            format!("the trace store failed: {err}; check the gateway log and disk space"),
        )
    }

    /// The JSON body in OpenAI's error shape.
    pub fn body(&self) -> Vec<u8> {
        serde_json::json!({
            "error": {"message": self.message, "type": self.kind, "code": self.code}
        })
        .to_string()
        .into_bytes()
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: {}", self.status, self.code, self.message)
    }
}

impl ApiError {
    /// The code of [`ApiError::store_unavailable`].
    pub const STORE_UNAVAILABLE: &'static str = "store_unavailable";

    /// 503 while the store cannot write: the harness retries later.
    pub fn store_unavailable(message: impl Into<String>) -> Self {
        let mut e = Self::new(503, "server_error", Self::STORE_UNAVAILABLE, message);
        e.retry_after = Some(1);
        e
    }

    /// This is the store's refusal to write ([`ApiError::store_unavailable`]).
    pub fn is_store_unavailable(&self) -> bool {
        self.code == Self::STORE_UNAVAILABLE
    }
}

impl From<GatewayError> for ApiError {
    fn from(e: GatewayError) -> Self {
        match e {
            GatewayError::StoreUnwritable { .. } => ApiError::store_unavailable(e.to_string()),
            e => ApiError::store(e),
        }
    }
}
