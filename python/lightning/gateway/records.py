"""What the gateway records and answers, as plain Python values.

``CallRecord`` is one recorded completion as the store holds it (read over HTTP
in the columnar encoding, or straight from the file by ``lightning.gateway.store``);
``Rollout``, ``AppKey``, ``FeedbackReceipt`` and ``OnlineSession`` are what the
admin API hands back. Shared by the HTTP client and the store reader, so
neither imports the other.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning._core import Call, LightningError


@dataclass(frozen=True)
class Rollout:
    """A created rollout: point the harness at ``base_url`` with ``token`` as its API key."""

    id: str
    token: str
    base_url: str
    group: str | None = None
    mode: str = "train"

    def openai_env(self) -> dict[str, str]:
        """Environment variables the ``openai`` SDK reads."""
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.token}

    @property
    def anthropic_base_url(self) -> str:
        """The base URL for Anthropic clients, which append ``/v1/messages`` themselves."""
        return self.base_url.removesuffix("/v1")

    def anthropic_env(self) -> dict[str, str]:
        """Environment variables the ``anthropic`` SDK and Claude Code read."""
        return {"ANTHROPIC_BASE_URL": self.anthropic_base_url, "ANTHROPIC_API_KEY": self.token}


@dataclass
class CallRecord:
    """Everything the store holds about one recorded completion (one choice)."""

    rollout_id: str
    seq: int
    request_id: str
    choice_index: int
    kind: str
    prompt_ids: np.ndarray | None  # (P,) uint32
    completion_ids: np.ndarray | None  # (C,) uint32
    logprobs: np.ndarray | None  # (C,) float32, NaN unknown
    finish_reason: str | None
    status: str
    flags: list[str] = field(default_factory=list)
    delivered: bool = True
    retry_count: int = 0
    weight_version: int = 0
    upstream: str = ""
    http_status: int = 0
    latency_ms: float = 0.0
    text: str | None = None
    usage: dict[str, Any] | None = None
    group: str | None = None

    @property
    def trainable(self) -> bool:
        """The harness saw it whole and the engine gave exact ids."""
        return (
            self.status == "ok"
            and self.delivered
            and self.prompt_ids is not None
            and self.completion_ids is not None
        )

    def to_call(self) -> Call:
        """As a ``lightning.Call`` (ids uint32, logprobs float32)."""
        return Call(
            rollout_id=self.rollout_id,
            prompt_ids=self.prompt_ids if self.prompt_ids is not None else np.zeros(0, np.uint32),
            completion_ids=(
                self.completion_ids if self.completion_ids is not None else np.zeros(0, np.uint32)
            ),
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            weight_version=self.weight_version,
            group=self.group,
        )


def decode_columnar(buf: bytes, group: str | None = None) -> list[CallRecord]:
    """Decodes ``GET /rollouts/{id}/trace?format=columnar`` (see rust/gateway/src/columnar.rs).

    A trace comes over the network from a gateway that may be another version
    or cut off mid-body: anything that is not exactly one well-formed trace
    raises ``LightningError`` (never a bare struct/JSON/numpy error, and never
    a silently short or shifted array)."""
    if buf[:4] != b"LTRC":
        raise LightningError("not a lightning columnar trace (bad magic)")
    try:
        return _decode_columnar(buf, group)
    except (struct.error, ValueError, KeyError, TypeError, IndexError, RecursionError) as e:
        raise LightningError(f"malformed columnar trace ({len(buf)} bytes): {e!r}") from e


def _decode_columnar(buf: bytes, group: str | None) -> list[CallRecord]:
    version, hlen = struct.unpack_from("<II", buf, 4)
    if version != 1:
        raise LightningError(
            f"columnar trace version {version} is not supported; upgrade lightning"
        )
    header = json.loads(buf[12 : 12 + hlen])
    metas = header["calls"]
    for m in metas:
        for key in ("prompt_len", "completion_len"):
            if type(m[key]) is not int or m[key] < 0:
                raise ValueError(f"call {m.get('seq')}: {key} {m[key]!r} is not a count")
    off = 12 + hlen
    np_total = sum(m["prompt_len"] for m in metas)
    nc_total = sum(m["completion_len"] for m in metas)
    if len(buf) != off + 4 * (np_total + 2 * nc_total):
        raise ValueError(
            f"header announces {np_total} prompt and {nc_total} completion tokens, "
            f"body holds {len(buf) - off} bytes"
        )
    prompts = np.frombuffer(buf, dtype="<u4", count=np_total, offset=off)
    off += 4 * np_total
    comps = np.frombuffer(buf, dtype="<u4", count=nc_total, offset=off)
    off += 4 * nc_total
    lps = np.frombuffer(buf, dtype="<f4", count=nc_total, offset=off)
    out = []
    p0 = c0 = 0
    for m in metas:
        p1, c1 = p0 + m["prompt_len"], c0 + m["completion_len"]
        out.append(
            CallRecord(
                rollout_id=header["rollout_id"],
                seq=m["seq"],
                request_id=m["request_id"],
                choice_index=m["choice_index"],
                kind=m["kind"],
                prompt_ids=prompts[p0:p1].astype(np.uint32) if m["has_prompt_ids"] else None,
                completion_ids=comps[c0:c1].astype(np.uint32) if m["has_completion_ids"] else None,
                logprobs=lps[c0:c1].astype(np.float32) if m["has_logprobs"] else None,
                finish_reason=m["finish_reason"],
                status=m["status"],
                flags=list(m["flags"]),
                delivered=m["delivered"],
                retry_count=m["retry_count"],
                weight_version=m["weight_version"],
                upstream=m["upstream"],
                http_status=m["http_status"],
                latency_ms=m["latency_ms"],
                text=m["text"],
                usage=m["usage"],
                group=group,
            )
        )
        p0, c0 = p1, c1
    return out


@dataclass(frozen=True)
class AppKey:
    """An application key (online mode). ``key`` (``lk-…``) is set only on the
    object :meth:`GatewayClient.create_app_key` returns: the gateway stores its
    hash and never shows it again."""

    id: str
    name: str
    defaults: dict[str, Any]
    created: float
    revoked: float | None = None
    key: str | None = None

    def openai_env(self, gateway_url: str) -> dict[str, str]:
        """Environment for an ``openai`` SDK harness served through this key."""
        return {"OPENAI_BASE_URL": gateway_url.rstrip("/") + "/v1", "OPENAI_API_KEY": self._key()}

    def anthropic_env(self, gateway_url: str) -> dict[str, str]:
        """Environment for an ``anthropic`` SDK harness (it appends ``/v1/messages``)."""
        return {"ANTHROPIC_BASE_URL": gateway_url.rstrip("/"), "ANTHROPIC_API_KEY": self._key()}

    def _key(self) -> str:
        if self.key is None:
            raise LightningError(
                f"application key {self.id!r} ({self.name}) is shown only when created; "
                "create a new one (POST /admin/keys) if it was lost"
            )
        return self.key

    @classmethod
    def _from(cls, d: dict[str, Any]) -> AppKey:
        return cls(
            id=d["id"],
            name=d["name"],
            defaults=dict(d.get("defaults") or {}),
            created=float(d["created"]),
            revoked=d.get("revoked"),
            key=d.get("key"),
        )


@dataclass(frozen=True)
class FeedbackReceipt:
    """What ``POST /v1/feedback`` acknowledged (durable when returned)."""

    feedback_id: str
    session_id: str
    name: str
    value: float
    duplicate: bool
    after_training: bool


@dataclass(frozen=True)
class OnlineSession:
    """A recorded production session (a rollout with ``origin = 'online'``)."""

    session_id: str
    key_id: str
    key_name: str | None
    session_key: str | None
    user: str | None
    n_calls: int
    started: float
    updated: float
    closed: bool
    trained: float | None
    feedback: int
