//! A static fake engine for the load benchmark: answers every POST with the same
//! precomputed vLLM-shaped body (1,000 prompt ids, 200 completion ids, 200
//! logprobs), as JSON or as an SSE stream when the request has `"stream":true`.
//! It does no work per request, so its own capacity is far above the gateway's.
//!
//! `cargo run --release -p lightning-gateway --example static_upstream -- PORT [COMPLETION_TOKENS] [unique]`
//! (default 200 completion tokens: one SSE event each when streamed).
//!
//! `unique` (the soak bench): a request whose body holds a nonce `#n=DIGITS#`
//! gets an answer of its own: the nonce, zero-padded to 10 digits, is the text
//! of the first completion token and the nonce itself its token id, so a
//! client can tell its answer from any other and the store's ids can be
//! checked byte for byte against what this engine sent.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::json;
use std::convert::Infallible;
use std::sync::Arc;

const PROMPT: usize = 1000;
/// Stand-ins for a request's nonce in `unique` mode (see the module doc).
const TEXT_SLOT: &str = "QQQQQQQQQQ";
const ID_SLOT: u32 = u32::MAX;

fn bodies(completion: usize, unique: bool) -> (Bytes, Bytes) {
    let prompt: Vec<u32> = (0..PROMPT as u32).map(|i| 1000 + i * 7 % 30000).collect();
    let mut ids: Vec<u32> = (0..completion as u32)
        .map(|i| 500 + i * 13 % 30000)
        .collect();
    let lp = |i: usize| -((i % 17) as f64) / 8.0;
    let mut tokens: Vec<&str> = vec!["x"; completion];
    if unique && completion > 0 {
        (ids[0], tokens[0]) = (ID_SLOT, TEXT_SLOT);
    }
    let content: String = tokens.concat();
    let whole = json!({
        "id": "chatcmpl-static", "object": "chat.completion", "created": 0, "model": "static",
        "prompt_token_ids": prompt,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": content, "tool_calls": []},
            "logprobs": {"content": (0..completion).map(|i| json!({"token": "x", "logprob": lp(i), "bytes": [120], "top_logprobs": []})).collect::<Vec<_>>()},
            "finish_reason": "length", "stop_reason": null, "token_ids": ids,
        }],
        "usage": {"prompt_tokens": PROMPT, "completion_tokens": completion, "total_tokens": PROMPT + completion},
    });
    let mut sse = String::new();
    let first = json!({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "static",
        "prompt_token_ids": prompt,
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null, "token_ids": []}]});
    sse.push_str(&format!("data: {first}\n\n"));
    for (i, id) in ids.iter().enumerate() {
        let c = json!({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "static",
            "choices": [{"index": 0, "delta": {"content": tokens[i]},
                "logprobs": {"content": [{"token": "x", "logprob": lp(i), "bytes": [120], "top_logprobs": []}]},
                "finish_reason": if i + 1 == completion { json!("length") } else { json!(null) }, "token_ids": [id]}]});
        sse.push_str(&format!("data: {c}\n\n"));
    }
    let usage = json!({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "static", "choices": [],
        "usage": {"prompt_tokens": PROMPT, "completion_tokens": completion, "total_tokens": PROMPT + completion}});
    sse.push_str(&format!("data: {usage}\n\ndata: [DONE]\n\n"));
    (Bytes::from(whole.to_string()), Bytes::from(sse))
}

/// The nonce of a request body (`#n=DIGITS#`), if any.
fn nonce(body: &[u8]) -> Option<u64> {
    let at = memchr::memmem::find(body, b"#n=")? + 3;
    let digits = body[at..].iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(&body[at..at + digits])
        .ok()?
        .parse()
        .ok()
}

/// The template with its slots filled by this nonce.
fn fill(template: &Bytes, n: u64) -> Bytes {
    let text = format!("{n:010}");
    let id = n.to_string();
    let mut out = Vec::with_capacity(template.len() + 16);
    let mut rest = &template[..];
    let slots: [(&[u8], &[u8]); 2] = [
        (TEXT_SLOT.as_bytes(), text.as_bytes()),
        (b"4294967295", id.as_bytes()),
    ];
    while let Some((at, from, to)) = slots
        .iter()
        .filter_map(|(from, to)| memchr::memmem::find(rest, from).map(|at| (at, *from, *to)))
        .min_by_key(|(at, _, _)| *at)
    {
        out.extend_from_slice(&rest[..at]);
        out.extend_from_slice(to);
        rest = &rest[at + from.len()..];
    }
    out.extend_from_slice(rest);
    Bytes::from(out)
}

async fn answer(
    req: Request<Incoming>,
    b: Arc<(Bytes, Bytes)>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let body = req
        .into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let stream = body.windows(13).any(|w| w == b"\"stream\":true");
    let (mut data, ct) = if stream {
        (b.1.clone(), "text/event-stream")
    } else {
        (b.0.clone(), "application/json")
    };
    if let Some(n) = nonce(&body) {
        data = fill(&data, n);
    }
    let mut r = Response::new(Full::new(data));
    r.headers_mut()
        .insert("content-type", hyper::header::HeaderValue::from_static(ct));
    Ok(r)
}

fn main() -> std::io::Result<()> {
    let port: u16 = std::env::args()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(18000);
    let completion: usize = std::env::args()
        .nth(2)
        .and_then(|p| p.parse().ok())
        .unwrap_or(200);
    let unique = std::env::args().nth(3).as_deref() == Some("unique");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let b = Arc::new(bodies(completion, unique));
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
        println!("READY {}", listener.local_addr()?.port());
        loop {
            let (s, _) = listener.accept().await?;
            let _ = s.set_nodelay(true);
            let b = b.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |r| answer(r, b.clone()));
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    })
}
