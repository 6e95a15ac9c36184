//! Closed-loop HTTP load generator for the gateway benchmark: C workers, each on
//! its own keep-alive connection, POST the same body back to back for D seconds
//! and time each full answer (the whole body, for streams every event).
//!
//! `load URL CONCURRENCY DURATION_S BODY_FILE [BEARER]` → one JSON line:
//! `{"requests", "errors", "wrong", "rps", "p50_ms", "p99_ms", "max_ms"}`.
//!
//! A body holding `{{n}}` is a template (the soak bench): each request gets a
//! nonce of its own there, and an answer only counts if it carries that nonce
//! zero-padded to 10 digits (the `unique` static engine writes it into the
//! text); a successful answer without it is `wrong` (another call's answer, or
//! a corrupt one). With `LOAD_SEEN=FILE` the nonces of the answers seen whole
//! are written there, one a line, for the bench to look up in the store.
//! Nonces are `LOAD_NONCE_BASE` (default 0) + worker × 1,000,000 + request.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use std::time::{Duration, Instant};

/// What one worker saw.
#[derive(Default)]
struct Seen {
    latencies_ms: Vec<f64>,
    errors: u64,
    wrong: u64,
    nonces: Vec<u64>,
}

async fn worker(
    w: u64,
    authority: String,
    path: String,
    body: Bytes,
    bearer: Option<String>,
    until: Instant,
) -> Seen {
    let mut seen = Seen::default();
    let template = body
        .windows(5)
        .position(|x| x == b"{{n}}")
        .map(|at| (body[..at].to_vec(), body[at + 5..].to_vec()));
    let nonce_base: u64 = std::env::var("LOAD_NONCE_BASE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut k = 0u64;
    'outer: while Instant::now() < until {
        let Ok(stream) = tokio::net::TcpStream::connect(&authority).await else {
            seen.errors += 1;
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let _ = stream.set_nodelay(true);
        let Ok((mut send, conn)) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await
        else {
            seen.errors += 1;
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
            k += 1;
            let nonce = nonce_base + w * 1_000_000 + k;
            let this = match &template {
                Some((head, tail)) => {
                    Bytes::from([&head[..], nonce.to_string().as_bytes(), tail].concat())
                }
                None => body.clone(),
            };
            let Ok(req) = b.body(Full::new(this)) else {
                break 'outer;
            };
            let t0 = Instant::now();
            match send.send_request(req).await {
                Ok(resp) => {
                    let ok = resp.status().is_success();
                    let mut rb = resp.into_body();
                    let mut failed = false;
                    let mut answer = Vec::new();
                    while let Some(f) = rb.frame().await {
                        match f {
                            Ok(f) if template.is_some() => {
                                if let Some(d) = f.data_ref() {
                                    answer.extend_from_slice(d);
                                }
                            }
                            Ok(_) => {}
                            Err(_) => {
                                failed = true;
                                break;
                            }
                        }
                    }
                    if ok && !failed {
                        seen.latencies_ms.push(t0.elapsed().as_secs_f64() * 1000.0);
                        if template.is_some() {
                            let own = format!("{nonce:010}");
                            if answer.windows(own.len()).any(|x| x == own.as_bytes()) {
                                seen.nonces.push(nonce);
                            } else {
                                seen.wrong += 1;
                            }
                        }
                    } else {
                        seen.errors += 1;
                        if failed {
                            continue 'outer;
                        }
                    }
                }
                Err(_) => {
                    seen.errors += 1;
                    continue 'outer;
                }
            }
        }
    }
    seen
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
    let all = rt.block_on(async move {
        let until = Instant::now() + Duration::from_secs_f64(dur);
        let mut hs = Vec::new();
        for w in 0..conc as u64 {
            hs.push(tokio::spawn(worker(
                w,
                authority.clone(),
                path.clone(),
                body.clone(),
                bearer.clone(),
                until,
            )));
        }
        let mut all = Seen::default();
        for h in hs {
            if let Ok(s) = h.await {
                all.latencies_ms.extend(s.latencies_ms);
                all.errors += s.errors;
                all.wrong += s.wrong;
                all.nonces.extend(s.nonces);
            }
        }
        all
    });
    if let Ok(path) = std::env::var("LOAD_SEEN") {
        let lines: Vec<String> = all.nonces.iter().map(u64::to_string).collect();
        std::fs::write(path, lines.join("\n"))?;
    }
    let mut lat = all.latencies_ms;
    lat.sort_by(|x, y| x.total_cmp(y));
    let q = |p: f64| -> f64 {
        if lat.is_empty() {
            return f64::NAN;
        }
        lat[((lat.len() as f64 - 1.0) * p).round() as usize]
    };
    println!(
        "{{\"requests\": {}, \"errors\": {}, \"wrong\": {}, \"rps\": {:.1}, \"p50_ms\": {:.4}, \"p99_ms\": {:.4}, \"max_ms\": {:.3}}}",
        lat.len(),
        all.errors,
        all.wrong,
        lat.len() as f64 / dur,
        q(0.5),
        q(0.99),
        lat.last().copied().unwrap_or(f64::NAN)
    );
    Ok(())
}
