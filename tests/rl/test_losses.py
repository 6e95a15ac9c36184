from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
from lightning.rl.losses import (
    AGGREGATION_MODES,
    Normalizer,
    aggregate,
    entropy_from_logits,
    kl_penalty,
    policy_loss,
    sequence_log_ratio,
)

T = torch.tensor


def test_aggregate_hand_checked() -> None:
    # sample 0 (rollout 0): losses 1, 3 weights 1, 1; sample 1 (rollout 0): loss 5 w 2;
    # sample 2 (rollout 1): loss 2 w 1.
    losses = T([1.0, 3.0, 5.0, 2.0], dtype=torch.float64)
    w, s, r = T([1.0, 1.0, 2.0, 1.0]), T([0, 0, 1, 2]), T([0, 0, 0, 1])
    expect = {
        "token-mean": (1 + 3 + 10 + 2) / 5,
        "seq-mean-token-mean": (2 + 5 + 2) / 3,
        "seq-mean-token-sum": (4 + 10 + 2) / 3,
        "seq-mean-token-sum-norm": (4 + 10 + 2) / (3 * 8),
        "rollout-mean": (14 / 4 + 2) / 2,
    }
    for mode, want in expect.items():
        got = aggregate(losses, w, s, r, mode=mode, max_len=8)  # type: ignore[arg-type]
        assert float(got) == pytest.approx(want, abs=1e-12)


def test_aggregate_modes_checked() -> None:
    x = T([1.0])
    with pytest.raises(ValueError, match="unknown aggregation mode"):
        aggregate(x, x, T([0]), T([0]), mode="mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_len"):
        aggregate(x, x, T([0]), T([0]), mode="seq-mean-token-sum-norm")


@st.composite
def token_batches(draw: st.DrawFn) -> tuple[list[float], list[float], list[int], list[int]]:
    n_samples = draw(st.integers(1, 6))
    rollout_of = [draw(st.integers(0, 3)) for _ in range(n_samples)]
    losses, weights, samples, rollouts = [], [], [], []
    for s in range(n_samples):
        for _ in range(draw(st.integers(1, 6))):
            losses.append(draw(st.floats(-5, 5, allow_nan=False)))
            weights.append(float(draw(st.sampled_from([0, 1, 1, 1, 2]))))
            samples.append(s)
            rollouts.append(rollout_of[s])
    return losses, weights, samples, rollouts


@settings(max_examples=150, deadline=None)
@given(batch=token_batches(), mode=st.sampled_from(AGGREGATION_MODES))
def test_aggregate_matches_reference(
    batch: tuple[list[float], list[float], list[int], list[int]], mode: str
) -> None:
    losses, weights, samples, rollouts = batch
    got = aggregate(
        T(losses, dtype=torch.float64),
        T(weights),
        T(samples),
        T(rollouts),
        mode=mode,  # type: ignore[arg-type]
        max_len=7,
    )
    want = reference.aggregate(losses, weights, samples, rollouts, mode, 7)
    assert float(got) == pytest.approx(want, rel=1e-6, abs=1e-6)


@settings(max_examples=60, deadline=None)
@given(batch=token_batches(), mode=st.sampled_from(AGGREGATION_MODES), cut=st.data())
def test_normalizer_split_sums_to_whole(
    batch: tuple[list[float], list[float], list[int], list[int]], mode: str, cut: st.DataObject
) -> None:
    losses, weights, samples, rollouts = batch
    lt, w, s, r = T(losses, dtype=torch.float64), T(weights), T(samples), T(rollouts)
    norm = Normalizer.build(w, s, r, mode=mode, max_len=7)  # type: ignore[arg-type]
    k = cut.draw(st.integers(0, len(losses)))
    parts = [slice(0, k), slice(k, None)]
    total = sum(float((norm.coefficients(w[p], s[p], r[p]) * lt[p]).sum()) for p in parts)
    want = float(aggregate(lt, w, s, r, mode=mode, max_len=7))  # type: ignore[arg-type]
    assert total == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_aggregate_is_differentiable() -> None:
    x = T([1.0, 2.0, 3.0], requires_grad=True)
    aggregate(x, T([1.0, 1.0, 2.0]), T([0, 0, 1]), T([0, 0, 0]), mode="token-mean").backward()
    assert x.grad is not None
    assert x.grad.tolist() == pytest.approx([0.25, 0.25, 0.5])


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.floats(-3, 0),
            st.floats(-3, 0),
            st.floats(-2, 2, allow_nan=False),
        ),
        min_size=1,
        max_size=20,
    ),
    clip_low=st.sampled_from([0.1, 0.2]),
    clip_high=st.sampled_from([0.2, 0.28]),
    dual=st.sampled_from([None, 3.0]),
)
def test_policy_loss_matches_reference(
    rows: list[tuple[float, float, float]], clip_low: float, clip_high: float, dual: float | None
) -> None:
    logp, old, adv = (T([r[i] for r in rows], dtype=torch.float64) for i in range(3))
    got, metrics = policy_loss(
        logp, old, adv, clip_low=clip_low, clip_high=clip_high, dual_clip=dual
    )
    want = [reference.ppo_token_loss(*r, clip_low, clip_high, dual) for r in rows]
    assert got.tolist() == pytest.approx(want, rel=1e-9, abs=1e-9)
    assert set(metrics) == {"ratio", "clipped", "approx_kl", "is_weight", "is_truncated"}
    assert bool((metrics["approx_kl"] >= -1e-12).all())


def test_policy_loss_gradient_on_policy() -> None:
    # At ratio 1 the PPO gradient is -A dlogp (the REINFORCE gradient).
    logp = T([-1.0, -2.0], requires_grad=True)
    loss, m = policy_loss(logp, logp.detach(), T([1.5, -0.5]))
    loss.sum().backward()
    assert logp.grad is not None
    assert logp.grad.tolist() == pytest.approx([-1.5, 0.5])
    assert m["clipped"].tolist() == [0.0, 0.0]


def test_clipping_zeroes_gradient() -> None:
    logp = T([0.0, 0.0], requires_grad=True)
    old = T([-1.0, 1.0])  # ratio e (above 1.2) and 1/e (below 0.8)
    loss, m = policy_loss(logp, old, T([1.0, -1.0]))
    loss.sum().backward()
    assert logp.grad is not None
    assert logp.grad.tolist() == [0.0, 0.0]
    assert m["clipped"].tolist() == [1.0, 1.0]


def test_dual_clip_bounds_negative_advantage() -> None:
    logp = T([2.0])
    loss, _ = policy_loss(logp, T([0.0]), T([-1.0]), dual_clip=3.0)
    assert float(loss) == pytest.approx(3.0)  # unbounded it would be e^2 ≈ 7.39


def test_truncated_importance_weights() -> None:
    logp = T([-1.0, -1.0, -1.0])
    rollout = T([-1.5, -0.5, float("nan")])
    loss, m = policy_loss(logp, logp, T([1.0, 1.0, 1.0]), rollout_logp=rollout, tis_cap=1.2)
    assert m["is_weight"].tolist() == pytest.approx([1.2, math.exp(-0.5), 1.0])
    assert m["is_truncated"].tolist() == [1.0, 0.0, 0.0]  # only e^0.5 > 1.2 was cut
    assert loss.tolist() == pytest.approx([-1.2, -math.exp(-0.5), -1.0])
    _, m = policy_loss(
        logp,
        logp,
        T([1.0, 1.0, 1.0]),
        rollout_logp=T([-1.1, -1.0, -0.95]),
        tis_cap=5.0,
        tis_level="sequence",
        sample_index=T([0, 0, 1]),
    )
    assert m["is_weight"].tolist() == pytest.approx([math.exp(0.1)] * 2 + [math.exp(-0.05)])


def test_gspo_sequence_ratio() -> None:
    logp = T([-1.0, -2.0, -1.0], requires_grad=True)
    old = T([-1.2, -2.2, -0.5])
    lr = sequence_log_ratio(logp, old, T([0, 0, 1]))
    assert lr.tolist() == pytest.approx([0.2, 0.2, -0.5])
    loss, _ = policy_loss(
        logp, old, T([1.0, 1.0, 1.0]), ratio_level="sequence", sample_index=T([0, 0, 1])
    )
    # sample 0's ratio e^0.2 > 1.2 is clipped (no grad); sample 1's e^-0.5 is not.
    loss.sum().backward()
    assert logp.grad is not None
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, -math.exp(-0.5)])


def test_kl_and_entropy() -> None:
    lp, ref = T([-1.0, -2.0]), T([-1.5, -2.0])
    assert kl_penalty(lp, ref, estimator="k1").tolist() == pytest.approx([0.5, 0.0])
    assert kl_penalty(lp, ref, estimator="k3").tolist() == pytest.approx(
        [math.exp(-0.5) + 0.5 - 1, 0.0]
    )
    with pytest.raises(ValueError, match="KL estimator"):
        kl_penalty(lp, ref, estimator="k2")  # type: ignore[arg-type]
    logits = torch.zeros(2, 4)
    assert entropy_from_logits(logits).tolist() == pytest.approx([math.log(4)] * 2)
