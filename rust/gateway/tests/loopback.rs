//! Loopback integration test: a tiny vLLM-shaped upstream, the gateway server,
//! and a hyper client, all in one process.

mod common;

use bytes::Bytes;
use common::{call_bytes, spawn_upstream, start};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use lightning_gateway::{Config, UpstreamConfig};
use serde_json::{json, Value};
use std::convert::Infallible;

async fn upstream(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let body = req
        .into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    // The gateway must have switched ids and logprobs on.
    assert_eq!(v["return_token_ids"], json!(true));
    assert_eq!(v["logprobs"], json!(true));
    let stream = v["stream"] == json!(true);
    let text = if stream {
        let mut s = String::new();
        s.push_str("data: {\"prompt_token_ids\":[1,2,3],\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"token_ids\":[]}]}\n\n");
        for (i, id) in [7u32, 8, 9].iter().enumerate() {
            let fin = if i == 2 { "\"stop\"" } else { "null" };
            s.push_str(&format!(
                "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t\"}},\"token_ids\":[{id}],\"logprobs\":{{\"content\":[{{\"token\":\"t\",\"logprob\":-0.5}}]}},\"finish_reason\":{fin}}}]}}\n\n"
            ));
        }
        s.push_str("data: [DONE]\n\n");
        s
    } else {
        json!({"object": "chat.completion", "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ttt"}, "token_ids": [7, 8, 9],
                "logprobs": {"content": [{"token": "t", "logprob": -0.5}, {"token": "t", "logprob": -0.25}, {"token": "t", "logprob": -0.125}]},
                "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}})
        .to_string()
    };
    Ok(Response::new(Full::new(Bytes::from(text))))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_json_and_streamed_calls_exactly() {
    let up = spawn_upstream(upstream).await;
    let dir = std::env::temp_dir().join(format!("lightning-loopback-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = Config {
        listen: "127.0.0.1:0".into(),
        upstreams: vec![UpstreamConfig {
            url: format!("http://{up}/v1"),
            weight_version: 5,
            engine: Default::default(),
        }],
        db: dir.join("t.db"),
        admin_key: Some("admin-key-123".into()),
        ..Config::default()
    };
    let gw = start(cfg).await;
    let addr = gw.addr;

    let (s, b) = call_bytes(
        addr,
        "POST",
        "/rollouts",
        "admin-key-123",
        json!({"task": {"q": 1}}),
    )
    .await;
    assert_eq!(s, 201);
    let r: Value = serde_json::from_slice(&b).unwrap_or(Value::Null);
    let id = r["rollout_id"].as_str().unwrap_or_default().to_string();
    let token = r["token"].as_str().unwrap_or_default().to_string();
    // One URL per client family: OpenAI clients take `.../v1`, Anthropic
    // clients append `/v1/messages` themselves.
    assert_eq!(
        r["base_url"],
        json!(format!("http://{addr}/rollouts/{id}/v1"))
    );
    assert_eq!(
        r["anthropic_base_url"],
        json!(format!("http://{addr}/rollouts/{id}"))
    );

    let msgs = json!([{"role": "user", "content": "hi"}]);
    let path = format!("/rollouts/{id}/v1/chat/completions");
    let (s, b) = call_bytes(
        addr,
        "POST",
        &path,
        &token,
        json!({"model": "m", "messages": msgs}),
    )
    .await;
    assert_eq!(s, 200);
    assert!(String::from_utf8_lossy(&b).contains("\"token_ids\":[7,8,9]"));
    let (s, b) = call_bytes(
        addr,
        "POST",
        &path,
        &token,
        json!({"model": "m", "messages": msgs, "stream": true}),
    )
    .await;
    assert_eq!(s, 200);
    let text = String::from_utf8_lossy(&b).to_string();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");

    let (s, b) = call_bytes(
        addr,
        "GET",
        &format!("/rollouts/{id}/trace"),
        &token,
        Value::Null,
    )
    .await;
    assert_eq!(s, 200);
    let t: Value = serde_json::from_slice(&b).unwrap_or(Value::Null);
    let calls = t["calls"].as_array().cloned().unwrap_or_default();
    assert_eq!(calls.len(), 2);
    for c in &calls {
        assert_eq!(c["prompt_ids"], json!([1, 2, 3]));
        assert_eq!(c["completion_ids"], json!([7, 8, 9]));
        assert_eq!(c["status"], json!("ok"));
        assert_eq!(c["weight_version"], json!(5));
    }
    assert_eq!(calls[0]["logprobs"], json!([-0.5, -0.25, -0.125]));
    assert_eq!(calls[0]["flags"], json!([]));

    // Another rollout's token may not read this trace.
    let (_, b2) = call_bytes(addr, "POST", "/rollouts", "admin-key-123", json!({})).await;
    let other: Value = serde_json::from_slice(&b2).unwrap_or(Value::Null);
    let other_token = other["token"].as_str().unwrap_or_default().to_string();
    let (s, b) = call_bytes(
        addr,
        "GET",
        &format!("/rollouts/{id}/trace"),
        &other_token,
        Value::Null,
    )
    .await;
    assert_eq!(s, 403);
    let e: Value = serde_json::from_slice(&b).unwrap_or(Value::Null);
    assert_eq!(e["error"]["code"], json!("wrong_rollout"));

    gw.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}
