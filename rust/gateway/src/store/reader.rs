//! Every read of the store: the HTTP routes, the writer's own look-ups,
//! `lightning.Store`, a training step and online mode all go through the
//! functions here, so the SQL that turns rows back into values exists once.
//!
//! [`Reader`] opens the SQLite file read-only beside a running gateway (WAL mode
//! lets it see every committed call without blocking the writer). A training
//! step's batch comes out in one read transaction ([`Reader::read_step`]): the
//! selected rollouts with group, mode, status and latest reward, and their
//! trainable calls with exact ids, logprobs and weight versions, so what trains
//! is a consistent snapshot of what is on disk.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use lightning_core::Call;
use rusqlite::{params, Connection, OpenFlags, OptionalExtension, TransactionBehavior};

use serde_json::Value;

use super::columnar::{blob_to_f32s, blob_to_ids};
use super::online::{KeyRow, SessionFilter, SessionPage, SessionRow};
use super::prefix::{self, Resolver};
use super::records::{
    CallBody, CallRate, EventRecord, FeedbackRecord, RateBucket, RolloutRecord, RolloutRow,
    Selection, StepData, StoredCall,
};
use crate::error::GatewayError;

const ROLLOUT_COLUMNS: &str = "id, grp, task, mode, status, created, updated";

fn rollout_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<RolloutRecord> {
    Ok(RolloutRecord {
        rollout_id: r.get(0)?,
        group: r.get(1)?,
        task: r.get(2)?,
        mode: r.get(3)?,
        status: r.get(4)?,
        reward: None,
        created: r.get(5)?,
        updated: r.get(6)?,
    })
}

/// The latest reward of a rollout (`None` without one, or when its `value` is
/// not a number).
pub fn latest_reward(conn: &Connection, rollout_id: &str) -> rusqlite::Result<Option<f64>> {
    let data: Option<String> = conn
        .prepare_cached(
            "SELECT data FROM events WHERE rollout_id = ?1 AND type = 'reward' ORDER BY seq DESC LIMIT 1",
        )?
        .query_row(params![rollout_id], |r| r.get(0))
        .optional()?;
    Ok(data
        .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
        .and_then(|v| v.get("value").and_then(serde_json::Value::as_f64)))
}

/// The SQL of a rollout listing: only the filters given (`?1` status, `?2`
/// mode, `?3` group), keyset paging after `(?4 created, ?5 id)` when
/// `after`, at most `?6` rows (-1: all), in `(created, id)` order. Filters are
/// left out rather than written `?1 IS NULL OR …` so that SQLite can walk one
/// of the `rollouts_*created` indexes from the page's start and stop after
/// `?6` rows (`tests::a_page_reads_its_rows_not_the_table`).
pub(crate) fn rollout_page_sql(sel: &Selection, after: bool) -> String {
    let mut cond = Vec::new();
    if sel.status.is_some() {
        cond.push("status = ?1");
    }
    if sel.mode.is_some() {
        cond.push("mode = ?2");
    }
    if sel.group.is_some() {
        cond.push("grp = ?3");
    }
    if after {
        cond.push("(created, id) > (?4, ?5)");
    }
    let filter = if cond.is_empty() {
        String::new()
    } else {
        format!("WHERE {}", cond.join(" AND "))
    };
    format!("SELECT {ROLLOUT_COLUMNS} FROM rollouts {filter} ORDER BY created, id LIMIT ?6")
}

/// Rollouts matching `sel`, each with its latest reward: by id (in the order
/// given), or in creation order, one keyset page at a time (`after`, `limit`).
pub fn rollouts(conn: &Connection, sel: &Selection) -> rusqlite::Result<Vec<RolloutRecord>> {
    let mut out = match &sel.rollout_ids {
        Some(ids) => {
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT {ROLLOUT_COLUMNS} FROM rollouts WHERE id = ?1"
            ))?;
            let mut out = Vec::with_capacity(ids.len());
            for id in ids {
                if let Some(r) = stmt.query_row(params![id], rollout_row).optional()? {
                    out.push(r);
                }
            }
            out.retain(|r| {
                sel.group
                    .as_ref()
                    .is_none_or(|g| r.group.as_ref() == Some(g))
                    && sel.status.as_ref().is_none_or(|s| &r.status == s)
                    && sel.mode.as_ref().is_none_or(|m| &r.mode == m)
            });
            out
        }
        None => {
            let after = match &sel.after {
                None => None,
                Some(id) => {
                    let key = conn
                        .prepare_cached("SELECT created, id FROM rollouts WHERE id = ?1")?
                        .query_row(params![id], |r| {
                            Ok((r.get::<_, f64>(0)?, r.get::<_, String>(1)?))
                        })
                        .optional()?;
                    match key {
                        Some(k) => Some(k),
                        None => return Ok(Vec::new()),
                    }
                }
            };
            let mut stmt = conn.prepare_cached(&rollout_page_sql(sel, after.is_some()))?;
            let (after_created, after_id) = after.unzip();
            let rows = stmt.query_map(
                params![
                    sel.status,
                    sel.mode,
                    sel.group,
                    after_created,
                    after_id,
                    sel.limit.unwrap_or(-1)
                ],
                rollout_row,
            )?;
            rows.collect::<rusqlite::Result<Vec<_>>>()?
        }
    };
    for r in &mut out {
        r.reward = latest_reward(conn, &r.rollout_id)?;
    }
    Ok(out)
}

/// Rollouts per `(mode, status)`, by SQL aggregate (one pass, not a row per
/// rollout to the caller); online sessions as `("online", "open" | "closed")`.
pub fn rollout_counts(conn: &Connection) -> rusqlite::Result<Vec<(String, String, i64)>> {
    let mut stmt = conn.prepare_cached(
        // An online session is a rollout row too (`mode` train, `status`
        // running until closed): counted as mode `online`, status open/closed.
        "SELECT CASE WHEN r.origin = 'online' THEN 'online' ELSE r.mode END AS m,
                CASE WHEN r.origin = 'online'
                     THEN CASE WHEN s.closed THEN 'closed' ELSE 'open' END
                     ELSE r.status END AS st,
                COUNT(*)
         FROM rollouts r LEFT JOIN online_sessions s ON s.rollout_id = r.id
         GROUP BY m, st ORDER BY m, st",
    )?;
    let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
    rows.collect()
}

/// Most buckets one `call_rate` returns (a longer window gets wider buckets).
pub const MAX_RATE_BUCKETS: f64 = 2000.0;

/// Per bucket `b` (counted from `?3`, the window's first): calls, upstream
/// errors, aborted calls, for calls created at or after `?1`.
const CALL_RATE_SQL: &str = "SELECT CAST(created / ?2 AS INTEGER) - ?3 AS b, COUNT(*),
        SUM(status = 'upstream_error'), SUM(status = 'aborted')
 FROM calls WHERE created >= ?1 GROUP BY b ORDER BY b";

/// Calls, upstream errors and aborted calls per `bucket_s` over the `window_s`
/// that ends at the latest call (so a finished store shows its last activity,
/// and a live one the last minutes). Buckets are aligned to multiples of
/// `bucket_s`, so a poll sees the same buckets fill rather than shift. Reads
/// the window's rows from the `calls_created` index only.
pub fn call_rate(conn: &Connection, window_s: f64, bucket_s: f64) -> rusqlite::Result<CallRate> {
    let window_s = if window_s.is_finite() && window_s > 0.0 {
        window_s
    } else {
        600.0
    };
    let bucket_s = if bucket_s.is_finite() && bucket_s > 0.0 {
        bucket_s.max(window_s / MAX_RATE_BUCKETS)
    } else {
        5.0
    };
    let end: Option<f64> = conn
        .prepare_cached("SELECT MAX(created) FROM calls")?
        .query_row([], |r| r.get(0))?;
    let Some(end) = end else {
        return Ok(CallRate {
            end: None,
            bucket_s,
            buckets: Vec::new(),
        });
    };
    let first = ((end - window_s) / bucket_s).floor();
    let last = (end / bucket_s).floor();
    let n = (last - first) as usize + 1;
    let mut buckets: Vec<RateBucket> = (0..n)
        .map(|i| RateBucket {
            start: (first + i as f64) * bucket_s,
            ..RateBucket::default()
        })
        .collect();
    let mut stmt = conn.prepare_cached(CALL_RATE_SQL)?;
    let rows = stmt.query_map(params![first * bucket_s, bucket_s, first as i64], |r| {
        Ok((
            r.get::<_, i64>(0)?,
            r.get::<_, i64>(1)?,
            r.get::<_, i64>(2)?,
            r.get::<_, i64>(3)?,
        ))
    })?;
    for row in rows {
        let (b, calls, upstream_errors, aborted) = row?;
        if let Some(slot) = usize::try_from(b).ok().and_then(|b| buckets.get_mut(b)) {
            slot.calls = calls;
            slot.upstream_errors = upstream_errors;
            slot.aborted = aborted;
        }
    }
    Ok(CallRate {
        end: Some(end),
        bucket_s,
        buckets,
    })
}

/// Every recorded call of a rollout in seq order, trainable or not, with its
/// prompt ids whole: a prefix-shared row (`prefix`) is joined to its base,
/// read earlier in the same pass, so every stored token is read once.
pub fn records(conn: &Connection, rollout_id: &str) -> rusqlite::Result<Vec<StoredCall>> {
    let refs = if layout_2(conn)? {
        "prompt_base, prompt_shared"
    } else {
        "NULL, NULL"
    };
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT seq, request_id, choice_index, kind, prompt_ids, completion_ids, logprobs,
                finish_reason, text, status, flags, delivered, retry_count, weight_version,
                upstream, http_status, latency_ms, usage, created, {refs}
         FROM calls WHERE rollout_id = ?1 ORDER BY seq"
    ))?;
    let mut rows = stmt.query(params![rollout_id])?;
    let mut out: Vec<StoredCall> = Vec::new();
    let mut bases = Resolver::default();
    while let Some(r) = rows.next()? {
        let flags: String = r.get(10)?;
        let seq: i64 = r.get(0)?;
        let mut prompt_ids = r.get::<_, Option<Vec<u8>>>(4)?.map(|b| blob_to_ids(&b));
        if let (Some(base), Some(shared)) =
            (r.get::<_, Option<i64>>(19)?, r.get::<_, Option<i64>>(20)?)
        {
            let b = &out[bases.base(base, seq)?];
            let suffix = prompt_ids.unwrap_or_default();
            prompt_ids = Some(prefix::join_ids(
                b.prompt_ids.as_deref().unwrap_or(&[]),
                b.completion_ids.as_deref().unwrap_or(&[]),
                usize::try_from(shared).unwrap_or(usize::MAX),
                &suffix,
            )?);
        }
        bases.add(seq, out.len());
        out.push(StoredCall {
            seq,
            request_id: r.get(1)?,
            choice_index: r.get(2)?,
            kind: r.get(3)?,
            prompt_ids,
            completion_ids: r.get::<_, Option<Vec<u8>>>(5)?.map(|b| blob_to_ids(&b)),
            logprobs: r.get::<_, Option<Vec<u8>>>(6)?.map(|b| blob_to_f32s(&b)),
            finish_reason: r.get(7)?,
            text: r.get(8)?,
            status: r.get(9)?,
            flags: flags
                .split(',')
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect(),
            delivered: r.get::<_, i64>(11)? != 0,
            retry_count: r.get(12)?,
            weight_version: r.get(13)?,
            upstream: r.get(14)?,
            http_status: r.get(15)?,
            latency_ms: r.get(16)?,
            usage: r
                .get::<_, Option<String>>(17)?
                .and_then(|s| serde_json::from_str(&s).ok()),
            created: r.get(18)?,
        });
    }
    Ok(out)
}

/// Whether the file has layout 2's columns: a layout-1 file opened read-only
/// (no writer has migrated it) has none, and all its rows are whole.
fn layout_2(conn: &Connection) -> rusqlite::Result<bool> {
    conn.prepare_cached(
        "SELECT COUNT(*) > 0 FROM pragma_table_info('calls') WHERE name = 'text_base'",
    )?
    .query_row([], |r| r.get(0))
}

/// A body column of a row: whole, or its base's head and tail around the
/// stored middle.
fn body(
    base: Option<&str>,
    head: Option<i64>,
    tail: Option<i64>,
    stored: Option<String>,
) -> Result<Option<String>, prefix::Damaged> {
    match (base, head, tail, stored) {
        (Some(b), Some(h), Some(t), Some(middle)) => {
            let c = prefix::Cut {
                head: usize::try_from(h).unwrap_or(usize::MAX),
                tail: usize::try_from(t).unwrap_or(usize::MAX),
            };
            prefix::join_text(b, c, &middle).map(Some)
        }
        (None, Some(_), _, _) => Err(prefix::Damaged(
            "a request refers to one that has no body".into(),
        )),
        (_, _, _, stored) => Ok(stored),
    }
}

/// Each call's engine request and harness request, whole, in seq order
/// (`""` and `None` on a request's later choices, which store neither).
/// `want_request = false` leaves the engine request out (`""`): online mode
/// reads only what the harness sent.
pub fn requests(
    conn: &Connection,
    rollout_id: &str,
    want_request: bool,
) -> rusqlite::Result<Vec<(i64, String, Option<String>)>> {
    let refs = match (layout_2(conn)?, want_request) {
        (true, true) => "text_base, request_head, request_tail, harness_head, harness_tail",
        (true, false) => "text_base, NULL, NULL, harness_head, harness_tail",
        (false, _) => "NULL, NULL, NULL, NULL, NULL",
    };
    let request = if want_request { "request" } else { "NULL" };
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT seq, {request}, harness_request, {refs} FROM calls WHERE rollout_id = ?1 ORDER BY seq"
    ))?;
    let mut rows = stmt.query(params![rollout_id])?;
    let mut out: Vec<(i64, String, Option<String>)> = Vec::new();
    let mut bases = Resolver::default();
    while let Some(r) = rows.next()? {
        let seq: i64 = r.get(0)?;
        let base = match r.get::<_, Option<i64>>(3)? {
            Some(b) => Some(&out[bases.base(b, seq)?]),
            None => None,
        };
        let request = body(base.map(|b| b.1.as_str()), r.get(4)?, r.get(5)?, r.get(1)?)?;
        let harness = body(
            base.and_then(|b| b.2.as_deref()),
            r.get(6)?,
            r.get(7)?,
            r.get(2)?,
        )?;
        bases.add(seq, out.len());
        out.push((seq, request.unwrap_or_default(), harness));
    }
    Ok(out)
}

/// Every event of a rollout in seq order.
pub fn events(conn: &Connection, rollout_id: &str) -> rusqlite::Result<Vec<EventRecord>> {
    let mut stmt = conn.prepare_cached(
        "SELECT seq, type, data, created FROM events WHERE rollout_id = ?1 ORDER BY seq",
    )?;
    let rows = stmt.query_map(params![rollout_id], |r| {
        Ok(EventRecord {
            seq: r.get(0)?,
            kind: r.get(1)?,
            data: r.get(2)?,
            created: r.get(3)?,
        })
    })?;
    rows.collect()
}

const ROLLOUT_ROW_COLUMNS: &str = "id, grp, task, mode, status, token_hash, created, updated";

fn rollout_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<RolloutRow> {
    let task: String = r.get(2)?;
    Ok(RolloutRow {
        rollout_id: r.get(0)?,
        group: r.get(1)?,
        task: serde_json::from_str(&task).unwrap_or(serde_json::Value::Null),
        mode: r.get(3)?,
        status: r.get(4)?,
        token_hash: r.get(5)?,
        created: r.get(6)?,
        updated: r.get(7)?,
    })
}

/// One rollout by id (also the writer's answer to a create).
pub fn rollout(conn: &Connection, id: &str) -> rusqlite::Result<Option<RolloutRow>> {
    conn.prepare_cached(&format!(
        "SELECT {ROLLOUT_ROW_COLUMNS} FROM rollouts WHERE id = ?1"
    ))?
    .query_row(params![id], rollout_from_row)
    .optional()
}

/// The rollout a token hash authorizes.
pub fn rollout_by_token_hash(
    conn: &Connection,
    hash: &str,
) -> rusqlite::Result<Option<RolloutRow>> {
    conn.prepare_cached(&format!(
        "SELECT {ROLLOUT_ROW_COLUMNS} FROM rollouts WHERE token_hash = ?1"
    ))?
    .query_row(params![hash], rollout_from_row)
    .optional()
}

/// Rollouts by status and group, oldest first, at most `limit`.
pub fn list_rollouts(
    conn: &Connection,
    status: Option<&str>,
    group: Option<&str>,
    limit: i64,
) -> rusqlite::Result<Vec<RolloutRow>> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {ROLLOUT_ROW_COLUMNS} FROM rollouts
         WHERE (?1 IS NULL OR status = ?1) AND (?2 IS NULL OR grp = ?2)
         ORDER BY created, id LIMIT ?3"
    ))?;
    let rows = stmt.query_map(params![status, group, limit], rollout_from_row)?;
    rows.collect()
}

/// Number of calls and the latest reward of a rollout.
pub fn rollout_summary(conn: &Connection, id: &str) -> rusqlite::Result<(i64, Option<f64>)> {
    let n: i64 = conn
        .prepare_cached("SELECT COUNT(*) FROM calls WHERE rollout_id = ?1")?
        .query_row(params![id], |r| r.get(0))?;
    Ok((n, latest_reward(conn, id)?))
}

/// A kept protocol object (`Kept`) of this rollout: `(object, state)`.
pub fn kept(
    conn: &Connection,
    rollout_id: &str,
    id: &str,
) -> rusqlite::Result<Option<(Value, Value)>> {
    let row = conn
        .prepare_cached("SELECT object, state FROM kept WHERE id = ?1 AND rollout_id = ?2")?
        .query_row(params![id, rollout_id], |r| {
            Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?))
        })
        .optional()?;
    Ok(row.map(|(o, s)| {
        (
            serde_json::from_str(&o).unwrap_or(Value::Null),
            serde_json::from_str(&s).unwrap_or(Value::Null),
        )
    }))
}

/// What a call carries besides its tokens, for online mode's grouping and
/// export: the protocol, the harness's own request and the response id it
/// was given, in seq order. (Kept out of `records`: the bodies are large and
/// a training step never needs them.)
pub fn call_bodies(conn: &Connection, rollout_id: &str) -> rusqlite::Result<Vec<CallBody>> {
    let mut stmt = conn.prepare_cached(
        "SELECT seq, protocol, response_id FROM calls WHERE rollout_id = ?1 ORDER BY seq",
    )?;
    let rows = stmt.query_map(params![rollout_id], |r| {
        Ok((r.get::<_, i64>(0)?, r.get(1)?, r.get(2)?))
    })?;
    let heads = rows.collect::<rusqlite::Result<Vec<(i64, Option<String>, Option<String>)>>>()?;
    let bodies = requests(conn, rollout_id, false)?;
    Ok(heads
        .into_iter()
        .zip(bodies)
        .map(
            |((seq, protocol, response_id), (_, _, harness_request))| CallBody {
                seq,
                protocol,
                harness_request,
                response_id,
            },
        )
        .collect())
}

// ------------------------------------------------------------ online mode

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

/// The columns of a `SessionRow` (`session_from_row`), `nf` its feedback count.
const SESSION_FROM: &str =
    "SELECT s.rollout_id, s.key_id, k.name, s.session_key, s.user, s.n_calls, s.started,
                s.updated, s.closed, s.trained,
                (SELECT COUNT(*) FROM feedback f WHERE f.rollout_id = s.rollout_id) AS nf,
                COALESCE(r.task, '{}')
         FROM online_sessions s LEFT JOIN app_keys k ON k.id = s.key_id
              LEFT JOIN rollouts r ON r.id = s.rollout_id";

fn session_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<SessionRow> {
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
        task: r.get(11)?,
    })
}

pub fn list_sessions(c: &Connection, f: &SessionFilter) -> rusqlite::Result<Vec<SessionRow>> {
    let mut stmt = c.prepare_cached(&format!(
        "{SESSION_FROM}
         WHERE (?1 IS NULL OR s.key_id = ?1) AND (?2 IS NULL OR s.closed = ?2)
           AND (?3 IS NULL OR (nf > 0) = ?3)
           AND (?5 IS NULL OR s.updated >= ?5) AND (?6 IS NULL OR s.updated < ?6)
         ORDER BY CASE WHEN ?7 THEN s.updated END, s.updated DESC, s.rollout_id LIMIT ?4"
    ))?;
    let args = params![
        f.key_id,
        f.closed,
        f.with_feedback,
        f.limit,
        f.updated_from,
        f.updated_before,
        f.oldest_first
    ];
    let rows = stmt.query_map(args, session_from_row)?;
    rows.collect()
}

/// The SQL of a session page: only the filters given (`?1` key id or name,
/// `?2` tag, feedback and trained as fixed clauses), keyset paging before
/// `(?3 updated, ?4 rollout_id)` when `after`, at most `?5` rows, newest
/// activity first: the `online_sessions_updated` index walked backwards, so a
/// page stops after its rows instead of sorting every session.
pub(crate) fn session_page_sql(p: &SessionPage, after: bool) -> String {
    let mut cond = Vec::new();
    if p.key.is_some() {
        cond.push("(s.key_id = ?1 OR k.name = ?1)");
    }
    if p.tag.is_some() {
        cond.push("EXISTS (SELECT 1 FROM json_each(r.task, '$.tags') t WHERE t.value = ?2)");
    }
    match p.with_feedback {
        Some(true) => cond.push("nf > 0"),
        Some(false) => cond.push("nf = 0"),
        None => {}
    }
    match p.trained {
        Some(true) => cond.push("s.trained IS NOT NULL"),
        Some(false) => cond.push("s.trained IS NULL"),
        None => {}
    }
    if after {
        cond.push("(s.updated, s.rollout_id) < (?3, ?4)");
    }
    let filter = if cond.is_empty() {
        String::new()
    } else {
        format!("WHERE {}", cond.join(" AND "))
    };
    format!("{SESSION_FROM} {filter} ORDER BY s.updated DESC, s.rollout_id DESC LIMIT ?5")
}

/// One page of online sessions, newest activity first (`SessionPage`).
pub fn session_page(c: &Connection, p: &SessionPage) -> rusqlite::Result<Vec<SessionRow>> {
    let after = match &p.after {
        None => None,
        Some(id) => {
            let key = c
                .prepare_cached(
                    "SELECT updated, rollout_id FROM online_sessions WHERE rollout_id = ?1",
                )?
                .query_row(params![id], |r| {
                    Ok((r.get::<_, f64>(0)?, r.get::<_, String>(1)?))
                })
                .optional()?;
            match key {
                Some(k) => Some(k),
                None => return Ok(Vec::new()),
            }
        }
    };
    let mut stmt = c.prepare_cached(&session_page_sql(p, after.is_some()))?;
    let (after_updated, after_id) = after.unzip();
    let rows = stmt.query_map(
        params![p.key, p.tag, after_updated, after_id, p.limit],
        session_from_row,
    )?;
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

/// Every feedback signal of a session, in timestamp then arrival order.
pub fn feedback(conn: &Connection, rollout_id: &str) -> rusqlite::Result<Vec<FeedbackRecord>> {
    let mut stmt = conn.prepare_cached(
        "SELECT feedback_id, response_id, name, value, ts, after_training, data
         FROM feedback WHERE rollout_id = ?1 ORDER BY ts, id",
    )?;
    let rows = stmt.query_map(params![rollout_id], |r| {
        Ok(FeedbackRecord {
            feedback_id: r.get(0)?,
            response_id: r.get(1)?,
            name: r.get(2)?,
            value: r.get(3)?,
            ts: r.get(4)?,
            after_training: r.get::<_, i64>(5)? != 0,
            data: r.get(6)?,
        })
    })?;
    rows.collect()
}

/// Logprobs aligned with the completion: a flagged call whose engine sent
/// fewer logprobs than ids is padded with NaN (unknown), extra ones dropped,
/// the same as the columnar HTTP form.
fn aligned_logprobs(lp: Option<Vec<f32>>, n: usize) -> Option<Vec<f32>> {
    lp.map(|mut l| {
        l.resize(n, f32::NAN);
        l
    })
}

/// A stored call as a merge input, when the harness saw it whole and it has
/// exact ids and at least one completion token; else `None`.
pub fn trainable(rollout: &RolloutRecord, c: StoredCall) -> Option<Call> {
    if c.status != "ok" || !c.delivered {
        return None;
    }
    let (Some(prompt_ids), Some(completion_ids)) = (c.prompt_ids, c.completion_ids) else {
        return None;
    };
    if completion_ids.is_empty() {
        return None;
    }
    let logprobs = aligned_logprobs(c.logprobs, completion_ids.len());
    Some(Call {
        rollout_id: rollout.rollout_id.clone(),
        order: u32::try_from(c.seq).unwrap_or(u32::MAX),
        prompt_ids,
        completion_ids,
        logprobs,
        finish_reason: c.finish_reason,
        weight_version: u64::try_from(c.weight_version).unwrap_or(0),
        group: rollout.group.clone(),
    })
}

/// A read-only connection to a gateway's store file.
#[derive(Debug)]
pub struct Reader {
    path: PathBuf,
    conn: Mutex<Connection>,
    /// This process has the file open (`schema::HELD`) while `conn` lives.
    _held: super::schema::Held,
}

impl Reader {
    /// Opens `path` read-only; fails if there is no store there.
    pub fn open(path: &Path) -> Result<Reader, GatewayError> {
        if !path.is_file() {
            return Err(GatewayError::store(
                path.display(),
                "no gateway store here; pass the --db path the gateway was started with",
            ));
        }
        let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = Connection::open_with_flags(path, flags)
            .map_err(|e| GatewayError::store(path.display(), e))?;
        conn.busy_timeout(std::time::Duration::from_secs(30))
            .map_err(|e| GatewayError::store(path.display(), e))?;
        // A file without the meta table is not readable as a store either;
        // its reads fail with their own message.
        let version = super::schema::version(&conn).unwrap_or(1);
        if version > prefix::SCHEMA_VERSION {
            return Err(GatewayError::store(
                path.display(),
                format!(
                    "written in store layout {version}, this lightning reads up to {}; upgrade lightning to read it",
                    prefix::SCHEMA_VERSION
                ),
            ));
        }
        Ok(Reader {
            _held: super::schema::Held::new(path),
            path: path.to_path_buf(),
            conn: Mutex::new(conn),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn with<T>(
        &self,
        f: impl FnOnce(&mut Connection) -> rusqlite::Result<T>,
    ) -> Result<T, GatewayError> {
        let mut conn = self
            .conn
            .lock()
            .map_err(|_| GatewayError::store(self.path.display(), "reader lock poisoned"))?;
        f(&mut conn).map_err(|e| GatewayError::store(self.path.display(), e))
    }

    pub fn rollouts(&self, sel: &Selection) -> Result<Vec<RolloutRecord>, GatewayError> {
        self.with(|c| rollouts(c, sel))
    }

    pub fn records(&self, rollout_id: &str) -> Result<Vec<StoredCall>, GatewayError> {
        self.with(|c| records(c, rollout_id))
    }

    pub fn events(&self, rollout_id: &str) -> Result<Vec<EventRecord>, GatewayError> {
        self.with(|c| events(c, rollout_id))
    }

    /// Online sessions as `list_sessions` selects them.
    pub fn sessions(&self, filter: &SessionFilter) -> Result<Vec<SessionRow>, GatewayError> {
        self.with(|c| list_sessions(c, filter))
    }

    /// One page of online sessions, newest activity first.
    pub fn session_page(&self, page: &SessionPage) -> Result<Vec<SessionRow>, GatewayError> {
        self.with(|c| session_page(c, page))
    }

    /// Rollouts per `(mode, status)`.
    pub fn rollout_counts(&self) -> Result<Vec<(String, String, i64)>, GatewayError> {
        self.with(|c| rollout_counts(c))
    }

    /// Calls, upstream errors and aborts per bucket (see [`call_rate`]).
    pub fn call_rate(&self, window_s: f64, bucket_s: f64) -> Result<CallRate, GatewayError> {
        self.with(|c| call_rate(c, window_s, bucket_s))
    }

    /// Every feedback signal of a session.
    pub fn feedback(&self, rollout_id: &str) -> Result<Vec<FeedbackRecord>, GatewayError> {
        self.with(|c| feedback(c, rollout_id))
    }

    /// Each call's protocol, harness request and response id.
    pub fn call_bodies(&self, rollout_id: &str) -> Result<Vec<CallBody>, GatewayError> {
        self.with(|c| call_bodies(c, rollout_id))
    }

    /// Each call's `(seq, engine request, harness request)`, whole (see [`requests`]).
    pub fn requests(
        &self,
        rollout_id: &str,
    ) -> Result<Vec<(i64, String, Option<String>)>, GatewayError> {
        self.with(|c| requests(c, rollout_id, true))
    }

    /// The trainable calls of one rollout (empty for an unknown rollout).
    pub fn trace(&self, rollout_id: &str) -> Result<Vec<Call>, GatewayError> {
        let sel = Selection {
            rollout_ids: Some(vec![rollout_id.to_string()]),
            ..Selection::default()
        };
        Ok(self.read_step(&sel)?.calls)
    }

    /// The selected rollouts and their trainable calls, in one read transaction.
    pub fn read_step(&self, sel: &Selection) -> Result<StepData, GatewayError> {
        self.with(|conn| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Deferred)?;
            let mut out = StepData {
                rollouts: rollouts(&tx, sel)?,
                ..StepData::default()
            };
            for r in &out.rollouts {
                for c in records(&tx, &r.rollout_id)? {
                    match trainable(r, c) {
                        Some(call) => out.calls.push(call),
                        None => out.skipped_calls += 1,
                    }
                }
            }
            tx.finish()?;
            Ok(out)
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::config::SyncMode;
    use crate::store::{CallRecord, CallStatus, NewRollout, Store};

    fn record(rollout: &str, status: CallStatus, completion: Vec<u32>, lp: usize) -> CallRecord {
        CallRecord {
            rollout_id: rollout.into(),
            request_id: "req".into(),
            choice_index: 0,
            kind: "chat",
            request: "{}".into(),
            prompt_ids: Some(vec![1, 2]),
            logprobs: Some(vec![-0.5; lp]),
            completion_ids: Some(completion),
            finish_reason: Some("stop".into()),
            text: None,
            status,
            flags: vec![],
            delivered: true,
            retry_count: 0,
            weight_version: 3,
            upstream: "u".into(),
            http_status: 200,
            latency_ms: 1.0,
            usage: None,
            created: 0.0,
            protocol: "openai_chat",
            harness_request: "{}".into(),
            response_id: None,
        }
    }

    #[tokio::test]
    async fn step_reads_rollouts_rewards_and_trainable_calls() {
        let dir = std::env::temp_dir().join(format!("lightning-reader-{}", std::process::id()));
        let path = dir.join("t.db");
        let _ = std::fs::remove_file(&path);
        let store = Store::open(&path, SyncMode::Normal, crate::store::SecretSource::None).unwrap();
        for (id, grp) in [("a", Some("g")), ("b", Some("g")), ("c", None)] {
            store
                .create_rollout(NewRollout {
                    id: id.into(),
                    group: grp.map(str::to_string),
                    task: "{\"q\": 1}".into(),
                    mode: "train".into(),
                    token_hash: format!("h{id}"),
                })
                .await
                .unwrap();
        }
        let recs = vec![
            record("a", CallStatus::Ok, vec![3, 4], 1),
            record("a", CallStatus::Aborted, vec![5], 1),
            record("a", CallStatus::Ok, vec![], 0),
        ];
        store.insert_calls(recs, true, None).await.unwrap();
        store
            .insert_calls(vec![record("b", CallStatus::Ok, vec![7], 1)], true, None)
            .await
            .unwrap();
        store
            .insert_event("a", "reward", "{\"value\": 0.25}".into())
            .await
            .unwrap();
        store
            .insert_event("a", "reward", "{\"value\": 1.0}".into())
            .await
            .unwrap();
        let reader = Reader::open(&path).unwrap();
        let sel = Selection {
            rollout_ids: Some(vec!["b".into(), "a".into(), "missing".into()]),
            ..Selection::default()
        };
        let step = reader.read_step(&sel).unwrap();
        let ids: Vec<_> = step
            .rollouts
            .iter()
            .map(|r| r.rollout_id.as_str())
            .collect();
        assert_eq!(ids, ["b", "a"]);
        assert_eq!(step.rollouts[1].reward, Some(1.0));
        assert_eq!(step.rollouts[0].reward, None);
        assert_eq!(step.calls.len(), 2);
        assert_eq!(step.calls[0].rollout_id, "b");
        let a = &step.calls[1];
        assert_eq!(a.completion_ids, vec![3, 4]);
        // One logprob for two ids: padded with NaN, never shifted.
        let lp = a.logprobs.as_ref().unwrap();
        assert_eq!(lp[0], -0.5);
        assert!(lp[1].is_nan());
        assert_eq!((a.weight_version, a.group.as_deref()), (3, Some("g")));
        assert_eq!(step.skipped_calls, 2);
        let by_group = Selection {
            group: Some("g".into()),
            ..Selection::default()
        };
        assert_eq!(reader.rollouts(&by_group).unwrap().len(), 2);
        assert_eq!(reader.events("a").unwrap().len(), 2);
        assert_eq!(reader.records("a").unwrap().len(), 3);
        store.close();
        assert!(Reader::open(&dir.join("none.db")).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn plan(conn: &Connection, sql: &str) -> String {
        let mut stmt = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
        // The plan does not depend on the values: bind NULL to every parameter.
        let nulls = vec![rusqlite::types::Null; stmt.parameter_count()];
        let rows = stmt
            .query_map(rusqlite::params_from_iter(nulls), |r| r.get::<_, String>(3))
            .unwrap();
        rows.map(Result::unwrap).collect::<Vec<_>>().join("; ")
    }

    /// A page of a 20k-rollout store walks an index from the page's start and
    /// stops after its rows: the plan names the index and sorts nothing, and
    /// the statement's VM steps stay near the page size, not the table's.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_page_reads_its_rows_not_the_table() {
        const N: usize = 20_000;
        let dir = std::env::temp_dir().join(format!("lightning-page-{}", std::process::id()));
        let path = dir.join("t.db");
        let _ = std::fs::remove_dir_all(&dir);
        let store = std::sync::Arc::new(
            Store::open(&path, SyncMode::Normal, crate::store::SecretSource::None).unwrap(),
        );
        let mut tasks = Vec::with_capacity(N);
        for i in 0..N {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                store
                    .create_rollout(NewRollout {
                        id: format!("r{i:05}"),
                        group: Some(format!("g{}", i % 100)),
                        task: "{}".into(),
                        mode: if i.is_multiple_of(10) {
                            "eval"
                        } else {
                            "train"
                        }
                        .into(),
                        token_hash: format!("h{i}"),
                    })
                    .await
                    .unwrap();
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        store.set_status("r00007", "succeeded").await.unwrap();
        let reader = Reader::open(&path).unwrap();
        let conn = reader.conn.lock().unwrap();
        let filters = [
            Selection::default(),
            Selection {
                status: Some("queued".into()),
                ..Selection::default()
            },
            Selection {
                mode: Some("eval".into()),
                ..Selection::default()
            },
            Selection {
                group: Some("g3".into()),
                ..Selection::default()
            },
        ];
        for sel in &filters {
            for after in [false, true] {
                let p = plan(&conn, &rollout_page_sql(sel, after));
                assert!(p.contains("USING INDEX rollouts_"), "{sel:?}: {p}");
                assert!(!p.contains("TEMP B-TREE"), "{sel:?} sorts: {p}");
            }
        }
        // Pages follow each other with no gap or repeat, in creation order.
        let all = rollouts(&conn, &Selection::default()).unwrap();
        assert_eq!(all.len(), N);
        let mut seen = Vec::new();
        let mut sel = Selection {
            limit: Some(7_000),
            ..Selection::default()
        };
        loop {
            let page = rollouts(&conn, &sel).unwrap();
            let Some(last) = page.last() else { break };
            sel.after = Some(last.rollout_id.clone());
            seen.extend(page.into_iter().map(|r| r.rollout_id));
        }
        let ids: Vec<_> = all.iter().map(|r| r.rollout_id.clone()).collect();
        assert_eq!(seen, ids);
        // The VM steps of one 50-row page deep into the table, filtered by
        // mode: a scan of 20k rows would take well over 20k steps.
        let sel = Selection {
            mode: Some("eval".into()),
            ..Selection::default()
        };
        let eval: Vec<_> = all.iter().filter(|r| r.mode == "eval").collect();
        let mid = &eval[eval.len() / 2];
        let mut stmt = conn.prepare(&rollout_page_sql(&sel, true)).unwrap();
        let n = stmt
            .query_map(
                params![
                    None::<String>,
                    "eval",
                    None::<String>,
                    mid.created,
                    mid.rollout_id,
                    50
                ],
                |r| r.get::<_, String>(0),
            )
            .unwrap()
            .count();
        assert_eq!(n, 50);
        let steps = stmt.get_status(rusqlite::StatementStatus::VmStep);
        assert!(steps < 2_000, "a 50-row page took {steps} VM steps");
        assert_eq!(stmt.get_status(rusqlite::StatementStatus::FullscanStep), 0);
        drop(stmt);
        // An unknown `after` is an empty page, not the first page again.
        let lost = Selection {
            after: Some("gone".into()),
            ..Selection::default()
        };
        assert!(rollouts(&conn, &lost).unwrap().is_empty());
        let counts = rollout_counts(&conn).unwrap();
        assert_eq!(
            counts,
            vec![
                ("eval".into(), "queued".into(), 2_000),
                ("train".into(), "queued".into(), 17_999),
                ("train".into(), "succeeded".into(), 1),
            ]
        );
        // The sessions page: the same shape, on its own index.
        for page in [
            SessionPage::default(),
            SessionPage {
                key: Some("k".into()),
                tag: Some("t".into()),
                with_feedback: Some(true),
                trained: Some(false),
                ..SessionPage::default()
            },
        ] {
            let p = plan(&conn, &session_page_sql(&page, true));
            assert!(p.contains("online_sessions_updated"), "{page:?}: {p}");
            assert!(!p.contains("TEMP B-TREE"), "{page:?} sorts: {p}");
        }
        drop(conn);
        store.close();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn call_rate_buckets_the_window_before_the_latest_call() {
        let dir = std::env::temp_dir().join(format!("lightning-rate-{}", std::process::id()));
        let path = dir.join("t.db");
        let _ = std::fs::remove_dir_all(&dir);
        let store = Store::open(&path, SyncMode::Normal, crate::store::SecretSource::None).unwrap();
        let reader = Reader::open(&path).unwrap();
        assert_eq!(reader.call_rate(60.0, 10.0).unwrap().end, None);
        let mut recs = Vec::new();
        for (t, status) in [
            (1000.0, CallStatus::Ok), // outside the 60 s window
            (1041.0, CallStatus::Ok),
            (1042.0, CallStatus::UpstreamError),
            (1049.9, CallStatus::Aborted),
            (1075.0, CallStatus::Ok),
        ] {
            let mut r = record("a", status, vec![1], 1);
            r.created = t;
            recs.push(r);
        }
        store.insert_calls(recs, false, None).await.unwrap();
        let rate = reader.call_rate(60.0, 10.0).unwrap();
        assert_eq!(rate.end, Some(1075.0));
        let got: Vec<_> = rate
            .buckets
            .iter()
            .map(|b| (b.start, b.calls, b.upstream_errors, b.aborted))
            .collect();
        assert_eq!(
            got,
            vec![
                (1010.0, 0, 0, 0),
                (1020.0, 0, 0, 0),
                (1030.0, 0, 0, 0),
                (1040.0, 3, 1, 1),
                (1050.0, 0, 0, 0),
                (1060.0, 0, 0, 0),
                (1070.0, 1, 0, 0),
            ]
        );
        let conn = reader.conn.lock().unwrap();
        let p = plan(&conn, CALL_RATE_SQL);
        assert!(p.contains("COVERING INDEX calls_created"), "{p}");
        drop(conn);
        store.close();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
