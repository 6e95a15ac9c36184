//! Retention: closing idle online sessions and deleting whole closed ones
//! past `retention_days` / `retention_bytes`. Runs on the single writer
//! (`super::online::Op::Sweep`).

use rusqlite::{params, Connection};

use super::online::SweepReport;

pub(super) fn sweep(
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
