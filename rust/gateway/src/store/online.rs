//! Online mode's side of the store: application keys, sessions (resolved
//! inside the writer's transaction, see `crate::online` for the rules),
//! feedback, and the trained mark. Everything here runs on the single writer
//! (`super::apply`); the reads are in `super::reader`, the tables in
//! `super::schema`, retention in `super::retention`.

use rusqlite::{params, Connection, OptionalExtension};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::records::{CallRecord, Mode};
use crate::error::ApiError;
use std::sync::Arc;

#[derive(Debug, Clone, Serialize)]
pub struct KeyRow {
    pub id: String,
    pub name: String,
    pub defaults: Value,
    pub created: f64,
    pub revoked: Option<f64>,
}

#[derive(Debug, Clone)]
pub struct NewFeedback {
    pub key_id: String,
    pub feedback_id: String,
    pub response_id: Option<String>,
    pub session: Option<String>,
    pub name: String,
    pub value: f64,
    pub data: Value,
    pub ts: f64,
}

/// Operations the writer runs for online mode.
#[derive(Debug)]
pub enum Op {
    CreateKey {
        id: String,
        name: String,
        token_hash: String,
        defaults: Value,
    },
    RevokeKey {
        id: String,
    },
    Feedback(NewFeedback),
    /// Sessions a training pass used (`online_sessions.trained`).
    MarkTrained {
        rollout_ids: Vec<String>,
        when: f64,
    },
    Sweep {
        idle_before: f64,
        retain_after: Option<f64>,
        retain_bytes: Option<u64>,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum FeedbackOutcome {
    /// Stored now (`duplicate = false`) or earlier with the same content.
    Stored {
        rollout_id: String,
        after_training: bool,
        duplicate: bool,
    },
    NotFound(String),
    Ambiguous(String),
    /// The feedback id was used before for a different signal.
    Conflict(String),
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SweepReport {
    pub closed: usize,
    pub deleted: usize,
}

#[derive(Debug)]
pub enum Outcome {
    Key(KeyRow),
    Found(bool),
    Feedback(FeedbackOutcome),
    Swept(SweepReport),
    Session {
        rollout_id: String,
        created: bool,
    },
    /// Sessions marked trained (ids not found are not counted).
    Marked(usize),
}

/// What an application key's defaults say (validated on creation).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct KeyDefaults {
    /// `train` (default) or `eval`: the mode of its sessions.
    pub mode: Option<String>,
    /// Tags stored on every session (selection in `lightning train --online`).
    pub tags: Vec<String>,
    /// Store token ids but no text (request bodies, answer text).
    pub redact: bool,
    /// Sampling overrides. Off by default: production gets what it asks for.
    pub temperature: Option<f64>,
}

impl KeyDefaults {
    pub fn parse(v: Option<&Value>) -> Result<KeyDefaults, ApiError> {
        let d: KeyDefaults = match v {
            None | Some(Value::Null) => KeyDefaults::default(),
            Some(v) => serde_json::from_value(v.clone()).map_err(|e| {
                ApiError::bad_request(
                    "invalid_defaults",
                    format!("key defaults take {{mode, tags, redact, temperature}}: {e}"),
                )
            })?,
        };
        if let Some(m) = &d.mode {
            if m != "train" && m != "eval" {
                return Err(ApiError::bad_request(
                    "invalid_mode",
                    format!("defaults.mode {m:?} is not 'train' or 'eval'"),
                ));
            }
        }
        if d.temperature.is_some_and(|t| !(t.is_finite() && t >= 0.0)) {
            return Err(ApiError::bad_request(
                "invalid_defaults",
                "defaults.temperature must be a finite number >= 0",
            ));
        }
        Ok(d)
    }
}

/// An application key, as the hot path needs it.
#[derive(Debug, Clone)]
pub struct AppKey {
    pub id: String,
    pub name: String,
    pub mode: Mode,
    pub defaults: KeyDefaults,
}

impl AppKey {
    pub fn from_row(row: &KeyRow) -> AppKey {
        let defaults: KeyDefaults =
            serde_json::from_value(row.defaults.clone()).unwrap_or_default();
        AppKey {
            id: row.id.clone(),
            name: row.name.clone(),
            mode: if defaults.mode.as_deref() == Some("eval") {
                Mode::Eval
            } else {
                Mode::Train
            },
            defaults,
        }
    }
}

/// One online call on its way to the store: whose it is and which session it names.
#[derive(Debug, Clone)]
pub struct OnlineCall {
    pub key: Arc<AppKey>,
    /// The explicit session id (rule 1), if the client sent one.
    pub session: Option<String>,
    /// Responses' `previous_response_id` (rule 2).
    pub previous_response: Option<String>,
    /// The protocol's user field, kept as a tag.
    pub user: Option<String>,
    pub window_s: f64,
    pub idle_s: f64,
}

/// One session as `GET /admin/online/sessions` lists it.
#[derive(Debug, Clone, Serialize)]
pub struct SessionRow {
    pub session_id: String,
    pub key_id: String,
    pub key_name: Option<String>,
    pub session_key: Option<String>,
    pub user: Option<String>,
    pub n_calls: i64,
    pub started: f64,
    pub updated: f64,
    pub closed: bool,
    pub trained: Option<f64>,
    pub feedback: i64,
    /// The session rollout's task (JSON text: key name, tags, user); the
    /// admin listing leaves it out.
    #[serde(skip)]
    pub task: String,
}

/// Which sessions to list: all filters optional; newest activity first
/// unless `oldest_first`.
#[derive(Debug, Clone, Default)]
pub struct SessionFilter {
    pub key_id: Option<String>,
    pub closed: Option<bool>,
    pub with_feedback: Option<bool>,
    /// At most this many (negative: no limit).
    pub limit: i64,
    /// Last active at or after (unix seconds).
    pub updated_from: Option<f64>,
    /// Last active before (unix seconds).
    pub updated_before: Option<f64>,
    /// Oldest activity first (a training pass) instead of newest first.
    pub oldest_first: bool,
}

/// One page of sessions for a browser (`Reader::session_page`): newest
/// activity first, keyset-paged on `(updated, rollout_id)`; every given filter
/// must hold.
#[derive(Debug, Clone, Default)]
pub struct SessionPage {
    /// An application key, by id or by name.
    pub key: Option<String>,
    /// A tag of the session (its key's tags when it opened).
    pub tag: Option<String>,
    /// With (`true`) or without (`false`) any feedback signal.
    pub with_feedback: Option<bool>,
    /// Used by a training pass (`true`) or not yet (`false`).
    pub trained: Option<bool>,
    /// Only sessions after this one in the page order. An id not in the store
    /// gives an empty page.
    pub after: Option<String>,
    pub limit: i64,
}

/// SHA-256 of ids as little-endian u32 (the tail a continuing prompt starts with).
pub fn ids_hash(ids: &[u32]) -> [u8; 32] {
    let mut h = Sha256::new();
    for id in ids {
        h.update(id.to_le_bytes());
    }
    h.finalize().into()
}

/// `ids_hash(&ids[..n])` for each `n` in `lengths` (ascending), in one pass.
pub fn prefix_hashes(ids: &[u32], lengths: &[usize]) -> Vec<[u8; 32]> {
    let mut h = Sha256::new();
    let mut at = 0;
    let mut out = Vec::with_capacity(lengths.len());
    for &n in lengths {
        let n = n.min(ids.len());
        if n > at {
            for id in &ids[at..n] {
                h.update(id.to_le_bytes());
            }
            at = n;
        }
        out.push(h.clone().finalize().into());
    }
    out
}

/// The session this call belongs to, `(rollout id, created)`, creating it if
/// need be; the module doc lists the rules. `prompt`: the call's prompt ids, if the engine sent them.
pub fn resolve_session(
    conn: &Connection,
    oc: &OnlineCall,
    prompt: Option<&[u32]>,
    now: f64,
) -> rusqlite::Result<(String, bool)> {
    let open_after = now - oc.idle_s;
    let key = &oc.key.id;
    if let Some(sk) = &oc.session {
        let row: Option<(String, f64, i64)> = conn
            .query_row(
                "SELECT rollout_id, updated, closed FROM online_sessions
                 WHERE key_id = ?1 AND session_key = ?2 ORDER BY started DESC LIMIT 1",
                params![key, sk],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .optional()?;
        return match row {
            Some((rid, updated, 0)) if updated >= open_after => Ok((rid, false)),
            _ => create_session(conn, oc, now),
        };
    }
    if let Some(prev) = &oc.previous_response {
        let rid: Option<String> = conn
            .query_row(
                "SELECT s.rollout_id FROM calls c JOIN online_sessions s ON s.rollout_id = c.rollout_id
                 WHERE c.response_id = ?1 AND s.key_id = ?2 AND s.closed = 0 AND s.updated >= ?3 LIMIT 1",
                params![prev, key, open_after],
                |r| r.get(0),
            )
            .optional()?;
        if let Some(rollout_id) = rid {
            return Ok((rollout_id, false));
        }
    }
    if let Some(p) = prompt {
        if let Some(rollout_id) = continued(conn, oc, p, now)? {
            return Ok((rollout_id, false));
        }
    }
    create_session(conn, oc, now)
}

/// The open implicit session whose tail `prompt` extends (longest tail wins).
fn continued(
    conn: &Connection,
    oc: &OnlineCall,
    prompt: &[u32],
    now: f64,
) -> rusqlite::Result<Option<String>> {
    let after = now - oc.window_s.min(oc.idle_s);
    let mut stmt = conn.prepare_cached(
        "SELECT rollout_id, tail_len, tail_hash FROM online_sessions
         WHERE key_id = ?1 AND closed = 0 AND session_key IS NULL AND updated >= ?2
           AND tail_len > 0 AND tail_len <= ?3
         ORDER BY tail_len DESC, updated DESC",
    )?;
    let cands: Vec<(String, usize, Vec<u8>)> = stmt
        .query_map(params![oc.key.id, after, prompt.len() as i64], |r| {
            Ok((r.get(0)?, r.get::<_, i64>(1)? as usize, r.get(2)?))
        })?
        .collect::<rusqlite::Result<_>>()?;
    if cands.is_empty() {
        return Ok(None);
    }
    let mut lengths: Vec<usize> = cands.iter().map(|c| c.1).collect();
    lengths.sort_unstable();
    lengths.dedup();
    let hashes = prefix_hashes(prompt, &lengths);
    for (rid, len, hash) in &cands {
        if let Ok(i) = lengths.binary_search(len) {
            if hashes[i].as_slice() == hash.as_slice() {
                return Ok(Some(rid.clone()));
            }
        }
    }
    Ok(None)
}

fn create_session(
    conn: &Connection,
    oc: &OnlineCall,
    now: f64,
) -> rusqlite::Result<(String, bool)> {
    let rid = format!("on-{}", crate::util::random_hex(10));
    let task = json!({
        "app_key": oc.key.name,
        "key_id": oc.key.id,
        "session_key": oc.session,
        "user": oc.user,
        "tags": oc.key.defaults.tags,
    });
    let mode = oc.key.mode.as_str();
    conn.execute(
        "INSERT INTO rollouts(id, grp, task, mode, status, token_hash, created, updated, origin)
         VALUES (?1, NULL, ?2, ?3, 'running', 'online', ?4, ?4, 'online')",
        params![rid, task.to_string(), mode, now],
    )?;
    conn.execute(
        "INSERT INTO online_sessions(rollout_id, key_id, session_key, user, started, updated)
         VALUES (?1, ?2, ?3, ?4, ?5, ?5)",
        params![rid, oc.key.id, oc.session, oc.user, now],
    )?;
    Ok((rid, true))
}

/// The tail a following call must extend: the first choice's prompt + completion.
pub fn tail_of(records: &[CallRecord]) -> Option<(usize, [u8; 32])> {
    let r = records.first()?;
    let (p, c) = (r.prompt_ids.as_ref()?, r.completion_ids.as_ref()?);
    let mut all = Vec::with_capacity(p.len() + c.len());
    all.extend_from_slice(p);
    all.extend_from_slice(c);
    Some((all.len(), ids_hash(&all)))
}

/// Records a call on its session: count, time, tail.
pub fn touch_session(
    conn: &Connection,
    rollout_id: &str,
    tail: Option<(usize, [u8; 32])>,
    now: f64,
) -> rusqlite::Result<()> {
    let (len, hash) = match tail {
        Some((l, h)) => (Some(l as i64), Some(h.to_vec())),
        None => (None, None),
    };
    conn.execute(
        "UPDATE online_sessions SET n_calls = n_calls + 1, updated = ?2,
           tail_len = COALESCE(?3, tail_len), tail_hash = COALESCE(?4, tail_hash)
         WHERE rollout_id = ?1",
        params![rollout_id, now, len, hash],
    )?;
    conn.execute(
        "UPDATE rollouts SET updated = ?2, status = 'running' WHERE id = ?1",
        params![rollout_id, now],
    )?;
    Ok(())
}

/// Drops the text of a redacted key's call (ids, logprobs and metadata stay).
pub fn redact(records: &mut [CallRecord]) {
    for r in records {
        r.request = r#"{"redacted":true}"#.to_string();
        r.harness_request = r#"{"redacted":true}"#.to_string();
        r.text = None;
    }
}

pub fn apply(conn: &Connection, op: Op, now: f64) -> rusqlite::Result<Outcome> {
    match op {
        Op::CreateKey {
            id,
            name,
            token_hash,
            defaults,
        } => {
            conn.execute(
                "INSERT INTO app_keys(id, name, token_hash, defaults, created) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![id, name, token_hash, defaults.to_string(), now],
            )?;
            Ok(Outcome::Key(KeyRow {
                id,
                name,
                defaults,
                created: now,
                revoked: None,
            }))
        }
        Op::RevokeKey { id } => {
            let n = conn.execute(
                "UPDATE app_keys SET revoked = ?2 WHERE id = ?1 AND revoked IS NULL",
                params![id, now],
            )?;
            Ok(Outcome::Found(n == 1))
        }
        Op::Feedback(f) => feedback(conn, &f, now).map(Outcome::Feedback),
        Op::Sweep {
            idle_before,
            retain_after,
            retain_bytes,
        } => super::retention::sweep(conn, idle_before, retain_after, retain_bytes, now)
            .map(Outcome::Swept),
        Op::MarkTrained { rollout_ids, when } => {
            let mut stmt = conn
                .prepare_cached("UPDATE online_sessions SET trained = ?1 WHERE rollout_id = ?2")?;
            let mut n = 0;
            for rid in &rollout_ids {
                n += stmt.execute(params![when, rid])?;
            }
            Ok(Outcome::Marked(n))
        }
    }
}

/// Stores one signal (idempotent on its feedback id); the caller adds the
/// `feedback` event to the session's rollout when it is new.
pub fn feedback(conn: &Connection, f: &NewFeedback, now: f64) -> rusqlite::Result<FeedbackOutcome> {
    let prior: Option<(String, String, f64, bool, Option<String>)> = conn
        .query_row(
            "SELECT rollout_id, name, value, after_training, response_id FROM feedback WHERE key_id = ?1 AND feedback_id = ?2",
            params![f.key_id, f.feedback_id],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get::<_, i64>(3)? != 0, r.get(4)?)),
        )
        .optional()?;
    if let Some((rollout_id, name, value, after_training, response_id)) = prior {
        // The same id for another target is a client bug, not a resend.
        let same_target = match (&f.response_id, &f.session) {
            (Some(r), _) => response_id.as_deref() == Some(r.as_str()),
            (None, Some(s)) => {
                let key: Option<String> = conn
                    .query_row(
                        "SELECT session_key FROM online_sessions WHERE rollout_id = ?1",
                        params![rollout_id],
                        |r| r.get(0),
                    )
                    .optional()?
                    .flatten();
                response_id.is_none() && (&rollout_id == s || key.as_deref() == Some(s.as_str()))
            }
            (None, None) => false,
        };
        if !same_target {
            let was = match &response_id {
                Some(r) => format!("response_id {r:?}"),
                None => format!("session {rollout_id:?}"),
            };
            return Ok(FeedbackOutcome::Conflict(format!(
                "feedback_id {:?} was already used for another target ({was}); a feedback id names one signal on one target: send a new feedback_id",
                f.feedback_id
            )));
        }
        if name == f.name && value == f.value {
            return Ok(FeedbackOutcome::Stored {
                rollout_id,
                after_training,
                duplicate: true,
            });
        }
        return Ok(FeedbackOutcome::Conflict(format!(
            "feedback_id {:?} was already used for {name}={value}; send a new feedback_id for a new signal",
            f.feedback_id
        )));
    }
    let target: Vec<String> = if let Some(resp) = &f.response_id {
        let mut stmt = conn.prepare_cached(
            "SELECT DISTINCT c.rollout_id FROM calls c JOIN online_sessions s ON s.rollout_id = c.rollout_id
             WHERE c.response_id = ?1 AND s.key_id = ?2 LIMIT 2",
        )?;
        let rows = stmt.query_map(params![resp, f.key_id], |r| r.get(0))?;
        rows.collect::<rusqlite::Result<_>>()?
    } else if let Some(s) = &f.session {
        let mut stmt = conn.prepare_cached(
            "SELECT rollout_id FROM online_sessions WHERE key_id = ?1 AND (rollout_id = ?2 OR session_key = ?2)
             ORDER BY started DESC LIMIT 1",
        )?;
        let rows = stmt.query_map(params![f.key_id, s], |r| r.get(0))?;
        rows.collect::<rusqlite::Result<_>>()?
    } else {
        Vec::new()
    };
    let what = match (&f.response_id, &f.session) {
        (Some(r), _) => format!("response_id {r:?}"),
        (None, Some(s)) => format!("session_id {s:?}"),
        _ => "nothing".to_string(),
    };
    let rollout_id = match target.as_slice() {
        [] => {
            return Ok(FeedbackOutcome::NotFound(format!(
                "no call or session of this application key has {what}; send the id the API returned (chatcmpl-…, resp_…, msg_…) or the session id"
            )))
        }
        [one] => one.clone(),
        _ => {
            return Ok(FeedbackOutcome::Ambiguous(format!(
                "{what} names calls in more than one session (the engine reuses ids); send session_id instead"
            )))
        }
    };
    let trained: Option<f64> = conn.query_row(
        "SELECT trained FROM online_sessions WHERE rollout_id = ?1",
        params![rollout_id],
        |r| r.get(0),
    )?;
    let after_training = trained.is_some();
    conn.execute(
        "INSERT INTO feedback(key_id, feedback_id, rollout_id, response_id, name, value, data, ts, created, after_training)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
        params![
            f.key_id,
            f.feedback_id,
            rollout_id,
            f.response_id,
            f.name,
            f.value,
            f.data.to_string(),
            f.ts,
            now,
            after_training as i64
        ],
    )?;
    Ok(FeedbackOutcome::Stored {
        rollout_id,
        after_training,
        duplicate: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prefix_hashes_match_whole_hashes() {
        let ids: Vec<u32> = (0..50).map(|i| i * 7 + 1).collect();
        let lengths = [0, 1, 10, 10, 49, 50];
        let got = prefix_hashes(&ids, &lengths);
        for (n, h) in lengths.iter().zip(got) {
            assert_eq!(h, ids_hash(&ids[..*n]));
        }
        assert_ne!(ids_hash(&[1, 2]), ids_hash(&[1, 3]));
    }

    #[test]
    fn defaults_are_validated() {
        assert!(KeyDefaults::parse(Some(&json!({"mode": "prod"}))).is_err());
        assert!(KeyDefaults::parse(Some(&json!({"temperatur": 1.0}))).is_err());
        let d = KeyDefaults::parse(Some(&json!({"tags": ["a"], "redact": true})));
        assert!(matches!(
            d,
            Ok(KeyDefaults {
                redact: true,
                temperature: None,
                ..
            })
        ));
    }
}
