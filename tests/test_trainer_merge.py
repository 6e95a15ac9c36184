"""The trainer on real merged samples: ``lightning.merge_calls`` → batching
layouts (including the merge's own ``packed(across_rollouts=True)`` tree for a
GRPO group's shared prompt) → ``Trainer.step``."""

from __future__ import annotations

import math

import lightning
import numpy as np
import pytest
import reference
import torch
from lightning.batching import BATCH_MODES, forward_logprobs, micro_batches, seq_items, tree_batch
from lightning.models import tiny_model_dir
from lightning.trainer import Trainer
from transformers import AutoModelForCausalLM

if not hasattr(lightning, "merge_calls"):  # the merge branch has not landed in this checkout
    pytest.skip("lightning.merge_calls is not built in this checkout", allow_module_level=True)


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
    tr = Trainer({"model": str(tiny_model_dir()), "lr": 1e-3, "batching": "tree"})
    m = tr.step(merged.samples, rewards, groups)
    assert m["samples"] == len(merged.samples)
    assert m["forward_tokens"] < m["tokens"]
    assert math.isfinite(m["gap_abs_logprob"]) and math.isfinite(m["grad_norm"])
