//! The proxy pipeline: harness request → protocol adapter → forward → record
//! → protocol answer, streamed event by event, with the call committed before
//! the answer's final frame leaves the gateway (docs/design.md#durability).
//!
//! The pipeline knows no protocol: it parses the harness's JSON, asks the
//! adapter (`crate::protocol`) for the engine request, forwards it
//! (`forward`), captures ids and logprobs from the engine's vLLM-wire answer
//! (`wire::engine`), records the call (`record`) and hands the answer or
//! each stream event to the adapter to translate.

pub mod forward;
pub mod record;

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderMap, HeaderValue, CACHE_CONTROL, CONTENT_TYPE};
use hyper::{Response, StatusCode};
use serde_json::Value;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

use crate::config::{Engine, StoreFailure};
use crate::error::ApiError;
use crate::http::{copy_content_type, copy_headers, engine_json, json_bytes_response, Body};
use crate::limits::CallPermit;
use crate::protocol::{Answer, Ctx, History, Protocol, StreamTranslator};
use crate::state::{Mode, RolloutInfo, State};
use crate::store::CallStatus;
use crate::upstream::Upstream;
use crate::wire::engine::{self as capture, Kind, StreamCapture};
use crate::wire::sse;
use forward::{plain_body, send_with_retries, Sent};
use record::{build_records, commit, ms, CallMeta, InFlight};

/// A response body fed by a channel: each batch of SSE frames is one body
/// frame, sent the moment it is ready. Dropping it (client gone) closes the channel.
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

type Reply = oneshot::Sender<Result<Response<Body>, ApiError>>;

/// One call in flight: what it records, how its protocol speaks.
struct Call {
    st: Arc<State>,
    meta: CallMeta,
    proto: &'static dyn Protocol,
    ctx: Ctx,
    stream: bool,
}

/// Proxies one call in protocol `proto` and records it. Errors come back as
/// [`ApiError`]; the caller renders them in the protocol's shape.
pub async fn call(
    st: &Arc<State>,
    rollout: Arc<RolloutInfo>,
    proto: &'static dyn Protocol,
    headers: &HeaderMap,
    body: Bytes,
    permit: CallPermit,
) -> Result<Response<Body>, ApiError> {
    let started = Instant::now();
    let v: Value = serde_json::from_slice(&body).map_err(|e| {
        ApiError::bad_request(
            "invalid_json",
            format!("request body is not valid JSON: {e}"),
        )
    })?;
    if let Value::Object(req) = &v {
        proto.check(req, &st.cfg.caps())?;
    }
    // Online calls always capture ids and logprobs (they do not change the
    // answer) and keep the harness's sampling unless the key overrides it.
    let want_ids = rollout.mode == Mode::Train || st.cfg.eval_capture || rollout.online.is_some();
    let request_id = format!("call-{}", crate::util::random_hex(8));
    let mut ctx = Ctx {
        want_ids,
        temperature: match (&rollout.online, rollout.mode) {
            (Some(o), _) => o.key.defaults.temperature,
            (None, Mode::Train) => st.cfg.train_temperature,
            (None, Mode::Eval) => st.cfg.eval_temperature,
        },
        call_id: request_id.clone(),
        created: crate::util::now() as u64,
        history: None,
        state: Value::Null,
        tool_args: Some(st.tool_args.clone()),
        client_fields_only: rollout.online.is_some(),
    };
    ctx.history = match (proto.history_key(&v), &rollout.online) {
        (None, _) => None,
        (Some(History::Response(key)), Some(o)) => {
            Some(crate::online::load_history(st, &o.key.id, &key).await?)
        }
        (Some(History::Response(key)), None) => Some(load_history(st, &rollout.id, &key).await?),
        (Some(History::Conversation(c)), Some(o)) => {
            crate::online::conversation_history(st, &o.key.id, &c).await?
        }
        (Some(History::Conversation(_)), None) => {
            return Err(ApiError::bad_request(
                "unsupported_parameter",
                "'conversation' needs an application key (online mode, where a conversation is a session); with a rollout token send previous_response_id or the whole conversation as input",
            ))
        }
    };
    if rollout.online.is_none() {
        recover_tool_args(st, &rollout.id, proto.resent_tool_ids(&v)).await?;
    }
    let er = proto.engine_request(v, &mut ctx)?;
    let request = Value::Object(er.body).to_string();
    let retry_count = headers
        .get("x-stainless-retry-count")
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.trim().parse::<u32>().ok())
        .unwrap_or(0);
    st.metrics.proxied_calls.fetch_add(1, Ordering::Relaxed);
    let meta = CallMeta {
        rollout,
        kind: er.kind,
        protocol: proto.name(),
        request_id,
        request,
        // Parsed as JSON above, so it is UTF-8.
        harness_request: String::from_utf8_lossy(&body).into_owned(),
        retry_count,
        want_ids,
        started,
        response_id: proto.response_id(&ctx),
    };
    // The work runs in its own task so that a harness hanging up is noticed
    // (the reply channel closes), the upstream request is cancelled, and the
    // call is still recorded as aborted.
    let (reply_tx, reply_rx) = oneshot::channel::<Result<Response<Body>, ApiError>>();
    let c = Call {
        st: st.clone(),
        meta,
        proto,
        ctx,
        stream: er.stream,
    };
    let guard = InFlight::new(st, permit);
    tokio::spawn(async move {
        run_call(c, reply_tx, guard).await;
    });
    match reply_rx.await {
        Ok(r) => r,
        Err(_) => Err(ApiError::internal("the call task ended without an answer")),
    }
}

/// Puts back into `st.tool_args` the generated argument texts of the re-sent
/// tool calls `ids` it lacks (older than its bound, or from before a restart),
/// from the rows the adapter kept ([`crate::protocol::tool_args_key`]).
async fn recover_tool_args(
    st: &Arc<State>,
    rollout: &str,
    ids: Vec<String>,
) -> Result<(), ApiError> {
    let missing: Vec<String> = ids.into_iter().filter(|id| !st.tool_args.has(id)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    let r = rollout.to_string();
    let found = st
        .read_store(move |s| {
            let mut out = Vec::new();
            for id in &missing {
                if let Some((_, state)) = s.kept(&r, &crate::protocol::tool_args_key(id))? {
                    out.extend(crate::protocol::tool_args_of(&state));
                }
            }
            Ok(out)
        })
        .await?;
    for (id, text) in found {
        st.tool_args.put(&id, &text);
    }
    Ok(())
}

/// The state a protocol continues from (`Kept::state`), or 404.
async fn load_history(st: &Arc<State>, rollout: &str, key: &str) -> Result<Value, ApiError> {
    let st2 = st.clone();
    let (r, k) = (rollout.to_string(), key.to_string());
    let row = tokio::task::spawn_blocking(move || st2.store.kept(&r, &k))
        .await
        .map_err(|e| ApiError::internal(format!("reader task failed: {e}")))??;
    match row {
        Some((_, state)) => Ok(state),
        None => Err(ApiError::not_found(
            "previous_response_not_found",
            format!("no stored response {key:?} in this rollout; send the whole conversation as input, or an id this rollout's calls returned"),
        )),
    }
}

async fn run_call(c: Call, mut reply: Reply, guard: InFlight) {
    let (st, meta) = (&c.st, &c.meta);
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
        s = send_with_retries(st, &meta.rollout.id, path, body, plain) => s,
        _ = reply.closed() => {
            let records = build_records(meta, None, CallStatus::Aborted, false, None, 0, ms(meta.started));
            let _ = commit(st, records, &meta.rollout, None).await;
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
                meta,
                None,
                CallStatus::UpstreamError,
                false,
                upstream.as_deref(),
                err.status,
                ms(meta.started),
            );
            let res = commit(st, records, &meta.rollout, None).await;
            let _ = reply.send(res.and(Err(err)));
            return;
        }
    };
    if c.stream && resp.status() == StatusCode::OK {
        let translator = c.proto.translator(&c.ctx);
        stream_call(
            c.st, c.meta, resp, upstream, sent_at, reply, guard, translator,
        )
        .await;
        return;
    }
    let answered = Answered {
        resp,
        upstream,
        sent_at,
    };
    whole_call(c, answered, reply, guard).await;
}

/// What the engine sent back, and when the request went out.
struct Answered {
    resp: Response<Incoming>,
    upstream: Arc<Upstream>,
    sent_at: Instant,
}

/// A whole (not streamed) answer: read it, record it, then answer the harness
/// in its protocol.
async fn whole_call(c: Call, a: Answered, mut reply: Reply, guard: InFlight) {
    let Call {
        st,
        meta,
        proto,
        ctx,
        ..
    } = c;
    let Answered {
        resp,
        upstream,
        sent_at,
    } = a;
    let status = resp.status();
    let deadline = sent_at + Duration::from_secs_f64(st.cfg.upstream_timeout_s);
    let (parts, incoming) = resp.into_parts();
    let limited = Limited::new(incoming, st.cfg.max_upstream_answer_bytes);
    let collected = tokio::select! {
        r = tokio::time::timeout_at(deadline.into(), limited.collect()) => r,
        _ = reply.closed() => {
            let records = build_records(&meta, None, CallStatus::Aborted, false, Some(&upstream), status.as_u16(), ms(meta.started));
            let _ = commit(&st, records, &meta.rollout, None).await;
            return;
        }
    };
    let upstream_s = sent_at.elapsed().as_secs_f64();
    st.metrics.upstream_latency.observe(upstream_s);
    let bytes = match collected {
        Ok(Ok(c)) => c.to_bytes(),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
            let err = too_large(&st, &upstream);
            finish_failed(&st, &meta, &upstream, err, reply, Some(TOO_LARGE)).await;
            return;
        }
        Ok(Err(e)) => {
            let err = ApiError::new(
                502,
                "server_error",
                "upstream_failed",
                format!("upstream {} broke off its answer: {e}", upstream.url),
            );
            finish_failed(&st, &meta, &upstream, err, reply, None).await;
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
            finish_failed(&st, &meta, &upstream, err, reply, None).await;
            return;
        }
    };
    if std::str::from_utf8(&bytes).is_err() {
        // Never forwarded: the harness's JSON parser would fail on it instead.
        let err = not_utf8(&upstream);
        finish_failed(&st, &meta, &upstream, err, reply, Some(NOT_UTF8)).await;
        return;
    }
    let (cap, call_status) = if status.is_success() {
        match capture::parse_answer(&bytes) {
            Ok(c) => (Some(c), CallStatus::Ok),
            Err(e) => {
                // A 2xx the gateway cannot read is a broken engine, not an
                // answer: the harness gets a typed 502, never the garbage.
                let err = ApiError::new(
                    502,
                    "server_error",
                    "upstream_bad_answer",
                    format!(
                        "upstream {} answered {status} with a body that is not a completion ({e})",
                        upstream.url
                    ),
                );
                finish_failed(&st, &meta, &upstream, err, reply, Some(UNPARSEABLE)).await;
                return;
            }
        }
    } else {
        (None, CallStatus::UpstreamError)
    };
    let (answer, kept) = proto.answer(status, &bytes, &ctx);
    let aborted = reply.is_closed();
    let records = build_records(
        &meta,
        cap,
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
    let res = served_unrecorded(&st, commit(&st, records, &meta.rollout, kept).await);
    st.metrics
        .added_latency
        .observe((meta.started.elapsed().as_secs_f64() - upstream_s).max(0.0));
    drop(guard);
    let answer = res.map(|()| match answer {
        Answer::Passthrough => engine_json(status, &parts.headers, bytes),
        Answer::Json { status, body } => json_bytes_response(status, body),
    });
    let _ = reply.send(answer);
}

/// Record flags naming why an engine answer was refused.
const UNPARSEABLE: &str = "unparseable_answer";
const TOO_LARGE: &str = "answer_too_large";
const NOT_UTF8: &str = "answer_not_utf8";

fn too_large(st: &State, upstream: &Upstream) -> ApiError {
    ApiError::new(
        502,
        "server_error",
        "upstream_answer_too_large",
        format!(
            "upstream {} sent more than max_upstream_answer_bytes = {} for one call; lower the request's max_tokens or raise the limit",
            upstream.url, st.cfg.max_upstream_answer_bytes
        ),
    )
}

fn not_utf8(upstream: &Upstream) -> ApiError {
    ApiError::new(
        502,
        "server_error",
        "upstream_not_utf8",
        format!(
            "upstream {} sent bytes that are not UTF-8; check the engine",
            upstream.url
        ),
    )
}

/// `on_store_failure = "serve"`: a call the store cannot take (disk full) is
/// still answered, unrecorded; any other store error still fails the call.
fn served_unrecorded(st: &State, res: Result<(), ApiError>) -> Result<(), ApiError> {
    match res {
        Err(e) if e.is_store_unavailable() && st.cfg.on_store_failure == StoreFailure::Serve => {
            tracing::warn!("call served unrecorded: the store cannot write");
            st.metrics.calls_unrecorded.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
        r => r,
    }
}

async fn finish_failed(
    st: &Arc<State>,
    meta: &CallMeta,
    upstream: &Arc<Upstream>,
    err: ApiError,
    reply: Reply,
    flag: Option<&'static str>,
) {
    st.pool.record_failure(upstream);
    let mut records = build_records(
        meta,
        None,
        CallStatus::UpstreamError,
        false,
        Some(upstream),
        err.status,
        ms(meta.started),
    );
    if let Some(f) = flag {
        records.iter_mut().for_each(|r| r.flags.push(f.into()));
    }
    let res = commit(st, records, &meta.rollout, None).await;
    let _ = reply.send(Err(res.err().unwrap_or(err)));
}

/// How reading an engine stream ended.
struct Pumped {
    status: CallStatus,
    /// What went wrong, for the harness (`None`: nothing to tell it).
    failure: Option<ApiError>,
    /// A record flag naming why the stream was refused.
    flag: Option<&'static str>,
    saw_done: bool,
}

/// The per-stream readers: SSE framing, id capture, protocol translation.
struct Reading {
    parser: sse::Parser,
    cap: StreamCapture,
    translator: Box<dyn StreamTranslator>,
}

/// Why a read's events stopped being forwarded.
enum Halt {
    /// An event's bytes are not UTF-8.
    NotUtf8,
    /// An event's data is not a chunk we can read: its ids are lost.
    Unreadable,
}

impl Reading {
    /// Captures and translates one read's events (noting `[DONE]` in
    /// `saw_done`); returns the frames for the harness and, when an event
    /// cannot be forwarded, why (the events after it are dropped).
    fn take(&mut self, events: &[sse::Event], saw_done: &mut bool) -> (Vec<u8>, Option<Halt>) {
        let mut out = Vec::new();
        for ev in events {
            // Checked per event: a read may end inside a multi-byte character.
            if std::str::from_utf8(&ev.raw).is_err() {
                return (out, Some(Halt::NotUtf8));
            }
            *saw_done |= ev.is_done();
            // One read of the chunk feeds the capture and the translator.
            let Ok(chunk) = capture::read_event(ev) else {
                // An event we cannot read lost its ids: stop before the
                // harness sees it, and tell it in its own vocabulary.
                self.cap.bad_chunks += 1;
                return (out, Some(Halt::Unreadable));
            };
            if let Some(c) = &chunk {
                self.cap.add(c);
            }
            self.translator.on_event(ev, chunk.as_ref(), &mut out);
        }
        (out, None)
    }
}

/// Reads the engine's stream: every event is captured and translated, and
/// the frames one upstream read completes go out together, at once.
async fn pump(
    st: &State,
    upstream: &Upstream,
    body: &mut Incoming,
    deadline: Instant,
    tx: &mpsc::Sender<Bytes>,
    s: &mut Reading,
) -> Pumped {
    let fail = |code: &'static str, message: String| Pumped {
        status: CallStatus::UpstreamError,
        failure: Some(ApiError::new(502, "server_error", code, message)),
        flag: None,
        saw_done: false,
    };
    let refuse = |err: ApiError, flag: &'static str| Pumped {
        status: CallStatus::UpstreamError,
        failure: Some(err),
        flag: Some(flag),
        saw_done: false,
    };
    let mut saw_done = false;
    let mut read = 0usize;
    loop {
        let frame = tokio::select! {
            _ = tx.closed() => {
                return Pumped { status: CallStatus::Aborted, failure: None, flag: None, saw_done };
            }
            f = tokio::time::timeout_at(deadline.into(), body.frame()) => f,
        };
        let data = match frame {
            Err(_) => {
                return fail(
                    "upstream_timeout",
                    format!(
                        "upstream {} did not finish within {}s",
                        upstream.url, st.cfg.upstream_timeout_s
                    ),
                )
            }
            Ok(None) => {
                return Pumped {
                    status: CallStatus::Ok,
                    failure: None,
                    flag: None,
                    saw_done,
                }
            }
            Ok(Some(Err(e))) => {
                return fail(
                    "upstream_failed",
                    format!("upstream {} broke off the stream: {e}", upstream.url),
                )
            }
            Ok(Some(Ok(frame))) => match frame.into_data() {
                Ok(d) => d,
                Err(_) => continue,
            },
        };
        read += data.len();
        if read > st.cfg.max_upstream_answer_bytes {
            return refuse(too_large(st, upstream), TOO_LARGE);
        }
        let events = match s.parser.feed(&data) {
            Ok(ev) => ev,
            // The parser's one error: an event past its size bound.
            Err(e) => {
                let message = format!("upstream {} sent {e}", upstream.url);
                let err = ApiError::new(502, "server_error", "upstream_answer_too_large", message);
                return refuse(err, TOO_LARGE);
            }
        };
        let (out, halt) = s.take(&events, &mut saw_done);
        // What came before a bad event still goes out.
        let sent = out.is_empty() || tx.send(Bytes::from(out)).await.is_ok();
        match halt {
            Some(Halt::NotUtf8) => return refuse(not_utf8(upstream), NOT_UTF8),
            Some(Halt::Unreadable) => {
                return fail(
                    "upstream_bad_stream",
                    format!(
                        "upstream {} sent a stream event that is not JSON",
                        upstream.url
                    ),
                )
            }
            None => {}
        }
        if !sent {
            return Pumped {
                status: CallStatus::Aborted,
                failure: None,
                flag: None,
                saw_done,
            };
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn stream_call(
    st: Arc<State>,
    meta: CallMeta,
    resp: Response<Incoming>,
    upstream: Arc<Upstream>,
    sent_at: Instant,
    reply: Reply,
    guard: InFlight,
    translator: Box<dyn StreamTranslator>,
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
            CallStatus::Aborted,
            false,
            Some(&upstream),
            200,
            ms(meta.started),
        );
        let _ = commit(&st, records, &meta.rollout, None).await;
        return;
    }
    let deadline = sent_at + Duration::from_secs_f64(st.cfg.upstream_timeout_s);
    let mut reading = Reading {
        parser: sse::Parser::with_limit(st.cfg.max_sse_event_bytes),
        cap: StreamCapture::new(),
        translator,
    };
    let Pumped {
        mut status,
        mut failure,
        flag,
        saw_done,
    } = pump(&st, &upstream, &mut body, deadline, &tx, &mut reading).await;
    let Reading {
        parser,
        cap,
        mut translator,
    } = reading;
    // Drop the upstream body now: on abort this closes the connection, which
    // makes the engine cancel the generation.
    drop(body);
    let upstream_s = sent_at.elapsed().as_secs_f64();
    st.metrics.upstream_latency.observe(upstream_s);
    if status == CallStatus::Ok {
        if cap.engine_error.is_some() {
            // The engine's error event already went out, translated.
            status = CallStatus::UpstreamError;
        } else if !saw_done && (!parser.remainder().trim_ascii().is_empty() || !cap.all_finished())
        {
            // No `[DONE]` and a choice without finish_reason: the engine went
            // away mid-answer (a close-delimited body ends "cleanly" on a cut).
            status = CallStatus::UpstreamError;
            failure = Some(ApiError::new(
                502,
                "server_error",
                "upstream_failed",
                format!(
                    "upstream {} ended the stream before it finished",
                    upstream.url
                ),
            ));
        }
    }
    let bad_chunks = cap.bad_chunks;
    if failure.is_some() {
        st.pool.record_failure(&upstream);
    }
    let (held, kept) = if status == CallStatus::Ok {
        translator.finish()
    } else {
        (Vec::new(), None)
    };
    let mut records = build_records(
        &meta,
        Some(cap.finish()),
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
    if let Some(f) = flag {
        records.iter_mut().for_each(|r| r.flags.push(f.into()));
    }
    let res = served_unrecorded(&st, commit(&st, records, &meta.rollout, kept).await);
    st.metrics
        .added_latency
        .observe((meta.started.elapsed().as_secs_f64() - upstream_s).max(0.0));
    match (status, res) {
        (CallStatus::Ok, Ok(())) => {
            if !held.is_empty() {
                let _ = tx.send(Bytes::from(held)).await;
            }
        }
        (CallStatus::Ok, Err(e)) => {
            let _ = tx.send(Bytes::from(translator.fail(&e))).await;
        }
        (CallStatus::UpstreamError, _) => {
            if let Some(e) = failure {
                tracing::warn!(rollout = %meta.rollout.id, code = e.code, "stream failed mid-way");
                let _ = tx.send(Bytes::from(translator.fail(&e))).await;
            }
        }
        (CallStatus::Aborted, _) => {
            tracing::debug!(rollout = %meta.rollout.id, "harness hung up mid-stream");
        }
    }
    drop(guard);
}
