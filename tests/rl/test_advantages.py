from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
from lightning.rl.advantages import (
    ESTIMATORS,
    discounted_returns,
    estimate,
    token_advantages,
    turn_level,
    zero_advantage_groups,
)


def test_hand_checked_grpo() -> None:
    # group a: rewards 1, 0 -> mean 0.5, unbiased std sqrt(0.5)
    adv = estimate([1.0, 0.0, 3.0], ["a", "a", "b"], estimator="grpo", eps=0.0)
    s = math.sqrt(0.5)
    assert adv.dtype == torch.float32
    assert adv.tolist() == pytest.approx([0.5 / s, -0.5 / s, 0.0], abs=1e-6)


def test_hand_checked_others() -> None:
    r, g = [1.0, 2.0, 6.0, 5.0], [0, 0, 0, 1]
    assert estimate(r, g, estimator="dr_grpo").tolist() == pytest.approx([-2, -1, 3, 0])
    # RLOO: 1 - (2+6)/2 = -3; 2 - 3.5 = -1.5; 6 - 1.5 = 4.5; a group of one: 0
    assert estimate(r, g, estimator="rloo").tolist() == pytest.approx([-3, -1.5, 4.5, 0])
    centred = np.array([-2.0, -1.0, 3.0, 0.0])
    expect = centred / (centred.std(ddof=1) + 1e-6)
    assert estimate(r, g, estimator="reinforce_pp").tolist() == pytest.approx(expect.tolist())


def test_equal_rewards_give_exact_zero() -> None:
    for est in ESTIMATORS:
        adv = estimate([0.1, 0.1, 0.1, 0.7, 0.2], ["x", "x", "x", "y", "y"], estimator=est)
        assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert zero_advantage_groups([0.1, 0.1, 0.7, 0.2, 3.0], ["x", "x", "y", "y", "z"]) == {
        "x",
        "z",
    }


def test_unknown_estimator_and_bad_input() -> None:
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        estimate([1.0], ["a"], estimator="ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="group keys"):
        estimate([1.0, 2.0], ["a"], estimator="grpo")
    with pytest.raises(ValueError, match="NaN"):
        estimate([float("nan")], ["a"], estimator="grpo")


@settings(max_examples=150, deadline=None)
@given(
    data=st.lists(
        st.tuples(
            st.floats(-10, 10, allow_nan=False).map(lambda x: round(x, 2)),
            st.integers(0, 4),
        ),
        min_size=1,
        max_size=30,
    ),
    estimator=st.sampled_from(ESTIMATORS),
)
def test_matches_reference(data: list[tuple[float, int]], estimator: str) -> None:
    rewards = [r for r, _ in data]
    groups = [g for _, g in data]
    got = estimate(rewards, groups, estimator=estimator).tolist()  # type: ignore[arg-type]
    want = reference.advantages(rewards, groups, estimator)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_accepts_numpy_and_torch() -> None:
    a = estimate(np.array([1.0, 2.0]), ("g", "g"), estimator="grpo")
    b = estimate(torch.tensor([1.0, 2.0]), ["g", "g"], estimator="grpo")
    assert torch.equal(a, b)


def test_turn_level() -> None:
    assert discounted_returns([1.0, 0.0, 2.0], gamma=0.5) == [1.5, 1.0, 2.0]
    adv = turn_level(
        {"r1": [0.0, 1.0], "r2": [0.0, 0.0]}, {"r1": "g", "r2": "g"}, estimator="dr_grpo", gamma=1.0
    )
    # returns: r1 [1, 1], r2 [0, 0]; turn-wise means 0.5
    assert adv["r1"].tolist() == pytest.approx([0.5, 0.5])
    assert adv["r2"].tolist() == pytest.approx([-0.5, -0.5])


@dataclass
class _Sample:
    rollout_id: str
    call_index: np.ndarray


def test_token_advantages_broadcast() -> None:
    s = _Sample("r", np.array([-1, -1, 0, 0, -1, 1], dtype=np.int32))
    assert token_advantages(s, rollout_advantage=2.0).tolist() == [0, 0, 2, 2, 0, 2]
    got = token_advantages(s, call_advantages=np.array([1.0, -1.0]))
    assert got.tolist() == [0, 0, 1, 1, 0, -1]
    with pytest.raises(ValueError, match="call advantages"):
        token_advantages(s, call_advantages=np.array([1.0]))
