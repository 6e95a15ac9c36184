"""Experiment tracking where large runs live: ``[tracking] backends = ["wandb", "mlflow"]``.

Besides ``metrics.jsonl`` and TensorBoard, the run sends the same per-step metrics
(nested ones such as ``staleness_tokens`` or ``rollout_status`` flattened to
``staleness_tokens/1``), and the decoded traces it writes to ``traces.jsonl``, to
Weights & Biases and/or MLflow, when the user has installed them (optional extras
``lightning-rl[wandb]``, ``lightning-rl[mlflow]``):

- W&B: one run (``project``, ``run_name``, the run config as its config); metrics
  with ``step``; traces as a ``wandb.Table`` per step (``traces``). ``wandb_mode``
  (``"offline"`` writes under ``RUN_DIR/wandb`` for ``wandb sync`` later) or the
  ``WANDB_MODE`` environment variable as usual.
- MLflow: one run in experiment ``project`` at ``mlflow_tracking_uri`` (default
  ``sqlite:///RUN_DIR/mlflow.db``, artifacts beside it); metrics with ``step``; traces as a JSON artifact per
  step (``traces/step_N.json``).

Trackers count steps from 0 = the evaluation before training, so training step
``s`` of ``metrics.jsonl`` is tracker step ``s + 1`` (W&B and MLflow want steps
that start at 0 and only grow). A tracker that fails while logging is logged and disabled: the run's own files
are the record, tracking is a copy.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("lightning.run.tracking")


def flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Finite numbers only; nested mappings become ``outer/inner`` keys."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "/"))
        elif isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, int | float) and math.isfinite(value):
            out[name] = float(value)
    return out


def trace_text(trace: Mapping[str, Any]) -> str:
    return "".join(str(p) for p in trace.get("pieces", []))


class WandbTracker:
    def __init__(
        self, *, project: str, name: str | None, run_dir: Path, config: Any, mode: str | None
    ) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=project, name=name, dir=str(run_dir), config=config, mode=mode
        )

    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        # The loop writes a step's traces first, then its metrics: commit here.
        self.run.log(dict(values), step=step, commit=True)

    def traces(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        table = self.wandb.Table(columns=["step", "rollout_id", "harness", "reward", "text"])
        for r in rows:
            table.add_data(
                step, r.get("rollout_id"), r.get("harness"), r.get("reward"), trace_text(r)
            )
        self.run.log({"traces": table}, step=step, commit=False)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(
        self, *, project: str, name: str | None, uri: str, params: Mapping[str, Any]
    ) -> None:
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(project)
        artifacts = None
        if uri.startswith("sqlite:///"):  # a local database keeps its artifacts beside it
            artifacts = Path(uri.removeprefix("sqlite:///")).parent.joinpath("mlartifacts").as_uri()
        exp_id = exp.experiment_id if exp else self.client.create_experiment(project, artifacts)
        self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
        for key, value in params.items():
            self.client.log_param(self.run_id, key, str(value)[:6000])

    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def traces(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        payload = [{**r, "text": trace_text(r)} for r in rows]
        self.client.log_dict(self.run_id, payload, f"traces/step_{step}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Trackers:
    """Every configured tracker; a failing one is disabled with a warning."""

    def __init__(self, trackers: Sequence[Any]) -> None:
        self.active = list(trackers)

    def _each(self, what: str, *args: Any) -> None:
        for t in list(self.active):
            try:
                getattr(t, what)(*args)
            except Exception as e:
                log.warning("tracking: %s.%s failed (%s); disabled", type(t).__name__, what, e)
                self.active.remove(t)

    def metrics(self, metrics: Mapping[str, Any]) -> None:
        step = metrics.get("step")
        if isinstance(step, int):
            self._each("metrics", step + 1, flatten(metrics))

    def traces(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        if rows:
            self._each("traces", step + 1, rows)

    def close(self) -> None:
        self._each("close")


def open_trackers(section: Any, run_dir: Path, config: Mapping[str, Any]) -> Trackers:
    """The trackers of a ``[tracking]`` section (``lightning.config.TrackingSection``)."""
    trackers: list[Any] = []
    for backend in section.backends:
        if backend == "wandb":
            try:
                trackers.append(
                    WandbTracker(
                        project=section.project,
                        name=section.run_name,
                        run_dir=run_dir,
                        config=dict(config),
                        mode=section.wandb_mode,
                    )
                )
            except ImportError as e:
                raise ImportError(
                    "[tracking] backends has 'wandb': pip install 'lightning-rl[wandb]'"
                ) from e
        elif backend == "mlflow":
            try:
                uri = (
                    section.mlflow_tracking_uri or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
                )
                params = flatten_params(config)
                trackers.append(
                    MlflowTracker(
                        project=section.project, name=section.run_name, uri=uri, params=params
                    )
                )
            except ImportError as e:
                raise ImportError(
                    "[tracking] backends has 'mlflow': pip install 'lightning-rl[mlflow]'"
                ) from e
    return Trackers(trackers)


def flatten_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out.update(flatten_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
