//! Writes a large store for `benches/view_scale.py`, through the store's own
//! writer (`Store::create_rollout`, `insert_calls`, `insert_event`,
//! `set_status`, and online mode's key, session and feedback writes): the rows
//! are what a gateway would write, with no SQL outside the store module.
//! Many writes are kept in flight so the writer's group commit folds them into
//! large transactions (one gateway at full load does the same).
//!
//! `cargo run --release -p lightning-gateway --example fill_store -- PATH ROLLOUTS CALLS_PER_ROLLOUT SESSIONS`
//! → one JSON line `{"rollouts", "calls", "sessions", "seconds"}`.
//!
//! Rollouts: groups of 8, one in ten `eval`, nine in ten finished with a
//! reward, the rest left running. Calls: 32 prompt + 16 completion ids, 1% upstream
//! errors and 0.5% aborted, `created` spread over the hour before now (the
//! view's calls chart has something to draw). Sessions: one key (`bench`,
//! tagged `support`), two chat calls each, every other one with a feedback signal.

#![allow(clippy::expect_used)] // a bench tool: a failed write ends it, with the message

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use lightning_gateway::config::SyncMode;
use lightning_gateway::store::online::{AppKey, NewFeedback, OnlineCall, Op, Outcome};
use lightning_gateway::store::{CallRecord, CallStatus, NewRollout, SecretSource, Store};
use tokio::task::JoinSet;

/// Writes in flight at once (each waits for its commit).
const IN_FLIGHT: usize = 512;
const SPAN_S: f64 = 3600.0;

fn call(rollout: &str, i: usize, n: usize, t0: f64, status: CallStatus) -> CallRecord {
    let prompt: Vec<u32> = (0..32).map(|k| (k * 7 + i as u32) % 50_000).collect();
    let completion: Vec<u32> = (0..16).map(|k| (k * 13 + i as u32) % 50_000).collect();
    CallRecord {
        rollout_id: rollout.into(),
        request_id: format!("req-{i}"),
        choice_index: 0,
        kind: "chat",
        protocol: "openai_chat",
        request: "{}".into(),
        harness_request: r#"{"messages":[{"role":"user","content":"hi"}]}"#.into(),
        prompt_ids: Some(prompt),
        completion_ids: Some(completion),
        logprobs: Some(vec![-0.25; 16]),
        finish_reason: Some("stop".into()),
        text: Some("hello".into()),
        status,
        flags: vec![],
        delivered: status == CallStatus::Ok,
        retry_count: 0,
        weight_version: 1,
        upstream: "bench".into(),
        http_status: if status == CallStatus::UpstreamError {
            502
        } else {
            200
        },
        latency_ms: 12.0,
        usage: None,
        created: t0 - SPAN_S + SPAN_S * (i as f64) / (n as f64),
        response_id: Some(format!("chatcmpl-{rollout}-{i}")),
    }
}

fn status_of(i: usize) -> CallStatus {
    match i % 200 {
        0 | 1 => CallStatus::UpstreamError,
        2 => CallStatus::Aborted,
        _ => CallStatus::Ok,
    }
}

async fn rollout(store: Arc<Store>, r: usize, per: usize, total: usize, t0: f64) {
    let id = format!("r{r:08}");
    let row = NewRollout {
        id: id.clone(),
        group: Some(format!("g{}", r / 8)),
        task: format!(r#"{{"q": {r}}}"#),
        mode: if r.is_multiple_of(10) {
            "eval"
        } else {
            "train"
        }
        .into(),
        token_hash: format!("bench-{r}"),
    };
    store.create_rollout(row).await.expect("create rollout");
    let calls = (0..per)
        .map(|k| {
            let i = r * per + k;
            call(&id, i, total, t0, status_of(i))
        })
        .collect();
    store
        .insert_calls(calls, true, None)
        .await
        .expect("insert calls");
    if r % 10 != 9 {
        let reward = format!(r#"{{"value": {}}}"#, (r % 5) as f64 / 4.0);
        store
            .insert_event(&id, "reward", reward)
            .await
            .expect("reward");
        store.set_status(&id, "succeeded").await.expect("status");
    }
}

async fn session(store: Arc<Store>, key: Arc<AppKey>, s: usize, total: usize, t0: f64) {
    let online = Arc::new(OnlineCall {
        key: key.clone(),
        session: Some(format!("s{s:07}")),
        previous_response: None,
        user: None,
        window_s: 3600.0,
        idle_s: 3600.0,
    });
    for turn in 0..2 {
        let rec = call("", s * 2 + turn, total * 2, t0, CallStatus::Ok);
        store
            .insert_online_calls(vec![rec], online.clone(), None)
            .await
            .expect("online call");
    }
    if s.is_multiple_of(2) {
        let fb = NewFeedback {
            key_id: key.id.clone(),
            feedback_id: format!("f{s}"),
            response_id: None,
            session: Some(format!("s{s:07}")),
            name: "thumbs".into(),
            value: (s % 3) as f64 / 2.0,
            data: serde_json::Value::Null,
            ts: t0,
        };
        store.online(Op::Feedback(fb)).await.expect("feedback");
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 5 {
        eprintln!("usage: fill_store PATH ROLLOUTS CALLS_PER_ROLLOUT SESSIONS");
        std::process::exit(2);
    }
    let path = PathBuf::from(&args[1]);
    let parse = |s: &str| -> usize {
        s.parse().unwrap_or_else(|_| {
            eprintln!("fill_store: {s:?} is not a count");
            std::process::exit(2)
        })
    };
    let (rollouts, per, sessions) = (parse(&args[2]), parse(&args[3]), parse(&args[4]));
    if path.exists() {
        eprintln!("fill_store: {} exists; give a new path", path.display());
        std::process::exit(2);
    }
    let store = Arc::new(Store::open(&path, SyncMode::Normal, SecretSource::None).expect("open"));
    let t0 = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    let started = Instant::now();
    let mut tasks = JoinSet::new();
    for r in 0..rollouts {
        if tasks.len() >= IN_FLIGHT {
            if let Some(j) = tasks.join_next().await {
                j.expect("task");
            }
        }
        tasks.spawn(rollout(store.clone(), r, per, rollouts * per, t0));
    }
    let key = match store
        .online(Op::CreateKey {
            id: "key-bench".into(),
            name: "bench".into(),
            token_hash: "bench-key".into(),
            defaults: serde_json::json!({"tags": ["support"]}),
        })
        .await
        .expect("key")
    {
        Outcome::Key(row) => Arc::new(AppKey::from_row(&row)),
        other => panic!("unexpected {other:?}"),
    };
    for s in 0..sessions {
        if tasks.len() >= IN_FLIGHT {
            if let Some(j) = tasks.join_next().await {
                j.expect("task");
            }
        }
        tasks.spawn(session(store.clone(), key.clone(), s, sessions, t0));
    }
    while let Some(j) = tasks.join_next().await {
        j.expect("task");
    }
    store.barrier().await.expect("barrier");
    store.close();
    println!(
        "{{\"rollouts\": {rollouts}, \"calls\": {}, \"sessions\": {sessions}, \"seconds\": {:.1}}}",
        rollouts * per + sessions * 2,
        started.elapsed().as_secs_f64()
    );
}
