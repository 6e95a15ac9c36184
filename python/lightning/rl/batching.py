"""Micro-batches by token budget: padded, packed and tree-packed forward passes.

Every mode computes the same thing — the log-probability of each trained token
of each sequence — and differs only in how the forward pass is laid out:

- ``padded``: one row per sequence, right-padded, HF's 2-D attention mask.
- ``packed``: sequences concatenated into one row, position ids restarting at
  0 per sequence; attention runs per sequence (:mod:`lightning.rl.attention`, no
  ``[N, N]`` mask), so no padding is computed anywhere.
- ``tree``: the sequences are located in a Rust ``PackedTree`` (the merge's
  ``packed(across_rollouts=True)``, or :func:`lightning.pack_sequences`) and
  every tree node is computed once, with position id = depth and attention
  along each node's root path (segment-batched SDPA, :mod:`lightning.rl.attention`).
  Shared prefixes — the earlier turns of a multi-turn rollout, the prompt of a
  GRPO group — cost one forward token instead of one per sequence.

A *target* is one trained token: position ``t >= 1`` of a sequence, predicted
by the logits at the position before it (in a tree: at the node's parent).
Targets carry a step-global ``target_id`` so per-token data (advantages, old
and reference log-probabilities) lives in flat step-wide tensors.
Only the rows that predict a target are projected onto the vocabulary, in
chunks that stay in cache (:func:`target_logprobs`): the ``[K, V]`` logits are
never materialised, which on a large vocabulary is most of the step.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, get_args

import numpy as np
import torch
from torch.distributed.fsdp import FSDPModule

from lightning.modes import BatchMode
from lightning.rl.attention import TreePlan, plan_tree, segments, to_device, use_tree_attention
from lightning.rl.losses import entropy_from_logits

_T = TypeVar("_T")

BATCH_MODES: tuple[str, ...] = get_args(BatchMode)

__all__ = [
    "BATCH_MODES",
    "BatchMode",
    "MicroBatch",
    "SeqItem",
    "forward_logprobs",
    "kept_hidden",
    "micro_batches",
    "packed_batches",
    "padded_batches",
    "seq_items",
    "target_logprobs",
    "tree_batch",
    "tree_batches",
]


@dataclass(frozen=True)
class SeqItem:
    """One training sequence: ``tokens`` ``[L]`` int64, trained ``positions``
    ``[K]`` (each >= 1) and their step-global ``target_ids`` ``[K]``."""

    tokens: np.ndarray
    positions: np.ndarray
    target_ids: np.ndarray


@dataclass
class MicroBatch:
    """Model inputs plus where each target's logits row lands in the output."""

    input_ids: torch.Tensor  # [B, L] long
    position_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor | None  # [B, L] (padded) | None (packed, tree: see ``tree``)
    # [R] long, sorted: the kept rows of the flattened [B * L] positions. An
    # index, not a [B, L] mask: selecting rows by a mask on a GPU waits for the
    # device to count them (a host sync per micro-batch).
    keep: torch.Tensor
    gather: torch.Tensor  # [K] long: row of the kept logits that predicts each target
    target_tokens: torch.Tensor  # [K] long
    target_ids: torch.Tensor  # [K] long, step-global
    forward_tokens: int  # real (non-pad) positions computed
    n_sequences: int = 1
    tree: TreePlan | None = None  # attention plan of a packed / tree row
    extras: dict[str, Any] = field(default_factory=dict)

    def to(self, device: torch.device | str) -> MicroBatch:
        ids, pos, mask, keep, gather, tokens, target_ids = to_device(
            [
                self.input_ids,
                self.position_ids,
                self.attention_mask,
                self.keep,
                self.gather,
                self.target_tokens,
                self.target_ids,
            ],
            device,
        )
        return MicroBatch(
            input_ids=ids,  # type: ignore[arg-type]
            position_ids=pos,  # type: ignore[arg-type]
            attention_mask=mask,
            keep=keep,  # type: ignore[arg-type]
            gather=gather,  # type: ignore[arg-type]
            target_tokens=tokens,  # type: ignore[arg-type]
            target_ids=target_ids,  # type: ignore[arg-type]
            forward_tokens=self.forward_tokens,
            n_sequences=self.n_sequences,
            tree=None if self.tree is None else self.tree.to(device),
            extras=self.extras,
        )


def _chunks(items: Sequence[SeqItem], budget: int, cost: Any) -> Iterable[list[SeqItem]]:
    """Greedy in-order split; ``cost(chunk)`` is the forward size of a chunk.
    A single item larger than the budget gets a micro-batch of its own."""
    current: list[SeqItem] = []
    for item in items:
        if current and cost([*current, item]) > budget:
            yield current
            current = []
        current.append(item)
    if current:
        yield current


def _check(items: Sequence[SeqItem], budget: int) -> None:
    if budget <= 0:
        raise ValueError(f"micro-batch token budget must be > 0, got {budget}")
    for item in items:
        if len(item.positions) and int(np.min(item.positions)) < 1:
            raise ValueError("a trained position must be >= 1 (position 0 has no logits before it)")


def seq_items(samples: Sequence[Any]) -> list[SeqItem]:
    """One :class:`SeqItem` per merged sample (``tokens``, ``weights``): trained
    positions are those with weight > 0 (position 0 cannot be trained: nothing
    predicts it); target ids run consecutively over the samples."""
    items, tid = [], 0
    for s in samples:
        tokens = np.asarray(s.tokens).astype(np.int64)
        pos = np.nonzero(np.asarray(s.weights) > 0)[0]
        pos = pos[pos >= 1]
        items.append(SeqItem(tokens, pos, np.arange(tid, tid + len(pos))))
        tid += len(pos)
    return items


def padded_batches(items: Sequence[SeqItem], budget: int) -> list[MicroBatch]:
    """Right-padded rows; ``rows × longest`` stays within ``budget`` tokens."""
    _check(items, budget)
    out = []
    cost = lambda c: len(c) * max(len(i.tokens) for i in c)  # noqa: E731
    for chunk in _chunks(items, budget, cost):
        width = max(len(i.tokens) for i in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        keep = torch.zeros(len(chunk), width, dtype=torch.bool)
        for b, item in enumerate(chunk):
            ids[b, : len(item.tokens)] = torch.from_numpy(item.tokens.astype(np.int64))
            mask[b, : len(item.tokens)] = 1
            keep[b, torch.from_numpy(item.positions.astype(np.int64) - 1)] = True
        # Kept rows come out flattened in row-major order: rank of each (b, t-1).
        rank = keep.reshape(-1).long().cumsum(0) - 1  # [B*W]
        gather = torch.cat(
            [
                rank[b * width + torch.from_numpy(i.positions.astype(np.int64) - 1)]
                for b, i in enumerate(chunk)
            ]
        )
        out.append(
            MicroBatch(
                input_ids=ids,
                position_ids=torch.arange(width).expand(len(chunk), width).clone(),
                attention_mask=mask,
                keep=keep.reshape(-1).nonzero()[:, 0],
                gather=gather,
                target_tokens=torch.cat([_target_tokens(i) for i in chunk]),
                target_ids=torch.cat(
                    [torch.from_numpy(i.target_ids.astype(np.int64)) for i in chunk]
                ),
                forward_tokens=sum(len(i.tokens) for i in chunk),
                n_sequences=len(chunk),
            )
        )
    return out


def _target_tokens(item: SeqItem) -> torch.Tensor:
    return torch.from_numpy(item.tokens[item.positions].astype(np.int64))


def _one_row(
    tokens: np.ndarray,
    positions: np.ndarray,
    predict_rows: np.ndarray,
    target_tokens: np.ndarray,
    target_ids: np.ndarray,
    tree: TreePlan,
    n_sequences: int,
) -> MicroBatch:
    keep, gather = np.unique(predict_rows, return_inverse=True)
    return MicroBatch(
        input_ids=torch.from_numpy(tokens.astype(np.int64))[None],
        position_ids=torch.from_numpy(positions.astype(np.int64))[None],
        attention_mask=None,
        keep=torch.from_numpy(keep.astype(np.int64)),
        gather=torch.from_numpy(gather.reshape(-1).astype(np.int64)),
        target_tokens=torch.from_numpy(target_tokens.astype(np.int64)),
        target_ids=torch.from_numpy(target_ids.astype(np.int64)),
        forward_tokens=len(tokens),
        n_sequences=n_sequences,
        tree=tree,
    )


def packed_batches(items: Sequence[SeqItem], budget: int) -> list[MicroBatch]:
    """Sequences concatenated into one row of at most ``budget`` tokens."""
    _check(items, budget)
    out = []
    cost = lambda c: sum(len(i.tokens) for i in c)  # noqa: E731
    for chunk in _chunks(items, budget, cost):
        starts = np.cumsum([0] + [len(i.tokens) for i in chunk])[:-1]
        positions = np.concatenate([np.arange(len(i.tokens)) for i in chunk])
        parent = np.where(positions > 0, np.arange(len(positions)) - 1, -1)
        out.append(
            _one_row(
                tokens=np.concatenate([i.tokens for i in chunk]),
                positions=positions,
                predict_rows=np.concatenate(
                    [s + i.positions - 1 for s, i in zip(starts, chunk, strict=True)]
                ),
                target_tokens=np.concatenate([i.tokens[i.positions] for i in chunk]),
                target_ids=np.concatenate([i.target_ids for i in chunk]),
                tree=plan_tree(parent, positions),
                n_sequences=len(chunk),
            )
        )
    return out


def _segment_chains(parent: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Segments of a DFS-ordered tree (see :func:`lightning.rl.attention.segments`)
    and the segment of each node."""
    starts, ends, parent_seg = segments(parent)
    seg_of = np.repeat(np.arange(len(starts)), ends - starts)
    return starts, ends, parent_seg, seg_of


def _tree_micro_batch(
    packed: Any, nodes: np.ndarray, chunk: Sequence[SeqItem], paths: Sequence[np.ndarray]
) -> MicroBatch:
    """One micro-batch computing the packed tree's ``nodes`` (sorted, closed
    under parents): position id = depth, attention along each root path."""
    parent = np.asarray(packed.parent, dtype=np.int64)[nodes]
    local_parent = np.where(parent >= 0, np.searchsorted(nodes, parent), -1)
    depth = np.asarray(packed.depth, dtype=np.int64)[nodes]
    # The node at position t is predicted by the node at position t-1.
    predict = np.searchsorted(
        nodes, np.concatenate([p[i.positions - 1] for p, i in zip(paths, chunk, strict=True)])
    )
    return _one_row(
        tokens=np.asarray(packed.tokens, dtype=np.int64)[nodes],
        positions=depth,
        predict_rows=predict,
        target_tokens=np.concatenate([i.tokens[i.positions] for i in chunk]),
        target_ids=np.concatenate([i.target_ids for i in chunk]),
        tree=plan_tree(local_parent, depth),
        n_sequences=len(chunk),
    )


def tree_batches(items: Sequence[SeqItem], budget: int, packed: Any = None) -> list[MicroBatch]:
    """Micro-batches of at most ``budget`` tree nodes over a Rust ``PackedTree``
    (``MergeResult.packed(across_rollouts=True)``; by default
    :func:`lightning.pack_sequences` of the items). Every item is located in
    the tree and brings its root path; a micro-batch computes each node once.
    Put items that share prefixes next to each other."""
    _check(items, budget)
    if packed is None:
        from lightning import pack_sequences

        packed = pack_sequences([i.tokens.astype(np.uint32) for i in items])
    starts, ends, parent_seg, seg_of = _segment_chains(np.asarray(packed.parent, np.int64))
    sizes = ends - starts
    out: list[MicroBatch] = []
    chunk: list[SeqItem] = []
    paths: list[np.ndarray] = []
    taken: set[int] = set()
    count = 0
    for item in items:
        path = np.asarray(packed.locate(item.tokens.astype(np.uint32)), dtype=np.int64)
        chain = []
        s = int(seg_of[path[-1]]) if len(path) else -1
        while s >= 0:
            chain.append(s)
            s = int(parent_seg[s])
        new = [c for c in chain if c not in taken]
        extra = int(sizes[new].sum()) if new else 0
        if chunk and count + extra > budget:
            out.append(_finish_tree(packed, starts, ends, taken, chunk, paths))
            chunk, paths, taken, count = [], [], set(), 0
            new, extra = chain, int(sizes[chain].sum()) if chain else 0
        chunk.append(item)
        paths.append(path)
        taken.update(new)
        count += extra
    if chunk:
        out.append(_finish_tree(packed, starts, ends, taken, chunk, paths))
    return out


def _finish_tree(
    packed: Any,
    starts: np.ndarray,
    ends: np.ndarray,
    taken: set[int],
    chunk: Sequence[SeqItem],
    paths: Sequence[np.ndarray],
) -> MicroBatch:
    segs = sorted(taken)
    nodes = np.concatenate([np.arange(starts[s], ends[s]) for s in segs])
    return _tree_micro_batch(packed, nodes, chunk, paths)


def tree_batch(packed: Any, items: Sequence[SeqItem]) -> MicroBatch:
    """One micro-batch holding every item, laid out on ``packed``."""
    return tree_batches(items, 1 << 62, packed)[0] if items else _empty()


def _empty() -> MicroBatch:
    return _one_row(
        *(np.zeros(0, np.int64),) * 5, tree=plan_tree(np.zeros(0), np.zeros(0)), n_sequences=0
    )


def micro_batches(
    items: Sequence[SeqItem], budget: int, *, mode: BatchMode, packed: Any = None
) -> list[MicroBatch]:
    """Dispatch to the batching ``mode`` (``padded``, ``packed`` or ``tree``);
    ``packed`` is the Rust ``PackedTree`` the tree mode lays items out on."""
    if mode == "padded":
        return padded_batches(items, budget)
    if mode == "packed":
        return packed_batches(items, budget)
    if mode == "tree":
        return tree_batches(items, budget, packed)
    raise ValueError(f"unknown batching mode {mode!r}; use one of {BATCH_MODES}")


# Rows of logits per chunk: about 8M floats, so a chunk's logits stay in cache.
_CHUNK_ELEMENTS = 1 << 23
# Up to this many [R, V] elements (1 GiB of float32) the softmax is kept for
# the backward pass (three matmuls per step); beyond it each chunk's logits are
# recomputed (four matmuls, no [R, V] buffer).
_KEEP_SOFTMAX_ELEMENTS = 1 << 28


class _KeptBuffer:
    """One float32 buffer for the kept softmax, reused from micro-batch to
    micro-batch on the CPU. Each fresh ``[R, V]`` tensor there is new pages the
    kernel zero-fills as they are first written: about a fifth of the head's
    forward + backward CPU time on the tiny model. (CUDA's caching allocator
    already reuses memory, so other devices allocate as before.)

    One forward holds the buffer at a time; a second one gets a fresh tensor.
    The holder's backward pass gives it back once it has read it, or, when the
    forward's graph is dropped without a backward pass, its finaliser does. The
    buffer stays allocated between steps: at most ``_KEEP_SOFTMAX_ELEMENTS``
    floats (1 GiB), the size of one micro-batch's kept softmax at its peak."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffer: torch.Tensor | None = None
        self._holder: object | None = None

    def take(self, n: int, device: torch.device) -> tuple[torch.Tensor, object | None]:
        """``n`` floats, and the token that gives them back (None: not pooled)."""
        if device.type == "cpu":
            with self._lock:
                if self._holder is None:
                    if self._buffer is None or self._buffer.numel() < n:
                        self._buffer = None  # free the smaller one first
                        self._buffer = torch.empty(n, dtype=torch.float32)
                    self._holder = object()
                    return self._buffer[:n], self._holder
        return torch.empty(n, dtype=torch.float32, device=device), None

    def give(self, token: object | None) -> None:
        with self._lock:
            if token is not None and self._holder is token:
                self._holder = None

    def held(self) -> bool:
        return self._holder is not None


_KEPT = _KeptBuffer()


class _TargetLogprob(torch.autograd.Function):
    """``log softmax(h W^T + b)[row, token]`` per target, computed chunk by
    chunk over rows, with the row entropies (detached). The gradient with
    respect to the logits is ``g·(onehot − softmax)``, summed over the targets
    of a row; the softmax (unnormalised) is kept from the forward pass when it fits in
    ``_KEEP_SOFTMAX_ELEMENTS``, else recomputed per chunk."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        h: torch.Tensor,  # [R, H]
        weight: torch.Tensor,  # [V, H]
        bias: torch.Tensor | None,  # [V]
        rows: torch.Tensor,  # [K] long, sorted
        tokens: torch.Tensor,  # [K] long
        inv_temp: float,
        want_entropy: bool,
        for_backward: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        r, v = h.shape[0], weight.shape[0]
        step = max(1, _CHUNK_ELEMENTS // max(v, 1))
        # Chunk c's targets are rows[bounds[c]:bounds[c + 1]]: read to the host
        # once, not twice per chunk (each read waits for the GPU to drain).
        bounds = torch.searchsorted(
            rows, torch.arange(0, r + step, step, device=rows.device)
        ).tolist()
        lse = torch.empty(r, dtype=torch.float32, device=h.device)
        ent = torch.empty(r if want_entropy else 0, dtype=torch.float32, device=h.device)
        logp = torch.empty(rows.shape[0], dtype=torch.float32, device=h.device)
        # Without a backward pass to come (old or reference log-probabilities,
        # computed under no_grad) nothing is kept.
        keep = for_backward and r * v <= _KEEP_SOFTMAX_ELEMENTS
        # Kept: exp(logits - row max), unnormalised, and 1 / its row sum; the
        # backward pass folds the normalisation into its per-row scale. One exp
        # and five passes over each [c, V] chunk (logsumexp, then a normalised
        # softmax copied into place, took two exps and eleven).
        ctx.kept_token = None
        if keep:
            flat, ctx.kept_token = _KEPT.take(r * v, h.device)
            if ctx.kept_token is not None:
                weakref.finalize(ctx, _KEPT.give, ctx.kept_token)
            probs = flat.view(r, v)
        else:
            probs = torch.empty((0, 0), dtype=torch.float32, device=h.device)
        inv_sum = torch.empty(r if keep else 0, dtype=torch.float32, device=h.device)
        for c, a in enumerate(range(0, r, step)):
            logits = _chunk_logits(h[a : a + step], weight, bias, inv_temp)  # [c, V]
            top = logits.amax(dim=-1, keepdim=True)
            shifted = logits.sub_(top)  # <= 0: exp never overflows
            z = torch.exp(shifted, out=probs[a : a + step]) if keep else shifted.exp()
            total = z.sum(dim=-1)
            log_total = total.log()
            lse[a : a + step] = top[:, 0] + log_total
            lo, hi = bounds[c], bounds[c + 1]
            local = rows[lo:hi] - a
            logp[lo:hi] = shifted[local, tokens[lo:hi]] - log_total[local]
            if want_entropy:
                # H = lse - sum(p * logits) = log_total - sum(z * shifted) / total
                ent[a : a + step] = log_total - (z * shifted).sum(dim=-1) / total
            if keep:
                inv_sum[a : a + step] = total.reciprocal()
        ctx.save_for_backward(h, weight, bias, rows, tokens, lse, probs, inv_sum)
        ctx.step, ctx.inv_temp, ctx.keep, ctx.bounds = step, inv_temp, keep, bounds
        # Autograd runs backward outside the caller's autocast: re-enter it there,
        # as autocast's own matmuls are differentiated, or the head's three
        # backward GEMMs run in float32 (a quarter of a smollm2-sized GPU step).
        dev = h.device.type
        ctx.amp = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, _: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        amp = (
            torch.autocast(ctx.saved_tensors[0].device.type, dtype=ctx.amp)
            if ctx.amp is not None
            else contextlib.nullcontext()
        )
        with amp:
            return _TargetLogprob._backward(ctx, g)

    @staticmethod
    def _backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        h, weight, bias, rows, tokens, lse, probs, inv_sum = ctx.saved_tensors
        bounds = ctx.bounds
        g = g.float()
        row_g = torch.zeros(h.shape[0], dtype=torch.float32, device=h.device).index_add_(0, rows, g)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if ctx.keep:
            if ctx.keep == "used":
                raise RuntimeError("target_logprobs supports one backward pass per forward")
            ctx.keep = "used"
            # The kept exp, normalised and scaled in one pass, becomes d loss / d logits.
            d = probs.mul_((-row_g * inv_sum)[:, None])
            d.index_put_((rows, tokens), g, accumulate=True)
            if ctx.inv_temp != 1.0:
                d.mul_(ctx.inv_temp)  # [R, V]
            gh = (d.to(weight.dtype) @ weight).to(h.dtype) if need_h else None
            gw = (d.T @ h.float()).to(weight.dtype) if need_w else None
            gb = d.sum(0).to(bias.dtype) if (need_b and bias is not None) else None
            del d
            _KEPT.give(ctx.kept_token)  # read for the last time above
            return gh, gw, gb, None, None, None, None, None
        step, inv_temp = ctx.step, ctx.inv_temp
        gh = torch.empty_like(h) if need_h else None
        gw = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        gb = torch.zeros_like(bias, dtype=torch.float32) if (need_b and bias is not None) else None
        for c, a in enumerate(range(0, h.shape[0], step)):
            hc = h[a : a + step]
            logits = _chunk_logits(hc, weight, bias, inv_temp)
            d = logits.sub_(lse[a : a + step, None]).exp_().mul_(-row_g[a : a + step, None])
            lo, hi = bounds[c], bounds[c + 1]
            d.index_put_((rows[lo:hi] - a, tokens[lo:hi]), g[lo:hi], accumulate=True)
            if inv_temp != 1.0:
                d.mul_(inv_temp)  # [c, V]: d loss / d (h W^T + b)
            if gh is not None:
                gh[a : a + step] = (d.to(weight.dtype) @ weight).to(h.dtype)
            if gw is not None:
                gw += d.T @ hc.float()  # not addmm_: in-place ops bypass autocast
            if gb is not None:
                gb += d.sum(0)
        return (
            gh,
            gw.to(weight.dtype) if gw is not None else None,
            gb.to(bias.dtype) if gb is not None else None,
            None,
            None,
            None,
            None,
            None,
        )


def _chunk_logits(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, inv_temp: float
) -> torch.Tensor:
    logits = (h.to(weight.dtype) @ weight.T).float()  # [c, V]
    if bias is not None:
        logits += bias.float()
    if inv_temp != 1.0:
        logits *= inv_temp
    return logits


def target_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(head(hidden[rows]) / T)[tokens]`` ``[K]`` (float32) without
    materialising the ``[K, V]`` logits, and the detached entropy of each
    target's distribution ``[K]`` when asked."""
    order = torch.argsort(rows, stable=True)
    for_backward = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
    logp_sorted, ent_rows = _TargetLogprob.apply(
        hidden,
        head.weight,
        head.bias,
        rows[order],
        tokens[order],
        1.0 / temperature,
        entropy,
        for_backward,
    )
    logp = torch.empty_like(logp_sorted).index_copy(0, order, logp_sorted)
    return logp, (ent_rows[rows] if entropy else None)


def _causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face causal LM inside DDP / PEFT wrappers."""
    inner = getattr(model, "module", model)  # DDP
    get_base = getattr(inner, "get_base_model", None)  # PEFT
    return get_base() if callable(get_base) else inner


def _fused_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """(decoder, lm_head) when the head is a plain linear layer we can fuse
    (under FSDP2 too, through :func:`_as_root_forward`)."""
    lm = _causal_lm(model)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    if type(head) is not torch.nn.Linear or decoder is None or decoder is lm:
        return None
    if getattr(lm.config, "final_logit_softcapping", None):
        return None
    return decoder, head


def _as_root_forward(lm: torch.nn.Module, fn: Callable[[], _T]) -> _T:
    """``fn()`` run as ``lm``'s own forward, through ``lm.__call__``.

    Why: under FSDP2 the root unit's parameters (embeddings, final norm, the LM
    head, tied or not) are gathered by hooks on the root's call and are DTensor
    shards outside it. The fused head calls the decoder and reads the head's weight
    itself, so it runs inside that call: the pre-forward hook gathers them (cast to
    the compute dtype), the post-forward hook registers the backward hooks on what
    ``fn`` returns, and the backward reduce-scatters their gradients as after the
    model's own forward. The decoder layers are units of their own and gather
    inside ``fn`` as usual."""
    lm.forward = fn  # an instance attribute shadows the class's forward for one call
    try:
        return lm()
    finally:
        del lm.forward


def _logits_to_keep(mb: MicroBatch) -> torch.Tensor:
    """``mb.keep`` as Hugging Face's ``logits_to_keep``: positions of the one
    row, or a ``[B, L]`` mask when there are several rows (a 1-D index would
    keep the same positions in every row)."""
    b, width = mb.input_ids.shape
    if b == 1:
        return mb.keep
    flat = torch.zeros(b * width, dtype=torch.bool, device=mb.keep.device)
    return flat.index_fill_(0, mb.keep, True).view(b, width)


def _layout_kwargs(model: torch.nn.Module, mb: MicroBatch) -> dict[str, Any]:
    """The forward's attention arguments for ``mb``'s layout: padded rows'
    mask, or (packed, tree) the tree plan, switching ``model`` to tree attention."""
    if mb.tree is None:
        return {"attention_mask": mb.attention_mask}
    use_tree_attention(model)
    # A prepared (empty) 4-D mask makes HF skip building an [N, N] mask.
    empty = torch.zeros(1, 1, 0, 0, dtype=torch.bool, device=mb.input_ids.device)
    return {"attention_mask": empty, "lightning_tree": mb.tree}


def kept_hidden(model: torch.nn.Module, decoder: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """``[R, H]``: ``model``'s ``decoder`` run on ``mb``, at the kept rows
    (the positions whose next-token distribution a target reads)."""
    hidden = decoder(
        input_ids=mb.input_ids,
        position_ids=mb.position_ids,
        use_cache=False,
        **_layout_kwargs(model, mb),
    ).last_hidden_state  # [B, L, H]
    return hidden.flatten(0, 1)[mb.keep]


def forward_logprobs(
    model: torch.nn.Module,
    mb: MicroBatch,
    *,
    entropy: bool = False,
    entropy_grad: bool = False,
    temperature: float = 1.0,
    fuse_head: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each target ``[K]`` (float32), and the entropy of the
    predicted distribution ``[K]`` when asked (detached unless ``entropy_grad``).
    ``temperature`` scales the logits first: rollouts sampled at temperature T came
    from ``softmax(logits / T)``, and that is the policy the ratio must compare.
    ``fuse_head=False`` materialises the ``[K, V]`` logits through the model's own
    forward (also used for ``entropy_grad`` and heads that are not a plain linear
    layer). Runs under whatever autocast context the caller set."""
    fused = _fused_head(model) if fuse_head and not entropy_grad else None
    if fused is not None:
        decoder, head = fused

        def fused_logprobs() -> tuple[torch.Tensor, torch.Tensor | None]:
            return target_logprobs(
                kept_hidden(model, decoder, mb),
                head,
                mb.gather,
                mb.target_tokens,
                temperature=temperature,
                entropy=entropy,
            )

        lm = _causal_lm(model)
        return (
            _as_root_forward(lm, fused_logprobs) if isinstance(lm, FSDPModule) else fused_logprobs()
        )
    out = model(
        input_ids=mb.input_ids,
        position_ids=mb.position_ids,
        logits_to_keep=_logits_to_keep(mb),
        use_cache=False,
        **_layout_kwargs(model, mb),
    )
    # Normalise each kept row once, then pick (row, token) pairs: a target
    # shares its row with others in a tree, and indexing pairs avoids copying
    # (and back-propagating through) a [K, V] gather of the logits.
    logits = out.logits.reshape(-1, out.logits.shape[-1]).float()  # [R, V]
    if temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)  # [R]
    logp = logits[mb.gather, mb.target_tokens] - logz[mb.gather]  # [K]
    ent = None
    if entropy or entropy_grad:
        ent = entropy_from_logits(logits if entropy_grad else logits.detach())[mb.gather]  # [K]
    return logp, ent
