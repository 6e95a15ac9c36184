"""Test stand-ins for ``lightning.Sample`` (same attributes) and batch builders."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class FakeSample:
    rollout_id: str
    group: str | None
    tokens: np.ndarray  # uint32 [T]
    weights: np.ndarray  # float32 [T], 0 = context
    logprobs: np.ndarray  # float32 [T], NaN unknown
    call_index: np.ndarray  # int32 [T], -1 = context


def make_sample(
    rollout_id: str,
    group: str | None,
    segments: list[tuple[list[int], int]],
    logprob: float = float("nan"),
) -> FakeSample:
    """``segments``: (token ids, call index or -1 for context), in order."""
    tokens = np.concatenate([np.asarray(t, dtype=np.uint32) for t, _ in segments])
    call = np.concatenate([np.full(len(t), c, dtype=np.int32) for t, c in segments])
    weights = (call >= 0).astype(np.float32)
    lps = np.where(call >= 0, np.float32(logprob), np.float32(np.nan)).astype(np.float32)
    return FakeSample(rollout_id, group, tokens, weights, lps, call)


def grpo_batch(
    n_groups: int = 2, group_size: int = 4, prompt_len: int = 12, seed: int = 0
) -> tuple[list[FakeSample], dict[str, float], dict[str, str]]:
    """GRPO-shaped batch: each group shares a prompt; some rollouts are two-turn."""
    rng = np.random.default_rng(seed)
    samples, rewards, groups = [], {}, {}
    for g in range(n_groups):
        prompt = rng.integers(5, 40000, size=prompt_len).tolist()
        for k in range(group_size):
            rid = f"g{g}r{k}"
            segs = [
                (prompt, -1),
                (rng.integers(5, 40000, size=int(rng.integers(3, 9))).tolist(), 0),
            ]
            if k % 2:
                segs += [(rng.integers(5, 40000, size=4).tolist(), -1)]
                segs += [(rng.integers(5, 40000, size=int(rng.integers(2, 6))).tolist(), 1)]
            samples.append(make_sample(rid, f"g{g}", segs, logprob=-3.0))
            rewards[rid] = float(rng.integers(0, 3))
            groups[rid] = f"g{g}"
    return samples, rewards, groups
