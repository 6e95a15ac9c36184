"""Synchronous vs asynchronous (``max_staleness = 1``) training on the CPU demo.

Both runs use the demo's setting (``examples/demo.toml``: SmolLM2-135M-Instruct,
the arithmetic harness, GRPO), the same seed and the same wall-clock budget of
training (``--budget-s``); the synchronous run is the baseline, measured in the
same process. Printed per mode: steps done, steps/hour, mean engine and trainer
idle fractions, mean e2e tokens/s, staleness of trained tokens, and the held-out
reward after the budget. A PNG compares the idle fractions step by step.

On one CPU box generation and training compete for the same cores, so the
measured async gain is small or negative here. The expected gain with engine
and trainer on separate devices is modelled from the synchronous run's measured
phase times: a synchronous step costs G + T (generation, then training + weight
push); one-step-off pipelining costs max(G, T) once the pipeline is full.

    python benches/async_loop.py                      # ~15 min on 2 loaded cores
    python benches/async_loop.py --model tiny --budget-s 60   # smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _tasks(out: Path, seed: int) -> tuple[Path, Path]:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import arith_tasks
    finally:
        sys.path.remove(str(EXAMPLES))
    rc = arith_tasks.main(["--seed", str(seed), "--out", str(out), *arith_tasks.DEMO_FLAGS])
    assert rc == 0
    return out / "train.jsonl", out / "eval.jsonl"


def run_mode(
    k: int, args: argparse.Namespace, tasks: tuple[Path, Path], out: Path
) -> dict[str, Any]:
    from lightning.config import RunConfig
    from lightning.run.loop import Run

    overrides: dict[str, Any] = {
        "model.builtin": args.model,
        "steps": 10_000,  # the budget stops the run
        "eval_every": 0,
        "checkpoint_every": 0,
        "output_dir": str(out),
        "tasks.train": str(tasks[0]),
        "tasks.eval": str(tasks[1]),
        "tasks.eval_limit": args.eval_tasks,
        "algorithm.eval_samples": 1,
        "algorithm.max_staleness": k,
        "algorithm.tasks_per_step": args.tasks_per_step,
        "algorithm.group_size": args.group_size,
        "seed": args.seed,
    }
    config = RunConfig.load(EXAMPLES / "demo.toml", overrides)
    steps: list[dict[str, Any]] = []
    with Run(config, quiet=True) as run:
        t0 = time.monotonic()
        run.phases.mark()
        with run.schedule(0) as batches:
            for batch in batches.batches():
                step = batch.step
                m = run.train_on(step, batch.results, t0=batch.t0)
                batches.published(step + 1)
                steps.append(m)
                print(
                    f"  k={k} step {step}: {m['step_time_s']:.1f}s engine idle "
                    f"{m['engine_idle_frac']:.2f} trainer idle {m['trainer_idle_frac']:.2f} "
                    f"staleness {m['staleness_tokens']}",
                    flush=True,
                )
                if time.monotonic() - t0 >= args.budget_s:
                    break
            elapsed = time.monotonic() - t0
        interval = run.evaluate("after the budget")
    # The report is JSON: the eval's mean and its 95% interval as plain numbers.
    reward = (
        None
        if interval is None
        else {"mean": interval.mean, "ci95": [interval.low, interval.high], "tasks": interval.tasks}
    )
    return {"k": k, "steps": steps, "elapsed_s": elapsed, "eval_reward": reward}


def summarize(r: dict[str, Any]) -> dict[str, Any]:
    steps = r["steps"]
    mean = lambda key: statistics.fmean(m[key] for m in steps) if steps else float("nan")  # noqa: E731
    stale: dict[str, int] = {}
    for m in steps:
        for s, n in m["staleness_tokens"].items():
            stale[s] = stale.get(s, 0) + n
    train_s = [m["step_time_s"] - m["rollout_time_s"] for m in steps]
    return {
        "max_staleness": r["k"],
        "steps": len(steps),
        "steps_per_hour": 3600 * len(steps) / r["elapsed_s"],
        "engine_idle_frac": mean("engine_idle_frac"),
        "trainer_idle_frac": mean("trainer_idle_frac"),
        "e2e_tokens_per_s": mean("e2e_tokens_per_s"),
        "staleness_tokens": stale,
        "eval_reward": r["eval_reward"],
        "generate_s": mean("rollout_time_s"),
        "train_push_s": statistics.fmean(train_s) if train_s else float("nan"),
    }


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), sharey=True)
    for ax, key, title in zip(
        axes,
        ("engine_idle_frac", "trainer_idle_frac"),
        ("engine idle", "trainer idle"),
        strict=True,
    ):
        for r in results:
            label = "sync" if r["k"] == 0 else f"async (max_staleness={r['k']})"
            ax.plot([m[key] for m in r["steps"]], marker="o", label=label)
        ax.set_title(f"{title} fraction per step")
        ax.set_xlabel("step")
        ax.set_ylim(0, 1)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model", default="smollm2-135m-instruct", choices=["smollm2-135m-instruct", "tiny"]
    )
    p.add_argument("--budget-s", type=float, default=300.0, help="training wall clock per mode")
    p.add_argument("--eval-tasks", type=int, default=8)
    p.add_argument("--tasks-per-step", type=int, default=4, help="demo: 4")
    p.add_argument("--group-size", type=int, default=8, help="demo: 8")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for runs, JSON and PNG")
    args = p.parse_args()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    out = Path(args.out or tempfile.mkdtemp(prefix="async-bench-"))
    print(
        f"machine: {platform.machine()} {platform.processor() or ''} cpus={__import__('os').cpu_count()}"
    )
    print(f"commit: {commit}  model: {args.model}  budget: {args.budget_s:g}s per mode  out: {out}")
    print(f"batch: {args.tasks_per_step} tasks x {args.group_size} rollouts per step")
    tasks = _tasks(out / "tasks", args.seed)
    results = [run_mode(k, args, tasks, out / f"k{k}") for k in (0, 1)]
    summary = [summarize(r) for r in results]
    sync, async_ = summary
    g, t = sync["generate_s"], sync["train_push_s"]
    modelled = (g + t) / max(g, t)
    report = {
        "commit": commit,
        "model": args.model,
        "budget_s": args.budget_s,
        "batch": [args.tasks_per_step, args.group_size],
        "modes": summary,
        "measured_steps_per_hour_ratio": async_["steps_per_hour"] / sync["steps_per_hour"],
        "modelled_separate_devices_ratio": modelled,
    }
    (out / "async_loop.json").write_text(json.dumps(report, indent=2))
    plot(results, out / "idle_fractions.png")
    print(json.dumps(report, indent=2))
    print(
        f"async/sync steps per hour, measured here: {report['measured_steps_per_hour_ratio']:.2f}x; "
        f"modelled with engine and trainer on separate devices (sync G={g:.1f}s + T={t:.1f}s "
        f"→ max(G, T)): {modelled:.2f}x"
    )
    print(f"plot: {out / 'idle_fractions.png'}")


if __name__ == "__main__":
    main()
