//! The OpenAI Responses API (`POST /v1/responses`) on a chat-completions engine.
//!
//! Field names and the event vocabulary follow OpenAI's API reference
//! (<https://platform.openai.com/docs/api-reference/responses>) as the
//! `openai` Python SDK parses it (`openai/types/responses/`: `response.py`,
//! `response_create_params.py`, `response_output_message.py`,
//! `response_function_tool_call.py`, `response_custom_tool_call.py`,
//! `response_reasoning_item.py`, `response_usage.py`, `response_error.py` and
//! the `response_*_event.py` stream events), checked against SDK 3.60, and
//! against what Codex CLI 0.171 really sends (recorded in the `codex`
//! helper's notes: `developer` messages as the system prompt, `custom`
//! freeform tools, `namespace` tools, `reasoning`, `include`,
//! `prompt_cache_key`, `client_metadata`, `store: false`, full history).
//!
//! Request → chat completions:
//! - `instructions` → a leading `system` message (not carried over by
//!   `previous_response_id`, as OpenAI documents);
//! - `input` (a string, or items): `message` (roles `developer` → `system`,
//!   `system`, `user`, `assistant`; parts `input_text`/`output_text`/`refusal`
//!   become text), `function_call` and `custom_tool_call` → assistant
//!   `tool_calls` (merged into the assistant message they follow, so the
//!   engine's own turn comes back whole and the rollout merges into one
//!   sample), `function_call_output`/`custom_tool_call_output` → `tool`
//!   messages, `reasoning` → `reasoning_content` of the next assistant message;
//! - `previous_response_id` → the stored conversation of that response
//!   (table `kept`, so it survives a restart) before the new input;
//! - `tools`: `function` → chat function; `custom` (freeform) → a function
//!   with one string parameter `input` (its grammar, if any, goes into the
//!   description; the engine is not grammar-constrained); `namespace` → its
//!   functions, named `namespace.name` for the engine and split back on output;
//!   `tool_choice` (`auto`/`none`/`required`/`{type: function|custom, name}`),
//!   `parallel_tool_calls`, `max_output_tokens` → `max_tokens`,
//!   `temperature`, `top_p`, `top_logprobs`, `text.format` (`json_schema`,
//!   `json_object`) → `response_format`;
//! - kept for the response object only (they have no meaning for a
//!   self-hosted engine): `metadata`, `store` (false: the response is not kept
//!   for `GET`/`previous_response_id`; the call is still recorded for
//!   training), `include` (there is no encrypted reasoning to include),
//!   `reasoning` (effort/summary: the engine's template decides),
//!   `text.verbosity`, `prompt_cache_key`, `prompt_cache_retention`,
//!   `client_metadata`, `user`, `safety_identifier`, `service_tier`,
//!   `truncation`, `stream_options`;
//! - refused with 400: `background: true`, `conversation`, `prompt`
//!   templates, hosted tools (`web_search*`, `file_search`, `code_interpreter`,
//!   `computer*`, `image_generation`, `mcp`, `local_shell`, `shell`,
//!   `apply_patch`, `tool_search`), images and files in the input (the engine
//!   is text-only), `item_reference` items, unknown item types.
//!
//! Answer → response: `reasoning` (when the engine exposes
//! `reasoning_content`/`reasoning`), `message` with one `output_text`,
//! `function_call`/`custom_tool_call` per tool call (`call_id` is the
//! engine's tool call id); `status` `completed`, or `incomplete` with
//! `incomplete_details.reason` (`max_output_tokens` for `length`,
//! `content_filter`); `usage`. Streamed, the same items are announced and
//! filled as the engine's chunks arrive; only `response.completed` (or
//! `.incomplete`) waits for the commit. A custom tool's input is sent in one
//! `custom_tool_call_input.delta` when the call ends (the engine streams it
//! JSON-encoded inside `{"input": …}`, which is not the raw input).

use bytes::Bytes;
use hyper::StatusCode;
use serde_json::{json, Map, Value};

use super::{
    object, push_json, sse_frame, Answer, Ctx, EngineRequest, History, Kept, Protocol,
    StreamTranslator,
};
use crate::error::ApiError;
use crate::wire::engine::{Chunk, Kind, ToolCallDelta};
use crate::wire::sse::Event;

#[derive(Debug, Clone, Copy)]
pub struct OpenAiResponses;

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::bad_request("unsupported_parameter", msg)
}

/// Tools the engine cannot run: OpenAI runs them on its side.
const HOSTED_TOOLS: [&str; 13] = [
    "web_search",
    "web_search_preview",
    "web_search_2025_08_26",
    "web_search_preview_2025_03_11",
    "file_search",
    "code_interpreter",
    "computer",
    "computer_use_preview",
    "image_generation",
    "mcp",
    "local_shell",
    "shell",
    "apply_patch",
];

/// How tool names map between the request and the engine.
#[derive(Debug, Clone, Default, PartialEq)]
struct ToolMap {
    /// Engine function name → (namespace, name, is custom).
    entries: Vec<(String, Option<String>, String, bool)>,
}

impl ToolMap {
    fn entry(&self, engine_name: &str) -> Option<&(String, Option<String>, String, bool)> {
        self.entries.iter().find(|e| e.0 == engine_name)
    }

    fn lookup(&self, engine_name: &str) -> (Option<String>, String, bool) {
        self.entry(engine_name)
            .map(|e| (e.1.clone(), e.2.clone(), e.3))
            .unwrap_or((None, engine_name.to_string(), false))
    }

    fn engine_name(&self, namespace: Option<&str>, name: &str) -> String {
        match namespace {
            Some(ns) => format!("{ns}.{name}"),
            None => name.to_string(),
        }
    }

    /// Asked for every streamed argument delta: no copies of the names.
    fn is_custom(&self, engine_name: &str) -> bool {
        self.entry(engine_name).is_some_and(|e| e.3)
    }
}

fn str_field<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

/// The request's tools as chat tools, and the name map to read calls back.
fn tools(list: &[Value]) -> Result<(Vec<Value>, ToolMap), ApiError> {
    let mut out = Vec::new();
    let mut map = ToolMap::default();
    let push_function = |t: &Value, ns: Option<&str>, out: &mut Vec<Value>, map: &mut ToolMap| {
        let name = str_field(t, "name").ok_or_else(|| bad("a function tool needs a 'name'"))?;
        let engine_name = map.engine_name(ns, name);
        let mut f = json!({"name": engine_name});
        if let Some(d) = t.get("description") {
            f["description"] = d.clone();
        }
        f["parameters"] = t
            .get("parameters")
            .cloned()
            .filter(|p| !p.is_null())
            .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
        if let Some(s) = t.get("strict").filter(|s| !s.is_null()) {
            f["strict"] = s.clone();
        }
        map.entries
            .push((engine_name, ns.map(str::to_string), name.to_string(), false));
        out.push(json!({"type": "function", "function": f}));
        Ok::<(), ApiError>(())
    };
    for t in list {
        match str_field(t, "type").unwrap_or("") {
            "function" => push_function(t, None, &mut out, &mut map)?,
            "namespace" => {
                let ns = str_field(t, "name").ok_or_else(|| bad("a namespace tool needs a 'name'"))?;
                for inner in t.get("tools").and_then(Value::as_array).into_iter().flatten() {
                    if str_field(inner, "type") != Some("function") {
                        return Err(bad(format!(
                            "namespace {ns:?} holds a tool of type {:?}; only function tools can be namespaced here",
                            inner.get("type")
                        )));
                    }
                    push_function(inner, Some(ns), &mut out, &mut map)?;
                }
            }
            "custom" => {
                let name = str_field(t, "name").ok_or_else(|| bad("a custom tool needs a 'name'"))?;
                let mut desc = str_field(t, "description").unwrap_or("").to_string();
                if let Some(fmt) = t.get("format").filter(|f| str_field(f, "type") == Some("grammar")) {
                    desc.push_str(&format!(
                        "\n\nThe input is free text in this {} grammar:\n{}",
                        str_field(fmt, "syntax").unwrap_or(""),
                        str_field(fmt, "definition").unwrap_or("")
                    ));
                }
                map.entries
                    .push((name.to_string(), None, name.to_string(), true));
                out.push(json!({"type": "function", "function": {
                    "name": name,
                    "description": desc,
                    "parameters": {"type": "object", "properties": {"input": {"type": "string", "description": "the raw input"}}, "required": ["input"]},
                }}));
            }
            other if HOSTED_TOOLS.contains(&other) || other == "tool_search" => {
                return Err(bad(format!(
                    "tool type {other:?} is a hosted tool that only OpenAI's servers run; a self-hosted engine cannot. Remove it (Codex CLI: web_search = \"disabled\" in config.toml) or give a function tool instead"
                )))
            }
            other => return Err(bad(format!("unknown tool type {other:?}; use function or custom tools"))),
        }
    }
    Ok((out, map))
}

fn tool_choice(v: &Value, map: &ToolMap) -> Result<Value, ApiError> {
    match v {
        Value::String(s) if ["auto", "none", "required"].contains(&s.as_str()) => Ok(v.clone()),
        Value::Object(o) => match o.get("type").and_then(Value::as_str) {
            Some("function") | Some("custom") => {
                let name = o
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad("tool_choice needs a 'name'"))?;
                let ns = o.get("namespace").and_then(Value::as_str);
                Ok(json!({"type": "function", "function": {"name": map.engine_name(ns, name)}}))
            }
            other => Err(bad(format!(
                "tool_choice of type {other:?} is not supported; use auto, none, required or a function"
            ))),
        },
        _ => Err(bad(format!("tool_choice {v} is not supported"))),
    }
}

/// The text of a message's content (a string, or parts).
fn content_text(content: &Value) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => {
            let mut text = String::new();
            for p in parts {
                match str_field(p, "type").unwrap_or("") {
                    "input_text" | "output_text" | "text" => text.push_str(str_field(p, "text").unwrap_or("")),
                    "refusal" => text.push_str(str_field(p, "refusal").unwrap_or("")),
                    "input_image" | "input_file" | "input_audio" => {
                        return Err(bad(format!(
                            "content part {:?}: the engine behind this gateway takes text only; send the content as text",
                            p.get("type")
                        )))
                    }
                    other => return Err(bad(format!("unknown content part type {other:?}"))),
                }
            }
            Ok(text)
        }
        other => Err(bad(format!(
            "message content must be a string or a list of parts, not {other}"
        ))),
    }
}

/// Appends input items to chat messages.
fn push_items(items: &[Value], map: &ToolMap, msgs: &mut Vec<Value>) -> Result<(), ApiError> {
    let mut reasoning: Option<String> = None;
    // The assistant message function calls attach to, if the last one is an assistant's.
    let last_assistant = |msgs: &mut Vec<Value>| -> usize {
        let open = msgs.last().is_some_and(|m| m["role"] == "assistant");
        if !open {
            msgs.push(json!({"role": "assistant", "content": Value::Null}));
        }
        msgs.len() - 1
    };
    for it in items {
        let kind = str_field(it, "type").unwrap_or(if it.get("role").is_some() {
            "message"
        } else {
            ""
        });
        match kind {
            "message" => {
                let role = match str_field(it, "role").unwrap_or("user") {
                    "developer" | "system" => "system",
                    "user" => "user",
                    "assistant" => "assistant",
                    other => return Err(bad(format!("message role {other:?} is not one of developer, system, user, assistant"))),
                };
                let text = content_text(it.get("content").unwrap_or(&Value::Null))?;
                let mut m = json!({"role": role, "content": text});
                if role == "assistant" {
                    if let Some(r) = reasoning.take() {
                        m["reasoning_content"] = Value::String(r);
                    }
                }
                msgs.push(m);
            }
            "reasoning" => {
                let mut text = String::new();
                for p in it.get("content").and_then(Value::as_array).into_iter().flatten() {
                    text.push_str(str_field(p, "text").unwrap_or(""));
                }
                if text.is_empty() {
                    for p in it.get("summary").and_then(Value::as_array).into_iter().flatten() {
                        text.push_str(str_field(p, "text").unwrap_or(""));
                    }
                }
                reasoning = Some(text);
            }
            "function_call" | "custom_tool_call" => {
                let call_id = str_field(it, "call_id").ok_or_else(|| bad(format!("a {kind} item needs a 'call_id'")))?;
                let name = str_field(it, "name").ok_or_else(|| bad(format!("a {kind} item needs a 'name'")))?;
                let engine_name = map.engine_name(str_field(it, "namespace"), name);
                let arguments = if kind == "function_call" {
                    str_field(it, "arguments").unwrap_or("{}").to_string()
                } else {
                    json!({"input": str_field(it, "input").unwrap_or("")}).to_string()
                };
                let i = last_assistant(msgs);
                if let Some(r) = reasoning.take() {
                    msgs[i]["reasoning_content"] = Value::String(r);
                }
                let call = json!({"id": call_id, "type": "function", "function": {"name": engine_name, "arguments": arguments}});
                match msgs[i].get_mut("tool_calls").and_then(Value::as_array_mut) {
                    Some(calls) => calls.push(call),
                    None => msgs[i]["tool_calls"] = json!([call]),
                }
            }
            "function_call_output" | "custom_tool_call_output" => {
                let call_id = str_field(it, "call_id").ok_or_else(|| bad(format!("a {kind} item needs a 'call_id'")))?;
                let output = content_text(it.get("output").unwrap_or(&Value::Null))?;
                msgs.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
            }
            "item_reference" => {
                return Err(bad("item_reference items are not supported; send the item itself, or use previous_response_id"))
            }
            other => return Err(bad(format!("input item type {other:?} is not supported"))),
        }
    }
    Ok(())
}

/// The Responses `conversation` a request names (an id, or `{"id": ...}`).
pub fn conversation_id(req: &Map<String, Value>) -> Option<&str> {
    match req.get("conversation")? {
        Value::String(s) => Some(s.as_str()),
        Value::Object(o) => o.get("id").and_then(Value::as_str),
        _ => None,
    }
}

/// What the adapter needs from the request again when it answers.
fn echo(req: &Map<String, Value>) -> Map<String, Value> {
    let mut e = Map::new();
    for k in [
        "instructions",
        "max_output_tokens",
        "metadata",
        "model",
        "parallel_tool_calls",
        "previous_response_id",
        "reasoning",
        "store",
        "temperature",
        "text",
        "tool_choice",
        "tools",
        "top_p",
        "truncation",
        "user",
        "prompt_cache_key",
        "top_logprobs",
        "service_tier",
        "safety_identifier",
    ] {
        if let Some(v) = req.get(k) {
            e.insert(k.into(), v.clone());
        }
    }
    e
}

impl OpenAiResponses {
    /// The chat request and the translation state (echo fields, tool names, history).
    fn translate(
        &self,
        req: &Map<String, Value>,
        ctx: &Ctx,
    ) -> Result<(Map<String, Value>, Plan), ApiError> {
        if req.get("background").and_then(Value::as_bool) == Some(true) {
            return Err(bad("background: true is not supported; the gateway answers while it records. Drop 'background'"));
        }
        if req.get("prompt").is_some_and(|v| !v.is_null()) {
            return Err(bad(
                "'prompt' templates are not supported by this gateway; send the input items themselves",
            ));
        }
        let (chat_tools, map) = match req.get("tools") {
            None | Some(Value::Null) => (Vec::new(), ToolMap::default()),
            Some(Value::Array(list)) => tools(list)?,
            Some(_) => return Err(bad("'tools' must be a list")),
        };
        // The conversation before this request: instructions are not carried over.
        let mut history: Vec<Value> = match &ctx.history {
            Some(h) => h
                .get("messages")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default(),
            None => Vec::new(),
        };
        match req.get("input") {
            Some(Value::String(s)) => history.push(json!({"role": "user", "content": s})),
            Some(Value::Array(items)) => push_items(items, &map, &mut history)?,
            None | Some(Value::Null) => {}
            Some(_) => return Err(bad("'input' must be a string or a list of items")),
        }
        let mut messages = Vec::with_capacity(history.len() + 1);
        if let Some(instr) = req.get("instructions").filter(|v| !v.is_null()) {
            let text = match instr {
                Value::String(s) => s.clone(),
                other => content_text(other)?,
            };
            if !text.is_empty() {
                messages.push(json!({"role": "system", "content": text}));
            }
        }
        messages.extend(history.iter().cloned());
        if messages.is_empty() {
            return Err(bad(
                "the request has no input; send 'input' (a string or items)",
            ));
        }
        let mut chat = Map::new();
        chat.insert(
            "model".into(),
            req.get("model").cloned().unwrap_or(Value::Null),
        );
        chat.insert("messages".into(), Value::Array(messages));
        if !chat_tools.is_empty() {
            chat.insert("tools".into(), Value::Array(chat_tools));
            if let Some(tc) = req.get("tool_choice").filter(|v| !v.is_null()) {
                chat.insert("tool_choice".into(), tool_choice(tc, &map)?);
            }
            if let Some(p) = req.get("parallel_tool_calls").filter(|v| !v.is_null()) {
                chat.insert("parallel_tool_calls".into(), p.clone());
            }
        }
        for (from, to) in [
            ("max_output_tokens", "max_tokens"),
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("top_logprobs", "top_logprobs"),
        ] {
            if let Some(v) = req.get(from).filter(|v| !v.is_null()) {
                chat.insert(to.into(), v.clone());
            }
        }
        if let Some(fmt) = req.get("text").and_then(|t| t.get("format")) {
            match str_field(fmt, "type") {
                Some("json_schema") => {
                    let mut js = json!({"name": fmt.get("name").cloned().unwrap_or(json!("response")), "schema": fmt.get("schema").cloned().unwrap_or(json!({}))});
                    if let Some(s) = fmt.get("strict") {
                        js["strict"] = s.clone();
                    }
                    chat.insert(
                        "response_format".into(),
                        json!({"type": "json_schema", "json_schema": js}),
                    );
                }
                Some("json_object") => {
                    chat.insert("response_format".into(), json!({"type": "json_object"}));
                }
                _ => {}
            }
        }
        let stream = req.get("stream").and_then(Value::as_bool).unwrap_or(false);
        if stream {
            chat.insert("stream".into(), Value::Bool(true));
            chat.insert("stream_options".into(), json!({"include_usage": true}));
        }
        let mut echo = echo(req);
        let conversation = conversation_id(req);
        if let Some(c) = conversation {
            echo.insert("conversation".into(), json!({ "id": c }));
        }
        let plan = Plan {
            echo,
            map,
            history,
            // A conversation continues from its last response: it is kept
            // whatever `store` says.
            keep: conversation.is_some()
                || req.get("store").and_then(Value::as_bool).unwrap_or(true),
        };
        Ok((chat, plan))
    }
}

/// What the answer side needs from the request.
#[derive(Debug, Clone, Default)]
struct Plan {
    echo: Map<String, Value>,
    map: ToolMap,
    /// The conversation (chat messages, no instructions) up to this answer.
    history: Vec<Value>,
    keep: bool,
}

/// The plan travels to the answer side in `Ctx::state`.
fn plan_to_value(p: &Plan) -> Value {
    json!({
        "echo": p.echo,
        "map": p.map.entries.iter().map(|e| json!([e.0, e.1, e.2, e.3])).collect::<Vec<_>>(),
        "history": p.history,
        "keep": p.keep,
    })
}

fn plan_from_ctx(ctx: &Ctx) -> Plan {
    let p = &ctx.state;
    if !p.is_object() {
        return Plan::default();
    }
    let entries = p
        .get("map")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|e| {
            Some((
                e.get(0)?.as_str()?.to_string(),
                e.get(1).and_then(Value::as_str).map(str::to_string),
                e.get(2)?.as_str()?.to_string(),
                e.get(3)?.as_bool()?,
            ))
        })
        .collect();
    Plan {
        echo: p
            .get("echo")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default(),
        map: ToolMap { entries },
        history: p
            .get("history")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default(),
        keep: p.get("keep").and_then(Value::as_bool).unwrap_or(true),
    }
}

/// One tool call as the engine produced it.
#[derive(Debug, Clone, Default, PartialEq)]
struct ToolCall {
    id: String,
    name: String,
    arguments: String,
}

/// The engine's answer, accumulated (whole, or chunk by chunk).
#[derive(Debug, Clone, Default, PartialEq)]
struct Generated {
    reasoning: Option<String>,
    text: Option<String>,
    calls: Vec<ToolCall>,
    finish_reason: Option<String>,
    usage: Option<Value>,
}

fn short(call_id: &str) -> &str {
    call_id.strip_prefix("call-").unwrap_or(call_id)
}

/// Builds the response object; shared by the whole and the streamed answer,
/// so both give the same response for the same generation.
struct Builder<'a> {
    ctx: &'a Ctx,
    plan: &'a Plan,
}

impl Builder<'_> {
    fn response_id(&self) -> String {
        format!("resp_{}", short(&self.ctx.call_id))
    }

    fn item_id(&self, prefix: &str, index: usize) -> String {
        format!("{prefix}_{}_{index}", short(&self.ctx.call_id))
    }

    /// The output items of a generation, in order: reasoning, message, calls.
    fn items(&self, g: &Generated, status: &str) -> Vec<Value> {
        let mut out = Vec::new();
        if let Some(r) = &g.reasoning {
            out.push(self.reasoning_item(out.len(), r, status));
        }
        if let Some(t) = &g.text {
            out.push(self.message_item(out.len(), t, status));
        }
        for c in &g.calls {
            out.push(self.call_item(out.len(), c, status));
        }
        out
    }

    fn reasoning_item(&self, index: usize, text: &str, status: &str) -> Value {
        json!({"type": "reasoning", "id": self.item_id("rs", index), "summary": [],
               "content": [{"type": "reasoning_text", "text": text}], "status": status})
    }

    fn message_item(&self, index: usize, text: &str, status: &str) -> Value {
        let content = if status == "in_progress" {
            json!([])
        } else {
            json!([output_text(text)])
        };
        json!({"type": "message", "id": self.item_id("msg", index), "role": "assistant", "status": status, "content": content})
    }

    fn call_item(&self, index: usize, c: &ToolCall, status: &str) -> Value {
        let (ns, name, custom) = self.plan.map.lookup(&c.name);
        let mut item = if custom {
            let input = serde_json::from_str::<Value>(&c.arguments)
                .ok()
                .and_then(|v| v.get("input").and_then(Value::as_str).map(str::to_string))
                .unwrap_or_else(|| c.arguments.clone());
            json!({"type": "custom_tool_call", "id": self.item_id("ctc", index), "call_id": c.id, "name": name,
                   "input": if status == "in_progress" { String::new() } else { input }, "status": status})
        } else {
            json!({"type": "function_call", "id": self.item_id("fc", index), "call_id": c.id, "name": name,
                   "arguments": if status == "in_progress" { "" } else { c.arguments.as_str() }, "status": status})
        };
        if let Some(ns) = ns {
            item["namespace"] = Value::String(ns);
        }
        item
    }

    fn status(&self, g: &Generated) -> (&'static str, Value) {
        match g.finish_reason.as_deref() {
            Some("length") => ("incomplete", json!({"reason": "max_output_tokens"})),
            Some("content_filter") => ("incomplete", json!({"reason": "content_filter"})),
            _ => ("completed", Value::Null),
        }
    }

    fn usage(&self, g: &Generated) -> Value {
        let Some(u) = &g.usage else {
            return Value::Null;
        };
        let n = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0);
        let cached = u
            .get("prompt_tokens_details")
            .and_then(|d| d.get("cached_tokens"))
            .and_then(Value::as_u64)
            .unwrap_or(0);
        json!({
            "input_tokens": n("prompt_tokens"),
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": n("completion_tokens"),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": n("total_tokens").max(n("prompt_tokens") + n("completion_tokens")),
        })
    }

    /// The response object with these output items and this status.
    fn response(&self, status: &str, output: Vec<Value>, g: Option<&Generated>) -> Value {
        let e = &self.plan.echo;
        let get = |k: &str, d: Value| e.get(k).cloned().unwrap_or(d);
        let mut r = json!({
            "id": self.response_id(),
            "object": "response",
            "created_at": self.ctx.created,
            "status": status,
            "background": false,
            "error": Value::Null,
            "incomplete_details": Value::Null,
            "instructions": get("instructions", Value::Null),
            "max_output_tokens": get("max_output_tokens", Value::Null),
            "metadata": get("metadata", json!({})),
            "model": get("model", json!("")),
            "output": output,
            "parallel_tool_calls": get("parallel_tool_calls", json!(true)),
            "previous_response_id": get("previous_response_id", Value::Null),
            "reasoning": get("reasoning", json!({"effort": null, "summary": null})),
            "store": get("store", json!(true)),
            "temperature": get("temperature", Value::Null),
            "text": get("text", json!({"format": {"type": "text"}})),
            "tool_choice": get("tool_choice", json!("auto")),
            "tools": get("tools", json!([])),
            "top_p": get("top_p", Value::Null),
            "truncation": get("truncation", json!("disabled")),
            "usage": Value::Null,
        });
        for k in [
            "conversation",
            "user",
            "prompt_cache_key",
            "top_logprobs",
            "service_tier",
            "safety_identifier",
        ] {
            if let Some(v) = e.get(k) {
                r[k] = v.clone();
            }
        }
        if let Some(g) = g {
            let (_, details) = self.status(g);
            r["incomplete_details"] = details;
            r["usage"] = self.usage(g);
            if status != "in_progress" {
                r["completed_at"] = json!(self.ctx.created);
            }
        }
        r
    }

    /// The final response, and what to keep for `GET` and `previous_response_id`.
    /// `items`: the output items (a stream passes the ones it sent; for vLLM's
    /// order, reasoning → content → tool calls, they equal `self.items`).
    fn finish(&self, g: &Generated, items: Option<Vec<Value>>) -> (Value, Option<Kept>) {
        let (status, _) = self.status(g);
        let items = items.unwrap_or_else(|| self.items(g, "completed"));
        let resp = self.response(status, items, Some(g));
        let kept = self.plan.keep.then(|| {
            let mut history = self.plan.history.clone();
            history.push(assistant_message(g));
            Kept {
                id: self.response_id(),
                object: resp.clone(),
                state: json!({"messages": history}),
            }
        });
        (resp, kept)
    }
}

fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

/// The engine's turn as a chat message, exactly as generated (content, the
/// calls' argument strings, reasoning), so the next turn's prompt renders the
/// same tokens the engine produced.
fn assistant_message(g: &Generated) -> Value {
    let mut m = json!({"role": "assistant", "content": g.text.clone().map(Value::String).unwrap_or(Value::Null)});
    if let Some(r) = &g.reasoning {
        m["reasoning_content"] = Value::String(r.clone());
    }
    if !g.calls.is_empty() {
        m["tool_calls"] = g
            .calls
            .iter()
            .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
            .collect();
    }
    m
}

/// Reasoning text in a message or delta: vLLM's `reasoning_content` (older)
/// or `reasoning` (newer).
fn reasoning_of(m: &Value) -> Option<&str> {
    m.get("reasoning_content")
        .and_then(Value::as_str)
        .or_else(|| m.get("reasoning").and_then(Value::as_str))
}

/// The first choice of a whole chat answer as a generation.
fn generated(engine: &Value) -> Option<Generated> {
    let ch = engine.get("choices")?.get(0)?;
    let m = ch.get("message")?;
    let calls = m
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|c| ToolCall {
            id: str_field(c, "id").unwrap_or("").to_string(),
            name: c
                .get("function")
                .and_then(|f| str_field(f, "name"))
                .unwrap_or("")
                .to_string(),
            arguments: c
                .get("function")
                .and_then(|f| str_field(f, "arguments"))
                .unwrap_or("")
                .to_string(),
        })
        .collect();
    Some(Generated {
        reasoning: reasoning_of(m)
            .filter(|s| !s.is_empty())
            .map(str::to_string),
        text: m
            .get("content")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_string),
        calls,
        finish_reason: str_field(ch, "finish_reason").map(str::to_string),
        usage: engine.get("usage").cloned().filter(|u| !u.is_null()),
    })
}

/// `{"error": {"message", "type", "param", "code"}}`, the Responses API's error shape.
fn error_json(e: &ApiError) -> Value {
    json!({"error": {"message": e.message, "type": e.kind, "param": Value::Null, "code": e.code}})
}

impl Protocol for OpenAiResponses {
    fn name(&self) -> &'static str {
        "openai_responses"
    }

    fn check(
        &self,
        req: &Map<String, Value>,
        caps: &super::validate::Caps,
    ) -> Result<(), ApiError> {
        super::validate::responses(req, caps)?;
        if conversation_id(req).is_some()
            && req
                .get("previous_response_id")
                .is_some_and(|v| !v.is_null())
        {
            return Err(bad("send either 'conversation' or 'previous_response_id', not both (a conversation already continues from its last response)"));
        }
        Ok(())
    }

    fn history_key(&self, body: &Value) -> Option<History> {
        if let Some(id) = body.get("previous_response_id").and_then(Value::as_str) {
            return Some(History::Response(id.to_string()));
        }
        body.as_object()
            .and_then(conversation_id)
            .map(|c| History::Conversation(c.trim().to_string()))
    }

    fn engine_request(&self, body: Value, ctx: &mut Ctx) -> Result<EngineRequest, ApiError> {
        let req = object(body)?;
        let (mut chat, plan) = self.translate(&req, ctx)?;
        super::openai::capture_fields(&mut chat, Kind::Chat, ctx);
        let stream = chat.get("stream").and_then(Value::as_bool).unwrap_or(false);
        ctx.state = plan_to_value(&plan);
        Ok(EngineRequest {
            kind: Kind::Chat,
            body: chat,
            stream,
        })
    }

    fn answer(&self, status: StatusCode, engine: &Bytes, ctx: &Ctx) -> (Answer, Option<Kept>) {
        let plan = plan_from_ctx(ctx);
        let b = Builder { ctx, plan: &plan };
        let parsed: Option<Value> = serde_json::from_slice(engine).ok();
        if !status.is_success() {
            let msg = parsed
                .as_ref()
                .and_then(|v| v.get("error"))
                .and_then(|e| e.get("message").and_then(Value::as_str).or(e.as_str()))
                .unwrap_or("the engine refused the request")
                .to_string();
            let kind = if status.is_client_error() {
                "invalid_request_error"
            } else {
                "server_error"
            };
            let e = ApiError::new(status.as_u16(), kind, "engine_error", msg);
            return (
                Answer::Json {
                    status,
                    body: Bytes::from(error_json(&e).to_string()),
                },
                None,
            );
        }
        let Some(g) = parsed.as_ref().and_then(generated) else {
            let e = ApiError::new(
                502,
                "server_error",
                "upstream_bad_answer",
                "the engine's answer is not a chat completion",
            );
            return (
                Answer::Json {
                    status: StatusCode::BAD_GATEWAY,
                    body: Bytes::from(error_json(&e).to_string()),
                },
                None,
            );
        };
        let (resp, kept) = b.finish(&g, None);
        (
            Answer::Json {
                status: StatusCode::OK,
                body: Bytes::from(resp.to_string()),
            },
            kept,
        )
    }

    fn translator(&self, ctx: &Ctx) -> Box<dyn StreamTranslator> {
        Box::new(Translator::new(ctx.clone()))
    }

    fn error_body(&self, e: &ApiError) -> Bytes {
        Bytes::from(error_json(e).to_string())
    }
}

/// The item being streamed.
#[derive(Debug, Clone, PartialEq)]
enum Open {
    None,
    Reasoning,
    Text,
    /// Tool call at this position of `Generated::calls`.
    Call(usize),
}

/// What a per-token delta adds to.
#[derive(Debug, Clone, Copy, PartialEq)]
enum DeltaOf {
    Reasoning,
    Text,
    Arguments,
}

impl DeltaOf {
    fn kind(self) -> &'static str {
        match self {
            DeltaOf::Reasoning => "response.reasoning_text.delta",
            DeltaOf::Text => "response.output_text.delta",
            DeltaOf::Arguments => "response.function_call_arguments.delta",
        }
    }
}

/// Streams a chat completion as Responses events.
struct Translator {
    ctx: Ctx,
    plan: Plan,
    g: Generated,
    seq: u64,
    started: bool,
    open: Open,
    /// Output index of the open item; items done so far.
    index: usize,
    /// The open item's delta frames up to the delta text, and from after it
    /// to the sequence number (see `open_deltas`).
    delta_head: Vec<u8>,
    delta_tail: Vec<u8>,
    done_items: Vec<Value>,
    /// Engine tool-call index → position in `g.calls`.
    call_slots: Vec<(u64, usize)>,
    failed: bool,
}

impl Translator {
    fn new(ctx: Ctx) -> Self {
        let plan = plan_from_ctx(&ctx);
        Translator {
            ctx,
            plan,
            g: Generated::default(),
            seq: 0,
            started: false,
            open: Open::None,
            index: 0,
            delta_head: Vec::new(),
            delta_tail: Vec::new(),
            done_items: Vec::new(),
            call_slots: Vec::new(),
            failed: false,
        }
    }

    fn builder(&self) -> Builder<'_> {
        Builder {
            ctx: &self.ctx,
            plan: &self.plan,
        }
    }

    fn emit(&mut self, out: &mut Vec<u8>, kind: &str, mut ev: Value) {
        ev["type"] = json!(kind);
        ev["sequence_number"] = json!(self.seq);
        self.seq += 1;
        sse_frame(out, Some(kind), ev.to_string().as_bytes());
    }

    /// Prepares the open item's per-token frames: all their bytes but the
    /// delta text and the sequence number are the same for every token, so
    /// they are written once here (the keys in the order `emit` gives every
    /// event: its own, then `type` and `sequence_number`).
    fn open_deltas(&mut self, of: DeltaOf, item_id: &str) {
        let kind = of.kind();
        let mut head = format!("event: {kind}\ndata: {{\"item_id\":").into_bytes();
        push_json(&mut head, item_id);
        head.extend_from_slice(format!(",\"output_index\":{}", self.index).as_bytes());
        if of != DeltaOf::Arguments {
            head.extend_from_slice(b",\"content_index\":0");
        }
        head.extend_from_slice(b",\"delta\":");
        // Output text carries `logprobs: []`: the engine's are recorded, not sent.
        let logprobs = if of == DeltaOf::Text {
            ",\"logprobs\":[]"
        } else {
            ""
        };
        self.delta_head = head;
        self.delta_tail =
            format!("{logprobs},\"type\":\"{kind}\",\"sequence_number\":").into_bytes();
    }

    /// A per-token delta of the open item: its prepared bytes around the
    /// delta text and the sequence number, no `Value` built.
    fn emit_delta(&mut self, out: &mut Vec<u8>, delta: &str) {
        out.reserve(self.delta_head.len() + self.delta_tail.len() + delta.len() + 32);
        out.extend_from_slice(&self.delta_head);
        push_json(out, delta);
        out.extend_from_slice(&self.delta_tail);
        push_json(out, &self.seq);
        out.extend_from_slice(b"}\n\n");
        self.seq += 1;
    }

    fn start(&mut self, out: &mut Vec<u8>) {
        if self.started {
            return;
        }
        self.started = true;
        let r = self.builder().response("in_progress", Vec::new(), None);
        self.emit(out, "response.created", json!({"response": r}));
        self.emit(out, "response.in_progress", json!({"response": r}));
    }

    fn close(&mut self, out: &mut Vec<u8>) {
        let i = self.index;
        match std::mem::replace(&mut self.open, Open::None) {
            Open::None => return,
            Open::Reasoning => {
                let text = self.g.reasoning.clone().unwrap_or_default();
                let id = self.builder().item_id("rs", i);
                self.emit(
                    out,
                    "response.reasoning_text.done",
                    json!({"item_id": id, "output_index": i, "content_index": 0, "text": text}),
                );
                self.emit(out, "response.content_part.done", json!({"item_id": id, "output_index": i, "content_index": 0, "part": {"type": "reasoning_text", "text": text}}));
                let item = self.builder().reasoning_item(i, &text, "completed");
                self.item_done(out, item);
            }
            Open::Text => {
                let text = self.g.text.clone().unwrap_or_default();
                let id = self.builder().item_id("msg", i);
                self.emit(out, "response.output_text.done", json!({"item_id": id, "output_index": i, "content_index": 0, "text": text, "logprobs": []}));
                self.emit(out, "response.content_part.done", json!({"item_id": id, "output_index": i, "content_index": 0, "part": output_text(&text)}));
                let item = self.builder().message_item(i, &text, "completed");
                self.item_done(out, item);
            }
            Open::Call(slot) => {
                let c = self.g.calls[slot].clone();
                let item = self.builder().call_item(i, &c, "completed");
                let id = item["id"].clone();
                if item["type"] == "custom_tool_call" {
                    let input = item["input"].clone();
                    self.emit(
                        out,
                        "response.custom_tool_call_input.delta",
                        json!({"item_id": id, "output_index": i, "delta": input}),
                    );
                    self.emit(
                        out,
                        "response.custom_tool_call_input.done",
                        json!({"item_id": id, "output_index": i, "input": input}),
                    );
                } else {
                    self.emit(
                        out,
                        "response.function_call_arguments.done",
                        json!({"item_id": id, "output_index": i, "arguments": c.arguments}),
                    );
                }
                self.item_done(out, item);
            }
        }
        self.index += 1;
    }

    fn item_done(&mut self, out: &mut Vec<u8>, item: Value) {
        self.emit(
            out,
            "response.output_item.done",
            json!({"output_index": self.index, "item": item}),
        );
        self.done_items.push(item);
    }

    fn reasoning_delta(&mut self, out: &mut Vec<u8>, d: &str) {
        if self.open != Open::Reasoning {
            self.close(out);
            self.open = Open::Reasoning;
            let i = self.index;
            let id = self.builder().item_id("rs", i);
            let item = json!({"type": "reasoning", "id": id, "summary": [], "content": [], "status": "in_progress"});
            self.emit(
                out,
                "response.output_item.added",
                json!({"output_index": i, "item": item}),
            );
            self.emit(out, "response.content_part.added", json!({"item_id": id, "output_index": i, "content_index": 0, "part": {"type": "reasoning_text", "text": ""}}));
            self.open_deltas(DeltaOf::Reasoning, &id);
        }
        self.g.reasoning.get_or_insert_with(String::new).push_str(d);
        self.emit_delta(out, d);
    }

    fn text_delta(&mut self, out: &mut Vec<u8>, d: &str) {
        if self.open != Open::Text {
            self.close(out);
            self.open = Open::Text;
            let i = self.index;
            let item = self.builder().message_item(i, "", "in_progress");
            let id = item["id"].clone();
            self.emit(
                out,
                "response.output_item.added",
                json!({"output_index": i, "item": item}),
            );
            self.emit(out, "response.content_part.added", json!({"item_id": id, "output_index": i, "content_index": 0, "part": output_text("")}));
            let id = self.builder().item_id("msg", i);
            self.open_deltas(DeltaOf::Text, &id);
        }
        self.g.text.get_or_insert_with(String::new).push_str(d);
        self.emit_delta(out, d);
    }

    fn call_delta(&mut self, out: &mut Vec<u8>, tc: &ToolCallDelta<'_>) {
        let engine_index = tc.index.as_u64().unwrap_or(0);
        let f = &tc.function.0;
        let slot = match self.call_slots.iter().find(|(e, _)| *e == engine_index) {
            Some((_, s)) => *s,
            None => {
                self.close(out);
                let slot = self.g.calls.len();
                self.call_slots.push((engine_index, slot));
                self.g.calls.push(ToolCall {
                    id: tc.id.as_str().unwrap_or("").to_string(),
                    name: f.name.as_str().unwrap_or("").to_string(),
                    arguments: String::new(),
                });
                self.open = Open::Call(slot);
                let i = self.index;
                let item = self
                    .builder()
                    .call_item(i, &self.g.calls[slot], "in_progress");
                self.emit(
                    out,
                    "response.output_item.added",
                    json!({"output_index": i, "item": item}),
                );
                let id = self.builder().item_id("fc", i);
                self.open_deltas(DeltaOf::Arguments, &id);
                slot
            }
        };
        let args = f.arguments.as_str().unwrap_or("");
        if args.is_empty() {
            return;
        }
        self.g.calls[slot].arguments.push_str(args);
        if self.open != Open::Call(slot) {
            // Arguments for a call that is no longer the open item: kept, not streamed.
            return;
        }
        if !self.plan.map.is_custom(&self.g.calls[slot].name) {
            self.emit_delta(out, args);
        }
    }

    fn failed_frames(&mut self, code: &str, message: &str) -> Vec<u8> {
        let mut out = Vec::new();
        if self.failed {
            return out;
        }
        self.failed = true;
        self.start(&mut out);
        let items = self.done_items.clone();
        let mut r = self.builder().response("failed", items, Some(&self.g));
        r["error"] = json!({"code": "server_error", "message": format!("{code}: {message}")});
        r["incomplete_details"] = Value::Null;
        self.emit(&mut out, "response.failed", json!({"response": r}));
        out
    }

    fn on_chunk(&mut self, chunk: &Chunk<'_>, out: &mut Vec<u8>) {
        if let Some(err) = &chunk.error {
            let msg = err
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("engine error")
                .to_string();
            let frames = self.failed_frames("engine_error", &msg);
            out.extend_from_slice(&frames);
            return;
        }
        self.start(out);
        if let Some(u) = &chunk.usage {
            self.g.usage = Some(u.clone());
        }
        // Responses has one output per answer: only the first choice is translated.
        let Some(ch) = chunk.choices.first() else {
            return;
        };
        if let Some(d) = &ch.delta {
            // As `reasoning_of`: `reasoning_content` first.
            if let Some(r) = d
                .reasoning_content
                .as_str()
                .or_else(|| d.reasoning.as_str())
                .filter(|s| !s.is_empty())
            {
                self.reasoning_delta(out, r);
            }
            if let Some(t) = d.content.as_deref().filter(|s| !s.is_empty()) {
                self.text_delta(out, t);
            }
            for tc in &d.tool_calls.0 {
                self.call_delta(out, &tc.0);
            }
        }
        if let Some(fr) = &ch.finish_reason {
            self.g.finish_reason = Some(fr.clone());
            // The engine is done generating: the last item ends now, not at commit.
            self.close(out);
        }
    }
}

impl StreamTranslator for Translator {
    fn on_event(&mut self, _: &Event, chunk: Option<&Chunk<'_>>, out: &mut Vec<u8>) {
        if let Some(c) = chunk {
            self.on_chunk(c, out);
        }
    }

    fn finish(&mut self) -> (Vec<u8>, Option<Kept>) {
        // Normally empty: the last item closed with the engine's finish_reason.
        let mut out = Vec::new();
        self.start(&mut out);
        self.close(&mut out);
        let (resp, kept) = self
            .builder()
            .finish(&self.g, Some(self.done_items.clone()));
        let kind = if resp["status"] == "incomplete" {
            "response.incomplete"
        } else {
            "response.completed"
        };
        self.emit(&mut out, kind, json!({"response": resp}));
        (out, kept)
    }

    fn fail(&mut self, e: &ApiError) -> Vec<u8> {
        self.failed_frames(e.code, &e.message)
    }
}

#[cfg(test)]
mod tests;
