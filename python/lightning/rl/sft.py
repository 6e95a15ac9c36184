"""Supervised fine-tuning data: conversations and store rollouts as exact-token samples.

Both sources end as the same thing the RL step trains on: calls (prompt ids,
completion ids) merged by the radix trie (:func:`lightning.merge_calls`), so a
multi-turn conversation becomes one sample whose assistant tokens carry weight 1
and everything else weight 0, and :meth:`lightning.rl.trainer.Trainer.supervised_step`
lays them out (padded, packed or tree) like any RL batch.

**Conversations** (:func:`load_conversations`): JSONL, one object per line with
``messages`` (OpenAI chat format: ``role``, ``content``, assistant ``tool_calls``)
and optionally ``tools`` (OpenAI function tools) — the conversational layout
TRL's ``SFTTrainer`` reads. Each assistant message *i* becomes one call: its
prompt is ``encode_chat(messages[:i], tools, add_generation_prompt=True)`` (what
the engine would send the model), its completion the tokens the template adds
after that prompt for the message, up to and including the end-of-turn token
(the tokenizer's EOS) — exactly what the model must generate, no more: the
newline a template writes after the EOS is context. The rendering is the
model's own chat template through lightning's template engine (the one the
embedded engine serves with), so training and serving see the same ids. A
template that renders an assistant message differently once later turns
follow (one that strips reasoning, say) is handled by the merge: the sample
branches, and each assistant turn is still trained once.

**Store** (:func:`select_rollouts`, :func:`select_sessions`): rejection
sampling. The kept rollouts' calls are read as recorded (prompt and completion
ids the engine returned) and merged; nothing is re-rendered, so the model is
trained on exactly the tokens it produced.

Bad data stops before any training with :class:`SftDataError`, naming the file
and line (or the rollout) and the fix.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lightning._core import LightningError, TemplateError

__all__ = [
    "Selected",
    "SftDataError",
    "SftSample",
    "conversation_calls",
    "load_conversations",
    "merge_examples",
    "select_rollouts",
    "select_sessions",
    "split_validation",
]


class SftDataError(LightningError, ValueError):
    """A supervised example that cannot be trained on; the message names where it is."""


@dataclass(frozen=True)
class SftSample:
    """One training sequence: ``tokens`` [L] and per-token ``weights`` [L]
    (> 0: trained), with the example it came from (``source``: ``FILE:LINE`` or a
    rollout id). The fields ``Trainer.supervised_step`` reads are those of
    ``lightning.Sample``."""

    source: str
    tokens: np.ndarray  # [L] uint32
    weights: np.ndarray  # [L] float32
    rollout_id: str = ""
    group: str | None = None
    logprobs: np.ndarray | None = None

    @property
    def trained_tokens(self) -> int:
        return int(np.count_nonzero(self.weights))


def _tool_names(tools: Any, where: str) -> set[str]:
    if tools is None:
        return set()
    if not isinstance(tools, list):
        raise SftDataError(f"{where}: `tools` must be a list of OpenAI function tools")
    names = set()
    for t in tools:
        fn = t.get("function", t) if isinstance(t, Mapping) else None
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(name, str):
            raise SftDataError(
                f"{where}: a tool without a name ({json.dumps(t)[:120]}); tools are "
                '{"type": "function", "function": {"name": ..., "parameters": ...}}'
            )
        names.add(name)
    return names


def _check_conversation(row: Any, where: str) -> tuple[list[dict[str, Any]], list[Any] | None]:
    if not isinstance(row, Mapping) or not isinstance(row.get("messages"), list):
        raise SftDataError(
            f'{where}: expected an object with "messages" (a list of chat messages) and '
            'optionally "tools"'
        )
    messages = row["messages"]
    tools = row.get("tools")
    declared = _tool_names(tools, where)
    assistant = 0
    for k, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise SftDataError(f"{where}: message {k} has no role")
        if m["role"] != "assistant":
            continue
        assistant += 1
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call) if isinstance(call, Mapping) else {}
            name = fn.get("name") if isinstance(fn, Mapping) else None
            if name not in declared:
                known = ", ".join(sorted(declared)) or "none"
                raise SftDataError(
                    f"{where}: message {k} calls the tool {name!r}, which the conversation's "
                    f"`tools` do not declare (declared: {known}); add its schema to `tools` or "
                    "drop the call"
                )
    if assistant == 0:
        raise SftDataError(
            f"{where}: no assistant message, so nothing to train on; every conversation needs "
            "at least one message with role 'assistant'"
        )
    return list(messages), tools


def conversation_calls(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Any, where: str
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt ids, completion ids) of each assistant message, as the model would
    have been asked and would have answered (see the module docstring)."""
    eos = tokenizer.token_to_id(tokenizer.eos_token) if tokenizer.eos_token else None
    out = []
    try:
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            prompt = np.asarray(
                tokenizer.encode_chat(messages[:i], tools=tools, add_generation_prompt=True)
            )
            full = np.asarray(tokenizer.encode_chat(messages[: i + 1], tools=tools))
            if len(full) <= len(prompt) or not np.array_equal(full[: len(prompt)], prompt):
                raise SftDataError(
                    f"{where}: the chat template renders message {i} (assistant) so that the "
                    "conversation does not extend the generation prompt before it; this "
                    "template cannot be trained turn by turn (set [sft] chat_template)"
                )
            answer = full[len(prompt) :]
            if eos is not None:
                hits = np.nonzero(answer == eos)[0]
                if len(hits):
                    answer = answer[: int(hits[0]) + 1]
            out.append((prompt, answer))
    except TemplateError as e:
        raise SftDataError(
            f"{where}: the chat template failed on this conversation ({e}); a model whose "
            "template ignores tools needs [sft] chat_template (as [engine] chat_template)"
        ) from None
    return out


def merge_examples(
    examples: Sequence[tuple[str, list[tuple[np.ndarray, np.ndarray]]]],
    *,
    max_len: int | None,
    tokenizer: Any = None,
) -> list[SftSample]:
    """Samples of (source, calls) examples, each merged on its own by the radix
    trie; a sample longer than ``max_len`` is an error naming its source."""
    from lightning import Call, merge_calls

    out: list[SftSample] = []
    for source, calls in examples:
        merged = merge_calls(
            [Call(source, p.astype(np.uint32), c.astype(np.uint32)) for p, c in calls],
            tokenizer=tokenizer,
        )
        for s in merged.samples:
            if max_len is not None and len(s.tokens) > max_len:
                raise SftDataError(
                    f"{source}: {len(s.tokens)} tokens, longer than the context ({max_len}); "
                    "shorten the conversation, drop it, or raise [sft] max_len (not beyond "
                    "the model's max_position_embeddings)"
                )
            out.append(
                SftSample(
                    source=source,
                    tokens=np.asarray(s.tokens),
                    weights=np.asarray(s.weights, dtype=np.float32),
                    rollout_id=source,
                )
            )
    return out


def load_conversations(
    path: str | Path, tokenizer: Any, *, max_len: int | None = None
) -> list[SftSample]:
    """Every conversation of a JSONL file as trained samples (loss on assistant
    tokens only). Raises :class:`SftDataError` naming ``FILE:LINE`` for a line
    that is not JSON, has no assistant message, calls an undeclared tool, or is
    longer than ``max_len`` tokens."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"[sft] dataset {path} does not exist")
    examples = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SftDataError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
        messages, tools = _check_conversation(row, where)
        examples.append((where, conversation_calls(tokenizer, messages, tools, where)))
    if not examples:
        raise SftDataError(f"{path}: no conversations")
    return merge_examples(examples, max_len=max_len)


def split_validation(
    samples: Sequence[SftSample], fraction: float, seed: int
) -> tuple[list[SftSample], list[SftSample]]:
    """(train, validation): a seeded ``fraction`` of the examples (by source, so
    the pieces of one example stay together), at least one when fraction > 0
    and there are two or more examples."""
    sources = list(dict.fromkeys(s.source for s in samples))
    k = math.ceil(len(sources) * fraction) if fraction > 0 and len(sources) > 1 else 0
    k = min(k, len(sources) - 1)
    held = set(random.Random(seed).sample(sources, k))
    return [s for s in samples if s.source not in held], [s for s in samples if s.source in held]


# --------------------------------------------------------------------- store


@dataclass
class Selected:
    """The rollouts (or sessions) a filter kept, in store order, with their
    rewards, and how many it dropped for each reason."""

    ids: list[str]
    rewards: dict[str, float]
    groups: dict[str, str | None]
    dropped: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        r = list(self.rewards[i] for i in self.ids)
        return {
            "kept": len(self.ids),
            "dropped": dict(self.dropped),
            "kept_reward_mean": float(np.mean(r)) if r else float("nan"),
        }


def keep_best(
    rows: Sequence[tuple[str, str | None, float | None]],
    *,
    min_reward: float | None,
    top_fraction: float | None,
) -> Selected:
    """Rejection sampling over ``(id, group, reward)`` rows in store order: drop
    rollouts without a reward, below ``min_reward``, then keep the best
    ``ceil(top_fraction × n)`` of each group of n rewarded rollouts (a rollout
    without a group is a group of its own; ties at the cut keep the earlier
    rollout). The threshold applies first, the fraction to what is left."""
    dropped = {"no_reward": 0, "below_min_reward": 0, "not_top_fraction": 0}
    rewards: dict[str, float] = {}
    groups: dict[str, str | None] = {}
    by_group: dict[str, list[str]] = {}
    order: list[str] = []
    for rid, group, reward in rows:
        if reward is None or not math.isfinite(reward):
            dropped["no_reward"] += 1
            continue
        if min_reward is not None and reward < min_reward:
            dropped["below_min_reward"] += 1
            continue
        rewards[rid], groups[rid] = float(reward), group
        by_group.setdefault(group if group is not None else "\0" + rid, []).append(rid)
        order.append(rid)
    keep = set(order)
    if top_fraction is not None:
        keep = set()
        for members in by_group.values():
            n = math.ceil(top_fraction * len(members) - 1e-9)
            ranked = sorted(members, key=lambda r: -rewards[r])  # stable: earlier first
            keep.update(ranked[:n])
        dropped["not_top_fraction"] = len(order) - len(keep)
    ids = [r for r in order if r in keep]
    return Selected(ids, {r: rewards[r] for r in ids}, {r: groups[r] for r in ids}, dropped)


def select_rollouts(
    db: str | Path,
    *,
    min_reward: float | None = None,
    top_fraction: float | None = None,
    rollout_ids: Sequence[str] | None = None,
) -> Selected:
    """Train-mode rollouts of the store that succeeded, filtered by
    :func:`keep_best`. Eval rollouts are never selected: they are the held-out
    measurement."""
    from lightning.gateway.store import Store

    with Store(db) as store:
        rows = store.rollouts()
    if rollout_ids is not None:
        wanted = set(rollout_ids)
        rows = [r for r in rows if r["rollout_id"] in wanted]
    dropped = {"eval_mode": 0, "not_succeeded": 0}
    kept_rows = []
    for r in rows:
        if r.get("mode") != "train":
            dropped["eval_mode"] += 1
        elif r.get("status") != "succeeded":
            dropped["not_succeeded"] += 1
        else:
            kept_rows.append((r["rollout_id"], r.get("group"), r.get("reward")))
    sel = keep_best(kept_rows, min_reward=min_reward, top_fraction=top_fraction)
    sel.dropped = {**dropped, **sel.dropped}
    return sel


def session_reward(feedback: Sequence[Mapping[str, Any]]) -> float | None:
    """The mean of the latest value per (signal name, target response), the
    default reward of an online pass (docs/online.md); None without feedback."""
    latest: dict[tuple[str, Any], tuple[float, float]] = {}
    for f in feedback:
        key = (f["name"], f.get("response_id"))
        if key not in latest or float(f["ts"]) >= latest[key][0]:
            latest[key] = (float(f["ts"]), float(f["value"]))
    return sum(v for _, v in latest.values()) / len(latest) if latest else None


def select_sessions(
    db: str | Path,
    *,
    min_reward: float | None = None,
    top_fraction: float | None = None,
    rated_only: bool = True,
) -> Selected:
    """Online sessions of the store, by their feedback (:func:`session_reward`):
    unrated ones are dropped when ``rated_only`` (they have no reward to
    filter by, so without it they count as reward 0), then :func:`keep_best`
    (sessions have no groups: ``top_fraction`` ranks them all together)."""
    from lightning import _core

    if not Path(db).exists():
        raise FileNotFoundError(f"no gateway store at {db}")
    reader = _core.StoreReader(str(db))
    rows: list[tuple[str, str | None, float | None]] = []
    unrated = 0
    for s in reader.sessions():
        reward = session_reward(reader.feedback(s["rollout_id"]))
        if reward is None:
            if rated_only:
                unrated += 1
                continue
            reward = 0.0
        rows.append((s["rollout_id"], "sessions", reward))
    sel = keep_best(rows, min_reward=min_reward, top_fraction=top_fraction)
    sel.dropped = {"unrated": unrated, **sel.dropped}
    return sel


def store_samples(db: str | Path, selected: Selected, *, max_len: int | None) -> list[SftSample]:
    """The kept rollouts' recorded calls, merged: the exact tokens the model
    produced (its completions weighted, prompts and tool results context)."""
    from lightning.gateway.store import Store

    if not selected.ids:
        return []
    with Store(db) as store:
        merged = store.read_step(selected.ids)
    out = []
    for s in merged.samples:
        if max_len is not None and len(s.tokens) > max_len:
            raise SftDataError(
                f"rollout {s.rollout_id}: {len(s.tokens)} tokens, longer than the context "
                f"({max_len}); raise [sft] max_len or filter such rollouts out"
            )
        out.append(
            SftSample(
                source=s.rollout_id,
                tokens=np.asarray(s.tokens),
                weights=np.asarray(s.weights, dtype=np.float32),
                rollout_id=s.rollout_id,
                group=s.group,
            )
        )
    return out
