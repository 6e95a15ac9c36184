"""A session's reward from its feedback signals.

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
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import Field, model_validator

from lightning import LightningError
from lightning.online.select import Selection
from lightning.online.sessions import Section


class OnlineRewardSection(Section):
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


class BadReward(LightningError, ValueError):
    """A session's reward (or a signal it counts) is not finite or beyond ``max_abs``."""


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
