"""How sure an eval reward is: a 95% interval by bootstrap over tasks.

An eval runs every held-out task ``k`` times. Samples of one task are not
independent (an easy task is solved by all its samples), so a binomial interval
over tasks x samples would be too narrow. The cluster bootstrap resamples whole
tasks with replacement, keeping each task's samples together, and takes the
percentile interval of the resampled means (Efron & Tibshirani, *An Introduction
to the Bootstrap*, 1993, ch. 13; resampling clusters: Davison & Hinkley 1997,
§3.8). Seeded, so a run reports the same interval every time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Interval:
    """A mean reward with its ``confidence`` interval over ``tasks`` x ``samples``."""

    mean: float
    low: float
    high: float
    tasks: int
    samples: int
    confidence: float = 0.95

    def __str__(self) -> str:
        pct = round(100 * self.confidence)
        return f"{self.mean:.3f} [{pct}% CI {self.low:.3f}, {self.high:.3f}]"


def reward_interval(
    rewards_by_task: Mapping[str, Sequence[float]],
    *,
    confidence: float = 0.95,
    resamples: int = 4000,
    seed: int = 0,
) -> Interval:
    """Mean reward over all samples, with a cluster-bootstrap interval over tasks.

    Every task must have the same number of samples (the eval runs each ``k``
    times), so the mean of task means is the mean of all samples.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    if not rewards_by_task:
        raise ValueError("no eval rewards; the eval set is empty")
    counts = {len(v) for v in rewards_by_task.values()}
    if len(counts) != 1 or 0 in counts:
        raise ValueError(
            f"every task needs the same, non-zero number of samples; got counts {sorted(counts)}"
        )
    per_task = np.array([np.mean(v) for v in rewards_by_task.values()], dtype=np.float64)  # [T]
    mean = float(per_task.mean())
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(per_task), size=(resamples, len(per_task)))  # [R, T]
    means = per_task[picks].mean(axis=1)  # [R]
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return Interval(
        mean=mean,
        low=float(low),
        high=float(high),
        tasks=len(per_task),
        samples=counts.pop(),
        confidence=confidence,
    )
