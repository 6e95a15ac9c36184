"""Read traces straight from the gateway's SQLite file, without HTTP.

Every read goes through the gateway's own Rust reader (``_core.StoreReader``,
GIL released), the same code the HTTP trace route uses. The gateway writes in
WAL mode, so reading while it runs is safe and sees every committed call.

    store = Store("lightning.db")
    batch = store.read_step(rollout_ids)       # one read + merge: samples, rewards, groups
    calls = store.trace(rid)              # list[lightning.Call]
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from lightning._core import MergeResult, StoreError, StoreReader, Tokenizer
from lightning.gateway.records import CallRecord


class _Closed:
    """The reader of a closed ``Store``: every read says so."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __getattr__(self, name: str) -> Any:
        raise StoreError(f"{self.path}: this lightning.Store is closed; open a new one to read")


class Store:
    """Read-only view of a gateway store file. Raises ``lightning.StoreError``
    when there is no store at ``path``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._reader = StoreReader(self.path)

    def close(self) -> None:
        """Closes the reader's connection now (not whenever the object is
        collected): until then Python's ``sqlite3`` is refused on this file
        (``lightning/gateway/store_guard.py``). Reads after it raise ``StoreError``."""
        # Stands in for the reader (typed as one: every attribute raises).
        self._reader = cast(StoreReader, _Closed(self.path))

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def rollouts(self, status: str | None = None, group: str | None = None) -> list[dict[str, Any]]:
        """Rollouts in creation order, each with its latest reward (None without one)."""
        rows = self._reader.rollouts(group=group, status=status)
        for r in rows:
            r["task"] = json.loads(r.pop("task_json"))
        return rows

    def rollout_ids(self, status: str | None = None, group: str | None = None) -> list[str]:
        return [r["rollout_id"] for r in self._reader.rollouts(group=group, status=status)]

    def records(self, rollout_id: str) -> list[CallRecord]:
        """Every recorded completion of the rollout, in seq order, with status and flags."""
        out = []
        group = next(iter(self._reader.rollouts([rollout_id])), {}).get("group")
        for r in self._reader.records(rollout_id):
            usage = r.pop("usage_json")
            out.append(CallRecord(**r, usage=json.loads(usage) if usage else None, group=group))
        return out

    def requests(self, rollout_id: str) -> list[tuple[int, str, str | None]]:
        """Each call's ``(seq, engine_request, harness_request)`` as JSON text, in seq
        order: what the gateway sent the engine and what the harness sent it, whole
        (the store keeps only what each call adds to an earlier one). A request's later
        choices carry ``("", None)``: its first choice holds the bodies."""
        return self._reader.requests(rollout_id)

    def trace(self, rollout_id: str) -> list[Any]:
        """The calls the harness saw whole, with exact ids, as ``lightning.Call``."""
        return self._reader.trace(rollout_id)

    def read_step(
        self,
        rollout_ids: Sequence[str] | None = None,
        *,
        group: str | None = None,
        status: str | None = None,
        mode: str | None = None,
        max_tokens: int | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> MergeResult:
        """A training step's batch in one call: the selected rollouts (with group,
        mode, status and latest reward, in ``rollouts``) and their trainable calls,
        read in one transaction and merged (drift classified with ``tokenizer``)."""
        ids = list(rollout_ids) if rollout_ids is not None else None
        return self._reader.read_step(
            ids, group=group, status=status, mode=mode, max_tokens=max_tokens, tokenizer=tokenizer
        )

    def step(self, *args: Any, **kwargs: Any) -> MergeResult:
        """Deprecated name of :meth:`read_step` (it only reads; ``step`` was
        easy to mistake for the trainer's)."""
        warnings.warn(
            "Store.step is deprecated: it only reads a batch; call Store.read_step",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.read_step(*args, **kwargs)

    def events(self, rollout_id: str) -> list[dict[str, Any]]:
        return [
            {"seq": seq, "type": kind, "data": json.loads(data), "created": created}
            for seq, kind, data, created in self._reader.events(rollout_id)
        ]

    def rewards(self, group: str | None = None) -> dict[str, float]:
        """The latest reward per rollout (rollouts without one are left out)."""
        return {
            r["rollout_id"]: float(r["reward"])
            for r in self._reader.rollouts(group=group)
            if r["reward"] is not None
        }
