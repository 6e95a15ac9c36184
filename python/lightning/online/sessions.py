"""Online sessions as the trainer side reads them from the store.

The gateway records calls made with an application key into *sessions*
(rollouts with ``origin = 'online'``, see ``rust/gateway/src/online``) and
keeps every feedback signal posted later (``POST /v1/feedback``). This module
reads them through the store's one reader (``lightning._core.StoreReader``)
and writes the one thing the trainer side writes: the trained mark.
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A table of an online configuration: unknown keys are an error."""

    model_config = ConfigDict(extra="forbid")


@dataclass
class Session:
    rollout_id: str
    key_id: str
    app_key: str
    session_key: str | None
    tags: list[str]
    n_calls: int
    started: float
    updated: float
    closed: bool
    trained: float | None
    signals: list[dict[str, Any]] = field(default_factory=list)


def store_reader(db: str | Path) -> Any:
    """The store's one reader (``lightning._core.StoreReader``) on ``db``."""
    from lightning import _core

    if not Path(db).exists():
        raise FileNotFoundError(f"no gateway store at {db}; give the gateway's --db path")
    return _core.StoreReader(str(db))


def signals(reader: Any, rollout_ids: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rid in rollout_ids:
        for f in reader.feedback(rid):
            out[rid].append(
                {
                    "feedback_id": f["feedback_id"],
                    "response_id": f["response_id"],
                    "name": f["name"],
                    "value": float(f["value"]),
                    "ts": float(f["ts"]),
                    "after_training": bool(f["after_training"]),
                    "data": json.loads(f["data_json"]),
                }
            )
    return out


def mark_trained(
    db: str,
    rollout_ids: Sequence[str],
    when: float | None = None,
    *,
    gateway: str | None = None,
    admin_key: str | None = None,
) -> int:
    """Marks sessions trained; returns how many were found. With ``gateway``
    (the running gateway that writes ``db``) the write goes through its single
    writer (``POST /admin/online/trained``); without, the store's own writer
    opens ``db`` (the gateway must be stopped then)."""
    when = time.time() if when is None else when
    if gateway is None:
        from lightning import _core

        return _core.mark_trained(str(db), list(rollout_ids), when)
    from lightning.gateway.client import GatewayClient

    with GatewayClient(gateway, admin_key) as client:
        body = {"session_ids": list(rollout_ids), "trained_at": when}
        r = client._request("POST", "/admin/online/trained", json=body)
        return int(r.json()["marked"])


def finite_json(x: Any) -> Any:
    """``x`` with every non-finite float replaced by None (JSON has no Infinity/NaN)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite_json(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [finite_json(v) for v in x]
    return x


def dumps(x: Any, **kw: Any) -> str:
    return json.dumps(finite_json(x), allow_nan=False, default=float, **kw)
