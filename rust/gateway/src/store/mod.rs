//! The durable trace store: SQLite in WAL mode, one writer thread with group
//! commit, a few reader connections.
//!
//! Durability contract (docs/design.md#durability): every write API returns only after the
//! transaction holding it has committed, so a caller that acknowledges after
//! `await`ing a write never acknowledges something that is not on disk. The
//! writer drains everything queued while the previous commit ran into one
//! transaction, so under load one fsync covers many calls.
//!
//! Token ids are stored as little-endian u32 blobs, logprobs as little-endian
//! f32 blobs (NaN where the engine gave none). A call's prompt ids and request
//! bodies are stored as what they add to an earlier call of the rollout
//! (`prefix`, layout 2); readers return them whole.

//!
//! The one module that owns the schema: nothing else in the workspace opens
//! the database. `schema` (tables, migrations, opening a connection),
//! `records` (row types), `reader` (every read, also the writer's), `online`
//! (online mode's writes), `retention` (the sweep), `columnar` (ids and
//! logprobs as bytes), `secret` (the token secret, kept out of the file);
//! this file is the writer.
//!
//! One writer per store file: the writer holds an exclusive OS lock on the
//! database file itself (its inode, `schema::lock_writer`) for its lifetime,
//! opens it by its canonical path, and refuses a file with more than one
//! hard link, so a second gateway (or `mark_trained`) on the same file,
//! through any symlink, fails at once naming the holder's pid instead of
//! interleaving writes. The database, its `-wal`/`-shm` and the key file are
//! all mode 0600.

pub mod columnar;
pub mod online;
pub mod prefix;
pub mod reader;
pub mod records;
mod retention;
mod schema;
pub mod secret;

use rusqlite::{params, Connection};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;
use tokio::sync::oneshot;

use crate::util::now;
pub use columnar::{blob_to_f32s, blob_to_ids, f32s_to_blob, ids_to_blob};
pub use online::{AppKey, KeyDefaults, OnlineCall};

/// Whether a writer could open the store at `path` now: takes the writer's
/// lock and gives it back, opening no SQLite connection. An error names the
/// process that writes it (`StoreLocked`), like `Store::open` would.
/// Whether a `Store` or `Reader` of this process has the file at `path` (any
/// name of it) open now: another SQLite library must not open it then
/// (`schema::HELD` says why).
pub fn open_here(path: &Path) -> bool {
    schema::open_here(path)
}

pub fn check_writable(path: &Path) -> Result<(), GatewayError> {
    let lock = schema::lock_writer(path)?;
    schema::release(lock.file);
    Ok(())
}
pub use reader::Reader;
pub use records::{
    CallBody, CallRecord, CallStatus, EventRecord, FeedbackRecord, Mode, NewRollout, RolloutRecord,
    RolloutRow, Selection, StepData, StoredCall,
};
pub use secret::SecretSource;

use crate::config::{StoreLayout, SyncMode};
use crate::error::GatewayError;
use crate::protocol::Kept;

/// Most writes folded into one transaction.
const MAX_BATCH: usize = 4096;

#[derive(Debug)]
enum Op {
    CreateRollout(NewRollout),
    SetStatus {
        id: String,
        status: String,
    },
    InsertCalls {
        records: Vec<CallRecord>,
        mark_running: bool,
        kept: Option<Kept>,
    },
    InsertEvent {
        rollout_id: String,
        kind: String,
        data: String,
    },
    /// An application key's call: resolve its session, then insert as above.
    InsertOnline {
        records: Vec<CallRecord>,
        online: Arc<OnlineCall>,
        kept: Option<Kept>,
    },
    Online(online::Op),
    Barrier,
    /// A one-row write that proves the disk takes writes again.
    Probe,
}

#[derive(Debug)]
enum OpResult {
    Rollout { row: RolloutRow, created: bool },
    Found(bool),
    Seqs(Vec<i64>),
    Seq(i64),
    Online(online::Outcome),
    Unit,
}

type Reply = oneshot::Sender<Result<OpResult, String>>;

/// Counters the metrics endpoint reads.
#[derive(Debug, Default)]
pub struct StoreStats {
    pub queue_depth: AtomicI64,
    pub commits: AtomicUsize,
    pub committed_ops: AtomicUsize,
    /// Sum of commit durations in microseconds.
    pub commit_us_total: AtomicUsize,
    pub commit_us_max: AtomicUsize,
    /// Commit latency histogram (bucket upper bounds in COMMIT_BUCKETS_MS).
    pub commit_buckets: [AtomicUsize; 8],
    pub health: StoreHealth,
}

/// Whether the last write reached the disk. Set by the writer: unwritable
/// after a commit (or a write) fails with a disk error, writable again after
/// a commit that wrote rows. `Store::probe` makes such a commit.
#[derive(Debug, Default)]
pub struct StoreHealth {
    unwritable: AtomicBool,
    error: Mutex<Option<String>>,
}

impl StoreHealth {
    pub fn writable(&self) -> bool {
        !self.unwritable.load(Ordering::SeqCst)
    }

    /// The disk error that made the store unwritable (`None` while writable).
    pub fn error(&self) -> Option<String> {
        self.error.lock().ok().and_then(|g| g.clone())
    }

    fn failed(&self, message: String) {
        if let Ok(mut g) = self.error.lock() {
            *g = Some(message.clone());
        }
        if !self.unwritable.swap(true, Ordering::SeqCst) {
            tracing::error!(error = %message, "store cannot write; refusing work it cannot record until the disk recovers");
        }
    }

    fn recovered(&self) {
        if self.unwritable.swap(false, Ordering::SeqCst) {
            tracing::warn!("store writes again");
        }
        if let Ok(mut g) = self.error.lock() {
            *g = None;
        }
    }
}

/// Errors that say the disk refused a write, not that the write was wrong.
fn is_disk_error(e: &rusqlite::Error) -> bool {
    use rusqlite::ErrorCode as C;
    matches!(
        e.sqlite_error_code(),
        Some(C::DiskFull | C::SystemIoFailure | C::ReadOnly | C::CannotOpen | C::DatabaseCorrupt)
    )
}

pub const COMMIT_BUCKETS_MS: [f64; 8] = [0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 100.0, f64::INFINITY];

#[derive(Debug)]
pub struct Store {
    path: PathBuf,
    tx: Mutex<Option<mpsc::Sender<(Op, Reply)>>>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    readers: Vec<Mutex<Connection>>,
    next_reader: AtomicUsize,
    pub stats: Arc<StoreStats>,
    secret: Option<Vec<u8>>,
    /// The open database file carrying the writer's `flock`, released by `close`.
    lock: Mutex<Option<std::fs::File>>,
    /// This process has the file open (`schema::HELD`) while the readers live.
    _held: schema::Held,
}

impl Store {
    /// Opens `path` as its one writer: takes the writer lock (fails with
    /// `StoreLocked` while another writer holds it), creates the files 0600,
    /// brings the schema up to date and loads the token secret from `secret`.
    pub fn open(path: &Path, sync: SyncMode, secret: SecretSource) -> Result<Store, GatewayError> {
        Store::open_layout(path, sync, secret, StoreLayout::Shared)
    }

    /// `open`, writing calls in `layout` (`full`: every call whole, for comparisons).
    pub fn open_layout(
        path: &Path,
        sync: SyncMode,
        secret: SecretSource,
        layout: StoreLayout,
    ) -> Result<Store, GatewayError> {
        if let Some(parent) = path.parent() {
            if !parent.as_os_str().is_empty() && !parent.exists() {
                std::fs::create_dir_all(parent)
                    .map_err(|e| GatewayError::store(path.display(), e))?;
            }
        }
        let lock = schema::lock_writer(path)?;
        // Everything below names the one real file, never the name given.
        let path = lock.path.as_path();
        schema::private_files(path)?;
        let conn = schema::open_conn(path, sync)?;
        // A newer gateway's rows would be misread, and written against.
        let version = schema::version(&conn).unwrap_or(1);
        if version > prefix::SCHEMA_VERSION {
            return Err(GatewayError::store(
                path.display(),
                format!(
                    "written in store layout {version}, this gateway writes layout {}; upgrade lightning to open it",
                    prefix::SCHEMA_VERSION
                ),
            ));
        }
        schema::create(&conn).map_err(|e| GatewayError::store(path.display(), e))?;
        let secret = secret::load(&conn, path, &secret)?;
        let mut readers = Vec::new();
        for _ in 0..2 {
            readers.push(Mutex::new(schema::open_conn(path, sync)?));
        }
        let stats = Arc::new(StoreStats::default());
        let (tx, rx) = mpsc::channel::<(Op, Reply)>();
        let wstats = stats.clone();
        let writer = std::thread::Builder::new()
            .name("lightning-store-writer".into())
            .spawn(move || writer_loop(conn, rx, wstats, layout))?;
        Ok(Store {
            path: path.to_path_buf(),
            tx: Mutex::new(Some(tx)),
            writer: Mutex::new(Some(writer)),
            readers,
            next_reader: AtomicUsize::new(0),
            stats,
            secret,
            lock: Mutex::new(Some(lock.file)),
            _held: schema::Held::new(path),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The secret that rollout tokens are derived from (`secret`); an error
    /// for a store opened with `SecretSource::None`.
    pub fn secret(&self) -> Result<&[u8], GatewayError> {
        self.secret.as_deref().ok_or_else(|| {
            GatewayError::store(
                self.path.display(),
                "this writer was opened without a token secret",
            )
        })
    }

    async fn submit(&self, op: Op) -> Result<OpResult, GatewayError> {
        let (rtx, rrx) = oneshot::channel();
        {
            let guard = self.tx.lock().map_err(|_| GatewayError::StoreClosed)?;
            let tx = guard.as_ref().ok_or(GatewayError::StoreClosed)?;
            self.stats.queue_depth.fetch_add(1, Ordering::Relaxed);
            if tx.send((op, rtx)).is_err() {
                self.stats.queue_depth.fetch_sub(1, Ordering::Relaxed);
                return Err(GatewayError::StoreClosed);
            }
        }
        let health = &self.stats.health;
        match rrx.await {
            Ok(Ok(r)) => Ok(r),
            // The writer marks the store before it replies.
            Ok(Err(message)) if !health.writable() => Err(GatewayError::StoreUnwritable {
                path: self.path.display().to_string(),
                message,
            }),
            Ok(Err(msg)) => Err(GatewayError::store(self.path.display(), msg)),
            Err(_) if !health.writable() => Err(GatewayError::StoreUnwritable {
                path: self.path.display().to_string(),
                message: health.error().unwrap_or_default(),
            }),
            Err(_) => Err(GatewayError::StoreClosed),
        }
    }

    /// Writes one row and waits for its commit: `Ok` once the disk takes writes.
    pub async fn probe(&self) -> Result<(), GatewayError> {
        self.submit(Op::Probe).await.map(|_| ())
    }

    /// Creates the rollout, or returns the existing one with that id (`created = false`).
    pub async fn create_rollout(&self, r: NewRollout) -> Result<(RolloutRow, bool), GatewayError> {
        match self.submit(Op::CreateRollout(r)).await? {
            OpResult::Rollout { row, created } => Ok((row, created)),
            other => Err(unexpected(other)),
        }
    }

    pub async fn set_status(&self, id: &str, status: &str) -> Result<bool, GatewayError> {
        match self
            .submit(Op::SetStatus {
                id: id.to_string(),
                status: status.to_string(),
            })
            .await?
        {
            OpResult::Found(f) => Ok(f),
            other => Err(unexpected(other)),
        }
    }

    /// Inserts the calls of one request (one per choice) with consecutive seqs,
    /// and the protocol's kept object, in one transaction.
    pub async fn insert_calls(
        &self,
        records: Vec<CallRecord>,
        mark_running: bool,
        kept: Option<Kept>,
    ) -> Result<Vec<i64>, GatewayError> {
        match self
            .submit(Op::InsertCalls {
                records,
                mark_running,
                kept,
            })
            .await?
        {
            OpResult::Seqs(s) => Ok(s),
            other => Err(unexpected(other)),
        }
    }

    pub async fn insert_event(
        &self,
        rollout_id: &str,
        kind: &str,
        data: String,
    ) -> Result<i64, GatewayError> {
        match self
            .submit(Op::InsertEvent {
                rollout_id: rollout_id.to_string(),
                kind: kind.to_string(),
                data,
            })
            .await?
        {
            OpResult::Seq(s) => Ok(s),
            other => Err(unexpected(other)),
        }
    }

    /// Inserts an application key's call into its session (resolved in the
    /// same transaction); returns the session's rollout id.
    pub async fn insert_online_calls(
        &self,
        records: Vec<CallRecord>,
        online: Arc<OnlineCall>,
        kept: Option<Kept>,
    ) -> Result<String, GatewayError> {
        match self
            .submit(Op::InsertOnline {
                records,
                online,
                kept,
            })
            .await?
        {
            OpResult::Online(online::Outcome::Session { rollout_id, .. }) => Ok(rollout_id),
            other => Err(unexpected(other)),
        }
    }

    /// Runs one online-mode write (keys, feedback, sweep) and waits for its commit.
    pub async fn online(&self, op: online::Op) -> Result<online::Outcome, GatewayError> {
        match self.submit(Op::Online(op)).await? {
            OpResult::Online(o) => Ok(o),
            other => Err(unexpected(other)),
        }
    }

    /// Marks online sessions as used by a training pass (`trained` = `when`);
    /// returns how many it found. The one path for that write, whether the
    /// gateway is running (its admin route) or not (`lightning._core`).
    pub async fn mark_trained(
        &self,
        rollout_ids: Vec<String>,
        when: f64,
    ) -> Result<usize, GatewayError> {
        match self
            .online(online::Op::MarkTrained { rollout_ids, when })
            .await?
        {
            online::Outcome::Marked(n) => Ok(n),
            other => Err(GatewayError::store(
                self.path.display(),
                format!("internal: unexpected writer result {other:?}"),
            )),
        }
    }

    /// Waits until everything queued before it has committed.
    pub async fn barrier(&self) -> Result<(), GatewayError> {
        self.submit(Op::Barrier).await.map(|_| ())
    }

    /// Stops the writer after it has committed everything queued.
    pub fn close(&self) {
        if let Ok(mut g) = self.tx.lock() {
            g.take();
        }
        let handle = self.writer.lock().ok().and_then(|mut g| g.take());
        if let Some(h) = handle {
            let _ = h.join();
        }
        // After the writer's last commit: the next writer may open the file.
        if let Some(file) = self.lock.lock().ok().and_then(|mut g| g.take()) {
            schema::release(file);
        }
    }

    /// Runs `f` on a reader connection (call from a blocking context).
    pub fn read<T>(
        &self,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T>,
    ) -> Result<T, GatewayError> {
        let n = self.readers.len();
        let start = self.next_reader.fetch_add(1, Ordering::Relaxed);
        for i in 0..n {
            if let Ok(conn) = self.readers[(start + i) % n].try_lock() {
                return f(&conn).map_err(|e| GatewayError::store(self.path.display(), e));
            }
        }
        let conn = self.readers[start % n]
            .lock()
            .map_err(|_| GatewayError::store(self.path.display(), "reader lock poisoned"))?;
        f(&conn).map_err(|e| GatewayError::store(self.path.display(), e))
    }

    pub fn get_rollout(&self, id: &str) -> Result<Option<RolloutRow>, GatewayError> {
        self.read(|c| reader::rollout(c, id))
    }

    pub fn rollout_by_token_hash(&self, hash: &str) -> Result<Option<RolloutRow>, GatewayError> {
        self.read(|c| reader::rollout_by_token_hash(c, hash))
    }

    pub fn list_rollouts(
        &self,
        status: Option<&str>,
        group: Option<&str>,
        limit: i64,
    ) -> Result<Vec<RolloutRow>, GatewayError> {
        self.read(|c| reader::list_rollouts(c, status, group, limit))
    }

    /// Number of calls and the latest reward of a rollout.
    pub fn rollout_summary(&self, id: &str) -> Result<(i64, Option<f64>), GatewayError> {
        self.read(|c| reader::rollout_summary(c, id))
    }

    /// Every event of a rollout as the HTTP routes show it (`data` parsed).
    pub fn events(&self, id: &str) -> Result<Vec<serde_json::Value>, GatewayError> {
        let rows = self.read(|c| reader::events(c, id))?;
        Ok(rows
            .into_iter()
            .map(|e| {
                serde_json::json!({
                    "seq": e.seq,
                    "type": e.kind,
                    "data": serde_json::from_str::<serde_json::Value>(&e.data).unwrap_or(serde_json::Value::Null),
                    "created": e.created,
                })
            })
            .collect())
    }

    /// A kept protocol object (`Kept`) of this rollout: `(object, state)`.
    pub fn kept(
        &self,
        rollout_id: &str,
        id: &str,
    ) -> Result<Option<(serde_json::Value, serde_json::Value)>, GatewayError> {
        self.read(|c| reader::kept(c, rollout_id, id))
    }

    /// Every recorded call of a rollout (see [`reader::records`]).
    pub fn trace(&self, id: &str) -> Result<Vec<StoredCall>, GatewayError> {
        self.read(|c| reader::records(c, id))
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        self.close();
    }
}

fn unexpected(r: OpResult) -> GatewayError {
    GatewayError::Store {
        path: String::new(),
        message: format!("internal: unexpected writer result {r:?}"),
    }
}

/// Next sequence numbers per rollout, cached so the writer does one MAX query
/// per rollout; and the latest calls of each rollout, that new calls store
/// their prompt and bodies against (`prefix::Recent`, unused in `full`).
#[derive(Default)]
struct SeqCache {
    calls: HashMap<String, i64>,
    events: HashMap<String, i64>,
    recent: prefix::Recent,
    layout: StoreLayout,
}

fn next_seq(
    conn: &Connection,
    cache: &mut HashMap<String, i64>,
    table: &str,
    rollout: &str,
) -> rusqlite::Result<i64> {
    if let Some(s) = cache.get_mut(rollout) {
        let v = *s;
        *s += 1;
        return Ok(v);
    }
    let sql = format!("SELECT COALESCE(MAX(seq) + 1, 0) FROM {table} WHERE rollout_id = ?1");
    let v: i64 = conn.query_row(&sql, params![rollout], |r| r.get(0))?;
    cache.insert(rollout.to_string(), v + 1);
    Ok(v)
}

fn apply(conn: &Connection, seqs: &mut SeqCache, op: Op) -> rusqlite::Result<OpResult> {
    match op {
        Op::CreateRollout(r) => {
            let t = now();
            let n = conn.execute(
                "INSERT OR IGNORE INTO rollouts(id, grp, task, mode, status, token_hash, created, updated)
                 VALUES (?1, ?2, ?3, ?4, 'queued', ?5, ?6, ?6)",
                params![r.id, r.group, r.task, r.mode, r.token_hash, t],
            )?;
            // Inserted or already there: either way the row exists now.
            let row = reader::rollout(conn, &r.id)?.ok_or(rusqlite::Error::QueryReturnedNoRows)?;
            Ok(OpResult::Rollout {
                row,
                created: n == 1,
            })
        }
        Op::SetStatus { id, status } => {
            let n = conn.execute(
                "UPDATE rollouts SET status = ?2, updated = ?3 WHERE id = ?1",
                params![id, status, now()],
            )?;
            Ok(OpResult::Found(n == 1))
        }
        Op::InsertCalls {
            records,
            mark_running,
            kept,
        } => insert_call_rows(conn, seqs, &records, mark_running, kept),
        Op::InsertEvent {
            rollout_id,
            kind,
            data,
        } => insert_event(conn, seqs, &rollout_id, &kind, &data).map(OpResult::Seq),
        Op::InsertOnline {
            records,
            online,
            kept,
        } => insert_online_calls(conn, seqs, records, &online, kept),
        Op::Online(op) => apply_online(conn, seqs, op),
        Op::Barrier => Ok(OpResult::Unit),
        Op::Probe => {
            conn.execute(
                "INSERT OR REPLACE INTO meta(key, value) VALUES ('write_probe', ?1)",
                params![now()],
            )?;
            Ok(OpResult::Unit)
        }
    }
}

/// One event of a rollout, under the rollout's next event number (returned).
fn insert_event(
    conn: &Connection,
    seqs: &mut SeqCache,
    rollout_id: &str,
    kind: &str,
    data: &str,
) -> rusqlite::Result<i64> {
    let seq = next_seq(conn, &mut seqs.events, "events", rollout_id)?;
    conn.execute(
        "INSERT INTO events(rollout_id, seq, type, data, created) VALUES (?1, ?2, ?3, ?4, ?5)",
        params![rollout_id, seq, kind, data, now()],
    )?;
    Ok(seq)
}

/// The calls of one engine answer (one per choice), with their rollout's
/// first move to `running` and the protocol object they keep, if any.
fn insert_call_rows(
    conn: &Connection,
    seqs: &mut SeqCache,
    records: &[CallRecord],
    mark_running: bool,
    kept: Option<Kept>,
) -> rusqlite::Result<OpResult> {
    let mut out = Vec::with_capacity(records.len());
    let mut stmt = conn.prepare_cached(
        "INSERT INTO calls(rollout_id, seq, request_id, choice_index, kind, request, prompt_ids,
            completion_ids, logprobs, finish_reason, text, status, flags, delivered, retry_count,
            weight_version, upstream, http_status, latency_ms, usage, created, protocol, harness_request, response_id,
            prompt_base, prompt_shared, text_base, request_head, request_tail, harness_head, harness_tail)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20, ?21, ?22, ?23, ?24,
            ?25, ?26, ?27, ?28, ?29, ?30, ?31)",
    )?;
    let shared = seqs.layout == StoreLayout::Shared;
    for (i, c) in records.iter().enumerate() {
        let seq = next_seq(conn, &mut seqs.calls, "calls", &c.rollout_id)?;
        let recent = &mut seqs.recent;
        // The request bodies are stored once per request, on its first choice.
        let (mut request, mut harness_request) = if i == 0 {
            (c.request.as_str(), Some(c.harness_request.as_str()))
        } else {
            ("", None)
        };
        let text_ref = match harness_request {
            Some(h) if shared => recent.text_base(&c.rollout_id, request, h),
            _ => None,
        };
        if let Some(t) = &text_ref {
            request = &request[t.request.head..request.len() - t.request.tail];
            harness_request = harness_request.map(|h| &h[t.harness.head..h.len() - t.harness.tail]);
        }
        let ids_ref = match &c.prompt_ids {
            Some(p) if shared => recent.ids_base(&c.rollout_id, p),
            _ => None,
        };
        let prompt = c
            .prompt_ids
            .as_deref()
            .map(|p| &p[ids_ref.as_ref().map_or(0, |r| r.shared)..]);
        stmt.execute(params![
            c.rollout_id,
            seq,
            c.request_id,
            c.choice_index,
            c.kind,
            request,
            prompt.map(ids_to_blob),
            c.completion_ids.as_deref().map(ids_to_blob),
            c.logprobs.as_deref().map(f32s_to_blob),
            c.finish_reason,
            c.text,
            c.status.as_str(),
            c.flags.join(","),
            c.delivered as i64,
            c.retry_count as i64,
            c.weight_version as i64,
            c.upstream,
            c.http_status as i64,
            c.latency_ms,
            c.usage,
            c.created,
            c.protocol,
            harness_request,
            c.response_id,
            ids_ref.as_ref().map(|r| r.base),
            ids_ref.as_ref().map(|r| r.shared as i64),
            text_ref.as_ref().map(|t| t.base),
            text_ref.as_ref().map(|t| t.request.head as i64),
            text_ref.as_ref().map(|t| t.request.tail as i64),
            text_ref.as_ref().map(|t| t.harness.head as i64),
            text_ref.as_ref().map(|t| t.harness.tail as i64),
        ])?;
        if shared {
            if let Some(p) = &c.prompt_ids {
                let completion = c.completion_ids.as_deref().unwrap_or(&[]);
                recent.stage_ids(&c.rollout_id, seq, p, completion);
            }
            if i == 0 {
                recent.stage_text(&c.rollout_id, seq, &c.request, Some(&c.harness_request));
            }
        }
        out.push(seq);
    }
    if mark_running {
        if let Some(first) = records.first() {
            conn.execute(
                "UPDATE rollouts SET status = 'running', updated = ?2 WHERE id = ?1 AND status = 'queued'",
                params![first.rollout_id, now()],
            )?;
        }
    }
    if let (Some(k), Some(first)) = (kept, records.first()) {
        conn.execute(
            "INSERT OR REPLACE INTO kept(id, rollout_id, protocol, request_id, object, state, created)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            params![
                k.id,
                first.rollout_id,
                first.protocol,
                first.request_id,
                k.object.to_string(),
                k.state.to_string(),
                now()
            ],
        )?;
    }
    Ok(OpResult::Seqs(out))
}

/// An application key's call: its session resolved (or opened), then the
/// calls inserted into it.
fn insert_online_calls(
    conn: &Connection,
    seqs: &mut SeqCache,
    mut records: Vec<CallRecord>,
    online: &OnlineCall,
    kept: Option<Kept>,
) -> rusqlite::Result<OpResult> {
    let t = now();
    let prompt = records.first().and_then(|r| r.prompt_ids.clone());
    let (rollout_id, created) = online::resolve_session(conn, online, prompt.as_deref(), t)?;
    let tail = online::tail_of(&records);
    for r in records.iter_mut() {
        r.rollout_id = rollout_id.clone();
    }
    // A redacting key keeps no protocol object either: a Responses object
    // and its state hold the conversation text (so `previous_response_id`
    // is a 404 telling the harness to resend the conversation).
    let kept = if online.key.defaults.redact {
        online::redact(&mut records);
        None
    } else {
        kept
    };
    insert_call_rows(conn, seqs, &records, false, kept)?;
    online::touch_session(conn, &rollout_id, tail, t)?;
    Ok(OpResult::Online(online::Outcome::Session {
        rollout_id,
        created,
    }))
}

/// An online-learning write; a new feedback signal also becomes an event.
fn apply_online(
    conn: &Connection,
    seqs: &mut SeqCache,
    op: online::Op,
) -> rusqlite::Result<OpResult> {
    let fb = match &op {
        online::Op::Feedback(f) => Some(f.clone()),
        _ => None,
    };
    let out = online::apply(conn, op, now())?;
    // A new signal is also an event of the session, so `lightning show`
    // and `GET /rollouts/{id}/events` list it beside the rewards.
    if let (
        Some(f),
        online::Outcome::Feedback(online::FeedbackOutcome::Stored {
            rollout_id,
            after_training,
            duplicate: false,
        }),
    ) = (fb, &out)
    {
        let data = serde_json::json!({
            "feedback_id": f.feedback_id, "name": f.name, "value": f.value,
            "response_id": f.response_id, "ts": f.ts,
            "after_training": after_training, "data": f.data,
        });
        insert_event(conn, seqs, rollout_id, "feedback", &data.to_string())?;
    }
    Ok(OpResult::Online(out))
}

fn writer_loop(
    mut conn: Connection,
    rx: mpsc::Receiver<(Op, Reply)>,
    stats: Arc<StoreStats>,
    layout: StoreLayout,
) {
    let fresh = || SeqCache {
        layout,
        ..SeqCache::default()
    };
    let mut seqs = fresh();
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(m) => batch.push(m),
                Err(_) => break,
            }
        }
        let n = batch.len();
        let t0 = Instant::now();
        let mut replies: Vec<(Reply, Result<OpResult, String>)> = Vec::with_capacity(n);
        let changes = conn.total_changes();
        let mut disk_error: Option<String> = None;
        let outcome = (|| -> rusqlite::Result<()> {
            let tx = conn.transaction()?;
            for (op, reply) in batch.drain(..) {
                // A savepoint per op: one bad write fails alone, the rest commit.
                // Cached statements: `execute_batch` would re-parse the SQL
                // for every op (a tenth of the writer's instructions).
                let res = {
                    tx.prepare_cached("SAVEPOINT op")?.execute([])?;
                    match apply(&tx, &mut seqs, op) {
                        Ok(r) => {
                            tx.prepare_cached("RELEASE op")?.execute([])?;
                            seqs.recent.keep();
                            Ok(r)
                        }
                        Err(e) => {
                            if is_disk_error(&e) {
                                disk_error = Some(e.to_string());
                            }
                            // Rows the op wrote are gone: none may be a base.
                            seqs.recent.discard();
                            tx.prepare_cached("ROLLBACK TO op")?.execute([])?;
                            tx.prepare_cached("RELEASE op")?.execute([])?;
                            Err(e.to_string())
                        }
                    }
                };
                replies.push((reply, res));
            }
            tx.commit()
        })();
        let us = t0.elapsed().as_micros() as usize;
        stats.commits.fetch_add(1, Ordering::Relaxed);
        stats.committed_ops.fetch_add(n, Ordering::Relaxed);
        stats.commit_us_total.fetch_add(us, Ordering::Relaxed);
        stats.commit_us_max.fetch_max(us, Ordering::Relaxed);
        let ms = us as f64 / 1000.0;
        if let Some(b) = COMMIT_BUCKETS_MS.iter().position(|ub| ms <= *ub) {
            stats.commit_buckets[b].fetch_add(1, Ordering::Relaxed);
        }
        stats.queue_depth.fetch_sub(n as i64, Ordering::Relaxed);
        match (&outcome, disk_error) {
            (Ok(()), None) if conn.total_changes() > changes => stats.health.recovered(),
            (Ok(()), None) => {}
            (Ok(()), Some(e)) => stats.health.failed(e),
            (Err(e), _) => stats.health.failed(e.to_string()),
        }
        match outcome {
            Ok(()) => {
                for (reply, res) in replies {
                    let _ = reply.send(res);
                }
            }
            Err(e) => {
                // The transaction did not commit: nothing in it is durable, and
                // the cached seqs may be ahead of the table, and the calls
                // remembered as bases may not exist: drop both.
                tracing::error!(error = %e, ops = n, "store commit failed");
                seqs = fresh();
                for (reply, _) in replies {
                    let _ = reply.send(Err(format!("commit failed: {e}")));
                }
            }
        }
    }
    tracing::debug!("store writer stopped");
}
