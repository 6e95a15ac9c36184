"""Micro-batches by token budget: padded, packed and tree-packed forward passes.

Every mode computes the same thing — the log-probability of each trained token
of each sequence — and differs only in how the forward pass is laid out:

- ``padded``: one row per sequence, right-padded, HF's 2-D attention mask.
- ``packed``: sequences concatenated into one row, position ids restarting at
  0 per sequence; transformers detects the restarts and confines attention to
  each sequence.
- ``tree``: the sequences of a micro-batch are inserted into a token prefix
  tree and every tree node is computed once, with position id = depth and an
  ancestor attention mask (SDPA with an explicit boolean mask). Shared prefixes
  — the earlier turns of a multi-turn rollout, the prompt of a GRPO group — cost
  one forward token instead of one per sequence. :func:`tree_batch` runs a
  ``PackedTree`` from the merge as it is.

A *target* is one trained token: position ``t >= 1`` of a sequence, predicted
by the logits at the position before it (in a tree: at the node's parent).
Targets carry a step-global ``target_id`` so per-token data (advantages, old
and reference log-probabilities) lives in flat step-wide tensors.
Only the logits rows that predict a target are projected onto the vocabulary
(``logits_to_keep``), which on long prompts is most of the LM-head cost saved.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, get_args

import numpy as np
import torch

from lightning.losses import entropy_from_logits
from lightning.modes import BatchMode

BATCH_MODES: tuple[str, ...] = get_args(BatchMode)

__all__ = [
    "BATCH_MODES",
    "BatchMode",
    "MicroBatch",
    "SeqItem",
    "forward_logprobs",
    "micro_batches",
    "packed_batches",
    "padded_batches",
    "seq_items",
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
    attention_mask: torch.Tensor | None  # [B, L] (padded) | [1, 1, N, N] bool (tree) | None
    keep: torch.Tensor  # logits_to_keep: [B, L] bool (padded) or [R] long (packed, tree)
    gather: torch.Tensor  # [K] long: row of the kept logits that predicts each target
    target_tokens: torch.Tensor  # [K] long
    target_ids: torch.Tensor  # [K] long, step-global
    forward_tokens: int  # real (non-pad) positions computed
    n_sequences: int = 1
    extras: dict[str, Any] = field(default_factory=dict)

    def to(self, device: torch.device | str) -> MicroBatch:
        move = lambda t: t.to(device) if t is not None else None  # noqa: E731
        return MicroBatch(
            input_ids=move(self.input_ids),
            position_ids=move(self.position_ids),
            attention_mask=move(self.attention_mask),
            keep=move(self.keep),
            gather=move(self.gather),
            target_tokens=move(self.target_tokens),
            target_ids=move(self.target_ids),
            forward_tokens=self.forward_tokens,
            n_sequences=self.n_sequences,
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
                keep=keep,
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
    attention_mask: torch.Tensor | None,
    n_sequences: int,
) -> MicroBatch:
    keep, gather = np.unique(predict_rows, return_inverse=True)
    return MicroBatch(
        input_ids=torch.from_numpy(tokens.astype(np.int64))[None],
        position_ids=torch.from_numpy(positions.astype(np.int64))[None],
        attention_mask=attention_mask,
        keep=torch.from_numpy(keep.astype(np.int64)),
        gather=torch.from_numpy(gather.reshape(-1).astype(np.int64)),
        target_tokens=torch.from_numpy(target_tokens.astype(np.int64)),
        target_ids=torch.from_numpy(target_ids.astype(np.int64)),
        forward_tokens=len(tokens),
        n_sequences=n_sequences,
    )


def packed_batches(items: Sequence[SeqItem], budget: int) -> list[MicroBatch]:
    """Sequences concatenated into one row of at most ``budget`` tokens."""
    _check(items, budget)
    out = []
    cost = lambda c: sum(len(i.tokens) for i in c)  # noqa: E731
    for chunk in _chunks(items, budget, cost):
        starts = np.cumsum([0] + [len(i.tokens) for i in chunk])[:-1]
        out.append(
            _one_row(
                tokens=np.concatenate([i.tokens for i in chunk]),
                positions=np.concatenate([np.arange(len(i.tokens)) for i in chunk]),
                predict_rows=np.concatenate(
                    [s + i.positions - 1 for s, i in zip(starts, chunk, strict=True)]
                ),
                target_tokens=np.concatenate([i.tokens[i.positions] for i in chunk]),
                target_ids=np.concatenate([i.target_ids for i in chunk]),
                attention_mask=None,
                n_sequences=len(chunk),
            )
        )
    return out


class _Trie:
    """Token prefix tree; nodes are numbered in insertion order, so a parent
    always precedes its children."""

    def __init__(self) -> None:
        self.children: dict[tuple[int, int], int] = {}
        self.token: list[int] = []
        self.parent: list[int] = []
        self.depth: list[int] = []

    def new_nodes(self, tokens: np.ndarray) -> int:
        node = -1
        for k, t in enumerate(tokens.tolist()):
            child = self.children.get((node, t))
            if child is None:
                return len(tokens) - k
            node = child
        return 0

    def insert(self, tokens: np.ndarray) -> np.ndarray:
        path = np.empty(len(tokens), dtype=np.int64)
        node = -1
        for k, t in enumerate(tokens.tolist()):
            child = self.children.get((node, t))
            if child is None:
                child = len(self.token)
                self.children[(node, t)] = child
                self.token.append(t)
                self.parent.append(node)
                self.depth.append(k)
            path[k] = node = child
        return path


def ancestor_mask(parent: np.ndarray) -> torch.Tensor:
    """``[1, 1, N, N]`` bool: node i attends to j iff j is i or an ancestor of i.
    Needs every parent index to precede its child (true of DFS order)."""
    n = len(parent)
    if n and (parent >= np.arange(n)).any():
        raise ValueError("tree nodes must come after their parent (DFS or insertion order)")
    mask = np.zeros((n, n), dtype=np.bool_)
    for i, p in enumerate(parent.tolist()):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return torch.from_numpy(mask)[None, None]


def _tree_micro_batch(
    tokens: np.ndarray,
    parent: np.ndarray,
    depth: np.ndarray,
    chunk: Sequence[SeqItem],
    paths: list[np.ndarray],
) -> MicroBatch:
    # The node of position t is predicted by the node of position t-1 (its parent).
    predict = np.concatenate([p[i.positions - 1] for p, i in zip(paths, chunk, strict=True)])
    return _one_row(
        tokens=tokens,
        positions=depth,
        predict_rows=predict,
        target_tokens=np.concatenate([i.tokens[i.positions] for i in chunk]),
        target_ids=np.concatenate([i.target_ids for i in chunk]),
        attention_mask=ancestor_mask(parent),
        n_sequences=len(chunk),
    )


def tree_batches(items: Sequence[SeqItem], budget: int) -> list[MicroBatch]:
    """Prefix-tree micro-batches of at most ``budget`` distinct nodes each.
    Put sequences that share prefixes next to each other in ``items``."""
    _check(items, budget)
    out = []
    trie, chunk = _Trie(), []
    for item in items:
        if chunk and len(trie.token) + trie.new_nodes(item.tokens) > budget:
            out.append(_finish_tree(trie, chunk))
            trie, chunk = _Trie(), []
        chunk.append(item)
        trie.insert(item.tokens)
    if chunk:
        out.append(_finish_tree(trie, chunk))
    return out


def _finish_tree(trie: _Trie, chunk: list[SeqItem]) -> MicroBatch:
    paths = [trie.insert(i.tokens) for i in chunk]  # already present: just the paths
    return _tree_micro_batch(
        np.asarray(trie.token, dtype=np.int64),
        np.asarray(trie.parent, dtype=np.int64),
        np.asarray(trie.depth, dtype=np.int64),
        chunk,
        paths,
    )


def tree_batch(packed: Any, items: Sequence[SeqItem]) -> MicroBatch:
    """One micro-batch running a merge ``PackedTree`` (``tokens``, ``parent``,
    ``depth`` in DFS order) as it is, with targets taken from ``items`` (the
    samples it was packed from): each sequence is located in the tree by
    walking it from a root, so targets do not depend on the merge's internal
    bookkeeping."""
    tokens = np.asarray(packed.tokens, dtype=np.int64)
    parent = np.asarray(packed.parent, dtype=np.int64)
    depth = np.asarray(packed.depth, dtype=np.int64)
    children = {(int(p), int(t)): i for i, (p, t) in enumerate(zip(parent, tokens, strict=True))}
    paths = []
    for item in items:
        node, path = -1, np.empty(len(item.tokens), dtype=np.int64)
        for k, t in enumerate(item.tokens.tolist()):
            found = children.get((node, t))
            if found is None:
                raise ValueError(f"sequence not in the packed tree (diverges at position {k})")
            path[k] = node = found
        paths.append(path)
    return _tree_micro_batch(tokens, parent, depth, items, paths)


def micro_batches(items: Sequence[SeqItem], budget: int, *, mode: BatchMode) -> list[MicroBatch]:
    """Dispatch to the batching ``mode`` (``padded``, ``packed`` or ``tree``)."""
    if mode == "padded":
        return padded_batches(items, budget)
    if mode == "packed":
        return packed_batches(items, budget)
    if mode == "tree":
        return tree_batches(items, budget)
    raise ValueError(f"unknown batching mode {mode!r}; use one of {BATCH_MODES}")


def forward_logprobs(
    model: torch.nn.Module,
    mb: MicroBatch,
    *,
    entropy: bool = False,
    entropy_grad: bool = False,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each target ``[K]`` (float32), and the entropy of the
    predicted distribution ``[K]`` when asked (detached unless ``entropy_grad``).
    ``temperature`` scales the logits first: rollouts sampled at temperature T came
    from ``softmax(logits / T)``, and that is the policy the ratio must compare.
    Runs under whatever autocast context the caller set."""
    out = model(
        input_ids=mb.input_ids,
        position_ids=mb.position_ids,
        attention_mask=mb.attention_mask,
        logits_to_keep=mb.keep,
        use_cache=False,
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
