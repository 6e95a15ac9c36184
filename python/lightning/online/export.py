"""``lightning online export``: sessions to JSONL, one line per session —
chat-style messages (whatever protocol the harness spoke), each call's
response id and token ids, the feedback signals and the session's reward.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning.online.rewards import BadReward, OnlineRewardSection, session_reward
from lightning.online.select import SourceSection, select_sessions
from lightning.online.sessions import Session, dumps, store_reader


@dataclass
class ExportSummary:
    """What ``export_sessions`` wrote, and the calls it could not read (left out
    of their session's line, which lists them under ``skipped_calls``)."""

    sessions: int = 0
    calls: int = 0
    skipped: list[dict[str, Any]] = field(default_factory=list)  # session_id, seq, reason
    redacted_sessions: int = 0

    def line(self, out: str | Path) -> str:
        text = f"wrote {self.sessions} sessions ({self.calls} calls) to {out}"
        if self.redacted_sessions:
            text += f"; {self.redacted_sessions} redacted (token ids left out unless --with-ids)"
        if self.skipped:
            reasons = Counter(x["reason"] for x in self.skipped)
            text += f"; skipped {len(self.skipped)} calls it could not read: {dict(reasons)}"
        return text


def export_sessions(
    db: str,
    path: str | Path,
    *,
    reward: OnlineRewardSection | None = None,
    only_feedback: bool = False,
    with_ids: bool = False,
) -> ExportSummary:
    """Writes one JSON line per session: messages, token ids per call, signals,
    reward. A call whose recorded request cannot be read as its protocol's is
    left out and reported (``ExportSummary.skipped``, and ``skipped_calls`` in
    its session's line) instead of ending the export. A redacted session's calls
    carry no token ids (they decode to the text redaction removed) unless
    ``with_ids``."""
    reward = reward or OnlineRewardSection()
    src = SourceSection(
        db=db, require_feedback=only_feedback, closed_only=False, include_trained=True
    )
    sessions = select_sessions(src)
    summary = ExportSummary()
    reader = store_reader(db)
    # Production text (and, with ``with_ids``, ids that decode to redacted
    # text): 0600 whatever the umask, as the store itself is. Created 0600, and
    # an existing file is tightened before a byte is written to it.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with open(fd, "w") as f:
        for s in sessions:
            line = _export_session(reader, s, reward, with_ids=with_ids)
            summary.skipped.extend({"session_id": s.rollout_id, **x} for x in line["skipped_calls"])
            summary.redacted_sessions += bool(line["redacted"])
            summary.calls += len(line["calls"])
            f.write(dumps(line) + "\n")
            summary.sessions += 1
    return summary


def _export_session(
    reader: Any, s: Session, reward: OnlineRewardSection, *, with_ids: bool
) -> dict[str, Any]:
    bodies = {
        seq: (proto, harness, resp)
        for seq, proto, harness, resp in reader.call_bodies(s.rollout_id)
    }
    calls, skipped = [], []
    messages: list[Any] = []
    redacted = False
    for rec in reader.records(s.rollout_id):
        proto, harness, resp = bodies.get(rec["seq"], (None, None, None))
        text = rec["text"]
        try:
            body = json.loads(harness) if harness else {}
            if not isinstance(body, dict):
                raise ValueError(f"the request is a JSON {type(body).__name__}, not an object")
            sent = sent_messages(body, messages)
        except ValueError as e:  # JSONDecodeError is one
            skipped.append({"seq": rec["seq"], "protocol": proto, "reason": str(e)})
            continue
        if body.get("redacted") is True:
            redacted = True
        if sent is not None:
            messages = sent + ([{"role": "assistant", "content": text}] if text is not None else [])
        ids = with_ids or body.get("redacted") is not True
        calls.append(
            {
                "seq": rec["seq"],
                "response_id": resp,
                "protocol": proto,
                "status": rec["status"],
                "prompt_ids": _u32(rec["prompt_ids"]) if ids else None,
                "completion_ids": _u32(rec["completion_ids"]) if ids else None,
                "weight_version": rec["weight_version"],
                "text": text,
            }
        )
    try:
        r: float | None = session_reward(s.signals, reward)
        reward_error = None
    except BadReward as e:
        r, reward_error = None, str(e)
    return {
        "session_id": s.rollout_id,
        "app_key": s.app_key,
        "session_key": s.session_key,
        "tags": s.tags,
        "started": s.started,
        "updated": s.updated,
        "closed": s.closed,
        "trained": s.trained,
        "redacted": redacted,
        "reward": r,
        **({"reward_error": reward_error} if reward_error else {}),
        "signals": s.signals,
        "messages": messages,
        "calls": calls,
        "skipped_calls": skipped,
    }


def sent_messages(body: dict[str, Any], before: list[Any]) -> list[Any] | None:
    """The conversation a harness sent, as chat-style messages, whatever its protocol:
    chat ``messages``; Anthropic ``system`` + ``messages``; Responses ``instructions``
    + ``input`` (a string or items), continuing ``before`` when it names a
    ``previous_response_id`` (the input then holds only the new turn). Items that are
    not messages (tool calls and outputs) are kept as sent. None: no text stored
    (a redacted call). ``ValueError`` names a shape it cannot read."""
    if "messages" in body:
        if not isinstance(body["messages"], list):
            raise ValueError(f"`messages` is {_kind(body['messages'])}, not a list")
        system = body.get("system")
        if isinstance(system, list):  # Anthropic text blocks
            system = "".join(b.get("text", "") for b in system if isinstance(b, dict))
        head = [{"role": "system", "content": system}] if system else []
        return head + list(body["messages"])
    if "input" not in body:
        return None
    items = body["input"]
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    elif not isinstance(items, list):
        raise ValueError(f"Responses `input` is {_kind(items)}, not a string or a list of items")
    if body.get("previous_response_id"):
        return [*before, *items]
    system = body.get("instructions")
    return ([{"role": "system", "content": system}] if system else []) + list(items)


def _kind(x: Any) -> str:
    if x is None:
        return "null"
    names = {bool: "boolean", int: "number", float: "number", dict: "an object"}
    return names.get(type(x), f"a {type(x).__name__}")


def _u32(ids: Any) -> list[int] | None:
    return None if ids is None else [int(x) for x in ids]
