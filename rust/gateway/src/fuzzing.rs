//! Fuzz entry points: one function per surface that reads bytes from outside
//! the gateway, each checking the properties that must hold for *any* input
//! (not only "no panic"). Two drivers call them:
//! - `rust/gateway/fuzz` (cargo-fuzz, nightly): coverage-guided long runs by hand;
//! - `cargo test` (stable, in `make test`): a bounded proptest run per target,
//!   plus a replay of every input under `rust/gateway/fuzz/regressions/`, so a
//!   crash found once stays fixed.
//!
//! Memory stays bounded because every output is checked against the input's
//! size: a parser that allocated per byte of *claimed* length (not of data
//! present) would fail these checks long before it exhausted memory.

// A broken property must stop the fuzzer with the input that broke it: here
// panicking is the report, as in a test.
#![allow(clippy::expect_used, clippy::panic)]

use bytes::Bytes;
use hyper::StatusCode;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::protocol::{translate_event, Answer, Ctx, Protocol};
use crate::routes::{CHAT, COMPLETIONS, MESSAGES, RESPONSES};
use crate::store::columnar;
use crate::store::{blob_to_f32s, blob_to_ids, StoredCall};
use crate::wire::engine::{parse_answer, Kind, StreamCapture};
use crate::wire::sse::Parser;

/// One fuzz target: any bytes in, a panic when a property breaks.
pub type Target = fn(&[u8]);

/// The fuzz targets by name (the cargo-fuzz binaries and the regression
/// folders use these names).
pub const TARGETS: [(&str, Target); 5] = [
    ("sse_framing", sse_framing),
    ("engine_answer", engine_answer),
    ("harness_request", harness_request),
    ("engine_to_harness", engine_to_harness),
    ("stored_trace", stored_trace),
];

static ADAPTERS: [&dyn Protocol; 4] = [&CHAT, &COMPLETIONS, &RESPONSES, &MESSAGES];

/// A harness request each adapter accepts (sets up the answer side's state).
fn valid_request(adapter: usize) -> Value {
    match adapter {
        0 => json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        1 => json!({"model": "m", "prompt": "hi"}),
        2 => json!({"model": "m", "input": "go", "tools": [{"type": "function", "name": "f"}]}),
        _ => {
            json!({"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}],
                    "tools": [{"name": "f", "input_schema": {"type": "object"}}]})
        }
    }
}

/// Splits a fuzz input into a selector byte and the rest.
fn split(data: &[u8]) -> (u8, &[u8]) {
    match data.split_first() {
        Some((&first, rest)) => (first, rest),
        None => (0, &[]),
    }
}

/// SSE framing: the same bytes framed in one read or cut at any point give the
/// same events and the same remainder; no event holds more bytes than came in.
pub fn sse_framing(data: &[u8]) {
    let (cut, stream) = split(data);
    let cut = usize::from(cut).min(stream.len());
    let mut whole = Parser::with_limit(256);
    let mut pieces = Parser::with_limit(256);
    let a = whole.feed(stream);
    let b = pieces.feed(&stream[..cut]).and_then(|mut first| {
        pieces.feed(&stream[cut..]).map(|rest| {
            first.extend(rest);
            first
        })
    });
    match (a, b) {
        (Ok(a), Ok(b)) => {
            let raw = |evs: &[crate::wire::sse::Event]| -> Vec<(Vec<u8>, Vec<u8>)> {
                evs.iter()
                    .map(|e| (e.raw.clone(), e.data.clone()))
                    .collect()
            };
            assert_eq!(raw(&a), raw(&b), "framing depends on where reads split");
            assert_eq!(whole.remainder(), pieces.remainder());
            let total: usize = a.iter().map(|e| e.raw.len()).sum();
            assert!(total + whole.remainder().len() <= stream.len());
            assert!(a.iter().all(|e| e.data.len() <= e.raw.len()));
        }
        // An event over the limit is refused however the bytes arrive.
        (Err(_), Err(_)) => {}
        (a, b) => panic!(
            "one framing refused, the other did not: {:?} vs {:?}",
            a.is_ok(),
            b.is_ok()
        ),
    }
}

/// Engine answers, whole and streamed: never more ids or logprobs than the
/// input has bytes, and a stream fed event by event never panics.
pub fn engine_answer(data: &[u8]) {
    if let Ok(capture) = parse_answer(data) {
        let ids: usize = capture.prompt_ids.as_ref().map_or(0, Vec::len)
            + capture
                .choices
                .iter()
                .map(|c| {
                    c.prompt_ids.as_ref().map_or(0, Vec::len)
                        + c.completion_ids.as_ref().map_or(0, Vec::len)
                        + c.logprobs.as_ref().map_or(0, Vec::len)
                })
                .sum::<usize>();
        assert!(
            ids <= data.len(),
            "{ids} values out of {} bytes",
            data.len()
        );
    }
    let mut parser = Parser::new();
    let mut capture = StreamCapture::new();
    for ev in parser.feed(data).unwrap_or_default() {
        if !ev.is_done() {
            capture.feed(&ev.data);
        }
    }
    // Each line of the input as one event's data as well (the common shape).
    for line in data.split(|&b| b == b'\n') {
        capture.feed(line);
    }
}

/// The request-body rewriters of every adapter: what they accept always asks
/// the engine for token ids and logprobs when captured, carries the mode's
/// temperature, and serializes.
pub fn harness_request(data: &[u8]) {
    let (sel, body) = split(data);
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return;
    };
    let adapter = ADAPTERS[usize::from(sel) % ADAPTERS.len()];
    let want_ids = sel & 0x10 != 0;
    let temperature = (sel & 0x20 != 0).then_some(1.0);
    let mut ctx = Ctx {
        want_ids,
        temperature,
        call_id: "call-fuzz".into(),
        ..Default::default()
    };
    let Ok(req) = adapter.engine_request(v, &mut ctx) else {
        return;
    };
    let bytes = serde_json::to_vec(&req.body).expect("an engine request always serializes");
    assert!(!bytes.is_empty());
    if want_ids {
        assert_eq!(
            req.body.get("return_token_ids"),
            Some(&Value::Bool(true)),
            "{}",
            adapter.name()
        );
        match req.kind {
            Kind::Chat => assert_eq!(req.body.get("logprobs"), Some(&Value::Bool(true))),
            Kind::Completion => assert!(req.body.get("logprobs").is_some_and(Value::is_u64)),
        }
    }
    if let Some(t) = temperature {
        assert_eq!(req.body.get("temperature").and_then(Value::as_f64), Some(t));
    }
}

/// Engine answers through every adapter's answer side, whole and streamed:
/// the Responses and Messages adapters write their own JSON, so every body
/// and every SSE frame they emit parses as JSON, whatever the engine sent.
pub fn engine_to_harness(data: &[u8]) {
    let (sel, engine) = split(data);
    let i = usize::from(sel) % ADAPTERS.len();
    let adapter = ADAPTERS[i];
    let mut ctx = Ctx {
        want_ids: true,
        call_id: "call-fuzz".into(),
        ..Default::default()
    };
    adapter
        .engine_request(valid_request(i), &mut ctx)
        .expect("the fixed request is valid");
    let writes_json = i >= 2;
    let status = if sel & 0x80 != 0 {
        StatusCode::BAD_GATEWAY
    } else {
        StatusCode::OK
    };
    if let (Answer::Json { body, .. }, _) =
        adapter.answer(status, &Bytes::copy_from_slice(engine), &ctx)
    {
        assert!(
            serde_json::from_slice::<Value>(&body).is_ok(),
            "{} wrote a non-JSON body",
            adapter.name()
        );
    }
    let mut t = adapter.translator(&ctx);
    let mut out = Vec::new();
    for ev in Parser::new().feed(engine).unwrap_or_default() {
        // As the pipeline: a chunk that does not read ends the stream.
        if !translate_event(t.as_mut(), &ev, &mut out) {
            break;
        }
    }
    let (last, _) = t.finish();
    out.extend_from_slice(&last);
    out.extend_from_slice(&t.fail(&ApiError::internal("fuzz: the stream failed")));
    if writes_json {
        let mut p = Parser::new();
        let frames = p
            .feed(&out)
            .expect("adapter frames stay under the event limit");
        assert!(
            p.remainder().is_empty(),
            "{} left a frame unterminated",
            adapter.name()
        );
        for f in frames {
            assert!(
                serde_json::from_slice::<Value>(&f.data).is_ok(),
                "{} sent a non-JSON frame: {:?}",
                adapter.name(),
                String::from_utf8_lossy(&f.data)
            );
        }
    }
}

/// Stored trace blobs (ids and logprobs as read back from SQLite, whatever
/// their length) into a training call and the columnar trace form: logprobs
/// line up with the completion, and the columnar bytes are exactly the
/// header plus four bytes per value.
pub fn stored_trace(data: &[u8]) {
    let (sel, rest) = split(data);
    let a = (usize::from(sel) * 4).min(rest.len());
    let b = (a + rest.len().saturating_sub(a) / 2).min(rest.len());
    let (prompt, completion, logprobs) = (
        blob_to_ids(&rest[..a]),
        blob_to_ids(&rest[a..b]),
        blob_to_f32s(&rest[b..]),
    );
    let call = StoredCall {
        seq: i64::from(sel),
        request_id: "req".into(),
        choice_index: 0,
        kind: "chat".into(),
        prompt_ids: Some(prompt),
        completion_ids: Some(completion),
        logprobs: (sel & 1 == 0).then_some(logprobs),
        finish_reason: None,
        text: Some(String::from_utf8_lossy(rest).into_owned()),
        status: "ok".into(),
        flags: vec![],
        delivered: true,
        retry_count: 0,
        weight_version: 1,
        upstream: "u".into(),
        http_status: 200,
        latency_ms: 0.0,
        usage: None,
        created: 0.0,
    };
    let encoded = columnar::encode("ro-fuzz", std::slice::from_ref(&call));
    let header_len = u32::from_le_bytes(encoded[8..12].try_into().expect("4 bytes")) as usize;
    let header: Value =
        serde_json::from_slice(&encoded[12..12 + header_len]).expect("header is JSON");
    let np = header["calls"][0]["prompt_len"]
        .as_u64()
        .expect("prompt_len") as usize;
    let nc = header["calls"][0]["completion_len"]
        .as_u64()
        .expect("completion_len") as usize;
    assert_eq!(encoded.len(), 12 + header_len + 4 * (np + 2 * nc));
    let rollout = crate::store::RolloutRecord {
        rollout_id: "ro-fuzz".into(),
        group: None,
        task: "null".into(),
        mode: "train".into(),
        status: "running".into(),
        reward: None,
        created: 0.0,
        updated: 0.0,
    };
    if let Some(c) = crate::store::reader::trainable(&rollout, call) {
        if let Some(l) = &c.logprobs {
            assert_eq!(l.len(), c.completion_ids.len());
        }
        assert!(!c.completion_ids.is_empty());
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use std::path::Path;

    /// The fuzzers' seeds (realistic inputs) hold every property, and every
    /// input a long fuzz run found (and we fixed) stays fixed.
    #[test]
    fn seeds_and_regressions_replay() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
        for folder in ["seeds", "regressions"] {
            let mut replayed = 0;
            for (name, target) in super::TARGETS {
                let Ok(dir) = std::fs::read_dir(root.join(folder).join(name)) else {
                    continue;
                };
                for entry in dir {
                    let path = entry.expect("readable folder").path();
                    target(&std::fs::read(&path).expect("readable input"));
                    replayed += 1;
                }
            }
            assert!(
                replayed > 0,
                "no inputs under {}",
                root.join(folder).display()
            );
        }
    }

    /// Seeds bias the bounded run towards inputs that get past the parsers.
    fn near_valid() -> impl Strategy<Value = Vec<u8>> {
        let pieces = prop::sample::select(vec![
            &b"data: "[..],
            b"\n\n",
            b"\r\n",
            b"{\"choices\":[{",
            b"\"delta\":{\"content\":\"x\"}",
            b"\"token_ids\":[1,2]",
            b"\"logprobs\":{\"content\":[{\"logprob\":-0.5}]}",
            b"\"finish_reason\":\"stop\"",
            b"\"tool_calls\":[{\"index\":0,\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]",
            b"}]}",
            b"[DONE]",
            b",",
            b"\"prompt_token_ids\":[3]",
            b"\"error\":{\"message\":\"x\"}",
            b"\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]",
            b"\"input\":\"go\"",
            b"\"model\":\"m\"",
            b"\"stream\":true",
            b"\"max_tokens\":4",
            b"{",
            b"}",
            b"\xff",
        ]);
        (any::<u8>(), prop::collection::vec(pieces, 0..24)).prop_map(|(sel, ps)| {
            let mut v = vec![sel];
            for p in ps {
                v.extend_from_slice(p);
            }
            v
        })
    }

    proptest! {
        #![proptest_config(crate::util::proptest_config(256))]

        #[test]
        fn every_target_holds_on_bytes(data in prop::collection::vec(any::<u8>(), 0..300)) {
            for (_, target) in super::TARGETS {
                target(&data);
            }
        }

        #[test]
        fn every_target_holds_on_near_valid_input(data in near_valid()) {
            for (_, target) in super::TARGETS {
                target(&data);
            }
        }
    }
}
