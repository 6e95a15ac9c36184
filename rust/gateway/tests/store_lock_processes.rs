//! One writer per store *file* (issue 39, finding 1), between two real
//! `lightning-gateway` processes: a hard link, a symlink, or a deleted file
//! beside the store never admits a second writer, and the refusal names the
//! first writer's pid.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_lightning-gateway");

fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lightning-proc-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    dir
}

fn gateway(db: &Path) -> Command {
    let mut c = Command::new(BIN);
    c.args([
        "--listen",
        "127.0.0.1:0",
        "--admin-key",
        "admin-key-123",
        "--db",
    ])
    .arg(db)
    .env("RUST_LOG", "info")
    .env_remove("LIGHTNING_TOKEN_SECRET")
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::piped());
    c
}

/// A gateway that is serving (its log said so), killed on drop.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(db: &Path) -> Running {
    let mut child = gateway(db).spawn().unwrap_or_else(|e| panic!("{BIN}: {e}"));
    let stderr = child.stderr.take().unwrap_or_else(|| panic!("no stderr"));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("gateway listening") {
                let _ = tx.send(());
            }
        }
    });
    if rx.recv_timeout(Duration::from_secs(30)).is_err() {
        let _ = child.kill();
        panic!("the first gateway on {} did not start", db.display());
    }
    Running(child)
}

/// Runs a second gateway on `db` and returns its exit status and log; a
/// second gateway that starts serving is the bug, so it is killed and the
/// test fails.
fn second(db: &Path) -> (bool, String) {
    let mut child = gateway(db).spawn().unwrap_or_else(|e| panic!("{e}"));
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            let mut log = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut log);
            }
            return (status.success(), log);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "a second gateway on {} kept running: two writers",
                db.display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_symlink_reaches_the_same_lock_and_the_refusal_names_the_pid() {
    let dir = fresh_dir("symlink");
    let db = dir.join("gw.db");
    let first = start(&db);
    let link = dir.join("other-name.db");
    std::os::unix::fs::symlink(&db, &link).unwrap_or_else(|e| panic!("{e}"));
    let (ok, log) = second(&link);
    assert!(!ok, "{log}");
    assert!(log.contains("already has a writer"), "{log}");
    assert!(log.contains(&format!("pid {}", first.0.id())), "{log}");
    // The refusal names the real file, not the link.
    assert!(log.contains(&db.display().to_string()), "{log}");
    assert!(!dir.join("other-name.db-wal").exists());
    drop(first);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_hard_link_is_refused_while_a_writer_runs_and_when_none_does() {
    let dir = fresh_dir("hardlink");
    let db = dir.join("gw.db");
    let first = start(&db);
    let link = dir.join("copy.db");
    std::fs::hard_link(&db, &link).unwrap_or_else(|e| panic!("{e}"));
    let (ok, log) = second(&link);
    assert!(!ok, "{log}");
    assert!(log.contains("2 hard links"), "{log}");
    assert!(
        !dir.join("copy.db-wal").exists(),
        "the second name got its own WAL"
    );
    drop(first);
    // No writer running: the file still has two names, and neither is opened.
    let (ok, log) = second(&db);
    assert!(!ok && log.contains("2 hard links"), "{log}");
    std::fs::remove_file(&link).unwrap_or_else(|e| panic!("{e}"));
    let again = start(&db);
    drop(again);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn deleting_the_files_beside_the_store_admits_no_second_writer() {
    let dir = fresh_dir("deleted");
    let db = dir.join("gw.db");
    let first = start(&db);
    // Today's gateways kept their lock in `<db>.lock`; whatever sits beside
    // the store, deleting it must not matter: the lock is on the file itself.
    for suffix in [".lock", ".secret"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", db.display()));
    }
    let (ok, log) = second(&db);
    assert!(!ok, "{log}");
    assert!(
        log.contains(&format!("pid {}", first.0.id())),
        "the refusal does not name the writer: {log}"
    );
    drop(first);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_key_file_is_made_private_and_never_silently_replaced() {
    let dir = fresh_dir("secret");
    let db = dir.join("gw.db");
    // A rollout in the store: tokens have been handed out.
    {
        let first = start(&db);
        drop(first);
    }
    let key = PathBuf::from(format!("{}.secret", db.display()));
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644))
        .unwrap_or_else(|e| panic!("{e}"));
    let again = start(&db);
    let mode = std::fs::metadata(&key)
        .map(|m| m.permissions().mode() & 0o777)
        .unwrap_or(0);
    assert_eq!(mode, 0o600, "a 0644 key file was left readable");
    drop(again);
    {
        let conn = rusqlite::Connection::open(&db).unwrap_or_else(|e| panic!("{e}"));
        conn.execute(
            "INSERT INTO rollouts(id, task, mode, status, token_hash, created, updated)
             VALUES ('ro-1', '{}', 'train', 'queued', 'h', 0, 0)",
            [],
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }
    let before = std::fs::read(&key).unwrap_or_default();
    std::fs::remove_file(&key).unwrap_or_else(|e| panic!("{e}"));
    let (ok, log) = second(&db);
    assert!(!ok, "a missing key file was silently replaced: {log}");
    assert!(
        log.contains("key file is missing") && log.contains("1 rollouts"),
        "{log}"
    );
    assert!(!key.exists());
    // Restored, the store opens again with its old secret.
    std::fs::write(&key, &before).unwrap_or_else(|e| panic!("{e}"));
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600))
        .unwrap_or_else(|e| panic!("{e}"));
    let restored = start(&db);
    drop(restored);
    assert_eq!(std::fs::read(&key).unwrap_or_default(), before);
    let _ = std::fs::remove_dir_all(&dir);
}
