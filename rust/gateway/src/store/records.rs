//! The store's row types: what goes in (`CallRecord`, `NewRollout`) and what
//! comes back out (`StoredCall`, `RolloutRow`, `RolloutRecord`, ...).

use lightning_core::Call;
use serde::Serialize;

/// A rollout's mode: train rollouts are captured for training, eval ones
/// may run without capture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Train,
    Eval,
}

impl Mode {
    /// The stored spelling (`rollouts.mode`).
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Train => "train",
            Mode::Eval => "eval",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CallStatus {
    Ok,
    UpstreamError,
    Aborted,
}

impl CallStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            CallStatus::Ok => "ok",
            CallStatus::UpstreamError => "upstream_error",
            CallStatus::Aborted => "aborted",
        }
    }
}

/// One recorded completion (one choice of one proxied request).
#[derive(Debug, Clone)]
pub struct CallRecord {
    pub rollout_id: String,
    pub request_id: String,
    pub choice_index: i64,
    /// `chat` or `completion`: the engine endpoint the call went to.
    pub kind: &'static str,
    /// The protocol the harness spoke (`Protocol::name`).
    pub protocol: &'static str,
    /// The engine request (JSON).
    pub request: String,
    /// The harness's own request body, before translation.
    pub harness_request: String,
    pub prompt_ids: Option<Vec<u32>>,
    pub completion_ids: Option<Vec<u32>>,
    pub logprobs: Option<Vec<f32>>,
    pub finish_reason: Option<String>,
    pub text: Option<String>,
    pub status: CallStatus,
    pub flags: Vec<String>,
    /// Whether the harness received the whole answer.
    pub delivered: bool,
    pub retry_count: u32,
    pub weight_version: u64,
    pub upstream: String,
    pub http_status: u16,
    pub latency_ms: f64,
    pub usage: Option<String>,
    pub created: f64,
    /// The id the harness was given for this answer (for feedback).
    pub response_id: Option<String>,
}

#[derive(Debug, Clone)]
pub struct NewRollout {
    pub id: String,
    pub group: Option<String>,
    pub task: String,
    pub mode: String,
    pub token_hash: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct RolloutRow {
    pub rollout_id: String,
    pub group: Option<String>,
    pub task: serde_json::Value,
    pub mode: String,
    pub status: String,
    #[serde(skip)]
    pub token_hash: String,
    pub created: f64,
    pub updated: f64,
}

/// A call as read back from the store.
#[derive(Debug, Clone, Serialize)]
pub struct StoredCall {
    pub seq: i64,
    pub request_id: String,
    pub choice_index: i64,
    pub kind: String,
    pub prompt_ids: Option<Vec<u32>>,
    pub completion_ids: Option<Vec<u32>>,
    pub logprobs: Option<Vec<f32>>,
    pub finish_reason: Option<String>,
    pub text: Option<String>,
    pub status: String,
    pub flags: Vec<String>,
    pub delivered: bool,
    pub retry_count: i64,
    pub weight_version: i64,
    pub upstream: String,
    pub http_status: i64,
    pub latency_ms: f64,
    pub usage: Option<serde_json::Value>,
    pub created: f64,
}

/// Which rollouts to read; every given filter must hold. `rollout_ids` also
/// fixes the output order (else: creation order, `created` then id).
#[derive(Debug, Clone, Default)]
pub struct Selection {
    pub rollout_ids: Option<Vec<String>>,
    pub group: Option<String>,
    pub status: Option<String>,
    pub mode: Option<String>,
    /// Keyset paging (without `rollout_ids`): only rollouts after this one in
    /// creation order. An id not in the store gives an empty page, so a client
    /// following `next` never loops back to the start.
    pub after: Option<String>,
    /// At most this many (without `rollout_ids`; `None`: all).
    pub limit: Option<i64>,
}

/// Calls per time bucket over a window that ends at the store's latest call
/// (`Reader::call_rate`): the live chart of a gateway's load and errors.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CallRate {
    /// `created` of the latest call (`None`: no calls yet).
    pub end: Option<f64>,
    pub bucket_s: f64,
    /// Every bucket of the window in time order, empty ones included.
    pub buckets: Vec<RateBucket>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RateBucket {
    /// Start of the bucket (unix seconds, a multiple of `bucket_s`).
    pub start: f64,
    pub calls: i64,
    pub upstream_errors: i64,
    pub aborted: i64,
}

/// A rollout as read back, with its latest reward.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutRecord {
    pub rollout_id: String,
    pub group: Option<String>,
    /// The task as stored (JSON text).
    pub task: String,
    pub mode: String,
    pub status: String,
    /// The value of the rollout's latest `reward` event, if any.
    pub reward: Option<f64>,
    pub created: f64,
    pub updated: f64,
}

/// One event of a rollout (`data` is the stored JSON text).
#[derive(Debug, Clone, PartialEq)]
pub struct EventRecord {
    pub seq: i64,
    pub kind: String,
    pub data: String,
    pub created: f64,
}

/// A step's batch: the selected rollouts and, rollout by rollout in that order,
/// their trainable calls in seq order (what the harness saw whole, with ids).
#[derive(Debug, Clone, Default)]
pub struct StepData {
    pub rollouts: Vec<RolloutRecord>,
    pub calls: Vec<Call>,
    /// Calls left out because they cannot be trained on (aborted, upstream
    /// errors, not delivered whole, no ids, empty completion).
    pub skipped_calls: usize,
}

/// One feedback signal of an online session (`data` is the stored JSON text).
#[derive(Debug, Clone, PartialEq)]
pub struct FeedbackRecord {
    pub feedback_id: String,
    pub response_id: Option<String>,
    pub name: String,
    pub value: f64,
    pub ts: f64,
    pub after_training: bool,
    pub data: String,
}

/// A call's protocol, the harness's own request (stored on a request's first
/// choice only) and the response id the harness was given.
#[derive(Debug, Clone, PartialEq)]
pub struct CallBody {
    pub seq: i64,
    pub protocol: Option<String>,
    pub harness_request: Option<String>,
    pub response_id: Option<String>,
}
