//! Unit and property tests of the Anthropic Messages adapter.

use super::*;
use crate::protocol::translate_event;
use crate::wire::sse::Parser;
use proptest::prelude::*;
use serde_json::json;
use std::sync::Arc;

fn ctx(want_ids: bool) -> Ctx {
    Ctx {
        want_ids,
        call_id: "call-7f3a".into(),
        ..Default::default()
    }
}

fn chat_of(body: Value) -> Map<String, Value> {
    AnthropicMessages
        .engine_request(body, &mut ctx(true))
        .unwrap_or_else(|e| panic!("{e}"))
        .body
}

fn refused(body: Value) -> ApiError {
    match AnthropicMessages.engine_request(body, &mut ctx(true)) {
        Ok(r) => panic!("expected a 400, got {:?}", r.body),
        Err(e) => e,
    }
}

/// The shape of Claude Code 2.1.332's second call (docs/harnesses.md#what-claude-code-sends).
fn claude_code_call() -> Value {
    json!({
        "model": "lightning",
        "max_tokens": 32000,
        "stream": true,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.fa9;"},
            {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>r</system-reminder>\n"},
                {"type": "text", "text": "Create hello.txt"},
            ]},
            {"role": "system", "content": "# Environment"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Use Bash.", "signature": "sig1"},
                {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "echo hi > hello.txt"}},
            ]},
            {"role": "user", "content": [
                {"tool_use_id": "toolu_1", "type": "tool_result", "content": "(Bash completed with no output)",
                 "is_error": false, "cache_control": {"type": "ephemeral"}},
            ]},
        ],
        "tools": [
            {"name": "DeferredToolPlaceholder", "description": "d", "input_schema": {"type": "object", "properties": {}}, "defer_loading": true},
            {"name": "Bash", "description": "Run a command", "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}},
        ],
        "metadata": {"user_id": "{\"session_id\":\"s\"}"},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
    })
}

#[test]
fn translates_what_claude_code_sends() {
    let r = AnthropicMessages
        .engine_request(claude_code_call(), &mut ctx(true))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(r.stream);
    assert_eq!(r.kind, Kind::Chat);
    let b = r.body;
    assert_eq!(
        b["messages"],
        json!([
            {"role": "system", "content": "x-anthropic-billing-header: cc_version=2.1.332.fa9;\nYou are a Claude agent."},
            {"role": "user", "content": "<system-reminder>r</system-reminder>\n\nCreate hello.txt"},
            {"role": "system", "content": "# Environment"},
            {"role": "assistant", "content": null, "reasoning": "Use Bash.", "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "Bash", "arguments": "{\"command\":\"echo hi > hello.txt\"}"}}
            ]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "(Bash completed with no output)"},
        ])
    );
    // The deferred tool is not shown to the model.
    assert_eq!(b["tools"].as_array().map(Vec::len), Some(1));
    assert_eq!(b["tools"][0]["function"]["name"], json!("Bash"));
    assert_eq!(
        b["tools"][0]["function"]["parameters"]["required"],
        json!(["command"])
    );
    assert_eq!(b["max_tokens"], json!(32000));
    assert_eq!(b["chat_template_kwargs"], json!({"enable_thinking": true}));
    assert_eq!(b["stream_options"], json!({"include_usage": true}));
    assert_eq!(b["return_token_ids"], json!(true));
    assert_eq!(b["logprobs"], json!(true));
    for absent in [
        "metadata",
        "context_management",
        "output_config",
        "system",
        "thinking",
    ] {
        assert!(
            !b.contains_key(absent),
            "{absent} leaked into the engine request"
        );
    }
}

#[test]
fn a_one_block_list_and_a_string_translate_alike() {
    // Claude Code sends the same turn as a block list in one call, a string in the next.
    let a = chat_of(
        json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]}),
    );
    let b = chat_of(json!({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}));
    assert_eq!(a["messages"], b["messages"]);
}

#[test]
fn tool_input_keeps_its_key_order() {
    // The template renders the arguments back; a reordered object would break
    // the token prefix the next turn shares with this one.
    let b = chat_of(
        json!({"max_tokens": 5, "messages": [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": {"zeta": 1, "alpha": {"y": 2, "b": 3}}},
        ]}]}),
    );
    assert_eq!(
        b["messages"][0]["tool_calls"][0]["function"]["arguments"],
        json!(r#"{"zeta":1,"alpha":{"y":2,"b":3}}"#)
    );
    let m = whole_message(&EngineAnswer {
        calls: vec![("c".into(), "f".into(), r#"{"zeta": 1, "alpha": 2}"#.into())],
        ..sample_answer()
    });
    assert_eq!(
        m["content"][2]["input"].to_string(),
        r#"{"zeta":1,"alpha":2}"#
    );
}

#[test]
fn sampling_stop_and_tool_choice() {
    let tool = json!({"name": "f", "input_schema": {"type": "object"}});
    let b = chat_of(json!({
        "max_tokens": 9, "messages": [{"role": "user", "content": "x"}],
        "temperature": 0.5, "top_p": 0.9, "top_k": 40, "stop_sequences": ["END"],
        "tools": [tool], "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
    }));
    assert_eq!(
        (
            b["temperature"].clone(),
            b["top_p"].clone(),
            b["top_k"].clone()
        ),
        (json!(0.5), json!(0.9), json!(40))
    );
    assert_eq!(b["stop"], json!(["END"]));
    assert_eq!(b["tool_choice"], json!("required"));
    assert_eq!(b["parallel_tool_calls"], json!(false));
    for (choice, want) in [
        (json!({"type": "auto"}), json!("auto")),
        (json!({"type": "none"}), json!("none")),
        (
            json!({"type": "tool", "name": "f"}),
            json!({"type": "function", "function": {"name": "f"}}),
        ),
    ] {
        let b = chat_of(
            json!({"max_tokens": 9, "messages": [], "tools": [tool], "tool_choice": choice}),
        );
        assert_eq!(b["tool_choice"], want);
    }
    let b = chat_of(json!({"max_tokens": 9, "messages": [], "thinking": {"type": "disabled"}}));
    assert_eq!(b["chat_template_kwargs"], json!({"enable_thinking": false}));
}

#[test]
fn tool_results_split_a_user_turn_in_order() {
    let b = chat_of(
        json!({"max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "a", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}], "is_error": true},
            {"type": "tool_result", "tool_use_id": "b"},
            {"type": "text", "text": "next"},
        ]}]}),
    );
    assert_eq!(
        b["messages"],
        json!([
            {"role": "tool", "tool_call_id": "a", "content": "one\ntwo"},
            {"role": "tool", "tool_call_id": "b", "content": ""},
            {"role": "user", "content": "next"},
        ])
    );
}

#[test]
fn refuses_what_it_cannot_translate_with_a_400() {
    let user = |content: Value| json!({"max_tokens": 5, "messages": [{"role": "user", "content": content}]});
    let cases = [
        (
            user(
                json!([{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]),
            ),
            "image",
        ),
        (
            user(json!([{"type": "document", "source": {}}])),
            "document",
        ),
        (
            user(
                json!([{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "tool_reference", "tool_name": "X"}]}]),
            ),
            "tool_reference",
        ),
        (
            json!({"max_tokens": 5, "messages": [], "tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
            "web_search_20250305",
        ),
        (
            json!({"max_tokens": 5, "messages": [], "container": "c"}),
            "container",
        ),
        (
            json!({"max_tokens": 5, "messages": [], "mcp_servers": [{}]}),
            "mcp_servers",
        ),
        (json!({"messages": []}), "max_tokens"),
        (json!({"max_tokens": 0, "messages": []}), "max_tokens"),
        (json!({"max_tokens": 5}), "messages"),
        (
            json!({"max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}),
            "role",
        ),
        (
            json!({"max_tokens": 5, "messages": [], "tools": [{"name": "f"}]}),
            "input_schema",
        ),
        (
            json!({"max_tokens": 5, "messages": [], "tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "sometimes"}}),
            "tool_choice",
        ),
        (json!("just a string"), "JSON object"),
    ];
    for (body, word) in cases {
        let e = refused(body);
        assert_eq!(e.status, 400);
        assert!(e.message.contains(word), "{word}: {}", e.message);
        let v: Value =
            serde_json::from_slice(&AnthropicMessages.error_body(&e)).unwrap_or_default();
        assert_eq!(v["type"], json!("error"));
        assert_eq!(v["error"]["type"], json!("invalid_request_error"));
        assert_eq!(v["error"]["message"], json!(e.message));
    }
}

#[test]
fn error_types_follow_the_status() {
    for (status, kind) in [
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
        (504, "timeout_error"),
    ] {
        assert_eq!(error_type(status), kind);
    }
    // An engine error keeps its status and says what the engine said.
    let (a, _) = AnthropicMessages.answer(
        StatusCode::BAD_REQUEST,
        &Bytes::from_static(br#"{"object":"error","message":"This model's maximum context length is 2048 tokens.","code":400}"#),
        &ctx(true),
    );
    let Answer::Json { status, body } = a else {
        panic!("expected JSON")
    };
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let v: Value = serde_json::from_slice(&body).unwrap_or_default();
    assert_eq!(v["error"]["type"], json!("invalid_request_error"));
    assert!(v["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("maximum context length"));
}

#[test]
fn count_tokens_asks_the_engine_to_tokenize_the_translation() {
    let mut body = claude_code_call();
    if let Some(m) = body.as_object_mut() {
        m.remove("max_tokens");
        m.remove("stream");
    }
    let t = tokenize_request(body).unwrap_or_else(|e| panic!("{e}"));
    let chat =
        to_chat(claude_code_call().as_object().unwrap_or(&Map::new()), true).unwrap_or_default();
    assert_eq!(t["messages"], chat["messages"]);
    assert_eq!(t["tools"], chat["tools"]);
    assert_eq!(t["add_generation_prompt"], json!(true));
    assert!(!t.contains_key("max_tokens") && !t.contains_key("stream"));
    let a = count_tokens_answer(br#"{"count": 42, "max_model_len": 2048, "tokens": [1]}"#);
    assert_eq!(a, Ok(json!({"input_tokens": 42})));
    assert!(count_tokens_answer(b"nope").is_err());
}

// ------------------------------------------------------------------ answers

/// One engine answer, in the two shapes vLLM sends it.
#[derive(Debug, Clone)]
struct EngineAnswer {
    reasoning: String,
    content: String,
    /// (id, name, arguments JSON)
    calls: Vec<(String, String, String)>,
    finish: &'static str,
    stop: Option<String>,
    ids: Vec<u32>,
}

impl EngineAnswer {
    fn whole(&self) -> Value {
        let calls: Vec<Value> = self
            .calls
            .iter()
            .map(|(id, name, args)| json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}}))
            .collect();
        let mut msg = json!({"role": "assistant", "content": self.content});
        if !self.reasoning.is_empty() {
            msg["reasoning"] = json!(self.reasoning);
        }
        if !calls.is_empty() {
            msg["tool_calls"] = json!(calls);
        }
        json!({
            "id": "chatcmpl-1", "model": "m", "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "message": msg, "finish_reason": self.finish, "stop_reason": self.stop, "token_ids": self.ids}],
            "usage": {"prompt_tokens": 3, "completion_tokens": self.ids.len(), "total_tokens": 3 + self.ids.len()},
        })
    }

    /// The streamed form: text pieces cut at `cuts` (byte positions, char-aligned).
    fn chunks(&self, cut: usize) -> Vec<Value> {
        let mut out = vec![
            json!({"model": "m", "prompt_token_ids": [1, 2, 3], "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
        ];
        let delta = |d: Value| json!({"model": "m", "choices": [{"index": 0, "delta": d, "token_ids": [9]}]});
        for piece in pieces(&self.reasoning, cut) {
            out.push(delta(json!({"reasoning": piece})));
        }
        for piece in pieces(&self.content, cut) {
            out.push(delta(json!({"content": piece})));
        }
        for (i, (id, name, args)) in self.calls.iter().enumerate() {
            out.push(delta(json!({"tool_calls": [{"index": i, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]})));
            for piece in pieces(args, cut) {
                out.push(delta(
                    json!({"tool_calls": [{"index": i, "function": {"arguments": piece}}]}),
                ));
            }
        }
        out.push(json!({"model": "m", "choices": [{"index": 0, "delta": {}, "finish_reason": self.finish, "stop_reason": self.stop}]}));
        out.push(json!({"model": "m", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": self.ids.len(), "total_tokens": 3 + self.ids.len()}}));
        out
    }
}

fn pieces(s: &str, cut: usize) -> Vec<String> {
    let chars: Vec<char> = s.chars().collect();
    chars
        .chunks(cut.max(1))
        .map(|c| c.iter().collect())
        .collect()
}

fn whole_message(a: &EngineAnswer) -> Value {
    let (answer, _) = AnthropicMessages.answer(
        StatusCode::OK,
        &Bytes::from(a.whole().to_string()),
        &ctx(true),
    );
    let Answer::Json { status, body } = answer else {
        panic!("expected JSON")
    };
    assert_eq!(status, StatusCode::OK);
    serde_json::from_slice(&body).unwrap_or_default()
}

/// Runs the translator over the chunks; returns (early frames, held-back frames).
fn translate(chunks: &[Value]) -> (Vec<u8>, Vec<u8>) {
    let mut sse = Vec::new();
    for c in chunks {
        sse_frame(&mut sse, None, c.to_string().as_bytes());
    }
    sse_frame(&mut sse, None, b"[DONE]");
    let events = Parser::new().feed(&sse).unwrap_or_default();
    let mut t = AnthropicMessages.translator(&ctx(true));
    let mut early = Vec::new();
    for ev in &events {
        translate_event(t.as_mut(), ev, &mut early);
    }
    (early, t.finish().0)
}

/// Accumulates Messages stream events into a message the way the SDK does
/// (`anthropic/lib/streaming/_messages.py` `accumulate_event`), checking the
/// event order on the way.
fn accumulate(frames: &[u8]) -> Value {
    let events = Parser::new().feed(frames).unwrap_or_default();
    let mut msg = Value::Null;
    let mut json_buf: Vec<String> = Vec::new();
    let mut open: Option<usize> = None;
    let mut names = Vec::new();
    for ev in events {
        let raw = String::from_utf8_lossy(&ev.raw).to_string();
        let v: Value = serde_json::from_slice(&ev.data).unwrap_or_default();
        let kind = v["type"].as_str().unwrap_or("").to_string();
        assert!(
            raw.starts_with(&format!("event: {kind}\n")),
            "event name must match its type: {raw}"
        );
        names.push(kind.clone());
        match kind.as_str() {
            "message_start" => {
                assert!(msg.is_null(), "one message_start");
                msg = v["message"].clone();
            }
            "ping" => {}
            "content_block_start" => {
                assert_eq!(open, None, "blocks do not nest");
                let i = v["index"].as_u64().unwrap_or(99) as usize;
                let blocks = msg["content"].as_array_mut().map(|b| b.len());
                assert_eq!(blocks, Some(i), "block indexes count up from 0");
                open = Some(i);
                json_buf.push(String::new());
                if let Some(b) = msg["content"].as_array_mut() {
                    b.push(v["content_block"].clone());
                }
            }
            "content_block_delta" => {
                let i = v["index"].as_u64().unwrap_or(99) as usize;
                assert_eq!(open, Some(i), "a delta goes to the open block");
                let d = &v["delta"];
                let block = &mut msg["content"][i];
                match d["type"].as_str() {
                    Some("text_delta") => {
                        block["text"] = json!(format!(
                            "{}{}",
                            block["text"].as_str().unwrap_or(""),
                            d["text"].as_str().unwrap_or("")
                        ))
                    }
                    Some("thinking_delta") => {
                        block["thinking"] = json!(format!(
                            "{}{}",
                            block["thinking"].as_str().unwrap_or(""),
                            d["thinking"].as_str().unwrap_or("")
                        ))
                    }
                    Some("signature_delta") => block["signature"] = d["signature"].clone(),
                    Some("input_json_delta") => {
                        json_buf[i].push_str(d["partial_json"].as_str().unwrap_or(""));
                        block["input"] = serde_json::from_str(&json_buf[i]).unwrap_or(json!({}));
                    }
                    other => panic!("unknown delta {other:?}"),
                }
            }
            "content_block_stop" => {
                assert_eq!(open, v["index"].as_u64().map(|i| i as usize));
                open = None;
            }
            "message_delta" => {
                assert_eq!(open, None);
                msg["stop_reason"] = v["delta"]["stop_reason"].clone();
                msg["stop_sequence"] = v["delta"]["stop_sequence"].clone();
                msg["usage"]["output_tokens"] = v["usage"]["output_tokens"].clone();
                if !v["usage"]["input_tokens"].is_null() {
                    msg["usage"]["input_tokens"] = v["usage"]["input_tokens"].clone();
                }
            }
            "message_stop" => {}
            other => panic!("unexpected event {other}"),
        }
    }
    assert_eq!(names.first().map(String::as_str), Some("message_start"));
    assert_eq!(names.last().map(String::as_str), Some("message_stop"));
    msg
}

fn sample_answer() -> EngineAnswer {
    EngineAnswer {
        reasoning: "Think.".into(),
        content: "I will run it.".into(),
        calls: vec![(
            "call_1".into(),
            "Bash".into(),
            r#"{"command": "ls"}"#.into(),
        )],
        finish: "tool_calls",
        stop: None,
        ids: vec![5, 6, 7],
    }
}

#[test]
fn a_whole_answer_becomes_a_message() {
    let m = whole_message(&sample_answer());
    assert_eq!(
        m,
        json!({
            "id": "msg_call7f3a", "type": "message", "role": "assistant", "model": "m",
            "content": [
                {"type": "thinking", "thinking": "Think.", "signature": "lightning:call-7f3a"},
                {"type": "text", "text": "I will run it."},
                {"type": "tool_use", "id": "call_1", "name": "Bash", "input": {"command": "ls"}},
            ],
            "stop_reason": "tool_use", "stop_sequence": null,
            "usage": {"input_tokens": 3, "output_tokens": 3, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
        })
    );
    let mut a = sample_answer();
    a.calls.clear();
    a.reasoning.clear();
    a.finish = "stop";
    a.stop = Some("END".into());
    let m = whole_message(&a);
    assert_eq!(
        (m["stop_reason"].clone(), m["stop_sequence"].clone()),
        (json!("stop_sequence"), json!("END"))
    );
    a.stop = None;
    assert_eq!(whole_message(&a)["stop_reason"], json!("end_turn"));
    a.finish = "length";
    assert_eq!(whole_message(&a)["stop_reason"], json!("max_tokens"));
}

#[test]
fn the_stream_holds_back_only_the_end() {
    let a = sample_answer();
    let (early, held) = translate(&a.chunks(3));
    let early_names: Vec<String> = Parser::new()
        .feed(&early)
        .unwrap_or_default()
        .iter()
        .filter_map(|e| {
            serde_json::from_slice::<Value>(&e.data).ok()?["type"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(
        early_names.first().map(String::as_str),
        Some("message_start")
    );
    assert_eq!(early_names[1], "ping");
    assert_eq!(
        early_names.last().map(String::as_str),
        Some("content_block_stop")
    );
    let held = String::from_utf8_lossy(&held).to_string();
    assert!(held.starts_with("event: message_delta\n"), "{held}");
    assert!(
        held.ends_with("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"),
        "{held}"
    );
}

#[test]
fn a_failed_stream_ends_with_an_error_event() {
    let mut t = AnthropicMessages.translator(&ctx(true));
    let out = t.fail(&ApiError::new(
        502,
        "server_error",
        "upstream_error",
        "the engine hung up",
    ));
    let s = String::from_utf8_lossy(&out).to_string();
    assert!(s.starts_with("event: error\ndata: "), "{s}");
    assert!(
        s.contains(r#""type":"api_error""#) && s.contains("the engine hung up"),
        "{s}"
    );
    // An engine error inside the stream ends it the same way.
    let (mut t, s) = first_event(b"data: {\"error\": {\"message\": \"boom\", \"code\": 500}}\n\n");
    assert!(s.contains("boom"), "{s}");
    assert!(t.finish().0.is_empty());
    // `"error": null` is no error (the capture records the call as answered).
    let (mut t, s) = first_event(
        b"data: {\"error\": null, \"choices\": [{\"delta\": {\"content\": \"Hi\"}}]}\n\n",
    );
    assert!(
        s.contains("text_delta") && !s.contains("event: error"),
        "{s}"
    );
    assert!(!t.finish().0.is_empty());
}

/// A fresh stream translator fed the first event of `sse` (which it must
/// forward), and the frames it wrote for it.
fn first_event(sse: &[u8]) -> (Box<dyn StreamTranslator>, String) {
    let mut t = AnthropicMessages.translator(&ctx(true));
    let mut out = Vec::new();
    let evs = Parser::new().feed(sse).unwrap_or_default();
    assert!(translate_event(t.as_mut(), &evs[0], &mut out));
    (t, String::from_utf8_lossy(&out).into_owned())
}

/// `model` is echoed in `message_start` as the engine sent it, any JSON value.
#[test]
fn the_first_chunk_model_is_echoed_as_sent() {
    for (model, want) in [
        (r#""m\u00e9""#, json!("m\u{e9}")),
        (r#"{"b":1,"a":[2]}"#, json!({"b": 1, "a": [2]})),
        ("null", Value::Null),
    ] {
        let (early, _) = translate(&[serde_json::from_str(&format!(
            r#"{{"model": {model}, "choices": [{{"delta": {{"content": "x"}}}}]}}"#
        ))
        .unwrap_or_default()]);
        let start = Parser::new().feed(&early).unwrap_or_default();
        let v: Value = serde_json::from_slice(&start[0].data).unwrap_or_default();
        assert_eq!(v["message"]["model"], want, "{model}");
    }
}

fn text_strategy() -> impl Strategy<Value = String> {
    prop_oneof![Just(String::new()), "[a-z é\\n{}\"\\\\]{1,12}"]
}

fn answer_strategy() -> impl Strategy<Value = EngineAnswer> {
    let call = (
        "[a-z]{1,6}",
        "[a-zA-Z_]{1,8}",
        proptest::collection::btree_map("[a-z]{1,4}", "[a-z \"]{0,6}", 0..3),
    );
    (
        text_strategy(),
        text_strategy(),
        proptest::collection::vec(call, 0..3),
        prop_oneof![Just("stop"), Just("length"), Just("tool_calls")],
        proptest::option::of("[A-Z]{1,3}"),
        proptest::collection::vec(0u32..1000, 0..6),
    )
        .prop_map(
            |(reasoning, content, calls, finish, stop, ids)| EngineAnswer {
                reasoning,
                content,
                calls: calls
                    .into_iter()
                    .enumerate()
                    .map(|(i, (id, name, args))| {
                        (
                            format!("{id}{i}"),
                            name,
                            serde_json::to_string(&args).unwrap_or_default(),
                        )
                    })
                    .collect(),
                finish,
                stop: if finish == "stop" { stop } else { None },
                ids,
            },
        )
}

proptest! {
    #![proptest_config(crate::util::proptest_config(256))]

    /// Streamed and whole translations of the same engine answer agree.
    #[test]
    fn stream_equals_whole(a in answer_strategy(), cut in 1usize..8) {
        let (early, held) = translate(&a.chunks(cut));
        let mut all = early;
        all.extend_from_slice(&held);
        prop_assert_eq!(accumulate(&all), whole_message(&a));
    }

    /// No bytes make the request side panic.
    #[test]
    fn request_parsing_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        if let Ok(v) = serde_json::from_slice::<Value>(&bytes) {
            let _ = AnthropicMessages.engine_request(v.clone(), &mut ctx(true));
            let _ = tokenize_request(v);
        }
        let _ = count_tokens_answer(&bytes);
    }

    /// Structured garbage in every field Messages defines never panics either.
    #[test]
    fn request_fields_never_panic(v in json_strategy()) {
        let _ = AnthropicMessages.engine_request(v.clone(), &mut ctx(true));
        let _ = tokenize_request(v);
    }

    /// No engine bytes make the answer side or the stream translator panic.
    #[test]
    fn answers_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512), v in json_strategy()) {
        let _ = AnthropicMessages.answer(StatusCode::OK, &Bytes::from(bytes.clone()), &ctx(true));
        let _ = AnthropicMessages.answer(StatusCode::OK, &Bytes::from(v.to_string()), &ctx(true));
        let _ = AnthropicMessages.answer(StatusCode::BAD_REQUEST, &Bytes::from(bytes.clone()), &ctx(true));
        let mut t = AnthropicMessages.translator(&ctx(true));
        let mut out = Vec::new();
        let mut frames = Vec::new();
        sse_frame(&mut frames, None, &bytes);
        sse_frame(&mut frames, None, v.to_string().as_bytes());
        for ev in Parser::new().feed(&frames).unwrap_or_default() {
            translate_event(t.as_mut(), &ev, &mut out);
        }
        let _ = t.finish();
    }
}

/// JSON whose keys are the ones Messages requests and engine chunks use.
fn json_strategy() -> impl Strategy<Value = Value> {
    let keys = prop_oneof![
        Just("model"),
        Just("messages"),
        Just("role"),
        Just("content"),
        Just("type"),
        Just("text"),
        Just("system"),
        Just("tools"),
        Just("tool_choice"),
        Just("name"),
        Just("input_schema"),
        Just("input"),
        Just("id"),
        Just("tool_use_id"),
        Just("max_tokens"),
        Just("stream"),
        Just("thinking"),
        Just("stop_sequences"),
        Just("choices"),
        Just("delta"),
        Just("tool_calls"),
        Just("function"),
        Just("arguments"),
        Just("index"),
        Just("finish_reason"),
        Just("usage"),
        Just("reasoning"),
        Just("error"),
        Just("message"),
        Just("defer_loading"),
        Just("prompt_token_ids"),
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        prop_oneof![
            Just("user"),
            Just("assistant"),
            Just("system"),
            Just("text"),
            Just("tool_use"),
            Just("tool_result"),
            Just("thinking"),
            Just("image"),
            Just("auto"),
            Just("tool"),
            Just("stop")
        ]
        .prop_map(|s| Value::String(s.into())),
        "[a-z]{0,4}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, move |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::vec((keys.clone(), inner), 0..6).prop_map(|kv| Value::Object(
                kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
            )),
        ]
    })
}

// ------------------------------------------------------------------ conversations

/// One item of a conversation as the engine sees it.
#[derive(Debug, Clone, PartialEq)]
enum Item {
    System(String),
    User(String),
    Tool(String, String),
    /// (text, reasoning, calls as (id, name, input))
    Assistant(Option<String>, Option<String>, Vec<(String, String, Value)>),
}

/// What a random Messages conversation must become, computed block by block
/// (the plain reference the adapter is checked against).
fn expected(turns: &[Value]) -> Vec<Item> {
    let mut out = Vec::new();
    for t in turns {
        let blocks = t["content"].as_array().cloned().unwrap_or_default();
        let joined = |kind: &str, field: &str| -> Vec<String> {
            blocks
                .iter()
                .filter(|b| b["type"] == kind)
                .map(|b| b[field].as_str().unwrap_or("").to_string())
                .collect()
        };
        match t["role"].as_str() {
            Some("system") => out.push(Item::System(joined("text", "text").join("\n"))),
            Some("user") => {
                let mut run: Vec<String> = Vec::new();
                for b in &blocks {
                    if b["type"] == "text" {
                        run.push(b["text"].as_str().unwrap_or("").into());
                        continue;
                    }
                    if !run.is_empty() {
                        out.push(Item::User(run.join("\n")));
                        run.clear();
                    }
                    let id = b["tool_use_id"].as_str().unwrap_or("").to_string();
                    out.push(Item::Tool(id, b["content"].as_str().unwrap_or("").into()));
                }
                if !run.is_empty() {
                    out.push(Item::User(run.join("\n")));
                }
            }
            _ => {
                let texts = joined("text", "text");
                let thoughts = joined("thinking", "thinking");
                let calls: Vec<_> = blocks
                    .iter()
                    .filter(|b| b["type"] == "tool_use")
                    .map(|b| {
                        (
                            b["id"].as_str().unwrap_or("").to_string(),
                            b["name"].as_str().unwrap_or("").to_string(),
                            b["input"].clone(),
                        )
                    })
                    .collect();
                let text = if texts.is_empty() && !calls.is_empty() {
                    None
                } else {
                    Some(texts.join("\n"))
                };
                let reasoning = (!thoughts.is_empty()).then(|| thoughts.join("\n"));
                out.push(Item::Assistant(text, reasoning, calls));
            }
        }
    }
    out
}

/// The chat messages the adapter produced, read back as items.
fn items_of(chat: &Value) -> Vec<Item> {
    let s = |v: &Value| v.as_str().unwrap_or("").to_string();
    chat.as_array()
        .into_iter()
        .flatten()
        .map(|m| match m["role"].as_str() {
            Some("system") => Item::System(s(&m["content"])),
            Some("user") => Item::User(s(&m["content"])),
            Some("tool") => Item::Tool(s(&m["tool_call_id"]), s(&m["content"])),
            _ => Item::Assistant(
                m["content"].as_str().map(str::to_string),
                m["reasoning"].as_str().map(str::to_string),
                m["tool_calls"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|c| {
                        let args = c["function"]["arguments"].as_str().unwrap_or("");
                        (
                            s(&c["id"]),
                            s(&c["function"]["name"]),
                            serde_json::from_str(args).unwrap_or(Value::Null),
                        )
                    })
                    .collect(),
            ),
        })
        .collect()
}

fn block_strategy(role: &'static str) -> BoxedStrategy<Value> {
    let text = "[a-z \\n\"é]{0,8}";
    let input =
        proptest::collection::btree_map("[a-z]{1,3}", "[a-z]{0,3}", 0..3).prop_map(|m| json!(m));
    match role {
        "user" => prop_oneof![
            text.prop_map(|t| json!({"type": "text", "text": t, "cache_control": {"type": "ephemeral"}})),
            ("[a-z]{1,4}", text).prop_map(|(id, c)| json!({"type": "tool_result", "tool_use_id": id, "content": c, "is_error": false})),
        ]
        .boxed(),
        "system" => text.prop_map(|t| json!({"type": "text", "text": t})).boxed(),
        _ => prop_oneof![
            text.prop_map(|t| json!({"type": "text", "text": t})),
            text.prop_map(|t| json!({"type": "thinking", "thinking": t, "signature": "s"})),
            ("[a-z]{1,4}", "[A-Za-z]{1,5}", input).prop_map(|(id, n, i)| json!({"type": "tool_use", "id": id, "name": n, "input": i})),
        ]
        .boxed(),
    }
}

fn turn_strategy() -> impl Strategy<Value = Value> {
    prop_oneof![Just("user"), Just("assistant"), Just("system")].prop_flat_map(|role| {
        proptest::collection::vec(block_strategy(role), 0..4)
            .prop_map(move |blocks| json!({"role": role, "content": blocks}))
    })
}

proptest! {
    #![proptest_config(crate::util::proptest_config(256))]

    /// A random conversation keeps every item, in order, through the translation.
    #[test]
    fn conversations_keep_every_item(turns in proptest::collection::vec(turn_strategy(), 0..6)) {
        let chat = chat_of(json!({"max_tokens": 8, "messages": turns}));
        prop_assert_eq!(items_of(&chat["messages"]), expected(&turns));
    }
}

/// The frames the translator sends for one engine chunk as vLLM streams it
/// (the delta, its logprobs and its token ids).
fn frames(t: &mut dyn StreamTranslator, delta: Value) -> String {
    let chunk = json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": null,
            "logprobs": {"content": [{"token": "x", "logprob": -0.25, "bytes": [120], "top_logprobs": []}]},
            "token_ids": [87]}]});
    let data = chunk.to_string().into_bytes();
    let ev = Event {
        raw: [b"data: ", &data[..], b"\n\n"].concat(),
        data,
    };
    let mut out = Vec::new();
    assert!(translate_event(t, &ev, &mut out));
    String::from_utf8(out).unwrap_or_else(|e| panic!("{e}"))
}

/// The per-token frames, byte for byte (harnesses parse them as JSON, but
/// the bytes are what a recorded trace and a diff of two gateways see).
#[test]
fn per_token_frames_are_pinned() {
    let mut t = AnthropicMessages.translator(&ctx(true));
    let [thought, text, arguments] =
        crate::protocol::per_token_frames(|d| frames(t.as_mut(), d), "reasoning");
    assert_eq!(
        thought,
        "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"thinking_delta\",\"thinking\":\" \\\"hm\\\"\\n\"}}\n\n"
    );
    assert_eq!(
        text,
        "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"text_delta\",\"text\":\" thére\\t\"}}\n\n"
    );
    assert_eq!(
        arguments,
        "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":2,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"a\\\": 1\"}}\n\n"
    );
}

/// The next request of a conversation whose assistant turn is `message`.
fn resend(message: &Value, c: &mut Ctx) -> Value {
    let body = json!({"max_tokens": 8, "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": message["content"].clone()},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": message["content"][0]["id"].clone(), "content": "sunny"}]},
    ]});
    let r = AnthropicMessages
        .engine_request(body, c)
        .unwrap_or_else(|e| panic!("{e}"));
    r.body["messages"][1]["tool_calls"][0]["function"]["arguments"].clone()
}

#[test]
fn tool_input_is_resent_as_the_text_the_engine_generated() {
    // The engine renders arguments with spaces; Anthropic's `input` is a value,
    // so without the record the re-sent turn would be compact and split.
    let args = "{\"city\": \"Paris\",  \"days\": 2}";
    let engine = json!({"choices": [{"finish_reason": "tool_calls", "message": {"content": null,
        "tool_calls": [{"id": "call_w1", "type": "function", "function": {"name": "weather", "arguments": args}}]}}]});
    let record = Arc::new(ToolArgs::default());
    let mut c = ctx(true);
    c.tool_args = Some(record.clone());
    let (Answer::Json { body, .. }, _) =
        AnthropicMessages.answer(StatusCode::OK, &Bytes::from(engine.to_string()), &c)
    else {
        panic!("messages answers in its own shape");
    };
    let message: Value = serde_json::from_slice(&body).unwrap_or_default();
    assert_eq!(
        message["content"][0]["input"],
        json!({"city": "Paris", "days": 2})
    );
    assert_eq!(resend(&message, &mut c), json!(args));
    // Without the record (another gateway, a restart): the compact value.
    assert_eq!(
        resend(&message, &mut ctx(true)),
        json!("{\"city\":\"Paris\",\"days\":2}")
    );
    // An input the harness edited is sent as edited.
    let mut edited = message.clone();
    edited["content"][0]["input"]["days"] = json!(3);
    assert_eq!(
        resend(&edited, &mut c),
        json!("{\"city\":\"Paris\",\"days\":3}")
    );
}

#[test]
fn tool_input_kept_in_the_store_restores_it_after_a_restart() {
    let args = "{\"city\": \"Paris\"}";
    let engine = json!({"choices": [{"finish_reason": "tool_calls", "message": {"content": null,
        "tool_calls": [{"id": "call_a", "type": "function", "function": {"name": "w", "arguments": args}},
                       {"id": "call_b", "type": "function", "function": {"name": "w", "arguments": "{ }"}}]}}]});
    let mut c = ctx(true);
    c.tool_args = Some(Arc::new(ToolArgs::default()));
    let (Answer::Json { body, .. }, kept) =
        AnthropicMessages.answer(StatusCode::OK, &Bytes::from(engine.to_string()), &c)
    else {
        panic!("messages answers in its own shape");
    };
    let kept = kept.unwrap_or_else(|| panic!("a tool_use answer keeps its texts"));
    assert_eq!(kept.id, tool_args_key("call_a"));
    let message: Value = serde_json::from_slice(&body).unwrap_or_default();
    // The request re-sends both ids; a fresh record filled from the row
    // (what the proxy does) restores both texts.
    let resent = json!({"messages": [{"role": "user", "content": "q"},
        {"role": "assistant", "content": message["content"]}]});
    assert_eq!(resent_tool_ids(&resent), vec!["call_a", "call_b"]);
    let fresh = Arc::new(ToolArgs::default());
    for (id, text) in crate::protocol::tool_args_of(&kept.state) {
        fresh.put(&id, &text);
    }
    let mut after = ctx(true);
    after.tool_args = Some(fresh);
    assert_eq!(resend(&message, &mut after), json!(args));
    // An application key's call keeps no row.
    c.client_fields_only = true;
    let (_, none) = AnthropicMessages.answer(StatusCode::OK, &Bytes::from(engine.to_string()), &c);
    assert!(none.is_none());
}

#[test]
fn streamed_tool_input_is_recorded_when_the_stream_ends() {
    let record = Arc::new(ToolArgs::default());
    let mut c = ctx(true);
    c.tool_args = Some(record.clone());
    let mut t = AnthropicMessages.translator(&c);
    frames(
        t.as_mut(),
        json!({"tool_calls": [{"index": 0, "id": "call_s1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": "}}]}),
    );
    frames(
        t.as_mut(),
        json!({"tool_calls": [{"index": 0, "function": {"arguments": "\"Oslo\"}"}}]}),
    );
    assert_eq!(record.text_of("call_s1", &json!({"city": "Oslo"})), None);
    let _ = t.finish();
    assert_eq!(
        record
            .text_of("call_s1", &json!({"city": "Oslo"}))
            .as_deref(),
        Some("{\"city\": \"Oslo\"}")
    );
    assert_eq!(record.text_of("call_s1", &json!({"city": "Rome"})), None);
}

#[test]
fn the_tool_record_is_bounded() {
    let record = ToolArgs::new(2);
    for id in ["a", "b", "c"] {
        record.put(id, "{}");
    }
    assert_eq!(record.text_of("a", &json!({})), None);
    assert_eq!(record.text_of("c", &json!({})).as_deref(), Some("{}"));
}
