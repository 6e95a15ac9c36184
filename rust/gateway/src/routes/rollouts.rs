//! The rollout API: create and list rollouts, their status, rewards, events
//! and traces. Rewards and events answer 200 only after they are committed.

use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Request, Response};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;

use crate::auth;
use crate::error::ApiError;
use crate::http::{full, json_response, parse_json, Body};
use crate::state::State;
use crate::store::NewRollout;

/// `POST /rollouts` (admin): creates a rollout or returns the existing one with
/// that id; at most `max_rollouts_per_minute` requests a minute (429 above).
pub async fn create(st: &Arc<State>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    st.require_admin(req.headers())?;
    st.limits.admit_rollout()?;
    let (_, body) = st.read_body(req).await?;
    create_rollout(st, parse_json(&body)?).await
}

/// `GET /rollouts?status=&group=&limit=` (admin).
pub async fn list(
    st: &Arc<State>,
    req: Request<Incoming>,
    query: &HashMap<String, String>,
) -> Result<Response<Body>, ApiError> {
    st.require_admin(req.headers())?;
    let status = query.get("status").cloned();
    let group = query.get("group").cloned();
    let limit = query
        .get("limit")
        .and_then(|s| s.parse::<i64>().ok())
        .unwrap_or(10_000);
    let rows = st
        .read_store(move |s| s.list_rollouts(status.as_deref(), group.as_deref(), limit))
        .await?;
    Ok(json_response(200, &json!({ "rollouts": rows })))
}

/// `GET /rollouts/{id}`: the row plus its number of calls and latest reward.
pub async fn get(
    st: &Arc<State>,
    id: &str,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    st.authorize(req.headers(), id).await?;
    let key = id.to_string();
    let (row, (n_calls, reward)) = st
        .read_store(move |s| Ok((s.get_rollout(&key)?, s.rollout_summary(&key)?)))
        .await?;
    let row = row.ok_or_else(|| {
        ApiError::not_found(
            "rollout_not_found",
            format!("rollout {id:?} does not exist"),
        )
    })?;
    let mut v = serde_json::to_value(&row).map_err(|e| ApiError::internal(e.to_string()))?;
    v["n_calls"] = json!(n_calls);
    v["reward"] = json!(reward);
    Ok(json_response(200, &v))
}

/// `POST /rollouts/{id}/status` (admin).
pub async fn set_status(
    st: &Arc<State>,
    id: &str,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    st.require_admin(req.headers())?;
    st.rollout(id).await?;
    let id = id.to_string();
    let (_, body) = st.read_body(req).await?;
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

/// `POST /rollouts/{id}/reward`: 200 only after the reward is committed.
pub async fn reward(
    st: &Arc<State>,
    id: &str,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let info = st.authorize(req.headers(), id).await?;
    let (_, body) = st.read_body(req).await?;
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
    // The range feedback gets: 1e308 is finite, but a group's mean and std
    // overflow on it and every advantage of the group comes out 0 or NaN.
    let (lo, hi) = (st.cfg.online.feedback_min, st.cfg.online.feedback_max);
    if !(lo..=hi).contains(&value) {
        return Err(ApiError::bad_request(
            "invalid_reward",
            format!("reward {value} is outside [{lo}, {hi}] (the gateway's [online] feedback_min, feedback_max, which bound rewards too)"),
        ));
    }
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

/// `POST /rollouts/{id}/events`.
pub async fn post_event(
    st: &Arc<State>,
    id: &str,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let info = st.authorize(req.headers(), id).await?;
    let (_, body) = st.read_body(req).await?;
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

/// `GET /rollouts/{id}/events`.
pub async fn events(
    st: &Arc<State>,
    id: &str,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let info = st.authorize(req.headers(), id).await?;
    let key = info.id.clone();
    let events = st.read_store(move |s| s.events(&key)).await?;
    Ok(json_response(
        200,
        &json!({"rollout_id": info.id, "events": events}),
    ))
}

/// `GET /rollouts/{id}/trace?format=json|columnar`.
pub async fn trace(
    st: &Arc<State>,
    id: &str,
    req: Request<Incoming>,
    query: &HashMap<String, String>,
) -> Result<Response<Body>, ApiError> {
    let info = st.authorize(req.headers(), id).await?;
    let format = query
        .get("format")
        .map(String::as_str)
        .unwrap_or("json")
        .to_string();
    let key = info.id.clone();
    let calls = st.read_store(move |s| s.trace(&key)).await?;
    match format.as_str() {
        "json" => Ok(json_response(
            200,
            &json!({"rollout_id": info.id, "calls": calls}),
        )),
        "columnar" => {
            let bytes = crate::store::columnar::encode(&info.id, &calls);
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
        None | Some(Value::Null) => format!("ro-{}", crate::util::random_hex(12)),
        Some(Value::String(s)) if auth::valid_rollout_id(s) => s.clone(),
        Some(other) => {
            return Err(ApiError::bad_request(
                "invalid_rollout_id",
                format!("rollout_id {other} must be 1..128 characters of [A-Za-z0-9._:-]"),
            ))
        }
    };
    let task = v.get("task").cloned().unwrap_or(Value::Null);
    let token = auth::rollout_token(st.store.secret()?, &id);
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
            // Anthropic clients append `/v1/messages` themselves (Claude Code's
            // ANTHROPIC_BASE_URL, the `anthropic` SDKs' base_url).
            "anthropic_base_url": format!("{}/rollouts/{}", st.public_url, id),
            "group": row.group,
            "mode": row.mode,
            "status": row.status,
            "created": created,
        }),
    ))
}
