"""One BFCL v4 test case through BFCL's own generation harness and its own checker.

Runs in BFCL's cached environment (``python -m lightning.apps.bfcl setup``), once
per rollout, launched by ``examples/bfcl/harness.sh``. Nothing of BFCL is patched:

1. BFCL's extension point for a model is its ``MODEL_CONFIG_MAPPING`` (a model id
   -> ``ModelConfig`` with a handler class). We add one entry, ``lightning-policy``,
   whose handler is BFCL's own ``OpenAICompletionsHandler`` in prompt mode
   (``is_fc_model=False``, like the leaderboard's "(Prompt)" entries): BFCL writes
   the function docs into the system prompt, asks chat completions, and parses
   ``[func(arg=...)]`` from the text. That handler reads ``OPENAI_BASE_URL`` and
   ``OPENAI_API_KEY``, which the runner already sets to the rollout's gateway URL
   and token, so every call BFCL makes is recorded for this rollout.
2. ``bfcl generate --model lightning-policy --run-ids --skip-server-setup`` for
   the one test id (``test_case_ids_to_generate.json`` in a private
   ``BFCL_PROJECT_ROOT``), then ``bfcl evaluate --partial-eval`` on its category:
   the score is exactly what BFCL's checker gives that case (1 or 0).
3. The last stdout line is ``{"reward": score, ...}`` (``[reward] source = "stdout"``),
   with BFCL's score and its checker's ``error_type`` for the case under ``"bfcl"``.
   A task with ``"shaped": true`` (training tasks of ``recipe --shaped-train-reward``)
   is rewarded by :func:`shaped_reward` instead; ``"bfcl"`` still holds BFCL's score.

The task is ``LIGHTNING_TASK = {"id": "simple_python_3", "category": "simple_python"}``
(or ``--id ID`` on the command line for a manual run against ``OPENAI_BASE_URL``).
An optional ``"max_tokens"`` in the task caps each answer: BFCL's chat handler sends
none, so a model that answers in prose writes until the context ends (minutes on a
CPU). The cap is ours, not the leaderboard's; it is set through a subclass of BFCL's
handler (its ``generate_with_backoff`` takes the request's keyword arguments).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

MODEL_ID = "lightning-policy"
# Where a pool of workers listens (set by lightning.apps.bfcl.workers): each
# rollout's process then hands its case to a worker that imported BFCL once.
WORKERS_ENV = "LIGHTNING_BFCL_WORKERS"


def served_model(base_url: str, key: str) -> str:
    """The id the engine serves (BFCL sends its config's ``model_name`` verbatim)."""
    req = urllib.request.Request(
        base_url.rstrip("/") + "/models", headers={"Authorization": f"Bearer {key}"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)["data"][0]["id"]


# Partial credit read from BFCL's own verdict (its checker's ``error_type``), for
# training only: a model that never writes ``[func(arg=...)]`` gets no gradient
# from a 0/1 score, and one that writes the right function with a wrong argument
# is closer than one that writes prose. What a user reads stays BFCL's score.
SHAPED_WRONG_ARGS = 0.5  # decoded, the right function, an argument wrong or missing
SHAPED_WRONG_CALL = 0.25  # decoded to calls, but the wrong function or count


def shaped_reward(score: float, error_type: str | None) -> float:
    """1 when BFCL scores the case right; else by BFCL's ``error_type``: 0 when its
    AST decoder found no call, :data:`SHAPED_WRONG_CALL` for the wrong function or
    number of calls, :data:`SHAPED_WRONG_ARGS` for any other mistake (types, values,
    missing or unexpected parameters of the right function)."""
    if score >= 1.0:
        return 1.0
    if not error_type or error_type.startswith("ast_decoder:"):
        return 0.0
    if error_type.endswith((":wrong_func_name", ":wrong_count")):
        return SHAPED_WRONG_CALL
    return SHAPED_WRONG_ARGS


def case_error_type(score_file: Path) -> str | None:
    """BFCL's ``error_type`` for the one case in a score file (its lines after the
    header are the failed cases), or None when it passed."""
    lines = score_file.read_text().splitlines()[1:]
    return json.loads(lines[0]).get("error_type") if lines else None


def category_of(test_id: str) -> str:
    return test_id.rsplit("_", 1)[0]


def register(base_url: str | None, key: str, max_tokens: Any) -> None:
    """Add ``lightning-policy`` to BFCL's model table (its handler, prompt mode)."""
    from bfcl_eval.constants.model_config import MODEL_CONFIG_MAPPING, ModelConfig
    from bfcl_eval.model_handler.api_inference.openai_completion import (
        OpenAICompletionsHandler,
    )

    class CappedHandler(OpenAICompletionsHandler):
        def generate_with_backoff(self, **kwargs):  # type: ignore[no-untyped-def]
            if max_tokens is not None:
                kwargs.setdefault("max_tokens", int(max_tokens))
            return super().generate_with_backoff(**kwargs)

    MODEL_CONFIG_MAPPING[MODEL_ID] = ModelConfig(
        # Scoring alone never calls the model: any name does.
        model_name=served_model(base_url, key) if base_url else MODEL_ID,
        display_name="lightning policy (Prompt)",
        url="https://github.com/",
        org="lightning",
        license="apache-2.0",
        model_handler=CappedHandler,
        is_fc_model=False,
        underscore_to_dot=False,
    )


def run_evaluate(command: Any, categories: list[str]) -> None:
    try:
        command(
            [
                "evaluate",
                "--model",
                MODEL_ID,
                "--test-category",
                ",".join(categories),
                "--partial-eval",
            ],
            standalone_mode=False,
        )
    except statistics.StatisticsError:
        # After scoring, `bfcl evaluate` builds its leaderboard CSV, whose
        # latency column takes a standard deviation: with one test case that
        # raises. The category's score file is written before that step.
        pass


def evaluate_root(root: Path) -> int:
    # `bfcl evaluate` builds the handler (an OpenAI client, which wants a key) but
    # never calls the model.
    os.environ.setdefault("OPENAI_API_KEY", "unused-when-only-scoring")
    command = import_bfcl(root)
    register(None, "", None)
    categories = sorted(json.loads((root / "test_case_ids_to_generate.json").read_text()))
    with contextlib.redirect_stdout(sys.stderr):
        run_evaluate(command, categories)
    return 0


def run_case(task: dict[str, Any], base_url: str, key: str, root: Path, command: Any) -> dict:
    """One test case through ``bfcl generate`` + ``bfcl evaluate`` under ``root``
    (BFCL's project root, fixed when ``bfcl_eval`` was imported): the result line."""
    test_id = task["id"]
    category = task.get("category") or category_of(test_id)
    # Sampling is the gateway's business (train/eval temperature per rollout);
    # BFCL's own default (0.001) is what it sends otherwise.
    temperature = str(task.get("temperature", 0.001))
    # A worker runs case after case in one root: what the last one left would be
    # generated over or scored again.
    for old in ("result", "score"):
        shutil.rmtree(root / old, ignore_errors=True)
    (root / "test_case_ids_to_generate.json").write_text(json.dumps({category: [test_id]}))
    # BFCL's handler reads both when it is built, once per `generate`.
    os.environ["OPENAI_BASE_URL"] = base_url
    os.environ["OPENAI_API_KEY"] = key
    register(base_url, key, task.get("max_tokens"))
    # BFCL prints its progress on stdout; keep stdout for the final reward line.
    with contextlib.redirect_stdout(sys.stderr):
        generate = ["generate", "--model", MODEL_ID, "--run-ids", "--skip-server-setup"]
        command(
            [*generate, "--temperature", temperature, "--num-threads", "1", "--allow-overwrite"],
            standalone_mode=False,
        )
        run_evaluate(command, [category])
    found = sorted((root / "score" / MODEL_ID).rglob(f"BFCL_v4_{category}_score.json"))
    if not found:
        raise RuntimeError(f"BFCL wrote no score file for {test_id} under {root / 'score'}")
    score_file = found[0]
    header = json.loads(score_file.read_text().splitlines()[0])
    score = float(header["accuracy"])
    error_type = case_error_type(score_file)
    if task.get("results_dir"):
        # BFCL's raw result line for this case, by rollout id: the recipe gathers
        # the held-out ones and runs `bfcl evaluate` on them as one category
        # (python -m lightning.apps.bfcl official), for BFCL's own score file.
        (result_file,) = (root / "result" / MODEL_ID).rglob(f"BFCL_v4_{category}_result.json")
        keep = Path(task["results_dir"])
        keep.mkdir(parents=True, exist_ok=True)
        rollout = task.get("rollout_id") or test_id
        saved = {
            "id": test_id,
            "category": category,
            "relpath": str(result_file.relative_to(root)),
            "result": result_file.read_text().splitlines()[0],
        }
        (keep / f"{rollout}.json").write_text(json.dumps(saved))
    reward = shaped_reward(score, error_type) if task.get("shaped") else score
    bfcl = {"id": test_id, "category": category, **header, "error_type": error_type}
    return {"reward": reward, "bfcl": bfcl}


def import_bfcl(root: Path) -> Any:
    """``bfcl``'s click command, with ``root`` as its project root."""
    os.environ["BFCL_PROJECT_ROOT"] = str(root.resolve())  # read when bfcl_eval is imported
    import typer
    from bfcl_eval.__main__ import cli

    return typer.main.get_command(cli)


def serve(listen_fd: int, under: Path | None) -> int:
    """A worker: import BFCL once (about 4.4 s of CPU, more than a case costs on
    the engine), then run the cases clients send over the listening Unix socket
    ``listen_fd``, one at a time in a private project root. Several workers
    share one socket; the kernel hands each connection to a worker that is
    waiting in ``accept``, so a busy worker is never given a second case. The
    project root is made under ``under`` (the pool's directory, which the pool
    removes: a worker ends by SIGTERM and cleans up nothing itself)."""
    root = Path(tempfile.mkdtemp(prefix="bfcl-worker-", dir=under))
    command = import_bfcl(root)
    listener = socket.socket(fileno=listen_fd)
    while True:
        conn, _ = listener.accept()
        with conn, conn.makefile("rwb") as stream:
            try:
                job = json.loads(stream.readline())
                task = {**job["task"], "rollout_id": job.get("rollout_id")}
                reply = {"ok": run_case(task, job["base_url"], job["key"], root, command)}
            except Exception as e:  # one bad case must not take the worker down
                reply = {"error": f"{type(e).__name__}: {e}"}
            try:
                stream.write(json.dumps(reply).encode() + b"\n")
                stream.flush()
            except OSError:
                pass  # the client is gone (its rollout timed out): next case


def ask_worker(path: str, job: dict[str, Any]) -> dict[str, Any]:
    """Send one case to the worker pool at ``path``; its result line."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        s.sendall(json.dumps(job).encode() + b"\n")
        with s.makefile("rb") as stream:
            line = stream.readline()
    if not line:
        raise SystemExit(f"the BFCL worker at {path} closed the connection without an answer")
    reply = json.loads(line)
    if "error" in reply:
        raise SystemExit(f"BFCL worker: {reply['error']}")
    return reply["ok"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--id", help="a BFCL test id (default: LIGHTNING_TASK's id)")
    p.add_argument("--keep", help="keep BFCL's result and score files in this directory")
    p.add_argument(
        "--evaluate",
        metavar="ROOT",
        help="only run `bfcl evaluate` on the results already under ROOT/result (all "
        "categories named in ROOT/test_case_ids_to_generate.json)",
    )
    p.add_argument(
        "--serve-fd",
        type=int,
        help="run as a worker on this listening Unix socket (lightning.apps.bfcl.workers)",
    )
    p.add_argument("--serve-dir", help="with --serve-fd: make the worker's files under this")
    args = p.parse_args()
    if args.serve_fd is not None:
        return serve(args.serve_fd, Path(args.serve_dir) if args.serve_dir else None)
    if args.evaluate:
        return evaluate_root(Path(args.evaluate))
    task = json.loads(os.environ.get("LIGHTNING_TASK", "{}"))
    if args.id:
        task["id"] = args.id
    base_url = os.environ["OPENAI_BASE_URL"]
    key = os.environ.get("OPENAI_API_KEY", "EMPTY")
    rollout = os.environ.get("LIGHTNING_ROLLOUT_ID")
    pool = os.environ.get(WORKERS_ENV)
    if pool and not args.keep:
        job = {"task": task, "base_url": base_url, "key": key, "rollout_id": rollout}
        out = ask_worker(pool, job)
    else:
        with tempfile.TemporaryDirectory(prefix="bfcl-") as scratch:
            root = Path(args.keep or scratch)
            root.mkdir(parents=True, exist_ok=True)
            command = import_bfcl(root)
            try:
                out = run_case({**task, "rollout_id": rollout}, base_url, key, root, command)
            except RuntimeError as e:
                raise SystemExit(str(e)) from e
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
