//! The least an HTTP hop can cost, for the load benchmark's floor: a reverse
//! proxy that forwards each request to one upstream and answers with what came
//! back, built like the gateway (hyper 1.x server, hyper-util's pooled client
//! with `TCP_NODELAY`, a multi-thread runtime with one worker) but with no
//! routing, auth, parsing, translation or store. A JSON answer is read whole
//! before it is sent on, as the gateway must to record it; a stream is passed
//! through frame by frame.
//!
//! `cargo run --release -p lightning-gateway --example bare_proxy -- PORT UPSTREAM_URL`
//! (`UPSTREAM_URL` like `http://127.0.0.1:18000`; prints `READY PORT`).

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};

type Body = BoxBody<Bytes, hyper::Error>;
type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn fail(status: StatusCode, message: String) -> Response<Body> {
    let mut r = Response::new(
        Full::new(Bytes::from(message))
            .map_err(|never| match never {})
            .boxed(),
    );
    *r.status_mut() = status;
    r
}

async fn forward(
    req: Request<Incoming>,
    client: HttpClient,
    upstream: Arc<str>,
) -> Result<Response<Body>, Infallible> {
    let (parts, body) = req.into_parts();
    let body = match body.collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return Ok(fail(StatusCode::BAD_REQUEST, e.to_string())),
    };
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let uri: Uri = match format!("{upstream}{path}").parse() {
        Ok(u) => u,
        Err(e) => return Ok(fail(StatusCode::BAD_GATEWAY, e.to_string())),
    };
    let mut out = Request::new(Full::new(body));
    *out.method_mut() = parts.method;
    *out.uri_mut() = uri;
    if let Some(ct) = parts.headers.get(hyper::header::CONTENT_TYPE) {
        out.headers_mut()
            .insert(hyper::header::CONTENT_TYPE, ct.clone());
    }
    let resp = match client.request(out).await {
        Ok(r) => r,
        Err(e) => return Ok(fail(StatusCode::BAD_GATEWAY, e.to_string())),
    };
    let (parts, body) = resp.into_parts();
    let stream = parts
        .headers
        .get(hyper::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    let body = if stream {
        body.boxed()
    } else {
        match body.collect().await {
            Ok(b) => Full::new(b.to_bytes())
                .map_err(|never| match never {})
                .boxed(),
            Err(e) => return Ok(fail(StatusCode::BAD_GATEWAY, e.to_string())),
        }
    };
    Ok(Response::from_parts(parts, body))
}

fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let port: u16 = args.next().and_then(|p| p.parse().ok()).unwrap_or(18100);
    let upstream: Arc<str> = args
        .next()
        .unwrap_or_else(|| "http://127.0.0.1:18000".into())
        .trim_end_matches('/')
        .into();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client: HttpClient = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(1024)
            .build(connector);
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
        println!("READY {}", listener.local_addr()?.port());
        loop {
            let (s, _) = listener.accept().await?;
            let _ = s.set_nodelay(true);
            let (client, upstream) = (client.clone(), upstream.clone());
            tokio::spawn(async move {
                let svc = service_fn(move |r| forward(r, client.clone(), upstream.clone()));
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    })
}
