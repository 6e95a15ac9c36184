"""One SQLite per process (``lightning.gateway.store_guard``): Python's ``sqlite3``
is refused on a store file this process has open in Rust, because closing such a
connection deletes the ``-wal`` an in-process gateway still writes to."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import lightning
from gateways import start_gateway
from lightning import _core
from lightning.gateway.store_guard import _path

NO_ENGINE = "http://127.0.0.1:9/v1"  # rollouts and rewards need no engine


def test_sqlite3_is_refused_while_a_gateway_or_reader_here_has_the_store(tmp_path: Path) -> None:
    db = tmp_path / "gw.db"
    link = tmp_path / "other-name.db"
    link.symlink_to(db)
    handle = start_gateway(NO_ENGINE, db)
    try:
        assert _core.store_open_here(db) and _core.store_open_here(link)
        for name in (db, str(link), f"file:{db}?mode=ro"):
            with pytest.raises(lightning.StoreError, match="sqlite3 must not open it"):
                sqlite3.connect(name, uri=str(name).startswith("file:"))
    finally:
        handle.stop()
    assert not _core.store_open_here(db)
    sqlite3.connect(db).close()  # the gateway is gone: nothing to break
    store = lightning.Store(db)
    with pytest.raises(lightning.StoreError):
        sqlite3.connect(db)
    del store
    assert not _core.store_open_here(db)
    # Other files and memory databases are never refused.
    sqlite3.connect(tmp_path / "unrelated.db").close()
    sqlite3.connect(":memory:").close()


def test_uri_and_plain_names() -> None:
    assert _path("file:/a/b.db?mode=ro") == "/a/b.db"
    assert _path("file:///a/b.db") == "/a/b.db"
    assert _path(b"/a/b.db") == "/a/b.db"
    assert _path(":memory:") is None and _path("") is None and _path(3) is None


# What happens without the guard, in a child process: an in-process gateway
# acknowledges 60 rollouts while the test's own sqlite3 reads the file six times.
CHILD = """
import os, sqlite3, subprocess, sys
from pathlib import Path
sys.path.insert(0, {support!r})
from gateways import start_gateway
db = Path({db!r})
handle = start_gateway({engine!r}, db)
client = handle.client()
refused = 0
for i in range(60):
    client.create_rollout({{"t": i}}, group="g")
    if i % 10 == 5:
        try:
            con = sqlite3.connect(db)
            con.execute("SELECT count(*) FROM rollouts").fetchone()
            con.close()
        except Exception as e:
            refused += type(e).__name__ == "StoreError"
# Another process reads while the gateway still runs (a trainer, the view).
code = "import sqlite3; print(sqlite3.connect({db!r}).execute('SELECT count(*) FROM rollouts').fetchone()[0])"
seen = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
print(refused, seen.stdout.strip(), flush=True)
os._exit(0)  # as a crash would: the gateway never closes the store
"""


def test_acknowledged_commits_survive_the_tests_own_sqlite3(tmp_path: Path) -> None:
    """Without the guard, another process saw 6 of 60 acknowledged rollouts
    (the rest sat in a deleted `-wal`, lost at the crash); with it, every
    sqlite3 connect is refused and all 60 are in the file."""
    db = tmp_path / "gw.db"
    support = str(Path(__file__).resolve().parent.parent / "support")
    out = subprocess.run(
        [sys.executable, "-c", CHILD.format(support=support, db=str(db), engine=NO_ENGINE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    refused, seen = (int(x) for x in out.stdout.split())
    assert refused == 6
    assert seen == 60
    with sqlite3.connect(db) as c:  # and after the crash, from this process
        assert c.execute("SELECT count(*) FROM rollouts").fetchone()[0] == 60


def test_a_closed_store_releases_the_file(tmp_path: Path) -> None:
    """`Store.close()` (and `with Store(...)`) closes the reader then, not at collection."""
    db = tmp_path / "gw.db"
    start_gateway(NO_ENGINE, db).stop()
    with lightning.Store(db) as store:
        assert _core.store_open_here(db)
        assert store.rollouts() == []
    assert not _core.store_open_here(db)
    with pytest.raises(lightning.StoreError, match="closed"):
        store.rollouts()
    sqlite3.connect(db).close()
