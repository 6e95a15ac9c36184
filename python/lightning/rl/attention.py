"""Tree attention: every node of a token tree attends to its root path only,
computed per *segment* (a maximal chain of nodes without branching) with
dense, batched SDPA instead of one ``[N, N]`` ancestor mask.

Method: a packed tree in DFS order (parent before child) splits into segments;
a segment's queries attend to the keys of its root path (the ancestor segments,
then its own nodes causally). Segments of similar size are batched into one
``scaled_dot_product_attention`` call on gathered ``[B, H, L, d]`` tensors, so
attention costs what the tree really attends (a shared prefix's keys are read
by every branch, its queries and MLP are computed once) and runs on SDPA's
dense fast path. A bucket whose segments all have the same shape needs no
per-row mask (one ``[Lq, Lk]`` lower-right causal mask, or ``is_causal`` for
roots); a mixed bucket gets a boolean ``[B, 1, Lq, Lk]`` mask from depths.
Gradients reach a prefix from every branch through the gathers.

Packed sequences are the same thing with one root segment per sequence.

Hooked into Hugging Face models as the attention implementation
``"lightning"``: without a :class:`TreePlan` in the forward kwargs it is plain
SDPA (HF's own masks), so one model serves every batching layout.

Departures: sliding-window and soft-capped attention are not supported (the
plan raises for modules that declare them); attention dropout is applied per
bucket with SDPA's ``dropout_p``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["ATTN_IMPLEMENTATION", "TreePlan", "plan_tree", "to_device", "use_tree_attention"]

ATTN_IMPLEMENTATION = "lightning"
# A bucket may hold at most this much padding (in query x key cells) relative
# to what its segments really attend, before a new bucket starts.
_PAD_SLACK = 1.5


@dataclass(frozen=True)
class _Bucket:
    q_index: torch.Tensor  # [B, Lq] long: node of each query slot (padding: any node)
    k_index: torch.Tensor  # [B, Lk] long: node of each key slot, root path in depth order
    mask: torch.Tensor | None  # [B or 1, 1, Lq, Lk] bool, or None for plain causal (Lq == Lk)
    # (first node, rows, stride, length) when the bucket is B whole root
    # segments of one length, each `stride` nodes after the last: its queries,
    # keys and values are then a strided view of the row, no gather (and no
    # scatter in the backward pass). The index tensors are empty then.
    span: tuple[int, int, int, int] | None = None


@dataclass(frozen=True)
class TreePlan:
    """Index tensors that run :func:`tree_attention` on one packed tree."""

    buckets: tuple[_Bucket, ...]
    order: torch.Tensor  # [N] long: where node i's output sits in the bucket outputs
    # The bucket outputs are already in node order (`order` is 0..N-1): packed
    # sequences of one length.
    in_order: bool = False

    def to(self, device: torch.device | str) -> TreePlan:
        fields = [t for b in self.buckets for t in (b.q_index, b.k_index, b.mask)]
        moved = iter(to_device([*fields, self.order], device))
        buckets = tuple(
            _Bucket(next(moved), next(moved), next(moved), b.span)  # type: ignore[arg-type]
            for b in self.buckets
        )
        return TreePlan(buckets, next(moved), self.in_order)  # type: ignore[arg-type]


def to_device(
    tensors: Sequence[torch.Tensor | None], device: torch.device | str
) -> list[torch.Tensor | None]:
    """``[t.to(device) for t in tensors]`` (``None`` stays ``None``) in one copy
    per dtype. A plan has up to three small index tensors per bucket, and on a GPU
    each copy from pageable host memory waits for the stream to drain: one
    flat copy per dtype, split into views there, keeps the GPU fed."""
    device = torch.device(device)
    out: list[torch.Tensor | None] = list(tensors)
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        if t is not None and t.device != device:
            groups.setdefault(t.dtype, []).append(i)
    for dtype, idx in groups.items():
        # bool has no cat-able byte view on every backend; uint8 has.
        raw = torch.uint8 if dtype == torch.bool else dtype
        flat = torch.cat([tensors[i].reshape(-1).view(raw) for i in idx])  # type: ignore[union-attr]
        moved = flat.to(device).split([tensors[i].numel() for i in idx])  # type: ignore[union-attr]
        for i, m in zip(idx, moved, strict=True):
            out[i] = m.view(dtype).view(tensors[i].shape)  # type: ignore[union-attr]
    return out


def segments(parent: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(start, end, parent_segment)`` of each segment of a DFS-ordered tree.

    A node starts a segment when it is a root, when its parent is not the node
    just before it, or when its parent has more than one child; so a segment's
    parent node is always the last node of the parent segment."""
    n = len(parent)
    if n == 0:
        return (np.zeros(0, np.int64),) * 2 + (np.zeros(0, np.int64),)  # type: ignore[return-value]
    idx = np.arange(n)
    if (parent >= idx).any():
        raise ValueError("tree nodes must come after their parent (DFS order)")
    children = np.bincount(parent[parent >= 0], minlength=n)
    start = (parent < 0) | (parent != idx - 1)
    start[1:] |= children[parent[1:].clip(min=0)] > 1
    starts = np.flatnonzero(start)
    ends = np.append(starts[1:], n)
    seg_of = np.cumsum(start) - 1  # [N] segment of each node
    p = parent[starts]
    parent_seg = np.where(p >= 0, seg_of[p.clip(min=0)], -1)
    return starts, ends, parent_seg


def plan_tree(parent: np.ndarray, depth: np.ndarray) -> TreePlan:
    """Plan tree attention for nodes in DFS order (``parent`` -1 at roots,
    ``depth`` = position id)."""
    parent = np.asarray(parent, dtype=np.int64)
    depth = np.asarray(depth, dtype=np.int64)
    starts, ends, parent_seg = segments(parent)
    # Root path of each segment: ancestors' nodes, then its own (depth order).
    paths: list[np.ndarray] = []
    for s, (a, b) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
        own = np.arange(a, b)
        ps = int(parent_seg[s])
        paths.append(own if ps < 0 else np.concatenate([paths[ps], own]))
    lq = ends - starts
    lk = np.array([len(p) for p in paths], dtype=np.int64)
    buckets, placed = [], np.empty(len(parent), dtype=np.int64)
    offset = 0
    for members in _bucket(lq, lk):
        members = members[np.argsort(starts[members], kind="stable")]  # node order: views
        span = _span(members, starts, lq, lk, parent_seg, len(parent))
        if span is not None:
            empty = torch.zeros(0, dtype=torch.long)
            bucket = _Bucket(empty, empty, None, span)
        else:
            bucket = _make_bucket(members, starts, lq, lk, paths, depth)
        slots = _slots(members, starts, lq)
        placed[slots[:, 0]] = offset + slots[:, 1]
        offset += len(members) * int(lq[members].max())
        buckets.append(bucket)
    # No padding slots and every node at its own index: the outputs need no reorder.
    in_order = offset == len(parent) and bool((placed == np.arange(len(parent))).all())
    return TreePlan(tuple(buckets), torch.from_numpy(placed), in_order)


def _span(
    members: np.ndarray,
    starts: np.ndarray,
    lq: np.ndarray,
    lk: np.ndarray,
    parent_seg: np.ndarray,
    n: int,
) -> tuple[int, int, int, int] | None:
    """``(first node, rows, stride, length)`` when the bucket's segments (in
    node order) are whole roots of one length at evenly spaced starts whose
    strided window fits in the row; ``None`` otherwise."""
    length = int(lq[members[0]])
    if (parent_seg[members] >= 0).any() or (lq[members] != length).any():
        return None
    if (lk[members] != length).any():
        return None
    first, rows = int(starts[members[0]]), len(members)
    steps = np.diff(starts[members])
    stride = int(steps[0]) if rows > 1 else length
    if rows > 1 and (steps != stride).any():
        return None
    if stride < length or first + rows * stride > n:
        return None
    return first, rows, stride, length


def _bucket(lq: np.ndarray, lk: np.ndarray) -> list[np.ndarray]:
    """Group segments by size (sorted by key length, then query length) while
    the padded area stays within ``_PAD_SLACK`` of the real one."""
    order = np.lexsort((lq, lk))[::-1]
    out: list[np.ndarray] = []
    cur: list[int] = []
    real = 0
    for s in order.tolist():
        cells = int(lq[s] * lk[s])
        if cur:
            n = len(cur) + 1
            padded = n * max(int(lq[cur].max()), int(lq[s])) * max(int(lk[cur].max()), int(lk[s]))
            if padded > _PAD_SLACK * (real + cells):
                out.append(np.array(cur))
                cur, real = [], 0
        cur.append(s)
        real += cells
    if cur:
        out.append(np.array(cur))
    return out


def _make_bucket(
    members: np.ndarray,
    starts: np.ndarray,
    lq: np.ndarray,
    lk: np.ndarray,
    paths: Sequence[np.ndarray],
    depth: np.ndarray,
) -> _Bucket:
    b, mq, mk = len(members), int(lq[members].max()), int(lk[members].max())
    q_index = np.zeros((b, mq), dtype=np.int64)
    k_index = np.zeros((b, mk), dtype=np.int64)
    q_depth = np.zeros((b, mq), dtype=np.int64)  # padding queries see key 0 only
    for row, s in enumerate(members.tolist()):
        n, a = int(lq[s]), int(starts[s])
        q_index[row, :n] = np.arange(a, a + n)
        k_index[row, : lk[s]] = paths[s]
        # Key slot j holds the path node at depth (first depth of the path) + j.
        q_depth[row, :n] = depth[a : a + n] - depth[paths[s][0]]
    uniform = bool((lq[members] == mq).all() and (lk[members] == mk).all())
    mask: torch.Tensor | None
    if uniform and mq == mk:
        mask = None  # every row is a whole root segment: plain causal
    elif uniform:
        mask = torch.from_numpy(np.arange(mk)[None, :] <= q_depth[0][:, None])[None, None]
    else:
        mask = torch.from_numpy(np.arange(mk)[None, None, :] <= q_depth[:, :, None])[:, None]
    return _Bucket(torch.from_numpy(q_index), torch.from_numpy(k_index), mask)


def _slots(members: np.ndarray, starts: np.ndarray, lq: np.ndarray) -> np.ndarray:
    """``[n, 2]``: each node of the bucket's segments and its slot in the
    bucket's ``[B * Lq]`` output (row ``r`` of segment ``s`` starts at ``r * Lq``)."""
    mq = int(lq[members].max())
    return np.concatenate(
        [
            np.stack([np.arange(a, a + n), row * mq + np.arange(n)], axis=1)
            for row, (a, n) in enumerate(
                zip(starts[members].tolist(), lq[members].tolist(), strict=True)
            )
        ]
    )


def tree_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, N, d]
    key: torch.Tensor,  # [1, Hkv, N, d]
    value: torch.Tensor,  # [1, Hkv, N, d]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    lightning_tree: TreePlan | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """HF attention interface: tree attention with a plan, else plain SDPA."""
    if lightning_tree is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if getattr(module, "sliding_window", None) or getattr(module, "attn_logit_softcapping", None):
        raise ValueError(
            "tree/packed batching does not support sliding-window or soft-capped attention; "
            "use batching = 'padded' for this model"
        )
    if query.shape[0] != 1:
        raise ValueError("tree attention runs one packed row (batch size 1)")
    q, k, v = query[0], key[0], value[0]  # [H, N, d], [Hkv, N, d]
    rep = q.shape[0] // k.shape[0]
    outs = []
    for b in lightning_tree.buckets:
        if b.span is not None:
            qb, kb, vb = (_window(t, b.span) for t in (q, k, v))
        else:
            qb = _rows(q, b.q_index)  # [B, H, Lq, d]
            kb, vb = _rows(k, b.k_index), _rows(v, b.k_index)  # [B, Hkv, Lk, d]
        # Grouped-query heads: SDPA reads each key/value head for its query
        # heads in place when there is no mask; with a mask CUDA's fused
        # kernels would fall back to the math one, so the heads are repeated.
        gqa = rep > 1 and b.mask is None
        if rep > 1 and not gqa:
            kb, vb = kb.repeat_interleave(rep, dim=1), vb.repeat_interleave(rep, dim=1)
        ob = F.scaled_dot_product_attention(
            qb,
            kb,
            vb,
            attn_mask=b.mask,
            dropout_p=dropout if module.training else 0.0,
            is_causal=b.mask is None,
            scale=scaling,
            enable_gqa=gqa,
        )  # [B, H, Lq, d]
        outs.append(ob.transpose(1, 2).reshape(-1, *ob.shape[1:2], ob.shape[3]))  # [B*Lq, H, d]
    flat = torch.cat(outs) if len(outs) > 1 else outs[0]
    if lightning_tree.in_order:
        return flat[None], None
    # `order` names each slot at most once, so index_select's backward adds one
    # gradient into each zero: exact, in any order, on every device.
    return flat.index_select(0, lightning_tree.order)[None], None  # [1, N, H, d]


def _rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t[:, index].transpose(0, 1)``: ``[B, H, L, d]`` from ``t`` ``[H, N, d]``
    and ``index`` ``[B, L]``. The backward pass adds up the gradients of nodes
    read more than once (a prefix's keys, read by every branch). On the CPU by
    ``index_select``, whose backward ``index_add_`` took a quarter of the time
    of advanced indexing's accumulating ``index_put_`` (tiny model, tree body).
    Elsewhere by advanced indexing: on CUDA its backward sums repeated rows in
    a fixed order, where ``index_add_``'s atomics would make a step's key and
    value gradients differ from run to run."""
    if t.device.type != "cpu":
        return t[:, index].transpose(0, 1)
    picked = t.index_select(1, index.reshape(-1))  # [H, B*L, d]
    return picked.unflatten(1, tuple(index.shape)).transpose(0, 1)


def _window(t: torch.Tensor, span: tuple[int, int, int, int]) -> torch.Tensor:
    """``[B, H, L, d]`` view of ``t`` ``[H, N, d]``: B rows of L nodes, each
    ``stride`` nodes after the last (see ``_Bucket.span``)."""
    first, rows, stride, length = span
    # Narrow and slice only when they cut something: the backward pass of a
    # slice allocates a zeroed full-size gradient and copies into it, three
    # tensors a layer, while a whole row of equal sequences is a pure view.
    if first or rows * stride != t.shape[1]:
        t = t.narrow(1, first, rows * stride)
    windows = t.unflatten(1, (rows, stride))
    if stride != length:
        windows = windows[:, :, :length]
    return windows.transpose(0, 1)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, tree_attention)
    # Padded batches build HF's SDPA masks as usual; tree batches pass a
    # prepared (empty) 4-D mask so no [N, N] mask is ever built.
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)


_register()


def use_tree_attention(model: torch.nn.Module) -> None:
    """Switch a Hugging Face model (possibly wrapped by DDP or PEFT) to the
    ``"lightning"`` attention implementation; a no-op when already set."""
    inner = getattr(model, "module", model)  # DDP; PEFT forwards attribute access
    if not hasattr(inner, "set_attn_implementation"):
        raise TypeError(f"{type(model).__name__} is not a Hugging Face model")
    if getattr(inner.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        inner.set_attn_implementation(ATTN_IMPLEMENTATION)
