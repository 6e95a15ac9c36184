"""Refuse Python's ``sqlite3`` on a store file this process has open in Rust.

The store's SQLite is compiled into ``lightning._core``; Python's ``sqlite3``
module links the system's. Two copies of SQLite in one process each keep their
own books over the same POSIX (``fcntl``) locks, and a process never conflicts
with itself. So a ``sqlite3`` connection to a store that an in-process gateway
(or ``lightning.Store``, ``mark_trained``) has open sees none of the store's
locks: when it closes it takes itself for the file's last user, checkpoints
and deletes the ``-wal`` the gateway still appends to, and its closing
descriptor drops the gateway's locks. The gateway's later acknowledged commits
then live only in an unlinked file: other processes stop seeing them and a
crash loses them (``tests/gateway/test_store_guard.py`` reproduces it; see
docs/guarantees.md, "one SQLite per process").

lightning itself never opens a store with ``sqlite3`` (``tests/test_layers.py``
checks). For everyone else, an audit hook (PEP 578) on ``sqlite3.connect``
raises ``lightning.StoreError`` while the Rust side has that file open
(``_core.store_open_here``, by device and inode: any name of the file). Read a
live store through ``lightning.Store``, or with ``sqlite3`` from another
process. A connection opened *before* the Rust side opens the file is not
seen; close it first.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from lightning import _core

_installed = False


def _path(database: Any) -> str | None:
    """The file a ``sqlite3.connect`` argument names (None: memory or unknown)."""
    try:
        name = os.fsdecode(database)
    except TypeError:
        return None
    if name.startswith("file:"):  # a URI (``uri=True``): the path before any query
        name = name[len("file:") :].split("?", 1)[0].split("#", 1)[0]
        if name.startswith("//"):  # file://host/path: the path part
            name = "/" + name[2:].split("/", 1)[-1]
    if not name or name == ":memory:":
        return None
    return name


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if event != "sqlite3.connect" or not args:
        return
    path = _path(args[0])
    if path is not None and _core.store_open_here(path):
        raise _core.StoreError(
            f"{path}: this process has the store open through lightning (an in-process "
            "gateway, lightning.Store or mark_trained); Python's sqlite3 must not open it "
            "now: closing that connection would delete the -wal the store still writes "
            "(acknowledged commits lost). Read it with lightning.Store, or with sqlite3 "
            "from another process"
        )


def install() -> None:
    """Install the hook once per process (audit hooks cannot be removed)."""
    global _installed
    if not _installed:
        sys.addaudithook(_hook)
        _installed = True
