"""The eval interval: a cluster bootstrap over tasks."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning.run.stats import reward_interval


@settings(max_examples=40, deadline=None)
@given(
    rewards=st.lists(
        st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=3, max_size=3), min_size=1, max_size=30
    )
)
def test_interval_holds_the_plain_mean(rewards: list[list[float]]) -> None:
    by_task = {str(i): r for i, r in enumerate(rewards)}
    interval = reward_interval(by_task, resamples=500)
    flat = [x for r in rewards for x in r]
    assert interval.mean == pytest.approx(sum(flat) / len(flat))
    assert interval.low <= interval.mean + 1e-12 and interval.mean <= interval.high + 1e-12
    assert (interval.tasks, interval.samples) == (len(rewards), 3)
    if len({sum(r) for r in rewards}) == 1:  # every task alike: nothing to resample
        assert interval.low == pytest.approx(interval.high)


def test_width_shrinks_with_tasks_and_covers_truth() -> None:
    # Tasks with success probability p_t ~ U(0, 1), 2 samples each: the interval
    # over 200 tasks is about half as wide as over 50, and 95% intervals cover
    # the true mean (0.5) in most of 60 repeated evals.
    rng = random.Random(0)

    def draw(n_tasks: int) -> dict[str, list[float]]:
        probs = [rng.random() for _ in range(n_tasks)]
        return {str(i): [float(rng.random() < p) for _ in range(2)] for i, p in enumerate(probs)}

    small = reward_interval(draw(50), seed=1)
    large = reward_interval(draw(200), seed=1)
    assert 0.35 < (large.high - large.low) / (small.high - small.low) < 0.7
    covered = sum(
        1 for s in range(60) if (iv := reward_interval(draw(50), seed=s)).low <= 0.5 <= iv.high
    )
    assert covered >= 50


def test_same_seed_same_interval_and_bad_input() -> None:
    data = {"a": [1.0, 0.0], "b": [0.0, 0.0], "c": [1.0, 1.0]}
    assert reward_interval(data, seed=3) == reward_interval(data, seed=3)
    with pytest.raises(ValueError, match="same, non-zero number"):
        reward_interval({"a": [1.0], "b": [1.0, 0.0]})
    with pytest.raises(ValueError, match="empty"):
        reward_interval({})
    with pytest.raises(ValueError, match="confidence"):
        reward_interval(data, confidence=1.0)
