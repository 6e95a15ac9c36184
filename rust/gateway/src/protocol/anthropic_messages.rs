//! Anthropic Messages (`POST /v1/messages`, `POST /v1/messages/count_tokens`):
//! what Claude Code and the `anthropic` SDKs speak, translated to and from the
//! engine's vLLM-wire chat completions (docs/design.md#protocols).
//!
//! Sources: the API reference (platform.claude.com/docs/en/api/messages,
//! .../messages-streaming, .../errors, .../messages-count-tokens) and the
//! official Python SDK `anthropic` 2.16.0, whose types are cited by file
//! (`anthropic/types/...`). What the real Claude Code 2.1.332 sends was
//! recorded (docs/harnesses.md#what-claude-code-sends) and every field of it is
//! handled below.
//!
//! Request (`MessageCreateParamsBase`, `types/message_create_params.py`):
//! - `system` (string or text blocks) → a leading chat `system` message.
//! - `messages[]`: `user`/`assistant`/`system` (`MessageParam` =
//!   `UserMessageParam | AssistantMessageParam | SystemMessageParam`; Claude
//!   Code sends `system` turns mid-conversation) → chat messages in order.
//!   Blocks: `text` → content; `tool_use` → `tool_calls[]` (`arguments` = the
//!   input as JSON); `tool_result` (string or text blocks) → a `tool` message;
//!   `thinking` → the assistant message's `reasoning` (vLLM's input field,
//!   `vllm/entrypoints/chat_utils.py`, which hands it to the template as
//!   `reasoning_content` too). Several text blocks join with `\n`, as vLLM
//!   joins text parts for string-content templates.
//! - `tools[]` (`ToolParam`: `name`, `description`, `input_schema`) → function
//!   tools; `tool_choice` `auto`/`any`/`tool`/`none` → `auto`/`required`/
//!   named function/`none`; `disable_parallel_tool_use` → `parallel_tool_calls: false`.
//! - `max_tokens`, `stop_sequences` (→ `stop`), `temperature`, `top_p`, `top_k`.
//! - `thinking` `enabled`/`adaptive`/`disabled` → `chat_template_kwargs.enable_thinking`
//!   (the switch reasoning templates such as Qwen3's read; others ignore it).
//!
//! Refused with 400 (never dropped silently): images, documents, search
//! results and every other non-text input block; server tools (`web_search_*`,
//! `code_execution_*`, `bash_*`, `text_editor_*`, ... anything with a `type`
//! other than `custom`); `tool_reference` results; `container`, `mcp_servers`.
//!
//! Ignored, because they mean nothing to a self-hosted engine (the harness's
//! original body is stored with the call, so nothing is lost from the record):
//! `cache_control` everywhere (vLLM caches prefixes by itself), `metadata`,
//! `context_management` (Claude Code sends the no-op `clear_thinking` edit
//! with `keep: all`), `output_config.effort`, `thinking.budget_tokens` and
//! `thinking.display` (the engine's reasoning is always returned in full so the
//! harness can send it back verbatim), `service_tier`, `speed`,
//! `inference_geo`, `diagnostics`, tool `strict`/`input_examples`/
//! `eager_input_streaming`/`allowed_callers`, `redacted_thinking` input blocks
//! (opaque, never produced by this gateway), `is_error` on tool results (chat
//! tool messages have no such flag; Claude Code puts the error text in the
//! content), and the `anthropic-beta`/`anthropic-version` headers. Tools with
//! `defer_loading: true` are left out of the engine's tool list: the API does
//! not show them to the model until a tool search loads them.
//!
//! Response (`types/message.py`): `id` `msg_…`, `content` = [`thinking`]
//! [`text`] `tool_use`…, `stop_reason` (`types/stop_reason.py`) from the
//! engine's `finish_reason`: `stop` → `end_turn` (`stop_sequence`, with the
//! string, when vLLM's `stop_reason` names a stop string), `tool_calls` or any
//! tool call → `tool_use`, `length` → `max_tokens`, `content_filter` →
//! `refusal`; `usage` `input_tokens`/`output_tokens` (+ zero cache counts).
//! Streaming (`types/raw_message_stream_event.py`): `message_start`, `ping`,
//! per block `content_block_start`, `content_block_delta` (`text_delta`,
//! `thinking_delta` + one `signature_delta`, `input_json_delta`),
//! `content_block_stop`, then `message_delta` and `message_stop`, which are
//! held back until the call is committed. Errors: `{"type":"error","error":
//! {"type","message"}}` (`types/shared/error_response.py`), as an `error`
//! event inside a stream.
//!
//! Known difference between streamed and whole answers: a tool call whose
//! arguments are not a JSON object streams its raw arguments (the harness
//! rejects them), while a whole answer has no way to carry them and gives `{}`.

use bytes::Bytes;
use hyper::StatusCode;
use serde_json::{json, Map, Value};

use super::openai::capture_fields;
use super::{
    object, push_json, sse_frame, tool_args_key, Answer, Ctx, EngineRequest, Kept, Protocol,
    StreamTranslator, ToolArgs,
};
use crate::error::ApiError;
use crate::wire::engine::{Choice, Chunk, Delta, Kind, ToolCallDelta};
use crate::wire::sse::Event;

#[derive(Debug, Clone, Copy)]
pub struct AnthropicMessages;

impl Protocol for AnthropicMessages {
    fn name(&self) -> &'static str {
        "anthropic_messages"
    }

    fn resent_tool_ids(&self, body: &Value) -> Vec<String> {
        resent_tool_ids(body)
    }

    fn check(
        &self,
        req: &Map<String, Value>,
        caps: &super::validate::Caps,
    ) -> Result<(), ApiError> {
        super::validate::messages(req, caps)
    }

    fn engine_request(&self, body: Value, ctx: &mut Ctx) -> Result<EngineRequest, ApiError> {
        let req = object(body)?;
        let mut chat = to_chat(&req, true)?;
        if let Some(args) = &ctx.tool_args {
            restore_arguments(&mut chat, args);
        }
        capture_fields(&mut chat, Kind::Chat, ctx);
        let stream = req.get("stream").and_then(Value::as_bool).unwrap_or(false);
        if stream {
            chat.insert("stream".into(), Value::Bool(true));
            chat.insert("stream_options".into(), json!({"include_usage": true}));
        }
        Ok(EngineRequest {
            kind: Kind::Chat,
            body: chat,
            stream,
        })
    }

    fn answer(&self, status: StatusCode, engine: &Bytes, ctx: &Ctx) -> (Answer, Option<Kept>) {
        if !status.is_success() {
            return (
                json_answer(status, &engine_error(status.as_u16(), engine)),
                None,
            );
        }
        let message = serde_json::from_slice::<Value>(engine)
            .map_err(|e| format!("the engine's answer is not JSON: {e}"))
            .and_then(|v| {
                message_from_chat(&v, ctx)
                    .ok_or_else(|| "the engine's answer has no choices".into())
            });
        match message {
            Ok(m) => {
                let mut generated = Vec::new();
                if let (Some(args), Ok(v)) =
                    (&ctx.tool_args, serde_json::from_slice::<Value>(engine))
                {
                    generated = remember_arguments(&v, &m, args);
                }
                (
                    json_answer(StatusCode::OK, &m),
                    kept_arguments(&generated, ctx.client_fields_only),
                )
            }
            Err(msg) => (
                json_answer(StatusCode::BAD_GATEWAY, &error_json(502, &msg)),
                None,
            ),
        }
    }

    fn translator(&self, ctx: &Ctx) -> Box<dyn StreamTranslator> {
        Box::new(Translator::new(ctx))
    }

    fn error_body(&self, e: &ApiError) -> Bytes {
        Bytes::from(error_json(e.status, &e.message).to_string())
    }

    /// The harness sees `msg_…`, not the engine's `chatcmpl-…`: online
    /// feedback names the message by the id the client was given.
    fn response_id(&self, ctx: &Ctx) -> Option<String> {
        Some(message_id(ctx))
    }
}

fn json_answer(status: StatusCode, v: &Value) -> Answer {
    Answer::Json {
        status,
        body: Bytes::from(v.to_string()),
    }
}

// ------------------------------------------------------------------ errors

/// Anthropic's error type for an HTTP status (API reference, "Errors"; the
/// SDK's `types/shared/error_type.py` and `_exceptions.py`).
pub fn error_type(status: u16) -> &'static str {
    match status {
        400 => "invalid_request_error",
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        409 => "conflict_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        504 => "timeout_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

/// `{"type": "error", "error": {"type", "message"}}`.
pub fn error_json(status: u16, message: &str) -> Value {
    json!({"type": "error", "error": {"type": error_type(status), "message": message}})
}

/// An engine's error answer, in Anthropic's shape with the same status.
pub fn engine_error(status: u16, body: &[u8]) -> Value {
    error_json(status, &engine_message(body))
}

/// The message of an engine's error body (vLLM: `{"error": {"message"}}` or
/// `{"object": "error", "message"}`), else the body's text.
fn engine_message(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let v: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(_) => return format!("the engine answered: {}", text.trim()),
    };
    let msg = v
        .pointer("/error/message")
        .or_else(|| v.get("message"))
        .or_else(|| v.get("detail"))
        .and_then(Value::as_str);
    match msg {
        Some(m) => format!("the engine refused the request: {m}"),
        None => format!("the engine answered: {}", text.trim()),
    }
}

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::bad_request("invalid_request", message)
}

fn unsupported(message: impl Into<String>) -> ApiError {
    ApiError::bad_request("unsupported_feature", message)
}

// ------------------------------------------------------------------ request

/// The Messages request → a chat completions request (without the capture
/// fields). `count_tokens` requests carry no `max_tokens`: `need_max` is false.
pub fn to_chat(req: &Map<String, Value>, need_max: bool) -> Result<Map<String, Value>, ApiError> {
    for key in ["container", "mcp_servers"] {
        if req.get(key).is_some_and(|v| !v.is_null()) {
            return Err(unsupported(format!(
                "`{key}` needs Anthropic's hosted tools; this gateway serves a self-hosted model and cannot run them"
            )));
        }
    }
    let mut chat = Map::new();
    if let Some(m) = req.get("model") {
        chat.insert("model".into(), m.clone());
    }
    let mut messages = Vec::new();
    if let Some(s) = req.get("system") {
        let text = text_of(s, "system")?;
        if !text.is_empty() {
            messages.push(json!({"role": "system", "content": text}));
        }
    }
    let input = req
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("`messages` must be a list of {role, content} objects"))?;
    for (i, m) in input.iter().enumerate() {
        push_message(&mut messages, m, i)?;
    }
    chat.insert("messages".into(), Value::Array(messages));
    match req.get("max_tokens") {
        Some(v) if v.as_u64().is_some_and(|n| n >= 1) => {
            chat.insert("max_tokens".into(), v.clone());
        }
        Some(v) => return Err(bad(format!("`max_tokens` must be an integer ≥ 1, got {v}"))),
        None if need_max => return Err(bad("`max_tokens` is required")),
        None => {}
    }
    sampling(req, &mut chat)?;
    tools(req, &mut chat)?;
    thinking(req, &mut chat);
    Ok(chat)
}

fn sampling(req: &Map<String, Value>, chat: &mut Map<String, Value>) -> Result<(), ApiError> {
    for key in ["temperature", "top_p", "top_k"] {
        match req.get(key) {
            None | Some(Value::Null) => {}
            Some(v) if v.is_number() => {
                chat.insert(key.into(), v.clone());
            }
            Some(v) => return Err(bad(format!("`{key}` must be a number, got {v}"))),
        }
    }
    match req.get("stop_sequences") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => {
            if !a.is_empty() {
                chat.insert("stop".into(), Value::Array(a.clone()));
            }
        }
        Some(v) => {
            return Err(bad(format!(
                "`stop_sequences` must be a list of strings, got {v}"
            )))
        }
    }
    Ok(())
}

/// `thinking` → the template switch `enable_thinking` (Qwen3-style templates).
fn thinking(req: &Map<String, Value>, chat: &mut Map<String, Value>) {
    let on = match req
        .get("thinking")
        .and_then(|t| t.get("type"))
        .and_then(Value::as_str)
    {
        Some("enabled" | "adaptive") => true,
        Some("disabled") => false,
        _ => return,
    };
    chat.insert(
        "chat_template_kwargs".into(),
        json!({ "enable_thinking": on }),
    );
}

/// `system`, a system turn or a tool result's content: a string or text blocks.
fn text_of(v: &Value, what: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut parts = Vec::with_capacity(blocks.len());
            for b in blocks {
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => parts.push(block_text(b)?),
                    other => return Err(unsupported_block(other, what)),
                }
            }
            Ok(parts.join("\n"))
        }
        _ => Err(bad(format!(
            "`{what}` must be a string or a list of text blocks"
        ))),
    }
}

fn block_text(b: &Value) -> Result<String, ApiError> {
    b.get("text")
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| bad("a text block needs a string `text`"))
}

fn unsupported_block(kind: Option<&str>, what: &str) -> ApiError {
    match kind {
        Some(k @ ("image" | "document" | "search_result" | "container_upload")) => unsupported(format!(
            "`{k}` blocks in {what} are not supported: the gateway translates text only for a text-only engine"
        )),
        Some("tool_reference") => unsupported(format!(
            "`tool_reference` blocks in {what} are not supported: deferred tools are not loaded by this gateway"
        )),
        Some(k) => unsupported(format!("content blocks of type `{k}` are not supported in {what}")),
        None => bad(format!("every content block in {what} needs a string `type`")),
    }
}

/// One Messages turn → one or more chat messages, in order.
fn push_message(out: &mut Vec<Value>, m: &Value, i: usize) -> Result<(), ApiError> {
    let what = format!("messages[{i}]");
    let role = m.get("role").and_then(Value::as_str).unwrap_or("");
    let content = m
        .get("content")
        .ok_or_else(|| bad(format!("{what} has no `content`")))?;
    match role {
        "system" => {
            out.push(json!({"role": "system", "content": text_of(content, &what)?}));
            Ok(())
        }
        "user" => push_user(out, content, &what),
        "assistant" => {
            out.push(assistant(content, &what)?);
            Ok(())
        }
        r => Err(bad(format!(
            "{what} has role `{r}`; use `user`, `assistant` or `system`"
        ))),
    }
}

/// A user turn: runs of text become user messages, each `tool_result` a tool message.
fn push_user(out: &mut Vec<Value>, content: &Value, what: &str) -> Result<(), ApiError> {
    let blocks = match content {
        Value::String(s) => {
            out.push(json!({"role": "user", "content": s}));
            return Ok(());
        }
        Value::Array(b) => b,
        _ => {
            return Err(bad(format!(
                "{what}: `content` must be a string or a list of blocks"
            )))
        }
    };
    let mut text: Vec<String> = Vec::new();
    let flush = |text: &mut Vec<String>, out: &mut Vec<Value>| {
        if !text.is_empty() {
            out.push(json!({"role": "user", "content": text.join("\n")}));
            text.clear();
        }
    };
    for b in blocks {
        match b.get("type").and_then(Value::as_str) {
            Some("text") => text.push(block_text(b)?),
            Some("tool_result") => {
                flush(&mut text, out);
                out.push(tool_result(b, what)?);
            }
            other => return Err(unsupported_block(other, what)),
        }
    }
    flush(&mut text, out);
    Ok(())
}

fn tool_result(b: &Value, what: &str) -> Result<Value, ApiError> {
    let id = b
        .get("tool_use_id")
        .and_then(Value::as_str)
        .ok_or_else(|| bad(format!("a tool_result in {what} needs `tool_use_id`")))?;
    let content = match b.get("content") {
        None | Some(Value::Null) => String::new(),
        Some(c) => text_of(c, &format!("the tool_result content in {what}"))?,
    };
    Ok(json!({"role": "tool", "tool_call_id": id, "content": content}))
}

/// An assistant turn: text → `content`, thinking → `reasoning`, tool_use → `tool_calls`.
fn assistant(content: &Value, what: &str) -> Result<Value, ApiError> {
    let blocks = match content {
        Value::String(s) => return Ok(json!({"role": "assistant", "content": s})),
        Value::Array(b) => b,
        _ => {
            return Err(bad(format!(
                "{what}: `content` must be a string or a list of blocks"
            )))
        }
    };
    let (mut text, mut reasoning, mut calls) = (Vec::new(), Vec::new(), Vec::new());
    for b in blocks {
        match b.get("type").and_then(Value::as_str) {
            Some("text") => text.push(block_text(b)?),
            Some("thinking") => reasoning.push(
                b.get("thinking")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad(format!("a thinking block in {what} needs `thinking`")))?
                    .to_string(),
            ),
            Some("redacted_thinking") => {}
            Some("tool_use") => calls.push(tool_call(b, what)?),
            Some(k @ ("server_tool_use" | "mcp_tool_use")) => {
                return Err(unsupported(format!(
                    "`{k}` blocks in {what} are not supported: server tools cannot run on a self-hosted engine"
                )))
            }
            other => return Err(unsupported_block(other, what)),
        }
    }
    let mut msg = Map::new();
    msg.insert("role".into(), json!("assistant"));
    let content = if text.is_empty() && !calls.is_empty() {
        Value::Null
    } else {
        Value::String(text.join("\n"))
    };
    msg.insert("content".into(), content);
    if !reasoning.is_empty() {
        msg.insert("reasoning".into(), Value::String(reasoning.join("\n")));
    }
    if !calls.is_empty() {
        msg.insert("tool_calls".into(), Value::Array(calls));
    }
    Ok(Value::Object(msg))
}

fn tool_call(b: &Value, what: &str) -> Result<Value, ApiError> {
    let field = |k: &str| {
        b.get(k)
            .and_then(Value::as_str)
            .ok_or_else(|| bad(format!("a tool_use block in {what} needs a string `{k}`")))
    };
    let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
    Ok(json!({
        "id": field("id")?,
        "type": "function",
        "function": {"name": field("name")?, "arguments": input.to_string()},
    }))
}

/// Each re-sent `tool_use`'s arguments as the engine wrote them, where the
/// gateway still has that text and it is the value the harness sent
/// ([`ToolArgs`]); otherwise the compact re-serialisation stays.
pub fn restore_arguments(chat: &mut Map<String, Value>, args: &ToolArgs) {
    let Some(Value::Array(messages)) = chat.get_mut("messages") else {
        return;
    };
    for m in messages {
        let Some(Value::Array(calls)) = m.get_mut("tool_calls") else {
            continue;
        };
        for c in calls {
            let Some(id) = c.get("id").and_then(Value::as_str).map(str::to_string) else {
                continue;
            };
            let Some(f) = c.get_mut("function") else {
                continue;
            };
            let value = f
                .get("arguments")
                .and_then(Value::as_str)
                .and_then(|a| serde_json::from_str::<Value>(a).ok());
            if let Some(text) = value.and_then(|v| args.text_of(&id, &v)) {
                f["arguments"] = Value::String(text);
            }
        }
    }
}

/// The `tool_use` ids of the assistant turns a request re-sends.
pub fn resent_tool_ids(body: &Value) -> Vec<String> {
    body.get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))
        .filter_map(|m| m.get("content").and_then(Value::as_array))
        .flatten()
        .filter(|b| b.get("type").and_then(Value::as_str) == Some("tool_use"))
        .filter_map(|b| b.get("id").and_then(Value::as_str).map(str::to_string))
        .collect()
}

/// An answer's generated tool-call texts as a store row ([`tool_args_key`]),
/// so a re-send after a restart finds them; none for application keys
/// (online mode keeps no such rows).
fn kept_arguments(generated: &[(String, String)], online: bool) -> Option<Kept> {
    let (first, _) = generated.first()?;
    if online {
        return None;
    }
    let map: Map<String, Value> = generated
        .iter()
        .map(|(id, t)| (id.clone(), Value::String(t.clone())))
        .collect();
    Some(Kept {
        id: tool_args_key(first),
        object: Value::Null,
        state: json!({ "tool_args": map }),
    })
}

/// Records the engine's argument text of each tool call in a whole answer,
/// under the `tool_use` id the harness was given; returns what it recorded.
fn remember_arguments(engine: &Value, message: &Value, args: &ToolArgs) -> Vec<(String, String)> {
    let calls = engine
        .pointer("/choices/0/message/tool_calls")
        .and_then(Value::as_array);
    let ids = message
        .get("content")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|b| b.get("type").and_then(Value::as_str) == Some("tool_use"))
        .filter_map(|b| b.get("id").and_then(Value::as_str));
    let mut out = Vec::new();
    for (c, id) in calls.into_iter().flatten().zip(ids) {
        if let Some(text) = c.pointer("/function/arguments").and_then(Value::as_str) {
            args.put(id, text);
            out.push((id.to_string(), text.to_string()));
        }
    }
    out
}

/// `tools` and `tool_choice`. Only client tools (no `type`, or `custom`).
fn tools(req: &Map<String, Value>, chat: &mut Map<String, Value>) -> Result<(), ApiError> {
    let list = match req.get("tools") {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(bad("`tools` must be a list")),
    };
    let mut out = Vec::new();
    for t in list {
        match t.get("type").and_then(Value::as_str) {
            None | Some("custom") => {}
            Some(k) => {
                return Err(unsupported(format!(
                    "server tool `{k}` is not supported: Anthropic runs it on its servers, and this gateway serves a self-hosted model; offer it as a client tool with `input_schema` instead"
                )))
            }
        }
        if t.get("defer_loading").and_then(Value::as_bool) == Some(true) {
            continue;
        }
        let name = t
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("every tool needs a string `name`"))?;
        let schema = t
            .get("input_schema")
            .filter(|s| s.is_object())
            .ok_or_else(|| bad(format!("tool `{name}` needs an object `input_schema`")))?;
        let mut f = Map::new();
        f.insert("name".into(), json!(name));
        if let Some(d) = t.get("description").filter(|d| d.is_string()) {
            f.insert("description".into(), d.clone());
        }
        f.insert("parameters".into(), schema.clone());
        out.push(json!({"type": "function", "function": f}));
    }
    if out.is_empty() {
        return Ok(());
    }
    chat.insert("tools".into(), Value::Array(out));
    if let Some(choice) = req.get("tool_choice").filter(|c| !c.is_null()) {
        tool_choice(choice, chat)?;
    }
    Ok(())
}

fn tool_choice(c: &Value, chat: &mut Map<String, Value>) -> Result<(), ApiError> {
    let mapped = match c.get("type").and_then(Value::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => {
            let name = c
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("`tool_choice` of type `tool` needs `name`"))?;
            json!({"type": "function", "function": {"name": name}})
        }
        _ => {
            return Err(bad(format!(
                "`tool_choice` type must be auto, any, tool or none; got {c}"
            )))
        }
    };
    chat.insert("tool_choice".into(), mapped);
    if c.get("disable_parallel_tool_use").and_then(Value::as_bool) == Some(true) {
        chat.insert("parallel_tool_calls".into(), Value::Bool(false));
    }
    Ok(())
}

// ------------------------------------------------------------------ count_tokens

/// The engine's `POST /tokenize` body for a `count_tokens` request: the same
/// translated conversation, rendered with the generation prompt, as vLLM's
/// `TokenizeChatRequest` takes it (`vllm/entrypoints/openai/protocol.py`:
/// `model`, `messages`, `tools`, `add_generation_prompt`, `chat_template_kwargs`).
pub fn tokenize_request(body: Value) -> Result<Map<String, Value>, ApiError> {
    let req = object(body)?;
    let chat = to_chat(&req, false)?;
    let mut out = Map::new();
    for key in ["model", "messages", "tools", "chat_template_kwargs"] {
        if let Some(v) = chat.get(key) {
            out.insert(key.into(), v.clone());
        }
    }
    out.insert("add_generation_prompt".into(), Value::Bool(true));
    Ok(out)
}

/// vLLM's `TokenizeResponse` (`count`, `max_model_len`, `tokens`) →
/// `MessageTokensCount` (`types/message_tokens_count.py`: `input_tokens`).
pub fn count_tokens_answer(engine: &[u8]) -> Result<Value, String> {
    let v: Value = serde_json::from_slice(engine)
        .map_err(|e| format!("the engine's /tokenize answer is not JSON: {e}"))?;
    let n = v
        .get("count")
        .and_then(Value::as_u64)
        .or_else(|| {
            v.get("tokens")
                .and_then(Value::as_array)
                .map(|t| t.len() as u64)
        })
        .ok_or("the engine's /tokenize answer has no `count`")?;
    Ok(json!({ "input_tokens": n }))
}

// ------------------------------------------------------------------ answer

/// The `msg_…` id of a call (derived from the gateway's call id).
pub fn message_id(ctx: &Ctx) -> String {
    let tail: String = ctx
        .call_id
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .collect();
    format!("msg_{tail}")
}

/// The signature of a thinking block this gateway hands out. Anthropic's is
/// an opaque proof that Claude wrote the block; ours only has to come back
/// unchanged, so it names the call.
fn signature(ctx: &Ctx) -> String {
    format!("lightning:{}", ctx.call_id)
}

/// The engine's tool call id, or one made from the message id when it sent none.
fn tool_use_id(id: Option<&str>, message_id: &str, i: usize) -> String {
    match id {
        Some(s) if !s.is_empty() => s.to_string(),
        _ => format!("toolu_{}_{i}", message_id.trim_start_matches("msg_")),
    }
}

/// vLLM's `finish_reason` (+ its `stop_reason`, the matched stop string) →
/// Anthropic's `stop_reason` and `stop_sequence`.
pub fn stop_reason(finish: Option<&str>, stop: Option<&Value>, tool_calls: bool) -> (Value, Value) {
    match finish {
        Some("length") => (json!("max_tokens"), Value::Null),
        Some("content_filter") => (json!("refusal"), Value::Null),
        _ if tool_calls => (json!("tool_use"), Value::Null),
        Some("tool_calls") => (json!("tool_use"), Value::Null),
        _ => match stop.and_then(Value::as_str) {
            Some(s) => (json!("stop_sequence"), json!(s)),
            None => (json!("end_turn"), Value::Null),
        },
    }
}

fn reasoning_of(m: &Value) -> Option<&str> {
    m.get("reasoning")
        .or_else(|| m.get("reasoning_content"))
        .and_then(Value::as_str)
}

fn usage(input: u64, output: u64) -> Value {
    json!({
        "input_tokens": input,
        "output_tokens": output,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    })
}

fn u64_at(v: &Value, path: &str) -> Option<u64> {
    v.pointer(path).and_then(Value::as_u64)
}

/// A whole chat completion → a `Message`; `None` when it has no choice.
pub fn message_from_chat(v: &Value, ctx: &Ctx) -> Option<Value> {
    let choice = v.get("choices")?.as_array()?.first()?;
    let msg = choice.get("message").cloned().unwrap_or(Value::Null);
    let mut content = Vec::new();
    if let Some(r) = reasoning_of(&msg).filter(|r| !r.is_empty()) {
        content.push(json!({"type": "thinking", "thinking": r, "signature": signature(ctx)}));
    }
    if let Some(t) = msg
        .get("content")
        .and_then(Value::as_str)
        .filter(|t| !t.is_empty())
    {
        content.push(json!({"type": "text", "text": t}));
    }
    let calls = msg.get("tool_calls").and_then(Value::as_array);
    for (i, c) in calls.into_iter().flatten().enumerate() {
        let args = c
            .pointer("/function/arguments")
            .and_then(Value::as_str)
            .unwrap_or("");
        let input = match serde_json::from_str::<Value>(args) {
            Ok(o @ Value::Object(_)) => o,
            _ => json!({}),
        };
        content.push(json!({
            "type": "tool_use",
            "id": tool_use_id(c.get("id").and_then(Value::as_str), &message_id(ctx), i),
            "name": c.pointer("/function/name").and_then(Value::as_str).unwrap_or(""),
            "input": input,
        }));
    }
    let has_calls = calls.is_some_and(|c| !c.is_empty());
    let (reason, seq) = stop_reason(
        choice.get("finish_reason").and_then(Value::as_str),
        choice.get("stop_reason"),
        has_calls,
    );
    let input = u64_at(v, "/usage/prompt_tokens")
        .or_else(|| {
            v.get("prompt_token_ids")?
                .as_array()
                .map(|a| a.len() as u64)
        })
        .unwrap_or(0);
    let output = u64_at(v, "/usage/completion_tokens")
        .or_else(|| choice.get("token_ids")?.as_array().map(|a| a.len() as u64))
        .unwrap_or(0);
    Some(json!({
        "id": message_id(ctx),
        "type": "message",
        "role": "assistant",
        "model": v.get("model").cloned().unwrap_or(Value::Null),
        "content": content,
        "stop_reason": reason,
        "stop_sequence": seq,
        "usage": usage(input, output),
    }))
}

// ------------------------------------------------------------------ stream

/// The block open in the stream.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Open {
    Thinking,
    Text,
    /// A tool call, by the engine's `tool_calls[].index`.
    Tool(u64),
}

/// Engine chat chunks → Messages events (see the module doc for the order).
#[derive(Debug)]
pub struct Translator {
    id: String,
    signature: String,
    started: bool,
    open: Option<Open>,
    /// Index of the next content block.
    next: usize,
    tool_calls: usize,
    finish: Option<String>,
    stop: Option<Value>,
    input_tokens: u64,
    output_tokens: Option<u64>,
    streamed_ids: u64,
    failed: bool,
    /// The open block's delta frames up to the delta's one string (see `ensure`).
    delta_head: Vec<u8>,
    /// Each tool call's `tool_use` id and the argument text streamed for it,
    /// recorded in `tool_args` when the stream ends well.
    generated: Vec<(String, String)>,
    tool_args: Option<std::sync::Arc<ToolArgs>>,
    /// An application key's call (`Ctx::client_fields_only`): keeps no rows.
    online: bool,
}

impl Translator {
    pub fn new(ctx: &Ctx) -> Self {
        Translator {
            id: message_id(ctx),
            signature: signature(ctx),
            started: false,
            open: None,
            next: 0,
            tool_calls: 0,
            finish: None,
            stop: None,
            input_tokens: 0,
            output_tokens: None,
            streamed_ids: 0,
            failed: false,
            delta_head: Vec::new(),
            generated: Vec::new(),
            tool_args: ctx.tool_args.clone(),
            online: ctx.client_fields_only,
        }
    }

    fn event(out: &mut Vec<u8>, v: &Value) {
        let name = v.get("type").and_then(Value::as_str).unwrap_or("error");
        sse_frame(out, Some(name), v.to_string().as_bytes());
    }

    /// The first chunk (`None` when the stream ends before any) opens the message.
    fn start(&mut self, chunk: Option<&Chunk<'_>>, out: &mut Vec<u8>) {
        if self.started {
            return;
        }
        self.started = true;
        if let Some(p) = chunk.and_then(|c| c.prompt_token_ids.as_ref()) {
            self.input_tokens = p.len() as u64;
        }
        // Kept as its bytes by the read: parsed here, once a stream.
        let model = chunk
            .and_then(|c| c.model)
            .and_then(|m| serde_json::from_str::<Value>(m.get()).ok());
        let message = json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": model.unwrap_or(Value::Null),
            "content": [],
            "stop_reason": null,
            "stop_sequence": null,
            "usage": usage(self.input_tokens, 0),
        });
        Self::event(out, &json!({"type": "message_start", "message": message}));
        Self::event(out, &json!({"type": "ping"}));
    }

    fn close(&mut self, out: &mut Vec<u8>) {
        let Some(open) = self.open.take() else { return };
        let index = self.next - 1;
        if open == Open::Thinking {
            let delta = json!({"type": "signature_delta", "signature": self.signature});
            Self::event(
                out,
                &json!({"type": "content_block_delta", "index": index, "delta": delta}),
            );
        }
        Self::event(out, &json!({"type": "content_block_stop", "index": index}));
    }

    /// Opens `kind` unless it is the open block.
    fn ensure(&mut self, kind: Open, block: impl FnOnce() -> Value, out: &mut Vec<u8>) {
        if self.open != Some(kind) {
            self.close(out);
            let index = self.next;
            self.next += 1;
            self.open = Some(kind);
            let start =
                json!({"type": "content_block_start", "index": index, "content_block": block()});
            Self::event(out, &start);
            // Every delta of the block is the same bytes but for its one
            // string: written once here, not serialized per token.
            let (delta_type, field) = match kind {
                Open::Thinking => ("thinking_delta", "thinking"),
                Open::Text => ("text_delta", "text"),
                Open::Tool(_) => ("input_json_delta", "partial_json"),
            };
            self.delta_head = format!(
                "event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":{index},\"delta\":{{\"type\":\"{delta_type}\",\"{field}\":"
            )
            .into_bytes();
        }
    }

    /// A per-token delta of the open block: the block's prepared bytes
    /// around the delta's string, no `Value` built.
    fn delta(&self, out: &mut Vec<u8>, s: &str) {
        out.reserve(self.delta_head.len() + s.len() + 8);
        out.extend_from_slice(&self.delta_head);
        push_json(out, s);
        out.extend_from_slice(b"}}\n\n");
    }

    fn on_choice(&mut self, choice: &Choice<'_>, out: &mut Vec<u8>) {
        if let Some(ids) = &choice.token_ids {
            self.streamed_ids += ids.len() as u64;
        }
        if let Some(delta) = &choice.delta {
            self.on_delta(delta, out);
        }
        if let Some(f) = &choice.finish_reason {
            self.finish = Some(f.clone());
            // Only ever read as a string (the matched stop sequence).
            self.stop = choice
                .stop_reason
                .as_str()
                .map(|s| Value::String(s.to_string()));
            self.close(out);
        }
    }

    fn on_delta(&mut self, delta: &Delta<'_>, out: &mut Vec<u8>) {
        // `reasoning` wins whenever it is there, even when it is not a string.
        let reasoning = if delta.reasoning.is_present() {
            &delta.reasoning
        } else {
            &delta.reasoning_content
        };
        if let Some(r) = reasoning.as_str().filter(|r| !r.is_empty()) {
            self.ensure(
                Open::Thinking,
                || json!({"type": "thinking", "thinking": "", "signature": ""}),
                out,
            );
            self.delta(out, r);
        }
        if let Some(t) = delta.content.as_deref().filter(|t| !t.is_empty()) {
            self.ensure(Open::Text, || json!({"type": "text", "text": ""}), out);
            self.delta(out, t);
        }
        for c in &delta.tool_calls.0 {
            self.on_tool_delta(&c.0, out);
        }
    }

    fn on_tool_delta(&mut self, c: &ToolCallDelta<'_>, out: &mut Vec<u8>) {
        let index = c.index.as_u64().unwrap_or(self.tool_calls as u64);
        if self.open != Some(Open::Tool(index)) {
            let id = tool_use_id(c.id.as_str(), &self.id, self.tool_calls);
            self.tool_calls += 1;
            let name = c.function.0.name.as_str().unwrap_or("").to_string();
            self.generated.push((id.clone(), String::new()));
            self.ensure(
                Open::Tool(index),
                || json!({"type": "tool_use", "id": id, "name": name, "input": {}}),
                out,
            );
        }
        let args = c.function.0.arguments.as_str().unwrap_or("");
        if !args.is_empty() {
            if let Some((_, text)) = self.generated.last_mut() {
                text.push_str(args);
            }
            // The call's block is the open one (opened just above if it was not).
            self.delta(out, args);
        }
    }

    fn on_chunk(&mut self, chunk: &Chunk<'_>, out: &mut Vec<u8>) {
        if let Some(err) = &chunk.error {
            let msg = err
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("engine error");
            let status = err.get("code").and_then(Value::as_u64).unwrap_or(500) as u16;
            Self::event(
                out,
                &error_json(status, &format!("the engine failed mid-stream: {msg}")),
            );
            self.failed = true;
            return;
        }
        self.start(Some(chunk), out);
        if let Some(u) = &chunk.usage {
            if let Some(n) = u64_at(u, "/prompt_tokens") {
                self.input_tokens = n;
            }
            if let Some(n) = u64_at(u, "/completion_tokens") {
                self.output_tokens = Some(n);
            }
        }
        if let Some(choice) = chunk.choices.first() {
            self.on_choice(choice, out);
        }
    }
}

impl StreamTranslator for Translator {
    fn on_event(&mut self, _: &Event, chunk: Option<&Chunk<'_>>, out: &mut Vec<u8>) {
        if self.failed {
            return;
        }
        if let Some(c) = chunk {
            self.on_chunk(c, out);
        }
    }

    fn finish(&mut self) -> (Vec<u8>, Option<Kept>) {
        let mut out = Vec::new();
        if self.failed {
            return (out, None);
        }
        self.start(None, &mut out);
        self.close(&mut out);
        let (reason, seq) = stop_reason(
            self.finish.as_deref(),
            self.stop.as_ref(),
            self.tool_calls > 0,
        );
        let mut u = usage(
            self.input_tokens,
            self.output_tokens.unwrap_or(self.streamed_ids),
        );
        if let Some(m) = u.as_object_mut() {
            m.retain(|k, _| k == "input_tokens" || k == "output_tokens");
        }
        let delta = json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq}, "usage": u});
        Self::event(&mut out, &delta);
        Self::event(&mut out, &json!({"type": "message_stop"}));
        let Some(args) = &self.tool_args else {
            return (out, None);
        };
        for (id, text) in &self.generated {
            args.put(id, text);
        }
        (out, kept_arguments(&self.generated, self.online))
    }

    fn fail(&mut self, e: &ApiError) -> Vec<u8> {
        let mut out = Vec::new();
        if !self.failed {
            self.failed = true;
            Self::event(&mut out, &error_json(e.status, &e.message));
        }
        out
    }
}

#[cfg(test)]
#[path = "anthropic_messages_tests.rs"]
mod tests;
