//! A Messages `tool_use` re-sent after a gateway restart carries the engine's
//! own argument text: the gateway recovers it from the store, so the re-sent
//! prompt extends the first call's prompt and completion (one sample).

mod common;

use bytes::Bytes;
use common::{call, spawn_upstream, start};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use lightning_gateway::{Config, UpstreamConfig};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Mutex;

/// The engine's argument text: not what re-serialising the value gives.
const ARGS: &str = "{\"city\": \"Paris\"}";

static SEEN: Mutex<Vec<Value>> = Mutex::new(Vec::new());

async fn upstream(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let body = req
        .into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    SEEN.lock().unwrap_or_else(|p| p.into_inner()).push(v);
    let message = json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "call_7", "type": "function", "function": {"name": "weather", "arguments": ARGS}}]});
    let text = json!({"object": "chat.completion", "prompt_token_ids": [1, 2, 3],
        "choices": [{"index": 0, "message": message, "token_ids": [7, 8],
            "logprobs": {"content": [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -0.5}]},
            "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
    .to_string();
    Ok(Response::new(Full::new(Bytes::from(text))))
}

fn config(up: SocketAddr, db: &std::path::Path) -> Config {
    Config {
        listen: "127.0.0.1:0".into(),
        upstreams: vec![UpstreamConfig {
            url: format!("http://{up}/v1"),
            weight_version: 1,
            engine: Default::default(),
        }],
        db: db.to_path_buf(),
        admin_key: Some("admin-key-123".into()),
        ..Config::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_use_resent_after_a_restart_keeps_the_engine_text() {
    let up = spawn_upstream(upstream).await;
    let dir = std::env::temp_dir().join(format!("lightning-toolargs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let db = dir.join("t.db");

    let gw = start(config(up, &db)).await;
    let addr = gw.addr;
    let (s, r) = call(
        addr,
        "POST",
        "/rollouts",
        "admin-key-123",
        json!({"task": {}}),
    )
    .await;
    assert_eq!(s, 201, "{r}");
    let id = r["rollout_id"].as_str().unwrap_or_default().to_string();
    let token = r["token"].as_str().unwrap_or_default().to_string();
    let path = format!("/rollouts/{id}/v1/messages");
    let tools = json!([{"name": "weather", "input_schema": {"type": "object"}}]);
    let user = json!({"role": "user", "content": "weather?"});
    let (s, m) = call(
        addr,
        "POST",
        &path,
        &token,
        json!({"model": "m", "max_tokens": 64, "tools": tools, "messages": [user]}),
    )
    .await;
    assert_eq!(s, 200, "{m}");
    assert_eq!(m["content"][0]["type"], json!("tool_use"), "{m}");
    gw.stop().await;

    // A fresh gateway on the same store: nothing in memory.
    let gw = start(config(up, &db)).await;
    let addr = gw.addr;
    let assistant = json!({"role": "assistant", "content": m["content"]});
    let result = json!({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": m["content"][0]["id"], "content": "sunny"}]});
    let (s, r) = call(
        addr,
        "POST",
        &path,
        &token,
        json!({"model": "m", "max_tokens": 64, "tools": tools,
            "messages": [user, assistant, result]}),
    )
    .await;
    assert_eq!(s, 200, "{r}");
    gw.stop().await;
    let _ = std::fs::remove_dir_all(&dir);

    let seen = SEEN.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert_eq!(seen.len(), 2);
    let resent = &seen[1]["messages"][1]["tool_calls"][0];
    assert_eq!(resent["id"], json!("call_7"), "{}", seen[1]);
    assert_eq!(resent["function"]["arguments"], json!(ARGS), "{}", seen[1]);
}
