//! A Messages `tool_use` re-sent after a gateway restart carries the engine's
//! own argument text: the gateway recovers it from the store, so the re-sent
//! prompt extends the first call's prompt and completion (one sample).

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use lightning_gateway::{Config, Server, UpstreamConfig};
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

async fn spawn_upstream() -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let addr = l.local_addr().unwrap_or_else(|e| panic!("{e}"));
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), service_fn(upstream))
                    .await;
            });
        }
    });
    addr
}

async fn call(addr: SocketAddr, path: &str, token: &str, body: Value) -> (u16, Value) {
    let s = tokio::net::TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    tokio::spawn(conn);
    let req = Request::builder()
        .method("POST")
        .uri(path)
        .header("host", "localhost")
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {token}"))
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap_or_else(|e| panic!("{e}"));
    let resp = send
        .send_request(req)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let status = resp.status().as_u16();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

type Running = (
    SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), lightning_gateway::GatewayError>>,
);

async fn start(up: SocketAddr, db: &std::path::Path) -> Running {
    let cfg = Config {
        listen: "127.0.0.1:0".into(),
        upstreams: vec![UpstreamConfig {
            url: format!("http://{up}/v1"),
            weight_version: 1,
            engine: Default::default(),
        }],
        db: db.to_path_buf(),
        admin_key: Some("admin-key-123".into()),
        ..Config::default()
    };
    let server = Server::bind(cfg).await.unwrap_or_else(|e| panic!("{e}"));
    let addr = server.local_addr();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(server.run(async move {
        let _ = rx.await;
    }));
    (addr, tx, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_use_resent_after_a_restart_keeps_the_engine_text() {
    let up = spawn_upstream().await;
    let dir = std::env::temp_dir().join(format!("lightning-toolargs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let db = dir.join("t.db");

    let (addr, stop, task) = start(up, &db).await;
    let (s, r) = call(addr, "/rollouts", "admin-key-123", json!({"task": {}})).await;
    assert_eq!(s, 201, "{r}");
    let id = r["rollout_id"].as_str().unwrap_or_default().to_string();
    let token = r["token"].as_str().unwrap_or_default().to_string();
    let path = format!("/rollouts/{id}/v1/messages");
    let tools = json!([{"name": "weather", "input_schema": {"type": "object"}}]);
    let user = json!({"role": "user", "content": "weather?"});
    let (s, m) = call(
        addr,
        &path,
        &token,
        json!({"model": "m", "max_tokens": 64, "tools": tools, "messages": [user]}),
    )
    .await;
    assert_eq!(s, 200, "{m}");
    assert_eq!(m["content"][0]["type"], json!("tool_use"), "{m}");
    let _ = stop.send(());
    let _ = task.await;

    // A fresh gateway on the same store: nothing in memory.
    let (addr, stop, task) = start(up, &db).await;
    let assistant = json!({"role": "assistant", "content": m["content"]});
    let result = json!({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": m["content"][0]["id"], "content": "sunny"}]});
    let (s, r) = call(
        addr,
        &path,
        &token,
        json!({"model": "m", "max_tokens": 64, "tools": tools,
            "messages": [user, assistant, result]}),
    )
    .await;
    assert_eq!(s, 200, "{r}");
    let _ = stop.send(());
    let _ = task.await;
    let _ = std::fs::remove_dir_all(&dir);

    let seen = SEEN.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert_eq!(seen.len(), 2);
    let resent = &seen[1]["messages"][1]["tool_calls"][0];
    assert_eq!(resent["id"], json!("call_7"), "{}", seen[1]);
    assert_eq!(resent["function"]["arguments"], json!(ARGS), "{}", seen[1]);
}
