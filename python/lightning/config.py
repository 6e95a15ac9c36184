"""The run configuration of `lightning train`: one pydantic model, TOML in.

Every section is validated when the file is loaded, so a typo or an impossible
value fails before any model is loaded. Relative paths are resolved against the
directory of the TOML file, so a config works from any working directory.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSection(_Section):
    """The policy. Either a local Hugging Face directory or a built-in offline model."""

    path: str | None = None
    builtin: Literal["smollm2-135m-instruct", "tiny"] | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if (self.path is None) == (self.builtin is None):
            raise ValueError("[model] needs exactly one of `path` or `builtin`")
        return self

    def resolve(self) -> Path:
        from lightning import models

        if self.builtin == "smollm2-135m-instruct":
            return models.smollm2_dir()
        if self.builtin == "tiny":
            return models.tiny_model_dir()
        assert self.path is not None
        path = Path(self.path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"[model] path {path} has no config.json; give a model directory"
            )
        return path


class EngineSection(_Section):
    """Where generation happens.

    ``embedded``: lightning starts ``lightning serve`` on the policy and syncs weights
    into it after each step. ``external``: the OpenAI base URLs of running engines
    (vLLM, SGLang, lightning), with ``weight_sync`` saying how new weights reach them.
    """

    kind: Literal["embedded", "external"] = "embedded"
    urls: list[str] = Field(default_factory=list)
    # How new weights reach external engines (lightning.weight_sync; "sglang" is
    # the older name of "sglang-disk").
    weight_sync: Literal[
        "embedded",
        "sglang",
        "sglang-disk",
        "sglang-distributed",
        "sglang-tensor",
        "vllm-disk",
        "vllm-nccl",
        "none",
    ] = "embedded"
    # For the distributed syncs: where the trainer hosts the transfer group, each
    # engine's number of workers (TP x PP x DP; default 1 each), and for SGLang an
    # optional pause around updates ("none": in-flight requests finish first).
    sync_master_address: str = "127.0.0.1"
    sync_master_port: int = 0
    sync_world_sizes: list[int] = Field(default_factory=list)
    sync_pause: Literal["none", "abort", "retract"] = "none"
    host: str = "127.0.0.1"
    port: int = 0
    max_batch: int = 16
    dtype: Literal["float32", "bfloat16"] = "float32"
    threads: int | None = None
    startup_timeout_s: float = 600.0
    # Embedded engine only. A Jinja chat template used instead of the model's (for
    # tool-using harnesses on a model whose own template ignores tools, e.g. the
    # ChatML tool template `lightning serve --help` names); how tool calls are read
    # back (see lightning.engine.tools); the context length (default: the model's).
    chat_template: str | None = None
    tool_call_parser: Literal["auto", "hermes", "none"] = "auto"
    max_model_len: int | None = None

    @model_validator(mode="after")
    def _urls(self) -> EngineSection:
        if self.kind == "external" and not self.urls:
            raise ValueError("[engine] kind = 'external' needs `urls` (OpenAI base URLs, …/v1)")
        return self


class GatewaySection(_Section):
    listen: str = "127.0.0.1:0"
    admin_key: str | None = None
    db: str | None = None  # default: RUN_DIR/lightning.db


class HarnessSection(_Section):
    """The unmodified harness: a command run once per rollout, or a Python callable."""

    command: list[str] | None = None
    callable: str | None = None  # "module:function", async def run(task, client)
    timeout_s: float = 120.0
    concurrency: int = 8
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    # Where harness processes run: this machine, or Ray tasks on a cluster
    # (lightning.ray_runner; needs `pip install 'lightning-rl[ray]'`).
    backend: Literal["local", "ray"] = "local"
    ray_address: str | None = None  # None: ray.init() defaults; "auto"; "ray://head:10001"
    ray_num_cpus: float = Field(1.0, ge=0.0)
    ray_resources: dict[str, float] = Field(default_factory=dict)
    ray_schedule_timeout_s: float = Field(600.0, gt=0.0)

    @model_validator(mode="after")
    def _one_harness(self) -> HarnessSection:
        if (self.command is None) == (self.callable is None):
            raise ValueError("[harness] needs exactly one of `command` or `callable`")
        if self.backend == "ray" and self.command is None:
            raise ValueError(
                "[harness] backend = 'ray' runs a harness `command` on the cluster; a "
                "`callable` runs in this process (use backend = 'local')"
            )
        if self.concurrency < 1:
            raise ValueError("[harness] concurrency must be >= 1")
        return self


class TasksSection(_Section):
    train: str
    eval: str | None = None
    eval_limit: int | None = None


class RewardSection(_Section):
    source: Literal["harness", "stdout", "function"] = "stdout"
    function: str | None = None  # "module:function(task, trace) -> float"

    @model_validator(mode="after")
    def _fn(self) -> RewardSection:
        if self.source == "function" and not self.function:
            raise ValueError("[reward] source = 'function' needs `function = 'module:function'`")
        return self


class AlgorithmSection(_Section):
    estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"] = "grpo"
    group_size: int = Field(8, ge=1, description="rollouts per task (one GRPO group)")
    tasks_per_step: int = Field(2, ge=1)
    train_temperature: float = Field(1.0, ge=0.0)
    eval_temperature: float = Field(0.0, ge=0.0)
    eval_samples: int = Field(1, ge=1, description="rollouts per held-out task at each eval")
    drop_failed_rollouts: bool = True
    # Asynchronous training (lightning.async_loop): rollouts may start on weights up
    # to k versions older than the weights they train; 0 = synchronous.
    max_staleness: int = Field(0, ge=0)
    # A rollout found beyond the bound when its step trains: drop it, or run its
    # task again on the current weights. Either is counted in the step's metrics.
    on_stale: Literal["drop", "regenerate"] = "drop"


class TrackingSection(_Section):
    """Where else the per-step metrics and a few traces go (lightning.tracking)."""

    backends: list[Literal["wandb", "mlflow"]] = Field(default_factory=list)
    project: str = "lightning"
    run_name: str | None = None
    wandb_mode: Literal["online", "offline", "disabled"] | None = None  # None: WANDB_MODE
    mlflow_tracking_uri: str | None = None  # default: sqlite:///RUN_DIR/mlflow.db


class RunConfig(_Section):
    model: ModelSection
    engine: EngineSection = Field(default_factory=EngineSection)
    gateway: GatewaySection = Field(default_factory=GatewaySection)
    harness: HarnessSection
    tasks: TasksSection
    reward: RewardSection = Field(default_factory=RewardSection)
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    # Validated by lightning.trainer.TrainerConfig when the run starts (that module
    # imports torch, which loading a config should not).
    trainer: dict[str, Any] = Field(default_factory=dict)
    steps: int = Field(10, ge=0)
    eval_every: int = Field(0, ge=0, description="0 = only before and after training")
    checkpoint_every: int = Field(0, ge=0)
    traces_per_step: int = Field(2, ge=0)
    output_dir: str = "runs/latest"
    seed: int = 0

    @classmethod
    def load(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
        path = Path(path)
        try:
            raw = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {path} is not valid TOML: {e}") from None
        for dotted, value in (overrides or {}).items():
            node = raw
            *parents, leaf = dotted.split(".")
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = value
        config = cls.model_validate(raw)
        return config.resolved_against(path.parent)

    def resolved_against(self, base: Path) -> RunConfig:
        """Make relative file paths relative to `base` (the config file's directory)."""

        def fix(p: str | None) -> str | None:
            if p is None or Path(p).is_absolute():
                return p
            return str((base / p).resolve())

        data = self.model_copy(deep=True)
        data.tasks.train = fix(data.tasks.train) or data.tasks.train
        data.tasks.eval = fix(data.tasks.eval)
        if data.model.path is not None:
            data.model.path = fix(data.model.path)
        data.engine.chat_template = fix(data.engine.chat_template)
        if data.harness.cwd is not None:
            data.harness.cwd = fix(data.harness.cwd)
        else:
            data.harness.cwd = str(base.resolve())
        return data
