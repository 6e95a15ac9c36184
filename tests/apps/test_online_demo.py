"""``lightning demo --online`` end to end on the tiny model, few requests: the
agent served through an application key, the users' delayed, out-of-order,
partly resent ratings, one online pass that trains exactly the rated sessions
and pushes its weights to the engine, and the held-out evals before / after."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest


@pytest.mark.slow
def test_online_demo_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning.cli import main

    out = tmp_path / "demo"
    argv = ["demo", "--online", "--model", "tiny", "--questions", "3", "--users", "3",
            "--eval-tasks", "3", "--eval-samples", "2", "--max-delay-s", "0.5",
            "--output-dir", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    record = json.loads((out / "demo.json").read_text())
    assert record["conversations"] == 9
    for label in ("before", "after"):
        iv = record[label]
        assert iv["low"] <= iv["mean"] <= iv["high"] and (iv["tasks"], iv["samples"]) == (3, 2)
    assert f"held-out reward before {record['before']['mean']:.3f}" in printed
    with sqlite3.connect(out / "prod.db") as db:
        stored = db.execute("SELECT COUNT(*) FROM feedback").fetchone()[0]
        rated = {r for (r,) in db.execute("SELECT DISTINCT rollout_id FROM feedback")}
        sessions = db.execute("SELECT COUNT(*) FROM online_sessions").fetchone()[0]
        trained = {
            r
            for (r,) in db.execute(
                "SELECT rollout_id FROM online_sessions WHERE trained IS NOT NULL"
            )
        }
    # Every post was acknowledged; a resent one was stored once.
    assert stored == record["ratings"]["posted"] - record["ratings"]["duplicate"] > 0
    # One session per conversation; the pass trained exactly the rated ones.
    assert sessions == 9 and trained == rated
    assert record["sessions_trained"] == len(rated)
    assert record["sessions_skipped"] == ({"no_feedback": 9 - len(rated)} if len(rated) < 9 else {})
    summary = json.loads((out / "online" / "summary.json").read_text())
    assert summary["weights"] and (Path(summary["weights"]) / "config.json").exists()
    # The engine serves the new weights (pushed as the next version).
    assert record["engine_weight_version"] == 1
