from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import reference
from lightning.batching import (
    BATCH_MODES,
    SeqItem,
    ancestor_mask,
    forward_logprobs,
    micro_batches,
    tree_batch,
)
from lightning.models import tiny_model_dir


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir(), dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.eval()


def grpo_like_items(seed: int = 0) -> list[SeqItem]:
    """Two groups sharing a prompt each; some completions share a prefix too
    (the tree must handle targets at shared nodes)."""
    rng = np.random.default_rng(seed)
    items, tid = [], 0
    for _ in range(2):
        prompt = rng.integers(5, 40000, size=int(rng.integers(6, 14)))
        first = rng.integers(5, 40000, size=3)
        for k in range(4):
            tail = rng.integers(5, 40000, size=int(rng.integers(2, 9)))
            completion = np.concatenate([first, tail]) if k % 2 else tail
            tokens = np.concatenate([prompt, completion]).astype(np.int64)
            positions = np.arange(len(prompt), len(tokens))
            items.append(SeqItem(tokens, positions, np.arange(tid, tid + len(positions))))
            tid += len(positions)
    return items


def per_target(
    model: torch.nn.Module, items: list[SeqItem], mode: str, budget: int
) -> torch.Tensor:
    n = sum(len(i.positions) for i in items)
    out = torch.full((n,), float("nan"))
    for mb in micro_batches(items, budget, mode=mode):  # type: ignore[arg-type]
        lp, _ = forward_logprobs(model, mb)
        out[mb.target_ids] = lp.detach()
    return out


@pytest.mark.parametrize("budget", [16, 64, 4096])
def test_modes_match_plain_forward(tiny: torch.nn.Module, budget: int) -> None:
    items = grpo_like_items()
    want = torch.tensor(
        [
            lp
            for i in items
            for lp in np.asarray(reference.token_logprobs(tiny, i.tokens.tolist()))[i.positions - 1]
        ],
        dtype=torch.float32,
    )
    for mode in BATCH_MODES:
        got = per_target(tiny, items, mode, budget)
        assert (got - want).abs().max() < 1e-5, mode


def test_tree_computes_shared_prefixes_once() -> None:
    items = grpo_like_items()
    total = sum(len(i.tokens) for i in items)
    (tree,) = micro_batches(items, 10_000, mode="tree")
    (packed,) = micro_batches(items, 10_000, mode="packed")
    assert packed.forward_tokens == total
    assert tree.forward_tokens < total - 6  # both prompts (>= 6 tokens) shared 4 ways
    assert tree.n_sequences == len(items)


def test_modes_give_same_gradients(tiny: torch.nn.Module) -> None:
    items = grpo_like_items(1)
    n = sum(len(i.positions) for i in items)
    coef = torch.linspace(-1, 1, n)
    grads = {}
    for mode in BATCH_MODES:
        tiny.zero_grad()
        for mb in micro_batches(items, 40, mode=mode):  # type: ignore[arg-type]
            lp, _ = forward_logprobs(tiny, mb)
            (coef[mb.target_ids] * lp).sum().backward()
        grads[mode] = torch.cat([p.grad.reshape(-1).clone() for p in tiny.parameters()])
    tiny.zero_grad()
    for mode in ("packed", "tree"):
        torch.testing.assert_close(grads[mode], grads["padded"], atol=1e-5, rtol=1e-4)


def test_ancestor_mask() -> None:
    m = ancestor_mask(np.array([-1, 0, 1, 0, -1]))[0, 0].int().tolist()
    assert m == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 0, 0, 1, 0],
        [0, 0, 0, 0, 1],
    ]
    with pytest.raises(ValueError, match="after their parent"):
        ancestor_mask(np.array([1, -1]))


class _Packed:
    """A hand-built DFS packed tree (what ``MergeResult.packed`` returns)."""

    def __init__(self, tokens: list[int], parent: list[int]) -> None:
        self.tokens = np.array(tokens, dtype=np.uint32)
        self.parent = np.array(parent, dtype=np.int32)
        depth: list[int] = []
        for p in parent:
            depth.append(0 if p < 0 else depth[p] + 1)
        self.depth = np.array(depth, dtype=np.int32)


def test_tree_batch_from_packed_tree(tiny: torch.nn.Module) -> None:
    # Two sequences [10, 11, 12, 13] and [10, 11, 20, 21, 22] in DFS order.
    packed = _Packed([10, 11, 12, 13, 20, 21, 22], [-1, 0, 1, 2, 1, 4, 5])
    a = SeqItem(np.array([10, 11, 12, 13]), np.array([2, 3]), np.array([0, 1]))
    b = SeqItem(np.array([10, 11, 20, 21, 22]), np.array([2, 3, 4]), np.array([2, 3, 4]))
    mb = tree_batch(packed, [a, b])
    assert mb.forward_tokens == 7
    lp, _ = forward_logprobs(tiny, mb)
    want = [
        *np.asarray(reference.token_logprobs(tiny, [10, 11, 12, 13]))[[1, 2]],
        *np.asarray(reference.token_logprobs(tiny, [10, 11, 20, 21, 22]))[[1, 2, 3]],
    ]
    torch.testing.assert_close(
        lp.detach(), torch.tensor(want, dtype=torch.float32), atol=1e-5, rtol=0
    )
    with pytest.raises(ValueError, match="not in the packed tree"):
        tree_batch(packed, [SeqItem(np.array([10, 99]), np.array([1]), np.array([0]))])


def test_bad_mode_and_budget() -> None:
    with pytest.raises(ValueError, match="unknown batching mode"):
        micro_batches(grpo_like_items(), 10, mode="ragged")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="budget"):
        micro_batches(grpo_like_items(), 0, mode="packed")


@pytest.mark.parametrize("mode", ["padded", "packed", "tree"])
def test_temperature_scales_the_policy(tiny: torch.nn.Module, mode: str) -> None:
    # Rollouts sampled at temperature T are scored under softmax(logits / T).
    a = SeqItem(np.array([10, 11, 12, 13]), np.array([2, 3]), np.array([0, 1]))
    [mb] = micro_batches([a], 4096, mode=mode)  # type: ignore[arg-type]
    lp, _ = forward_logprobs(tiny, mb, temperature=0.7)
    want = np.asarray(reference.token_logprobs(tiny, [10, 11, 12, 13], temperature=0.7))[[1, 2]]
    torch.testing.assert_close(
        lp.detach(), torch.tensor(want, dtype=torch.float32), atol=1e-5, rtol=0
    )
    plain, _ = forward_logprobs(tiny, mb)
    assert not torch.allclose(lp, plain)
