"""Raw SQL on a store file, for tests that check what is on disk.

Python's ``sqlite3`` must not open a store this process has open in Rust (an
in-process gateway, ``lightning.Store``): closing it would delete the ``-wal``
the store still writes (``lightning/gateway/store_guard.py`` refuses it). Then
the query runs in a child process, where a second SQLite is harmless."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

from lightning import _core

CHILD = """
import json, sqlite3, sys
db, sql, args = json.loads(sys.stdin.read())
con = sqlite3.connect(db)
rows = con.execute(sql, args).fetchall()
con.close()
print(json.dumps([[{"blob": v.hex()} if isinstance(v, bytes) else v for v in r] for r in rows]))
"""


def rows(db: str | Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """``sql``'s rows, as ``sqlite3`` gives them (blobs as ``bytes``)."""
    if not _core.store_open_here(db):
        con = sqlite3.connect(db)
        try:
            return con.execute(sql, args).fetchall()
        finally:
            con.close()
    out = subprocess.run(
        [sys.executable, "-c", CHILD],
        input=json.dumps([str(db), sql, list(args)]),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return [
        tuple(bytes.fromhex(v["blob"]) if isinstance(v, dict) else v for v in r)
        for r in json.loads(out.stdout)
    ]
