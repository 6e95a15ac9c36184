"""Online mode, trainer side: train from production sessions in the store.

The gateway records calls made with an application key into *sessions*
(rollouts with ``origin = 'online'``, see ``rust/gateway/src/online``) and
keeps every feedback signal posted later (``POST /v1/feedback``). This module
selects sessions, turns their signals into rewards, groups them for the
advantage estimator, and runs trainer steps on them::

    lightning train --online online.toml        # train from the store
    lightning online sessions --db lightning.db # list sessions and their signals
    lightning online export --db lightning.db --out sessions.jsonl

**Reward (default ``kind = "mean"``).** For each (signal name, target) — the
target is the response id the signal names, or the session — only the latest
signal by timestamp counts (a user who flips a thumbs-down to up counts once,
as up). The session's reward is the mean of those latest values. ``sum``,
``last`` (the latest signal of all) and ``weighted`` (Σ weight[name] × latest
value, names without a weight ignored) are the other built-ins;
``function = "module:fn"`` takes ``fn(signals: list[dict]) -> float`` for
anything else. Booleans arrive as 1.0 / 0.0. A counted signal or a reward that
is not finite or beyond ``max_abs`` is refused (one such value makes the batch's
std infinite and every advantage zero): the pass stops before it trains or
marks anything, or, with ``on_bad_reward = "skip"``, leaves those sessions out;
a step whose statistics are not finite stops it the same way (``PassStopped``).

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

**Off-policy.** Sessions were sampled by whatever weights production served
(recorded per call as ``weight_version``, with the engine's logprobs). Tokens are
weighted by the truncated importance weight min(π_trainer / π_rollout, C)
(``[trainer] tis_cap``, default 2.0 here: ``lightning.config.trainer_defaults``;
``losses.policy_loss``), which corrects the gap to the policy being trained at
the cost of bias where the cap truncates.
``source.min_weight_version`` drops calls sampled by older weights outright.

**One data path with the main loop.** A step's sessions go to
``Trainer.step`` as one ``MergeResult`` (``merge_calls`` with the sessions as
``RolloutInfo``, each call tagged with its group), as ``Run.train_on`` passes
``Store.step``'s; ``batching = "tree"`` by default, so a group's shared first
prompt is computed once. ``sessions_per_step`` splits a pass into optimizer
steps that keep groups whole. A pass reports (``summary.json``,
``metrics.jsonl``, printed) sessions selected / trained / skipped by reason,
signals per name, reward mean, groups and singleton fallback, the truncated
importance weights (mean, fraction cut by the cap) and staleness in weight
versions (``policy_version`` minus each call's, by completion tokens).

Trained sessions get ``online_sessions.trained`` set and are skipped next time
unless ``source.include_trained``; feedback that arrives after is kept and
flagged. ``[weight_sync] policy = "none"`` (default) only exports the new
weights: a human decides when they serve.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lightning import LightningError
from lightning.config import (
    ModelSection,
    TrainerConfig,
    TrainerSection,
    refuse_run_set,
    trainer_defaults,
)
from lightning.modes import Estimator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SourceSection(_Section):
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


class GroupingSection(_Section):
    key: Literal["first_prompt", "system_first_user", "session", "none"] = "first_prompt"
    min_group: int = Field(default=2, ge=1)


class OnlineRewardSection(_Section):
    kind: Literal["mean", "sum", "last", "weighted"] = "mean"
    weights: dict[str, float] = Field(default_factory=dict)
    function: str | None = None  # "module:fn(signals) -> float"
    max_abs: float = Field(
        default=1e6,
        gt=0,
        description="a counted signal or a session reward beyond ±max_abs (or not finite) "
        "is refused: one such value swamps the batch statistics",
    )
    on_bad_reward: Literal["stop", "skip"] = Field(
        default="stop",
        description="a session whose reward is refused: stop the pass before it trains "
        "(default), or skip the session (left untrained, counted as `bad_reward`)",
    )

    @model_validator(mode="after")
    def _check(self) -> OnlineRewardSection:
        if self.kind == "weighted" and not self.weights:
            raise ValueError("[reward] kind = 'weighted' needs `weights = {name = w, ...}`")
        return self


class WeightSyncSection(_Section):
    policy: Literal["none", "embedded", "sglang"] = "none"
    urls: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _urls(self) -> WeightSyncSection:
        if self.policy != "none" and not self.urls:
            raise ValueError(f"[weight_sync] policy = {self.policy!r} needs `urls`")
        return self


# Trainer values an online pass sets from its top-level keys.
_PASS_SETS = {
    "estimator": "the top-level estimator",
    "temperature": "the top-level temperature",
    "seed": "the top-level seed",
}


class OnlineConfig(_Section):
    model: ModelSection
    source: SourceSection
    grouping: GroupingSection = Field(default_factory=GroupingSection)
    reward: OnlineRewardSection = Field(default_factory=OnlineRewardSection)
    weight_sync: WeightSyncSection = Field(default_factory=WeightSyncSection)
    estimator: Estimator = "grpo"
    temperature: float = Field(default=1.0, gt=0, description="production's sampling temperature")
    # The same [trainer] table as `lightning train`'s, validated by the same class.
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    sessions_per_step: int | None = Field(
        default=None, ge=1, description="default: all in one step"
    )
    mark_trained: bool = True
    policy_version: int | None = Field(
        default=None,
        ge=0,
        description="the weight version of [model] (for staleness); default: the newest "
        "version among the calls trained",
    )
    output_dir: str = "runs/online"
    seed: int = 0

    @model_validator(mode="before")
    @classmethod
    def _trainer_leaves_pass_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            refuse_run_set(data.get("trainer"), _PASS_SETS)
        return data

    def trainer_config(self, model: str | Path) -> TrainerConfig:
        """The trainer of this pass for the policy at ``model``: ``[trainer]``
        with the pass's estimator, temperature and seed, and online mode's
        defaults where ``[trainer]`` leaves them unset (``trainer_defaults``)."""
        return TrainerConfig.for_run(
            self.trainer,
            model=model,
            estimator=self.estimator,
            temperature=self.temperature,
            seed=self.seed,
            defaults=trainer_defaults(off_policy=True, online=True),
        )

    @classmethod
    def load(cls, path: str | Path) -> OnlineConfig:
        import tomllib

        path = Path(path)
        raw = tomllib.loads(path.read_text())
        cfg = cls.model_validate(raw)
        base = path.parent
        if not Path(cfg.source.db).is_absolute():
            cfg.source.db = str((base / cfg.source.db).resolve())
        if not Path(cfg.output_dir).is_absolute():
            cfg.output_dir = str((base / cfg.output_dir).resolve())
        if cfg.model.path is not None and not Path(cfg.model.path).is_absolute():
            cfg.model.path = str((base / cfg.model.path).resolve())
        return cfg


class PassStopped(LightningError):
    """An online pass stopped before it marked any session trained; the
    message says which sessions and values, and what to do."""


class BadReward(LightningError, ValueError):
    """A session's reward (or a signal it counts) is not finite or beyond ``max_abs``."""


def finite_json(x: Any) -> Any:
    """``x`` with every non-finite float replaced by None (JSON has no Infinity/NaN)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite_json(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [finite_json(v) for v in x]
    return x


def _dumps(x: Any, **kw: Any) -> str:
    return json.dumps(finite_json(x), allow_nan=False, default=float, **kw)


# ----------------------------------------------------------------- selection


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


def _reader(db: str | Path) -> Any:
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
    reader = _reader(src.db)
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


# -------------------------------------------------------------------- reward


def latest_per_target(sigs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The latest signal (by timestamp, then arrival) per (name, target)."""
    latest: dict[tuple[str, str | None], dict[str, Any]] = {}
    for s in sigs:  # arrival order; a later timestamp or an equal one that came later wins
        k = (s["name"], s.get("response_id"))
        if k not in latest or s["ts"] >= latest[k]["ts"]:
            latest[k] = s
    return list(latest.values())


def session_reward(sigs: Sequence[dict[str, Any]], cfg: OnlineRewardSection) -> float | None:
    """The reward of a session from its signals (``None`` when it has none that
    count). Raises ``BadReward`` when a counted signal or the reward is not
    finite or beyond ``cfg.max_abs``."""
    r = _reward(sigs, cfg)
    if r is not None and not (math.isfinite(r) and abs(r) <= cfg.max_abs):
        raise BadReward(f"reward {r!r} is {_beyond(r, cfg.max_abs)}")
    return r


def _beyond(x: float, bound: float) -> str:
    return "not finite" if not math.isfinite(x) else f"beyond ±{bound:g} ([reward] max_abs)"


def _reward(sigs: Sequence[dict[str, Any]], cfg: OnlineRewardSection) -> float | None:
    if cfg.function:
        fn = _load(cfg.function)
        return float(fn(list(sigs))) if sigs else None
    latest = latest_per_target(sigs)
    if cfg.kind == "weighted":
        latest = [s for s in latest if s["name"] in cfg.weights]
    elif cfg.kind == "last":
        latest = [max(sigs, key=lambda s: s["ts"])] if sigs else []
    for s in latest:  # the signals that count
        v = float(s["value"])
        if not (math.isfinite(v) and abs(v) <= cfg.max_abs):
            raise BadReward(
                f"signal {s['name']!r} = {v!r} (feedback_id {s.get('feedback_id')!r}) "
                f"is {_beyond(v, cfg.max_abs)}"
            )
    if not latest:
        return None
    values = [float(s["value"]) for s in latest]
    if cfg.kind == "mean":
        return sum(values) / len(values)
    if cfg.kind in ("sum", "last"):
        return sum(values)
    return sum(cfg.weights[s["name"]] * float(s["value"]) for s in latest)


def _load(target: str) -> Callable[..., Any]:
    module, _, name = target.partition(":")
    if not name:
        raise ValueError(f"function {target!r} must be 'module:function'")
    fn: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return fn


# ------------------------------------------------------------------ grouping


def _first_call(reader: Any, rid: str) -> tuple[bytes | None, str | None]:
    """The first call's prompt ids (as their little-endian bytes) and harness request."""
    records = reader.records(rid)
    if not records:
        return (None, None)
    p = records[0]["prompt_ids"]
    return (None if p is None else p.astype("<u4").tobytes(), reader.call_bodies(rid)[0][2])


def _check_model_path(model: ModelSection) -> None:
    try:
        model.resolve()
    except FileNotFoundError as e:
        raise FileNotFoundError(f'{e}, or try `builtin = "tiny"` under [model]') from None


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
    reader = _reader(db)
    keys = {
        s.rollout_id: group_key(g.key, s.rollout_id, *_first_call(reader, s.rollout_id))
        for s in sessions
    }
    return pool_small_groups(keys, g.min_group)


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


# ------------------------------------------------------------------ training


def _batch(
    store: Any,
    batch: Sequence[Session],
    rewards: dict[str, float],
    groups: dict[str, str],
    *,
    min_version: int | None,
    tokenizer: Any,
) -> tuple[Any, int]:
    """A step's ``MergeResult`` from the store, as the main loop builds one
    (``Store.step``): each session's trainable calls, tagged with its group so
    ``tree`` batching packs a group's shared prompt once, merged with the
    sessions as ``RolloutInfo`` (group, reward). Also the number of calls
    dropped as older than ``min_version``."""
    from lightning import Call, RolloutInfo, merge_calls

    calls, old = [], 0
    for s in batch:
        g = groups[s.rollout_id]
        for c in store.trace(s.rollout_id):
            if min_version is not None and int(c.weight_version) < min_version:
                old += 1
                continue
            calls.append(Call(c.rollout_id, c.prompt_ids, c.completion_ids, c.logprobs,
                              c.finish_reason, c.weight_version, g))  # fmt: skip
    infos = [
        RolloutInfo(s.rollout_id, group=groups[s.rollout_id], mode="train",
                    status="succeeded" if s.closed else "running", reward=rewards[s.rollout_id])
        for s in batch
    ]  # fmt: skip
    return merge_calls(calls, tokenizer=tokenizer, rollouts=infos), old


def step_batches(
    sessions: Sequence[Session], groups: dict[str, str], per_step: int
) -> list[list[Session]]:
    """Sessions in steps of about ``per_step``, whole groups together (a group's
    baseline is its members in one step): groups in order of their first
    session, each added to the current step until it holds ``per_step`` or more."""
    by_group: dict[str, list[Session]] = defaultdict(list)
    for s in sessions:
        by_group[groups[s.rollout_id]].append(s)
    steps: list[list[Session]] = [[]]
    for members in by_group.values():
        if len(steps[-1]) >= per_step:
            steps.append([])
        steps[-1].extend(members)
    return [b for b in steps if b]


def staleness(policy_version: int, calls: Sequence[Any]) -> dict[str, Any]:
    """Completion tokens by staleness ``policy_version - call.weight_version``
    (how many weight versions behind the policy being trained each token was
    sampled), with the token-weighted mean and the maximum."""
    hist: Counter[int] = Counter()
    for c in calls:
        hist[policy_version - int(c.weight_version)] += len(c.completion_ids)
    total = sum(hist.values())
    return {
        "staleness_tokens": {str(k): v for k, v in sorted(hist.items())},
        "staleness_mean": sum(k * v for k, v in hist.items()) / total if total else 0.0,
        "staleness_max": max(hist) if hist else 0,
    }


def selection_metrics(
    sel: Selection, rewards: dict[str, float], groups: dict[str, str]
) -> dict[str, Any]:
    """What a pass selected and why it left the rest out; the signals by name;
    how the groups came out (``singleton_fallback``: sessions whose group was too
    small and that share the ``__batch__`` baseline)."""
    no_reward = len(sel.sessions) - len(rewards)
    names: Counter[str] = Counter(x["name"] for s in sel.sessions for x in s.signals)
    late = sum(x["after_training"] for s in sel.sessions for x in s.signals)
    vals = list(rewards.values())
    mean = sum(vals) / len(vals) if vals else float("nan")
    return {
        "sessions_selected": len(rewards),
        "sessions_skipped": dict(sel.skipped + Counter({"no_reward": no_reward})),
        "feedback_signals": dict(sorted(names.items())),
        "feedback_after_training": late,
        "session_reward_mean": mean,
        "n_groups": len(set(groups.values())),
        "singleton_fallback": sum(g == "__batch__" for g in groups.values()),
    }


def check_can_mark(db: str, *, gateway: str | None, admin_key: str | None) -> None:
    """Marks nothing, the way ``mark_trained`` will mark: through the gateway's
    writer (its admin key checked) or by opening the store's own writer (which
    fails at once, naming the gateway's pid, while a gateway writes ``db``;
    the error says to set ``gateway = URL``)."""
    mark_trained(db, [], gateway=gateway, admin_key=admin_key)


def train_online(cfg: OnlineConfig, *, quiet: bool = False) -> dict[str, Any]:
    """Select, reward, group, train; returns the summary (also in
    OUTPUT_DIR/summary.json; one line per step in OUTPUT_DIR/metrics.jsonl)."""
    from lightning import Store, Tokenizer
    from lightning.rl.trainer import Trainer

    def say(msg: str) -> None:
        if not quiet:
            print(f"[lightning online] {msg}", flush=True)

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.model.path is not None:
        _check_model_path(cfg.model)
    sel = select(cfg.source)
    rewards, bad = session_rewards(sel, cfg.reward)
    sessions = [s for s in sel.sessions if s.rollout_id in rewards]
    groups = session_groups(cfg.source.db, sessions, cfg.grouping) if sessions else {}
    summary: dict[str, Any] = {"output_dir": str(out), "sessions": [], "steps": []}
    summary.update(selection_metrics(sel, rewards, groups))
    if bad and cfg.reward.on_bad_reward == "stop":
        _stop(summary, out, _bad_reward_message(bad, cfg.reward))
    if sessions and not math.isfinite(summary["session_reward_mean"]):
        _stop(summary, out, _stats_message("the session reward mean", sessions, rewards))
    say(
        f"{len(sessions)} sessions selected from {cfg.source.db}; skipped "
        f"{summary['sessions_skipped'] or 'none'}; signals {summary['feedback_signals']}"
    )
    if not sessions:
        summary["sessions_trained"] = 0
        (out / "summary.json").write_text(_dumps(summary, indent=2))
        return summary
    if cfg.mark_trained:
        # Before a step is trained or a weight written: a pass that cannot mark
        # would train these sessions again next time.
        src = cfg.source
        admin_key = os.environ.get(src.admin_key_env) if src.gateway else None
        check_can_mark(src.db, gateway=src.gateway, admin_key=admin_key)
    model_dir = cfg.model.resolve()
    trainer = Trainer(cfg.trainer_config(model_dir), log_dir=str(out))
    tokenizer = Tokenizer.from_dir(str(model_dir))
    batches = step_batches(sessions, groups, cfg.sessions_per_step or len(sessions))
    trained: list[str] = []
    versions: Counter[int] = Counter()
    try:
        with Store(cfg.source.db) as store:
            for batch in batches:
                merged, old = _batch(
                    store, batch, rewards, groups,
                    min_version=cfg.source.min_weight_version, tokenizer=tokenizer,
                )  # fmt: skip
                ids = sorted({smp.rollout_id for smp in merged.samples})
                if not ids:
                    say(f"{len(batch)} sessions: nothing trainable")
                    continue
                before = _reward_stats([rewards[i] for i in ids])
                if not all(math.isfinite(v) for v in before.values()):
                    off = ", ".join(k for k, v in before.items() if not math.isfinite(v))
                    what = f"step {len(summary['steps']) + 1}'s {off}"
                    _stop(summary, out, _stats_message(what, batch, rewards))
                versions.update(int(c.weight_version) for c in merged.calls)
                metrics = _train_step(
                    trainer, merged, ids, rewards, groups,
                    policy_version=cfg.policy_version, steps_before=len(summary["steps"]),
                )  # fmt: skip
                metrics.update(
                    {"sessions_untrainable": len(batch) - len(ids), "calls_too_old": old}
                )
                summary["steps"].append(metrics)
                with open(out / "metrics.jsonl", "a") as f:
                    f.write(_dumps(metrics) + "\n")
                not_finite = [k for k in _CHECKED if not _finite(metrics.get(k))]
                if not_finite:
                    what = f"step {len(summary['steps'])}'s {', '.join(not_finite)}"
                    _stop(summary, out, _stats_message(what, batch, rewards))
                trained.extend(ids)
                say(_step_line(len(summary["steps"]), metrics))
        if trained:
            summary["weights"] = str(_export(cfg, trainer, out, versions))
    finally:
        if hasattr(trainer, "close"):
            trainer.close()
    if cfg.mark_trained and trained:
        src = cfg.source
        admin_key = os.environ.get(src.admin_key_env) if src.gateway else None
        mark_trained(src.db, trained, gateway=src.gateway, admin_key=admin_key)
    summary["sessions"] = trained
    summary["sessions_trained"] = len(trained)
    summary["rewards"] = {rid: rewards[rid] for rid in trained}
    summary["groups"] = {rid: groups[rid] for rid in trained}
    summary["weight_versions"] = {str(k): v for k, v in sorted(versions.items())}
    (out / "summary.json").write_text(_dumps(summary, indent=2))
    say(
        f"trained {len(trained)} sessions; skipped {summary['sessions_skipped'] or 'none'}; "
        f"weights in {summary.get('weights')}"
    )
    return summary


# Step statistics that must be finite for the step to mean anything: a reward
# of 1e308 gives reward_std = inf, all advantages 0 and no gradient.
_CHECKED = ("reward_mean", "reward_std", "adv_mean", "adv_std", "loss", "grad_norm")


def _reward_stats(values: Sequence[float]) -> dict[str, float]:
    """Mean and std of a step's rewards, checked before the step: a std that
    overflows leaves every advantage 0. Plain floats: x * x overflows to inf
    without raising or warning."""
    mean = sum(values) / len(values)
    var = sum((x - mean) * (x - mean) for x in values) / len(values)
    return {"reward_mean": mean, "reward_std": math.sqrt(var)}


def _finite(x: Any) -> bool:
    return not isinstance(x, float) or math.isfinite(x)


def session_rewards(
    sel: Selection, cfg: OnlineRewardSection
) -> tuple[dict[str, float], dict[str, str]]:
    """Each selected session's reward (sessions without one left out), and the
    sessions whose reward ``session_reward`` refused, with why. With
    ``on_bad_reward = "skip"`` the refused ones leave ``sel`` as ``bad_reward``."""
    rewards: dict[str, float] = {}
    bad: dict[str, str] = {}
    for s in sel.sessions:
        try:
            r = session_reward(s.signals, cfg)
        except BadReward as e:
            bad[s.rollout_id] = str(e)
            continue
        if r is not None:
            rewards[s.rollout_id] = r
    if bad and cfg.on_bad_reward == "skip":
        sel.sessions = [s for s in sel.sessions if s.rollout_id not in bad]
        sel.skipped["bad_reward"] += len(bad)
    return rewards, bad


def _stop(summary: dict[str, Any], out: Path, why: str) -> None:
    """Ends the pass before anything is marked trained (or weights exported):
    the reason goes to summary.json and the raised ``PassStopped``."""
    summary["stopped"] = why
    summary["sessions_trained"] = 0
    (out / "summary.json").write_text(_dumps(summary, indent=2))
    raise PassStopped(why)


_NOTHING_DONE = "Nothing was marked trained and no weights were written"


def _bad_reward_message(bad: dict[str, str], cfg: OnlineRewardSection) -> str:
    shown = "; ".join(f"{rid}: {why}" for rid, why in list(bad.items())[:5])
    more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
    return (
        f"online pass stopped: {len(bad)} session(s) have a reward that is not finite or "
        f"beyond ±{cfg.max_abs:g}: {shown}{more}. {_NOTHING_DONE}. Find the client that "
        "posts such feedback (`lightning online sessions --db DB`); then leave those "
        'sessions out (`[reward] on_bad_reward = "skip"`), or raise `[reward] max_abs` '
        "if such values are meant."
    )


def _stats_message(what: str, sessions: Sequence[Session], rewards: dict[str, float]) -> str:
    top = sorted((s.rollout_id for s in sessions if s.rollout_id in rewards),
                 key=lambda rid: -abs(rewards[rid]))[:5]  # fmt: skip
    shown = ", ".join(f"{rid} = {rewards[rid]:g}" for rid in top)
    return (
        f"online pass stopped: {what} is not finite, so this step would train nothing "
        f"sensible. {_NOTHING_DONE}. The largest rewards: {shown}. Lower `[reward] max_abs` "
        'to refuse such rewards, or set `[reward] on_bad_reward = "skip"` to leave them out.'
    )


def _train_step(
    trainer: Any,
    merged: Any,
    ids: Sequence[str],
    rewards: dict[str, float],
    groups: dict[str, str],
    *,
    policy_version: int | None,
    steps_before: int,
) -> dict[str, Any]:
    """One optimizer step on the sessions ``ids`` of ``merged``; the trainer's
    metrics plus the pass's own (groups, singleton fallback, staleness)."""
    policy = (
        policy_version
        if policy_version is not None
        else max(int(c.weight_version) for c in merged.calls)
    )
    metrics = dict(trainer.step(merged, {k: rewards[k] for k in ids}, {k: groups[k] for k in ids}))
    metrics.update(
        {
            "sessions_trained": len(ids),
            "groups": len({groups[i] for i in ids}),
            "singleton_fallback": sum(groups[i] == "__batch__" for i in ids),
            "calls": len(merged.calls),
            "divergences": dict(Counter(d.kind for d in merged.divergences)),
            "policy_version": policy,
            **staleness(policy, merged.calls),
            # Optimizer steps the policy took in this pass before this one:
            # every session here was sampled at least that far back.
            "steps_behind": steps_before,
        }
    )
    return metrics


def _step_line(k: int, m: dict[str, Any]) -> str:
    def f(x: Any) -> str:
        return "nan" if x is None or x != x else f"{x:.3g}"

    return (
        f"step {k}: {m['sessions_trained']} sessions in {m['groups']} groups "
        f"({m['singleton_fallback']} on the batch baseline), reward {f(m['reward_mean'])}, "
        f"loss {f(m['loss'])}, IS weight {f(m['tis_weight_mean'])} "
        f"(cap cut {f(m['tis_clip_frac'])}), staleness mean {f(m['staleness_mean'])} "
        f"max {m['staleness_max']}"
    )


def _export(cfg: OnlineConfig, trainer: Any, out: Path, versions: Counter[int]) -> Path:
    """Writes the new weights; pushes them to the engines only when configured."""
    from lightning.run.weight_sync import WeightUpdate, make_weight_sync

    weights = out / "weights" / "latest"
    trainer.export_weights(str(weights))
    if cfg.weight_sync.policy != "none":
        version = 1 + max(versions) if versions else 1
        policy = cfg.weight_sync.policy
        sync = make_weight_sync(
            "sglang-disk" if policy == "sglang" else policy, cfg.weight_sync.urls
        )
        try:
            sync.setup()
            sync.push(WeightUpdate(version=version, path=weights))
        finally:
            sync.close()
    return weights


# -------------------------------------------------------------------- export


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
    reader = _reader(db)
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
            f.write(_dumps(line) + "\n")
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
            sent = _sent_messages(body, messages)
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


def _sent_messages(body: dict[str, Any], before: list[Any]) -> list[Any] | None:
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


# ----------------------------------------------------------------------- CLI


def train_main(argv: list[str]) -> int:
    import argparse

    from pydantic import ValidationError

    p = argparse.ArgumentParser(
        prog="lightning train --online",
        description="one training pass on the production sessions of a gateway's store",
    )
    p.add_argument("config", help="online training configuration (TOML; see docs/online.md)")
    p.add_argument("--output-dir", metavar="DIR", help="where summary.json, metrics and weights go "
                   "(default: the config's output_dir)")  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="print only the final summary")
    args = p.parse_args(argv)

    def fail(msg: str) -> int:
        print(f"lightning train --online: {msg}", file=sys.stderr)
        return 1

    try:
        cfg = OnlineConfig.load(args.config)
    except ValidationError as e:
        return fail(f"{args.config}: {_config_errors(e)}")
    except (OSError, ValueError) as e:  # a missing file, bad TOML
        return fail(f"{args.config}: {e}")
    if args.output_dir:
        cfg.output_dir = args.output_dir
    try:
        summary = train_online(cfg, quiet=args.quiet)
    except (PassStopped, FileNotFoundError) as e:
        return fail(str(e))
    print(json.dumps({k: summary[k] for k in ("output_dir", "sessions")}, indent=2))
    return 0


def _config_errors(e: Any) -> str:
    """A pydantic ``ValidationError`` as one line, with the fix for a missing model."""
    parts = []
    for err in e.errors():
        where = ".".join(str(x) for x in err["loc"]) or "config"
        parts.append(f"{where}: {err['msg']}")
    text = "; ".join(parts)
    if any(err["loc"][:1] == ("model",) for err in e.errors()):
        text += (
            ' (for a first try: [model] builtin = "tiny"; or path = "DIR" of a Hugging Face model)'
        )
    return text


_EXPORT_HELP = """\
Writes one JSON line per session: chat-style messages (whatever protocol the
harness spoke), each call's response id and token ids, the feedback signals and
the session's reward. Reads the store file directly (no gateway, no admin key);
a call whose recorded request it cannot read is left out and reported on stderr.
Sessions recorded under a key with defaults.redact = true carry no text and, unless
--with-ids, no token ids: the ids decode to the text redaction removed."""


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="lightning online", description="online sessions in a store")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser(
        "export",
        help="sessions to JSONL (messages, token ids, signals, reward)",
        description=_EXPORT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    e.add_argument("--db", required=True, metavar="PATH",
                   help="the gateway's store (its --db / `db` path); read-only")  # fmt: skip
    e.add_argument("--out", required=True, metavar="PATH", help="the JSONL file to write")
    e.add_argument("--only-feedback", action="store_true",
                   help="only sessions with at least one feedback signal")  # fmt: skip
    e.add_argument("--with-ids", action="store_true",
                   help="keep token ids of redacted sessions too (they decode to the "
                   "redacted text: handle the file as you would the text)")  # fmt: skip
    ls = sub.add_parser(
        "sessions",
        help="list sessions with their signals and reward",
        description="One line per session: id, key, calls, state, signals, reward.",
    )
    ls.add_argument("--db", required=True, metavar="PATH", help="the gateway's store; read-only")
    args = p.parse_args(argv)
    if args.cmd == "export":
        try:
            done = export_sessions(
                args.db, args.out, only_feedback=args.only_feedback, with_ids=args.with_ids
            )
        except FileNotFoundError as err:
            print(f"lightning online export: {err}", file=sys.stderr)
            return 1
        for x in done.skipped:
            print(
                f"lightning online export: skipped call {x['seq']} of session "
                f"{x['session_id']} ({x['protocol']}): {x['reason']}",
                file=sys.stderr,
            )
        print(done.line(args.out))
        return 0
    src = SourceSection(db=args.db, require_feedback=False, closed_only=False, include_trained=True)
    for s in select_sessions(src):
        try:
            r: Any = session_reward(s.signals, OnlineRewardSection())
        except BadReward as err:
            r = f"refused ({err})"
        state = "trained" if s.trained else ("closed" if s.closed else "open")
        print(
            f"{s.rollout_id}  {s.app_key:<16} calls={s.n_calls:<3} {state:<7} signals={len(s.signals)} reward={r}"
        )
    return 0
