//! The proxy path: rewrite the request (ids and logprobs on), pick an upstream,
//! retry only before any byte reached the harness, forward the answer unchanged
//! (streamed event by event), and commit the captured call before the answer's
//! last byte (`[DONE]` for streams) goes out.

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderMap, HeaderValue, AUTHORIZATION, CACHE_CONTROL, CONTENT_TYPE};
use hyper::{Request, Response, StatusCode};
use serde_json::{Map, Value};
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

use crate::auth;
use crate::capture::{self, Capture, Kind, StreamCapture};
use crate::config::Engine;
use crate::error::ApiError;
use crate::server::{full, Body, Mode, RolloutInfo, State};
use crate::sse;
use crate::store::{self, CallRecord, CallStatus};
use crate::upstream::Upstream;

/// Decrements the in-flight gauge however the call ends.
struct InFlight(Arc<State>);

impl InFlight {
    fn new(st: &Arc<State>) -> Self {
        st.metrics.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(st.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.metrics.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A response body fed by a channel: each SSE event is one frame, sent the
/// moment it is complete. Dropping it (client gone) closes the channel.
struct ChannelBody {
    rx: mpsc::Receiver<Bytes>,
}

impl HttpBody for ChannelBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(b)) => Poll::Ready(Some(Ok(Frame::data(b)))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Everything about one proxied request that ends up in its records.
struct CallMeta {
    rollout: Arc<RolloutInfo>,
    kind: Kind,
    request_id: String,
    request: String,
    retry_count: u32,
    want_ids: bool,
    started: Instant,
}

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

/// Rewrites the request body: ids and logprobs on (unless an eval rollout
/// with capture off), the mode's temperature if configured. Everything else
/// passes through untouched.
pub fn rewrite_request(
    st: &State,
    mode: Mode,
    kind: Kind,
    body: &[u8],
) -> Result<(Map<String, Value>, bool), ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(
            "invalid_json",
            format!("request body is not valid JSON: {e}"),
        )
    })?;
    let Value::Object(mut req) = v else {
        return Err(ApiError::bad_request(
            "invalid_json",
            "request body must be a JSON object",
        ));
    };
    let want_ids = mode == Mode::Train || st.cfg.eval_capture;
    if want_ids {
        req.insert("return_token_ids".into(), Value::Bool(true));
        match kind {
            Kind::Chat => {
                req.insert("logprobs".into(), Value::Bool(true));
            }
            Kind::Completion => {
                if req.get("logprobs").is_none_or(|x| x.as_u64().is_none()) {
                    req.insert("logprobs".into(), Value::from(0));
                }
            }
        }
    }
    let temp = match mode {
        Mode::Train => st.cfg.train_temperature,
        Mode::Eval => st.cfg.eval_temperature,
    };
    if let Some(t) = temp {
        req.insert("temperature".into(), Value::from(t));
    }
    Ok((req, want_ids))
}

/// The request without `return_token_ids`, for engines that know no such field.
fn plain_body(request: &str) -> Option<String> {
    let mut v: Map<String, Value> = serde_json::from_str(request).ok()?;
    v.remove("return_token_ids")?;
    Some(Value::Object(v).to_string())
}

enum Sent {
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
async fn send_with_retries(
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

#[allow(clippy::too_many_arguments)]
fn build_records(
    meta: &CallMeta,
    cap: Option<Capture>,
    parse_error: bool,
    status: CallStatus,
    delivered: bool,
    upstream: Option<&Upstream>,
    http_status: u16,
    latency_ms: f64,
) -> Vec<CallRecord> {
    let cap = cap.unwrap_or_default();
    let flags = capture::check(meta.kind, &cap, meta.want_ids && status == CallStatus::Ok);
    let usage = cap.usage.as_ref().map(|u| u.to_string());
    let base = |idx: i64| CallRecord {
        rollout_id: meta.rollout.id.clone(),
        request_id: meta.request_id.clone(),
        choice_index: idx,
        kind: meta.kind.as_str(),
        request: meta.request.clone(),
        prompt_ids: cap.prompt_ids.clone(),
        completion_ids: None,
        logprobs: None,
        finish_reason: None,
        text: None,
        status,
        flags: if parse_error {
            vec!["unparseable_answer".to_string()]
        } else {
            Vec::new()
        },
        delivered,
        retry_count: meta.retry_count,
        weight_version: upstream.map(|u| u.weight_version).unwrap_or(0),
        upstream: upstream.map(|u| u.url.clone()).unwrap_or_default(),
        http_status,
        latency_ms,
        usage: usage.clone(),
        created: store::now(),
    };
    if cap.choices.is_empty() {
        return vec![base(0)];
    }
    cap.choices
        .iter()
        .zip(flags)
        .map(|(c, f)| {
            let mut r = base(c.index);
            if meta.kind == Kind::Completion || r.prompt_ids.is_none() {
                r.prompt_ids = c.prompt_ids.clone().or(r.prompt_ids);
            }
            r.completion_ids = c.completion_ids.clone();
            r.logprobs = c.logprobs.clone();
            r.finish_reason = c.finish_reason.clone();
            r.text = c.text.clone();
            r.flags.extend(f);
            r
        })
        .collect()
}

async fn commit(
    st: &State,
    records: Vec<CallRecord>,
    rollout: &RolloutInfo,
) -> Result<(), ApiError> {
    let status = records.first().map(|r| r.status);
    let flagged = records.iter().any(|r| !r.flags.is_empty());
    let mark_running = rollout.queued.swap(false, Ordering::Relaxed);
    let res = st.store.insert_calls(records, mark_running).await;
    if res.is_err() && mark_running {
        rollout.queued.store(true, Ordering::Relaxed);
    }
    res?;
    let m = &st.metrics;
    match status {
        Some(CallStatus::Ok) => m.calls_ok.fetch_add(1, Ordering::Relaxed),
        Some(CallStatus::UpstreamError) => m.calls_upstream_error.fetch_add(1, Ordering::Relaxed),
        Some(CallStatus::Aborted) => m.calls_aborted.fetch_add(1, Ordering::Relaxed),
        None => 0,
    };
    if flagged {
        m.flagged_calls.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// Copies the engine's response headers, except hop-by-hop ones (RFC 9110
/// §7.6.1) and the length, which belong to each connection.
fn copy_headers(from: &HeaderMap, to: &mut HeaderMap) {
    const HOP: [&str; 8] = [
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "content-length",
    ];
    for (k, v) in from {
        if !HOP.contains(&k.as_str()) {
            to.append(k.clone(), v.clone());
        }
    }
}

/// The engine's whole JSON answer as the harness receives it: its status, its
/// headers (minus hop-by-hop ones) and its body, unchanged.
fn engine_json(status: StatusCode, headers: &HeaderMap, bytes: Bytes) -> Response<Body> {
    let mut r = Response::new(full(bytes));
    *r.status_mut() = status;
    copy_headers(headers, r.headers_mut());
    r.headers_mut()
        .insert(CONTENT_TYPE, copy_content_type(headers, "application/json"));
    r
}

fn copy_content_type(from: &HeaderMap, default: &'static str) -> HeaderValue {
    from.get(CONTENT_TYPE)
        .cloned()
        .unwrap_or_else(|| HeaderValue::from_static(default))
}

/// Proxies one chat or completion call and records it.
pub async fn call(
    st: &Arc<State>,
    rollout: Arc<RolloutInfo>,
    kind: Kind,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<Response<Body>, ApiError> {
    let started = Instant::now();
    let (req, want_ids) = rewrite_request(st, rollout.mode, kind, &body)?;
    let stream = req.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let request = Value::Object(req).to_string();
    let retry_count = headers
        .get("x-stainless-retry-count")
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.trim().parse::<u32>().ok())
        .unwrap_or(0);
    st.metrics.proxied_calls.fetch_add(1, Ordering::Relaxed);
    let meta = CallMeta {
        rollout,
        kind,
        request_id: format!("call-{}", auth::random_hex(8)),
        request,
        retry_count,
        want_ids,
        started,
    };
    // The work runs in its own task so that a harness hanging up is noticed
    // (the reply channel closes), the upstream request is cancelled, and the
    // call is still recorded as aborted.
    let (reply_tx, reply_rx) = oneshot::channel::<Result<Response<Body>, ApiError>>();
    let st2 = st.clone();
    let guard = InFlight::new(st);
    tokio::spawn(async move {
        run_call(st2, meta, stream, reply_tx, guard).await;
    });
    match reply_rx.await {
        Ok(r) => r,
        Err(_) => Err(ApiError::internal("the call task ended without an answer")),
    }
}

async fn run_call(
    st: Arc<State>,
    meta: CallMeta,
    stream: bool,
    mut reply: oneshot::Sender<Result<Response<Body>, ApiError>>,
    guard: InFlight,
) {
    let path = match meta.kind {
        Kind::Chat => "/chat/completions",
        Kind::Completion => "/completions",
    };
    let body = Bytes::from(meta.request.clone());
    // Only pay for the second body when an id-less engine is configured.
    let plain = if st.pool.all().iter().any(|u| u.engine == Engine::Openai) {
        plain_body(&meta.request)
            .map(Bytes::from)
            .unwrap_or_else(|| body.clone())
    } else {
        body.clone()
    };
    let sent = tokio::select! {
        s = send_with_retries(&st, &meta.rollout.id, path, body, plain) => s,
        _ = reply.closed() => {
            let records = build_records(&meta, None, false, CallStatus::Aborted, false, None, 0, ms(meta.started));
            let _ = commit(&st, records, &meta.rollout).await;
            return;
        }
    };
    let (resp, upstream, sent_at) = match sent {
        Sent::Answer {
            resp,
            upstream,
            sent,
        } => (resp, upstream, sent),
        Sent::Failed { err, upstream } => {
            let records = build_records(
                &meta,
                None,
                false,
                CallStatus::UpstreamError,
                false,
                upstream.as_deref(),
                err.status,
                ms(meta.started),
            );
            let res = commit(&st, records, &meta.rollout).await;
            let _ = reply.send(match res {
                Ok(()) => Err(err),
                Err(e) => Err(e),
            });
            return;
        }
    };
    let status = resp.status();
    if stream && status == StatusCode::OK {
        stream_call(st, meta, resp, upstream, sent_at, reply, guard).await;
        return;
    }
    // Whole answer: read it, record it, then answer.
    let deadline = sent_at + Duration::from_secs_f64(st.cfg.upstream_timeout_s);
    let (parts, incoming) = resp.into_parts();
    let collected = tokio::select! {
        r = tokio::time::timeout_at(deadline.into(), incoming.collect()) => r,
        _ = reply.closed() => {
            let records = build_records(&meta, None, false, CallStatus::Aborted, false, Some(&upstream), status.as_u16(), ms(meta.started));
            let _ = commit(&st, records, &meta.rollout).await;
            return;
        }
    };
    let upstream_s = sent_at.elapsed().as_secs_f64();
    st.metrics.upstream_latency.observe(upstream_s);
    let bytes = match collected {
        Ok(Ok(c)) => c.to_bytes(),
        Ok(Err(e)) => {
            let err = ApiError::new(
                502,
                "server_error",
                "upstream_failed",
                format!("upstream {} broke off its answer: {e}", upstream.url),
            );
            finish_failed(&st, &meta, &upstream, err, reply).await;
            return;
        }
        Err(_) => {
            let err = ApiError::new(
                504,
                "server_error",
                "upstream_timeout",
                format!(
                    "upstream {} did not finish within {}s; raise upstream_timeout_s",
                    upstream.url, st.cfg.upstream_timeout_s
                ),
            );
            finish_failed(&st, &meta, &upstream, err, reply).await;
            return;
        }
    };
    let (cap, parse_error, call_status) = if status.is_success() {
        match capture::parse_answer(&bytes) {
            Ok(c) => (Some(c), false, CallStatus::Ok),
            Err(_) => (None, true, CallStatus::Ok),
        }
    } else {
        (None, false, CallStatus::UpstreamError)
    };
    let aborted = reply.is_closed();
    let records = build_records(
        &meta,
        cap,
        parse_error,
        if aborted {
            CallStatus::Aborted
        } else {
            call_status
        },
        !aborted,
        Some(&upstream),
        status.as_u16(),
        ms(meta.started),
    );
    let res = commit(&st, records, &meta.rollout).await;
    st.metrics
        .added_latency
        .observe((meta.started.elapsed().as_secs_f64() - upstream_s).max(0.0));
    drop(guard);
    let answer = res.map(|()| engine_json(status, &parts.headers, bytes));
    let _ = reply.send(answer);
}

async fn finish_failed(
    st: &Arc<State>,
    meta: &CallMeta,
    upstream: &Arc<Upstream>,
    err: ApiError,
    reply: oneshot::Sender<Result<Response<Body>, ApiError>>,
) {
    st.pool.record_failure(upstream);
    let records = build_records(
        meta,
        None,
        false,
        CallStatus::UpstreamError,
        false,
        Some(upstream),
        err.status,
        ms(meta.started),
    );
    let res = commit(st, records, &meta.rollout).await;
    let _ = reply.send(Err(res.err().unwrap_or(err)));
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1000.0
}

fn sse_error(code: &'static str, message: String) -> Bytes {
    let e = ApiError::new(502, "server_error", code, message);
    let mut out = b"data: ".to_vec();
    out.extend_from_slice(&e.body());
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

async fn stream_call(
    st: Arc<State>,
    meta: CallMeta,
    resp: Response<Incoming>,
    upstream: Arc<Upstream>,
    sent_at: Instant,
    reply: oneshot::Sender<Result<Response<Body>, ApiError>>,
    guard: InFlight,
) {
    let (parts, mut body) = resp.into_parts();
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    let mut r = Response::new(ChannelBody { rx }.boxed());
    copy_headers(&parts.headers, r.headers_mut());
    r.headers_mut().insert(
        CONTENT_TYPE,
        copy_content_type(&parts.headers, "text/event-stream"),
    );
    r.headers_mut()
        .insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    if reply.send(Ok(r)).is_err() {
        let records = build_records(
            &meta,
            None,
            false,
            CallStatus::Aborted,
            false,
            Some(&upstream),
            200,
            ms(meta.started),
        );
        let _ = commit(&st, records, &meta.rollout).await;
        return;
    }
    let deadline = sent_at + Duration::from_secs_f64(st.cfg.upstream_timeout_s);
    let mut parser = sse::Parser::new();
    let mut cap = StreamCapture::new();
    let mut status = CallStatus::Ok;
    let mut failure: Option<(&'static str, String)> = None;
    let mut done: Option<Vec<u8>> = None;
    'read: loop {
        let frame = tokio::select! {
            _ = tx.closed() => {
                status = CallStatus::Aborted;
                break 'read;
            }
            f = tokio::time::timeout_at(deadline.into(), body.frame()) => f,
        };
        match frame {
            Err(_) => {
                status = CallStatus::UpstreamError;
                failure = Some((
                    "upstream_timeout",
                    format!(
                        "upstream {} did not finish within {}s",
                        upstream.url, st.cfg.upstream_timeout_s
                    ),
                ));
                break;
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                status = CallStatus::UpstreamError;
                failure = Some((
                    "upstream_failed",
                    format!("upstream {} broke off the stream: {e}", upstream.url),
                ));
                break;
            }
            Ok(Some(Ok(frame))) => {
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                let events = match parser.feed(&data) {
                    Ok(ev) => ev,
                    Err(e) => {
                        status = CallStatus::UpstreamError;
                        failure = Some(("upstream_bad_stream", e));
                        break;
                    }
                };
                // Events completed by one upstream read go out as one frame:
                // each is forwarded as soon as it arrived, without a write per event.
                let mut out: Vec<u8> = Vec::new();
                for ev in events {
                    if ev.is_done() {
                        // Held back until the call has committed (durability contract).
                        done = Some(ev.raw);
                        continue;
                    }
                    cap.feed(&ev.data);
                    out.extend_from_slice(&ev.raw);
                }
                if !out.is_empty() && tx.send(Bytes::from(out)).await.is_err() {
                    status = CallStatus::Aborted;
                    break 'read;
                }
            }
        }
    }
    // Drop the upstream body now: on abort this closes the connection, which
    // makes the engine cancel the generation.
    drop(body);
    let upstream_s = sent_at.elapsed().as_secs_f64();
    st.metrics.upstream_latency.observe(upstream_s);
    if status == CallStatus::Ok {
        if cap.engine_error.is_some() {
            status = CallStatus::UpstreamError;
        } else if done.is_none()
            && (!parser.remainder().trim_ascii().is_empty() || !cap.all_finished())
        {
            // No `[DONE]` and a choice without finish_reason: the engine went
            // away mid-answer (a close-delimited body ends "cleanly" on a cut).
            status = CallStatus::UpstreamError;
            failure = Some((
                "upstream_failed",
                format!(
                    "upstream {} ended the stream before it finished",
                    upstream.url
                ),
            ));
        }
    }
    if failure.is_some() {
        st.pool.record_failure(&upstream);
    }
    let bad_chunks = cap.bad_chunks;
    let mut records = build_records(
        &meta,
        Some(cap.finish()),
        false,
        status,
        status == CallStatus::Ok,
        Some(&upstream),
        200,
        ms(meta.started),
    );
    if bad_chunks > 0 {
        records
            .iter_mut()
            .for_each(|r| r.flags.push("unparseable_chunk".into()));
    }
    let res = commit(&st, records, &meta.rollout).await;
    st.metrics
        .added_latency
        .observe((meta.started.elapsed().as_secs_f64() - upstream_s).max(0.0));
    match (status, res) {
        (CallStatus::Ok, Ok(())) => {
            if let Some(d) = done {
                let _ = tx.send(Bytes::from(d)).await;
            }
        }
        (CallStatus::Ok, Err(e)) => {
            let _ = tx.send(sse_error("store_error", e.message)).await;
        }
        (CallStatus::UpstreamError, _) => {
            if let Some((code, msg)) = failure {
                tracing::warn!(rollout = %meta.rollout.id, code, "stream failed mid-way");
                let _ = tx.send(sse_error(code, msg)).await;
            }
        }
        (CallStatus::Aborted, _) => {
            tracing::debug!(rollout = %meta.rollout.id, "harness hung up mid-stream");
        }
    }
    drop(guard);
}

/// `GET /v1/models`: the first upstream's answer, unchanged.
pub async fn models(st: &Arc<State>) -> Result<Response<Body>, ApiError> {
    let all = st.pool.all();
    let u = all.first().cloned().ok_or_else(|| {
        ApiError::new(
            503,
            "server_error",
            "no_upstream",
            "no upstream engine is configured; POST /admin/upstreams",
        )
    })?;
    let mut b = Request::get(u.uri("/models"));
    if let Some(k) = &st.cfg.upstream_api_key {
        b = b.header(AUTHORIZATION, format!("Bearer {k}"));
    }
    let req = b
        .body(Full::new(Bytes::new()))
        .map_err(|e| ApiError::internal(e.to_string()))?;
    let timeout = Duration::from_secs_f64(st.cfg.upstream_timeout_s);
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
        Err(_) => {
            return Err(ApiError::new(
                504,
                "server_error",
                "upstream_timeout",
                format!("upstream {} timed out", u.url),
            ))
        }
    };
    let (parts, b) = resp.into_parts();
    let bytes = tokio::time::timeout(timeout, b.collect())
        .await
        .map_err(|_| {
            ApiError::new(
                504,
                "server_error",
                "upstream_timeout",
                "upstream timed out",
            )
        })?
        .map_err(|e| ApiError::new(502, "server_error", "upstream_failed", e.to_string()))?
        .to_bytes();
    Ok(engine_json(parts.status, &parts.headers, bytes))
}
