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
import contextlib
import fcntl
import hashlib
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

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


# The harness's Unix socket for a pool of workers (examples/bfcl/bfcl_harness.py).
WORKERS_ENV = "LIGHTNING_BFCL_WORKERS"


@contextlib.contextmanager
def workers(count: int, harness_py: Path) -> Iterator[str]:
    """A pool of ``count`` BFCL workers for the duration: each imports BFCL once
    (~4.4 s of CPU, which a process per rollout paid every time, more than the
    engine spends on a case) and then runs cases from one shared listening
    socket. The rollouts' harness processes find it through
    ``LIGHTNING_BFCL_WORKERS`` (set here for the runner to pass down) and stay
    the rollouts: they get the gateway URL and token, wait for their case and
    print its reward line; only the BFCL code runs in the worker."""
    python = bfcl_python(quiet=True)
    sock_dir = Path(tempfile.mkdtemp(prefix="bfcl-workers-"))
    path = str(sock_dir / "socket")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(256)
    fd = str(listener.fileno())
    argv = [str(python), str(harness_py), "--serve-fd", fd, "--serve-dir", str(sock_dir)]
    procs = [
        subprocess.Popen(
            argv,
            pass_fds=[listener.fileno()],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(count)
    ]
    before = os.environ.get(WORKERS_ENV)
    os.environ[WORKERS_ENV] = path
    try:
        yield path
    finally:
        if before is None:
            os.environ.pop(WORKERS_ENV, None)
        else:
            os.environ[WORKERS_ENV] = before
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        listener.close()
        shutil.rmtree(sock_dir, ignore_errors=True)


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


# ------------------------------------------------------------------ recipe v2

# Never trained on: it repeats 195 simple_python questions (the held-out set).
NEVER_TRAIN = "unused_datasets/question/BFCL_v4_chatable.json"
SPLIT_RULE = (
    "held out: a seeded sample of each held-out category; train pool: every case of the "
    "train categories except those that (1) declare a function whose name a held-out case "
    "declares, (2) ask a user question whose text (lowercased, whitespace collapsed) a "
    "held-out case asks, or (3) share a word {n}-gram of question + function docs with a "
    "held-out case (lightning.data.clean.decontaminate); never " + NEVER_TRAIN
)
MIN_PRIMARY = 100  # fewer held-out simple_python cases cannot tell arms apart


def function_names(case: dict[str, Any]) -> set[str]:
    return {str(f.get("name", "")) for f in case.get("function") or []}


def question_texts(case: dict[str, Any]) -> set[str]:
    turns = case.get("question") or []
    return {
        " ".join(str(m.get("content", "")).lower().split())
        for turn in turns
        for m in turn
        if m.get("role") == "user"
    }


def split_cases(
    held_out: dict[str, list[dict[str, Any]]],
    train: dict[str, list[dict[str, Any]]],
    *,
    primary: str = "simple_python",
    ngram: int = 8,
) -> dict[str, Any]:
    """The v2 split of given cases (``SPLIT_RULE``): which train cases stay, which
    go and why (the first rule that applies), overlap counts per rule, and a
    sha256 over the ids. Raises ``ValueError`` with fewer than ``MIN_PRIMARY``
    held-out ``primary`` cases or a category on both sides."""
    if set(held_out) & set(train):
        raise ValueError(f"categories both trained and held out: {set(held_out) & set(train)}")
    if any("chatable" in c for c in train):
        raise ValueError(f"never train on {NEVER_TRAIN}: it repeats simple_python questions")
    if len(held_out.get(primary, [])) < MIN_PRIMARY:
        raise ValueError(
            f"{len(held_out.get(primary, []))} held-out {primary} cases; the recipe needs at "
            f"least {MIN_PRIMARY} (the same ids for every arm)"
        )
    held = [c for cases in held_out.values() for c in cases]
    held_names = set().union(*(function_names(c) for c in held)) - {""}
    held_questions = set().union(*(question_texts(c) for c in held)) - {""}
    pool = [c for cases in train.values() for c in cases]
    _, ngram_report = decontaminate_cases(pool, held, n=ngram) if ngram > 0 else ([], None)
    ngram_hits = {r["id"]: r["held_out"] for r in (ngram_report or {}).get("removed", [])}
    counts = {"function_name": 0, "question_text": 0, "ngram": 0}
    dropped, kept = [], {cat: [] for cat in train}
    for cat, cases in train.items():
        for c in cases:
            names = function_names(c) & held_names
            questions = question_texts(c) & held_questions
            hits = {
                "function_name": bool(names),
                "question_text": bool(questions),
                "ngram": c["id"] in ngram_hits,
            }
            for rule, hit in hits.items():
                counts[rule] += hit
            reason = next((rule for rule, hit in hits.items() if hit), None)
            if reason is None:
                kept[cat].append(c["id"])
            else:
                dropped.append(
                    {
                        "id": c["id"],
                        "reason": reason,
                        "functions": sorted(names),
                        "held_out": ngram_hits.get(c["id"], [])[:3],
                    }
                )
    ids = {
        "held_out": {cat: [c["id"] for c in cases] for cat, cases in held_out.items()},
        "train_pool": kept,
    }
    digest = hashlib.sha256(json.dumps(ids, sort_keys=True).encode()).hexdigest()
    return {
        **ids,
        "rule": SPLIT_RULE.format(n=ngram),
        "overlap": {**counts, "dropped": len(dropped), "train_in": len(pool)},
        "dropped": dropped,
        "never_trained": [NEVER_TRAIN],
        "sha256": digest,
    }


def write_split(
    out: Path,
    *,
    held_out: dict[str, int],
    train: Sequence[str],
    seed: int,
    ngram: int = 8,
) -> dict[str, Any]:
    """``split.json`` (the manifest, with BFCL's version and the seed) for held-out
    categories sampled to the given sizes (0: all) and whole train categories."""
    rng = random.Random(seed)
    held_cases = {}
    for cat, n in held_out.items():
        cases = category_cases(cat)
        picks = (
            sorted(rng.sample(range(len(cases)), n)) if 0 < n < len(cases) else range(len(cases))
        )
        held_cases[cat] = [cases[i] for i in picks]
    manifest = split_cases(held_cases, {cat: category_cases(cat) for cat in train}, ngram=ngram)
    manifest = {"bfcl_eval": BFCL_EVAL, "seed": seed, **manifest}
    out.mkdir(parents=True, exist_ok=True)
    (out / "split.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def sft_examples(ids: dict[str, list[str]], out: Path, script: Path) -> dict[str, Any]:
    """``out`` (JSONL for ``lightning sft``): BFCL's own prompts for ``ids`` with the
    gold answer as the assistant turn (``examples/bfcl/sft_data.py`` in BFCL's
    environment); targets BFCL's checker would not accept are left out and counted."""
    raw = out.with_suffix(".bfcl.jsonl")
    ids_file = out.with_suffix(".ids.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    ids_file.write_text(json.dumps(ids))
    done = subprocess.run(
        [str(bfcl_python(quiet=True)), str(script), str(ids_file), str(raw)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"building SFT data in BFCL's environment failed:\n{done.stderr[-3000:]}"
        )
    rows = [json.loads(line) for line in raw.read_text().splitlines()]
    good = [r for r in rows if r["gold_valid"]]
    out.write_text(
        "".join(json.dumps({"messages": r["messages"], "id": r["id"]}) + "\n" for r in good)
    )
    return {
        "examples": len(good),
        "gold_rejected": [(r["id"], r["gold_error"]) for r in rows if not r["gold_valid"]],
    }


def mcnemar(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """Exact McNemar test of paired 0/1 outcomes (the same cases under two arms):
    the discordant pairs (``a`` wrong, ``b`` right: ``b_wins``; the reverse:
    ``a_wins``) and the two-sided binomial p-value under "either is equally likely"."""
    if len(a) != len(b):
        raise ValueError(f"paired outcomes need equal lengths, got {len(a)} and {len(b)}")
    b_wins = sum(1 for x, y in zip(a, b, strict=True) if x < 0.5 <= y)
    a_wins = sum(1 for x, y in zip(a, b, strict=True) if y < 0.5 <= x)
    n, k = a_wins + b_wins, min(a_wins, b_wins)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n if n else 1.0
    return {"a_wins": a_wins, "b_wins": b_wins, "p_value": min(1.0, 2 * tail)}


def paired_difference(
    a: Sequence[float],
    b: Sequence[float],
    *,
    confidence: float = 0.95,
    resamples: int = 4000,
    seed: int = 0,
) -> dict[str, Any]:
    """mean(b) − mean(a) over the same cases, with a paired bootstrap interval
    (cases resampled with replacement, each keeping both its outcomes) and
    McNemar's exact test."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)  # [N]
    if x.shape != y.shape or not len(x):
        raise ValueError("paired outcomes need the same, non-zero number of cases")
    d = y - x  # [N]
    picks = np.random.default_rng(seed).integers(0, len(d), size=(resamples, len(d)))  # [R, N]
    means = d[picks].mean(axis=1)  # [R]
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return {
        "diff": float(d.mean()),
        "low": float(low),
        "high": float(high),
        "n": len(d),
        **mcnemar(a, b),
    }


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


# -------------------------------------------------------- recipe v2: the flow

HELD_OUT_SENTENCE = "held-out BFCL categories, not BFCL overall, not leaderboard-comparable"


def last_json(text: str) -> dict[str, Any]:
    """The harness's final ``{"reward", "bfcl"}`` line ({} if it printed none)."""
    for line in reversed(text.splitlines()):
        try:
            out = json.loads(line)
        except ValueError:
            continue
        if isinstance(out, dict):
            return out
    return {}


def made_call(category: str, error_type: str | None, reward: float) -> bool:
    """Whether BFCL's decoder read the answer as calls: on an AST category any
    verdict but ``ast_decoder:*`` (None = right); on ``irrelevance`` the one
    verdict that says a call was decoded (there, a call is the mistake)."""
    if "irrelevance" in category:
        return error_type == "irrelevance_error:decoder_success"
    return reward >= 1.0 or not (error_type or "ast_decoder:").startswith("ast_decoder:")


def score_model(
    model_dir: Path,
    tasks: Sequence[dict[str, Any]],
    out: Path,
    *,
    harness: Path,
    samples: int = 1,
    concurrency: int = 8,
    max_model_len: int = 4096,
    max_batch: int = 8,
    kv_cache_bytes: int | None = None,
) -> dict[str, Any]:
    """Every task ``samples`` times through BFCL's harness (``bfcl generate`` +
    ``bfcl evaluate`` per case, in a pool of ``concurrency`` workers that import
    BFCL once) on the embedded engine serving ``model_dir``,
    behind a recording gateway (its store in ``out``). Per test id: the rewards
    (BFCL's 0/1), its checker's verdicts, whether each answer was a call."""
    from lightning import Gateway, GatewayConfig
    from lightning.run.loop import EmbeddedEngine
    from lightning.run.runner import Runner

    out.mkdir(parents=True, exist_ok=True)
    engine = EmbeddedEngine(
        model_dir, host="127.0.0.1", port=0, max_batch=max_batch, dtype="float32",
        threads=None, log_path=out / "engine.log", max_model_len=max_model_len,
        kv_cache_bytes=kv_cache_bytes,
    )  # fmt: skip
    t0 = time.monotonic()
    try:
        engine.wait_ready(600)
        config = GatewayConfig(
            listen="127.0.0.1:0",
            upstreams=[{"url": engine.url, "weight_version": 0}],
            upstream_api_key=engine.key,  # the engine takes only requests with its key
            db=str(out / "lightning.db"),
        )
        handle = Gateway(config).start()
        client = handle.client()
        try:
            runner = Runner(
                client, ["sh", str(harness)], reward_source="stdout", timeout_s=900,
                concurrency=concurrency,
            )  # fmt: skip
            jobs = [(t, f"{t['id']}") for t in tasks for _ in range(samples)]
            with workers(concurrency, harness.parent / "bfcl_harness.py"):
                results = runner.run(jobs, mode="eval")
        finally:
            client.close()
            handle.stop()
    finally:
        engine.stop()
    failed = [r for r in results if r.status != "succeeded"]
    if failed:
        # A case the harness could not run is not a wrong answer: say so, and
        # refuse to score an arm where none ran.
        print(
            f"[bfcl] {len(failed)} of {len(results)} cases did not run through BFCL's "
            f"harness; the first said:\n{failed[0].stderr_tail[-1500:]}",
            flush=True,
        )
        if len(failed) == len(results):
            raise SystemExit(f"no case ran through BFCL's harness (serving {model_dir})")
    per_id: dict[str, dict[str, Any]] = {}
    for (task, _), r in zip(jobs, results, strict=True):
        verdict = last_json(r.stdout_tail).get("bfcl", {}).get("error_type")
        reward = float(r.reward) if r.reward is not None else 0.0
        row = per_id.setdefault(
            task["id"], {"category": task["category"], "rewards": [], "calls": [], "verdicts": []}
        )
        row["rewards"].append(reward)
        row["calls"].append(made_call(task["category"], verdict, reward))
        row["verdicts"].append(verdict if r.status == "succeeded" else f"harness:{r.status}")
    return {
        "per_id": per_id,
        "harness_failed": len(failed),
        "rollout_ids": [r.rollout_id for r in results],
        "wall_s": round(time.monotonic() - t0, 1),
    }


def arm_table(arms: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per arm and held-out category: n, accuracy with its 95% bootstrap interval
    over cases, and the rate of answers BFCL's decoder read as calls."""
    from lightning.run.stats import reward_interval

    out: dict[str, dict[str, Any]] = {}
    for arm, scored in arms.items():
        by_cat: dict[str, dict[str, Any]] = {}
        for tid, row in scored["per_id"].items():
            by_cat.setdefault(row["category"], {})[tid] = row
        out[arm] = {}
        for cat, rows in sorted(by_cat.items()):
            iv = reward_interval({t: r["rewards"] for t, r in rows.items()})
            calls = [c for r in rows.values() for c in r["calls"]]
            out[arm][cat] = {
                "n": len(rows), "accuracy": iv.mean, "ci_low": iv.low, "ci_high": iv.high,
                "call_rate": sum(calls) / len(calls),
            }  # fmt: skip
    return out


def paired_rows(
    arms: dict[str, dict[str, Any]], pairs: Sequence[tuple[str, str]], category: str
) -> dict[str, Any]:
    """``b − a`` on ``category``'s cases both arms scored (greedy: one sample each)."""
    out = {}
    for a, b in pairs:
        if a not in arms or b not in arms:
            continue
        pa, pb = arms[a]["per_id"], arms[b]["per_id"]
        ids = sorted(t for t in pa if pa[t]["category"] == category and t in pb)
        if ids:
            out[f"{b} - {a}"] = paired_difference(
                [pa[t]["rewards"][0] for t in ids], [pb[t]["rewards"][0] for t in ids]
            )
    return out


# The paired differences every page reports, on simple_python: (a, b) for b − a.
PAIRS = [("base", "sft"), ("sft", "sft+rl"), ("control", "sft+rl")]


def _score_cells(r: dict[str, Any]) -> str:
    """An arm-table row's cells after the category: n, accuracy (CI), call rate."""
    return (
        f"{r['n']} | {r['accuracy']:.3f} ({r['ci_low']:.3f}-{r['ci_high']:.3f}) | "
        f"{r['call_rate']:.3f} |"
    )


def _paired_text(d: dict[str, Any]) -> str:
    """A paired difference with its interval, n, the discordant wins and McNemar's p."""
    return (
        f"{d['diff']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}], n={d['n']}, "
        f"wins {d['b_wins']} vs {d['a_wins']}, p={d['p_value']:.3g}"
    )


def _zero_mark(d: dict[str, Any]) -> str:
    return " (interval includes 0)" if d["low"] <= 0 <= d["high"] else ""


def report_v2(summary: dict[str, Any]) -> str:
    """The recipe's page: the arms' held-out scores, the paired differences, the
    learnable fraction, what each phase cost, and the sentence that bounds it."""
    lines = [
        f"# BFCL recipe v2, seed {summary['seed']}",
        "",
        f"Scores on {HELD_OUT_SENTENCE}; greedy, answers capped at "
        f"{summary['max_tokens']} tokens, BFCL's own checker.",
        "",
        "| arm | category | n | accuracy (95% CI) | call rate |",
        "|---|---|---|---|---|",
    ]
    for arm, cats in summary.get("table", {}).items():
        for cat, r in cats.items():
            lines.append(f"| {arm} | {cat} | {_score_cells(r)}")
    lines += ["", "Paired differences (same cases; bootstrap 95% CI; exact McNemar):", ""]
    for name, d in summary.get("paired", {}).items():
        lines.append(f"- {name}: {_paired_text(d)}{_zero_mark(d)}")
    learn = summary.get("learnability")
    if learn:
        lines += [
            "",
            f"Learnability filter: {learn['kept']} of {learn['prompts']} training prompts had "
            f"0 < correct < {learn['samples']} ({learn['kept'] / max(1, learn['prompts']):.2f}).",
        ]
        k = f"pass@{learn['samples']}"
        if k in learn:
            lines.append(
                f"On those prompts at temperature 1.0 the SFT model had pass@1 "
                f"{learn['pass@1']:.3f} and {k} {learn[k]:.3f}."
            )
    lines += ["", "| phase | wall clock (s) |", "|---|---|"]
    for phase, secs in summary.get("phases", {}).items():
        lines.append(f"| {phase} | {secs} |")
    return "\n".join(lines) + "\n"


def recipe_v2(args: argparse.Namespace) -> int:
    """Split → SFT data → SFT → learnability filter → GRPO → compute-matched
    control → the four arms scored → report (docs/bfcl.md). ``--phases`` runs a
    prefix of it; each phase's output lands in ``OUT`` and later phases read it."""
    from lightning.config import RunConfig, SftConfig
    from lightning.run.loop import train
    from lightning.run.sft import run_standalone

    here = Path(args.config).resolve().parent
    harness = here / "harness.sh"
    out = Path(args.output_dir or f"runs/bfcl-v2-seed{args.seed}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    phases = args.phases.split(",")
    summary: dict[str, Any] = _read_json(out / "bfcl.json") or {"phases": {}}
    summary.update(seed=args.seed, max_tokens=args.max_tokens)

    def timed(name: str, fn: Any) -> Any:
        t0 = time.monotonic()
        result = fn()
        summary["phases"][name] = round(time.monotonic() - t0, 1)
        (out / "bfcl.json").write_text(json.dumps(summary, indent=2, default=str))
        print(f"[bfcl] {name}: {summary['phases'][name]} s", flush=True)
        return result

    task_extra = {"max_tokens": args.max_tokens}
    if args.shared_from:
        shared_arms = share_run(Path(args.shared_from).resolve(), out)
        summary.setdefault("arms", {}).update(shared_arms)
        summary["shared_from"] = str(Path(args.shared_from).resolve())
    if "split" in phases:
        held = {"simple_python": args.held_out_n, "irrelevance": args.irrelevance_n}
        manifest = timed(
            "split", lambda: write_split(out, held_out=held, train=[args.train], seed=args.seed)
        )
        summary["split"] = {"sha256": manifest["sha256"], "overlap": manifest["overlap"]}
    manifest = json.loads((out / "split.json").read_text())
    pool = manifest["train_pool"][args.train]
    rng = random.Random(args.seed)
    rl_prompts = rng.sample(pool, min(args.filter_prompts, len(pool)))
    if "sft-data" in phases:
        summary["sft_data"] = timed(
            "sft-data",
            lambda: sft_examples({args.train: pool}, out / "sft.jsonl", here / "sft_data.py"),
        )
    sft_dir = out / "sft"
    if "sft" in phases:
        cfg = SftConfig.load(
            here / "sft.toml",
            {"output_dir": str(sft_dir), "seed": args.seed},
        )
        cfg = cfg.model_copy(
            update={"sft": cfg.sft.model_copy(update={"dataset": str(out / "sft.jsonl")})}
        )
        summary["sft"] = timed("sft", lambda: run_standalone(cfg))
    if "filter" in phases:
        tasks = [
            {"id": t, "category": args.train, "temperature": 1.0, **task_extra} for t in rl_prompts
        ]
        scored = timed(
            "filter",
            lambda: score_model(
                sft_dir / "model",
                tasks,
                out / "filter",
                harness=harness,
                samples=args.filter_samples,
                kv_cache_bytes=args.kv_cache_bytes,
            ),
        )
        correct = {t: sum(r["rewards"]) for t, r in scored["per_id"].items()}
        kept = [t for t, c in correct.items() if 0 < c < args.filter_samples]
        # pass@1 (mean correct per sample) against pass@k (any of k right): SFT
        # that left pass@k no higher than pass@1 leaves RL nothing to explore.
        n = max(1, len(correct))
        summary["learnability"] = {
            "prompts": len(correct), "samples": args.filter_samples, "kept": len(kept),
            "pass@1": sum(correct.values()) / (n * args.filter_samples),
            f"pass@{args.filter_samples}": sum(1 for c in correct.values() if c > 0) / n,
            "correct": correct,
        }  # fmt: skip
        (out / "rl_tasks.jsonl").write_text(
            "".join(
                json.dumps({"id": t, "category": args.train, **task_extra}) + "\n" for t in kept
            )
        )
    if "rl" in phases:
        if not summary.get("learnability", {}).get("kept"):
            raise SystemExit("no learnable prompt (0 < correct < 8): GRPO would see no gradient")
        overrides: dict[str, Any] = {
            "output_dir": str(out / "rl"),
            "seed": args.seed,
            "model": {"path": str(sft_dir / "model")},
            # The held-out arms are scored apart (phase score), never inside RL.
            "tasks": {"train": str(out / "rl_tasks.jsonl"), "eval": None},
        }
        if args.rl_steps is not None:
            overrides["steps"] = args.rl_steps
        if args.kv_cache_bytes is not None:
            overrides["engine.kv_cache_bytes"] = args.kv_cache_bytes
        rl_cfg = RunConfig.load(args.config, overrides)
        pool = max(h.concurrency for h in rl_cfg.all_harnesses())
        with workers(pool, here / "bfcl_harness.py"):
            result = timed("rl", lambda: train(rl_cfg))
        summary["rl"] = {"run": result, "train_s": summary["phases"]["rl"]}
    if "control" in phases:
        # SFT continued from the SFT model on the same data for RL's wall clock.
        budget = float(summary.get("rl", {}).get("train_s") or args.control_s or 60.0)
        cfg = SftConfig.load(
            here / "sft.toml", {"output_dir": str(out / "control"), "seed": args.seed}
        )
        cfg = cfg.model_copy(
            update={
                "model": cfg.model.model_copy(
                    update={"path": str(sft_dir / "model"), "builtin": None}
                ),
                "sft": cfg.sft.model_copy(
                    update={
                        "dataset": str(out / "sft.jsonl"),
                        "epochs": 100.0,
                        "max_wall_s": budget,
                    }
                ),
            }
        )
        summary["control"] = timed("control", lambda: run_standalone(cfg))
    if "score" in phases:
        held = [
            {
                "id": t,
                "category": cat,
                "temperature": 0.0,
                "results_dir": str(out / "results" / "ARM"),
                **task_extra,
            }
            for cat, ids in manifest["held_out"].items()
            for t in ids[: args.score_limit or None]
        ]
        arm_models = {
            "base": _builtin_model(),
            "sft": sft_dir / "model",
            "sft+rl": out / "rl" / "checkpoints" / "latest" / "model",
            "control": out / "control" / "model",
        }
        arms = summary.setdefault("arms", {})
        for arm in args.arms.split(","):
            model = arm_models[arm]
            if not (Path(model) / "config.json").exists():
                print(f"[bfcl] arm {arm}: no model at {model}; skipped", flush=True)
                continue
            tasks = [{**t, "results_dir": t["results_dir"].replace("ARM", arm)} for t in held]
            arms[arm] = timed(
                f"score:{arm}",
                lambda m=model, ts=tasks, a=arm: score_model(
                    Path(m),
                    ts,
                    out / "score" / a,
                    harness=harness,
                    kv_cache_bytes=args.kv_cache_bytes,
                ),
            )
    if "report" in phases or "score" in phases:
        arms = summary.get("arms", {})
        summary["table"] = arm_table(arms)
        summary["paired"] = paired_rows(arms, PAIRS, "simple_python")
        (out / "bfcl.md").write_text(report_v2(summary))
        print(report_v2(summary))
    (out / "bfcl.json").write_text(json.dumps(summary, indent=2, default=str))
    return 0


def seeds_report(dirs: Sequence[Path]) -> str:
    """Several seeds' pages in one: each seed's arms and paired differences, and
    the differences pooled over seeds (per case, the mean over seeds of
    ``b − a``; cases resampled as in :func:`paired_difference`; no McNemar test,
    whose outcomes must be 0/1)."""
    runs = [_read_json(d / "bfcl.json") or {} for d in dirs]
    lines = [f"# BFCL recipe v2, seeds {', '.join(str(r.get('seed')) for r in runs)}", ""]
    lines += [
        f"Scores on {HELD_OUT_SENTENCE}.",
        "",
        "| seed | arm | category | n | accuracy (95% CI) | call rate |",
        "|---|---|---|---|---|---|",
    ]
    for run in runs:
        for arm, cats in arm_table(run.get("arms", {})).items():
            for cat, r in cats.items():
                lines.append(f"| {run.get('seed')} | {arm} | {cat} | {_score_cells(r)}")
    lines += ["", "Paired differences on simple_python, per seed and pooled:", ""]
    for a, b in PAIRS:
        per_case: dict[str, list[float]] = {}
        for run in runs:
            arms = run.get("arms", {})
            d = paired_rows(arms, [(a, b)], "simple_python").get(f"{b} - {a}")
            if d is None:
                continue
            lines.append(f"- seed {run.get('seed')}, {b} - {a}: {_paired_text(d)}")
            pa, pb = arms[a]["per_id"], arms[b]["per_id"]
            for t in pa:  # in scoring order: the pooled bootstrap resamples by position
                if pa[t]["category"] == "simple_python" and t in pb:
                    per_case.setdefault(t, []).append(pb[t]["rewards"][0] - pa[t]["rewards"][0])
        both = {t: v for t, v in per_case.items() if len(v) == len(runs)}
        if len(runs) > 1 and both:
            d = paired_difference([0.0] * len(both), [sum(v) / len(v) for v in both.values()])
            lines.append(
                f"- **pooled over {len(runs)} seeds, {b} - {a}: {d['diff']:+.3f} "
                f"[{d['low']:+.3f}, {d['high']:+.3f}]**, n={d['n']}{_zero_mark(d)}"
            )
    lines += ["", "| seed | phase | wall clock (s) |", "|---|---|---|"]
    for run in runs:
        for phase, secs in run.get("phases", {}).items():
            lines.append(f"| {run.get('seed')} | {phase} | {secs} |")
    return "\n".join(lines) + "\n"


def share_run(source: Path, out: Path) -> dict[str, Any]:
    """What a second seed takes from the first (the issue lets the base and SFT
    arms be scored once): its split, SFT data and SFT model (linked, not copied)
    and the base and SFT arms' scores. The seed's own phases (filter, RL,
    control, their arms) then run on the same held-out ids."""
    for name in ("split.json", "sft.jsonl"):
        shutil.copyfile(source / name, out / name)
    link = out / "sft"
    if not link.exists():
        link.symlink_to(source / "sft", target_is_directory=True)
    scored = (_read_json(source / "bfcl.json") or {}).get("arms", {})
    missing = {"base", "sft"} - set(scored)
    if missing:
        raise SystemExit(f"{source} has not scored the arm(s) {sorted(missing)} to share")
    return {arm: scored[arm] for arm in ("base", "sft")}


def phase_argv(given: Sequence[str], phase: str) -> list[str]:
    """The recipe's command line with ``--phases`` replaced by one phase."""
    rest: list[str] = []
    skip = False
    for a in given:
        if skip:
            skip = False
        elif a == "--phases":
            skip = True
        elif not a.startswith("--phases="):
            rest.append(a)
    return [*rest, "--phases", phase]


def _builtin_model() -> Path:
    from lightning.model_cache import smollm2_dir

    return smollm2_dir()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lightning.apps.bfcl", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("setup", help="create BFCL's cached environment; print its interpreter")
    v = sub.add_parser(
        "recipe", help="v2: split, SFT, learnability filter, GRPO, control, four arms scored"
    )
    v.add_argument("--config", default="examples/bfcl/recipe.toml", help="the GRPO run config")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--output-dir")
    v.add_argument("--train", default="live_simple", help="the SFT and RL prompt pool")
    v.add_argument("--held-out-n", type=int, default=200, help="simple_python cases held out")
    v.add_argument("--irrelevance-n", type=int, default=50)
    v.add_argument("--filter-prompts", type=int, default=40, help="RL prompts sampled")
    v.add_argument("--filter-samples", type=int, default=8)
    v.add_argument("--rl-steps", type=int)
    v.add_argument("--control-s", type=float, help="control budget when RL did not run")
    v.add_argument("--max-tokens", type=int, default=96, help="cap per answer (ours)")
    v.add_argument("--score-limit", type=int, help="score only the first N ids per category")
    v.add_argument(
        "--kv-cache-bytes",
        type=int,
        help="the embedded engine's prefix cache budget in the filter, RL and score "
        "phases (0 = off; default: the engine's)",
    )
    v.add_argument("--arms", default="base,sft,sft+rl,control")
    v.add_argument(
        "--shared-from",
        metavar="DIR",
        help="a first seed's output: reuse its split, SFT model and base/SFT arms "
        "(run --phases filter,rl,control,score,report --arms sft+rl,control)",
    )
    v.add_argument(
        "--phases",
        default="split,sft-data,sft,filter,rl,control,score,report",
        help="comma-separated subset, in this order",
    )
    sd = sub.add_parser("seeds", help="several seeds' recipe pages in one table")
    sd.add_argument("dirs", nargs="+", help="the seeds' --output-dir")
    sd.add_argument("--out", help="also write the page here")
    r = sub.add_parser("recipe-v1", help="v1: set up, measure held-out, train, measure again")
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
    if args.cmd == "recipe":
        print(f"BFCL environment: {bfcl_python()}", flush=True)
        phases = args.phases.split(",")
        if len(phases) == 1:
            return recipe_v2(args)
        # One process per phase: a trainer's memory is not given back to the
        # system when it is dropped (13 GB after SFT, GRPO and the control in one
        # process, which the kernel's OOM killer then ended mid-scoring), and
        # each phase reads what the last one wrote to OUT anyway.
        given = list(sys.argv[1:] if argv is None else argv)
        for phase in phases:
            cmd = [sys.executable, "-m", "lightning.apps.bfcl", *phase_argv(given, phase)]
            done = subprocess.run(cmd)
            if done.returncode != 0:
                print(f"[bfcl] phase {phase} failed (exit {done.returncode})", flush=True)
                return done.returncode
        return 0
    if args.cmd == "seeds":
        page = seeds_report([Path(d) for d in args.dirs])
        if args.out:
            Path(args.out).write_text(page)
        print(page)
        return 0
    return recipe(args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
