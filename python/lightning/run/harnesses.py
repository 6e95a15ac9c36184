"""Several harnesses in one run: routing, per-harness costs and the eval matrix.

A run lists its harnesses (``[[harnesses]]`` in the run config, or one
``[harness]``, named ``"default"``). The harness is a dimension of a rollout:

- **Recorded with the rollout.** The loop writes the harness name into the task
  JSON the rollout is created with (``task["harness"]``), so the store keeps it
  next to the calls (``lightning.Store.rollouts()[i]["task"]["harness"]``), and
  :func:`harness_of` reads it back. The harness sees the field too, in
  ``LIGHTNING_TASK``, as it sees ``temperature`` and ``sampling_seed``.
- **Groups form per (task, harness).** Different harnesses wrap a task in
  different prompts (system prompts, tool schemas, protocols), so their rollouts
  of one task are samples of different prompts. GRPO's advantage
  ``(R - mean_g) / std_g`` compares a rollout with the others of its group; a
  group across harnesses would compare prompts, not samples: a harness that
  scores lower on a task would have every rollout pushed down (and the better
  one's pushed up) whatever the sampled tokens did, a bias the policy learns as
  "behave like under harness A", and the std mixes prompt variance into the
  scale. One group per (task, harness) keeps the baseline a same-prompt mean.
  The cost: a step needs ``group_size`` rollouts per harness and task.
- **Routed to its runner.** :class:`HarnessRunner` runs each job through the
  :class:`~lightning.run.runner.Runner` of the harness its task names, all in
  one event loop, so harnesses of a step run concurrently.
- **Costs seen per harness** (:func:`harness_costs`): calls per rollout, prompt
  tokens per call and of the first call (what the harness adds around the task),
  samples per rollout after the merge and the divergences that split them, and
  wall clock per rollout. :func:`split_flags` names a harness whose history
  rewriting splits (nearly) every multi-call rollout.
- **An eval matrix** (:func:`eval_matrix`): every held-out task through every
  harness, ``eval_only`` ones included, before, during and after training, each
  cell a mean with its 95% interval (:mod:`lightning.run.stats`).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from lightning.config import DEFAULT_HARNESS
from lightning.run.runner import RolloutResult, Runner
from lightning.run.stats import Interval, reward_interval

# The task field that names a rollout's harness.
HARNESS_KEY = "harness"

# A harness is flagged when at least this share of its multi-call rollouts
# split into several samples (and it had at least MIN_FLAG_ROLLOUTS of them).
SPLIT_FLAG_FRAC = 0.9
MIN_FLAG_ROLLOUTS = 2


def harness_of(task: Any) -> str:
    """The harness a rollout's task names (``"default"`` when it names none)."""
    if isinstance(task, Mapping):
        name = task.get(HARNESS_KEY)
        if isinstance(name, str) and name:
            return name
    return DEFAULT_HARNESS


class HarnessRunner:
    """The runners of a run's harnesses behind the one ``run(jobs, mode=)`` of a
    :class:`~lightning.run.runner.Runner`: each ``(task, group)`` job goes to the
    runner of ``task["harness"]`` (a task naming no harness goes to the first)."""

    def __init__(self, runners: Mapping[str, Runner]) -> None:
        if not runners:
            raise ValueError("HarnessRunner needs at least one harness")
        self.runners = dict(runners)
        self.default = next(iter(self.runners))

    def runner_for(self, task: Any) -> Runner:
        name = harness_of(task) if isinstance(task, Mapping) and HARNESS_KEY in task else None
        if name is None:
            return self.runners[self.default]
        try:
            return self.runners[name]
        except KeyError:
            raise ValueError(
                f"task names harness {name!r}; this run has {sorted(self.runners)}"
            ) from None

    def run(
        self, jobs: Sequence[tuple[Any, str | None]], *, mode: str = "train"
    ) -> list[RolloutResult]:
        """One rollout per job, every harness at once; results in job order."""
        return asyncio.run(self.run_async(jobs, mode=mode))

    async def run_async(
        self, jobs: Sequence[tuple[Any, str | None]], *, mode: str = "train"
    ) -> list[RolloutResult]:
        # Each runner keeps its own concurrency bound.
        by_runner: dict[int, list[int]] = {}
        runners: dict[int, Runner] = {}
        for i, (task, _) in enumerate(jobs):
            r = self.runner_for(task)
            by_runner.setdefault(id(r), []).append(i)
            runners[id(r)] = r
        parts = await asyncio.gather(
            *(
                runners[key].run_async([jobs[i] for i in idx], mode=mode)
                for key, idx in by_runner.items()
            )
        )
        out: list[RolloutResult | None] = [None] * len(jobs)
        for idx, results in zip(by_runner.values(), parts, strict=True):
            for i, result in zip(idx, results, strict=True):
                out[i] = result
        assert all(r is not None for r in out)
        return out  # type: ignore[return-value]


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")


def harness_costs(
    results: Sequence[RolloutResult],
    merged: Any,
    *,
    tokenizer: Any = None,
    rewards: Mapping[str, float] | None = None,
) -> dict[str, dict[str, Any]]:
    """What each harness cost in one batch of rollouts (a step, or an eval).

    ``merged`` is the store read of those rollouts (``GatewayClient.step``):
    its calls, samples and divergences. Per harness: ``rollouts``,
    ``reward_mean``, ``calls_per_rollout``, ``prompt_tokens_per_call``,
    ``first_prompt_tokens`` (the first call's prompt: the task plus all the
    harness wraps it in), ``task_tokens`` (the task prompt alone, with a
    tokenizer), ``samples_per_rollout``, ``split_frac`` (of the rollouts with
    more than one call, the share the merge split into several samples),
    ``divergences`` ({kind: count}) and ``wall_s_per_rollout``.
    """
    harness = {r.rollout_id: harness_of(r.task) for r in results}
    calls: dict[str, list[Any]] = {}
    for c in merged.calls:
        calls.setdefault(c.rollout_id, []).append(c)
    samples = Counter(s.rollout_id for s in merged.samples)
    divs: dict[str, Counter[str]] = {}
    for d in merged.divergences:
        if d.rollout_id in harness:
            divs.setdefault(harness[d.rollout_id], Counter())[d.kind] += 1
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(harness.values()):
        mine = [r for r in results if harness[r.rollout_id] == name]
        with_calls = [r.rollout_id for r in mine if calls.get(r.rollout_id)]
        n_calls = [len(calls[rid]) for rid in with_calls]
        prompt_lens = [len(c.prompt_ids) for rid in with_calls for c in calls[rid]]
        multi = [rid for rid in with_calls if len(calls[rid]) > 1]
        row: dict[str, Any] = {
            "rollouts": len(mine),
            "calls_per_rollout": _mean(n_calls),
            "prompt_tokens_per_call": _mean(prompt_lens),
            "first_prompt_tokens": _mean([len(calls[rid][0].prompt_ids) for rid in with_calls]),
            "samples_per_rollout": _mean([samples.get(rid, 0) for rid in with_calls]),
            "multi_call_rollouts": len(multi),
            "split_frac": _mean([float(samples.get(rid, 0) > 1) for rid in multi])
            if multi
            else 0.0,
            "divergences": dict(divs.get(name, {})),
            "wall_s_per_rollout": _mean([r.duration_s for r in mine]),
        }
        if rewards is not None:
            row["reward_mean"] = _mean(
                [rewards[r.rollout_id] for r in mine if r.rollout_id in rewards]
            )
        if tokenizer is not None:
            prompts = [r.task.get("prompt") for r in mine if isinstance(r.task, Mapping)]
            lens = [len(tokenizer.encode(p)) for p in prompts if isinstance(p, str)]
            if lens:
                row["task_tokens"] = _mean(lens)
        out[name] = row
    return out


def split_flags(costs: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """Harnesses whose history rewriting splits (nearly) every multi-call
    rollout, each with the cause: the divergence kinds the merge found."""
    flags = {}
    for name, c in costs.items():
        multi = int(c.get("multi_call_rollouts") or 0)
        frac = float(c.get("split_frac") or 0.0)
        if multi >= MIN_FLAG_ROLLOUTS and frac >= SPLIT_FLAG_FRAC:
            kinds = c.get("divergences") or {}
            cause = (
                ", ".join(f"{k} ×{n}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
                or "no divergence recorded"
            )
            flags[name] = (
                f"{frac:.0%} of its {multi} multi-call rollouts split into several "
                f"samples (its later prompts leave the earlier calls' paths: {cause}); "
                "each split re-trains the shared prefix as context and costs tokens"
            )
    return flags


def merge_costs(rows: Sequence[Mapping[str, Any]], key: str = "harnesses") -> dict[str, Any]:
    """The per-harness costs of many rows of ``metrics.jsonl`` (steps or evals),
    averaged over rows, weighted by rollouts; divergences summed."""
    acc: dict[str, dict[str, Any]] = {}
    for row in rows:
        per = row.get(key)
        if not isinstance(per, Mapping):
            continue
        for name, c in per.items():
            if not isinstance(c, Mapping):
                continue
            a = acc.setdefault(name, {"_w": {}, "_n": {}, "divergences": Counter(), "rollouts": 0})
            n = int(c.get("rollouts") or 0)
            a["rollouts"] += n
            a["multi_call_rollouts"] = a.get("multi_call_rollouts", 0) + int(
                c.get("multi_call_rollouts") or 0
            )
            for k, v in c.items():
                if k in ("rollouts", "multi_call_rollouts", "divergences"):
                    continue
                if isinstance(v, int | float) and v == v:  # skip NaN
                    a["_w"][k] = a["_w"].get(k, 0.0) + float(v) * n
                    a["_n"][k] = a["_n"].get(k, 0) + n
            a["divergences"].update(c.get("divergences") or {})
    out: dict[str, Any] = {}
    for name, a in acc.items():
        row = {k: a["_w"][k] / a["_n"][k] for k in a["_w"] if a["_n"][k]}
        row.update(
            rollouts=a["rollouts"],
            multi_call_rollouts=a.get("multi_call_rollouts", 0),
            divergences=dict(a["divergences"]),
        )
        out[name] = row
    return out


def eval_intervals(
    results: Sequence[RolloutResult],
    harnesses: Sequence[tuple[str, bool]],
    *,
    k: int,
    seed: int,
) -> tuple[Interval, dict[str, dict[str, Any]]]:
    """The intervals of one eval: pooled over the trained harnesses, and per harness.

    ``results`` are in job order: for each ``(name, eval_only)`` of ``harnesses``,
    every held-out task ``k`` times. A rollout without a reward counts 0. The
    pooled interval keeps each task's samples from every trained harness together
    (one cluster per task). Each cell: ``reward``, ``low``, ``high``, ``n``,
    ``eval_only``."""
    per_harness = len(results) // len(harnesses)
    pooled: dict[str, list[float]] = {}
    cells: dict[str, dict[str, Any]] = {}
    for hi, (name, eval_only) in enumerate(harnesses):
        by_task: dict[str, list[float]] = {}
        for i, r in enumerate(results[hi * per_harness : (hi + 1) * per_harness]):
            value = r.reward if r.reward is not None else 0.0
            by_task.setdefault(str(i // k), []).append(value)
            if not eval_only:
                pooled.setdefault(str(i // k), []).append(value)
        iv = reward_interval(by_task, seed=seed)
        cells[name] = {
            "reward": iv.mean,
            "low": iv.low,
            "high": iv.high,
            "n": iv.tasks * iv.samples,
            "eval_only": eval_only,
        }
    return reward_interval(pooled, seed=seed), cells


def eval_label(row: Mapping[str, Any]) -> str:
    """``before``, ``step N`` (an eval after N training steps) or ``final``."""
    step = int(row.get("step", 0))
    if step < 0:
        return "before"
    # The final eval is a row of its own; mid-run evals ride on a step's row.
    return f"step {step + 1}" if "reward_mean" in row or "loss" in row else "final"


def eval_matrix(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Harness → its evals in order: ``{"label", "reward", "low", "high", "n",
    "eval_only"}``, from the ``eval_harnesses`` of ``metrics.jsonl`` rows."""
    out: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        per = row.get("eval_harnesses")
        if not isinstance(per, Mapping):
            continue
        label = eval_label(row)
        for name, cell in per.items():
            if isinstance(cell, Mapping):
                out.setdefault(name, []).append({"label": label, **cell})
    return out


def transfer_lines(matrix: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
    """The headline: each ``eval_only`` harness, before → final, with intervals."""
    lines = []
    for name, cells in matrix.items():
        if not cells or not cells[-1].get("eval_only"):
            continue
        first, last = cells[0], cells[-1]
        delta = float(last["reward"]) - float(first["reward"])
        lines.append(
            f"unseen harness {name!r} (eval_only, never trained on): "
            f"{first['label']} {fmt_cell(first)} → {last['label']} {fmt_cell(last)} "
            f"(Δ {delta:+.3f})"
        )
    return lines


def fmt_cell(cell: Mapping[str, Any]) -> str:
    low, high = cell.get("low"), cell.get("high")
    if low is None or high is None:
        return f"{float(cell['reward']):.3f}"
    return f"{float(cell['reward']):.3f} ({float(low):.3f}–{float(high):.3f})"


def matrix_table(matrix: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """The matrix as a Markdown table: harness × eval, mean (95% interval)."""
    labels: list[str] = []
    for cells in matrix.values():
        for c in cells:
            if c["label"] not in labels:
                labels.append(c["label"])
    head = ["harness", *labels]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, cells in matrix.items():
        by = {c["label"]: c for c in cells}
        tag = " (eval only)" if cells and cells[-1].get("eval_only") else ""
        row = [f"{name}{tag}", *[fmt_cell(by[lb]) if lb in by else "–" for lb in labels]]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
