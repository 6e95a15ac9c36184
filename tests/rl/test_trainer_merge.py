"""The trainer on real merged samples: ``lightning.merge_calls`` → batching
layouts (including the merge's own ``packed(across_rollouts=True)`` tree for a
GRPO group's shared prompt) → ``Trainer.step``."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import lightning
import reference
from lightning.model_cache import tiny_model_dir
from lightning.rl.batching import (
    BATCH_MODES,
    forward_logprobs,
    micro_batches,
    seq_items,
    tree_batch,
)
from lightning.rl.trainer import Trainer, TrainerConfig


def _ids(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(5, 40000, size=n).astype(np.uint32)


def group_calls() -> tuple[list[object], dict[str, float], dict[str, str]]:
    """One GRPO group of three rollouts sharing a prompt; r1 is two-turn."""
    rng = np.random.default_rng(0)
    prompt = _ids(rng, 10)
    calls, rewards, groups = [], {}, {}
    for k in range(3):
        rid = f"r{k}"
        c0 = _ids(rng, 5)
        lp0 = np.full(len(c0), -2.0, dtype=np.float32)
        calls.append(lightning.Call(rid, prompt, c0, logprobs=lp0, group="g"))
        if k == 1:
            p1 = np.concatenate([prompt, c0, _ids(rng, 3)]).astype(np.uint32)
            c1 = _ids(rng, 4)
            calls.append(
                lightning.Call(rid, p1, c1, logprobs=np.full(4, -1.0, np.float32), group="g")
            )
        rewards[rid] = float(k)
        groups[rid] = "g"
    return calls, rewards, groups


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), attn_implementation="sdpa")
    return m.eval()


def test_layouts_on_merged_samples(tiny: torch.nn.Module) -> None:
    calls, _, _ = group_calls()
    merged = lightning.merge_calls(calls)
    samples = merged.samples
    assert {s.rollout_id for s in samples} == {"r0", "r1", "r2"}
    items = seq_items(samples)
    want = torch.tensor(
        [
            x
            for i in items
            for x in np.asarray(reference.token_logprobs(tiny, i.tokens.tolist()))[i.positions - 1]
        ],
        dtype=torch.float32,
    )
    # Every generated token of every call is trained exactly once.
    assert sum(float(np.asarray(s.weights).sum()) for s in samples) == 5 * 3 + 4
    for mode in BATCH_MODES:
        got = torch.full_like(want, float("nan"))
        for mb in micro_batches(items, 24, mode=mode):
            lp, _ = forward_logprobs(tiny, mb)
            got[mb.target_ids] = lp.detach()
        assert float((got - want).abs().max()) < 1e-5, mode

    packed = merged.packed(across_rollouts=True)
    mb = tree_batch(packed, items)
    # The shared prompt (10 tokens) is computed once instead of three times.
    assert mb.forward_tokens == len(packed.tokens)
    assert mb.forward_tokens <= sum(len(i.tokens) for i in items) - 20
    lp, _ = forward_logprobs(tiny, mb)
    assert float((lp.detach() - want[mb.target_ids]).abs().max()) < 1e-5


def test_trainer_step_on_merged_samples() -> None:
    calls, rewards, groups = group_calls()
    merged = lightning.merge_calls(calls)
    tr = Trainer(TrainerConfig(model=str(tiny_model_dir()), lr=1e-3, batching="tree"))
    m = tr.step(merged.samples, rewards, groups)
    assert m["samples"] == len(merged.samples)
    assert m["forward_tokens"] < m["tokens"]
    assert math.isfinite(m["gap_abs_logprob"]) and math.isfinite(m["grad_norm"])


def _trainer(**kw: Any) -> Trainer:
    # lr ~ 0: the step leaves its gradient in .grad and barely moves the weights.
    cfg = TrainerConfig(model=str(tiny_model_dir()), **{"lr": 1e-12, "max_grad_norm": None, **kw})
    return Trainer(cfg)


def _grads(tr: Trainer) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in tr.params])


def _reference_grads(
    sequences: list[tuple[np.ndarray, np.ndarray, float, int, int]], mode: str
) -> torch.Tensor:
    """Plain gradient of an on-policy PPO step: every sequence run alone
    through the model; ``(tokens, trained positions, advantage, sample id,
    rollout id)``; ``reference.aggregate`` normalises the token losses."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), attn_implementation="eager")
    losses, weights, sample_ids, rollout_ids = [], [], [], []
    for tokens, positions, adv, sid, rid in sequences:
        logits = model(torch.from_numpy(tokens.astype(np.int64))[None]).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        for t in positions.tolist():
            logp = lp[t - 1, int(tokens[t])]
            losses.append(-torch.exp(logp - logp.detach()) * adv)  # ratio 1, no clipping
            weights.append(1.0)
            sample_ids.append(sid)
            rollout_ids.append(rid)
    loss = reference.aggregate(losses, weights, sample_ids, rollout_ids, mode)
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def shared_prefix_group() -> tuple[list[object], dict[str, float], dict[str, str]]:
    """A group whose rollouts share a system prompt and a first generated
    prefix (``<think>``-like), then differ; r1 is two-turn."""
    rng = np.random.default_rng(3)
    system, first = _ids(rng, 12), _ids(rng, 3)
    prompt = np.concatenate([system, _ids(rng, 4)]).astype(np.uint32)  # system + task
    calls, rewards, groups = [], {}, {}
    for k in range(4):
        rid = f"r{k}"
        c0 = np.concatenate([first, _ids(rng, 5 + k)]).astype(np.uint32)
        calls.append(lightning.Call(rid, prompt, c0, group="g"))
        if k == 1:
            p1 = np.concatenate([prompt, c0, _ids(rng, 3)]).astype(np.uint32)
            c1 = np.concatenate([first, _ids(rng, 4)]).astype(np.uint32)
            calls.append(lightning.Call(rid, p1, c1, group="g"))
        rewards[rid] = [0.0, 1.0, 0.5, 2.0][k]
        groups[rid] = "g"
    return calls, rewards, groups


@pytest.mark.parametrize("mode", ["token-mean", "rollout-mean"])
def test_shared_system_prompt_and_first_prefix_gradient(mode: str) -> None:
    calls, rewards, groups = shared_prefix_group()
    merged = lightning.merge_calls(calls)
    # Within the group tree the shared system prompt and the first generated
    # prefix are nodes of their own: computed once for all rollouts.
    packed = merged.packed(across_rollouts=True)
    assert len(packed.tokens) <= sum(len(s.tokens) for s in merged.samples) - 3 * (16 + 3)
    rids = list(rewards)
    adv = reference.advantages([rewards[r] for r in rids], [groups[r] for r in rids], "grpo")
    # Training each call separately: its own sequence, its completion trained.
    per_call = [
        (
            np.concatenate([np.asarray(c.prompt_ids), np.asarray(c.completion_ids)]),
            np.arange(len(c.prompt_ids), len(c.prompt_ids) + len(c.completion_ids)),
            adv[rids.index(c.rollout_id)],
            i,
            rids.index(c.rollout_id),
        )
        for i, c in enumerate(calls)
    ]
    want = _reference_grads(per_call, mode)
    for layout in ("padded", "packed", "tree"):
        for budget in (4096, 24):
            tr = _trainer(batching=layout, aggregation=mode, micro_batch_tokens=budget)
            m = tr.step(merged, rewards, groups)
            if layout == "tree" and budget == 4096:
                assert m["forward_tokens"] == len(packed.tokens)
            torch.testing.assert_close(
                _grads(tr), want, atol=1e-5, rtol=1e-4, msg=f"{layout} {budget}"
            )


def split_rollouts(ways: tuple[int, ...]) -> tuple[list[object], dict[str, float], dict[str, str]]:
    """One group; rollout k's calls each leave the previous call's path
    (re-tokenized history, as drift or a sub-agent does), so the merge splits
    it into ``ways[k]`` samples."""
    rng = np.random.default_rng(11)
    system = _ids(rng, 6)
    calls, rewards, groups = [], {}, {}
    for k, n in enumerate(ways):
        rid = f"r{k}"
        history = np.concatenate([system, _ids(rng, 2)]).astype(np.uint32)
        for _ in range(n):
            completion = _ids(rng, int(rng.integers(2, 6)))
            calls.append(lightning.Call(rid, history, completion, group="g"))
            # The next prompt carries this turn re-tokenized: the path departs.
            history = np.concatenate([history, _ids(rng, len(completion)), _ids(rng, 2)])
            history = history.astype(np.uint32)
        rewards[rid] = float(k * k)
        groups[rid] = "g"
    return calls, rewards, groups


@pytest.mark.parametrize("layout", ["padded", "tree"])
def test_rollout_mean_counts_split_rollouts_once(layout: str) -> None:
    ways = (1, 2, 5)
    calls, rewards, groups = split_rollouts(ways)
    merged = lightning.merge_calls(calls)
    per_rollout = [sum(s.rollout_id == f"r{k}" for s in merged.samples) for k in range(3)]
    assert per_rollout == list(ways)
    rids = list(rewards)
    adv = reference.advantages([rewards[r] for r in rids], [groups[r] for r in rids], "grpo")
    # Plain reference: every sample is its own sequence, each piece takes its
    # rollout's advantage, and rollout-mean averages over the 3 rollouts.
    pieces = []
    for i, s in enumerate(merged.samples):
        w = np.asarray(s.weights)
        pos = np.nonzero(w > 0)[0]
        assert (w[pos] == 1).all()
        pieces.append(
            (np.asarray(s.tokens), pos, adv[rids.index(s.rollout_id)], i, rids.index(s.rollout_id))
        )
    want = _reference_grads(pieces, "rollout-mean")
    tr = _trainer(batching=layout, aggregation="rollout-mean", micro_batch_tokens=32)
    m = tr.step(merged, rewards, groups)
    torch.testing.assert_close(_grads(tr), want, atol=1e-5, rtol=1e-4)
    assert m["samples"] == sum(ways)
    assert m["samples_per_rollout"] == pytest.approx(sum(ways) / 3)
    assert m["single_sample_rollout_frac"] == pytest.approx(1 / 3)
    # Dividing by samples instead of rollouts (the peer's mode) gives another gradient.
    wrong = _reference_grads(pieces, "seq-mean-token-mean")
    assert not torch.allclose(_grads(tr), wrong, atol=1e-5, rtol=1e-4)
