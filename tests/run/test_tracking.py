"""`[tracking]`: the per-step metrics and traces reach W&B (offline mode) and MLflow
(a local file store), read back and compared with what the run logged."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning.config import TrackingSection
from lightning.run.tracking import flatten, open_trackers

STEPS = [
    {
        "step": s,
        "reward_mean": 0.25 * s,
        "engine_idle_frac": 0.5 - 0.1 * s,
        "staleness_tokens": {"0": 10 + s, "1": 3},
        "rollout_status": {"succeeded": 6},
        "gap_kl": float("nan"),  # not a finite number: not sent
        "note": "text is not a metric",
    }
    for s in range(3)
]
TRACE = {
    "step": 2,
    "rollout_id": "r1",
    "reward": 1.0,
    "pieces": ["What is ", "2+2", "? ", "4"],
    "weights": [0, 0, 0, 1],
}


def test_flatten() -> None:
    assert flatten(STEPS[1]) == {
        "step": 1.0,
        "reward_mean": 0.25,
        "engine_idle_frac": 0.4,
        "staleness_tokens/0": 11.0,
        "staleness_tokens/1": 3.0,
        "rollout_status/succeeded": 6.0,
    }


def test_mlflow_receives_metrics_and_traces(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    section = TrackingSection(backends=["mlflow"], project="demo", run_name="r")
    trackers = open_trackers(section, tmp_path, {"algorithm": {"max_staleness": 1}})
    for m in STEPS:  # as the loop does: a step's traces, then its metrics
        if m["step"] == 2:
            trackers.traces(2, [TRACE])
        trackers.metrics(m)
    trackers.close()
    assert trackers.active, "a tracker was disabled by an error"

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("demo")
    assert exp is not None
    [run] = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "r" and run.info.status == "FINISHED"
    assert run.data.params["algorithm.max_staleness"] == "1"
    history = client.get_metric_history(run.info.run_id, "staleness_tokens/0")
    # Tracker step = loop step + 1 (0 is the evaluation before training).
    assert [(h.step, h.value) for h in history] == [(1, 10.0), (2, 11.0), (3, 12.0)]
    assert "gap_kl" not in run.data.metrics and "note" not in run.data.metrics
    path = client.download_artifacts(run.info.run_id, "traces/step_3.json", str(tmp_path / "dl"))
    [row] = json.loads(Path(path).read_text())
    assert row["rollout_id"] == "r1" and row["text"] == "What is 2+2? 4"


def test_wandb_offline_receives_metrics_and_traces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    section = TrackingSection(backends=["wandb"], project="demo", wandb_mode="offline")
    trackers = open_trackers(section, tmp_path, {"seed": 0})
    [tracker] = trackers.active
    for m in STEPS:
        if m["step"] == 2:
            trackers.traces(2, [TRACE])
        trackers.metrics(m)
    # The run's own summary holds the last logged value of every key.
    summary = tracker.run.summary
    assert summary["staleness_tokens/0"] == 12.0
    assert summary["engine_idle_frac"] == pytest.approx(0.3)
    assert summary["traces"]["_type"] == "table-file" and summary["traces"]["nrows"] == 1
    trackers.close()
    assert trackers.active
    # Offline: the run sits in RUN_DIR/wandb for `wandb sync`, the table as a file.
    [run_dir] = (tmp_path / "wandb").glob("offline-run-*")
    [table] = run_dir.glob("files/media/table/traces_*.table.json")
    data = json.loads(table.read_text())
    # The harness column is empty for a trace that names none (a run of one harness
    # names it "default").
    assert data["columns"] == ["step", "rollout_id", "harness", "reward", "text"]
    assert data["data"] == [[3, "r1", None, 1.0, "What is 2+2? 4"]]


def test_a_failing_tracker_is_disabled_not_fatal() -> None:
    from lightning.run.tracking import Trackers

    class Broken:
        def metrics(self, step: int, values: object) -> None:
            raise RuntimeError("server gone")

    good = SimpleNamespace(seen=[])
    good.metrics = lambda step, values: good.seen.append(step)
    trackers = Trackers([Broken(), good])
    trackers.metrics(STEPS[0])
    trackers.metrics(STEPS[1])
    assert good.seen == [1, 2] and len(trackers.active) == 1  # tracker steps: loop step + 1
