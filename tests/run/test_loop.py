"""End to end: two training steps of the demo on the tiny model.

Real everything: `lightning serve` in a child process, the Rust gateway in
process, the bundled openai-SDK harness as a subprocess per rollout, the Rust
merge, the PyTorch trainer, weight sync into the engine, and the report.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

import httpx
import pytest

from lightning import cli
from lightning.config import RunConfig
from lightning.run.loop import Run, read_tasks, sampling_seed

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

pytestmark = pytest.mark.slow


def _tasks(tmp_path: Path) -> tuple[Path, Path]:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import arith_tasks
    finally:
        sys.path.remove(str(EXAMPLES))
    out = tmp_path / "tasks"
    assert (
        arith_tasks.main(["--n", "60", "--eval-size", "4", "--seed", "3", "--out", str(out)]) == 0
    )
    return out / "train.jsonl", out / "eval.jsonl"


def test_two_steps_of_the_demo_on_the_tiny_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train, eval_ = _tasks(tmp_path)
    assert len(read_tasks(train)) > 10 and len(read_tasks(eval_)) == 4
    out = tmp_path / "run"
    config = RunConfig.load(
        EXAMPLES / "demo.toml",
        {
            "model.builtin": "tiny",
            "steps": 2,
            "eval_every": 0,
            "checkpoint_every": 0,
            "output_dir": str(out),
            "tasks.train": str(train),
            "tasks.eval": str(eval_),
            "algorithm.group_size": 3,
            "algorithm.eval_samples": 1,
            "algorithm.tasks_per_step": 2,
            "harness.concurrency": 6,
            "trainer.lr": 1e-3,
        },
    )
    with Run(config, quiet=True) as run:
        # The trainer holds the run's typed [trainer] config, completed by the run.
        want = config.trainer_config(run.model_dir).with_values(log_dir=str(out))
        assert run.trainer.config == want and run.trainer.config.lr == 1e-3
        assert run.engine is not None
        engine_root = run.engine.root
        summary = run.run()
        health = httpx.get(engine_root + "/health").json()
    # Weights were pushed after each step: the engine serves version 2.
    assert health["weight_version"] == 2
    assert "eval_before" in summary and "eval_after" in summary

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if "eval_reward" in m]
    assert [m["step"] for m in evals] == [-1, 2]
    for m in evals:  # the 95% interval of every eval is recorded around its mean
        assert m["eval_ci_low"] <= m["eval_reward"] <= m["eval_ci_high"]
        assert m["eval_n"] == 4
    steps = [m for m in metrics if m["step"] in (0, 1)]
    assert len(steps) == 2
    for m in steps:
        assert m["samples"] >= 1 and m["tokens"] > 0
        assert m["rollouts"] == 6
        assert m["samples_per_rollout"] >= 1.0
        for key in ("loss", "grad_norm", "reward_mean", "gap_abs_logprob", "step_time_s"):
            assert key in m
    # Every call of every rollout is in the durable store, with token ids.
    db = sqlite3.connect(out / "lightning.db")
    # Every rollout's request carried the sampling seed the run derived for it.
    # Each eval reuses the same seeds (they differ by the policy, not the draws).
    seeds = {
        mode: [json.loads(t)["sampling_seed"] for (t,) in rows]
        for mode in ("train", "eval")
        if (rows := db.execute("select task from rollouts where mode = ?", (mode,)).fetchall())
    }
    assert len(set(seeds["train"])) == len(seeds["train"]) == 12
    assert len(seeds["eval"]) == 8 and len(set(seeds["eval"])) == 4
    assert sampling_seed(0, 0, 0) == sampling_seed(0, 0, 0) != sampling_seed(1, 0, 0)
    (n_rollouts,) = db.execute("select count(*) from rollouts").fetchone()
    (n_calls,) = db.execute("select count(*) from calls").fetchone()
    assert n_rollouts == 2 * 6 + 2 * 4  # train rollouts + eval before and after
    assert n_calls >= n_rollouts
    # The trainer's checkpoint and the report were written.
    assert (out / "checkpoints" / "latest").is_dir()
    assert (out / "report.html").stat().st_size > 1000
    assert (out / "traces.jsonl").read_text().strip()

    # `lightning show` reads a rollout back from the store, merged and decoded.
    (rid,) = db.execute(
        "select r.id from rollouts r join calls c on c.rollout_id = r.id "
        "where r.mode = 'train' limit 1"
    ).fetchone()
    capsys.readouterr()
    assert cli.main(["show", rid, "--db", str(out / "lightning.db"), "--color", "never"]) == 0
    shown = capsys.readouterr().out
    assert f"rollout {rid}" in shown and "«" in shown  # generated text is marked
    assert cli.main(["show", "no-such-rollout", "--db", str(out / "lightning.db")]) == 1


def test_resume_continues_from_the_checkpoint(tmp_path: Path) -> None:
    train, eval_ = _tasks(tmp_path)
    out = tmp_path / "run"
    overrides = {
        "model.builtin": "tiny",
        "steps": 1,
        "eval_every": 0,
        "checkpoint_every": 1,
        "output_dir": str(out),
        "tasks.train": str(train),
        "tasks.eval": str(eval_),
        "tasks.eval_limit": 1,
        "algorithm.group_size": 2,
        "algorithm.tasks_per_step": 1,
        "algorithm.eval_samples": 1,
        "harness.concurrency": 2,
        "trainer.lr": 1e-3,
        # The demo runs its agent in-process; here the same agent runs as a process
        # that prints its reward, so the loop covers both kinds of harness.
        "harness.callable": None,
        "harness.command": ["{python}", "arith_agent.py"],
        "reward.source": "stdout",
    }
    with Run(RunConfig.load(EXAMPLES / "demo.toml", overrides), quiet=True) as run:
        run.run()
    with pytest.raises(FileExistsError, match="--resume"):
        Run(RunConfig.load(EXAMPLES / "demo.toml", overrides), quiet=True)
    overrides["steps"] = 2
    with Run(RunConfig.load(EXAMPLES / "demo.toml", overrides), resume=True, quiet=True) as run:
        assert run.engine is not None
        summary = run.run()
        health = httpx.get(run.engine.root + "/health").json()
    assert "eval_before" not in summary  # not re-evaluated from scratch
    assert health["weight_version"] == 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [0, 1]
    assert json.loads((out / "state.json").read_text())["step"] == 2
