//! Online-mode routes: application keys (admin), delayed feedback (application
//! key), an on-demand sweep (admin). See `crate::online` for the model.

use hyper::body::Incoming;
use hyper::{Request, Response};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;

use crate::auth;
use crate::error::ApiError;
use crate::http::{api_key, json_response, parse_json, Body};
use crate::online;
use crate::state::State;
use crate::store::online::{self as db, FeedbackOutcome, KeyDefaults, Outcome};
use crate::store::reader;

/// `POST /admin/keys {name, defaults?}` → `{id, key, name, defaults}`; the key
/// is shown once (only its SHA-256 is stored).
pub async fn create_key(
    st: &Arc<State>,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let v = st.admin_json(req).await?;
    let name = v
        .get("name")
        .and_then(Value::as_str)
        .filter(|s| !s.trim().is_empty() && s.len() <= 128)
        .ok_or_else(|| {
            ApiError::bad_request(
                "invalid_key",
                "an application key needs a 'name' (1..128 characters), e.g. {\"name\": \"support-bot\"}",
            )
        })?
        .to_string();
    let defaults = KeyDefaults::parse(v.get("defaults"))?;
    let id = format!("key-{}", crate::util::random_hex(8));
    let key = format!("lk-{}", crate::util::random_hex(32));
    let defaults_v =
        serde_json::to_value(&defaults).map_err(|e| ApiError::internal(e.to_string()))?;
    let out = st
        .store
        .online(db::Op::CreateKey {
            id: id.clone(),
            name: name.clone(),
            token_hash: auth::token_hash(&key),
            defaults: defaults_v.clone(),
        })
        .await?;
    let Outcome::Key(row) = out else {
        return Err(ApiError::internal("unexpected result creating a key"));
    };
    Ok(json_response(
        201,
        &json!({"id": row.id, "key": key, "name": row.name, "defaults": defaults_v, "created": row.created}),
    ))
}

/// `GET /admin/keys`: every key (never the key itself).
pub async fn list_keys(
    st: &Arc<State>,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    st.require_admin(req.headers())?;
    let rows = st.read_store(|s| s.read(reader::list_keys)).await?;
    Ok(json_response(200, &json!({ "keys": rows })))
}

/// `DELETE /admin/keys/{id}`: revokes at once (calls with it get 401).
pub async fn revoke_key(
    st: &Arc<State>,
    id: &str,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    st.require_admin(req.headers())?;
    let out = st
        .store
        .online(db::Op::RevokeKey { id: id.to_string() })
        .await?;
    st.online_keys.forget(id);
    match out {
        Outcome::Found(true) => Ok(json_response(200, &json!({"id": id, "revoked": true}))),
        _ => Err(ApiError::not_found(
            "key_not_found",
            format!("no active application key {id:?}; GET /admin/keys lists them"),
        )),
    }
}

/// `GET /admin/online/sessions?key_id=&closed=&feedback=&limit=`: sessions,
/// most recently active first (default limit 100, at most 10000), with their
/// call and feedback counts. Booleans are `true`/`false`.
pub async fn list_sessions(
    st: &Arc<State>,
    req: Request<Incoming>,
    query: &HashMap<String, String>,
) -> Result<Response<Body>, ApiError> {
    st.require_admin(req.headers())?;
    let flag = |k: &str| -> Result<Option<bool>, ApiError> {
        match query.get(k).map(String::as_str) {
            None => Ok(None),
            Some("true") => Ok(Some(true)),
            Some("false") => Ok(Some(false)),
            Some(x) => Err(ApiError::bad_request(
                "invalid_query",
                format!("{k}={x:?}: use true or false"),
            )),
        }
    };
    let limit = match query.get("limit") {
        None => 100,
        Some(x) => x
            .parse::<i64>()
            .ok()
            .filter(|n| (1..=10_000).contains(n))
            .ok_or_else(|| {
                ApiError::bad_request("invalid_query", format!("limit={x:?}: use 1..10000"))
            })?,
    };
    let filter = db::SessionFilter {
        key_id: query.get("key_id").cloned(),
        closed: flag("closed")?,
        with_feedback: flag("feedback")?,
        limit,
        ..db::SessionFilter::default()
    };
    let rows = st
        .read_store(move |s| s.read(|c| reader::list_sessions(c, &filter)))
        .await?;
    Ok(json_response(200, &json!({ "sessions": rows })))
}

/// `POST /admin/online/sweep {idle_timeout_s?}`: closes idle sessions (idle
/// for the config's timeout, or the one given) and applies retention now.
pub async fn sweep(st: &Arc<State>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    st.require_admin(req.headers())?;
    let (_, body) = st.read_body(req).await?;
    let v = if body.is_empty() {
        json!({})
    } else {
        parse_json(&body)?
    };
    let idle = match v.get("idle_timeout_s") {
        None | Some(Value::Null) => None,
        Some(x) => Some(
            x.as_f64()
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| {
                    ApiError::bad_request("invalid_sweep", "idle_timeout_s must be a number >= 0")
                })?,
        ),
    };
    let r = online::sweep(st, idle).await?;
    Ok(json_response(
        200,
        &json!({"closed": r.closed, "deleted": r.deleted}),
    ))
}

/// `POST /admin/online/trained {session_ids, trained_at?}` → `{marked}`:
/// marks sessions as trained on (a `lightning train --online` pass), through
/// the gateway's single writer while it runs.
pub async fn mark_trained(
    st: &Arc<State>,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let v = st.admin_json(req).await?;
    let ids: Vec<String> = v
        .get("session_ids")
        .and_then(Value::as_array)
        .and_then(|a| a.iter().map(|x| x.as_str().map(str::to_string)).collect())
        .ok_or_else(|| {
            ApiError::bad_request(
                "invalid_trained",
                "send {\"session_ids\": [\"on-…\", ...]} (strings), optionally with \"trained_at\" (unix seconds)",
            )
        })?;
    let when = match v.get("trained_at") {
        None | Some(Value::Null) => crate::util::now(),
        Some(x) => x.as_f64().filter(|x| x.is_finite()).ok_or_else(|| {
            ApiError::bad_request(
                "invalid_trained",
                "trained_at must be a number (unix seconds)",
            )
        })?,
    };
    let marked = st.store.mark_trained(ids, when).await?;
    Ok(json_response(200, &json!({ "marked": marked })))
}

/// `POST /v1/feedback` (application key):
/// `{feedback_id, response_id | session_id, name, value, timestamp?, data?}`.
/// 200 after commit; the same feedback id again is a no-op (`duplicate: true`);
/// an unknown target is 404; feedback for a session already trained on is kept
/// and flagged (`after_training: true`).
pub async fn feedback(st: &Arc<State>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let token = api_key(req.headers()).ok_or_else(|| {
        ApiError::unauthorized("missing application key; send 'Authorization: Bearer lk-…'")
    })?;
    let hash = auth::token_hash(token);
    let info = crate::state::key_rollout(st, &hash).await?.ok_or_else(|| {
        ApiError::unauthorized("feedback needs an active application key (POST /admin/keys)")
    })?;
    let key_id = match &info.online {
        Some(o) => o.key.id.clone(),
        None => return Err(ApiError::internal("application key without online state")),
    };
    let (_, body) = st.read_body(req).await?;
    let range = (st.cfg.online.feedback_min, st.cfg.online.feedback_max);
    let f = parse_feedback(&parse_json(&body)?, key_id, range)?;
    let out = st.store.online(db::Op::Feedback(f.clone())).await?;
    match out {
        Outcome::Feedback(FeedbackOutcome::Stored {
            rollout_id,
            after_training,
            duplicate,
        }) => Ok(json_response(
            200,
            &json!({"feedback_id": f.feedback_id, "session_id": rollout_id, "name": f.name,
                    "value": f.value, "duplicate": duplicate, "after_training": after_training}),
        )),
        Outcome::Feedback(FeedbackOutcome::NotFound(m)) => {
            Err(ApiError::not_found("unknown_target", m))
        }
        Outcome::Feedback(FeedbackOutcome::Ambiguous(m)) => Err(ApiError::new(
            409,
            "invalid_request_error",
            "ambiguous_response_id",
            m,
        )),
        Outcome::Feedback(FeedbackOutcome::Conflict(m)) => Err(ApiError::new(
            409,
            "invalid_request_error",
            "feedback_id_reused",
            m,
        )),
        other => Err(ApiError::internal(format!(
            "unexpected feedback result {other:?}"
        ))),
    }
}

/// `range`: the `[online] feedback_min`, `feedback_max` a value must lie in.
fn parse_feedback(
    v: &Value,
    key_id: String,
    (lo, hi): (f64, f64),
) -> Result<db::NewFeedback, ApiError> {
    let bad = |m: &str| ApiError::bad_request("invalid_feedback", m.to_string());
    let s = |k: &str| {
        v.get(k)
            .and_then(Value::as_str)
            .map(str::trim)
            .filter(|s| !s.is_empty())
    };
    let feedback_id = s("feedback_id")
        .filter(|x| x.len() <= 256)
        .ok_or_else(|| bad("feedback needs a 'feedback_id' (your own unique id, 1..256 chars): resending it is a no-op"))?;
    let name = s("name").filter(|x| x.len() <= 128).ok_or_else(|| {
        bad("feedback needs a signal 'name' such as \"thumbs\" or \"task_success\"")
    })?;
    let value = match v.get("value") {
        Some(Value::Bool(b)) => {
            if *b {
                1.0
            } else {
                0.0
            }
        }
        Some(x) => x
            .as_f64()
            .filter(|x| x.is_finite())
            .ok_or_else(|| bad("'value' must be a finite number or a boolean"))?,
        None => return Err(bad("feedback needs a 'value' (number or boolean)")),
    };
    if !(lo..=hi).contains(&value) {
        return Err(ApiError::bad_request(
            "invalid_feedback",
            format!("'value' {value} is outside [{lo}, {hi}] (the gateway's [online] feedback_min, feedback_max)"),
        ));
    }
    let response_id = s("response_id").map(str::to_string);
    let session = s("session_id").map(str::to_string);
    if response_id.is_none() == session.is_none() {
        return Err(bad(
            "feedback names exactly one of 'response_id' (the id the API returned) or 'session_id'",
        ));
    }
    let ts = match v.get("timestamp") {
        None | Some(Value::Null) => crate::util::now(),
        Some(x) => x
            .as_f64()
            .filter(|x| x.is_finite())
            .ok_or_else(|| bad("'timestamp' is unix seconds"))?,
    };
    Ok(db::NewFeedback {
        key_id,
        feedback_id: feedback_id.to_string(),
        response_id,
        session,
        name: name.to_string(),
        value,
        data: v.get("data").cloned().unwrap_or(Value::Null),
        ts,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn feedback_bodies() {
        let ok = parse_feedback(
            &json!({"feedback_id": "f1", "response_id": "chatcmpl-1", "name": "thumbs", "value": true}),
            "k".into(),
            (-1e6, 1e6),
        );
        assert!(matches!(
            ok,
            Ok(db::NewFeedback {
                value: 1.0,
                session: None,
                ..
            })
        ));
        for bad in [
            json!({"response_id": "r", "name": "n", "value": 1}),
            json!({"feedback_id": "f", "name": "n", "value": 1}),
            json!({"feedback_id": "f", "response_id": "r", "session_id": "s", "name": "n", "value": 1}),
            json!({"feedback_id": "f", "response_id": "r", "name": "n", "value": "good"}),
            json!({"feedback_id": "f", "response_id": "r", "value": 1}),
            // Bug 1: a finite but huge value made an online pass's statistics infinite.
            json!({"feedback_id": "f", "response_id": "r", "name": "n", "value": 1e308}),
            json!({"feedback_id": "f", "response_id": "r", "name": "n", "value": -1.0e6 - 1.0}),
            json!({"feedback_id": "f", "response_id": "r", "name": "n", "value": "NaN"}),
        ] {
            assert!(
                parse_feedback(&bad, "k".into(), (-1e6, 1e6)).is_err(),
                "{bad}"
            );
        }
    }
}
