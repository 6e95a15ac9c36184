//! Online-mode tables and the writer-side operations on them (run by the
//! store's single writer, inside its transactions; see `store::apply`).
//!
//! - `app_keys`: application keys (SHA-256 of the key, never the key).
//! - `online_sessions`: one row per session rollout: its key, explicit id,
//!   the token tail (last prompt + completion, as length + SHA-256) that a
//!   continuing prompt must start with, open/closed, and when it was trained.
//! - `feedback`: every signal ever posted, unique per (key, feedback id).

use rusqlite::{params, Connection, OptionalExtension};
use serde::Serialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::OnlineCall;
use crate::store::CallRecord;

pub const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS app_keys (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    token_hash TEXT NOT NULL UNIQUE,
    defaults TEXT NOT NULL,
    created REAL NOT NULL,
    revoked REAL
);
CREATE TABLE IF NOT EXISTS online_sessions (
    rollout_id TEXT PRIMARY KEY,
    key_id TEXT NOT NULL,
    session_key TEXT,
    user TEXT,
    tail_len INTEGER NOT NULL DEFAULT 0,
    tail_hash BLOB,
    n_calls INTEGER NOT NULL DEFAULT 0,
    started REAL NOT NULL,
    updated REAL NOT NULL,
    closed INTEGER NOT NULL DEFAULT 0,
    trained REAL
);
CREATE INDEX IF NOT EXISTS online_sessions_key ON online_sessions(key_id, session_key, started);
CREATE INDEX IF NOT EXISTS online_sessions_open ON online_sessions(key_id, closed, updated);
CREATE TABLE IF NOT EXISTS feedback (
    id INTEGER PRIMARY KEY,
    key_id TEXT NOT NULL,
    feedback_id TEXT NOT NULL,
    rollout_id TEXT NOT NULL,
    response_id TEXT,
    name TEXT NOT NULL,
    value REAL NOT NULL,
    data TEXT NOT NULL,
    ts REAL NOT NULL,
    created REAL NOT NULL,
    after_training INTEGER NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS feedback_key_id ON feedback(key_id, feedback_id);
CREATE INDEX IF NOT EXISTS feedback_rollout ON feedback(rollout_id);
CREATE INDEX IF NOT EXISTS calls_response_id ON calls(response_id);
"#;

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
    Session { rollout_id: String, created: bool },
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

pub fn key_by_hash(c: &Connection, hash: &str) -> rusqlite::Result<Option<KeyRow>> {
    c.query_row(
        "SELECT id, name, defaults, created, revoked FROM app_keys WHERE token_hash = ?1 AND revoked IS NULL",
        params![hash],
        key_from_row,
    )
    .optional()
}

pub fn list_keys(c: &Connection) -> rusqlite::Result<Vec<KeyRow>> {
    let mut stmt = c.prepare_cached(
        "SELECT id, name, defaults, created, revoked FROM app_keys ORDER BY created",
    )?;
    let rows = stmt.query_map([], key_from_row)?;
    rows.collect()
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
}

/// Which sessions to list: all filters optional; newest activity first.
#[derive(Debug, Clone, Default)]
pub struct SessionFilter {
    pub key_id: Option<String>,
    pub closed: Option<bool>,
    pub with_feedback: Option<bool>,
    pub limit: i64,
}

pub fn list_sessions(c: &Connection, f: &SessionFilter) -> rusqlite::Result<Vec<SessionRow>> {
    let mut stmt = c.prepare_cached(
        "SELECT s.rollout_id, s.key_id, k.name, s.session_key, s.user, s.n_calls, s.started,
                s.updated, s.closed, s.trained,
                (SELECT COUNT(*) FROM feedback f WHERE f.rollout_id = s.rollout_id) AS nf
         FROM online_sessions s LEFT JOIN app_keys k ON k.id = s.key_id
         WHERE (?1 IS NULL OR s.key_id = ?1) AND (?2 IS NULL OR s.closed = ?2)
           AND (?3 IS NULL OR (nf > 0) = ?3)
         ORDER BY s.updated DESC, s.rollout_id LIMIT ?4",
    )?;
    let rows = stmt.query_map(params![f.key_id, f.closed, f.with_feedback, f.limit], |r| {
        Ok(SessionRow {
            session_id: r.get(0)?,
            key_id: r.get(1)?,
            key_name: r.get(2)?,
            session_key: r.get(3)?,
            user: r.get(4)?,
            n_calls: r.get(5)?,
            started: r.get(6)?,
            updated: r.get(7)?,
            closed: r.get::<_, i64>(8)? != 0,
            trained: r.get(9)?,
            feedback: r.get(10)?,
        })
    })?;
    rows.collect()
}

/// The kept state of a protocol object (`resp_…`) in any session of this key.
pub fn kept_state(c: &Connection, key_id: &str, id: &str) -> rusqlite::Result<Option<Value>> {
    let s: Option<String> = c
        .query_row(
            "SELECT k.state FROM kept k JOIN online_sessions s ON s.rollout_id = k.rollout_id
             WHERE k.id = ?1 AND s.key_id = ?2",
            params![id, key_id],
            |r| r.get(0),
        )
        .optional()?;
    Ok(s.map(|s| serde_json::from_str(&s).unwrap_or(Value::Null)))
}

/// The public object of a kept protocol object (`resp_…`) in any session of this key.
pub fn kept_object(c: &Connection, key_id: &str, id: &str) -> rusqlite::Result<Option<Value>> {
    let s: Option<String> = c
        .query_row(
            "SELECT k.object FROM kept k JOIN online_sessions s ON s.rollout_id = k.rollout_id
             WHERE k.id = ?1 AND s.key_id = ?2",
            params![id, key_id],
            |r| r.get(0),
        )
        .optional()?;
    Ok(s.map(|s| serde_json::from_str(&s).unwrap_or(Value::Null)))
}

/// The kept state of the latest response in a Responses `conversation` (a
/// session key) of this key, across its sessions (one closed for idleness
/// included: the conversation goes on in the next).
pub fn conversation_state(
    c: &Connection,
    key_id: &str,
    conversation: &str,
) -> rusqlite::Result<Option<Value>> {
    let s: Option<String> = c
        .query_row(
            "SELECT k.state FROM kept k JOIN online_sessions s ON s.rollout_id = k.rollout_id
             WHERE s.key_id = ?1 AND s.session_key = ?2 AND k.protocol = 'openai_responses'
             ORDER BY k.created DESC, k.rowid DESC LIMIT 1",
            params![key_id, conversation],
            |r| r.get(0),
        )
        .optional()?;
    Ok(s.map(|s| serde_json::from_str(&s).unwrap_or(Value::Null)))
}

fn key_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<KeyRow> {
    let d: String = r.get(2)?;
    Ok(KeyRow {
        id: r.get(0)?,
        name: r.get(1)?,
        defaults: serde_json::from_str(&d).unwrap_or(Value::Null),
        created: r.get(3)?,
        revoked: r.get(4)?,
    })
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
    let rid = format!("on-{}", crate::auth::random_hex(10));
    let task = json!({
        "app_key": oc.key.name,
        "key_id": oc.key.id,
        "session_key": oc.session,
        "user": oc.user,
        "tags": oc.key.defaults.tags,
    });
    let mode = match oc.key.mode {
        crate::state::Mode::Eval => "eval",
        crate::state::Mode::Train => "train",
    };
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
        } => sweep(conn, idle_before, retain_after, retain_bytes, now).map(Outcome::Swept),
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

fn sweep(
    conn: &Connection,
    idle_before: f64,
    retain_after: Option<f64>,
    retain_bytes: Option<u64>,
    now: f64,
) -> rusqlite::Result<SweepReport> {
    conn.execute(
        "UPDATE rollouts SET status = 'succeeded', updated = ?2 WHERE id IN
           (SELECT rollout_id FROM online_sessions WHERE closed = 0 AND updated < ?1)",
        params![idle_before, now],
    )?;
    let closed = conn.execute(
        "UPDATE online_sessions SET closed = 1 WHERE closed = 0 AND updated < ?1",
        params![idle_before],
    )?;
    let mut doomed: Vec<String> = Vec::new();
    if let Some(after) = retain_after {
        let mut stmt = conn.prepare_cached(
            "SELECT rollout_id FROM online_sessions WHERE closed = 1 AND updated < ?1",
        )?;
        let rows = stmt.query_map(params![after], |r| r.get(0))?;
        doomed.extend(rows.collect::<rusqlite::Result<Vec<String>>>()?);
    }
    if let Some(limit) = retain_bytes {
        // Oldest first; every byte the session stores counts (ids, logprobs, bodies, text).
        let mut stmt = conn.prepare_cached(
            "SELECT s.rollout_id, s.closed, COALESCE(SUM(LENGTH(c.prompt_ids) + COALESCE(LENGTH(c.completion_ids), 0)
                + COALESCE(LENGTH(c.logprobs), 0) + LENGTH(c.request) + COALESCE(LENGTH(c.harness_request), 0)
                + COALESCE(LENGTH(c.text), 0)), 0)
             FROM online_sessions s LEFT JOIN calls c ON c.rollout_id = s.rollout_id
             GROUP BY s.rollout_id ORDER BY s.updated",
        )?;
        let rows: Vec<(String, bool, i64)> = stmt
            .query_map([], |r| Ok((r.get(0)?, r.get::<_, i64>(1)? != 0, r.get(2)?)))?
            .collect::<rusqlite::Result<_>>()?;
        let mut total: u64 = rows.iter().map(|r| r.2.max(0) as u64).sum();
        for (rid, closed, bytes) in rows {
            if total <= limit {
                break;
            }
            if closed && !doomed.contains(&rid) {
                doomed.push(rid);
                total = total.saturating_sub(bytes.max(0) as u64);
            }
        }
    }
    for rid in &doomed {
        for sql in [
            "DELETE FROM calls WHERE rollout_id = ?1",
            "DELETE FROM events WHERE rollout_id = ?1",
            "DELETE FROM kept WHERE rollout_id = ?1",
            "DELETE FROM feedback WHERE rollout_id = ?1",
            "DELETE FROM online_sessions WHERE rollout_id = ?1",
            "DELETE FROM rollouts WHERE id = ?1",
        ] {
            conn.execute(sql, params![rid])?;
        }
    }
    Ok(SweepReport {
        closed,
        deleted: doomed.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
