//! Online mode: deployed harnesses recorded session by session (docs/design.md#online-sessions).
//!
//! A production harness calls `/v1/...` with an *application key* (`lk-…`,
//! created through `POST /admin/keys`, stored as SHA-256 like rollout tokens).
//! Every call it makes, on any protocol route, is recorded like a rollout
//! call, into a *session*: a rollout with `origin = 'online'` (same tables,
//! so `lightning show`, the merge and the report work on it unchanged).
//!
//! **Which session a call joins** (first rule that applies):
//! 1. an explicit id: the `x-session-id` header, else the body's
//!    `metadata.session_id` (OpenAI chat/Responses `metadata` map), else the
//!    Responses API's `conversation` (string or `{id}`). The client knows best
//!    where a conversation starts and ends, so its word wins. The protocols'
//!    *user* fields (OpenAI `user`, Anthropic `metadata.user_id`) are NOT
//!    session ids: one user has many conversations, and merging them would
//!    train on unrelated turns as one trajectory. They are kept as the
//!    session's `user` tag instead.
//! 2. a Responses `previous_response_id` naming a response of an open session
//!    of this key: that session (the protocol's own continuation link).
//! 3. continuity: the call's prompt ids extend an open implicit session's last
//!    prompt + completion (exact token prefix) that was updated within
//!    `session_window_s`; the longest such tail wins. Only sessions without an
//!    explicit id take part (a client that names sessions keeps that control),
//!    and two conversations with identical tokens so far are indistinguishable
//!    (the most recently updated one wins): send an id where that matters.
//! 4. otherwise a new session.
//!
//! Resolution runs inside the store's single writer, in the transaction that
//! inserts the call, so concurrent calls of one session can never split it
//! or race on its tail. A session idle for `idle_timeout_s` is closed (its
//! rollout becomes `succeeded`); a later call with the same explicit id opens
//! a new session with that id.
//!
//! Feedback (`POST /v1/feedback`) attaches named signals to a response id or
//! a session, any time later, idempotent on the client's feedback id; see
//! `store::online::feedback`. Retention (`retention_days`, `retention_bytes`) deletes
//! whole closed sessions in a background sweep; a key with `redact = true`
//! stores token ids but no text.
//!
//! This module holds no SQL: the rules above run as queries in
//! `store::online` (writes) and `store::reader` (reads); here is what a call
//! says about its session, the background sweep, and the history look-up.

use bytes::Bytes;
use hyper::header::HeaderMap;
use serde_json::Value;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use crate::error::ApiError;
use crate::state::{RolloutInfo, State};
use crate::store::online::{self as db, SweepReport};
use crate::store::{reader, OnlineCall};

/// The longest session id (or conversation id) a client may name.
pub const MAX_SESSION_ID: usize = 256;

fn nonempty(s: &str) -> Option<String> {
    let s = s.trim();
    (!s.is_empty() && s.len() <= MAX_SESSION_ID).then(|| s.to_string())
}

/// A named session id over [`MAX_SESSION_ID`] bytes: refused, never ignored
/// (ignoring it would put the call in some other session).
fn session_id_too_long(headers: &HeaderMap, body: &Value) -> Option<&'static str> {
    let long = |s: &str| s.trim().len() > MAX_SESSION_ID;
    if headers
        .get("x-session-id")
        .is_some_and(|v| v.to_str().map_or(true, long))
    {
        return Some("the x-session-id header");
    }
    if body
        .get("metadata")
        .and_then(|m| m.get("session_id"))
        .and_then(Value::as_str)
        .is_some_and(long)
    {
        return Some("metadata.session_id");
    }
    let conv = match body.get("conversation") {
        Some(Value::String(s)) => Some(s.as_str()),
        Some(Value::Object(o)) => o.get("id").and_then(Value::as_str),
        _ => None,
    };
    conv.is_some_and(long).then_some("conversation")
}

/// The explicit session id of a call (rule 1), pure.
pub fn explicit_session(headers: &HeaderMap, body: &Value) -> Option<String> {
    if let Some(s) = headers
        .get("x-session-id")
        .and_then(|v| v.to_str().ok())
        .and_then(nonempty)
    {
        return Some(s);
    }
    if let Some(s) = body
        .get("metadata")
        .and_then(|m| m.get("session_id"))
        .and_then(Value::as_str)
        .and_then(nonempty)
    {
        return Some(s);
    }
    match body.get("conversation") {
        Some(Value::String(s)) => nonempty(s),
        Some(Value::Object(o)) => o.get("id").and_then(Value::as_str).and_then(nonempty),
        _ => None,
    }
}

/// The protocol's user field (OpenAI `user`, Anthropic `metadata.user_id`), pure.
pub fn user_of(body: &Value) -> Option<String> {
    body.get("user")
        .and_then(Value::as_str)
        .or_else(|| {
            body.get("metadata")
                .and_then(|m| m.get("user_id"))
                .and_then(Value::as_str)
        })
        .and_then(nonempty)
}

/// Binds an online call to what its request says about its session (a no-op
/// for rollout calls). A body that is not JSON is left to the pipeline's 400;
/// a session id over [`MAX_SESSION_ID`] bytes is a 400 here.
pub fn bind_call(
    info: Arc<RolloutInfo>,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<Arc<RolloutInfo>, ApiError> {
    let Some(oc) = &info.online else {
        return Ok(info);
    };
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    if let Some(what) = session_id_too_long(headers, &v) {
        return Err(ApiError::bad_request(
            "session_id_too_long",
            format!("{what} is longer than {MAX_SESSION_ID} bytes (or not text); name the session with at most {MAX_SESSION_ID} characters"),
        ));
    }
    let call = OnlineCall {
        session: explicit_session(headers, &v),
        previous_response: v
            .get("previous_response_id")
            .and_then(Value::as_str)
            .and_then(nonempty),
        user: user_of(&v),
        ..(**oc).clone()
    };
    Ok(Arc::new(RolloutInfo {
        id: info.id.clone(),
        mode: info.mode,
        token_hash: String::new(),
        queued: AtomicBool::new(false),
        online: Some(Arc::new(call)),
    }))
}

/// The state a protocol continues from (`previous_response_id`), looked up
/// among this key's sessions, or 404.
pub async fn load_history(st: &Arc<State>, key_id: &str, id: &str) -> Result<Value, ApiError> {
    let (k, i) = (key_id.to_string(), id.to_string());
    let state = st
        .read_store(move |s| s.read(|c| reader::kept_state(c, &k, &i)))
        .await?;
    state.ok_or_else(|| {
        ApiError::not_found(
            "previous_response_not_found",
            format!("no stored response {id:?} for this application key; send the whole conversation as input"),
        )
    })
}

/// The state of a Responses `conversation`'s latest kept response among
/// this key's sessions; `None` for a conversation not seen yet (it starts here).
pub async fn conversation_history(
    st: &Arc<State>,
    key_id: &str,
    conversation: &str,
) -> Result<Option<Value>, ApiError> {
    let (k, c) = (key_id.to_string(), conversation.to_string());
    st.read_store(move |s| s.read(|conn| reader::conversation_state(conn, &k, &c)))
        .await
}

/// A kept protocol object (`GET /v1/responses/{id}`) in any session of this key.
pub async fn kept_object(
    st: &Arc<State>,
    key_id: &str,
    id: &str,
) -> Result<Option<Value>, ApiError> {
    let (k, i) = (key_id.to_string(), id.to_string());
    st.read_store(move |s| s.read(|c| reader::kept_object(c, &k, &i)))
        .await
}

/// The background sweep: closes idle sessions and enforces retention, every
/// `sweep_interval_s`, until the process ends.
pub async fn sweeper(st: Arc<State>) {
    let every = Duration::from_secs_f64(st.cfg.online.sweep_interval_s.max(0.05));
    loop {
        tokio::time::sleep(every).await;
        match sweep(&st, None).await {
            Ok(r) if r.closed + r.deleted > 0 => {
                tracing::info!(closed = r.closed, deleted = r.deleted, "online sweep");
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e.message, "online sweep failed"),
        }
    }
}

/// One sweep now; `idle_s` overrides `idle_timeout_s` for this sweep (an
/// operator closing every session idle for a minute before a training run).
pub async fn sweep(st: &State, idle_s: Option<f64>) -> Result<SweepReport, ApiError> {
    let now = crate::util::now();
    let cfg = &st.cfg.online;
    let op = db::Op::Sweep {
        idle_before: now - idle_s.unwrap_or(cfg.idle_timeout_s),
        retain_after: cfg.retention_days.map(|d| now - d * 86400.0),
        retain_bytes: cfg.retention_bytes,
    };
    match st.store.online(op).await? {
        db::Outcome::Swept(r) => Ok(r),
        other => Err(ApiError::internal(format!(
            "unexpected sweep result {other:?}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn header_then_metadata_then_conversation() {
        let mut h = HeaderMap::new();
        let body = json!({"metadata": {"session_id": "m"}, "conversation": "c", "user": "u"});
        assert_eq!(explicit_session(&h, &body).as_deref(), Some("m"));
        h.insert("x-session-id", hyper::header::HeaderValue::from_static("h"));
        assert_eq!(explicit_session(&h, &body).as_deref(), Some("h"));
        let conv = json!({"conversation": {"id": "conv_1"}});
        assert_eq!(
            explicit_session(&HeaderMap::new(), &conv).as_deref(),
            Some("conv_1")
        );
    }

    #[test]
    fn a_session_id_too_long_is_named_not_ignored() {
        let long = "s".repeat(MAX_SESSION_ID + 1);
        let mut h = HeaderMap::new();
        assert_eq!(session_id_too_long(&h, &json!({})), None);
        h.insert(
            "x-session-id",
            hyper::header::HeaderValue::from_str(&long).unwrap_or_else(|e| panic!("{e}")),
        );
        assert_eq!(
            session_id_too_long(&h, &json!({})),
            Some("the x-session-id header")
        );
        let h = HeaderMap::new();
        let ok = "s".repeat(MAX_SESSION_ID);
        assert_eq!(session_id_too_long(&h, &json!({"conversation": ok})), None);
        assert_eq!(
            session_id_too_long(&h, &json!({"conversation": {"id": long}})),
            Some("conversation")
        );
        assert_eq!(
            session_id_too_long(&h, &json!({"metadata": {"session_id": long}})),
            Some("metadata.session_id")
        );
    }

    #[test]
    fn user_fields_are_not_sessions() {
        let body = json!({"user": "alice", "metadata": {"user_id": "bob"}});
        assert_eq!(explicit_session(&HeaderMap::new(), &body), None);
        assert_eq!(user_of(&body).as_deref(), Some("alice"));
        assert_eq!(
            user_of(&json!({"metadata": {"user_id": "bob"}})).as_deref(),
            Some("bob")
        );
    }
}
