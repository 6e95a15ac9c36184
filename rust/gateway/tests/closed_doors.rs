//! What a web page can do to a gateway on loopback (issue 39, findings 2-3):
//! nothing. A page whose name resolves to 127.0.0.1 (DNS rebinding) sends its
//! own name in `Host`; a page of another origin can POST `text/plain` without
//! a CORS preflight. Both are refused before a route runs, in the route's
//! protocol's error shape.

mod common;

use common::{raw, start};
use lightning_gateway::Config;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loopback_gateway_answers_only_loopback_names_and_json_bodies() {
    let dir = std::env::temp_dir().join(format!("lightning-doors-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // `--insecure-local`: no admin key, the case a page could drive blind.
    let cfg = Config {
        listen: "127.0.0.1:0".into(),
        db: dir.join("gw.db"),
        insecure_local: true,
        ..Config::default()
    };
    let gw = start(cfg).await;
    let addr = gw.addr;
    let port = addr.port().to_string();
    let json_ct = ("content-type", "application/json");
    let upstreams = r#"{"upstreams": [{"url": "http://203.0.113.9:1/v1"}]}"#;

    // A rebinding page: its own name in Host, even with a JSON body.
    let evil = format!("attacker.example:{port}");
    let (s, r) = raw(
        addr,
        "POST",
        "/admin/upstreams",
        &[("host", &evil), json_ct],
        upstreams,
    )
    .await;
    assert_eq!(s, 403, "{r}");
    assert_eq!(r["error"]["code"], json!("host_not_allowed"), "{r}");
    let (s, _) = raw(addr, "GET", "/rollouts", &[("host", &evil)], "").await;
    assert_eq!(s, 403);
    // A cross-origin "simple" POST: text/plain, or no type at all.
    for ct in [
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
        None,
    ] {
        let mut h = vec![("host", "127.0.0.1")];
        if let Some(ct) = ct {
            h.push(("content-type", ct));
        }
        let (s, r) = raw(addr, "POST", "/admin/upstreams", &h, upstreams).await;
        assert_eq!(s, 415, "{ct:?}: {r}");
        assert_eq!(r["error"]["code"], json!("unsupported_media_type"));
    }
    // The upstream list is what it was: the engine was not replaced.
    let (s, r) = raw(
        addr,
        "GET",
        "/admin/upstreams",
        &[("host", "localhost")],
        "",
    )
    .await;
    assert_eq!(s, 200, "{r}");
    assert!(!r.to_string().contains("203.0.113.9"), "{r}");
    // A harness route refuses in its own protocol's shape (Anthropic's here).
    let (s, r) = raw(
        addr,
        "POST",
        "/v1/messages",
        &[("host", "localhost"), ("content-type", "text/plain")],
        r#"{"model": "m", "max_tokens": 4, "messages": []}"#,
    )
    .await;
    assert_eq!(s, 415, "{r}");
    assert_eq!(r["type"], json!("error"), "{r}");
    // Loopback names and literals, with any port, are served; JSON with a charset too.
    for host in [
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
        "LOCALHOST".to_string(),
        format!("[::1]:{port}"),
        "127.0.0.2".to_string(),
    ] {
        let (s, r) = raw(addr, "GET", "/rollouts", &[("host", &host)], "").await;
        assert_eq!(s, 200, "{host}: {r}");
    }
    let (s, r) = raw(
        addr,
        "POST",
        "/rollouts",
        &[
            ("host", "localhost"),
            ("content-type", "application/json; charset=utf-8"),
        ],
        r#"{"rollout_id": "ro-1"}"#,
    )
    .await;
    assert_eq!(s, 201, "{r}");
    // A rollout reward gets feedback's finite range (1e308 zeroes a group's advantages).
    let token = format!("Bearer {}", r["token"].as_str().unwrap_or_default());
    let reward = |v: &'static str| {
        let token = token.clone();
        async move {
            raw(
                addr,
                "POST",
                "/rollouts/ro-1/reward",
                &[
                    ("host", "localhost"),
                    ("content-type", "application/json"),
                    ("authorization", &token),
                ],
                v,
            )
            .await
        }
    };
    for bad in [r#"{"value": 1e308}"#, r#"{"value": -1e7}"#] {
        let (s, r) = reward(bad).await;
        assert_eq!(s, 400, "{bad}: {r}");
        assert_eq!(r["error"]["code"], json!("invalid_reward"));
    }
    let (s, r) = reward(r#"{"value": 0.5}"#).await;
    assert_eq!(s, 200, "{r}");
    gw.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}
