//! The secret rollout tokens derive from (`auth::rollout_token`), kept out of
//! the database: whoever can read the store must not be able to mint a token.
//!
//! Where it comes from, first match wins: the operator's file
//! (`token_secret_file`), the operator's value (`LIGHTNING_TOKEN_SECRET`), or
//! the key file beside the store (`<db>.secret` beside the canonical path,
//! mode 0600 enforced, made on first open of a store without rollouts; never
//! silently replaced once tokens have been handed out). A store from an older gateway kept it in `meta.token_secret`: the
//! writer moves it to `<db>.secret` and deletes it from the store, so the
//! tokens already handed out keep their secret.

use rusqlite::{Connection, OptionalExtension};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::GatewayError;

/// Environment variable holding the secret itself (at least `MIN_LEN` bytes).
pub const ENV: &str = "LIGHTNING_TOKEN_SECRET";
/// Shortest secret accepted from an operator.
pub const MIN_LEN: usize = 16;

/// Where the writer gets the token secret from.
#[derive(Debug, Clone)]
pub enum SecretSource {
    /// `<db>.secret`, created (0600) when missing.
    Beside,
    /// An operator's file: read as is (a trailing newline dropped).
    File(PathBuf),
    /// An operator's value.
    Value(Vec<u8>),
    /// A writer that mints no tokens (`mark_trained`): no secret is read or made.
    None,
}

impl SecretSource {
    /// The configured source: `file` if given, else `LIGHTNING_TOKEN_SECRET`
    /// if set, else the key file beside the store.
    pub fn configured(file: Option<&Path>) -> Result<SecretSource, GatewayError> {
        if let Some(f) = file {
            return Ok(SecretSource::File(f.to_path_buf()));
        }
        match std::env::var(ENV) {
            Ok(v) if !v.is_empty() => {
                if v.len() < MIN_LEN {
                    return Err(GatewayError::Config(format!(
                        "{ENV} is {} bytes; use a random value of at least {MIN_LEN} (e.g. `openssl rand -hex 32`)",
                        v.len()
                    )));
                }
                Ok(SecretSource::Value(v.into_bytes()))
            }
            _ => Ok(SecretSource::Beside),
        }
    }
}

/// The key file beside the store: `<db>.secret`.
pub fn key_file(db: &Path) -> PathBuf {
    sibling(db, ".secret")
}

/// `<db><suffix>` (`gw.db` → `gw.db.secret`).
pub(super) fn sibling(db: &Path, suffix: &str) -> PathBuf {
    let mut s = db.as_os_str().to_os_string();
    s.push(suffix);
    PathBuf::from(s)
}

/// Moves an older store's `meta.token_secret` into the key file (unless one
/// is there already) and deletes it from the store; then loads the secret
/// from `source`. Runs on the writer's connection, under the writer lock.
pub(super) fn load(
    conn: &Connection,
    db: &Path,
    source: &SecretSource,
) -> Result<Option<Vec<u8>>, GatewayError> {
    let err = |e: &dyn std::fmt::Display| GatewayError::store(db.display(), e);
    let beside = key_file(db);
    let old: Option<Vec<u8>> = conn
        .query_row(
            "SELECT value FROM meta WHERE key = 'token_secret'",
            [],
            |r| r.get(0),
        )
        .optional()
        .map_err(|e| err(&e))?;
    if let Some(old) = old {
        if !beside.exists() {
            write_private(&beside, &old)?;
        }
        // `secure_delete` zeroes the freed bytes; the checkpoint copies the
        // zeroed page over the file's and empties the WAL.
        conn.execute_batch(
            "PRAGMA secure_delete = ON;
             DELETE FROM meta WHERE key = 'token_secret';
             PRAGMA secure_delete = OFF;
             PRAGMA wal_checkpoint(TRUNCATE);",
        )
        .map_err(|e| err(&e))?;
        tracing::info!(key_file = %beside.display(), "moved the token secret out of the store into its key file");
    }
    match source {
        SecretSource::None => Ok(None),
        SecretSource::Value(v) => Ok(Some(v.clone())),
        SecretSource::File(f) => read_operator_file(f).map(Some),
        SecretSource::Beside => {
            if !beside.exists() {
                // A store with rollouts has handed out tokens derived from the
                // missing secret: a new one would answer 401 to every one of
                // them, and re-creating a rollout would give a token that no
                // longer matches its stored hash. Only the operator may choose that.
                let rollouts: i64 = conn
                    .query_row("SELECT COUNT(*) FROM rollouts", [], |r| r.get(0))
                    .map_err(|e| err(&e))?;
                if rollouts > 0 {
                    return Err(GatewayError::store(
                        beside.display(),
                        format!("the token key file is missing, and the store holds {rollouts} rollouts whose tokens derive from it; restore it from a backup (mode 0600), or give the old secret as token_secret_file / {ENV}. To revoke every token handed out instead, write a new one yourself: `openssl rand -hex 32 > {0} && chmod 600 {0}`", beside.display()),
                    ));
                }
                let mut secret = vec![0u8; 32];
                getrandom::fill(&mut secret).map_err(|e| err(&format!("no OS randomness: {e}")))?;
                write_private(&beside, &secret)?;
            }
            private_key_file(&beside)?;
            let s = std::fs::read(&beside).map_err(|e| GatewayError::store(beside.display(), e))?;
            if s.len() < MIN_LEN {
                return Err(GatewayError::store(
                    beside.display(),
                    format!("the token key file holds {} bytes (at least {MIN_LEN} expected); restore it from a backup, or delete it to make a new one (tokens handed out before then stop working)", s.len()),
                ));
            }
            Ok(Some(s))
        }
    }
}

/// The key file beside the store is the gateway's own: one readable by
/// others is made 0600 (with a warning: it may have been copied), and one
/// that cannot be made private is refused, as an operator's file is.
fn private_key_file(f: &Path) -> Result<(), GatewayError> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let err = |e: &dyn std::fmt::Display| GatewayError::store(f.display(), e);
        let mode = std::fs::metadata(f)
            .map_err(|e| err(&e))?
            .permissions()
            .mode();
        if mode & 0o077 != 0 {
            std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o600)).map_err(|e| {
                err(&format!(
                    "the token key file is readable by others (mode {:o}) and cannot be made private ({e}); run `chmod 600 {}`",
                    mode & 0o777,
                    f.display()
                ))
            })?;
            tracing::warn!(key_file = %f.display(), mode = format!("{:o}", mode & 0o777), "the token key file was readable by others; made it 0600 (rotate it if it may have been copied)");
        }
    }
    Ok(())
}

fn read_operator_file(f: &Path) -> Result<Vec<u8>, GatewayError> {
    let cfg = |m: String| GatewayError::Config(format!("token_secret_file {}: {m}", f.display()));
    let mut s = std::fs::read(f).map_err(|e| cfg(e.to_string()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(f)
            .map_err(|e| cfg(e.to_string()))?
            .permissions()
            .mode();
        if mode & 0o007 != 0 {
            return Err(cfg(format!(
                "is readable by every user (mode {:o}); run `chmod 600 {}`",
                mode & 0o777,
                f.display()
            )));
        }
    }
    while s.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
        s.pop();
    }
    if s.len() < MIN_LEN {
        return Err(cfg(format!(
            "holds {} bytes; put a random value of at least {MIN_LEN} in it (e.g. `openssl rand -hex 32`)",
            s.len()
        )));
    }
    Ok(s)
}

/// Writes `bytes` to `path`, never readable by others even briefly: a
/// temporary file created 0600 (`O_EXCL`, umask can only take bits away),
/// synced, then renamed into place.
fn write_private(path: &Path, bytes: &[u8]) -> Result<(), GatewayError> {
    let err = |e: std::io::Error| GatewayError::store(path.display(), e);
    let tmp = sibling(path, &format!(".tmp-{}", crate::util::random_hex(6)));
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let written = opts.open(&tmp).and_then(|mut f| {
        f.write_all(bytes)?;
        f.sync_all()
    });
    if let Err(e) = written.and_then(|_| std::fs::rename(&tmp, path)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(err(e));
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}
