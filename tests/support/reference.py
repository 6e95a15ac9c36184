"""Slow, obvious twins of the fast code (house rule 9): plain Python, no tries,
written straight from the definitions so the fast code has something to match.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

Seq = tuple[int, ...]


@dataclass
class RefCall:
    """A call as plain lists (what tests generate before building `lightning.Call`)."""

    rollout_id: str
    prompt: list[int]
    completion: list[int]
    logprobs: list[float] | None = None
    group: str | None = None

    @property
    def seq(self) -> Seq:
        return (*self.prompt, *self.completion)


@dataclass
class RefSample:
    rollout_id: str
    group: str | None
    tokens: list[int]
    weights: list[float]
    logprobs: list[float]
    call_index: list[int]
    truncated: int


@dataclass
class RefMerge:
    samples: list[RefSample] = field(default_factory=list)
    # (rollout_id, call_index, position, left_call_index)
    divergences: list[tuple[str, int, int, int]] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _group_by(calls: Sequence[RefCall], key: Any) -> list[tuple[Any, list[int]]]:
    out: dict[Any, list[int]] = {}
    for i, c in enumerate(calls):
        out.setdefault(key(c), []).append(i)
    return list(out.items())


class _Tree:
    """The (uncompressed) trie of some calls' full sequences, answered by scanning."""

    def __init__(self, calls: Sequence[RefCall], members: list[int]) -> None:
        self.calls = calls
        self.members = members  # input indices, input order

    def first_with_prefix(self, prefix: Seq) -> int:
        """Creation time of the node `prefix`: the first call whose sequence has it."""
        return next(
            k for k, i in enumerate(self.members) if self.calls[i].seq[: len(prefix)] == prefix
        )

    def generators(self, prefix: Seq) -> list[int]:
        """Calls (input indices, input order) that generated the last token of `prefix`."""
        d = len(prefix) - 1
        return [
            i
            for i in self.members
            if len(self.calls[i].prompt) <= d < len(self.calls[i].seq)
            and self.calls[i].seq[: d + 1] == prefix
        ]

    def logprob(self, prefix: Seq) -> float:
        d = len(prefix) - 1
        for i in self.generators(prefix):
            c = self.calls[i]
            if c.logprobs is not None and not math.isnan(c.logprobs[d - len(c.prompt)]):
                return c.logprobs[d - len(c.prompt)]
        return math.nan

    def children(self, prefix: Seq) -> list[Seq]:
        """Child nodes in creation order."""
        kids = {
            self.calls[i].seq[: len(prefix) + 1]
            for i in self.members
            if len(self.calls[i].seq) > len(prefix) and self.calls[i].seq[: len(prefix)] == prefix
        }
        return sorted(kids, key=self.first_with_prefix)

    def leaves(self) -> list[Seq]:
        """Root-to-leaf paths in DFS order (children in creation order)."""
        out: list[Seq] = []
        stack: list[Seq] = [()]
        while stack:
            node = stack.pop()
            kids = self.children(node)
            if not kids and node:
                out.append(node)
            stack.extend(reversed(kids))
        return out

    def dfs(self) -> list[Seq]:
        """All nodes (non-empty prefixes) in DFS order."""
        out: list[Seq] = []
        stack: list[Seq] = [()]
        while stack:
            node = stack.pop()
            if node:
                out.append(node)
            stack.extend(reversed(self.children(node)))
        return out


def merge(calls: Sequence[RefCall], max_tokens: int | None = None) -> RefMerge:
    """docs/design.md#merge by definition, one rollout at a time."""
    limit = math.inf if max_tokens is None else max_tokens
    res = RefMerge()
    dropped = 0
    duplicates = 0
    rollouts = _group_by(calls, lambda c: c.rollout_id)
    for rollout_id, members in rollouts:
        for k, ci in enumerate(members):
            s = calls[ci].seq
            prior = [calls[e].seq for e in members[:k]]
            duplicates += s in prior
            d = max((_lcp(s, p) for p in prior), default=0)
            if d < len(calls[ci].prompt):
                cont = [
                    e for e in members[:k] if len(calls[e].seq) > d and calls[e].seq[:d] == s[:d]
                ]
                if cont:
                    res.divergences.append((rollout_id, ci, d, max(cont)))
        tree = _Tree(calls, members)
        trained: set[Seq] = set()
        for leaf in tree.leaves():
            n = int(min(len(leaf), limit))
            weights = [0.0] * n
            logprobs = [math.nan] * n
            call_index = [-1] * n
            truncated = 0
            for d in range(len(leaf)):
                node = leaf[: d + 1]
                gens = tree.generators(node)
                first = node not in trained
                trained.add(node)
                if d >= limit:
                    truncated += len(gens) if first else 0
                    continue
                if first and gens:
                    weights[d] = float(len(gens))
                    call_index[d] = gens[0]
                logprobs[d] = tree.logprob(node)
            if any(w > 0 for w in weights):
                group = calls[members[0]].group
                res.samples.append(
                    RefSample(
                        rollout_id, group, list(leaf[:n]), weights, logprobs, call_index, truncated
                    )
                )
            else:
                dropped += 1
    res.stats = {
        "calls": len(calls),
        "rollouts": len(rollouts),
        "samples": len(res.samples),
        "generated_tokens": sum(len(c.completion) for c in calls),
        "sample_tokens": sum(len(s.tokens) for s in res.samples),
        "truncated_tokens": int(
            sum(max(0, len(c.seq) - max(len(c.prompt), limit)) for c in calls)  # type: ignore[call-overload]
        ),
        "dropped_samples": dropped,
        "duplicates": duplicates,
    }
    return res


@dataclass
class RefPacked:
    tokens: list[int] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    gens: list[list[int]] = field(default_factory=list)
    tree_keys: list[str] = field(default_factory=list)
    tree_offsets: list[int] = field(default_factory=lambda: [0])


def pack(
    calls: Sequence[RefCall], max_tokens: int | None = None, across_rollouts: bool = False
) -> RefPacked:
    """Every trie node once, DFS order; one tree per rollout or per group."""
    limit = math.inf if max_tokens is None else max_tokens

    def key(c: RefCall) -> tuple[str, str]:
        if across_rollouts and c.group is not None:
            return ("group", c.group)
        return ("rollout", c.rollout_id)

    out = RefPacked()
    for (_, name), members in _group_by(calls, key):
        tree = _Tree(calls, members)
        index: dict[Seq, int] = {}
        for node in tree.dfs():
            if len(node) > limit:
                continue
            index[node] = len(out.tokens)
            out.tokens.append(node[-1])
            out.parent.append(index[node[:-1]] if len(node) > 1 else -1)
            out.depth.append(len(node) - 1)
            gens = tree.generators(node)
            out.weights.append(float(len(gens)))
            out.logprobs.append(tree.logprob(node))
            out.gens.append(gens)
        out.tree_keys.append(name)
        out.tree_offsets.append(len(out.tokens))
    return out


# --- RL math (advantages, aggregation, PPO) ---------------------------------


def _members(groups: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    out: dict[Hashable, list[int]] = {}
    for i, g in enumerate(groups):
        out.setdefault(g, []).append(i)
    return out


def advantages(
    rewards: Sequence[float], groups: Sequence[Hashable], estimator: str, eps: float = 1e-6
) -> list[float]:
    n = len(rewards)
    out = [0.0] * n
    members = _members(groups)
    for idx in members.values():
        vals = [float(rewards[i]) for i in idx]
        k = len(vals)
        mean = sum(vals) / k
        equal = all(v == vals[0] for v in vals)
        for i in idx:
            if equal:
                out[i] = 0.0
            elif estimator == "grpo":
                var = sum((v - mean) ** 2 for v in vals) / (k - 1)
                out[i] = (rewards[i] - mean) / (math.sqrt(var) + eps)
            elif estimator in ("dr_grpo", "reinforce_pp"):
                out[i] = rewards[i] - mean
            elif estimator == "rloo":
                others = [float(rewards[j]) for j in idx if j != i]
                out[i] = rewards[i] - sum(others) / len(others) if others else 0.0
            else:
                raise ValueError(estimator)
    if estimator == "reinforce_pp" and n > 1:
        m = sum(out) / n
        std = math.sqrt(sum((a - m) ** 2 for a in out) / (n - 1))
        out = [a / (std + eps) for a in out]
    return out


def aggregate(
    losses: Sequence[float],
    weights: Sequence[float],
    samples: Sequence[int],
    rollouts: Sequence[int],
    mode: str,
    max_len: float | None = None,
) -> float:
    def sums(keys: Sequence[int]) -> dict[int, tuple[float, float]]:
        out: dict[int, tuple[float, float]] = {}
        for loss, w, k in zip(losses, weights, keys, strict=True):
            a, b = out.get(k, (0.0, 0.0))
            out[k] = (a + w * loss, b + w)
        # Only groups with some weight count (a zero-weight group carries no loss).
        return {k: v for k, v in out.items() if v[1] > 0}

    total_w = sum(weights)
    if total_w == 0:
        return 0.0
    if mode == "token-mean":
        return sum(w * loss for loss, w in zip(losses, weights, strict=True)) / total_w
    per_sample = sums(samples)
    if mode == "seq-mean-token-mean":
        return sum(a / b for a, b in per_sample.values()) / len(per_sample)
    if mode == "seq-mean-token-sum":
        return sum(a for a, _ in per_sample.values()) / len(per_sample)
    if mode == "seq-mean-token-sum-norm":
        assert max_len is not None
        return sum(a for a, _ in per_sample.values()) / (len(per_sample) * max_len)
    if mode == "rollout-mean":
        per_rollout = sums(rollouts)
        return sum(a / b for a, b in per_rollout.values()) / len(per_rollout)
    raise ValueError(mode)


def ppo_token_loss(
    logp: float,
    old: float,
    adv: float,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> float:
    ratio = math.exp(logp - old)
    unclipped = ratio * adv
    clipped = max(min(ratio, 1 + clip_high), 1 - clip_low) * adv
    loss = -min(unclipped, clipped)
    if dual_clip is not None and adv < 0:
        loss = min(loss, -dual_clip * adv)
    return loss


def token_logprobs(model, tokens: Sequence[int], temperature: float = 1.0) -> list[float]:
    """Log-probability of tokens[1:] under ``model`` run on one plain sequence
    (sampling distribution at ``temperature``)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([list(tokens)])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return [float(lp[t - 1, tokens[t]]) for t in range(1, len(tokens))]


def decoupled_ppo_token_loss(
    logp: Any,
    prox: float,
    behav: float,
    adv: float,
    clip_low: float,
    clip_high: float,
    cap: float,
) -> Any:
    """Off-policy PPO for one token, written out: the ratio against the proximal
    policy (the trainer's current weights, ``prox``), times the truncated importance
    weight ``min(π_prox / π_behav, cap)`` of the behaviour policy that generated the
    token (``behav``, the recorded rollout log-prob). ``logp`` may be a torch scalar."""
    import torch

    is_weight = min(math.exp(prox - behav), cap)
    ratio = torch.exp(logp - prox)
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    return -is_weight * torch.minimum(ratio * adv, clipped * adv)


def hermes_tool_calls(text: str) -> tuple[str | None, list[tuple[str, Any]]] | None:
    """Hermes tool calls, from the definition: ``<tool_call>JSON</tool_call>`` regions
    (the last may run to the end of the text), each a JSON object with a string
    ``name`` and an ``arguments`` value; content is the text before the first tag.
    None when there is no tag or any region is not such an object (the text stays text)."""
    import json

    head, sep, rest = text.partition("<tool_call>")
    if not sep:
        return None
    calls = []
    for region in rest.split("<tool_call>"):
        body = region.split("</tool_call>")[0] if "</tool_call>" in region else region
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        if "arguments" not in obj:
            return None
        calls.append((obj["name"], obj["arguments"]))
    return (head or None), calls


def tree_attention(q, k, v, parent: Sequence[int], scale: float):  # type: ignore[no-untyped-def]
    """Every node attends to itself and its ancestors (``parent`` -1 at roots):
    ``q`` ``[H, N, d]``, ``k``/``v`` ``[H, N, d]`` torch tensors; returns ``[N, H, d]``."""
    import torch

    out = []
    for i in range(len(parent)):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = parent[j]
        keys = k[:, path]  # [H, P, d]
        w = torch.softmax((q[:, i : i + 1] @ keys.transpose(1, 2)) * scale, dim=-1)  # [H, 1, P]
        out.append((w @ v[:, path])[:, 0])  # [H, d]
    return torch.stack(out)


def longest_cached_prefix(stored: Sequence[Sequence[int]], ids: Sequence[int], limit: int) -> int:
    """The prefix cache's answer, by brute force: the longest common prefix of
    ``ids[:limit]`` with any stored sequence."""
    best = 0
    for seq in stored:
        n = 0
        while n < min(len(seq), limit, len(ids)) and seq[n] == ids[n]:
            n += 1
        best = max(best, n)
    return best
