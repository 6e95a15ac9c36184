//! The store's files on disk: the token secret lives outside the database
//! (issue 26, bug 5), every file is private (0600), and one writer holds a
//! store file at a time.

mod common;

use common::{call, start};
use lightning_gateway::auth;
use lightning_gateway::store::{SecretSource, Store};
use lightning_gateway::{Config, GatewayError, Server, SyncMode};
use serde_json::{json, Value};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

const ADMIN: &str = "admin-key-123";

fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lightning-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    dir
}

fn config(db: &Path) -> Config {
    Config {
        listen: "127.0.0.1:0".into(),
        db: db.to_path_buf(),
        admin_key: Some(ADMIN.into()),
        ..Config::default()
    }
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .permissions()
        .mode()
        & 0o777
}

fn with_suffix(db: &Path, suffix: &str) -> PathBuf {
    PathBuf::from(format!("{}{suffix}", db.display()))
}

/// Every byte of the database and its WAL.
fn store_bytes(db: &Path) -> Vec<u8> {
    let mut all = std::fs::read(db).unwrap_or_default();
    all.extend(std::fs::read(with_suffix(db, "-wal")).unwrap_or_default());
    all
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

fn meta_secret(db: &Path) -> Option<Vec<u8>> {
    let conn = rusqlite::Connection::open(db).unwrap_or_else(|e| panic!("{e}"));
    conn.query_row(
        "SELECT value FROM meta WHERE key = 'token_secret'",
        [],
        |r| r.get(0),
    )
    .ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_files_are_private_and_hold_no_token_secret() {
    let dir = fresh_dir("private");
    // Whatever the umask lets through, the store's files are 0600.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))
        .unwrap_or_else(|e| panic!("{e}"));
    let db = dir.join("gw.db");
    let gw = start(config(&db)).await;
    let (s, r) = call(
        gw.addr,
        "POST",
        "/rollouts",
        ADMIN,
        json!({"rollout_id": "ro-a"}),
    )
    .await;
    assert_eq!(s, 201, "{r}");
    let token = r["token"].as_str().unwrap_or_default().to_string();
    for suffix in ["", "-wal", "-shm", ".secret"] {
        let p = with_suffix(&db, suffix);
        assert_eq!(mode(&p), 0o600, "{} is mode {:o}", p.display(), mode(&p));
    }
    let secret = std::fs::read(with_suffix(&db, ".secret")).unwrap_or_default();
    assert_eq!(secret.len(), 32);
    assert_eq!(auth::rollout_token(&secret, "ro-a"), token);
    assert!(
        !contains(&store_bytes(&db), &secret),
        "the secret is in the store's bytes"
    );
    assert_eq!(meta_secret(&db), None);
    gw.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_store_s_secret_moves_to_the_key_file_and_old_tokens_still_work() {
    let dir = fresh_dir("migrate");
    let db = dir.join("gw.db");
    // An older gateway's store: the secret in `meta`, the files world-readable.
    let old_secret: Vec<u8> = (0u8..32).map(|i| i.wrapping_mul(37) ^ 0xa5).collect();
    let op_file = dir.join("op.secret");
    std::fs::write(&op_file, &old_secret).unwrap_or_else(|e| panic!("{e}"));
    std::fs::set_permissions(&op_file, std::fs::Permissions::from_mode(0o600))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut cfg = config(&db);
    cfg.token_secret_file = Some(op_file.clone());
    let gw = start(cfg).await;
    let (s, r) = call(
        gw.addr,
        "POST",
        "/rollouts",
        ADMIN,
        json!({"rollout_id": "ro-old"}),
    )
    .await;
    assert_eq!(s, 201, "{r}");
    let old_token = r["token"].as_str().unwrap_or_default().to_string();
    gw.stop().await;
    assert_eq!(old_token, auth::rollout_token(&old_secret, "ro-old"));
    {
        let conn = rusqlite::Connection::open(&db).unwrap_or_else(|e| panic!("{e}"));
        conn.execute(
            "INSERT INTO meta(key, value) VALUES ('token_secret', ?1)",
            rusqlite::params![old_secret],
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }
    std::fs::set_permissions(&db, std::fs::Permissions::from_mode(0o644))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(!with_suffix(&db, ".secret").exists());

    // The new gateway (no operator secret) moves it out of the store.
    let gw = start(config(&db)).await;
    let key_file = with_suffix(&db, ".secret");
    assert_eq!(std::fs::read(&key_file).unwrap_or_default(), old_secret);
    assert_eq!(mode(&key_file), 0o600);
    assert_eq!(mode(&db), 0o600, "an older store's file is made private");
    assert_eq!(meta_secret(&db), None);
    assert!(
        !contains(&store_bytes(&db), &old_secret),
        "the secret is still in the store's bytes"
    );
    // The token handed out before still authorizes its rollout, and asking
    // for the rollout again gives the same token.
    let (s, r) = call(
        gw.addr,
        "GET",
        "/rollouts/ro-old/trace",
        &old_token,
        Value::Null,
    )
    .await;
    assert_eq!(s, 200, "{r}");
    let (s, r) = call(
        gw.addr,
        "POST",
        "/rollouts",
        ADMIN,
        json!({"rollout_id": "ro-old"}),
    )
    .await;
    assert!(s == 200 || s == 201, "{s} {r}");
    assert_eq!(r["token"].as_str(), Some(old_token.as_str()));
    let (s, r) = call(
        gw.addr,
        "POST",
        "/rollouts",
        ADMIN,
        json!({"rollout_id": "ro-new"}),
    )
    .await;
    assert_eq!(s, 201, "{r}");
    assert_eq!(
        r["token"].as_str(),
        Some(auth::rollout_token(&old_secret, "ro-new").as_str())
    );
    gw.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_secret_file_must_not_be_world_readable() {
    let dir = fresh_dir("opfile");
    let f = dir.join("key");
    std::fs::write(&f, "0123456789abcdef0123456789abcdef\n").unwrap_or_else(|e| panic!("{e}"));
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut cfg = config(&dir.join("gw.db"));
    cfg.token_secret_file = Some(f.clone());
    let err = Server::bind(cfg.clone())
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("chmod 600"), "{err}");
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600))
        .unwrap_or_else(|e| panic!("{e}"));
    let gw = start(cfg).await;
    let (s, r) = call(
        gw.addr,
        "POST",
        "/rollouts",
        ADMIN,
        json!({"rollout_id": "ro-x"}),
    )
    .await;
    assert_eq!(s, 201, "{r}");
    assert_eq!(
        r["token"].as_str(),
        Some(auth::rollout_token(b"0123456789abcdef0123456789abcdef", "ro-x").as_str())
    );
    assert!(!with_suffix(&dir.join("gw.db"), ".secret").exists());
    gw.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_writer_per_store_file() {
    let dir = fresh_dir("lock");
    let db = dir.join("gw.db");
    let gw = start(config(&db)).await;
    // A second gateway on the same file fails at once, naming the file.
    let err = Server::bind(config(&db)).await.err();
    match &err {
        Some(GatewayError::StoreLocked { path, .. }) => assert_eq!(path, &db.display().to_string()),
        other => panic!(
            "a second gateway on {} was not refused: {other:?}",
            db.display()
        ),
    }
    let msg = err.map(|e| e.to_string()).unwrap_or_default();
    assert!(
        msg.contains(&db.display().to_string()) && msg.contains("gateway = URL"),
        "{msg}"
    );
    // So does `mark_trained`'s writer; a reader does not need the lock.
    assert!(matches!(
        Store::open(&db, SyncMode::Full, SecretSource::None),
        Err(GatewayError::StoreLocked { .. })
    ));
    assert!(lightning_gateway::store::Reader::open(&db).is_ok());
    gw.stop().await;
    // Stopped, the file takes a writer again.
    let store =
        Store::open(&db, SyncMode::Full, SecretSource::None).unwrap_or_else(|e| panic!("{e}"));
    assert!(Store::open(&db, SyncMode::Full, SecretSource::None).is_err());
    store.close();
    let again = start(config(&db)).await;
    again.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}
