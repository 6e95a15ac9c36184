"""Advantage estimators for group-based policy gradients.

Methods (docs/design.md#advantages), all computed within a *group* (the rollouts of one task
in one step):

- ``grpo``: GRPO (Shao et al. 2024, DeepSeekMath): ``(R - mean_g) / (std_g + eps)``.
- ``dr_grpo``: Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"):
  ``R - mean_g`` (no std division: it biases towards easy and hard questions).
- ``rloo``: REINFORCE leave-one-out (Ahmadian et al. 2024): ``R - mean of the
  others``; a group of one has no baseline and gets 0.
- ``reinforce_pp``: REINFORCE++-baseline (Hu et al. 2025): ``R - mean_g``, then
  divided by the standard deviation of those centred values over the whole batch.

Departures from the papers:

1. GRPO's ``std_g`` is the unbiased sample standard deviation (``n - 1``), as in
   the DeepSeekMath reference code (``torch.std``); a group of one has std 0 and,
   having ``R == mean_g``, advantage 0.
2. REINFORCE++'s batch normalisation divides by ``std + eps`` (unbiased std over
   all rollouts) and does not re-centre: group centring already makes the batch
   mean exactly zero.
3. Turn-level credit (:func:`turn_level`) first turns per-call rewards into
   discounted returns ``G_c = r_c + γ G_{c+1}`` within each rollout, then applies
   the estimator to every call, grouping calls by ``(group, turn index)`` so a
   turn is compared with the same turn of its sibling rollouts.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, get_args

import numpy as np
import torch

from lightning.modes import Estimator

ESTIMATORS: tuple[str, ...] = get_args(Estimator)

__all__ = [
    "ESTIMATORS",
    "Estimator",
    "check_estimator",
    "discounted_returns",
    "estimate",
    "token_advantages",
    "turn_level",
    "zero_advantage_groups",
]


def check_estimator(estimator: str) -> None:
    """Raise ``ValueError`` unless ``estimator`` is one of :data:`ESTIMATORS`."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; use one of {ESTIMATORS}")


def _group_ids(groups: Sequence[Hashable]) -> tuple[torch.Tensor, int]:
    index: dict[Hashable, int] = {}
    ids = [index.setdefault(g, len(index)) for g in groups]
    return torch.tensor(ids, dtype=torch.long), len(index)


def _as_float64(rewards: Any) -> torch.Tensor:
    # Group statistics in float64 so that equal rewards give exactly zero.
    return torch.as_tensor(np.asarray(rewards, dtype=np.float64)).reshape(-1)


def estimate(
    rewards: Any,
    groups: Sequence[Hashable],
    *,
    estimator: Estimator,
    eps: float = 1e-6,
) -> torch.Tensor:
    """One advantage per rollout, in input order (float32).

    ``rewards``: one float per rollout (list, numpy array or tensor);
    ``groups``: one hashable group key per rollout, same order. See the module
    docstring for each ``estimator``'s formula.
    """
    check_estimator(estimator)
    r = _as_float64(rewards)  # [N]
    if len(groups) != r.numel():
        raise ValueError(
            f"got {r.numel()} rewards but {len(groups)} group keys; pass one per rollout"
        )
    if not torch.isfinite(r).all():
        raise ValueError("rewards contain NaN or inf; fill or drop those rollouts first")
    if r.numel() == 0:
        return torch.zeros(0, dtype=torch.float32)
    gid, n_groups = _group_ids(groups)  # [N]
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, gid, torch.ones_like(r))
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, gid, r)
    mean = (total / count)[gid]  # [N]
    centred = r - mean  # [N]
    if estimator == "dr_grpo":
        adv = centred
    elif estimator == "grpo":
        sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, gid, centred**2)
        var = sq / (count - 1).clamp(min=1)  # unbiased; a group of one has var 0
        adv = centred / (var.sqrt()[gid] + eps)
    elif estimator == "rloo":
        n = count[gid]  # [N]
        # R - (S - R)/(n-1) == n/(n-1) (R - mean); zero for a group of one.
        adv = torch.where(n > 1, centred * n / (n - 1).clamp(min=1), torch.zeros_like(r))
    else:  # reinforce_pp
        std = centred.std(unbiased=True) if r.numel() > 1 else torch.zeros((), dtype=torch.float64)
        adv = centred / (std + eps)
    # Exact zeros for groups whose rewards are all equal (float noise would
    # otherwise make them count as "non-zero" groups).
    hi = torch.full((n_groups,), -torch.inf, dtype=torch.float64).scatter_reduce(0, gid, r, "amax")
    lo = torch.full((n_groups,), torch.inf, dtype=torch.float64).scatter_reduce(0, gid, r, "amin")
    adv = torch.where((hi == lo)[gid], torch.zeros_like(adv), adv)
    return adv.to(torch.float32)


def zero_advantage_groups(rewards: Any, groups: Sequence[Hashable]) -> set[Hashable]:
    """Group keys whose rewards are all equal (every estimator gives them zero advantage)."""
    r = _as_float64(rewards).tolist()
    seen: dict[Hashable, set[float]] = {}
    for value, g in zip(r, groups, strict=True):
        seen.setdefault(g, set()).add(value)
    return {g for g, values in seen.items() if len(values) == 1}


def discounted_returns(call_rewards: Sequence[float], *, gamma: float) -> list[float]:
    """``G_c = r_c + γ G_{c+1}`` over one rollout's calls (in call order)."""
    out = [0.0] * len(call_rewards)
    running = 0.0
    for c in range(len(call_rewards) - 1, -1, -1):
        running = float(call_rewards[c]) + gamma * running
        out[c] = running
    return out


def turn_level(
    call_rewards: Mapping[str, Sequence[float]],
    groups: Mapping[str, Hashable],
    *,
    estimator: Estimator,
    gamma: float = 1.0,
    eps: float = 1e-6,
) -> dict[str, np.ndarray]:
    """Per-call advantages: ``rollout_id -> float32 array [n_calls]``.

    ``call_rewards[rid][c]`` is the reward credited to call ``c`` of rollout
    ``rid``; returns are discounted with ``gamma`` inside each rollout, then the
    estimator compares call ``c`` with call ``c`` of the other rollouts of its
    group (departure 3 in the module docstring).
    """
    check_estimator(estimator)
    keys: list[tuple[str, int]] = []
    values: list[float] = []
    bucket: list[tuple[Hashable, int]] = []
    for rid, rs in call_rewards.items():
        if rid not in groups:
            raise ValueError(f"rollout {rid!r} has call rewards but no group; add it to groups")
        for c, g in enumerate(discounted_returns(rs, gamma=gamma)):
            keys.append((rid, c))
            values.append(g)
            bucket.append((groups[rid], c))
    adv = estimate(values, bucket, estimator=estimator, eps=eps).numpy()
    out = {rid: np.zeros(len(rs), dtype=np.float32) for rid, rs in call_rewards.items()}
    for (rid, c), a in zip(keys, adv, strict=True):
        out[rid][c] = a
    return out


def token_advantages(
    sample: Any,
    *,
    rollout_advantage: float | None = None,
    call_advantages: np.ndarray | None = None,
) -> np.ndarray:
    """Broadcast advantages onto one sample's tokens (float32 ``[len(tokens)]``).

    Generated tokens (``call_index >= 0``) take their rollout's advantage, or
    with ``call_advantages`` the advantage of the call that generated them;
    context tokens get 0 (their weight is 0 anyway).
    """
    call_index = np.asarray(sample.call_index, dtype=np.int64)  # [T]
    generated = call_index >= 0
    out = np.zeros(call_index.shape, dtype=np.float32)
    if call_advantages is not None:
        ca = np.asarray(call_advantages, dtype=np.float32)
        if generated.any() and call_index[generated].max() >= len(ca):
            raise ValueError(
                f"sample of rollout {sample.rollout_id!r} references call "
                f"{int(call_index.max())} but only {len(ca)} call advantages were given"
            )
        out[generated] = ca[call_index[generated]]
    elif rollout_advantage is not None:
        out[generated] = rollout_advantage
    else:
        raise ValueError("pass rollout_advantage or call_advantages")
    return out
