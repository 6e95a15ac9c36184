"""BFCL v4 (the Berkeley Function Calling Leaderboard) through its own harness and checker.

``bfcl-eval`` pins heavy dependencies (``numpy==1.26.4``, sentence-transformers and
so torch, faiss), so it lives in an environment of its own under
``$LIGHTNING_CACHE/bfcl-venv`` and runs only as the harness process, never in the
trainer's interpreter. It is installed ``--no-deps`` at a pinned version, plus the
packages its generation and checker import chains need (found by importing
``bfcl_eval.__main__``, which loads every model handler, and the checker). Left out:
sentence-transformers and faiss-cpu, imported only by the ``memory`` category's
vector backend, which needs outside services anyway.

``python -m lightning.apps.bfcl setup`` creates it; ``examples/bfcl/harness.sh``
runs ``examples/bfcl/bfcl_harness.py`` in it, one BFCL test case per rollout.
``tasks`` writes the train/held-out split (test ids by category, from the data
inside the wheel), ``summary`` reads a run's store and scores the held-out set per
category before and after training (BFCL's checker gave every reward), and
``recipe`` does all of it around ``lightning train`` (``make recipe-bfcl``).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning.model_cache import cache_dir

# The newest release on PyPI when this was written (2026-03-23).
BFCL_EVAL = "bfcl-eval==2026.3.23"
# bfcl-eval's own requirements (its pins kept), less sentence-transformers and
# faiss-cpu; soundfile is what qwen-agent's import needs on top.
BFCL_DEPS = [
    "requests",
    "tqdm",
    "numpy==1.26.4",
    "pandas<3",
    "huggingface_hub",
    "pydantic>=2.8.2",
    "python-dotenv>=1.0.1",
    "tree_sitter==0.21.3",
    "tree-sitter-java==0.21.0",
    "tree-sitter-javascript==0.21.4",
    "openai>=1.86.0",
    "mistralai==1.7.0",
    "anthropic>=0.75.0",
    "cohere==5.18.0",
    "typer>=0.12.5",
    "tabulate>=0.9.0",
    "datamodel-code-generator==0.25.7",
    "google-genai>=1.52.0",
    "qwen-agent",
    "soundfile",
    "mpmath==1.3.0",
    "tenacity>=8.5.0",
    "writer-sdk>=2.1.0",
    "overrides",
    "boto3",
    "beautifulsoup4",
    "html2text",
    "rank_bm25==0.2.2",
    "google-search-results",
    "networkx==3.3",
    "filelock==3.20.0",
]
# What must import for generation (every handler) and scoring (the checker).
IMPORT_CHECK = (
    "import bfcl_eval.__main__, bfcl_eval.eval_checker.eval_runner, "
    "bfcl_eval.model_handler.api_inference.openai_completion"
)


def venv_dir() -> Path:
    return cache_dir() / "bfcl-venv"


def bfcl_python(*, quiet: bool = False) -> Path:
    """The interpreter of BFCL's cached environment, created on first use (needs PyPI once)."""
    env = venv_dir()
    python = env / "bin" / "python"
    marker = env / (BFCL_EVAL + ".installed")
    env.parent.mkdir(parents=True, exist_ok=True)
    with open(env.parent / "bfcl-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent callers install once
        if marker.exists() and python.exists():
            return python
        if not python.exists():
            _run([sys.executable, "-m", "venv", str(env)], quiet)
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        _run([*pip, "--no-deps", BFCL_EVAL], quiet)
        _run([*pip, *BFCL_DEPS], quiet)
        _run([str(python), "-c", IMPORT_CHECK], quiet)
        marker.write_text("")
    return python


def _run(cmd: list[str], quiet: bool) -> None:
    if not quiet:
        print("+", " ".join(cmd[:6]), "..." if len(cmd) > 6 else "", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"setting up BFCL's environment failed ({' '.join(cmd)}):\n"
            f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}\n"
            f"It needs PyPI once; remove {venv_dir()} to retry from scratch."
        )


def data_dir() -> Path:
    """BFCL's test data, as shipped inside the pinned wheel."""
    python = bfcl_python(quiet=True)
    out = subprocess.run(
        [str(python), "-c", "import bfcl_eval, os; print(os.path.dirname(bfcl_eval.__file__))"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip()) / "data"


def category_ids(category: str) -> list[str]:
    path = data_dir() / f"BFCL_v4_{category}.json"
    if not path.exists():
        raise FileNotFoundError(f"BFCL {BFCL_EVAL} has no category {category!r} ({path})")
    return [json.loads(line)["id"] for line in path.read_text().splitlines() if line.strip()]


def write_tasks(
    out: Path, *, train: Sequence[str], held_out: Sequence[str], per_category: int, seed: int
) -> dict[str, int]:
    """``train.jsonl`` and ``eval.jsonl`` of ``{"id", "category"}``: a seeded sample of
    ``per_category`` test ids from each category (train and held-out categories are
    disjoint, so no test case is in both)."""
    if set(train) & set(held_out):
        raise ValueError(f"categories both trained and held out: {set(train) & set(held_out)}")
    rng = random.Random(seed)
    counts = {}
    out.mkdir(parents=True, exist_ok=True)
    for name, cats in (("train", train), ("eval", held_out)):
        rows = []
        for cat in cats:
            ids = category_ids(cat)
            picked = sorted(rng.sample(ids, min(per_category, len(ids))), key=ids.index)
            rows += [{"id": i, "category": cat} for i in picked]
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        counts[name] = len(rows)
    return counts


def summarize(run_dir: Path, eval_tasks: int, samples: int = 1) -> dict[str, Any]:
    """Held-out BFCL scores per category, before and after training, from the run's
    store: the first and the last eval of ``eval_tasks`` x ``samples`` rollouts."""
    from lightning.gateway.store import Store
    from lightning.run.stats import reward_interval

    with Store(run_dir / "lightning.db") as store:
        evals = [r for r in store.rollouts() if r.get("mode") == "eval"]
    n = eval_tasks * samples
    if len(evals) < 2 * n:
        raise ValueError(f"{run_dir} holds {len(evals)} eval rollouts, expected 2 x {n}")
    out: dict[str, Any] = {}
    for label, batch in (("before", evals[:n]), ("after", evals[-n:])):
        by_cat: dict[str, dict[str, list[float]]] = {}
        for r in batch:
            task = r["task"]
            reward = float(r["reward"]) if r["reward"] is not None else 0.0
            by_cat.setdefault(task["category"], {}).setdefault(task["id"], []).append(reward)
        by_cat["all"] = {k: v for d in list(by_cat.values()) for k, v in d.items()}
        out[label] = {
            cat: _interval_dict(reward_interval(d), len(d)) for cat, d in sorted(by_cat.items())
        }
    return out


def _interval_dict(iv: Any, cases: int) -> dict[str, float]:
    return {"score": iv.mean, "ci_low": iv.low, "ci_high": iv.high, "cases": cases}


def table(summary: dict[str, Any]) -> str:
    lines = ["| category | cases | before | after |", "|---|---|---|---|"]
    for cat, b in summary["before"].items():
        a = summary["after"][cat]
        fmt = "{score:.3f} ({ci_low:.3f}-{ci_high:.3f})".format
        lines.append(f"| {cat} | {b['cases']} | {fmt(**b)} | {fmt(**a)} |")
    return "\n".join(lines)


def recipe(args: argparse.Namespace) -> int:
    from lightning.config import RunConfig
    from lightning.run.loop import train

    t0 = time.monotonic()
    print(f"BFCL environment: {bfcl_python()}", flush=True)
    out = Path(args.output_dir or f"runs/bfcl-seed{args.seed}")
    tasks_dir = out / "tasks"
    counts = write_tasks(
        tasks_dir,
        train=args.train.split(","),
        held_out=args.held_out.split(","),
        per_category=args.per_category,
        seed=args.seed,
    )
    print(f"tasks: {counts} in {tasks_dir}", flush=True)
    overrides: dict[str, Any] = {
        "output_dir": str((out / "run").resolve()),
        "seed": args.seed,
        "tasks": {
            "train": str((tasks_dir / "train.jsonl").resolve()),
            "eval": str((tasks_dir / "eval.jsonl").resolve()),
        },
    }
    if args.steps is not None:
        overrides["steps"] = args.steps
    config = RunConfig.load(args.config, overrides)
    result = train(config)
    summary = summarize(out / "run", counts["eval"], config.algorithm.eval_samples)
    summary["config"] = str(args.config)
    summary["seed"] = args.seed
    summary["steps"] = config.steps
    summary["wall_clock_s"] = round(time.monotonic() - t0, 1)
    summary["run"] = result
    (out / "bfcl.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "bfcl.md").write_text(
        f"# BFCL v4 held-out, seed {args.seed}, {config.steps} steps\n\n{table(summary)}\n"
    )
    print(table(summary))
    print(f"wrote {out / 'bfcl.json'} and {out / 'bfcl.md'} ({summary['wall_clock_s']} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lightning.apps.bfcl", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("setup", help="create BFCL's cached environment; print its interpreter")
    r = sub.add_parser("recipe", help="set up, measure held-out, train, measure again")
    r.add_argument("--config", default="examples/bfcl/recipe.toml")
    r.add_argument("--train", default="live_simple,live_multiple")
    r.add_argument("--held-out", default="simple_python,multiple")
    r.add_argument("--per-category", type=int, default=20)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--steps", type=int)
    r.add_argument("--output-dir")
    args = p.parse_args(argv)
    if args.cmd == "setup":
        print(bfcl_python())
        return 0
    return recipe(args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
