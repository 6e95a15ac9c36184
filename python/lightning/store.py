"""Read traces straight from the gateway's SQLite file, without HTTP.

The gateway writes in WAL mode, so reading while it runs is safe and sees every
committed call. Ids are little-endian uint32 blobs and logprobs float32 blobs
(DESIGN.md §4); they become numpy arrays without per-token Python work.

    store = Store("lightning.db")
    for rid in store.rollout_ids(group="task-7"):
        calls = store.trace(rid)          # list[lightning.Call]
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np

from lightning._core import LightningError
from lightning.client import CallRecord

_CALL_COLUMNS = (
    "c.rollout_id, c.seq, c.request_id, c.choice_index, c.kind, c.prompt_ids, c.completion_ids, "
    "c.logprobs, c.finish_reason, c.status, c.flags, c.delivered, c.retry_count, "
    "c.weight_version, c.upstream, c.http_status, c.latency_ms, c.text, c.usage, r.grp"
)


def _ids(blob: bytes | None) -> np.ndarray | None:
    return None if blob is None else np.frombuffer(blob, dtype="<u4").astype(np.uint32)


def _f32(blob: bytes | None) -> np.ndarray | None:
    return None if blob is None else np.frombuffer(blob, dtype="<f4").astype(np.float32)


class Store:
    """Read-only view of a gateway store file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise LightningError(
                f"no gateway store at {self.path}; pass the --db path the gateway was started with"
            )
        self._db = sqlite3.connect(str(self.path), timeout=30.0, check_same_thread=False)
        self._db.execute("PRAGMA query_only = 1")

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def rollouts(self, status: str | None = None, group: str | None = None) -> list[dict[str, Any]]:
        rows = self._db.execute(
            "SELECT id, grp, task, mode, status, created, updated FROM rollouts "
            "WHERE (?1 IS NULL OR status = ?1) AND (?2 IS NULL OR grp = ?2) ORDER BY created, id",
            (status, group),
        ).fetchall()
        return [
            {
                "rollout_id": r[0],
                "group": r[1],
                "task": json.loads(r[2]),
                "mode": r[3],
                "status": r[4],
                "created": r[5],
                "updated": r[6],
            }
            for r in rows
        ]

    def rollout_ids(self, status: str | None = None, group: str | None = None) -> list[str]:
        return [r["rollout_id"] for r in self.rollouts(status, group)]

    def records(self, rollout_id: str) -> list[CallRecord]:
        """Every recorded completion of the rollout, in seq order, with status and flags."""
        rows = self._db.execute(
            f"SELECT {_CALL_COLUMNS} FROM calls c LEFT JOIN rollouts r ON r.id = c.rollout_id "
            "WHERE c.rollout_id = ? ORDER BY c.seq",
            (rollout_id,),
        ).fetchall()
        return [
            CallRecord(
                rollout_id=r[0],
                seq=r[1],
                request_id=r[2],
                choice_index=r[3],
                kind=r[4],
                prompt_ids=_ids(r[5]),
                completion_ids=_ids(r[6]),
                logprobs=_f32(r[7]),
                finish_reason=r[8],
                status=r[9],
                flags=[f for f in r[10].split(",") if f],
                delivered=bool(r[11]),
                retry_count=r[12],
                weight_version=r[13],
                upstream=r[14],
                http_status=r[15],
                latency_ms=r[16],
                text=r[17],
                usage=json.loads(r[18]) if r[18] else None,
                group=r[19],
            )
            for r in rows
        ]

    def trace(self, rollout_id: str) -> list[Any]:
        """The calls the harness saw whole, with exact ids, as ``lightning.Call``."""
        return [rec.to_call() for rec in self.records(rollout_id) if rec.trainable]

    def events(self, rollout_id: str) -> list[dict[str, Any]]:
        rows = self._db.execute(
            "SELECT seq, type, data, created FROM events WHERE rollout_id = ? ORDER BY seq",
            (rollout_id,),
        ).fetchall()
        return [
            {"seq": r[0], "type": r[1], "data": json.loads(r[2]), "created": r[3]} for r in rows
        ]

    def rewards(self, group: str | None = None) -> dict[str, float]:
        """The latest reward per rollout (rollouts without one are left out)."""
        rows = self._db.execute(
            "SELECT e.rollout_id, e.data FROM events e JOIN rollouts r ON r.id = e.rollout_id "
            "WHERE e.type = 'reward' AND (?1 IS NULL OR r.grp = ?1) ORDER BY e.rollout_id, e.seq",
            (group,),
        ).fetchall()
        out: dict[str, float] = {}
        for rid, data in rows:
            out[rid] = float(json.loads(data)["value"])
        return out
