"""Segment-batched tree attention equals attention along each node's root path."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import reference
from lightning.rl.attention import plan_tree, segments, to_device, tree_attention

# A second device for the copies (e.g. cuda); on the CPU they go to "meta".
DEVICE = torch.device(os.environ.get("LIGHTNING_TEST_DEVICE", "cpu"))


@st.composite
def dfs_trees(draw: st.DrawFn) -> list[int]:
    """Parent arrays in DFS order: node i hangs below node i-1 or one of its ancestors."""
    n = draw(st.integers(1, 40))
    parent = [-1]
    for i in range(1, n):
        chain, j = [-1], i - 1
        while j >= 0:
            chain.append(j)
            j = parent[j]
        # Mostly continue the current path (long segments), sometimes branch.
        parent.append(i - 1 if draw(st.booleans()) else draw(st.sampled_from(chain)))
    return parent


class _Module(torch.nn.Module):
    pass


def _depth(parent: list[int]) -> np.ndarray:
    depth: list[int] = []
    for p in parent:
        depth.append(0 if p < 0 else depth[p] + 1)
    return np.array(depth)


@settings(max_examples=60, deadline=None)
@given(dfs_trees(), st.sampled_from([1, 2]))
@example([-1, 0, 1, 1, 3, -1, 5, 5], 1)
@example([-1, 0, -1, 2, -1, 4], 1)  # packed, one length: one view, outputs in order
@example([-1, 0, 1, 1, -1, 4, 5, 5], 2)  # two prompts, two branches each: strided view
def test_tree_attention_matches_root_path_attention(parent: list[int], rep: int) -> None:
    torch.manual_seed(len(parent))
    n, hkv, d = len(parent), 2, 8
    q = torch.randn(1, hkv * rep, n, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, hkv, n, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, hkv, n, d, dtype=torch.float64, requires_grad=True)
    plan = plan_tree(np.array(parent), _depth(parent))
    got, _ = tree_attention(_Module(), q, k, v, None, scaling=0.3, lightning_tree=plan)
    kr, vr = k[0].repeat_interleave(rep, 0), v[0].repeat_interleave(rep, 0)
    want = reference.tree_attention(q[0], kr, vr, parent, 0.3)[None]
    torch.testing.assert_close(got, want)
    # Gradients reach every node's keys and values from all its descendants.
    g = torch.randn_like(want)
    grads = torch.autograd.grad((got * g).sum(), (q, k, v))
    wants = torch.autograd.grad((want * g).sum(), (q, k, v))
    for a, b in zip(grads, wants, strict=True):
        torch.testing.assert_close(a, b)


def test_even_roots_are_viewed_not_gathered() -> None:
    # Packed sequences of one length: one bucket viewed in place, no reorder.
    packed = plan_tree(np.array([-1, 0, 1, -1, 3, 4]), np.array([0, 1, 2, 0, 1, 2]))
    assert [b.span for b in packed.buckets] == [(0, 2, 3, 3)] and packed.in_order
    # Two prompts of 2 nodes with two 1-node branches each (stride 4): the
    # prompts are a strided view; the branches are gathered.
    parent = [-1, 0, 1, 1, -1, 4, 5, 5]
    tree = plan_tree(np.array(parent), _depth(parent))
    assert sorted(str(b.span) for b in tree.buckets) == ["(0, 2, 4, 2)", "None"]
    assert not tree.in_order


def test_segments_split_at_branches() -> None:
    starts, ends, parent_seg = segments(np.array([-1, 0, 1, 1, 3, -1, 5, 5]))
    assert starts.tolist() == [0, 2, 3, 5, 6, 7]
    assert ends.tolist() == [2, 3, 5, 6, 7, 8]
    assert parent_seg.tolist() == [-1, 0, 0, -1, 3, 3]
    with pytest.raises(ValueError, match="after their parent"):
        segments(np.array([1, -1]))


def test_to_device_keeps_every_tensor_in_place() -> None:
    # One copy per dtype, split back into views: shapes, dtypes, None and order
    # survive (values too, where a second device exists: LIGHTNING_TEST_DEVICE).
    tensors = [
        torch.arange(6).reshape(2, 3),
        None,
        torch.tensor([[True, False], [False, True]])[None],
        torch.arange(4, dtype=torch.int32),
        torch.arange(5),
        torch.zeros(0, dtype=torch.bool),
    ]
    target = DEVICE if DEVICE.type != "cpu" else torch.device("meta")
    moved = to_device(tensors, target)
    assert moved[1] is None
    for t, m in zip(tensors, moved, strict=True):
        if t is not None:
            assert m is not None and m.device.type == target.type
            assert (m.shape, m.dtype) == (t.shape, t.dtype)
            if target.type != "meta":
                assert torch.equal(m.cpu(), t)
    same = to_device(tensors, "cpu")
    assert all(a is b for a, b in zip(same, tensors, strict=True))
