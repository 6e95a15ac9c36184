//! What the gateway's in-process integration tests share: one HTTP/1 request
//! on a fresh connection, the authorized JSON call most tests make, an engine
//! stub served on loopback, and a served gateway that stops on request.

// Each test file is a crate of its own and uses only some of these.
#![allow(dead_code)]

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use lightning_gateway::{Config, GatewayError, Server};
use serde_json::Value;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;

/// `method path` with exactly `headers` and `body`: the status and the body's bytes.
pub async fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, Bytes) {
    let s = tokio::net::TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    tokio::spawn(conn);
    let mut req = Request::builder().method(method).uri(path);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
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
    (status, bytes)
}

/// `send`, the answer read as JSON (`Null` when it is not).
pub async fn raw(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, Value) {
    let (status, bytes) = send(addr, method, path, headers, body).await;
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// A JSON request as a client on this machine sends it (`Host: localhost`),
/// with `token` as its bearer key: the status and the body's bytes.
pub async fn call_bytes(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: &str,
    body: Value,
) -> (u16, Bytes) {
    let auth = format!("Bearer {token}");
    let headers = [
        ("host", "localhost"),
        ("content-type", "application/json"),
        ("authorization", auth.as_str()),
    ];
    send(addr, method, path, &headers, &body.to_string()).await
}

/// `call_bytes`, the answer read as JSON (`Null` when it is not).
pub async fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: &str,
    body: Value,
) -> (u16, Value) {
    let (status, bytes) = call_bytes(addr, method, path, token, body).await;
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// Serves `handler` (an engine stub) on a loopback port until the test ends.
pub async fn spawn_upstream<F, Fut>(handler: F) -> SocketAddr
where
    F: Fn(Request<Incoming>) -> Fut + Copy + Send + Sync + 'static,
    Fut: Future<Output = Result<Response<Full<Bytes>>, Infallible>> + Send + 'static,
{
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let addr = l.local_addr().unwrap_or_else(|e| panic!("{e}"));
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), service_fn(handler))
                    .await;
            });
        }
    });
    addr
}

/// A gateway served in this process.
pub struct Running {
    pub addr: SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), GatewayError>>,
}

/// Binds `cfg` and serves it until `Running::stop`.
pub async fn start(cfg: Config) -> Running {
    let server = Server::bind(cfg).await.unwrap_or_else(|e| panic!("{e}"));
    let addr = server.local_addr();
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(server.run(async move {
        let _ = rx.await;
    }));
    Running { addr, stop, task }
}

impl Running {
    /// Stops serving and waits until the store is flushed and closed.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}
