//! Admin routes: pause/resume around weight updates, state, the upstream pool.

use hyper::body::Incoming;
use hyper::{Request, Response};
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::UpstreamConfig;
use crate::error::ApiError;
use crate::http::{json_response, Body};
use crate::state::State;

/// `POST /admin/pause`: new calls get 503; optionally waits for in-flight calls to drain.
pub async fn pause(st: &Arc<State>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let v = st.admin_json(req).await?;
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

/// `POST /admin/resume`.
pub async fn resume(st: &Arc<State>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    st.require_admin(req.headers())?;
    st.paused.store(false, Ordering::SeqCst);
    tracing::info!("resumed");
    Ok(json_response(200, &admin_state(st)))
}

/// `GET /admin/state`.
pub async fn state(st: &Arc<State>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    st.require_admin(req.headers())?;
    Ok(json_response(200, &admin_state(st)))
}

/// `GET /admin/upstreams`.
pub async fn upstreams(
    st: &Arc<State>,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    st.require_admin(req.headers())?;
    Ok(json_response(200, &st.pool.describe()))
}

/// `POST /admin/upstreams`: replaces the pool (weight sync).
pub async fn replace_upstreams(
    st: &Arc<State>,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let v = st.admin_json(req).await?;
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

fn admin_state(st: &State) -> Value {
    json!({
        "paused": st.paused.load(Ordering::SeqCst),
        "in_flight": st.metrics.in_flight.load(Ordering::SeqCst),
        "weight_version": st.pool.weight_version(),
        "upstreams": st.pool.describe()["upstreams"],
    })
}
