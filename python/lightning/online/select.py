"""Which sessions an online pass trains on, and how they are grouped.

**Selection.** ``[source]`` picks sessions by time window, key, tags, length,
feedback and whether they were trained already; every session of the window
that is left out is counted under its reason.

**Groups and estimators.** Production traffic was never sampled in groups, so
groups are built after the fact by a key (``[grouping] key``):
``first_prompt`` (default: the exact token ids of the session's first prompt —
system prompt + first user turn as rendered, protocol- and redaction-proof),
``system_first_user`` (the text of the system prompt + first user message;
unavailable for redacted keys), ``session`` or ``none``. A group with fewer than
``min_group`` members is pooled with the other small ones into one batch group
(``__batch__``), so its baseline is the batch mean — with ``estimator =
"reinforce_pp"`` that is REINFORCE++'s batch baseline, and the advantage is then
divided by the batch std. Bias: (1) the group mean includes the sample's own
reward, shrinking its advantage by (1 − 1/n) (GRPO's known bias; ``rloo``
avoids it); (2) the pooled baseline mixes prompts of different difficulty, which
adds variance and, when prompt difficulty correlates with selection (e.g. only
sessions with feedback), bias toward prompts that get feedback; (3) a lone
session in the whole batch gets zero advantage and trains nothing.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field

from lightning.online.sessions import Section, Session, signals, store_reader


class SourceSection(Section):
    """Which sessions to train on."""

    kind: Literal["store"] = "store"
    db: str
    since: float | None = Field(
        default=None, description="unix seconds: sessions last active at or after"
    )
    until: float | None = Field(
        default=None, description="unix seconds: sessions last active before"
    )
    since_hours: float | None = Field(default=None, gt=0, description="or: the last N hours")
    tags: list[str] = Field(default_factory=list, description="every tag must be on the key")
    app_keys: list[str] = Field(default_factory=list, description="key names (empty: all)")
    require_feedback: bool = True
    min_calls: int = Field(default=1, ge=1)
    closed_only: bool = Field(default=True, description="only sessions the gateway closed (idle)")
    include_trained: bool = False
    min_weight_version: int | None = None
    limit: int | None = Field(default=None, ge=1)
    gateway: str | None = Field(
        default=None,
        description="URL of the gateway writing `db`, when it runs: the trained mark then "
        "goes through its single writer; leave unset only while it is stopped",
    )
    admin_key_env: str = Field(
        default="LIGHTNING_ADMIN_KEY", description="environment variable with its admin key"
    )


class GroupingSection(Section):
    key: Literal["first_prompt", "system_first_user", "session", "none"] = "first_prompt"
    min_group: int = Field(default=2, ge=1)


@dataclass
class Selection:
    """The sessions a pass trains on, and why the others in its time window were skipped."""

    sessions: list[Session]
    skipped: Counter[str] = field(default_factory=Counter)


def select(src: SourceSection, *, now: float | None = None) -> Selection:
    """Sessions matching ``src``, oldest first, with their signals; each session
    in the time window that is left out is counted under the first reason that
    applies: ``open``, ``already_trained``, ``other_key``, ``tags``,
    ``too_short`` (fewer than ``min_calls`` calls), ``no_feedback``."""
    now = time.time() if now is None else now
    since = src.since
    if src.since_hours is not None:
        since = max(since or 0.0, now - src.since_hours * 3600.0)
    skipped: Counter[str] = Counter()
    reader = store_reader(src.db)
    sessions = []
    for row in reader.sessions(since=since, until=src.until):
        tags = list(json.loads(row["task_json"]).get("tags") or [])
        s = Session(
            row["rollout_id"], row["key_id"], row["app_key"] or "", row["session_key"], tags,
            row["n_calls"], row["started"], row["updated"], row["closed"], row["trained"],
        )  # fmt: skip
        reason = _skip_reason(s, src)
        if reason is None:
            sessions.append(s)
        else:
            skipped[reason] += 1
    sigs = signals(reader, [s.rollout_id for s in sessions])
    for s in sessions:
        s.signals = sigs.get(s.rollout_id, [])
    if src.require_feedback:
        skipped["no_feedback"] += sum(not s.signals for s in sessions)
        sessions = [s for s in sessions if s.signals]
    if src.limit and len(sessions) > src.limit:
        skipped["over_limit"] += len(sessions) - src.limit
        sessions = sessions[: src.limit]
    return Selection(sessions, skipped)


def _skip_reason(s: Session, src: SourceSection) -> str | None:
    if src.closed_only and not s.closed:
        return "open"
    if s.trained is not None and not src.include_trained:
        return "already_trained"
    if src.app_keys and s.app_key not in src.app_keys:
        return "other_key"
    if not set(src.tags) <= set(s.tags):
        return "tags"
    if s.n_calls < src.min_calls:
        return "too_short"
    return None


def select_sessions(src: SourceSection, *, now: float | None = None) -> list[Session]:
    """Sessions matching ``src``, oldest first, with their signals."""
    return select(src, now=now).sessions


def _first_call(reader: Any, rid: str) -> tuple[bytes | None, str | None]:
    """The first call's prompt ids (as their little-endian bytes) and harness request."""
    records = reader.records(rid)
    if not records:
        return (None, None)
    p = records[0]["prompt_ids"]
    return (None if p is None else p.astype("<u4").tobytes(), reader.call_bodies(rid)[0][2])


def group_key(kind: str, rid: str, prompt_blob: bytes | None, harness: str | None) -> str:
    import hashlib

    if kind == "session":
        return rid
    if kind == "none":
        return "__all__"
    if kind == "first_prompt":
        return "p:" + hashlib.sha256(prompt_blob or rid.encode()).hexdigest()[:16]
    try:
        body = json.loads(harness) if harness else {}
    except ValueError:
        body = {}
    body = body if isinstance(body, dict) else {}
    msgs = body.get("messages")
    msgs = [m for m in msgs if isinstance(m, dict)] if isinstance(msgs, list) else []
    system = [m.get("content") for m in msgs if m.get("role") in ("system", "developer")][:1]
    user = [m.get("content") for m in msgs if m.get("role") == "user"][:1]
    if not user and body.get("redacted"):
        raise ValueError(
            f"session {rid} was recorded redacted; group by key = 'first_prompt' instead"
        )
    text = json.dumps([system, user, body.get("instructions"), body.get("system")], sort_keys=True)
    return "t:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def pool_small_groups(groups: dict[str, str], min_group: int) -> dict[str, str]:
    """Members of groups smaller than ``min_group`` move to one ``__batch__`` group."""
    size = Counter(groups.values())
    return {rid: g if size[g] >= min_group else "__batch__" for rid, g in groups.items()}


def session_groups(db: str, sessions: Sequence[Session], g: GroupingSection) -> dict[str, str]:
    reader = store_reader(db)
    keys = {
        s.rollout_id: group_key(g.key, s.rollout_id, *_first_call(reader, s.rollout_id))
        for s in sessions
    }
    return pool_small_groups(keys, g.min_group)
