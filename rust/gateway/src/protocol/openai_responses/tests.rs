use super::*;
use crate::protocol::translate_event;
use crate::wire::sse::Parser;
use proptest::prelude::*;

fn ctx() -> Ctx {
    Ctx {
        want_ids: true,
        call_id: "call-00ff".into(),
        created: 1_700_000_000,
        ..Default::default()
    }
}

fn request(body: Value) -> Result<(EngineRequest, Ctx), ApiError> {
    let mut c = ctx();
    let r = OpenAiResponses.engine_request(body, &mut c)?;
    Ok((r, c))
}

fn ok_request(body: Value) -> (EngineRequest, Ctx) {
    request(body).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn translates_codex_shaped_input() {
    let (r, _) = ok_request(json!({
        "model": "m", "instructions": "be brief", "stream": true, "store": false,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "s1", "reasoning": {"summary": "auto"},
        "tools": [
            {"type": "function", "name": "exec_command", "parameters": {"type": "object"}, "strict": false},
            {"type": "custom", "name": "apply_patch", "description": "patch", "format": {"type": "grammar", "syntax": "lark", "definition": "start: x"}},
            {"type": "namespace", "name": "multi", "tools": [{"type": "function", "name": "spawn"}]}
        ],
        "tool_choice": "auto", "parallel_tool_calls": true,
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sys"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
            {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "exec_command", "arguments": "{\"cmd\": \"ls\"}"},
            {"type": "custom_tool_call", "id": "ctc_1", "call_id": "c2", "name": "apply_patch", "input": "*** Begin"},
            {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
            {"type": "custom_tool_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "done"}]}
        ]
    }));
    assert!(r.stream);
    let b = Value::Object(r.body);
    assert_eq!(b["return_token_ids"], json!(true));
    assert_eq!(b["logprobs"], json!(true));
    assert_eq!(b["stream_options"], json!({"include_usage": true}));
    let m = b["messages"].as_array().cloned().unwrap_or_default();
    assert_eq!(m.len(), 6, "{m:?}");
    assert_eq!(m[0], json!({"role": "system", "content": "be brief"}));
    assert_eq!(m[1], json!({"role": "system", "content": "sys"}));
    assert_eq!(m[3]["reasoning_content"], json!("think"));
    assert_eq!(m[3]["content"], json!("ok"));
    let calls = m[3]["tool_calls"].as_array().cloned().unwrap_or_default();
    assert_eq!(
        calls[0]["function"]["arguments"],
        json!("{\"cmd\": \"ls\"}")
    );
    assert_eq!(
        calls[1]["function"]["arguments"],
        json!("{\"input\":\"*** Begin\"}")
    );
    assert_eq!(
        m[4],
        json!({"role": "tool", "tool_call_id": "c1", "content": "a.txt"})
    );
    assert_eq!(m[5]["content"], json!("done"));
    let names: Vec<&str> = b["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t["function"]["name"].as_str())
        .collect();
    assert_eq!(names, ["exec_command", "apply_patch", "multi.spawn"]);
    for k in [
        "include",
        "prompt_cache_key",
        "reasoning",
        "store",
        "instructions",
        "input",
    ] {
        assert!(b.get(k).is_none(), "{k} leaked to the engine");
    }
}

#[test]
fn refuses_what_it_cannot_do() {
    for body in [
        json!({"input": "x", "background": true}),
        json!({"input": "x", "tools": [{"type": "web_search"}]}),
        json!({"input": "x", "tools": [{"type": "file_search", "vector_store_ids": []}]}),
        json!({"input": "x", "tools": [{"type": "tool_search", "execution": "client"}]}),
        json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}),
        json!({"input": [{"type": "item_reference", "id": "msg_1"}]}),
        json!({"input": "x", "prompt": {"id": "pmpt_1"}}),
        json!({"input": 5}),
        json!({}),
        json!([1, 2]),
    ] {
        let e = request(body.clone())
            .err()
            .unwrap_or_else(|| panic!("accepted {body}"));
        assert_eq!(e.status, 400, "{body}");
        let shaped: Value =
            serde_json::from_slice(&OpenAiResponses.error_body(&e)).unwrap_or_default();
        assert_eq!(shaped["error"]["type"], json!("invalid_request_error"));
        assert!(shaped["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
    }
}

fn answer(c: &Ctx, engine: Value) -> (Value, Option<Kept>) {
    let (a, kept) = OpenAiResponses.answer(StatusCode::OK, &Bytes::from(engine.to_string()), c);
    match a {
        Answer::Json { status, body } => {
            assert_eq!(status, StatusCode::OK);
            (serde_json::from_slice(&body).unwrap_or_default(), kept)
        }
        Answer::Passthrough => panic!("responses never passes through"),
    }
}

#[test]
fn answers_with_items_status_and_usage() {
    let (_, c) = ok_request(json!({"model": "m", "input": "hi", "metadata": {"k": "v"},
        "tools": [{"type": "function", "name": "f"}, {"type": "custom", "name": "patch"}]}));
    let engine = json!({"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant",
        "content": "sure", "reasoning_content": "hmm",
        "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}},
                       {"id": "t2", "type": "function", "function": {"name": "patch", "arguments": "{\"input\":\"P\"}"}}]}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}});
    let (r, kept) = answer(&c, engine);
    assert_eq!(r["id"], json!("resp_00ff"));
    assert_eq!(r["status"], json!("completed"));
    assert_eq!(r["metadata"], json!({"k": "v"}));
    let out = r["output"].as_array().cloned().unwrap_or_default();
    let types: Vec<&str> = out.iter().filter_map(|i| i["type"].as_str()).collect();
    assert_eq!(
        types,
        ["reasoning", "message", "function_call", "custom_tool_call"]
    );
    assert_eq!(out[1]["content"][0]["text"], json!("sure"));
    assert_eq!(out[2]["call_id"], json!("t1"));
    assert_eq!(out[2]["arguments"], json!("{\"a\":1}"));
    assert_eq!(out[3]["input"], json!("P"));
    assert_eq!(r["usage"]["input_tokens"], json!(5));
    assert_eq!(r["usage"]["output_tokens"], json!(7));
    let kept = kept.unwrap_or_else(|| panic!("store defaults to true"));
    assert_eq!(kept.id, "resp_00ff");
    let hist = kept.state["messages"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(hist.len(), 2);
    assert_eq!(
        hist[1]["tool_calls"][1]["function"]["arguments"],
        json!("{\"input\":\"P\"}")
    );

    let (_, c) = ok_request(json!({"input": "hi", "store": false}));
    let (r, kept) = answer(
        &c,
        json!({"choices": [{"finish_reason": "length", "message": {"content": "abc"}}]}),
    );
    assert_eq!(r["status"], json!("incomplete"));
    assert_eq!(
        r["incomplete_details"]["reason"],
        json!("max_output_tokens")
    );
    assert!(kept.is_none());
}

#[test]
fn previous_response_continues_the_conversation() {
    let (_, c) = ok_request(json!({"input": "one", "instructions": "I"}));
    let (_, kept) = answer(
        &c,
        json!({"choices": [{"finish_reason": "stop", "message": {"content": "two"}}]}),
    );
    let kept = kept.unwrap_or_else(|| panic!("kept"));
    let mut c2 = ctx();
    c2.history = Some(kept.state);
    let r = OpenAiResponses
        .engine_request(
            json!({"input": "three", "previous_response_id": "resp_00ff", "instructions": "J"}),
            &mut c2,
        )
        .unwrap_or_else(|e| panic!("{e}"));
    let m = Value::Object(r.body)["messages"].clone();
    assert_eq!(
        m,
        json!([
            {"role": "system", "content": "J"},
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "two"},
            {"role": "user", "content": "three"}
        ])
    );
}

#[test]
fn a_conversation_is_kept_continued_and_echoed() {
    // `store: false` does not drop a conversation's state: the next call of
    // the conversation continues from it.
    let body = json!({"input": "one", "conversation": {"id": "conv_1"}, "store": false});
    assert_eq!(
        OpenAiResponses.history_key(&body),
        Some(History::Conversation("conv_1".into()))
    );
    let (_, c) = ok_request(body);
    let (resp, kept) = answer(
        &c,
        json!({"choices": [{"finish_reason": "stop", "message": {"content": "two"}}]}),
    );
    assert_eq!(resp["conversation"], json!({"id": "conv_1"}));
    let kept = kept.unwrap_or_else(|| panic!("a conversation's response is kept"));
    let mut c2 = ctx();
    c2.history = Some(kept.state);
    let r = OpenAiResponses
        .engine_request(json!({"input": "three", "conversation": "conv_1"}), &mut c2)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        Value::Object(r.body)["messages"],
        json!([
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "two"},
            {"role": "user", "content": "three"}
        ])
    );
    // previous_response_id wins the history key; both at once is refused at the door.
    let both = json!({"input": "x", "conversation": "c", "previous_response_id": "resp_1"});
    assert_eq!(
        OpenAiResponses.history_key(&both),
        Some(History::Response("resp_1".into()))
    );
    let caps = crate::protocol::validate::Caps::default();
    let e = OpenAiResponses.check(both.as_object().unwrap_or(&Map::new()), &caps);
    assert!(e.is_err_and(|e| e.status == 400 && e.message.contains("not both")));
}

/// Engine chunks of a generation, split at the given cut points, in vLLM's
/// order (reasoning, content, tool calls), then the finish and usage chunks.
fn chunks(g: &Generated, cuts: &[usize]) -> Vec<Value> {
    let split = |s: &str| -> Vec<String> {
        let chars: Vec<char> = s.chars().collect();
        let mut parts = Vec::new();
        let mut start = 0;
        for &c in cuts {
            let end = (start + 1 + c % 5).min(chars.len());
            if end <= start {
                break;
            }
            parts.push(chars[start..end].iter().collect());
            start = end;
        }
        if start < chars.len() {
            parts.push(chars[start..].iter().collect());
        }
        parts
    };
    let mut out = vec![
        json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "prompt_token_ids": [1]}),
    ];
    let mut delta = |d: Value| out.push(json!({"choices": [{"index": 0, "delta": d}]}));
    if let Some(r) = &g.reasoning {
        for p in split(r) {
            delta(json!({"reasoning_content": p}));
        }
    }
    if let Some(t) = &g.text {
        for p in split(t) {
            delta(json!({"content": p}));
        }
    }
    for (i, c) in g.calls.iter().enumerate() {
        delta(
            json!({"tool_calls": [{"index": i, "id": c.id, "type": "function", "function": {"name": c.name}}]}),
        );
        for p in split(&c.arguments) {
            delta(json!({"tool_calls": [{"index": i, "function": {"arguments": p}}]}));
        }
    }
    out.push(json!({"choices": [{"index": 0, "delta": {}, "finish_reason": g.finish_reason}]}));
    out.push(json!({"choices": [], "usage": g.usage}));
    out
}

fn whole(g: &Generated) -> Value {
    let calls: Vec<Value> = g
        .calls
        .iter()
        .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
        .collect();
    let mut m = json!({"role": "assistant", "content": g.text});
    if let Some(r) = &g.reasoning {
        m["reasoning_content"] = json!(r);
    }
    if !calls.is_empty() {
        m["tool_calls"] = json!(calls);
    }
    json!({"choices": [{"index": 0, "message": m, "finish_reason": g.finish_reason}], "usage": g.usage})
}

/// Feeds engine chunks through a translator; returns every event (as JSON)
/// sent before commit and the held-back ones.
fn stream(c: &Ctx, chunks: &[Value]) -> (Vec<Value>, Vec<Value>, Option<Kept>) {
    let mut t = OpenAiResponses.translator(c);
    let mut raw = Vec::new();
    for ch in chunks {
        raw.extend_from_slice(format!("data: {ch}\n\n").as_bytes());
    }
    raw.extend_from_slice(b"data: [DONE]\n\n");
    let mut p = Parser::new();
    let mut out = Vec::new();
    for ev in p.feed(&raw).unwrap_or_default() {
        translate_event(t.as_mut(), &ev, &mut out);
    }
    let (held, kept) = t.finish();
    let parse = |b: &[u8]| -> Vec<Value> {
        let mut p = Parser::new();
        p.feed(b)
            .unwrap_or_default()
            .iter()
            .map(|e| serde_json::from_slice(&e.data).unwrap_or_default())
            .collect()
    };
    (parse(&out), parse(&held), kept)
}

fn generation() -> impl Strategy<Value = Generated> {
    let text = proptest::option::of("[a-z {}\"\\\\é\n]{1,20}");
    let call = (
        "[a-z]{1,3}",
        prop_oneof![Just("f"), Just("patch"), Just("ns.g")],
        "[a-z0-9{}\":, ]{0,30}",
    )
        .prop_map(|(id, name, arguments)| ToolCall {
            id: format!("t{id}"),
            name: name.to_string(),
            arguments,
        });
    (
        text.clone(),
        text,
        proptest::collection::vec(call, 0..3),
        prop_oneof![Just("stop"), Just("length"), Just("tool_calls")],
        0u64..50,
    )
        .prop_map(|(reasoning, text, calls, fr, n)| Generated {
            reasoning,
            text,
            calls,
            finish_reason: Some(fr.to_string()),
            usage: Some(
                json!({"prompt_tokens": n, "completion_tokens": n + 1, "total_tokens": 2 * n + 1}),
            ),
        })
}

fn tool_request() -> (EngineRequest, Ctx) {
    ok_request(json!({"model": "m", "input": "go", "tools": [
        {"type": "function", "name": "f"}, {"type": "custom", "name": "patch"},
        {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "g"}]}]}))
}

proptest! {
    #![proptest_config(crate::util::proptest_config(256))]

    /// Streamed and whole translations of the same generation agree: the
    /// held-back terminal event carries the very response the whole answer
    /// gives; sequence numbers count up from 0; deltas add up to the items.
    #[test]
    fn stream_equals_whole(g in generation(), cuts in proptest::collection::vec(0usize..10, 0..12)) {
        let (_, c) = tool_request();
        let (whole_resp, whole_kept) = answer(&c, whole(&g));
        let (sent, held, kept) = stream(&c, &chunks(&g, &cuts));
        prop_assert_eq!(held.len(), 1);
        let terminal = &held[0];
        let want_kind = if g.finish_reason.as_deref() == Some("length") { "response.incomplete" } else { "response.completed" };
        prop_assert_eq!(&terminal["type"], &json!(want_kind));
        prop_assert_eq!(&terminal["response"], &whole_resp);
        prop_assert_eq!(kept, whole_kept);
        let all: Vec<&Value> = sent.iter().chain(held.iter()).collect();
        for (i, ev) in all.iter().enumerate() {
            prop_assert_eq!(&ev["sequence_number"], &json!(i));
        }
        prop_assert_eq!(&all[0]["type"], &json!("response.created"));
        prop_assert_eq!(&all[1]["type"], &json!("response.in_progress"));
        let text: String = sent.iter().filter(|e| e["type"] == "response.output_text.delta").filter_map(|e| e["delta"].as_str()).collect();
        prop_assert_eq!(text, g.text.clone().unwrap_or_default());
        let done: Vec<Value> = sent.iter().filter(|e| e["type"] == "response.output_item.done").map(|e| e["item"].clone()).collect();
        prop_assert_eq!(&Value::Array(done), &whole_resp["output"]);
    }

    /// Arbitrary bytes never panic any parser of the adapter.
    #[test]
    fn adapter_parsers_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..400), json_ish in "[\\[\\]{}\":,a-z0-9 ]{0,200}") {
        for input in [&bytes[..], json_ish.as_bytes()] {
            if let Ok(v) = serde_json::from_slice::<Value>(input) {
                let _ = request(v);
            }
            let (_, c) = tool_request();
            let _ = OpenAiResponses.answer(StatusCode::OK, &Bytes::copy_from_slice(input), &c);
            let _ = OpenAiResponses.answer(StatusCode::BAD_REQUEST, &Bytes::copy_from_slice(input), &c);
            let mut t = OpenAiResponses.translator(&c);
            let mut p = Parser::new();
            let mut out = Vec::new();
            let mut framed = b"data: ".to_vec();
            framed.extend_from_slice(input);
            framed.extend_from_slice(b"\n\n");
            for ev in p.feed(&framed).unwrap_or_default() {
                translate_event(t.as_mut(), &ev, &mut out);
            }
            let _ = t.finish();
        }
    }

    /// Random chunk shapes (any JSON the engine might send) never panic the translator.
    #[test]
    fn translator_survives_odd_chunks(vals in proptest::collection::vec(arb_json(), 0..8)) {
        let (_, c) = tool_request();
        let mut t = OpenAiResponses.translator(&c);
        let mut p = Parser::new();
        let mut out = Vec::new();
        for v in &vals {
            let wrapped = json!({"choices": [{"index": 0, "delta": v, "finish_reason": null}]});
            for ev in p.feed(format!("data: {wrapped}\n\ndata: {v}\n\n").as_bytes()).unwrap_or_default() {
                translate_event(t.as_mut(), &ev, &mut out);
            }
        }
        let _ = t.finish();
        let _ = t.fail(&ApiError::internal("x"));
    }
}

fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        "[a-z_]{0,8}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::btree_map(
                prop_oneof![
                    Just("content".to_string()),
                    Just("tool_calls".to_string()),
                    Just("index".to_string()),
                    Just("function".to_string()),
                    Just("arguments".to_string()),
                    Just("reasoning".to_string()),
                    "[a-z]{1,4}"
                ],
                inner,
                0..4
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// One engine chunk as vLLM streams it: the delta, its logprobs and its token ids.
fn engine_chunk(delta: Value, finish: Value) -> Event {
    let chunk = json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
            "logprobs": {"content": [{"token": "x", "logprob": -0.25, "bytes": [120], "top_logprobs": []}]},
            "token_ids": [87]}]});
    let data = chunk.to_string().into_bytes();
    Event {
        raw: [b"data: ", &data[..], b"\n\n"].concat(),
        data,
    }
}

/// The frames the translator sends for one engine chunk.
fn frames(t: &mut dyn StreamTranslator, delta: Value) -> String {
    let mut out = Vec::new();
    assert!(translate_event(
        t,
        &engine_chunk(delta, Value::Null),
        &mut out
    ));
    String::from_utf8(out).unwrap_or_else(|e| panic!("{e}"))
}

/// The per-token frames, byte for byte (harnesses parse them as JSON, but
/// the bytes are what a recorded trace and a diff of two gateways see).
#[test]
fn per_token_frames_are_pinned() {
    let (_, c) = tool_request();
    let mut t = OpenAiResponses.translator(&c);
    let [thought, text, arguments] =
        crate::protocol::per_token_frames(|d| frames(t.as_mut(), d), "reasoning_content");
    assert_eq!(
        thought,
        "event: response.reasoning_text.delta\ndata: {\"item_id\":\"rs_00ff_0\",\"output_index\":0,\"content_index\":0,\"delta\":\" \\\"hm\\\"\\n\",\"type\":\"response.reasoning_text.delta\",\"sequence_number\":5}\n\n"
    );
    assert_eq!(
        text,
        "event: response.output_text.delta\ndata: {\"item_id\":\"msg_00ff_1\",\"output_index\":1,\"content_index\":0,\"delta\":\" thére\\t\",\"logprobs\":[],\"type\":\"response.output_text.delta\",\"sequence_number\":12}\n\n"
    );
    assert_eq!(
        arguments,
        "event: response.function_call_arguments.delta\ndata: {\"item_id\":\"fc_00ff_2\",\"output_index\":2,\"delta\":\"{\\\"a\\\": 1\",\"type\":\"response.function_call_arguments.delta\",\"sequence_number\":17}\n\n"
    );
}

/// `"error": null` is no error: the chunk translates (the capture records the
/// call as answered, so the harness is not told it failed).
#[test]
fn a_null_error_is_no_error() {
    let (_, c) = tool_request();
    let mut t = OpenAiResponses.translator(&c);
    let mut out = Vec::new();
    let data = br#"{"error":null,"choices":[{"index":0,"delta":{"content":"Hi"}}]}"#;
    let ev = Event {
        raw: [b"data: ", &data[..], b"\n\n"].concat(),
        data: data.to_vec(),
    };
    assert!(translate_event(t.as_mut(), &ev, &mut out));
    let s = String::from_utf8_lossy(&out);
    assert!(
        s.contains("response.output_text.delta") && !s.contains("failed"),
        "{s}"
    );
}
