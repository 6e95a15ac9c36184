//! The protocol-free record step: the call records of one proxied request
//! (one per choice, exact ids and logprobs, consistency flags) and their commit.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use crate::error::ApiError;
use crate::limits::CallPermit;
use crate::protocol::Kept;
use crate::state::{RolloutInfo, State};
use crate::store::{CallRecord, CallStatus};
use crate::upstream::Upstream;
use crate::wire::engine::{self as capture, Capture, Kind};

/// Decrements the in-flight gauge and frees the call's place under the
/// concurrency limits however the call ends.
#[derive(Debug)]
pub struct InFlight {
    st: Arc<State>,
    _permit: CallPermit,
}

impl InFlight {
    pub fn new(st: &Arc<State>, permit: CallPermit) -> Self {
        st.metrics.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight {
            st: st.clone(),
            _permit: permit,
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.st.metrics.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Everything about one proxied request that ends up in its records.
#[derive(Debug)]
pub struct CallMeta {
    pub rollout: Arc<RolloutInfo>,
    /// The engine endpoint (chat or completions).
    pub kind: Kind,
    /// `Protocol::name` of the harness's protocol.
    pub protocol: &'static str,
    pub request_id: String,
    /// The engine request as sent.
    pub request: String,
    /// The harness's own body.
    pub harness_request: String,
    pub retry_count: u32,
    pub want_ids: bool,
    pub started: Instant,
    /// The id the adapter hands the harness (`Protocol::response_id`); `None`:
    /// the engine's own answer id.
    pub response_id: Option<String>,
}

#[allow(clippy::too_many_arguments)]
pub fn build_records(
    meta: &CallMeta,
    cap: Option<Capture>,
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
        protocol: meta.protocol,
        request: meta.request.clone(),
        harness_request: meta.harness_request.clone(),
        prompt_ids: cap.prompt_ids.clone(),
        completion_ids: None,
        logprobs: None,
        finish_reason: None,
        text: None,
        status,
        flags: Vec::new(),
        delivered,
        retry_count: meta.retry_count,
        weight_version: upstream.map(|u| u.weight_version).unwrap_or(0),
        upstream: upstream.map(|u| u.url.clone()).unwrap_or_default(),
        http_status,
        latency_ms,
        usage: usage.clone(),
        created: crate::util::now(),
        response_id: meta.response_id.clone().or_else(|| cap.id.clone()),
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

pub async fn commit(
    st: &State,
    records: Vec<CallRecord>,
    rollout: &RolloutInfo,
    kept: Option<Kept>,
) -> Result<(), ApiError> {
    let mut records = records;
    let status = records.first().map(|r| r.status);
    let flagged = records.iter().any(|r| !r.flags.is_empty());
    if let Some(k) = &kept {
        // A kept object's id is what the harness was told (`resp_…`).
        for r in records.iter_mut() {
            r.response_id = Some(k.id.clone());
        }
    }
    if let Some(online) = &rollout.online {
        // Online: the session is resolved in the insert's own transaction.
        st.store
            .insert_online_calls(records, online.clone(), kept)
            .await?;
    } else {
        let mark_running = rollout.queued.swap(false, Ordering::Relaxed);
        let res = st.store.insert_calls(records, mark_running, kept).await;
        if res.is_err() && mark_running {
            rollout.queued.store(true, Ordering::Relaxed);
        }
        res?;
    }
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

pub fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1000.0
}
