"""The closed loop behind `lightning train`.

One step::

    sample tasks → n rollouts per task (one GRPO group each) → run the harness
    → wait for complete groups → fetch traces from the gateway → merge (radix trie,
    drift classified) → advantages → trainer step → pause gateway, drain,
    push weights, bump weight version, resume

Periodic evaluation runs held-out tasks at the eval temperature through the very
same harness and gateway (rollouts in mode ``eval``, never trained on).

A run may train through several harnesses (``[[harnesses]]``): each step's groups
are split among them, one group per (task, harness), and every eval runs each
held-out task through every harness, ``eval_only`` ones included
(lightning.run.harnesses).

Everything a run produces lands in its output directory: ``lightning.db`` (the
gateway's store: every call and reward), ``metrics.jsonl`` (one object per step),
``traces.jsonl`` (a few decoded traces per step for the report), ``checkpoints/``,
``state.json`` (for ``--resume``) and ``report.html``.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from lightning.config import HarnessSection, RunConfig
from lightning.run.harnesses import (
    HARNESS_KEY,
    HarnessRunner,
    eval_intervals,
    harness_costs,
    harness_of,
    split_flags,
)
from lightning.run.runner import RolloutResult, Runner, load_callable
from lightning.run.stats import Interval
from lightning.sync import EngineLayout, WeightSync, WeightUpdate, make_weight_sync

if TYPE_CHECKING:
    from lightning.run.staleness import Schedule

log = logging.getLogger("lightning.run.loop")

# The name the embedded engine serves the policy under; harnesses get it as
# OPENAI_MODEL (most read it; one that hard-codes a name needs external engines
# started with that name).
SERVED_MODEL_NAME = "policy"


def read_tasks(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Tasks from JSONL, Parquet or a saved HF dataset (see `lightning.data.files`)."""
    from lightning.data.files import load_records

    tasks = load_records(path)
    if not tasks:
        raise ValueError(f"{path}: no tasks")
    return tasks


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


ENGINE_KEY_ENV = (
    "LIGHTNING_ENGINE_KEY"  # lightning.engine.server.KEY_ENV (that module imports torch)
)


class EmbeddedEngine:
    """`lightning serve` in a child process: its own interpreter, its own threads,
    so generation and training never fight over one GIL."""

    def __init__(
        self,
        model_dir: Path,
        *,
        host: str,
        port: int,
        max_batch: int,
        dtype: str,
        threads: int | None,
        log_path: Path,
        chat_template: str | None = None,
        tool_call_parser: str = "auto",
        max_model_len: int | None = None,
        kv_cache_bytes: int | None = None,
        prefill_chunk: int | None = None,
    ) -> None:
        self.host = host
        self.port = port or _free_port(host)
        # The engine takes only requests with its key (lightning/engine/server.py);
        # the gateway and the weight sync send it.
        self.key = os.environ.get(ENGINE_KEY_ENV) or secrets.token_urlsafe(24)
        argv = [
            sys.executable,
            "-m",
            "lightning.cli",
            "serve",
            str(model_dir),
            "--host",
            host,
            "--port",
            str(self.port),
            "--max-batch",
            str(max_batch),
            "--dtype",
            dtype,
            "--served-model-name",
            SERVED_MODEL_NAME,
            # Report the logprob of the distribution actually sampled from (after
            # temperature), which is what the trainer computes: the gap metrics
            # then measure real train-serve mismatch, not the temperature.
            "--logprobs-mode",
            "processed_logprobs",
            # A demo stopped with Ctrl-C, SIGTERM or kill -9 leaves no engine behind.
            "--exit-with-parent",
        ]
        if threads:
            argv += ["--threads", str(threads)]
        if chat_template is not None:
            argv += ["--chat-template", chat_template]
        if max_model_len is not None:
            argv += ["--max-model-len", str(max_model_len)]
        argv += ["--tool-call-parser", tool_call_parser]
        if kv_cache_bytes is not None:
            argv += ["--kv-cache-bytes", str(kv_cache_bytes)]
        if prefill_chunk is not None:
            argv += ["--prefill-chunk", str(prefill_chunk)]
        self.log_file = open(log_path, "ab")
        self.proc = subprocess.Popen(
            argv,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, ENGINE_KEY_ENV: self.key},
        )

    @property
    def root(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return self.root + "/v1"

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"embedded engine exited with {self.proc.returncode}; see {self.log_file.name}"
                )
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(self.root + "/health", timeout=2.0)
                if r.status_code == 200:
                    return dict(r.json())
            time.sleep(0.5)
        raise TimeoutError(
            f"embedded engine not ready after {timeout_s:g}s; see {self.log_file.name}"
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()


def _make_launcher(h: HarnessSection) -> Any:
    """Where harness processes run: here, or as Ray tasks (lightning.run.ray)."""
    if h.backend == "local":
        return None
    from lightning.run.ray import RayLauncher

    return RayLauncher(
        address=h.ray_address,
        num_cpus=h.ray_num_cpus,
        resources=h.ray_resources,
        schedule_timeout_s=h.ray_schedule_timeout_s,
    )


def _make_weight_sync(
    cfg: RunConfig, upstreams: Sequence[str], engine_key: str | None = None
) -> WeightSync:
    """The engines' own weight-update API (lightning.sync, docs/design.md#weight-sync)."""
    e = cfg.engine
    return make_weight_sync(
        "embedded" if e.kind == "embedded" else e.weight_sync,
        upstreams,
        master_address=e.sync_master_address,
        master_port=e.sync_master_port,
        world_sizes=e.sync_world_sizes or None,
        layouts=[EngineLayout(p.tp, p.pp, p.dp) for p in e.sync_parallel] or None,
        pause_mode=e.sync_pause,
        bucket_bytes=e.sync_bucket_mb << 20,
        colocate=e.colocate,
        engine_key=engine_key,
    )


def sampling_seed(run_seed: int, step: int, job: int) -> int:
    """The sampling seed of rollout ``job`` of ``step`` (-1: evals), derived from the run seed.

    Harnesses that pass it on as the request's ``seed`` (examples/arith_agent.py
    does) make a run repeat its own draws.
    """
    digest = hashlib.blake2b(f"{run_seed}/{step}/{job}".encode(), digest_size=6).digest()
    return int.from_bytes(digest, "little")


def _eval_metrics(interval: Interval | None) -> dict[str, Any]:
    if interval is None:
        return {"eval_reward": float("nan")}
    return {
        "eval_reward": interval.mean,
        "eval_ci_low": interval.low,
        "eval_ci_high": interval.high,
        "eval_n": interval.tasks * interval.samples,
    }


class Run:
    """One training run. Use as a context manager so servers always stop."""

    def __init__(self, config: RunConfig, *, resume: bool = False, quiet: bool = False) -> None:
        self.config = config
        self.out = Path(config.output_dir)
        self.quiet = quiet
        if self.out.exists() and not resume and any(self.out.iterdir()):
            raise FileExistsError(
                f"output dir {self.out} is not empty; pass --resume to continue that run "
                "or choose another output_dir"
            )
        self.out.mkdir(parents=True, exist_ok=True)
        self.resume = resume
        self.state_path = self.out / "state.json"
        self.state: dict[str, Any] = {"step": 0, "weight_version": 0}
        if resume and self.state_path.exists():
            self.state = json.loads(self.state_path.read_text())
        self._stack = contextlib.ExitStack()
        from lightning.run.staleness import PhaseLog

        self.phases = PhaseLog()

    # -- setup ----------------------------------------------------------------

    def __enter__(self) -> Run:
        try:
            self._setup()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _setup(self) -> None:
        cfg = self.config
        (self.out / "config.json").write_text(cfg.model_dump_json(indent=2))
        from lightning.run.tracking import open_trackers

        self.tracking = open_trackers(cfg.tracking, self.out, cfg.model_dump(mode="json"))
        self._stack.callback(self.tracking.close)
        self.train_tasks = read_tasks(cfg.tasks.train)
        self.eval_tasks = read_tasks(cfg.tasks.eval) if cfg.tasks.eval else []
        if cfg.tasks.eval_limit is not None:
            self.eval_tasks = self.eval_tasks[: cfg.tasks.eval_limit]
        start_weights = self._setup_trainer()
        upstreams = self._start_engine(start_weights)
        self.weight_sync = _make_weight_sync(
            cfg, upstreams, self.engine.key if self.engine is not None else None
        )
        self._stack.callback(self.weight_sync.close)
        self.weight_sync.setup()
        # The dtype streamed weights leave in: the engines' own unless configured.
        self.sync_dtype: str | None = None
        if self.weight_sync.streams:
            model_config = json.loads((self.model_dir / "config.json").read_text())
            self.sync_dtype = self.weight_sync.send_dtype(cfg.engine.sync_dtype, model_config)
        self._start_gateway(upstreams)
        self.runner = self._make_runner()

    def _setup_trainer(self) -> Path | None:
        """The tokenizer and the trainer (resumed from the latest checkpoint
        when resuming); returns the weights the engine must start on, when
        they are not the base model's."""
        from lightning import Tokenizer
        from lightning.rl.trainer import Trainer

        cfg = self.config
        self.model_dir = cfg.model.resolve()
        self.tokenizer = Tokenizer.from_dir(str(self.model_dir))
        trainer_cfg = cfg.trainer_config(self.model_dir)
        self.trainer = Trainer(trainer_cfg, log_dir=str(self.out))
        if self.trainer.world > 1:  # under torchrun: rank 0 leads (lightning.run.distributed)
            from lightning.run.distributed import LeaderTrainer

            self.trainer = LeaderTrainer(self.trainer)  # type: ignore[assignment]
        if hasattr(self.trainer, "close"):
            self._stack.callback(self.trainer.close)
        if not (self.resume and self.state["step"] > 0):
            return self._warm_start()
        ckpt = self.out / "checkpoints" / "latest"
        self.trainer.load_checkpoint(str(ckpt))
        # The engine restarts on the weights the run had reached, not on the
        # base model. (A LoRA checkpoint keeps an adapter there instead, so
        # the trainer exports merged weights for the engine.)
        start_weights = ckpt / "model"
        if not (start_weights / "config.json").exists():
            start_weights = self.out / "weights" / "resume"
            self.trainer.export_weights(str(start_weights))
        return start_weights

    def _warm_start(self) -> Path | None:
        """``[sft]`` from a dataset or a store, before RL (lightning.run.sft):
        fine-tunes the trainer and returns the weights the engine starts on.
        Expert iteration needs the engine and runs in :meth:`run` instead."""
        cfg = self.config
        if cfg.sft is None or cfg.sft.source == "expert_iteration":
            return None
        from lightning.run.sft import fit, prepare_data

        train, val, info = prepare_data(
            cfg.sft, self.model_dir, seed=cfg.seed, chat_template=cfg.engine.chat_template
        )
        self._say(
            f"sft warm start: {info['train_samples']} train / {info['val_samples']} "
            f"validation samples, {info['train_tokens']} trained tokens"
        )
        result = fit(
            self.trainer, train, val, cfg.sft, self.out / "sft", seed=cfg.seed, say=self._say
        )
        (self.out / "sft" / "summary.json").write_text(
            json.dumps({"data": info, **result}, indent=2, default=float)
        )
        weights = self.out / "weights" / "sft"
        self.trainer.export_weights(str(weights))
        return weights

    def _start_engine(self, start_weights: Path | None) -> list[str]:
        """Starts the embedded engine when the run has one; returns the
        engine URLs the gateway forwards to."""
        cfg = self.config
        self.engine: EmbeddedEngine | None = None
        if cfg.engine.kind != "embedded":
            return list(cfg.engine.urls)
        engine = EmbeddedEngine(
            start_weights or self.model_dir,
            host=cfg.engine.host,
            port=cfg.engine.port,
            max_batch=cfg.engine.max_batch,
            dtype=cfg.engine.dtype,
            threads=cfg.engine.threads,
            log_path=self.out / "engine.log",
            chat_template=cfg.engine.chat_template,
            tool_call_parser=cfg.engine.tool_call_parser,
            max_model_len=cfg.engine.max_model_len,
            kv_cache_bytes=cfg.engine.kv_cache_bytes,
            prefill_chunk=cfg.engine.prefill_chunk,
        )
        self._stack.callback(engine.stop)
        self._say(f"starting embedded engine on {engine.url} (log: {self.out / 'engine.log'})")
        engine.wait_ready(cfg.engine.startup_timeout_s)
        self.engine = engine
        return [engine.url]

    def _start_gateway(self, upstreams: list[str]) -> None:
        from lightning import Gateway, GatewayClient, UpstreamConfig

        cfg = self.config
        self.admin_key = cfg.gateway.admin_key or secrets.token_urlsafe(24)
        db = cfg.gateway.db or str(self.out / "lightning.db")
        self.gateway_db = db
        version = int(self.state["weight_version"])
        gw_config = cfg.gateway.for_run(
            db=db,
            admin_key=self.admin_key,
            upstreams=[UpstreamConfig(url=u, weight_version=version) for u in upstreams],
            algorithm=cfg.algorithm,
        )
        if self.engine is not None and gw_config.upstream_api_key is None:
            gw_config = gw_config.model_copy(update={"upstream_api_key": self.engine.key})
        self.gateway = Gateway(gw_config).start()
        self._stack.callback(self.gateway.stop)
        # The store is on this machine: a step's batch is one Rust read of it.
        self.client = GatewayClient(self.gateway.url, self.admin_key, store=db)
        self._stack.callback(self.client.close)

    def _make_runner(self) -> HarnessRunner:
        """One runner per harness, behind one ``run`` that routes by task["harness"]."""
        in_process: dict[str, tuple[str, str]] = {}  # env key -> (value, harness)
        runners = {}
        for h in self.config.all_harnesses():
            runners[h.name] = self._runner_for(h, in_process)
        return HarnessRunner(runners)

    def _runner_for(self, h: HarnessSection, in_process: dict[str, tuple[str, str]]) -> Runner:
        cfg = self.config
        harness: Any
        if h.command is not None:
            # "{python}" is resolved where the harness runs (lightning.run.runner.resolve_argv).
            harness = list(h.command)
        else:
            assert h.callable is not None
            harness = load_callable(h.callable)
        env = dict(h.env)
        if self.engine is not None:
            env.setdefault("OPENAI_MODEL", SERVED_MODEL_NAME)
        if not isinstance(harness, list):
            # A callable harness runs in this process: it reads the same settings
            # from this process's environment that a harness process would get.
            # Callable harnesses share that environment, so they must agree on it.
            for key, value in env.items():
                if key in in_process and in_process[key][0] != value:
                    raise ValueError(
                        f"harnesses {in_process[key][1]!r} and {h.name!r} both run in this "
                        f"process (callable) but set {key} differently; give one a `command`, "
                        "or pass the setting in the task"
                    )
                in_process[key] = (value, h.name)
            os.environ.update(env)
        return Runner(
            self.client,
            harness,
            reward_source=cfg.reward.source,
            reward_fn=cfg.reward.function,
            concurrency=h.concurrency,
            timeout_s=h.timeout_s,
            env=env,
            cwd=h.cwd,
            launcher=_make_launcher(h),
        )

    def _say(self, text: str) -> None:
        if not self.quiet:
            print(f"[lightning] {text}", flush=True)

    # -- the loop ---------------------------------------------------------------

    def evaluate(self, label: str) -> Interval | None:
        """Run every held-out task ``eval_samples`` times; the mean with its 95% interval
        (pooled over the trained harnesses)."""
        return self._evaluate(label)[0]

    def _evaluate(self, label: str) -> tuple[Interval | None, dict[str, Any]]:
        """Every held-out task ``eval_samples`` times through every harness
        (``eval_only`` ones included): the interval pooled over the trained
        harnesses, and per harness its interval and costs (``eval_harnesses``).

        Job j of every eval gets the same sampling seed, in every harness, so
        evals before, during and after training differ by the policy, not by
        the draws, and harnesses by the harness.
        """
        if not self.eval_tasks:
            return None, {}
        temp = self.config.algorithm.eval_temperature
        k = self.config.algorithm.eval_samples
        harnesses = self.config.all_harnesses()
        jobs = [
            (
                {
                    **t,
                    "temperature": temp,
                    "sampling_seed": sampling_seed(self.config.seed, -1, j),
                    HARNESS_KEY: h.name,
                },
                None,
            )
            for h in harnesses
            for j, t in enumerate(t for t in self.eval_tasks for _ in range(k))
        ]
        t0 = time.monotonic()
        results = self.runner.run(jobs, mode="eval")
        self.phases.record("generate", t0, time.monotonic())
        interval, cells = eval_intervals(
            results, [(h.name, h.eval_only) for h in harnesses], k=k, seed=self.config.seed
        )
        self._say(
            f"eval ({label}): mean reward {interval} over {interval.tasks} held-out "
            f"tasks × {k} at temperature {temp:g}"
            + (
                f" through {len(harnesses) - sum(h.eval_only for h in harnesses)} harnesses"
                if len(harnesses) > 1
                else ""
            )
        )
        if len(harnesses) > 1:
            for name, c in cells.items():
                tag = " (eval only)" if c["eval_only"] else ""
                self._say(
                    f"  {name}{tag}: {c['reward']:.3f} [95% CI {c['low']:.3f}, {c['high']:.3f}]"
                )
            # What each harness cost at this eval (the only costs an eval_only one has).
            try:
                merged = self.client.read_step(
                    [r.rollout_id for r in results], tokenizer=self.tokenizer
                )
                costs = harness_costs(results, merged, tokenizer=self.tokenizer)
                for name, c in costs.items():
                    cells[name]["costs"] = c
            except Exception as e:  # costs are a view; the eval's rewards stand
                log.warning("eval harness costs: %s", e)
        return interval, cells

    def _eval_row(self, label: str) -> dict[str, Any]:
        interval, cells = self._evaluate(label)
        row = _eval_metrics(interval)
        if cells:
            row["eval_harnesses"] = cells
        return row

    def generate(self, step: int) -> list[RolloutResult]:
        """Run the rollouts of ``step`` to completion (the schedule decides when)."""
        return self.runner.run(self._jobs(step), mode="train")

    def schedule(self, start: int) -> Schedule:
        """When the rollouts of steps ``start, start+1, …`` are generated: each
        when its step is due, or ahead within ``max_staleness`` (the
        configuration decides, ``lightning.run.staleness.schedule``)."""
        from lightning.run.staleness import schedule

        cfg = self.config
        return schedule(
            cfg.algorithm,
            self.generate,
            self.phases,
            start=start,
            steps=cfg.steps,
            version=int(self.state["weight_version"]),
            timeout_s=max(h.timeout_s for h in cfg.all_harnesses()),
        )

    def _jobs(self, step: int) -> list[tuple[dict[str, Any], str]]:
        """The rollouts of one step: ``group_size`` per sampled task (one group each).

        With several harnesses, the step's groups are split among the trained
        ones (``RunConfig.harness_groups``), one group per (task, harness): see
        lightning.run.harnesses for why groups never span harnesses."""
        cfg = self.config
        counts = cfg.harness_groups(step)
        total = sum(counts.values())
        rng = random.Random(cfg.seed * 1_000_003 + step)
        chosen = rng.sample(self.train_tasks, k=min(total, len(self.train_tasks)))
        several = len(cfg.all_harnesses()) > 1
        jobs = []
        i = 0
        for name, n in counts.items():
            for _ in range(n):
                task = chosen[i % len(chosen)]
                group = f"step{step}-task{i}-{task.get('id', i)}"
                if several:
                    group += f"@{name}"
                i += 1
                for _ in range(cfg.algorithm.group_size):
                    seed = sampling_seed(cfg.seed, step, len(jobs))
                    temp = cfg.algorithm.train_temperature
                    jobs.append(
                        (
                            {**task, "temperature": temp, "sampling_seed": seed, HARNESS_KEY: name},
                            group,
                        )
                    )
        return jobs

    def _before_train(self) -> None:
        """A colocated engine gives its GPU memory to the trainer for the step (the
        next push takes it back). SGLang releases memory only when idle, so the
        gateway drains first: a call still in flight from a timed-out rollout would
        otherwise make the release fail."""
        if not self.weight_sync.colocated:
            return
        self.client.pause(drain=True, timeout_s=120.0)
        try:
            self.weight_sync.before_train()
        finally:
            self.client.resume()

    def _sync_weights(self, version: int) -> None:
        """Pause the gateway, drain in-flight calls, push weights, resume (docs/design.md#weight-sync).

        Asynchronous runs skip the gateway drain: calls in flight finish on the old
        weights (each engine's own update waits for them) and keep the version the
        gateway recorded when they started; the version is bumped only after the
        engines hold the new weights, so a recorded version is never newer than the
        weights that served the call."""
        drain = not self.config.algorithm.asynchronous
        if drain:
            self.client.pause(drain=True, timeout_s=120.0)
        try:
            if self.weight_sync.streams:
                # Broadcast from the live (sharded) model bucket by bucket: nothing
                # on disk, never the whole model on one host. Leaving the block
                # runs any gathers a failed push skipped, so every rank's
                # collectives still line up.
                with self.trainer.live_weights(self.sync_dtype) as source:
                    self.weight_sync.push(WeightUpdate(version=version, source=source))
            else:
                path = self.out / "weights" / f"v{version}"
                self.trainer.export_weights(str(path))
                self.weight_sync.push(WeightUpdate(version=version, path=path))
                # Only the newest weights are needed from now on.
                for old in (self.out / "weights").glob("v*"):
                    if old != path:
                        shutil.rmtree(old, ignore_errors=True)
            upstreams = [self.engine.url] if self.engine is not None else self.config.engine.urls
            self.client.set_upstreams([{"url": u, "weight_version": version} for u in upstreams])
        finally:
            if drain:
                self.client.resume()

    def _write_traces(
        self, step: int, results: Sequence[RolloutResult], merged: Any, rewards: dict[str, float]
    ) -> None:
        """The first sample of a few rollouts, decoded, to ``traces.jsonl`` (the
        report's traces and ``lightning show --run``) and to the trackers."""
        from lightning.traces import divergence_rows, sample_row, trace_record

        n = self.config.traces_per_step
        if n <= 0:
            return
        first: dict[str, Any] = {}
        for sample in merged.samples:
            first.setdefault(sample.rollout_id, sample)
        tasks = {r.rollout_id: r.task for r in results}
        # Round-robin over harnesses, so each harness of the step shows.
        per_harness: dict[str, list[str]] = {}
        for rid in first:
            per_harness.setdefault(harness_of(tasks.get(rid)), []).append(rid)
        order = [
            rid
            for tier in itertools.zip_longest(*per_harness.values())
            for rid in tier
            if rid is not None
        ]
        rows = []
        with open(self.out / "traces.jsonl", "a") as f:
            for rid in order[:n]:
                rows.append(
                    trace_record(
                        sample_row(first[rid], self.tokenizer),
                        divergence_rows(merged, rid),
                        step=step,
                        rollout_id=rid,
                        reward=rewards.get(rid),
                        task=tasks.get(rid),
                        harness=harness_of(tasks.get(rid)),
                    )
                )
                f.write(json.dumps(rows[-1]) + "\n")
        self.tracking.traces(step, rows)

    def train_on(self, step: int, results: list[RolloutResult], *, t0: float) -> dict[str, Any]:
        """Merge, train and push the weights of one step from its finished rollouts."""
        from lightning.run.staleness import enforce_at_use, step_metrics

        status = Counter(r.status for r in results)
        usable = [
            r.rollout_id
            for r in results
            if r.status == "succeeded" or not self.config.algorithm.drop_failed_rollouts
        ]
        # One read of the store: calls, rewards and groups as they are on disk
        # (what trains is what was recorded), merged with drift classified.
        merged = self.client.read_step(usable, tokenizer=self.tokenizer)
        # Asynchronous hook: the staleness bound, checked again at use.
        merged, stale = enforce_at_use(self, step, merged, results)
        unrewarded = sum(r.reward is None for r in merged.rollouts)
        rewards = {
            r.rollout_id: (r.reward if r.reward is not None else 0.0) for r in merged.rollouts
        }
        groups = {r.rollout_id: r.group for r in merged.rollouts if r.group is not None}
        calls = merged.calls
        t_rollout = time.monotonic() - t0
        if not merged.samples:
            raise RuntimeError(
                f"step {step}: no trainable calls from {len(results)} rollouts "
                f"(statuses {dict(status)}); see the stderr events in the store "
                f"({self.out / 'lightning.db'}) and {self.out / 'engine.log'}"
            )
        t_train = time.monotonic()
        self._before_train()
        metrics: dict[str, Any] = dict(self.trainer.step(merged, rewards, groups))
        version = step + 1
        self._sync_weights(version)
        self.phases.record("train", t_train, time.monotonic())
        metrics.update(step_metrics(self, step, calls, stale))
        lengths = [len(c.completion_ids) for c in calls]
        per_rollout = Counter(s.rollout_id for s in merged.samples)
        metrics.update(
            {
                "step": step,
                "rollouts": len(results),
                "rollout_status": dict(status),
                "rollouts_without_reward": unrewarded,
                "skipped_calls": merged.stats.skipped_calls,
                "response_len_mean": float(sum(lengths) / len(lengths)) if lengths else 0.0,
                "samples_per_rollout": (sum(per_rollout.values()) / len(per_rollout))
                if per_rollout
                else 0.0,
                "divergences": dict(Counter(d.kind for d in merged.divergences)),
                "rollout_time_s": t_rollout,
                "step_time_s": time.monotonic() - t0,
                "weight_version": version,
            }
        )
        costs = harness_costs(results, merged, tokenizer=self.tokenizer, rewards=rewards)
        metrics["harnesses"] = costs
        flags = split_flags(costs)
        if flags:
            metrics["harness_flags"] = flags
        self._write_traces(step, results, merged, rewards)
        return metrics

    def _append_metrics(self, metrics: dict[str, Any]) -> None:
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics, default=float) + "\n")
        self.tracking.metrics(metrics)

    def run(self) -> dict[str, Any]:
        cfg = self.config
        start = int(self.state["step"])
        summary: dict[str, Any] = {"output_dir": str(self.out)}
        if start == 0:
            before = self._eval_row("before training")
            summary["eval_before"] = before["eval_reward"]
            summary["eval_before_ci"] = [before.get("eval_ci_low"), before.get("eval_ci_high")]
            self._append_metrics({"step": -1, **before})
        else:
            self._say(f"resuming at step {start}")
        if start == 0 and cfg.sft is not None and cfg.sft.source == "expert_iteration":
            from lightning.run.sft import expert_iteration

            summary["expert_iteration"] = expert_iteration(self, cfg.sft)
        batches = self.schedule(start)
        self.phases.mark()
        with _progress(cfg.steps, start, quiet=self.quiet) as tick, batches:
            for batch in batches.batches():
                step = batch.step
                metrics = self.train_on(step, batch.results, t0=batch.t0)
                batches.published(step + 1)
                if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
                    metrics.update(self._eval_row(f"after step {step + 1}"))
                self._append_metrics(metrics)
                self.state = {"step": step + 1, "weight_version": step + 1}
                if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
                    self._checkpoint()
                self.state_path.write_text(json.dumps(self.state))
                tick(metrics)
        after = self._eval_row("after training")
        summary["eval_after"] = after["eval_reward"]
        summary["eval_after_ci"] = [after.get("eval_ci_low"), after.get("eval_ci_high")]
        self._append_metrics({"step": cfg.steps, **after})
        if "eval_harnesses" in after:
            from lightning.run.harnesses import eval_matrix, matrix_table, transfer_lines
            from lightning.run.report import read_jsonl

            matrix = eval_matrix(read_jsonl(self.out / "metrics.jsonl"))
            # The matrix alone; each eval's costs stay in metrics.jsonl.
            summary["eval_matrix"] = {
                name: [{k: v for k, v in c.items() if k != "costs"} for c in cells]
                for name, cells in matrix.items()
            }
            # With one harness the matrix is the eval line above, said again.
            if len(matrix) > 1:
                self._say("held-out reward per harness (95% intervals):\n" + matrix_table(matrix))
                for line in transfer_lines(matrix):
                    self._say(line)
        self._checkpoint()
        self.state_path.write_text(json.dumps(self.state))
        try:
            from lightning.run.report import write_report

            summary["report"] = str(write_report(self.out).html_path)
        except Exception as e:  # the run's data is safe on disk; a report can be redone
            log.warning("report failed: %s (rerun `lightning report %s`)", e, self.out)
        return summary

    def _checkpoint(self) -> None:
        tmp = self.out / "checkpoints" / "latest.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self.trainer.save_checkpoint(str(tmp))
        final = self.out / "checkpoints" / "latest"
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)


@contextlib.contextmanager
def _progress(total: int, start: int, *, quiet: bool) -> Iterator[Any]:
    if quiet or total == 0:
        yield lambda metrics: None
        return
    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = [
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task("train", total=total, completed=start, info="")
        last_eval = "-"

        def tick(m: dict[str, Any]) -> None:
            nonlocal last_eval
            if "eval_reward" in m:
                last_eval = f"{m['eval_reward']:.3f}"
            info = (
                f"reward {m.get('reward_mean', float('nan')):.3f}  eval {last_eval}  "
                f"{m.get('tokens_per_s', 0.0):.0f} tok/s"
            )
            progress.update(task, advance=1, info=info)

        yield tick


def train(config: RunConfig, *, resume: bool = False, quiet: bool = False) -> dict[str, Any]:
    with Run(config, resume=resume, quiet=quiet) as run:
        return run.run()


def train_main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="lightning train", description=__doc__.split("\n")[0])
    p.add_argument("config", help="run configuration (TOML)")
    p.add_argument("--resume", action="store_true", help="continue the run in its output_dir")
    p.add_argument("--output-dir", help="override output_dir")
    p.add_argument("--steps", type=int, help="override steps")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    overrides: dict[str, Any] = {}
    if args.output_dir:
        overrides["output_dir"] = args.output_dir
    if args.steps is not None:
        overrides["steps"] = args.steps
    config = RunConfig.load(args.config, overrides)
    from lightning.run.distributed import follower_main, init_from_env

    rank, _ = init_from_env()  # torchrun: rank 0 runs the loop, the others train
    if rank > 0:
        follower_main(config, resume=args.resume)
        return 0
    summary = train(config, resume=args.resume, quiet=args.quiet)
    print(json.dumps(summary, indent=2))
    return 0


def sft_main(argv: list[str]) -> int:
    import argparse
    import tomllib

    p = argparse.ArgumentParser(
        prog="lightning sft", description="supervised fine-tuning (docs/sft.md)"
    )
    p.add_argument("config", help="TOML with [model], [trainer] and [sft]")
    p.add_argument("--output-dir", help="override output_dir")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    overrides = {"output_dir": args.output_dir} if args.output_dir else {}
    from lightning.config import SftConfig
    from lightning.rl.sft import SftDataError
    from lightning.run.sft import run_standalone

    raw = tomllib.loads(Path(args.config).read_text())
    try:
        if (raw.get("sft") or {}).get("source") == "expert_iteration":
            summary = _expert_main(RunConfig.load(args.config, overrides), quiet=args.quiet)
        else:
            summary = run_standalone(SftConfig.load(args.config, overrides), quiet=args.quiet)
    except SftDataError as e:
        print(f"lightning sft: {e}", file=sys.stderr)
        return 1
    print(json.dumps({k: v for k, v in summary.items() if k != "data"}, indent=2, default=float))
    return 0


def _expert_main(cfg: RunConfig, *, quiet: bool) -> dict[str, Any]:
    from lightning.run.sft import expert_iteration

    if cfg.sft is None:
        raise ValueError("expert iteration needs an [sft] section")
    with Run(cfg.model_copy(update={"sft": None}), quiet=quiet) as run:
        before = run._eval_row("before expert iteration")
        summary = expert_iteration(run, cfg.sft)
        after = run._eval_row("after expert iteration")
        run._checkpoint()
    summary.update(
        output_dir=str(cfg.output_dir),
        eval_before=before.get("eval_reward"),
        eval_after=after.get("eval_reward"),
    )
    (Path(cfg.output_dir) / "sft" / "summary.json").write_text(
        json.dumps(summary, indent=2, default=float)
    )
    return summary
