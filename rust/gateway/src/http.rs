//! HTTP helpers shared by the routes and the proxy: body type, JSON and error
//! responses, body reading with a size limit, credentials, query strings.

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{
    HeaderMap, HeaderValue, AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE, RETRY_AFTER,
};
use hyper::{Request, Response, StatusCode};
use serde_json::{json, Value};
use std::collections::HashMap;

use crate::error::ApiError;

pub type Body = BoxBody<Bytes, std::io::Error>;

pub fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).map_err(|never| match never {}).boxed()
}

pub fn json_response(status: u16, v: &Value) -> Response<Body> {
    json_bytes_response(
        StatusCode::from_u16(status).unwrap_or(StatusCode::OK),
        Bytes::from(v.to_string()),
    )
}

pub fn json_bytes_response(status: StatusCode, body: Bytes) -> Response<Body> {
    let mut r = Response::new(full(body));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// An error in OpenAI's shape (the gateway's own routes and chat/completions).
pub fn error_response(e: &ApiError) -> Response<Body> {
    error_response_with(e, Bytes::from(e.body()))
}

/// An error with a body in some protocol's own shape; status and `Retry-After` from `e`.
pub fn error_response_with(e: &ApiError, body: Bytes) -> Response<Body> {
    let mut r = json_bytes_response(
        StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        body,
    );
    if let Some(s) = e.retry_after {
        if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
            r.headers_mut().insert(RETRY_AFTER, v);
        }
    }
    r
}

/// Which names a request may give in `Host` (DNS rebinding: a page of any
/// origin whose name an attacker resolves to this machine's address reaches
/// the service with its own name in `Host`; an admin key does not help when
/// the service runs without one, and the harness routes take rollout tokens a
/// page can learn). Served, with any port:
/// - `localhost` and loopback IP literals (`127.0.0.0/8`, `[::1]`);
/// - the listen host, unless it is an unspecified address (`0.0.0.0`, `[::]`);
/// - the address the connection actually reached (a `0.0.0.0` listener
///   called at `http://192.168.1.5:8080` sees `192.168.1.5`): a page can only
///   send an IP literal as `Host` when its own origin is that address;
/// - the host of `public_url` (the base URL harnesses are handed);
/// - each name in `allowed_hosts` (case-insensitive; `*` serves any name).
///
/// A request without `Host` (HTTP/1.0, never a browser) passes.
#[derive(Debug, Clone)]
pub struct HostRule {
    listen: String,
    names: Vec<String>,
    any: bool,
}

/// The name part of a `Host` value or a `host:port`: `[::1]:80` → `::1`, `a:80` → `a`.
pub fn host_name(value: &str) -> &str {
    let v = value.trim();
    if let Some(rest) = v.strip_prefix('[') {
        return rest.split(']').next().unwrap_or("");
    }
    match v.rsplit_once(':') {
        // One colon: `name:port`; more: a bare IPv6 literal.
        Some((h, _)) if !h.contains(':') => h,
        _ => v,
    }
}

impl HostRule {
    pub fn new(listen: &str, public_url: Option<&str>, allowed: &[String]) -> HostRule {
        let mut names = Vec::new();
        let mut add = |n: &str| {
            let n = n.trim().to_ascii_lowercase();
            let unspecified = n
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_unspecified());
            if !n.is_empty() && !unspecified && !names.contains(&n) {
                names.push(n);
            }
        };
        add(host_name(listen));
        if let Some(url) = public_url {
            let rest = url.split_once("://").map_or(url, |(_, r)| r);
            let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
            let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
            add(host_name(authority));
        }
        let mut any = false;
        for a in allowed {
            if a.trim() == "*" {
                any = true;
            } else {
                add(host_name(a));
            }
        }
        HostRule {
            listen: listen.to_string(),
            names,
            any,
        }
    }

    /// `Ok` when `headers`' `Host` is served; `local` is the IP the
    /// connection reached (None where unknown).
    pub fn check(
        &self,
        headers: &HeaderMap,
        local: Option<std::net::IpAddr>,
    ) -> Result<(), ApiError> {
        if self.any {
            return Ok(());
        }
        let Some(v) = headers.get(hyper::header::HOST) else {
            return Ok(());
        };
        let given = v.to_str().unwrap_or("").trim();
        let name = host_name(given);
        // `[::]` listeners see IPv4 clients as `::ffff:a.b.c.d`.
        let ip = name
            .parse::<std::net::IpAddr>()
            .ok()
            .map(|ip| ip.to_canonical());
        let local = local.map(|ip| ip.to_canonical());
        let ok = name.eq_ignore_ascii_case("localhost")
            || ip.is_some_and(|ip| ip.is_loopback() || Some(ip) == local)
            || self.names.iter().any(|n| n.eq_ignore_ascii_case(name));
        if ok {
            return Ok(());
        }
        let named = if self.names.is_empty() {
            String::new()
        } else {
            format!(", {}", self.names.join(", "))
        };
        Err(ApiError::new(
            403,
            "permission_error",
            "host_not_allowed",
            format!(
                "this gateway (listening on {}) answers only requests addressed to localhost, a loopback address, the address it was reached at{named}; not Host {given:?} (a page of another site can point its name at this machine). Call it by one of those, or add the name with --allowed-host NAME (allowed_hosts in the config, LIGHTNING_ALLOWED_HOSTS)",
                self.listen
            ),
        ))
    }
}

/// A request with a body must say it is JSON (`application/json`, any
/// parameters): a page of another origin can POST `text/plain` without the
/// browser asking the server first (no CORS preflight), and a body read as
/// JSON whatever its type lets it drive the admin routes blind.
pub fn json_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    let given = headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let media = given.split(';').next().unwrap_or("").trim();
    if media.eq_ignore_ascii_case("application/json") {
        return Ok(());
    }
    Err(ApiError::new(
        415,
        "invalid_request_error",
        "unsupported_media_type",
        format!("the request body must be JSON sent with `Content-Type: application/json`, not {given:?}"),
    ))
}

/// The credential a client sent: `Authorization: Bearer <key>` (OpenAI SDKs)
/// or `x-api-key: <key>` (Anthropic SDKs). Bearer wins when both are present.
pub fn api_key(headers: &HeaderMap) -> Option<&str> {
    bearer(headers).or_else(|| {
        let v = headers.get("x-api-key")?.to_str().ok()?.trim();
        (!v.is_empty()).then_some(v)
    })
}

pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(AUTHORIZATION)?.to_str().ok()?.trim_start();
    // The scheme is case-insensitive (RFC 9110 §11.1): `BEARER x` is a bearer token.
    let (scheme, rest) = v.split_once([' ', '\t'])?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let t = rest.trim();
    if t.is_empty() {
        None
    } else {
        Some(t)
    }
}

/// Reads a request body, refusing more than `limit` bytes (413), a client
/// silent for `idle` between two pieces of it (408) and one that takes longer
/// than `total` for all of it, however steadily it trickles (408): a slow
/// body must not hold a call slot without end.
pub async fn read_body(
    limit: usize,
    idle: std::time::Duration,
    total: std::time::Duration,
    req: Request<Incoming>,
) -> Result<(hyper::http::request::Parts, Bytes), ApiError> {
    let too_big = || {
        ApiError::new(
            413,
            "invalid_request_error",
            "request_too_large",
            format!("request body exceeds {limit} bytes; send less, or raise max_body_bytes in the gateway config"),
        )
    };
    if let Some(len) = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse::<u64>().ok())
    {
        if len > limit as u64 {
            return Err(too_big());
        }
    }
    let (parts, body) = req.into_parts();
    let stalled = || {
        ApiError::new(
            408,
            "invalid_request_error",
            "request_timeout",
            format!("the client sent no part of the request body for {idle:?}; send the whole body at once (idle_timeout_s)"),
        )
    };
    let collect = IdleLimited::new(Limited::new(body, limit), idle).collect();
    let Ok(collected) = tokio::time::timeout(total, collect).await else {
        return Err(ApiError::new(
            408,
            "invalid_request_error",
            "request_timeout",
            format!("the client took longer than {total:?} to send the request body; send it at once (body_timeout_s)"),
        ));
    };
    match collected {
        Ok(c) => Ok((parts, c.to_bytes())),
        Err(e) if e.downcast_ref::<Stalled>().is_some() => Err(stalled()),
        Err(e) => {
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some()
            {
                Err(too_big())
            } else {
                Err(ApiError::bad_request(
                    "body_read_failed",
                    format!("could not read the request body: {e}"),
                ))
            }
        }
    }
}

/// The client went silent mid-body for longer than the idle timeout.
#[derive(Debug)]
struct Stalled;

impl std::fmt::Display for Stalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("request body stalled")
    }
}

impl std::error::Error for Stalled {}

/// A body whose every frame must arrive within `idle` of the previous one.
struct IdleLimited<B> {
    inner: B,
    idle: std::time::Duration,
    timer: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl<B> IdleLimited<B> {
    fn new(inner: B, idle: std::time::Duration) -> Self {
        IdleLimited {
            inner,
            idle,
            timer: Box::pin(tokio::time::sleep(idle)),
        }
    }
}

impl<B> http_body::Body for IdleLimited<B>
where
    B: http_body::Body<Error = Box<dyn std::error::Error + Send + Sync>> + Unpin,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<B::Data>, B::Error>>> {
        use std::future::Future;
        use std::task::Poll;
        let this = &mut *self;
        match std::pin::Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(r) => {
                let next = tokio::time::Instant::now() + this.idle;
                this.timer.as_mut().reset(next);
                Poll::Ready(r)
            }
            Poll::Pending => match this.timer.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(Stalled)))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
}

/// A JSON request body; an empty body reads as `{}`.
pub fn parse_json(body: &[u8]) -> Result<Value, ApiError> {
    if body.is_empty() {
        return Ok(json!({}));
    }
    serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(
            "invalid_json",
            format!("request body is not valid JSON: {e}"),
        )
    })
}

/// `a=1&b=x%20y` → map (application/x-www-form-urlencoded, `+` is a space).
pub fn query_params(q: Option<&str>) -> HashMap<String, String> {
    form_urlencoded::parse(q.unwrap_or("").as_bytes())
        .into_owned()
        .collect()
}

/// Copies an engine's response headers, except hop-by-hop ones (RFC 9110
/// §7.6.1) and the length, which belong to each connection.
pub fn copy_headers(from: &HeaderMap, to: &mut HeaderMap) {
    const HOP: [&str; 8] = [
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "content-length",
    ];
    for (k, v) in from {
        if !HOP.contains(&k.as_str()) {
            to.append(k.clone(), v.clone());
        }
    }
}

/// The engine's whole JSON answer as the harness receives it: its status, its
/// headers (minus hop-by-hop ones) and its body, unchanged.
pub fn engine_json(status: StatusCode, headers: &HeaderMap, bytes: Bytes) -> Response<Body> {
    let mut r = Response::new(full(bytes));
    *r.status_mut() = status;
    copy_headers(headers, r.headers_mut());
    r.headers_mut()
        .insert(CONTENT_TYPE, copy_content_type(headers, "application/json"));
    r
}

pub fn copy_content_type(from: &HeaderMap, default: &'static str) -> HeaderValue {
    from.get(CONTENT_TYPE)
        .cloned()
        .unwrap_or_else(|| HeaderValue::from_static(default))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            hyper::header::HOST,
            HeaderValue::from_str(v).unwrap_or_else(|e| panic!("{e}")),
        );
        h
    }

    #[test]
    fn host_rule_serves_own_loopback_and_allowed_names_only() {
        let lan: std::net::IpAddr = [192, 168, 1, 5].into();
        let rule = HostRule::new(
            "0.0.0.0:8080",
            Some("http://user@gw.lan:8080/base"),
            &["Extra.Example".into()],
        );
        for ok in [
            "localhost:1",
            "127.0.0.1",
            "[::1]:8080",
            "192.168.1.5:8080",
            "gw.lan",
            "extra.example:9",
        ] {
            assert!(rule.check(&host(ok), Some(lan)).is_ok(), "{ok}");
        }
        // An IPv4 client of a `[::]` listener: the local address is mapped.
        let mapped: std::net::IpAddr = "::ffff:192.168.1.5"
            .parse()
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(rule.check(&host("192.168.1.5"), Some(mapped)).is_ok());
        for bad in [
            "evil.example",
            "0.0.0.0:8080",
            "192.168.1.6",
            "gw.lan.evil.example",
            "",
        ] {
            let e = rule.check(&host(bad), Some(lan)).err();
            assert_eq!(e.map(|e| e.code), Some("host_not_allowed"), "{bad}");
        }
        assert!(rule.check(&HeaderMap::new(), Some(lan)).is_ok());
        let any = HostRule::new("0.0.0.0:1", None, &["*".into()]);
        assert!(any.check(&host("evil.example"), None).is_ok());
        assert_eq!(host_name("[::1]:80"), "::1");
        assert_eq!(host_name("::1"), "::1");
        assert_eq!(host_name("a.example:80"), "a.example");
    }

    #[test]
    fn query_strings_decode() {
        let q = query_params(Some("status=running&group=a%2Fb+c&x"));
        assert_eq!(q.get("status").map(String::as_str), Some("running"));
        assert_eq!(q.get("group").map(String::as_str), Some("a/b c"));
        assert_eq!(q.get("x").map(String::as_str), Some(""));
        assert!(query_params(None).is_empty());
    }

    #[test]
    fn api_key_from_either_header() {
        let mut h = HeaderMap::new();
        assert_eq!(api_key(&h), None);
        h.insert("x-api-key", HeaderValue::from_static("k1"));
        assert_eq!(api_key(&h), Some("k1"));
        h.insert(AUTHORIZATION, HeaderValue::from_static("Bearer k2"));
        assert_eq!(api_key(&h), Some("k2"));
    }

    #[test]
    fn bearer_scheme_is_case_insensitive() {
        let mut h = HeaderMap::new();
        for (v, want) in [
            ("BEARER k", Some("k")),
            ("bearer  k ", Some("k")),
            ("BeArEr\tk", Some("k")),
            ("Basic k", None),
            ("Bearer ", None),
            ("Bearerk", None),
        ] {
            h.insert(AUTHORIZATION, HeaderValue::from_static(v));
            assert_eq!(bearer(&h), want, "{v:?}");
        }
    }
}
