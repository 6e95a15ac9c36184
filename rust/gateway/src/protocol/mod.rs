//! Protocol adapters: how a harness's API maps onto the one engine dialect that
//! returns exact token ids (docs/design.md#protocols).
//!
//! Engines are always asked in vLLM-wire chat completions (or completions)
//! with `return_token_ids` and `logprobs` on; a harness may speak OpenAI chat
//! completions, completions, the Responses API or Anthropic Messages. Each
//! protocol is one adapter between the protocol-free *forward* step
//! (`proxy::forward`: pool, affinity, retries before the first byte, timeouts)
//! and the *record* step (`proxy::record`: call records, commit). The adapter
//! never does I/O: every method is a pure function of bytes and values, so it
//! can be unit-tested and fuzzed on its own.
//!
//! The pipeline (`proxy::call`) drives an adapter like this:
//!
//! 1. parse the harness's body as JSON (400 in the protocol's shape if not);
//! 2. [`Protocol::history_key`]: if the request continues stored state (the
//!    Responses API's `previous_response_id`), the pipeline loads it from the
//!    store into [`Ctx::history`] (404 in the protocol's shape if unknown);
//! 3. [`Protocol::engine_request`] → the engine request (which endpoint, the
//!    JSON body, streamed or not). Unsupported features are refused here with
//!    a 400 [`ApiError`];
//! 4. forward; the engine's answer is captured (ids, logprobs) by
//!    `wire::engine` whatever the protocol;
//! 5. not streamed: [`Protocol::answer`] turns the engine's whole answer into
//!    the protocol's (or passes it through unchanged), plus anything to keep
//!    ([`Kept`]); the call and the kept object commit in one transaction, then
//!    the answer goes out;
//! 6. streamed: a [`StreamTranslator`] gets every engine SSE event the moment
//!    it is complete, with its chunk as the capture read it (one parse feeds
//!    both), and returns the protocol's frames to send *now*;
//!    [`StreamTranslator::finish`] returns the final frame(s) that the
//!    pipeline holds back until the call has committed (chat's `[DONE]`,
//!    Responses' `response.completed`), so a harness that saw the end of an
//!    answer can rely on it being on disk. [`StreamTranslator::fail`] ends a
//!    stream that broke (engine cut, timeout, store failure) with the
//!    protocol's error frame(s);
//! 7. errors the gateway answers itself go out in [`Protocol::error_body`]'s shape.
//!
//! To add a protocol: implement [`Protocol`] (and its translator) in a new
//! file here and give it a route in `routes::protocol_for`.

use bytes::Bytes;
use hyper::StatusCode;
use serde::Serialize;
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::wire::engine::{read_event, Chunk, Kind};
use crate::wire::sse::Event;

pub mod anthropic_messages;
pub mod openai;
pub mod openai_responses;
pub mod validate;

/// The engine deltas both translating adapters' per-token tests stream: a
/// role, two reasoning pieces under `reasoning_key` (vLLM's `reasoning` or
/// its older `reasoning_content`), two text pieces (a quote, a newline, a
/// tab, a non-ASCII letter), a tool call opening and its first arguments.
/// `frames` sends one delta through the adapter; returns the frames of the
/// second reasoning piece, the second text piece and the arguments.
#[cfg(test)]
pub(crate) fn per_token_frames(
    mut frames: impl FnMut(Value) -> String,
    reasoning_key: &str,
) -> [String; 3] {
    let reasoning =
        |text: &str| Value::Object(Map::from_iter([(reasoning_key.into(), text.into())]));
    frames(serde_json::json!({"role": "assistant", "content": ""}));
    frames(reasoning("so"));
    let thought = frames(reasoning(" \"hm\"\n"));
    frames(serde_json::json!({"content": "Hi"}));
    let text = frames(serde_json::json!({"content": " thére\t"}));
    frames(
        serde_json::json!({"tool_calls": [{"index": 0, "id": "call_9", "type": "function",
        "function": {"name": "f", "arguments": ""}}]}),
    );
    let arguments = frames(
        serde_json::json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\": 1"}}]}),
    );
    [thought, text, arguments]
}

/// The argument text of tool calls as the engine generated it, by tool call
/// id, for the adapters whose protocol carries arguments as a JSON *value*
/// (Anthropic's `tool_use.input`): a harness re-sends the value, and
/// re-serialising it (`{"city":"Paris"}`) is not the text the model wrote
/// (`{"city": "Paris"}`), so the re-sent history would leave the path the
/// engine generated and the rollout would split. The adapter records what it
/// translated and, when the harness sends a tool call back, takes the
/// recorded text if it parses to the very value sent (so an edited input is
/// still sent as edited).
///
/// Bounded: the oldest ids are forgotten past `capacity`. The Messages
/// adapter also keeps each answer's texts in the store ([`Kept`] under
/// [`tool_args_key`] of its first tool call), and the proxy puts back those a
/// request re-sends that this map lacks (an older call, or one from before a
/// restart), so the rollout stays on the path the engine generated.
#[derive(Debug)]
pub struct ToolArgs {
    capacity: usize,
    inner: std::sync::Mutex<(
        std::collections::HashMap<String, String>,
        std::collections::VecDeque<String>,
    )>,
}

impl Default for ToolArgs {
    fn default() -> Self {
        ToolArgs::new(65_536)
    }
}

impl ToolArgs {
    pub fn new(capacity: usize) -> Self {
        ToolArgs {
            capacity: capacity.max(1),
            inner: Default::default(),
        }
    }

    /// Records the engine's text for tool call `id` (empty ids are not kept).
    pub fn put(&self, id: &str, arguments: &str) {
        if id.is_empty() {
            return;
        }
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let (map, order) = &mut *g;
        if map.insert(id.to_string(), arguments.to_string()).is_none() {
            order.push_back(id.to_string());
        }
        while order.len() > self.capacity {
            if let Some(old) = order.pop_front() {
                map.remove(&old);
            }
        }
    }

    /// Whether the text of tool call `id` is held.
    pub fn has(&self, id: &str) -> bool {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.0.contains_key(id)
    }

    /// The engine's text for tool call `id` if it is exactly `value` once parsed.
    pub fn text_of(&self, id: &str, value: &Value) -> Option<String> {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let text = g.0.get(id)?;
        (serde_json::from_str::<Value>(text).ok().as_ref() == Some(value)).then(|| text.clone())
    }
}

/// The [`Kept`] id under which an answer's tool-call texts are stored: its
/// first tool call's id, prefixed (`state`: `{"tool_args": {id: text}}`).
pub fn tool_args_key(first_id: &str) -> String {
    format!("tool-args:{first_id}")
}

/// The `(id, text)` pairs a [`tool_args_key`] row's state holds.
pub fn tool_args_of(state: &Value) -> Vec<(String, String)> {
    state
        .get("tool_args")
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
        .filter_map(|(id, t)| Some((id.clone(), t.as_str()?.to_string())))
        .collect()
}

/// What the pipeline tells an adapter about one call.
#[derive(Debug, Clone, Default)]
pub struct Ctx {
    /// Ask the engine for token ids and logprobs (train rollouts; eval rollouts
    /// when `eval_capture` is on).
    pub want_ids: bool,
    /// Temperature forced by the rollout's mode (`None`: the harness's own).
    pub temperature: Option<f64>,
    /// The gateway's id of this call (`call-…`); adapters derive the ids they
    /// hand out (`resp_…`, `msg_…`) from it, so they are unique and traceable.
    pub call_id: String,
    /// Unix seconds when the call arrived.
    pub created: u64,
    /// The stored state [`Protocol::history_key`] asked for (`Kept::state`), if any.
    pub history: Option<Value>,
    /// The adapter's own per-call state: set by [`Protocol::engine_request`],
    /// read by [`Protocol::answer`] and the translator (e.g. the names it
    /// gave tools, the fields to echo). `Null` unless the adapter sets it.
    pub state: Value,
    /// The gateway's record of generated tool-call arguments (`None`: none kept).
    pub tool_args: Option<std::sync::Arc<ToolArgs>>,
    /// Answer with only what the client asked for: the ids and logprobs the
    /// gateway asked the engine for are recorded, not returned (application
    /// keys: production clients; rollout harnesses get the engine's answer).
    pub client_fields_only: bool,
}

/// Which stored state a request continues from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum History {
    /// One kept object, by the id the harness was given (`previous_response_id`):
    /// 404 if there is none.
    Response(String),
    /// The latest kept object of a named conversation (the Responses API's
    /// `conversation`, online mode): none yet starts the conversation.
    Conversation(String),
}

/// The request to send to the engine.
#[derive(Debug, Clone)]
pub struct EngineRequest {
    /// Chat completions or completions (decides the engine path and how ids are read).
    pub kind: Kind,
    pub body: Map<String, Value>,
    /// Whether to stream the engine's answer (and the harness's).
    pub stream: bool,
}

/// A protocol's answer to a whole (non-streamed) engine answer.
#[derive(Debug, Clone)]
pub enum Answer {
    /// Send the engine's answer unchanged: its status, headers and body
    /// (chat and completions: the harness speaks the engine's dialect).
    Passthrough,
    /// Send this JSON body with this status.
    Json { status: StatusCode, body: Bytes },
}

/// An object a protocol keeps in the store beside the call, committed in the
/// same transaction (the Responses API's response objects, for
/// `GET /v1/responses/{id}` and `previous_response_id`).
#[derive(Debug, Clone, PartialEq)]
pub struct Kept {
    /// The id the harness knows it by (`resp_…`).
    pub id: String,
    /// The protocol's public object (what `GET` returns).
    pub object: Value,
    /// Whatever the adapter needs to continue from it (for Responses: the
    /// whole conversation as input items); handed back in [`Ctx::history`].
    pub state: Value,
}

/// A protocol adapter. Implementations are stateless statics; all per-call
/// state lives in [`Ctx`] and in the [`StreamTranslator`].
pub trait Protocol: Send + Sync + std::fmt::Debug {
    /// Stored with every call (`calls.protocol`): `openai_chat`, `openai_completions`, …
    fn name(&self) -> &'static str;

    /// The request's shape at the door ([`validate`]): wrong types, missing
    /// fields and sizes above the gateway's [`validate::Caps`] are a 400
    /// before anything reaches the engine or the store.
    fn check(&self, _req: &Map<String, Value>, _caps: &validate::Caps) -> Result<(), ApiError> {
        Ok(())
    }

    /// The ids of the tool calls the request re-sends whose argument text the
    /// adapter restores from [`ToolArgs`] (the proxy fills in those it lacks
    /// from the store first).
    fn resent_tool_ids(&self, _body: &Value) -> Vec<String> {
        Vec::new()
    }

    /// The stored state this request continues from, if any.
    fn history_key(&self, _body: &Value) -> Option<History> {
        None
    }

    /// The harness's request → the engine request. Refuses what the adapter
    /// cannot translate faithfully with a 400. May leave per-call state for
    /// the answer side in [`Ctx::state`].
    fn engine_request(&self, body: Value, ctx: &mut Ctx) -> Result<EngineRequest, ApiError>;

    /// The engine's whole answer (`status`, `body`) → the protocol's answer,
    /// and what to keep in the store.
    fn answer(&self, status: StatusCode, engine: &Bytes, ctx: &Ctx) -> (Answer, Option<Kept>);

    /// A fresh stream translator for one streamed call.
    fn translator(&self, ctx: &Ctx) -> Box<dyn StreamTranslator>;

    /// The body of an error the gateway answers with, in the protocol's shape.
    fn error_body(&self, e: &ApiError) -> Bytes;

    /// The id of the answer the harness will be given, when the adapter makes
    /// it (`msg_…` derived from [`Ctx::call_id`]); stored with the call so
    /// online feedback can name it. `None` (the default): the engine's own
    /// answer id (chat `chatcmpl-…`, completions `cmpl-…`), or the [`Kept`]
    /// object's id when there is one.
    fn response_id(&self, _ctx: &Ctx) -> Option<String> {
        None
    }
}

/// Turns one engine SSE stream into the protocol's SSE frames as it arrives.
pub trait StreamTranslator: Send {
    /// One complete engine event (`[DONE]` included) and its chunk, read once
    /// for the capture and the translator (`wire::engine::read_event`; `None`
    /// for `[DONE]` and an event without data). An event whose chunk does not
    /// read never gets here: the pipeline ends the stream. Appends the frames
    /// to send right away to `out` (nothing, if it has nothing to say yet).
    fn on_event(&mut self, ev: &Event, chunk: Option<&Chunk<'_>>, out: &mut Vec<u8>);

    /// The engine's stream ended well. Returns the final frame(s), which the
    /// pipeline sends only after the call has committed, and what to keep.
    fn finish(&mut self) -> (Vec<u8>, Option<Kept>);

    /// The call failed after the stream began (engine cut off, timeout, store
    /// failure): the frame(s) that end the stream with this error.
    fn fail(&mut self, e: &ApiError) -> Vec<u8>;
}

/// Hands one engine event to `t` as the pipeline does (for the tests and the
/// fuzz targets, which have no capture): its chunk read once and handed on.
/// `false`, and nothing handed on, when the chunk does not read (the
/// pipeline ends the stream there).
pub fn translate_event(t: &mut dyn StreamTranslator, ev: &Event, out: &mut Vec<u8>) -> bool {
    match read_event(ev) {
        Ok(chunk) => {
            t.on_event(ev, chunk.as_ref(), out);
            true
        }
        Err(_) => false,
    }
}

/// The JSON object a harness sent, or a 400 saying so.
pub fn object(body: Value) -> Result<Map<String, Value>, ApiError> {
    match body {
        Value::Object(m) => Ok(m),
        _ => Err(ApiError::bad_request(
            "invalid_json",
            "request body must be a JSON object",
        )),
    }
}

/// One SSE frame: `event: NAME` (when given) and one `data:` line.
pub fn sse_frame(out: &mut Vec<u8>, event: Option<&str>, data: &[u8]) {
    if let Some(name) = event {
        out.extend_from_slice(b"event: ");
        out.extend_from_slice(name.as_bytes());
        out.push(b'\n');
    }
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(data);
    out.extend_from_slice(b"\n\n");
}

/// `v` as JSON, appended to a frame being written by hand.
pub fn push_json(out: &mut Vec<u8>, v: &(impl Serialize + ?Sized)) {
    // Into a Vec, a string or a number cannot fail to serialize.
    let _ = serde_json::to_writer(out, v);
}
