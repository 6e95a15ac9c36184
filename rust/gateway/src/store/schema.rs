//! The schema, in one place: every table and index, the columns added since
//! the first release, and how a connection to the file is opened. The store
//! (`super`) is the only code that opens the database.

use rusqlite::{params, Connection, OptionalExtension};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::config::SyncMode;
use crate::error::GatewayError;

/// The rollout tables: what every gateway writes.
const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS rollouts (
    id TEXT PRIMARY KEY,
    grp TEXT,
    task TEXT NOT NULL,
    mode TEXT NOT NULL,
    status TEXT NOT NULL,
    token_hash TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS rollouts_token ON rollouts(token_hash);
CREATE INDEX IF NOT EXISTS rollouts_group ON rollouts(grp);
CREATE INDEX IF NOT EXISTS rollouts_status ON rollouts(status);
-- Keyset paging in creation order (`reader::rollouts` with `after`/`limit`),
-- alone or under one filter: a page reads its rows, never the table.
CREATE INDEX IF NOT EXISTS rollouts_created ON rollouts(created, id);
CREATE INDEX IF NOT EXISTS rollouts_status_created ON rollouts(status, created, id);
CREATE INDEX IF NOT EXISTS rollouts_mode_created ON rollouts(mode, created, id);
CREATE INDEX IF NOT EXISTS rollouts_group_created ON rollouts(grp, created, id);
CREATE TABLE IF NOT EXISTS calls (
    id INTEGER PRIMARY KEY,
    rollout_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    request_id TEXT NOT NULL,
    choice_index INTEGER NOT NULL,
    kind TEXT NOT NULL,
    request TEXT NOT NULL,
    prompt_ids BLOB,
    completion_ids BLOB,
    logprobs BLOB,
    finish_reason TEXT,
    text TEXT,
    status TEXT NOT NULL,
    flags TEXT NOT NULL,
    delivered INTEGER NOT NULL,
    retry_count INTEGER NOT NULL,
    weight_version INTEGER NOT NULL,
    upstream TEXT NOT NULL,
    http_status INTEGER NOT NULL,
    latency_ms REAL NOT NULL,
    usage TEXT,
    created REAL NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS calls_rollout_seq ON calls(rollout_id, seq);
-- Calls per time bucket (`reader::call_rate`): the window's rows from the
-- index alone (status covered), not a scan of every call ever recorded.
CREATE INDEX IF NOT EXISTS calls_created ON calls(created, status);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY,
    rollout_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    type TEXT NOT NULL,
    data TEXT NOT NULL,
    created REAL NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS events_rollout_seq ON events(rollout_id, seq);
CREATE TABLE IF NOT EXISTS kept (
    id TEXT PRIMARY KEY,
    rollout_id TEXT NOT NULL,
    protocol TEXT NOT NULL,
    request_id TEXT NOT NULL,
    object TEXT NOT NULL,
    state TEXT NOT NULL,
    created REAL NOT NULL
);
"#;

/// Columns added after the first release, with their definitions: a database
/// created by an older gateway gets them on open (`ALTER TABLE ADD COLUMN`;
/// rows written before read as the defaults). Existing columns never change name.
const MIGRATIONS: [(&str, &str, &str); 11] = [
    // The protocol the harness spoke (`openai_chat`, `openai_responses`, …);
    // old rows were all chat completions or completions, told apart by `kind`.
    ("calls", "protocol", "TEXT"),
    // The harness's own request body, before translation (`request` holds
    // the engine request). Stored on the first choice, like `request`.
    ("calls", "harness_request", "TEXT"),
    // The id the harness was given for the answer (`chatcmpl-…`, `resp_…`,
    // `msg_…`): what online feedback names.
    ("calls", "response_id", "TEXT"),
    // `online` for sessions recorded from application keys (NULL: a rollout).
    ("rollouts", "origin", "TEXT"),
    // Layout 2, prefix-shared rows (`super::prefix`): NULL means the column
    // beside it is stored whole, as every layout-1 row is.
    // `prompt_ids` continues call `prompt_base`'s prompt + completion after
    // its first `prompt_shared` tokens.
    ("calls", "prompt_base", "INTEGER"),
    ("calls", "prompt_shared", "INTEGER"),
    // `request` and `harness_request` are the middles of call `text_base`'s
    // bodies: its first `*_head` and last `*_tail` bytes surround them.
    ("calls", "text_base", "INTEGER"),
    ("calls", "request_head", "INTEGER"),
    ("calls", "request_tail", "INTEGER"),
    ("calls", "harness_head", "INTEGER"),
    ("calls", "harness_tail", "INTEGER"),
];

fn migrate(conn: &Connection) -> rusqlite::Result<()> {
    for (table, column, decl) in MIGRATIONS {
        let exists: bool = conn.query_row(
            &format!("SELECT COUNT(*) > 0 FROM pragma_table_info('{table}') WHERE name = ?1"),
            params![column],
            |r| r.get(0),
        )?;
        if !exists {
            conn.execute_batch(&format!("ALTER TABLE {table} ADD COLUMN {column} {decl}"))?;
        }
    }
    Ok(())
}

/// Online mode's tables (`super::online`):
/// - `app_keys`: application keys (SHA-256 of the key, never the key).
/// - `online_sessions`: one row per session rollout: its key, explicit id,
///   the token tail (last prompt + completion, as length + SHA-256) that a
///   continuing prompt must start with, open/closed, and when it was trained.
/// - `feedback`: every signal ever posted, unique per (key, feedback id).
const ONLINE_SCHEMA: &str = r#"
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
-- The view's session pages, newest activity first (`reader::session_page`).
CREATE INDEX IF NOT EXISTS online_sessions_updated ON online_sessions(updated, rollout_id);
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

/// Creates what is missing (tables, indexes, later columns) on the writer's
/// connection; a database from an older gateway is brought up to date.
pub(super) fn create(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(SCHEMA)?;
    migrate(conn)?;
    conn.execute_batch(ONLINE_SCHEMA)?;
    // The layout rows may be written in from now on; layout-1 rows stay as
    // they are (every reader of layout 2 reads them).
    conn.execute(
        "INSERT OR REPLACE INTO meta(key, value) VALUES ('schema_version', ?1)",
        params![super::prefix::SCHEMA_VERSION],
    )?;
    Ok(())
}

/// The layout a store file says it was written in (1: before versions were kept).
pub(super) fn version(conn: &Connection) -> rusqlite::Result<i64> {
    let v: Option<i64> = conn
        .query_row(
            "SELECT value FROM meta WHERE key = 'schema_version'",
            [],
            |r| r.get(0),
        )
        .optional()?;
    Ok(v.unwrap_or(1))
}

pub(super) fn open_conn(path: &Path, sync: SyncMode) -> Result<Connection, GatewayError> {
    let conn = Connection::open(path).map_err(|e| GatewayError::store(path.display(), e))?;
    let sync = match sync {
        SyncMode::Full => "FULL",
        SyncMode::Normal => "NORMAL",
    };
    conn.execute_batch(&format!(
        "PRAGMA journal_mode=WAL; PRAGMA synchronous={sync}; PRAGMA busy_timeout=10000; PRAGMA foreign_keys=OFF;"
    ))
    .map_err(|e| GatewayError::store(path.display(), e))?;
    Ok(conn)
}

/// The store file a writer holds: the canonical path (every symlink
/// resolved, so SQLite names its `-wal`/`-shm` after the one real file) and
/// the open file carrying the writer's lock.
pub(super) struct Locked {
    pub path: PathBuf,
    pub file: std::fs::File,
}

/// Takes the writer's exclusive OS lock on the database file itself, held
/// for the writer's lifetime: one writer per store *file*, whatever path
/// names it. The lock sits on the file's inode (`flock`, which SQLite never
/// takes; its own locks are `fcntl` byte ranges), so a symlink or a second
/// name reaches the same lock, and there is no lock file beside the store to
/// delete. A file with more than one hard link is refused outright: SQLite
/// keeps a `-wal` per *name*, so two names of one file are two stores
/// sharing pages, and a writer on each corrupts both.
pub(super) fn lock_writer(db: &Path) -> Result<Locked, GatewayError> {
    let file = match kept_file(db) {
        Some(file) => {
            tighten(db, &file);
            file
        }
        None => private_file(db).map_err(|e| GatewayError::store(db.display(), e))?,
    };
    let path = match std::fs::canonicalize(db) {
        Ok(path) => path,
        Err(e) => {
            release(file);
            return Err(GatewayError::store(db.display(), e));
        }
    };
    let locked = refuse_hard_links(&path, &file).and_then(|()| match file.try_lock() {
        Ok(()) => Ok(()),
        Err(std::fs::TryLockError::WouldBlock) => Err(GatewayError::StoreLocked {
            path: path.display().to_string(),
            holder: holder(&file),
        }),
        Err(std::fs::TryLockError::Error(e)) => Err(GatewayError::store(path.display(), e)),
    });
    // A link made between the check and the lock is caught here; one made
    // later reaches this lock (same inode) and is refused by the next writer.
    match locked.and_then(|()| refuse_hard_links(&path, &file)) {
        Ok(()) => Ok(Locked { path, file }),
        Err(e) => {
            release(file);
            Err(e)
        }
    }
}

/// Store files this process has open through this crate's SQLite (a `Store`
/// or a `Reader` alive), by device and inode, with how many.
///
/// A *second* SQLite library in the same process (Python's `sqlite3` module
/// links the system's; this crate bundles its own) keeps its own lock
/// bookkeeping over the same per-process POSIX locks. Its connection sees
/// none of ours (a process never conflicts with itself), so when it closes it
/// believes it is the last user of the file: it checkpoints and deletes the
/// `-wal` our connections still write to, and its closing descriptor drops
/// our locks. Acknowledged commits then live only in an unlinked file (lost
/// at a crash; other processes stop seeing them), and a reader can get "disk
/// I/O error". `open_here` is how Python refuses such a connection
/// (`lightning/gateway/store_guard.py`).
static HELD: Mutex<Vec<((u64, u64), usize)>> = Mutex::new(Vec::new());

/// One entry of `HELD` for as long as it lives (a field of `Store` and `Reader`).
#[derive(Debug)]
pub(super) struct Held(Option<(u64, u64)>);

#[cfg(unix)]
fn file_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

#[cfg(not(unix))]
fn file_id(_: &Path) -> Option<(u64, u64)> {
    None
}

impl Held {
    pub(super) fn new(path: &Path) -> Held {
        let id = file_id(path);
        if let (Some(id), Ok(mut held)) = (id, HELD.lock()) {
            match held.iter_mut().find(|(k, _)| *k == id) {
                Some((_, n)) => *n += 1,
                None => held.push((id, 1)),
            }
        }
        Held(id)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let (Some(id), Ok(mut held)) = (self.0, HELD.lock()) {
            if let Some(at) = held.iter().position(|(k, _)| *k == id) {
                held[at].1 -= 1;
                if held[at].1 == 0 {
                    held.swap_remove(at);
                }
            }
        }
    }
}

/// Whether this process has the store file at `path` (any name of it) open
/// through this crate now.
pub(super) fn open_here(path: &Path) -> bool {
    let Some(id) = file_id(path) else {
        return false;
    };
    HELD.lock()
        .is_ok_and(|held| held.iter().any(|(k, _)| *k == id))
}

/// Files of stores this process has locked, unlocked and kept open, one per
/// inode. Closing *any* descriptor of a file drops every POSIX (`fcntl`) lock
/// the process holds on it, SQLite's included: a writer that closed its lock
/// descriptor while a connection of the same process (its own readers, a
/// `lightning.Store`, Python's `sqlite3`) still had the file open would strip
/// that connection's locks, and a later connection could then checkpoint and
/// delete a `-wal` another one still writes to: acknowledged commits lost. So
/// the lock's descriptor is never closed: `release` unlocks it (`flock` only)
/// and keeps it here, and the next writer on the same file in this process
/// takes it back instead of opening another.
static KEPT: Mutex<Vec<std::fs::File>> = Mutex::new(Vec::new());

/// Gives back the writer's lock on `file` and keeps the file open (see `KEPT`).
pub(super) fn release(file: std::fs::File) {
    let _ = file.unlock();
    if let Ok(mut kept) = KEPT.lock() {
        kept.push(file);
    } else {
        std::mem::forget(file);
    }
}

/// The kept descriptor of the file at `db`, if this process has one.
#[cfg(unix)]
fn kept_file(db: &Path) -> Option<std::fs::File> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(db).ok()?;
    let mut kept = KEPT.lock().ok()?;
    let at = kept.iter().position(|f| {
        f.metadata()
            .is_ok_and(|m| m.dev() == meta.dev() && m.ino() == meta.ino())
    })?;
    Some(kept.swap_remove(at))
}

#[cfg(not(unix))]
fn kept_file(_: &Path) -> Option<std::fs::File> {
    None
}

#[cfg(unix)]
fn refuse_hard_links(path: &Path, file: &std::fs::File) -> Result<(), GatewayError> {
    use std::os::unix::fs::MetadataExt;
    let meta = file
        .metadata()
        .map_err(|e| GatewayError::store(path.display(), e))?;
    if meta.nlink() > 1 {
        return Err(GatewayError::store(
            path.display(),
            format!(
                "the store file has {} hard links; SQLite keeps one write-ahead log per name, so two names of one file corrupt it. Remove the other names (`find / -samefile {}`) or copy the store to a file of its own",
                meta.nlink(),
                path.display()
            ),
        ));
    }
    Ok(())
}

#[cfg(not(unix))]
fn refuse_hard_links(_: &Path, _: &std::fs::File) -> Result<(), GatewayError> {
    Ok(())
}

/// Who holds the lock on `file`: `pid N` from the kernel's lock table
/// (`/proc/locks` lists every `flock` with its owner's pid and the file's
/// device and inode), or a sentence saying it could not be told.
fn holder(file: &std::fs::File) -> String {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::MetadataExt;
        if let (Ok(meta), Ok(locks)) = (file.metadata(), std::fs::read_to_string("/proc/locks")) {
            if let Some(pid) = flock_holder(&locks, meta.dev(), meta.ino()) {
                return format!("pid {pid}");
            }
        }
    }
    let _ = file;
    "a process this one cannot see".to_string()
}

/// The pid of the `FLOCK` holder of (`dev`, `ino`) in `/proc/locks` text:
/// lines like `1: FLOCK  ADVISORY  WRITE 4242 08:01:1234 0 EOF`, the device
/// as hexadecimal `major:minor` (Linux's `dev_t` split).
pub(super) fn flock_holder(locks: &str, dev: u64, ino: u64) -> Option<u32> {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    locks.lines().find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        // `->` marks a waiter, one column further on.
        let f: Vec<&str> = f.into_iter().filter(|x| *x != "->").collect();
        if f.len() < 6 || f[1] != "FLOCK" {
            return None;
        }
        let mut id = f[5].split(':');
        let (ma, mi, i) = (id.next()?, id.next()?, id.next()?);
        let same = u64::from_str_radix(ma, 16).ok()? == major
            && u64::from_str_radix(mi, 16).ok()? == minor
            && i.parse::<u64>().ok()? == ino;
        if same {
            f[4].parse().ok()
        } else {
            None
        }
    })
}

/// Opens (creating) `path` with mode 0600 whatever the umask: created with
/// 0600, and tightened to 0600 if an older gateway left it readable by others.
fn private_file(path: &Path) -> std::io::Result<std::fs::File> {
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true).write(true).create(true).truncate(false);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let file = opts.open(path)?;
    tighten(path, &file);
    Ok(file)
}

#[cfg(unix)]
fn tighten(path: &Path, file: &std::fs::File) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = file.metadata() {
        if meta.permissions().mode() & 0o077 != 0 {
            if let Err(e) = file.set_permissions(std::fs::Permissions::from_mode(0o600)) {
                tracing::warn!(path = %path.display(), error = %e, "cannot make the store file private (mode 0600); fix its owner or mode");
            }
        }
    }
}

#[cfg(not(unix))]
fn tighten(_: &Path, _: &std::fs::File) {}

/// Makes an existing `-wal`, `-shm` or `-journal` private (SQLite gives new
/// ones the database file's mode, which `lock_writer` has made 0600).
pub(super) fn private_files(db: &Path) -> Result<(), GatewayError> {
    // By path, never by opening: closing a descriptor of `-shm` would drop the
    // locks SQLite's connections in this process hold on it (see `KEPT`).
    #[cfg(unix)]
    for suffix in ["-wal", "-shm", "-journal"] {
        use std::os::unix::fs::PermissionsExt;
        let p = super::secret::sibling(db, suffix);
        if let Ok(meta) = std::fs::metadata(&p) {
            if meta.permissions().mode() & 0o077 != 0 {
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600))
                    .map_err(|e| GatewayError::store(p.display(), e))?;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = db;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::flock_holder;

    #[test]
    fn the_lock_holder_is_found_by_device_and_inode() {
        // dev 0x0801 (major 8, minor 1); a waiter line (`->`) and a POSIX lock on the same inode.
        let table = "1: POSIX  ADVISORY  WRITE 11 08:01:1234 0 EOF\n\
                     2: FLOCK  ADVISORY  WRITE 4242 08:01:1234 0 EOF\n\
                     2: -> FLOCK  ADVISORY  WRITE 99 08:01:1234 0 EOF\n\
                     3: FLOCK  ADVISORY  WRITE 77 08:02:1234 0 EOF\n";
        assert_eq!(flock_holder(table, 0x0801, 1234), Some(4242));
        assert_eq!(flock_holder(table, 0x0802, 1234), Some(77));
        assert_eq!(flock_holder(table, 0x0801, 9), None);
        // A major above 255 is split across dev_t's bits (fd:00 → major 253).
        let lvm = "5: FLOCK  ADVISORY  WRITE 8 fd:00:77 0 EOF";
        assert_eq!(flock_holder(lvm, 0xfd00, 77), Some(8));
    }
}
