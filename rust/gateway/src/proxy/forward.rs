//! The protocol-free forward step: pick upstreams in the rollout's affinity
//! order, send, retry connect errors, 429 and 5xx only before any byte has
//! reached the harness, and time out.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{AUTHORIZATION, CONTENT_TYPE};
use hyper::{Request, Response};
use serde_json::{Map, Value};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::Engine;
use crate::error::ApiError;
use crate::http::{engine_json, Body};
use crate::state::State;
use crate::upstream::Upstream;

fn backoff(st: &State, attempt: u32) -> Duration {
    let base =
        st.cfg.retry_base_ms.max(1) as f64 * 2f64.powi(attempt.saturating_sub(1).min(16) as i32);
    let mut r = [0u8; 2];
    let jitter = if getrandom::fill(&mut r).is_ok() {
        u16::from_le_bytes(r) as f64 / 65535.0
    } else {
        0.5
    };
    Duration::from_secs_f64(base * (0.5 + jitter) / 1000.0)
}

/// The request without `return_token_ids`, for engines that know no such field.
pub fn plain_body(request: &str) -> Option<String> {
    let mut v: Map<String, Value> = serde_json::from_str(request).ok()?;
    v.remove("return_token_ids")?;
    Some(Value::Object(v).to_string())
}

#[derive(Debug)]
pub enum Sent {
    /// The engine answered (any status that is not retried).
    Answer {
        resp: Response<Incoming>,
        upstream: Arc<Upstream>,
        sent: Instant,
    },
    Failed {
        err: ApiError,
        upstream: Option<Arc<Upstream>>,
    },
}

/// `body` goes to engines that return ids; `plain` (the same request without
/// `return_token_ids`, which strict OpenAI servers reject) to `engine = "openai"`.
pub async fn send_with_retries(
    st: &Arc<State>,
    key: &str,
    path: &str,
    body: Bytes,
    plain: Bytes,
) -> Sent {
    let cands = st.pool.candidates(key);
    if cands.is_empty() {
        return Sent::Failed {
            err: ApiError::new(
                503,
                "server_error",
                "no_upstream",
                "no upstream engine is configured; pass --upstream or POST /admin/upstreams",
            ),
            upstream: None,
        };
    }
    let attempts = st.cfg.max_retries + 1;
    let timeout = Duration::from_secs_f64(st.cfg.upstream_timeout_s);
    let mut last: Option<(ApiError, Arc<Upstream>)> = None;
    for attempt in 0..attempts {
        // After a failure the next attempt goes to the next upstream in the
        // rollout's affinity order (the same one again if it is the only one).
        let u = cands[attempt as usize % cands.len()].clone();
        if attempt > 0 {
            st.metrics.retries.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(backoff(st, attempt)).await;
        }
        let mut builder = Request::post(u.uri(path)).header(CONTENT_TYPE, "application/json");
        if let Some(k) = &st.cfg.upstream_api_key {
            builder = builder.header(AUTHORIZATION, format!("Bearer {k}"));
        }
        let payload = if u.engine == Engine::Openai {
            plain.clone()
        } else {
            body.clone()
        };
        let req = match builder.body(Full::new(payload)) {
            Ok(r) => r,
            Err(e) => {
                return Sent::Failed {
                    err: ApiError::internal(format!(
                        "cannot build the upstream request for {}: {e}",
                        u.url
                    )),
                    upstream: Some(u),
                }
            }
        };
        let sent = Instant::now();
        match tokio::time::timeout(timeout, st.client.request(req)).await {
            Err(_) => {
                st.pool.record_failure(&u);
                // Timeouts are not retried: the engine may still be working on it.
                return Sent::Failed {
                    err: ApiError::new(
                        504,
                        "server_error",
                        "upstream_timeout",
                        format!(
                            "upstream {} did not answer within {}s; raise upstream_timeout_s or check the engine",
                            u.url, st.cfg.upstream_timeout_s
                        ),
                    ),
                    upstream: Some(u),
                };
            }
            Ok(Err(e)) => {
                if st.pool.record_failure(&u) {
                    tracing::warn!(upstream = %u.url, "upstream marked down");
                }
                last = Some((
                    ApiError::new(
                        502,
                        "server_error",
                        "upstream_unreachable",
                        format!("upstream {} failed: {e}; is the engine running?", u.url),
                    ),
                    u,
                ));
            }
            Ok(Ok(resp)) => {
                let s = resp.status().as_u16();
                if (s == 429 || s >= 500) && attempt + 1 < attempts {
                    if st.pool.record_failure(&u) {
                        tracing::warn!(upstream = %u.url, status = s, "upstream marked down");
                    }
                    tracing::debug!(upstream = %u.url, status = s, attempt, "retrying");
                    continue;
                }
                if s < 500 {
                    st.pool.record_success(&u);
                }
                return Sent::Answer {
                    resp,
                    upstream: u,
                    sent,
                };
            }
        }
    }
    match last {
        Some((err, u)) => Sent::Failed {
            err,
            upstream: Some(u),
        },
        None => Sent::Failed {
            err: ApiError::new(
                502,
                "server_error",
                "upstream_unreachable",
                "no upstream answered",
            ),
            upstream: None,
        },
    }
}

/// `GET /v1/models`: the first upstream's answer, unchanged.
pub async fn models(st: &Arc<State>) -> Result<Response<Body>, ApiError> {
    let all = st.pool.all();
    let u = all.first().cloned().ok_or_else(no_upstream)?;
    let req = Request::get(u.uri("/models"));
    let (status, headers, bytes) = fetch(st, &u, req, Bytes::new()).await?;
    Ok(engine_json(status, &headers, bytes))
}

/// `POST /tokenize` on the rollout's engine (vLLM serves it at the server
/// root, beside `/v1`: `vllm/entrypoints/openai/api_server.py`), for
/// Anthropic's `count_tokens`. Not retried and not recorded: it generates nothing.
pub async fn tokenize(
    st: &Arc<State>,
    key: &str,
    body: Bytes,
) -> Result<(hyper::StatusCode, Bytes), ApiError> {
    let u = st
        .pool
        .candidates(key)
        .first()
        .cloned()
        .ok_or_else(no_upstream)?;
    let root = u.base.prefix.strip_suffix("/v1").unwrap_or(&u.base.prefix);
    let url = format!("http://{}{}/tokenize", u.base.authority, root);
    let req = Request::post(url).header(CONTENT_TYPE, "application/json");
    let (status, _, bytes) = fetch(st, &u, req, body).await?;
    Ok((status, bytes))
}

fn no_upstream() -> ApiError {
    ApiError::new(
        503,
        "server_error",
        "no_upstream",
        "no upstream engine is configured; POST /admin/upstreams",
    )
}

/// One plain request to one upstream, within the upstream timeout.
async fn fetch(
    st: &Arc<State>,
    u: &Upstream,
    mut b: hyper::http::request::Builder,
    body: Bytes,
) -> Result<(hyper::StatusCode, hyper::HeaderMap, Bytes), ApiError> {
    if let Some(k) = &st.cfg.upstream_api_key {
        b = b.header(AUTHORIZATION, format!("Bearer {k}"));
    }
    let req = b
        .body(Full::new(body))
        .map_err(|e| ApiError::internal(e.to_string()))?;
    let timeout = Duration::from_secs_f64(st.cfg.upstream_timeout_s);
    let timed_out = || {
        ApiError::new(
            504,
            "server_error",
            "upstream_timeout",
            format!("upstream {} timed out", u.url),
        )
    };
    let resp = match tokio::time::timeout(timeout, st.client.request(req)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            return Err(ApiError::new(
                502,
                "server_error",
                "upstream_unreachable",
                format!("upstream {} failed: {e}", u.url),
            ))
        }
        Err(_) => return Err(timed_out()),
    };
    let (parts, b) = resp.into_parts();
    let bytes = tokio::time::timeout(timeout, b.collect())
        .await
        .map_err(|_| timed_out())?
        .map_err(|e| ApiError::new(502, "server_error", "upstream_failed", e.to_string()))?
        .to_bytes();
    Ok((parts.status, parts.headers, bytes))
}
