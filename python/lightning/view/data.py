"""What the view shows, read from the store and the run's metrics, as plain JSON.

Every store read goes through ``lightning.Store`` (the gateway's Rust reader,
read-only); nothing here writes. Metrics come from ``RUN_DIR/metrics.jsonl``,
read from a byte offset so a poll costs only the lines written since the last.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lightning._core import StoreReader, Tokenizer
from lightning.gateway.store import Store
from lightning.traces import Decoder, divergence_rows, finite, sample_row, token_pieces

PAGE_MAX = 200  # rollouts (or sessions) per page at most
RATE_WINDOW_S = 600.0  # the calls chart: the last ten minutes of activity...
RATE_BUCKET_S = 5.0  # ...in five-second buckets
# The range `/api/rate` accepts for both: a millisecond to ~30 years. Outside it
# the bucket arithmetic leaves floats' exact range (1e-300 s buckets: a 400).
RATE_MIN_S, RATE_MAX_S = 1e-3, 1e9
CALLS_PAGE = 20  # calls per page of a rollout's detail...
CALLS_PAGE_MAX = 100
SAMPLES_PAGE = 4  # ...and merged samples (each as long as the whole conversation)


def read_metrics(path: Path, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """The metrics rows completed after byte ``offset`` and the offset to poll from
    next. A half-written last line is left for the next poll."""
    if not path.exists():
        return [], 0
    size = path.stat().st_size
    if offset > size:  # the file was replaced: start again
        offset = 0
    with open(path, "rb") as f:
        f.seek(offset)
        chunk = f.read()
    end = chunk.rfind(b"\n") + 1
    rows = []
    for line in chunk[:end].splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            rows.append(_finite(obj))
    return rows, offset + end


def _finite(value: Any) -> Any:
    """JSON without NaN/inf (the browser's JSON.parse rejects them): they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def run_paths(run_dir: Path) -> tuple[Path, Path | None]:
    """The store and the policy's directory of a run, from RUN_DIR/config.json
    (as the loop wrote it; ``lightning show`` finds the model the same way).
    Without a config: RUN_DIR/lightning.db and no model (token ids shown)."""
    config = run_dir / "config.json"
    if not config.exists():
        return run_dir / "lightning.db", None
    from lightning.config import RunConfig

    cfg = RunConfig.model_validate_json(config.read_text())
    db = Path(cfg.gateway.db) if cfg.gateway.db else run_dir / "lightning.db"
    return db, cfg.model.resolve()


class View:
    """The store (opened lazily: a run may not have written it yet) and the
    tokenizer; every method returns JSON-ready data. Reads are serialised by a
    lock, so one reader connection serves every request thread; the summary and
    the rate (polled every few seconds) have a connection of their own, so a
    long detail read never holds them up.

    Redaction, as ``lightning online export`` does it: a session recorded under
    a key with ``redact`` keeps token ids that decode to the removed text, so
    its calls and samples are shown without ids or decoded pieces unless
    ``with_ids`` (``lightning view --with-ids``)."""

    def __init__(
        self,
        db: Path,
        metrics: Path | None = None,
        tokenizer: Decoder | None = None,
        *,
        with_ids: bool = False,
    ) -> None:
        self.db = db
        self.metrics_path = metrics
        self.tokenizer = tokenizer
        self.with_ids = with_ids
        self._store: tuple[Store, StoreReader] | None = None
        self._lock = threading.Lock()
        self._poll: StoreReader | None = None
        self._poll_lock = threading.Lock()

    def _read(self, fn: Callable[[Store, StoreReader], Any]) -> Any:
        """``fn(store, reader)`` under the lock; None while there is no store yet.
        ``Store`` gives the typed records and the merge, ``StoreReader`` (the same
        Rust reader) the rollout rows by id and mode, and the events as stored."""
        with self._lock:
            if self._store is None:
                if not self.db.exists():
                    return None
                self._store = (Store(self.db), StoreReader(self.db))
            return fn(*self._store)

    def _read_poll(self, fn: Callable[[StoreReader], Any]) -> Any:
        """``fn(reader)`` on the polling connection (summary, rate)."""
        with self._poll_lock:
            if self._poll is None:
                if not self.db.exists():
                    return None
                self._poll = StoreReader(self.db)
            return fn(self._poll)

    # ------------------------------------------------------------ run-level

    def metrics(self, offset: int) -> dict[str, Any]:
        if self.metrics_path is None:
            return {"rows": [], "offset": 0, "file": None}
        rows, nxt = read_metrics(self.metrics_path, offset)
        return {"rows": rows, "offset": nxt, "file": str(self.metrics_path)}

    def summary(self) -> dict[str, Any]:
        """Rollouts per mode and status (in flight = not finished), and the sources.
        The counts are one SQL aggregate in the reader, not a row per rollout."""
        rows = self._read_poll(lambda r: r.rollout_counts())
        counts: dict[str, dict[str, int]] = {}
        for mode, status, n in rows or []:
            counts.setdefault(mode or "-", {})[status or "-"] = int(n)
        return {
            "db": str(self.db),
            "store": rows is not None,
            "metrics": str(self.metrics_path) if self.metrics_path else None,
            "decoded": self.tokenizer is not None,
            "rollouts": sum(n for per in counts.values() for n in per.values()),
            "by_mode": counts,
        }

    def call_rate(
        self, window_s: float = RATE_WINDOW_S, bucket_s: float = RATE_BUCKET_S
    ) -> dict[str, Any]:
        """Calls, upstream errors and aborted calls per bucket over the window
        ending at the store's latest call (one aggregate over an index)."""
        got = self._read_poll(lambda r: r.call_rate(window_s=window_s, bucket_s=bucket_s))
        if got is None:
            return {"end": None, "bucket_s": bucket_s, "buckets": []}
        keys = ("start", "calls", "upstream_errors", "aborted")
        got["buckets"] = [dict(zip(keys, b, strict=True)) for b in got["buckets"]]
        return dict(got)

    def rollouts(
        self,
        after: str | None = None,
        limit: int = 50,
        status: str | None = None,
        mode: str | None = None,
        group: str | None = None,
    ) -> dict[str, Any]:
        """One page of rollouts in creation order, starting after rollout ``after``:
        a keyset page read by the reader through an index (one row more than the
        page says whether there is a next)."""
        limit = max(1, min(limit, PAGE_MAX))
        rows = self._read(
            lambda _, r: r.rollouts(
                group=group, status=status, mode=mode, after=after, limit=limit + 1
            )
        )
        rows = rows or []
        out = [_rollout_row(r) for r in rows[:limit]]
        more = len(rows) > limit
        return {"rollouts": out, "next": out[-1]["rollout_id"] if more and out else None}

    # ------------------------------------------------------------ online sessions

    def sessions(
        self,
        after: str | None = None,
        limit: int = 50,
        key: str | None = None,
        tag: str | None = None,
        feedback: bool | None = None,
        trained: bool | None = None,
    ) -> dict[str, Any]:
        """One page of online sessions, newest activity first: key, tags, number of
        signals, the reward ``lightning train --online`` computes from them by
        default (mean of the latest signal per name and target), trained or not."""
        from lightning.online.rewards import BadReward, OnlineRewardSection, session_reward
        from lightning.online.sessions import signals

        limit = max(1, min(limit, PAGE_MAX))

        def read(_: Store, r: StoreReader) -> Any:
            rows = r.session_page(
                after=after, limit=limit + 1, key=key, tag=tag, feedback=feedback, trained=trained
            )
            page = rows[:limit]
            return rows, page, signals(r, [x["rollout_id"] for x in page if x["feedback"]])

        got = self._read(read)
        if got is None:
            return {"sessions": [], "next": None}
        rows, page, sigs = got
        cfg = OnlineRewardSection()
        out = []
        for row in page:
            task = _json(row.pop("task_json"))
            reward: float | None
            try:
                reward = session_reward(sigs.get(row["rollout_id"], []), cfg)
                note = None
            except BadReward as e:
                reward, note = None, str(e)
            out.append(
                _finite(
                    {
                        **row,
                        "tags": list(task.get("tags") or []) if isinstance(task, dict) else [],
                        "reward": reward,
                        "reward_error": note,
                    }
                )
            )
        more = len(rows) > limit
        return {"sessions": out, "next": out[-1]["rollout_id"] if more and out else None}

    def session(
        self, session_id: str, offset: int = 0, limit: int = CALLS_PAGE
    ) -> dict[str, Any] | None:
        """A session's conversation across protocols: each call with its protocol,
        the response id the client was given, the messages the harness sent that
        turn (as chat messages, whatever the protocol) and the answer, decoded
        from the exact ids; its feedback signals and computed reward. One page of
        calls (``offset``, ``limit``), like ``rollout``."""
        from lightning.online.export import sent_messages
        from lightning.online.rewards import BadReward, OnlineRewardSection, session_reward
        from lightning.online.sessions import signals

        detail = self._detail(session_id, offset, limit)
        if detail is None:
            return None
        got = self._read(lambda _, r: signals(r, [session_id]).get(session_id, []))
        sigs = got if got is not None else []
        # What each turn sent needs every earlier turn (a Responses call names
        # its predecessor instead of repeating it): walk them all, keep the page.
        page = {c["seq"]: c for c in detail["calls"]}
        before: list[Any] = []
        for seq, proto, harness, resp, text in detail.pop("_turns"):
            call = page.get(seq)
            if call is not None:
                call["protocol"], call["response_id"] = proto, resp
            try:
                body = json.loads(harness) if harness else {}
                sent = sent_messages(body, before) if isinstance(body, dict) else None
            except ValueError:
                sent = None
            if sent is None:  # a later choice of a request, or a redacted call
                if call is not None:
                    call["sent"] = []
                continue
            fresh = sent[len(before) :] if sent[: len(before)] == before else sent
            if call is not None:
                call["sent"] = _finite(fresh)
            before = [*sent, {"role": "assistant", "content": text}]
        try:
            reward: float | None = session_reward(sigs, OnlineRewardSection())
            note = None
        except BadReward as e:
            reward, note = None, str(e)
        detail["feedback"] = _finite(sigs)
        detail["reward"] = reward
        detail["reward_error"] = note
        return detail

    # ------------------------------------------------------------ one rollout

    def rollout(
        self,
        rollout_id: str,
        offset: int = 0,
        limit: int = CALLS_PAGE,
        samples_offset: int = 0,
    ) -> dict[str, Any] | None:
        detail = self._detail(rollout_id, offset, limit, samples_offset)
        if detail is not None:
            detail.pop("_turns")
        return detail

    def _detail(
        self,
        rollout_id: str,
        offset: int = 0,
        limit: int = CALLS_PAGE,
        samples_offset: int = 0,
    ) -> dict[str, Any] | None:
        """A rollout's calls (prompt and completion decoded from the exact ids,
        logprob per generated token), its merged samples with their split points
        and drift causes, its reward, events and weight versions.

        Paged: calls ``offset .. offset + limit`` (at most ``CALLS_PAGE_MAX``)
        and ``SAMPLES_PAGE`` samples from ``samples_offset``; ``next_offset`` and
        ``next_samples_offset`` say where the next page starts (None: no more).
        A 300-call session is hundreds of MB of decoded pieces in one answer."""
        limit = max(1, min(limit, CALLS_PAGE_MAX))
        offset, samples_offset = max(0, offset), max(0, samples_offset)

        def read(s: Store, reader: StoreReader) -> Any:
            info = reader.rollouts([rollout_id])
            if not info:
                return None
            records = s.records(rollout_id)
            # Drift causes need the policy's own tokenizer (a plain decoder leaves them unclassified).
            tok = self.tokenizer if isinstance(self.tokenizer, Tokenizer) else None
            merged = s.read_step([rollout_id], tokenizer=tok)
            events = reader.events(rollout_id)
            return info[0], records, merged, events, reader.call_bodies(rollout_id)

        got = self._read(read)
        if got is None:
            return None
        info, records, merged, events, bodies = got
        by_seq = {seq: (proto, harness, resp) for seq, proto, harness, resp in bodies}
        redacted = any(_redacted(h) for _, _, h, _ in bodies)
        hide = redacted and not self.with_ids
        calls = []
        for r in records[offset : offset + limit]:
            completion = [] if r.completion_ids is None else [int(t) for t in r.completion_ids]
            prompt = [] if r.prompt_ids is None else [int(t) for t in r.prompt_ids]
            if hide:
                prompt, completion = [], []
            lps = [] if r.logprobs is None or hide else [finite(x) for x in r.logprobs]
            calls.append(
                {
                    "seq": r.seq,
                    "kind": r.kind,
                    "status": r.status,
                    "flags": r.flags,
                    "delivered": r.delivered,
                    "finish_reason": r.finish_reason,
                    "weight_version": r.weight_version,
                    "upstream": r.upstream,
                    "latency_ms": r.latency_ms,
                    "trainable": r.trainable,
                    "text": r.text,
                    "prompt": token_pieces(prompt, self.tokenizer),
                    "prompt_ids": prompt,
                    "completion": token_pieces(completion, self.tokenizer),
                    "completion_ids": completion,
                    "logprobs": lps,
                }
            )
        mine = [smp for smp in merged.samples if smp.rollout_id == rollout_id]
        page = [] if hide else mine[samples_offset : samples_offset + SAMPLES_PAGE]
        samples = [sample_row(smp, self.tokenizer) for smp in page]
        end, s_end = offset + len(calls), samples_offset + len(samples)
        return {
            "rollout": _rollout_row(info),
            "calls": calls,
            "calls_total": len(records),
            "offset": offset,
            "next_offset": end if end < len(records) else None,
            "samples": samples,
            "samples_total": 0 if hide else len(mine),
            "next_samples_offset": s_end if not hide and s_end < len(mine) else None,
            "divergences": divergence_rows(merged, rollout_id),
            "stats": merged.stats.as_dict(),
            "events": [
                {"seq": seq, "type": kind, "data": _json(data), "created": created}
                for seq, kind, data, created in events
            ],
            "decoded": self.tokenizer is not None,
            "redacted": redacted,
            "ids_hidden": hide,
            # For `session`: every turn's body and answer text (popped there).
            "_turns": [(r.seq, *by_seq.get(r.seq, (None, None, None)), r.text) for r in records],
        }

    def group(self, group: str) -> dict[str, Any]:
        """The group's rollouts, highest reward first (unrewarded last)."""
        rows = self._read(lambda _, r: r.rollouts(group=group)) or []
        rows = sorted(rows, key=lambda r: -r["reward"] if r["reward"] is not None else math.inf)
        return {"group": group, "rollouts": [_rollout_row(r) for r in rows]}

    def compare(self, a: str, b: str) -> dict[str, Any] | None:
        """Two rollouts' first merged samples and the first position they differ at
        (None when one is a prefix of the other and they are the same length)."""
        left, right = self.rollout(a), self.rollout(b)
        if left is None or right is None:
            return None
        ta = left["samples"][0]["tokens"] if left["samples"] else []
        tb = right["samples"][0]["tokens"] if right["samples"] else []
        return {"a": left, "b": right, "first_diff": first_difference(ta, tb)}


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (the shorter length when
    one is a proper prefix of the other); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _redacted(harness: Any) -> bool:
    """A call recorded under a redacting key (its harness request is replaced
    by ``{"redacted": true}``: ``rust/gateway/src/store/online.rs``)."""
    if not isinstance(harness, str) or "redacted" not in harness:
        return False
    try:
        body = json.loads(harness)
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("redacted") is True


def _rollout_row(r: dict[str, Any]) -> dict[str, Any]:
    row = {k: v for k, v in r.items() if k != "task_json"}
    if "task_json" in r:
        row["task"] = _json(r["task_json"])
    row["reward"] = finite(row.get("reward"))
    return _finite(row)


def _json(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text
