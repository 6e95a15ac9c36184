//! The prefix-shared layout reads exactly like a store of full copies: random
//! multi-turn conversations (continuations, branches from any earlier call,
//! edited history, retries, parallel calls in one group commit, n > 1
//! choices, calls without ids, the three protocols' body shapes, multi-byte
//! text) are written once into a `full` store and once into a `shared` one,
//! and every read path must return the same: call records (the trace JSON),
//! the columnar trace, bodies (`call_bodies`, `requests`) and a training
//! step's calls. The shared store must also be smaller whenever calls extend
//! earlier ones.

use lightning_gateway::config::StoreLayout;
use lightning_gateway::store::{
    columnar, reader, CallRecord, CallStatus, NewRollout, Reader, SecretSource, Selection, Store,
};
use lightning_gateway::SyncMode;
use proptest::prelude::*;
use std::path::{Path, PathBuf};

/// One step of a random conversation, interpreted by `Script::record`.
#[derive(Debug, Clone)]
enum Step {
    /// Continue from an earlier call (`from` picks it; the latest when out of range).
    Extend { from: usize, add: Vec<u32>, n: u8 },
    /// Like `Extend`, after changing one earlier token and message (edited history).
    Edit {
        from: usize,
        at: usize,
        add: Vec<u32>,
    },
    /// The same request as an earlier call again.
    Retry { from: usize },
    /// Three calls that commit together (sent before any answer).
    Parallel { from: usize, adds: [Vec<u32>; 3] },
    /// A new conversation in the same rollout (a sub-agent).
    Fresh { add: Vec<u32> },
    /// A call the engine gave no ids for.
    NoIds { from: usize },
}

const PROTOCOLS: [&str; 3] = ["openai_chat", "openai_responses", "anthropic_messages"];

#[derive(Clone)]
struct Convo {
    ids: Vec<u32>,
    messages: Vec<String>,
}

struct Script {
    rollout: String,
    protocol: &'static str,
    /// Conversations as each recorded call left them (prompt + completion).
    done: Vec<Convo>,
    n_req: usize,
}

fn tokens() -> impl Strategy<Value = Vec<u32>> {
    // A small alphabet: accidental shared prefixes and shared tails happen.
    proptest::collection::vec(0u32..6, 0..12)
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (any::<usize>(), tokens(), 1u8..3).prop_map(|(from, add, n)| Step::Extend { from, add, n }),
        1 => (any::<usize>(), any::<usize>(), tokens()).prop_map(|(from, at, add)| Step::Edit { from, at, add }),
        1 => any::<usize>().prop_map(|from| Step::Retry { from }),
        1 => (any::<usize>(), tokens(), tokens(), tokens()).prop_map(|(from, a, b, c)| Step::Parallel { from, adds: [a, b, c] }),
        1 => tokens().prop_map(|add| Step::Fresh { add }),
        1 => any::<usize>().prop_map(|from| Step::NoIds { from }),
    ]
}

fn text_of(ids: &[u32]) -> String {
    // Multi-byte characters, so cuts must land on char boundaries.
    ids.iter()
        .map(|i| ['a', 'é', '€', '"', 'b', '𝄞'][*i as usize % 6])
        .collect()
}

impl Script {
    fn base(&self, from: usize) -> Convo {
        match self.done.len() {
            0 => Convo {
                ids: vec![1, 2, 3, 4, 5, 0, 1, 2, 3, 4],
                messages: vec!["system prompt, long enough to share ".repeat(3)],
            },
            n => self.done[from.min(n - 1) % n].clone(),
        }
    }

    fn bodies(&self, messages: &[String]) -> (String, String) {
        let list = serde_json::to_string(messages).unwrap_or_default();
        let engine =
            format!(r#"{{"model":"m","messages":{list},"return_token_ids":true,"logprobs":true}}"#);
        let harness = match self.protocol {
            "openai_chat" => format!(r#"{{"model":"m","messages":{list},"temperature":0.5}}"#),
            "openai_responses" => format!(r#"{{"model":"m","input":{list},"store":false}}"#),
            _ => {
                format!(r#"{{"model":"m","system":"Be brief.","messages":{list},"max_tokens":64}}"#)
            }
        };
        (engine, harness)
    }

    /// The records of one request: `n` choices continuing `c` by `add`.
    fn request(&mut self, c: &Convo, add: &[u32], n: u8, ids: bool) -> Vec<CallRecord> {
        let mut prompt = c.ids.clone();
        prompt.extend_from_slice(add);
        let mut messages = c.messages.clone();
        messages.push(text_of(add));
        let (engine, harness) = self.bodies(&messages);
        self.n_req += 1;
        let mut out = Vec::new();
        for k in 0..n {
            let completion: Vec<u32> = (0..(3 + add.len() as u32 + k as u32) % 7)
                .map(|i| (i * 7 + k as u32 + add.len() as u32) % 6)
                .collect();
            let mut convo = Convo {
                ids: prompt.clone(),
                messages: messages.clone(),
            };
            convo.ids.extend(&completion);
            convo.messages.push(text_of(&completion));
            if ids {
                self.done.push(convo);
            }
            out.push(CallRecord {
                rollout_id: self.rollout.clone(),
                request_id: format!("req-{}", self.n_req),
                choice_index: k as i64,
                kind: "chat",
                protocol: self.protocol,
                request: engine.clone(),
                harness_request: harness.clone(),
                prompt_ids: ids.then(|| prompt.clone()),
                logprobs: ids.then(|| completion.iter().map(|i| -(*i as f32) / 8.0).collect()),
                completion_ids: ids.then_some(completion),
                finish_reason: Some("stop".into()),
                text: Some(text_of(add)),
                status: CallStatus::Ok,
                flags: vec![],
                delivered: true,
                retry_count: 0,
                weight_version: 1,
                upstream: "u".into(),
                http_status: 200,
                latency_ms: 1.0,
                usage: None,
                created: 1000.0 + self.n_req as f64,
                response_id: Some(format!("resp-{}", self.n_req)),
            });
        }
        out
    }
}

/// Batches of records per rollout; a batch commits as one group.
fn script(rollout: &str, protocol: &'static str, steps: &[Step]) -> Vec<Vec<Vec<CallRecord>>> {
    let mut s = Script {
        rollout: rollout.into(),
        protocol,
        done: Vec::new(),
        n_req: 0,
    };
    let mut out = Vec::new();
    for st in steps {
        let batch = match st {
            Step::Extend { from, add, n } => {
                let c = s.base(*from);
                vec![s.request(&c, add, *n, true)]
            }
            Step::Edit { from, at, add } => {
                let mut c = s.base(*from);
                let i = at % c.ids.len().max(1);
                if let Some(t) = c.ids.get_mut(i) {
                    *t = (*t + 1) % 6;
                }
                let j = at % c.messages.len().max(1);
                if let Some(m) = c.messages.get_mut(j) {
                    m.insert(0, 'x');
                }
                vec![s.request(&c, add, 1, true)]
            }
            Step::Retry { from } => {
                let c = s.base(*from);
                let mut r = s.request(&c, &[], 1, true);
                for x in &mut r {
                    x.retry_count = 1;
                }
                vec![r]
            }
            Step::Parallel { from, adds } => {
                let c = s.base(*from);
                adds.iter().map(|a| s.request(&c, a, 1, true)).collect()
            }
            Step::Fresh { add } => {
                let c = Convo {
                    ids: vec![],
                    messages: vec![],
                };
                vec![s.request(&c, add, 1, true)]
            }
            Step::NoIds { from } => {
                let c = s.base(*from);
                vec![s.request(&c, &[1, 2], 1, false)]
            }
        };
        out.push(batch);
    }
    out
}

fn dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("lightning-layout-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap_or_else(|e| panic!("{e}"));
    d
}

async fn write(path: &Path, layout: StoreLayout, rollouts: &[(String, Vec<Vec<Vec<CallRecord>>>)]) {
    let store = Store::open_layout(path, SyncMode::Normal, SecretSource::None, layout)
        .unwrap_or_else(|e| panic!("{e}"));
    for (id, _) in rollouts {
        store
            .create_rollout(NewRollout {
                id: id.clone(),
                group: Some("g".into()),
                task: "{}".into(),
                mode: "train".into(),
                token_hash: format!("h-{id}"),
            })
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    // Rollouts interleave, batch by batch, as concurrent rollouts do.
    let most = rollouts.iter().map(|r| r.1.len()).max().unwrap_or(0);
    for i in 0..most {
        for (_, batches) in rollouts {
            let Some(batch) = batches.get(i) else {
                continue;
            };
            let mut reqs = batch.iter().cloned();
            match (reqs.next(), reqs.next(), reqs.next()) {
                (Some(a), Some(b), Some(c)) => {
                    // Sent before any commits: one group commit holds all three.
                    let (x, y, z) = tokio::join!(
                        store.insert_calls(a, false, None),
                        store.insert_calls(b, false, None),
                        store.insert_calls(c, false, None)
                    );
                    for r in [x, y, z] {
                        r.unwrap_or_else(|e| panic!("{e}"));
                    }
                }
                (Some(a), _, _) => {
                    store
                        .insert_calls(a, false, None)
                        .await
                        .unwrap_or_else(|e| panic!("{e}"));
                }
                _ => {}
            }
        }
    }
    store.close();
}

/// Everything a reader can get for each rollout, as comparable text.
fn reads(path: &Path, ids: &[String]) -> Vec<String> {
    let r = Reader::open(path).unwrap_or_else(|e| panic!("{e}"));
    let mut out = Vec::new();
    for id in ids {
        let recs = r.records(id).unwrap_or_else(|e| panic!("{e}"));
        out.push(serde_json::to_string(&recs).unwrap_or_default());
        out.push(format!("{:?}", columnar::encode(id, &recs)));
        let bodies = r.call_bodies(id).unwrap_or_else(|e| panic!("{e}"));
        out.push(format!("{bodies:?}"));
        out.push(format!(
            "{:?}",
            r.requests(id).unwrap_or_else(|e| panic!("{e}"))
        ));
        out.push(format!(
            "{:?}",
            r.trace(id).unwrap_or_else(|e| panic!("{e}"))
        ));
    }
    let step = r
        .read_step(&Selection::default())
        .unwrap_or_else(|e| panic!("{e}"));
    // Rollout rows are the same in both (creation times aside, which differ
    // between the two writes); the calls must be identical.
    let rollouts: Vec<_> = step
        .rollouts
        .iter()
        .map(|r| (&r.rollout_id, &r.group, &r.status, r.reward))
        .collect();
    out.push(format!(
        "{rollouts:?} {:?} {}",
        step.calls, step.skipped_calls
    ));
    out
}

fn stored_bytes(path: &Path) -> i64 {
    let c = rusqlite::Connection::open(path).unwrap_or_else(|e| panic!("{e}"));
    c.query_row(
        "SELECT COALESCE(SUM(COALESCE(length(prompt_ids), 0) + length(request)
            + COALESCE(length(harness_request), 0)), 0) FROM calls",
        [],
        |r| r.get(0),
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

fn check(case: &str, rollouts: Vec<(String, Vec<Vec<Vec<CallRecord>>>)>) -> (i64, i64) {
    let d = dir(case);
    let (full, shared) = (d.join("full.db"), d.join("shared.db"));
    let rt = tokio::runtime::Runtime::new().unwrap_or_else(|e| panic!("{e}"));
    rt.block_on(write(&full, StoreLayout::Full, &rollouts));
    rt.block_on(write(&shared, StoreLayout::Shared, &rollouts));
    let ids: Vec<String> = rollouts.iter().map(|r| r.0.clone()).collect();
    let (a, b) = (reads(&full, &ids), reads(&shared, &ids));
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x, y);
    }
    assert_eq!(a.len(), b.len());
    let sizes = (stored_bytes(&full), stored_bytes(&shared));
    let _ = std::fs::remove_dir_all(&d);
    sizes
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn shared_reads_like_full_copies(
        a in proptest::collection::vec(step(), 1..14),
        b in proptest::collection::vec(step(), 0..8),
        c in proptest::collection::vec(step(), 0..8),
    ) {
        let rollouts = vec![
            ("ra".to_string(), script("ra", PROTOCOLS[0], &a)),
            ("rb".to_string(), script("rb", PROTOCOLS[1], &b)),
            ("rc".to_string(), script("rc", PROTOCOLS[2], &c)),
        ];
        let (full, shared) = check("prop", rollouts);
        prop_assert!(shared <= full, "shared {shared} > full {full}");
    }
}

/// A long conversation costs what it adds: at 60 turns the shared store keeps
/// under a tenth of the full copies' prompt and body bytes.
#[test]
fn a_long_conversation_stores_what_each_call_adds() {
    let steps: Vec<Step> = (0..60)
        .map(|i| Step::Extend {
            from: usize::MAX,
            add: (0..10).map(|k| (i + k) % 6).collect(),
            n: 1,
        })
        .collect();
    let rollouts: Vec<_> = PROTOCOLS
        .iter()
        .enumerate()
        .map(|(i, p)| (format!("r{i}"), script(&format!("r{i}"), p, &steps)))
        .collect();
    let (full, shared) = check("long", rollouts);
    assert!(shared * 10 < full, "shared {shared} vs full {full}");
}

/// A damaged reference is an error that says so, not wrong ids or a panic.
#[test]
fn a_damaged_reference_is_an_error() {
    let d = dir("damaged");
    let path = d.join("s.db");
    let steps: Vec<Step> = (0..3)
        .map(|_| Step::Extend {
            from: usize::MAX,
            add: vec![1, 2, 3],
            n: 1,
        })
        .collect();
    let rollouts = vec![("r".to_string(), script("r", PROTOCOLS[0], &steps))];
    let rt = tokio::runtime::Runtime::new().unwrap_or_else(|e| panic!("{e}"));
    rt.block_on(write(&path, StoreLayout::Shared, &rollouts));
    let c = rusqlite::Connection::open(&path).unwrap_or_else(|e| panic!("{e}"));
    c.execute("UPDATE calls SET prompt_shared = 100000 WHERE seq = 2", [])
        .unwrap_or_else(|e| panic!("{e}"));
    c.execute("UPDATE calls SET text_base = 7 WHERE seq = 1", [])
        .unwrap_or_else(|e| panic!("{e}"));
    drop(c);
    let conn = rusqlite::Connection::open(&path).unwrap_or_else(|e| panic!("{e}"));
    let e = reader::records(&conn, "r").err().map(|e| e.to_string());
    assert!(e.as_deref().is_some_and(|m| m.contains("damaged")), "{e:?}");
    let e = reader::requests(&conn, "r", true)
        .err()
        .map(|e| e.to_string());
    assert!(
        e.as_deref()
            .is_some_and(|m| m.contains("not an earlier call")),
        "{e:?}"
    );
    let _ = std::fs::remove_dir_all(&d);
}
