"""The prefix KV cache: keys and values of token sequences the engine has already computed.

Agents resend their whole history every turn and a GRPO group samples one prompt
n times, so most prefill is repeated work. This module keeps the keys/values of
prompts (after their prefill) and of finished sequences (prompt + completion)
and tells a new request how many leading tokens it can take from here instead
of recomputing them.

**Why a radix tree over token ids, not block hashes.** vLLM hashes fixed-size
blocks because its KV already lives in a paged block pool; a hash per block is
then the natural index. This engine keeps each running row contiguous in a
right-aligned slab (``kv.py``) and copies a row in once when it joins, so blocks
would buy no memory management and would cost up to ``block - 1`` recomputed
tokens at every divergence (a turn's prompt leaves the previous completion at an
arbitrary token, a 600-token group prompt is not block-aligned). A radix tree
(edges are token runs, each node owns the keys/values of its edge) matches at
token granularity, compares ids exactly (no hash collisions to reason about),
shares common prefixes once, and costs O(prompt length) per lookup.

**Eviction** is least-recently-used over leaves: a lookup touches every node on
its path, so an inner node is never older than its leaves, and evicting leaves
first never strands a reachable suffix. The budget is in bytes of key/value
tensors (``capacity_bytes``); 0 turns the cache off.

**Weight versions.** The tree is tagged with the weight version its keys/values
were computed under. ``invalidate(version)`` (called by the engine on every
weight reload) drops everything and retags; ``insert`` refuses keys/values of
any other version and ``match`` returns nothing on a version mismatch, so a
prefix from version v is never used at v + 1.

**Threads.** Only the engine's scheduler thread calls ``match``/``insert``/
``invalidate``; ``stats()`` may be read from any thread (plain int reads).

Exactness: a prefix's keys/values depend only on its own tokens (causal
attention), so reusing them changes a later forward only by float summation
order (the prefix was computed in a forward of a different length), the same
order of difference as batching; the engine's |Δ logprob| ≤ 1e-4 contract holds
(tests/engine/test_engine_prefix.py checks it against the no-cache path and a plain
forward).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Per layer: (keys [H, n, D], values [H, n, D]) for n tokens.
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(eq=False)
class Node:
    """An edge of token ids and the keys/values of those tokens, per layer."""

    tokens: list[int]
    kv: LayerKV
    parent: Node | None
    children: dict[int, Node] = field(default_factory=dict)
    last_used: int = 0

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv)


@dataclass
class Match:
    """The longest cached prefix of a prompt: ``length`` tokens in ``segments``."""

    length: int
    # (node, how many of its edge tokens are used), root to leaf.
    segments: list[tuple[Node, int]]

    def copy_into(self, buffers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write the matched keys/values into columns [0, length) of per-layer
        buffers shaped [H, capacity, D]."""
        pos = 0
        for node, used in self.segments:
            for (bk, bv), (k, v) in zip(buffers, node.kv, strict=True):
                bk[:, pos : pos + used] = k[:, :used]
                bv[:, pos : pos + used] = v[:, :used]
            pos += used


def _common(a: list[int], b: list[int], start: int, end: int) -> int:
    """Length of the common prefix of ``a`` and ``b[start:end]``."""
    n = min(len(a), end - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class PrefixCache:
    """A radix tree of computed keys/values with a byte budget (see the module docstring)."""

    def __init__(self, capacity_bytes: int, version: int = 0) -> None:
        if capacity_bytes < 0:
            raise ValueError(
                f"kv_cache_bytes must be >= 0 (0 turns the prefix cache off), got {capacity_bytes}"
            )
        self.capacity_bytes = capacity_bytes
        self.version = version
        self.root = Node([], [], None)
        self.bytes = 0
        self._tick = 0
        # Counters for status/metrics: lookups, prompt tokens asked for and found.
        self.lookups = 0
        self.hits = 0
        self.lookup_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0
        self.evicted_bytes = 0
        self.invalidations = 0

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    # ------------------------------------------------------------------ lookup
    def match(self, ids: list[int], version: int, limit: int | None = None) -> Match:
        """The longest cached prefix of ``ids[:limit]`` computed under ``version``.

        The engine passes ``limit = len(prompt) - 1``: the last prompt token is
        always recomputed, since its logits (not cached) give the first sample.
        """
        end = len(ids) if limit is None else min(limit, len(ids))
        self.lookups += 1
        self.lookup_tokens += end
        if not self.enabled or version != self.version or end <= 0:
            return Match(0, [])
        self._tick += 1
        segments: list[tuple[Node, int]] = []
        node, pos = self.root, 0
        while pos < end:
            child = node.children.get(ids[pos])
            if child is None:
                break
            used = _common(child.tokens, ids, pos, end)
            child.last_used = self._tick
            segments.append((child, used))
            pos += used
            if used < len(child.tokens):
                break
            node = child
        if pos:
            self.hits += 1
            self.hit_tokens += pos
        return Match(pos, segments)

    # ------------------------------------------------------------------ insert
    def insert(self, ids: list[int], kv: LayerKV, version: int) -> int:
        """Keep the keys/values ``kv`` (per layer [H, len(ids), D]) of ``ids``.

        Only the part past the longest cached prefix is copied (cloned, so the
        caller's buffers can be reused). Returns how many new tokens were kept.
        Keys/values of another weight version are refused (returns 0).
        """
        if not self.enabled or version != self.version or not ids:
            return 0
        assert all(k.shape[1] == len(ids) for k, _ in kv), "kv must cover every id"
        self._tick += 1
        node, pos = self.root, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            used = _common(child.tokens, ids, pos, len(ids))
            child.last_used = self._tick
            if used < len(child.tokens):
                self._split(child, used)
            node = child
            pos += used
        if pos == len(ids):
            return 0
        leaf = Node(
            list(ids[pos:]),
            [(k[:, pos:].clone(), v[:, pos:].clone()) for k, v in kv],
            node,
            last_used=self._tick,
        )
        node.children[ids[pos]] = leaf
        self.bytes += leaf.nbytes
        self._evict(keep=leaf)
        return len(ids) - pos

    def _split(self, node: Node, at: int) -> None:
        """Cut ``node``'s edge after ``at`` tokens: ``node`` keeps the head, a new
        child takes the tail (and ``node``'s children). Clones both halves so each
        owns exactly its bytes (a view would keep the whole edge alive)."""
        tail = Node(
            node.tokens[at:],
            [(k[:, at:].clone(), v[:, at:].clone()) for k, v in node.kv],
            node,
            children=node.children,
            last_used=node.last_used,
        )
        for grandchild in tail.children.values():
            grandchild.parent = tail
        node.tokens = node.tokens[:at]
        node.kv = [(k[:, :at].clone(), v[:, :at].clone()) for k, v in node.kv]
        node.children = {tail.tokens[0]: tail}

    # ------------------------------------------------------------------ eviction
    def _leaves(self) -> list[Node]:
        out: list[Node] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out

    def _evict(self, keep: Node | None = None) -> None:
        """Drop least-recently-used leaves until the tree fits its budget; ``keep``
        (the node just inserted) goes last."""
        while self.bytes > self.capacity_bytes:
            leaves = self._leaves()
            if not leaves:
                break
            victim = min(leaves, key=lambda n: (n is keep, n.last_used))
            self._remove(victim)
            self.evictions += 1

    def _remove(self, node: Node) -> None:
        assert node.parent is not None and not node.children
        del node.parent.children[node.tokens[0]]
        self.bytes -= node.nbytes
        self.evicted_bytes += node.nbytes
        node.kv = []

    def invalidate(self, version: int) -> None:
        """Forget every cached prefix (the weights changed) and accept only ``version`` from now."""
        self.root = Node([], [], None)
        self.bytes = 0
        self.version = version
        self.invalidations += 1

    # ------------------------------------------------------------------ report
    def stats(self) -> dict[str, float | int]:
        """Counters for ``status``/``/metrics``: hit rate is over prompt tokens."""
        return {
            "kv_cache_capacity_bytes": self.capacity_bytes,
            "kv_cache_bytes": self.bytes,
            "kv_cache_lookups": self.lookups,
            "kv_cache_hits": self.hits,
            "kv_cache_lookup_tokens": self.lookup_tokens,
            "kv_cache_hit_tokens": self.hit_tokens,
            "kv_cache_hit_rate": self.hit_tokens / self.lookup_tokens
            if self.lookup_tokens
            else 0.0,
            "kv_cache_evictions": self.evictions,
            "kv_cache_evicted_bytes": self.evicted_bytes,
            "kv_cache_invalidations": self.invalidations,
        }
