//! Closed-loop HTTP load generator for the gateway benchmark: C workers, each on
//! its own keep-alive connection, POST the same body back to back for D seconds
//! and time each full answer (the whole body, for streams every event).
//!
//! `load URL CONCURRENCY DURATION_S BODY_FILE [BEARER]` → one JSON line:
//! `{"requests", "errors", "rps", "p50_ms", "p99_ms", "max_ms"}`.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use std::time::{Duration, Instant};

async fn worker(
    authority: String,
    path: String,
    body: Bytes,
    bearer: Option<String>,
    until: Instant,
) -> (Vec<f64>, u64) {
    let mut lat = Vec::new();
    let mut errors = 0u64;
    'outer: while Instant::now() < until {
        let Ok(stream) = tokio::net::TcpStream::connect(&authority).await else {
            errors += 1;
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let _ = stream.set_nodelay(true);
        let Ok((mut send, conn)) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await
        else {
            errors += 1;
            continue;
        };
        tokio::spawn(conn);
        while Instant::now() < until {
            let mut b = Request::post(path.as_str())
                .header("host", authority.as_str())
                .header("content-type", "application/json");
            if let Some(t) = &bearer {
                b = b.header("authorization", format!("Bearer {t}"));
            }
            let Ok(req) = b.body(Full::new(body.clone())) else {
                break 'outer;
            };
            let t0 = Instant::now();
            match send.send_request(req).await {
                Ok(resp) => {
                    let ok = resp.status().is_success();
                    let mut rb = resp.into_body();
                    let mut failed = false;
                    while let Some(f) = rb.frame().await {
                        if f.is_err() {
                            failed = true;
                            break;
                        }
                    }
                    if ok && !failed {
                        lat.push(t0.elapsed().as_secs_f64() * 1000.0);
                    } else {
                        errors += 1;
                        if failed {
                            continue 'outer;
                        }
                    }
                }
                Err(_) => {
                    errors += 1;
                    continue 'outer;
                }
            }
        }
    }
    (lat, errors)
}

fn main() -> std::io::Result<()> {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 5 {
        eprintln!("usage: load URL CONCURRENCY DURATION_S BODY_FILE [BEARER]");
        std::process::exit(2);
    }
    let url = a[1].strip_prefix("http://").unwrap_or(&a[1]).to_string();
    let (authority, path) = match url.find('/') {
        Some(i) => (url[..i].to_string(), url[i..].to_string()),
        None => (url.clone(), "/".to_string()),
    };
    let conc: usize = a[2].parse().unwrap_or(1);
    let dur: f64 = a[3].parse().unwrap_or(5.0);
    let body = Bytes::from(std::fs::read(&a[4])?);
    let bearer = a.get(5).cloned();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (mut lat, errors) = rt.block_on(async move {
        let until = Instant::now() + Duration::from_secs_f64(dur);
        let mut hs = Vec::new();
        for _ in 0..conc {
            hs.push(tokio::spawn(worker(
                authority.clone(),
                path.clone(),
                body.clone(),
                bearer.clone(),
                until,
            )));
        }
        let mut all = Vec::new();
        let mut errs = 0;
        for h in hs {
            if let Ok((l, e)) = h.await {
                all.extend(l);
                errs += e;
            }
        }
        (all, errs)
    });
    lat.sort_by(|x, y| x.total_cmp(y));
    let q = |p: f64| -> f64 {
        if lat.is_empty() {
            return f64::NAN;
        }
        lat[((lat.len() as f64 - 1.0) * p).round() as usize]
    };
    println!(
        "{{\"requests\": {}, \"errors\": {}, \"rps\": {:.1}, \"p50_ms\": {:.4}, \"p99_ms\": {:.4}, \"max_ms\": {:.3}}}",
        lat.len(),
        errors,
        lat.len() as f64 / dur,
        q(0.5),
        q(0.99),
        lat.last().copied().unwrap_or(f64::NAN)
    );
    Ok(())
}
