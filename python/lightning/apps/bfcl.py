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


def category_cases(category: str) -> list[dict[str, Any]]:
    """The category's test cases as BFCL ships them (``id``, ``question``, ``function``)."""
    path = data_dir() / f"BFCL_v4_{category}.json"
    if not path.exists():
        raise FileNotFoundError(f"BFCL {BFCL_EVAL} has no category {category!r} ({path})")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def category_ids(category: str) -> list[str]:
    return [c["id"] for c in category_cases(category)]


def case_text(case: dict[str, Any]) -> str:
    """What decontamination compares: the user turns, then each function's name,
    description and parameter names. A held-out function reused in a training case
    shares its description's n-grams even when the question differs."""
    turns = case.get("question") or []
    users = [m.get("content", "") for turn in turns for m in turn if m.get("role") == "user"]
    funcs = [
        " ".join(
            [
                f.get("name", ""),
                f.get("description", ""),
                *sorted((f.get("parameters") or {}).get("properties", {})),
            ]
        )
        for f in case.get("function") or []
    ]
    return "\n".join(str(x) for x in users + funcs)


def decontaminate_cases(
    train: Sequence[dict[str, Any]], held_out: Sequence[dict[str, Any]], *, n: int = 8
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Train cases that share no word ``n``-gram with any held-out case, by
    ``lightning data``'s own stage (:func:`lightning.data.clean.decontaminate`), and
    what it removed: each dropped train id with the held-out ids it overlaps."""
    from lightning.data.clean import decontaminate, word_ngrams

    as_task = [{"id": c["id"], "prompt": case_text(c)} for c in train]
    held_tasks = [{"id": c["id"], "prompt": case_text(c)} for c in held_out]
    kept_tasks, stage = decontaminate(as_task, held_tasks, n=n)
    kept_ids = {t["id"] for t in kept_tasks}
    held_grams = [(t["id"], word_ngrams(t["prompt"], n)) for t in held_tasks]
    removed = []
    for t in as_task:
        if t["id"] in kept_ids:
            continue
        grams = word_ngrams(t["prompt"], n)
        hits = [hid for hid, g in held_grams if not g.isdisjoint(grams)]
        shared = min(grams & next(g for hid, g in held_grams if hid == hits[0]))
        removed.append({"id": t["id"], "held_out": hits, "shared": " ".join(shared)})
    report = {
        "stage": "lightning.data.clean.decontaminate",
        "ngram": n,
        "train_in": stage.n_in,
        "train_out": stage.n_out,
        "held_out": len(held_out),
        "removed": removed,
    }
    return [c for c in train if c["id"] in kept_ids], report


def write_tasks(
    out: Path,
    *,
    train: Sequence[str],
    held_out: Sequence[str],
    per_category: int,
    seed: int,
    ngram: int = 8,
    extra: dict[str, Any] | None = None,
    train_extra: dict[str, Any] | None = None,
) -> dict[str, int]:
    """``train.jsonl`` and ``eval.jsonl`` of ``{"id", "category", **extra}`` (train rows
    also get ``train_extra``, e.g. the shaped-reward flag evals never carry): a seeded
    sample of ``per_category`` test ids from each category (train and held-out
    categories are disjoint, so no test case is in both), then train decontaminated
    against held-out (``decontaminate.json`` says what went; ``ngram=0`` skips it)."""
    if set(train) & set(held_out):
        raise ValueError(f"categories both trained and held out: {set(train) & set(held_out)}")
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    picked: dict[str, list[dict[str, Any]]] = {}
    for name, cats in (("train", train), ("eval", held_out)):
        picked[name] = []
        for cat in cats:
            cases = category_cases(cat)
            chosen = sorted(rng.sample(range(len(cases)), min(per_category, len(cases))))
            picked[name] += [{**cases[i], "category": cat} for i in chosen]
    counts = {"sampled_train": len(picked["train"])}
    if ngram > 0:
        picked["train"], report = decontaminate_cases(picked["train"], picked["eval"], n=ngram)
        (out / "decontaminate.json").write_text(json.dumps(report, indent=2) + "\n")
        counts["decontaminated"] = len(report["removed"])
    for name, cases in picked.items():
        more = {**(extra or {}), **((train_extra or {}) if name == "train" else {})}
        rows = [{"id": c["id"], "category": c["category"], **more} for c in cases]
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
    out: dict[str, Any] = {"rollout_ids": {}}
    for label, batch in (("before", evals[:n]), ("after", evals[-n:])):
        out["rollout_ids"][label] = [r["rollout_id"] for r in batch]
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


def official_scores(
    results_dir: Path, rollout_ids: Sequence[str], dest: Path, harness: Path
) -> dict[str, Any]:
    """BFCL's own ``bfcl evaluate`` over the result lines the harness kept for
    ``rollout_ids`` (one per held-out case): its per-category score files land under
    ``dest/score`` exactly as for a leaderboard run, and their headers come back."""
    by_file: dict[str, list[tuple[str, str]]] = {}
    ids: dict[str, list[str]] = {}
    for rid in rollout_ids:
        path = results_dir / f"{rid}.json"
        if not path.exists():  # a rollout that failed before BFCL wrote its result
            continue
        saved = json.loads(path.read_text())
        by_file.setdefault(saved["relpath"], []).append((saved["id"], saved["result"]))
        ids.setdefault(saved["category"], []).append(saved["id"])
    if not ids:
        raise ValueError(f"no kept BFCL results for {len(rollout_ids)} rollouts in {results_dir}")
    dest.mkdir(parents=True, exist_ok=True)
    for rel, lines in by_file.items():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_text("".join(line + "\n" for _, line in sorted(lines)))
    (dest / "test_case_ids_to_generate.json").write_text(json.dumps(ids))
    done = subprocess.run(
        [str(bfcl_python(quiet=True)), str(harness), "--evaluate", str(dest)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"bfcl evaluate failed in {dest}:\n{done.stderr[-3000:]}")
    scores: dict[str, Any] = {}
    for cat in sorted(ids):
        (score_file,) = (dest / "score").rglob(f"BFCL_v4_{cat}_score.json")
        header = json.loads(score_file.read_text().splitlines()[0])
        scores[cat] = {**header, "file": str(score_file)}
    return scores


def _interval_dict(iv: Any, cases: int) -> dict[str, float]:
    return {"score": iv.mean, "ci_low": iv.low, "ci_high": iv.high, "cases": cases}


def table(summary: dict[str, Any]) -> str:
    lines = ["| category | cases | before | after |", "|---|---|---|---|"]
    for cat, b in summary["before"].items():
        a = summary["after"][cat]
        fmt = "{score:.3f} ({ci_low:.3f}-{ci_high:.3f})".format
        lines.append(f"| {cat} | {b['cases']} | {fmt(**b)} | {fmt(**a)} |")
    return "\n".join(lines)


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def report_md(summary: dict[str, Any], out: Path, seed: int, steps: int) -> str:
    """The run's page: our scores with intervals, BFCL's own score files beside them
    (linked, relative to ``out``), and what decontamination removed."""
    lines = [f"# BFCL v4 held-out, seed {seed}, {steps} steps", "", table(summary), ""]
    if summary.get("shaped_train_reward"):
        lines += [
            "Trained on a shaped reward (partial credit by BFCL's error type, "
            "`bfcl_harness.shaped_reward`); every score on this page is BFCL's own 0/1.",
            "",
        ]
    lines += ["## BFCL's own `bfcl evaluate` score files", ""]
    lines += ["| moment | category | accuracy | correct / total | file |", "|---|---|---|---|---|"]
    for label, cats in summary.get("official", {}).items():
        for cat, h in cats.items():
            rel = os.path.relpath(h["file"], out)
            lines.append(
                f"| {label} | {cat} | {h['accuracy']:.3f} | "
                f"{h['correct_count']} / {h['total_count']} | [{rel}]({rel}) |"
            )
    dec = summary.get("decontamination")
    lines += ["", "## Decontamination (train against held-out)", ""]
    if dec is None:
        lines.append("off (`--decontaminate-ngram 0`)")
    else:
        lines.append(
            f"{dec['ngram']}-word n-grams of question + function docs: "
            f"{dec['train_in']} train cases in, {dec['train_out']} kept, "
            f"{len(dec['removed'])} removed."
        )
        for r in dec["removed"][:10]:
            lines.append(f'- `{r["id"]}` ~ `{", ".join(r["held_out"][:3])}`: "{r["shared"]}"')
    return "\n".join(lines) + "\n"


def recipe(args: argparse.Namespace) -> int:
    from lightning.config import RunConfig
    from lightning.run.loop import train

    t0 = time.monotonic()
    print(f"BFCL environment: {bfcl_python()}", flush=True)
    out = Path(args.output_dir or f"runs/bfcl-seed{args.seed}")
    tasks_dir = out / "tasks"
    results_dir = (out / "bfcl-results").resolve()
    extra: dict[str, Any] = {"results_dir": str(results_dir)}
    if args.max_tokens is not None:
        extra["max_tokens"] = args.max_tokens
    counts = write_tasks(
        tasks_dir,
        train=args.train.split(","),
        held_out=args.held_out.split(","),
        per_category=args.per_category,
        seed=args.seed,
        ngram=args.decontaminate_ngram,
        extra=extra,
        train_extra={"shaped": True} if args.shaped_train_reward else None,
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
    harness = Path(args.config).resolve().parent / "bfcl_harness.py"
    summary["official"] = {
        label: official_scores(results_dir, ids, out / "official" / label, harness)
        for label, ids in summary["rollout_ids"].items()
    }
    summary["decontamination"] = _read_json(tasks_dir / "decontaminate.json")
    summary["config"] = str(args.config)
    summary["seed"] = args.seed
    summary["shaped_train_reward"] = bool(args.shaped_train_reward)
    summary["steps"] = config.steps
    summary["wall_clock_s"] = round(time.monotonic() - t0, 1)
    summary["run"] = result
    (out / "bfcl.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "bfcl.md").write_text(report_md(summary, out, args.seed, config.steps))
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
    r.add_argument("--max-tokens", type=int, help="cap each answer (ours, not the leaderboard's)")
    r.add_argument(
        "--decontaminate-ngram", type=int, default=8, help="word n-gram size; 0 skips it"
    )
    r.add_argument(
        "--shaped-train-reward",
        action="store_true",
        help="train on partial credit from BFCL's error type (examples/bfcl/bfcl_harness.py "
        "shaped_reward); held-out scores stay BFCL's 0/1",
    )
    args = p.parse_args(argv)
    if args.cmd == "setup":
        print(bfcl_python())
        return 0
    return recipe(args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
