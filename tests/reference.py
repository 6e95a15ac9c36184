"""Slow, obvious twins of the RL math (plain Python loops, no shared code with
the library). Tests check the fast code against these."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence


def _members(groups: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    out: dict[Hashable, list[int]] = {}
    for i, g in enumerate(groups):
        out.setdefault(g, []).append(i)
    return out


def advantages(
    rewards: Sequence[float], groups: Sequence[Hashable], estimator: str, eps: float = 1e-6
) -> list[float]:
    n = len(rewards)
    out = [0.0] * n
    members = _members(groups)
    for idx in members.values():
        vals = [float(rewards[i]) for i in idx]
        k = len(vals)
        mean = sum(vals) / k
        equal = all(v == vals[0] for v in vals)
        for i in idx:
            if equal:
                out[i] = 0.0
            elif estimator == "grpo":
                var = sum((v - mean) ** 2 for v in vals) / (k - 1)
                out[i] = (rewards[i] - mean) / (math.sqrt(var) + eps)
            elif estimator in ("dr_grpo", "reinforce_pp"):
                out[i] = rewards[i] - mean
            elif estimator == "rloo":
                others = [float(rewards[j]) for j in idx if j != i]
                out[i] = rewards[i] - sum(others) / len(others) if others else 0.0
            else:
                raise ValueError(estimator)
    if estimator == "reinforce_pp" and n > 1:
        m = sum(out) / n
        std = math.sqrt(sum((a - m) ** 2 for a in out) / (n - 1))
        out = [a / (std + eps) for a in out]
    return out


def aggregate(
    losses: Sequence[float],
    weights: Sequence[float],
    samples: Sequence[int],
    rollouts: Sequence[int],
    mode: str,
    max_len: float | None = None,
) -> float:
    def sums(keys: Sequence[int]) -> dict[int, tuple[float, float]]:
        out: dict[int, tuple[float, float]] = {}
        for loss, w, k in zip(losses, weights, keys, strict=True):
            a, b = out.get(k, (0.0, 0.0))
            out[k] = (a + w * loss, b + w)
        # Only groups with some weight count (a zero-weight group carries no loss).
        return {k: v for k, v in out.items() if v[1] > 0}

    total_w = sum(weights)
    if total_w == 0:
        return 0.0
    if mode == "token-mean":
        return sum(w * loss for loss, w in zip(losses, weights, strict=True)) / total_w
    per_sample = sums(samples)
    if mode == "seq-mean-token-mean":
        return sum(a / b for a, b in per_sample.values()) / len(per_sample)
    if mode == "seq-mean-token-sum":
        return sum(a for a, _ in per_sample.values()) / len(per_sample)
    if mode == "seq-mean-token-sum-norm":
        assert max_len is not None
        return sum(a for a, _ in per_sample.values()) / (len(per_sample) * max_len)
    if mode == "rollout-mean":
        per_rollout = sums(rollouts)
        return sum(a / b for a, b in per_rollout.values()) / len(per_rollout)
    raise ValueError(mode)


def ppo_token_loss(
    logp: float,
    old: float,
    adv: float,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> float:
    ratio = math.exp(logp - old)
    unclipped = ratio * adv
    clipped = max(min(ratio, 1 + clip_high), 1 - clip_low) * adv
    loss = -min(unclipped, clipped)
    if dual_clip is not None and adv < 0:
        loss = min(loss, -dual_clip * adv)
    return loss


def token_logprobs(model, tokens: Sequence[int]) -> list[float]:
    """Log-probability of tokens[1:] under ``model`` run on one plain sequence."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([list(tokens)])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[t - 1, tokens[t]]) for t in range(1, len(tokens))]
