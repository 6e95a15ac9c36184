"""The policy trainer: advantages → split-invariant PPO-family loss → optimizer step.

One :meth:`Trainer.step` is one batch of rollouts: it computes rollout
advantages (:mod:`lightning.rl.advantages`), broadcasts them onto every trained
token of every merged sample, and runs ``ppo_epochs × mini_batches`` optimizer
steps whose loss is normalised over the whole optimizer step
(:class:`lightning.rl.losses.Normalizer`), so the gradient is the same however the
data is split into micro-batches (by the token budget) or data-parallel ranks.

Data parallel: start the same script with ``torchrun``; when
``torch.distributed`` is initialised the model is wrapped in DDP. Every rank
calls ``step`` with the *whole* batch (advantages need whole groups); each rank
trains a contiguous, token-balanced shard of the samples.

Choices where the issue is silent:

1. Old log-probabilities are only recomputed (an extra no-grad forward pass)
   when the policy can move before a token is trained: ``ppo_epochs > 1`` or
   ``mini_batches > 1``. Strictly on-policy steps reuse the detached log-probs of
   the training forward pass (ratio exactly 1), or the engine's rollout
   log-probs with ``old_logprobs = "rollout"`` (NaN ones fall back to the
   trainer's own).
2. Train-serve gap metrics use the trainer's log-probs before any update of
   the step (the recompute pass when there is one, else the first forward of each
   mini-batch) against ``Sample.logprobs``; NaN (unknown) tokens are skipped.
   ``gap_kl`` is the k3 estimate of KL(π_rollout ‖ π_trainer) on those tokens.
3. Metrics: ``reward_*`` / ``adv_*`` are over rollouts (population std); token
   metrics (``clip_frac``, ``approx_kl``, ``entropy``) are weight-averaged over all
   trained tokens of all epochs; ``loss`` and ``grad_norm`` (before clipping) are
   averaged over optimizer steps; ``tokens`` counts sample tokens and
   ``tokens_per_s`` is tokens / step wall time. ``forward_tokens`` (extra) counts
   positions actually run through the model per pass (shared tree prefixes once).
   ``samples_per_rollout`` and ``single_sample_rollout_frac`` say how often
   drift or sub-agents split a rollout into several samples (every piece still
   takes its rollout's advantage, and ``rollout-mean`` counts the rollout once).
4. A sample whose rollout has no reward raises ``ValueError`` unless
   ``missing_reward`` is set; a rollout without a group uses ``Sample.group``,
   then its own id (a group of one: zero advantage).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from lightning.config import LoraSettings, TrainerConfig
from lightning.model_cache import no_progress_bars
from lightning.rl.advantages import estimate, zero_advantage_groups
from lightning.rl.batching import (
    MicroBatch,
    SeqItem,
    forward_logprobs,
    micro_batches,
    seq_items,
)
from lightning.rl.losses import (
    Normalizer,
    kl_penalty,
    policy_loss,
)

if TYPE_CHECKING:
    from lightning.sync.live_weights import LiveWeights

__all__ = ["LoraSettings", "Trainer", "TrainerConfig"]

log = logging.getLogger(__name__)

CPU_OFFLOAD_UNVERIFIED = (
    "cpu_offload = true is experimental on GPUs: FSDP2's CPUOffloadPolicy, the shards "
    "allocated on the CPU and the gloo backend for their collectives ran in lightning's "
    "tests on CPU ranks only, where offloading moves nothing (lightning/rl/fsdp.py, point 6)"
)

METRIC_KEYS = (
    "step",
    "reward_mean",
    "reward_std",
    "adv_mean",
    "adv_std",
    "zero_adv_group_frac",
    "loss",
    "clip_frac",
    "approx_kl",
    "entropy",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "samples",
    "tokens",
    "gap_abs_logprob",
    "gap_kl",
    "tis_weight_mean",
    "tis_clip_frac",
    "samples_per_rollout",
    "single_sample_rollout_frac",
)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _split_by_tokens(items: Sequence[SeqItem], parts: int) -> list[list[SeqItem]]:
    """Contiguous split into ``parts`` with near-equal token counts (groups
    stay together as far as possible, which the tree mode likes)."""
    sizes = np.cumsum([len(i.tokens) for i in items])
    total = int(sizes[-1]) if len(items) else 0
    out: list[list[SeqItem]] = [[] for _ in range(parts)]
    for item, end in zip(items, sizes, strict=True):
        k = min(parts - 1, int((end - len(item.tokens) / 2) * parts // max(total, 1)))
        out[k].append(item)
    return out


class _Sum(IntEnum):
    """Slots of a step's metric sums (one float64 tensor, all-reduced once):
    weighted sums over trained tokens, then the train-serve gap's terms, then
    the summed loss of the optimizer steps."""

    CLIPPED = 0  # Σ w · clipped
    APPROX_KL = 1  # Σ w · approx_kl
    ENTROPY = 2  # Σ w · entropy
    WEIGHT = 3  # Σ w
    IS_WEIGHT = 4  # Σ w · importance weight
    IS_TRUNCATED = 5  # Σ w · (importance weight truncated)
    GAP_ABS = 6  # Σ |log μ − log π|
    GAP_K3 = 7  # Σ k3 of KL(μ‖π)
    GAP_TOKENS = 8  # tokens with both log-probs known
    LOSS = 9  # Σ optimizer-step losses


@dataclass(frozen=True)
class _RolloutBatch:
    """A step's samples in training order (by group, then rollout, then as
    given) and what the loss needs per rollout (first-appearance order)."""

    samples: list[Any]
    rollout_ids: list[str]
    rewards: np.ndarray  # [n_rollouts] float64
    advantages: torch.Tensor  # [n_rollouts]
    zero_groups: set[Any]  # groups whose rewards are all equal
    n_groups: int
    pieces: np.ndarray  # [n_rollouts] samples per rollout (drift and sub-agents split one)


def _rollout_batch(
    samples: list[Any], rewards: Mapping[str, float], groups: Mapping[str, Any], cfg: TrainerConfig
) -> _RolloutBatch:
    rollout_ids: list[str] = list(dict.fromkeys(s.rollout_id for s in samples))
    sample_group = {s.rollout_id: s.group for s in samples}
    group_of = {rid: groups.get(rid, sample_group.get(rid) or rid) for rid in rollout_ids}
    reward_list = []
    for rid in rollout_ids:
        if rid in rewards:
            reward_list.append(float(rewards[rid]))
        elif cfg.missing_reward is not None:
            reward_list.append(cfg.missing_reward)
        else:
            raise ValueError(
                f"rollout {rid!r} has samples but no reward; pass it in rewards or set "
                "missing_reward in the trainer config"
            )
    group_keys = [group_of[rid] for rid in rollout_ids]
    rollout_rank = {rid: k for k, rid in enumerate(rollout_ids)}
    pieces = np.bincount(
        np.array([rollout_rank[s.rollout_id] for s in samples], dtype=np.int64),
        minlength=len(rollout_ids),
    )
    zero = zero_advantage_groups(reward_list, group_keys)
    if cfg.filter_zero_adv_groups:
        samples = [s for s in samples if group_of[s.rollout_id] not in zero]
    # Grouped, so that a group's samples sit next to each other (shared
    # prompts land in one tree).
    group_rank = {g: k for k, g in enumerate(dict.fromkeys(group_keys))}
    order = sorted(
        range(len(samples)),
        key=lambda i: (
            group_rank[group_of[samples[i].rollout_id]],
            rollout_rank[samples[i].rollout_id],
            i,
        ),
    )
    return _RolloutBatch(
        samples=[samples[i] for i in order],
        rollout_ids=rollout_ids,
        rewards=np.asarray(reward_list, dtype=np.float64),
        advantages=estimate(reward_list, group_keys, estimator=cfg.estimator, eps=cfg.adv_eps),
        zero_groups=zero,
        n_groups=len(set(group_keys)),
        pieces=pieces,
    )


@dataclass
class _Targets:
    """Step-wide per-target tensors ``[N]``, indexed by target id."""

    weight: torch.Tensor  # float32, host
    advantage: torch.Tensor  # float32, device: the target's rollout's
    rollout_logp: torch.Tensor  # float32, device: the engine's (NaN: unknown)
    sample: torch.Tensor  # long, host
    rollout: torch.Tensor  # long, host
    old: torch.Tensor  # device: the ratio's denominator (NaN: this pass's own)
    first: torch.Tensor  # device: the first epoch's log-probs (the gap's, without a recompute)
    ref: torch.Tensor | None = None  # device: the reference policy's (kl_coef > 0)

    @property
    def n(self) -> int:
        return len(self.weight)


def _targets(rb: _RolloutBatch, items: Sequence[SeqItem], device: torch.device) -> _Targets:
    adv_of = dict(zip(rb.rollout_ids, rb.advantages.tolist(), strict=True))
    rollout_rank = {rid: k for k, rid in enumerate(rb.rollout_ids)}
    weight, advantage, rollout_lp, sample_id, rollout_idx = [], [], [], [], []
    for k, (s, item) in enumerate(zip(rb.samples, items, strict=True)):
        pos = item.positions
        weight.append(np.asarray(s.weights, dtype=np.float32)[pos])
        advantage.append(np.full(len(pos), adv_of[s.rollout_id], dtype=np.float32))
        lp = s.logprobs
        rollout_lp.append(
            np.full(len(pos), np.nan, np.float32) if lp is None else np.asarray(lp, np.float32)[pos]
        )
        sample_id.append(np.full(len(pos), k))
        rollout_idx.append(np.full(len(pos), rollout_rank[s.rollout_id]))
    n = sum(len(i.positions) for i in items)
    cat = lambda xs, dt: torch.from_numpy(np.concatenate(xs) if xs else np.zeros(0)).to(dt)  # noqa: E731
    unknown = torch.full((n,), float("nan"), device=device)
    return _Targets(
        weight=cat(weight, torch.float32),
        advantage=cat(advantage, torch.float32).to(device),
        rollout_logp=cat(rollout_lp, torch.float32).to(device),
        sample=cat(sample_id, torch.long),
        rollout=cat(rollout_idx, torch.long),
        old=unknown,
        first=unknown.clone(),
    )


def _add_gap(sums: torch.Tensor, rollout_lp: torch.Tensor, trainer_lp: torch.Tensor) -> None:
    """Adds the train-serve gap terms of tokens whose two log-probs are known."""
    known = ~torch.isnan(rollout_lp) & ~torch.isnan(trainer_lp)
    d = (rollout_lp - trainer_lp)[known].double()  # log(μ/π)
    sums[_Sum.GAP_ABS] += d.abs().sum().cpu()
    sums[_Sum.GAP_K3] += (torch.expm1(-d) + d).sum().cpu()  # k3 of KL(μ‖π)
    sums[_Sum.GAP_TOKENS] += float(known.sum())


def _metrics(
    rb: _RolloutBatch,
    sums: torch.Tensor,
    counts: torch.Tensor,
    grad_norms: list[float],
    lr: float,
    elapsed: float,
    cfg: TrainerConfig,
) -> dict[str, Any]:
    """The step's metrics but its number (see the module's choice 3)."""
    nan = float("nan")
    wsum = float(sums[_Sum.WEIGHT])
    gap_tokens = float(sums[_Sum.GAP_TOKENS])
    tis = cfg.tis_cap is not None
    per_w = lambda k: float(sums[k]) / wsum if wsum else nan  # noqa: E731
    r, a, pieces = rb.rewards, rb.advantages.double().numpy(), rb.pieces
    return {
        "reward_mean": float(r.mean()) if len(r) else nan,
        "reward_std": float(r.std()) if len(r) else nan,
        "adv_mean": float(a.mean()) if len(a) else nan,
        "adv_std": float(a.std()) if len(a) else nan,
        "zero_adv_group_frac": len(rb.zero_groups) / rb.n_groups if rb.n_groups else nan,
        "loss": float(sums[_Sum.LOSS]) / max(1, len(grad_norms)),
        "clip_frac": per_w(_Sum.CLIPPED),
        "approx_kl": per_w(_Sum.APPROX_KL),
        "entropy": per_w(_Sum.ENTROPY),
        "grad_norm": float(np.mean(grad_norms)) if grad_norms else nan,
        "lr": lr,
        "tokens_per_s": float(counts[1]) / elapsed if elapsed > 0 else nan,
        "samples": int(counts[0]),
        "tokens": int(counts[1]),
        "gap_abs_logprob": float(sums[_Sum.GAP_ABS]) / gap_tokens if gap_tokens else nan,
        "gap_kl": float(sums[_Sum.GAP_K3]) / gap_tokens if gap_tokens else nan,
        # Truncated importance weights (``tis_cap``): their mean and the
        # fraction of trained tokens whose weight the cap cut.
        "tis_weight_mean": per_w(_Sum.IS_WEIGHT) if tis else nan,
        "tis_clip_frac": per_w(_Sum.IS_TRUNCATED) if tis else nan,
        "forward_tokens": int(counts[2]),
        "samples_per_rollout": float(pieces.mean()) if len(pieces) else nan,
        "single_sample_rollout_frac": float((pieces == 1).mean()) if len(pieces) else nan,
    }


class Trainer:
    """A Hugging Face causal LM trained with the PPO family on merged samples."""

    def __init__(self, config: TrainerConfig, *, log_dir: str | None = None) -> None:
        """Load the model from ``config.model``; ``log_dir`` overrides ``config.log_dir``."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        # The config arrives validated (from TOML, a run, or TrainerConfig(...));
        # a dict here would be a second, untyped way in.
        if not isinstance(config, TrainerConfig):
            raise TypeError(
                f"Trainer takes a TrainerConfig, not {type(config).__name__}; "
                "build one with TrainerConfig(model=..., ...) or TrainerConfig.from_toml(path)"
            )
        cfg = config if log_dir is None else config.with_values(log_dir=log_dir)
        self.config = cfg
        torch.manual_seed(cfg.seed)
        cuda = torch.cuda.is_available()
        if cfg.device == "cuda" and not cuda:
            raise ValueError(
                "device 'cuda' requested but CUDA is not available; use 'cpu' or 'auto'"
            )
        self.rank, self.world = _world()
        if cfg.device == "cpu" or not cuda:
            self.device = torch.device("cpu")
        else:
            self.device = torch.device("cuda", torch.cuda.current_device())
        compute = cfg.compute_dtype
        if compute == "auto":
            compute = "bfloat16" if self.device.type == "cuda" else "float32"
        self.compute_dtype: torch.dtype = getattr(torch, compute)
        self.fsdp = self.world > 1 and cfg.parallel == "fsdp2"
        # Master weights are the float32 parameters the optimizer steps (see
        # TrainerSection.compute_dtype). One process: autocast runs the matmuls
        # in bf16 against those same parameters, so there is no second copy to
        # keep in sync and gradients land in float32. FSDP2: its mixed-precision
        # policy casts instead, and autocast stays off.
        low = self.compute_dtype != torch.float32
        self._amp_dtype = self.compute_dtype if low and not self.fsdp else None

        def prepare(model: Any) -> None:
            model.config.use_cache = False
            if cfg.gradient_checkpointing:
                # Non-reentrant checkpointing works with DDP, FSDP2, LoRA and no_sync.
                model.activation_checkpointing_enable({"use_reentrant": False})

        if cfg.cpu_offload and not self.fsdp:
            log.warning(
                "cpu_offload applies to FSDP2 under torchrun; this single process keeps "
                "its weights and optimizer state on %s",
                self.device,
            )
        if self.fsdp:  # FSDP2 hook: meta init, shard, load per shard (lightning.rl.fsdp)
            from lightning.rl import fsdp

            if cfg.cpu_offload and self.device.type == "cuda":
                log.warning(CPU_OFFLOAD_UNVERIFIED)
            model = fsdp.build_sharded(
                cfg.model,
                self.device,
                compute_dtype=self.compute_dtype,
                prepare=prepare,
                offload=cfg.cpu_offload,
            )
        else:
            model = AutoModelForCausalLM.from_pretrained(
                cfg.model, dtype=torch.float32, attn_implementation="sdpa"
            ).to(self.device)
            prepare(model)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        if cfg.lora is not None:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(
                model,
                LoraConfig(
                    r=cfg.lora.r,
                    lora_alpha=cfg.lora.alpha,
                    lora_dropout=cfg.lora.dropout,
                    target_modules=cfg.lora.target_modules,
                    task_type="CAUSAL_LM",
                ),
            )
            if cfg.gradient_checkpointing:
                model.enable_input_require_grads()
        model.train()
        self.model: torch.nn.Module = model
        self.ddp: torch.nn.Module | None = None
        if self.world > 1 and not self.fsdp:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = DistributedDataParallel(model, device_ids=ids)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.ref_model: torch.nn.Module | None = None
        # No reference model at all unless the KL term needs one (LoRA without
        # ref_model uses the base weights under disable_adapter()).
        if cfg.kl_coef > 0 and (cfg.lora is None or cfg.ref_model is not None):
            if self.fsdp:  # FSDP2 hook: sharded like the policy, stored in compute dtype
                from lightning.rl import fsdp

                ref = fsdp.build_sharded(
                    cfg.ref_model or cfg.model,
                    self.device,
                    compute_dtype=self.compute_dtype,
                    storage_dtype=self.compute_dtype,
                    offload=cfg.cpu_offload,
                )
            else:
                ref = AutoModelForCausalLM.from_pretrained(
                    cfg.ref_model or cfg.model, dtype=torch.float32, attn_implementation="sdpa"
                ).to(self.device)
            self.ref_model = ref.eval().requires_grad_(False)
        self.step_count = 0
        self._log_file: Any = None
        self._tb: Any = None
        if cfg.log_dir is not None and self.rank == 0:
            Path(cfg.log_dir).mkdir(parents=True, exist_ok=True)
            self._log_file = open(Path(cfg.log_dir) / "trainer_metrics.jsonl", "a")
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(cfg.log_dir)

    # ----------------------------------------------------------------- helpers
    def _lr_factor(self, k: int) -> float:
        cfg = self.config
        if cfg.warmup_steps and k < cfg.warmup_steps:
            return (k + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "constant" or cfg.total_steps is None:
            return 1.0
        span = max(1, cfg.total_steps - cfg.warmup_steps)
        frac = min(1.0, (k - cfg.warmup_steps) / span)
        if cfg.lr_schedule == "linear":
            return 1.0 - frac
        return 0.5 * (1.0 + math.cos(math.pi * frac))

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self._amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._amp_dtype)

    def _logprobs(self, model: torch.nn.Module, mbs: Sequence[MicroBatch], n: int) -> torch.Tensor:
        out = torch.full((n,), float("nan"), device=self.device)
        with torch.no_grad(), self._autocast():
            for mb in mbs:
                lp, _ = forward_logprobs(
                    model, mb.to(self.device), temperature=self.config.temperature
                )
                out[mb.target_ids.to(self.device)] = lp
        return out

    def _ref_logprobs(self, mbs: Sequence[MicroBatch], n: int) -> torch.Tensor:
        if self.ref_model is not None:
            return self._logprobs(self.ref_model, mbs, n)
        with self.model.disable_adapter():  # type: ignore[operator]
            return self._logprobs(self.model, mbs, n)

    # -------------------------------------------------------------------- step
    def step(
        self,
        batch: Any,
        rewards: Mapping[str, float],
        groups: Mapping[str, Any],
    ) -> dict[str, Any]:
        """Train on one batch of merged samples; returns the step's metrics.

        ``batch``: a ``lightning.MergeResult`` (``tree`` batching then runs its
        ``packed(across_rollouts=True)`` tree), or a sequence of samples: objects
        with ``rollout_id, group, tokens, weights, logprobs, call_index``
        (``lightning.Sample``; ``tree`` batching packs their tokens with
        ``lightning.pack_sequences``). ``rewards`` / ``groups`` map rollout ids
        to their reward and group key. Every rank passes the whole batch.
        """
        cfg = self.config
        t0 = time.perf_counter()
        merged = batch if hasattr(batch, "packed") and hasattr(batch, "samples") else None
        packed = (
            merged.packed(across_rollouts=True)
            if merged is not None and cfg.batching == "tree"
            else None
        )
        rb = _rollout_batch(
            list(merged.samples if merged is not None else batch), rewards, groups, cfg
        )
        items = seq_items(rb.samples)
        tg = _targets(rb, items, self.device)

        shard = _split_by_tokens(items, self.world)[self.rank] if items else []
        minis = (
            _split_by_tokens(shard, cfg.mini_batches)
            if shard
            else [[] for _ in range(cfg.mini_batches)]
        )
        mini_mbs = [
            micro_batches(m, cfg.micro_batch_tokens, mode=cfg.batching, packed=packed) if m else []
            for m in minis
        ]
        if self.fsdp:  # FSDP2 hook: every rank runs as many forwards as the busiest
            from lightning.rl import fsdp

            mini_mbs = fsdp.balance(mini_mbs, self.device)
        all_mbs = [mb for mbs in mini_mbs for mb in mbs]

        pre_update = self._old_logprobs(tg, all_mbs)
        tg.ref = self._ref_logprobs(all_mbs, tg.n) if cfg.kl_coef > 0 else None
        sums = torch.zeros(len(_Sum), dtype=torch.float64)
        grad_norms = []
        for epoch in range(cfg.ppo_epochs):
            for mbs in mini_mbs:
                grad_norms.append(self._optimizer_step(mbs, epoch, tg, sums))

        # Train-serve gap on pre-update trainer log-probs.
        trainer_lp = pre_update if pre_update is not None else tg.first
        if all_mbs:
            mine = torch.cat([mb.target_ids for mb in all_mbs]).to(self.device)
            _add_gap(sums, tg.rollout_logp[mine], trainer_lp[mine])
        counts = torch.tensor(
            [
                len(shard),
                sum(len(i.tokens) for i in shard),
                sum(mb.forward_tokens for mb in all_mbs),
            ],
            dtype=torch.float64,
        )
        if self.world > 1:
            dist.all_reduce(sums)
            dist.all_reduce(counts)
        self.step_count += 1
        lr = float(self.scheduler.get_last_lr()[0])
        elapsed = time.perf_counter() - t0
        metrics = {
            "step": self.step_count,
            **_metrics(rb, sums, counts, grad_norms, lr, elapsed, cfg),
        }
        self._log(metrics)
        return metrics

    # -------------------------------------------------------------- supervised
    def supervised_step(self, samples: Sequence[Any], *, train: bool = True) -> dict[str, Any]:
        """One optimizer step of supervised fine-tuning on ``samples`` (objects
        with ``tokens`` and ``weights``: ``lightning.Sample``, or
        :class:`lightning.rl.sft.SftSample`); with ``train=False`` the same
        loss and metrics without a gradient (validation).

        The loss is the weighted negative log-likelihood of every token with
        weight > 0 at temperature 1, ``Σ w·(−log p) / Σ w`` over the whole step
        (every rank passes every sample; each trains a token-balanced shard, as
        in :meth:`step`), laid out by ``[trainer] batching`` in micro-batches of
        ``micro_batch_tokens``. Returns ``sft_loss`` (or ``sft_val_loss``), the
        mean ``sft_entropy`` of the predicted distributions at trained tokens
        (``sft_val_entropy``), and with the same prefix ``tokens`` (trained),
        ``forward_tokens``, ``samples`` and ``tokens_per_s``; training steps add ``grad_norm`` and ``lr`` and advance
        the learning-rate schedule and ``step_count``."""
        cfg = self.config
        t0 = time.perf_counter()
        items = seq_items(samples)
        weight = torch.from_numpy(
            np.concatenate(
                [
                    np.asarray(s.weights, dtype=np.float32)[i.positions]
                    for s, i in zip(samples, items, strict=True)
                ]
            )
            if items
            else np.zeros(0, np.float32)
        )  # [N] float32, by target id
        total = float(weight.double().sum())
        if total <= 0:
            raise ValueError(
                f"supervised step on {len(samples)} samples with no trained token (every "
                "weight is 0); check that the data has assistant turns"
            )
        shard = _split_by_tokens(items, self.world)[self.rank] if items else []
        mbs = micro_batches(shard, cfg.micro_batch_tokens, mode=cfg.batching) if shard else []
        if self.fsdp:  # FSDP2 hook: every rank runs as many forwards as the busiest
            from lightning.rl import fsdp

            mbs = fsdp.balance([mbs], self.device)[0]
        # [nll, entropy, weight] sums over this rank's trained tokens.
        sums = torch.zeros(3, dtype=torch.float64)
        net = (self.ddp or self.model) if train else self.model
        grad_norm = float("nan")
        if train:
            self.optimizer.zero_grad(set_to_none=True)
        grad = torch.enable_grad() if train else torch.no_grad()
        with grad:
            for mb in mbs:
                with self._no_sync() if train else contextlib.nullcontext(), self._autocast():
                    lp, ent = forward_logprobs(net, mb.to(self.device), entropy=True)
                assert ent is not None
                w = weight[mb.target_ids].to(self.device)  # [K]
                nll = -(w * lp).sum()
                if train:
                    # DDP averages gradients over ranks; the denominator is global.
                    (nll / total * self.world).backward()
                sums += torch.stack(
                    [nll.detach().double(), (w * ent).sum().double(), w.sum().double()]
                ).cpu()
            if train:
                self._sync_grads()
                gn = torch.nn.utils.clip_grad_norm_(
                    self.params, cfg.max_grad_norm if cfg.max_grad_norm is not None else math.inf
                )
                self.optimizer.step()
                self.scheduler.step()
                grad_norm = float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)
        counts = torch.tensor(
            [len(shard), sum(mb.forward_tokens for mb in mbs)], dtype=torch.float64
        )
        if self.world > 1:
            dist.all_reduce(sums)
            dist.all_reduce(counts)
        elapsed = time.perf_counter() - t0
        prefix = "sft_" if train else "sft_val_"
        metrics: dict[str, Any] = {
            f"{prefix}loss": float(sums[0]) / total,
            f"{prefix}entropy": float(sums[1]) / total,
            f"{prefix}tokens": len(weight),
            f"{prefix}samples": int(counts[0]),
            f"{prefix}forward_tokens": int(counts[1]),
            f"{prefix}tokens_per_s": float(counts[1]) / elapsed if elapsed > 0 else float("nan"),
        }
        if train:
            self.step_count += 1
            metrics["grad_norm"] = grad_norm
            metrics["lr"] = float(self.scheduler.get_last_lr()[0])
        return metrics

    def _old_logprobs(self, tg: _Targets, mbs: Sequence[MicroBatch]) -> torch.Tensor | None:
        """Fills ``tg.old``; returns the pre-update log-probs when a no-grad pass
        computed them (see the module's choice 1)."""
        cfg = self.config
        moves_first = cfg.ppo_epochs > 1 or cfg.mini_batches > 1
        if cfg.old_logprobs == "rollout":
            tg.old = tg.rollout_logp.clone()
        if cfg.old_logprobs == "recompute" or (moves_first and bool(torch.isnan(tg.old).any())):
            pre_update = self._logprobs(self.model, mbs, tg.n)
            tg.old = torch.where(torch.isnan(tg.old), pre_update, tg.old)
            return pre_update
        return None

    def _optimizer_step(
        self, mbs: Sequence[MicroBatch], epoch: int, tg: _Targets, sums: torch.Tensor
    ) -> float:
        """One optimizer step over a mini-batch's micro-batches, normalised over
        the mini-batch; returns the gradient norm before clipping."""
        cfg = self.config
        ids = torch.cat([mb.target_ids for mb in mbs]) if mbs else torch.zeros(0, dtype=torch.long)
        norm = Normalizer.build(
            tg.weight[ids],
            tg.sample[ids],
            tg.rollout[ids],
            mode=cfg.aggregation,
            max_len=cfg.max_len,
        )
        self.optimizer.zero_grad(set_to_none=True)
        net = self.ddp or self.model
        for mb in mbs:
            with self._no_sync():
                sums[_Sum.LOSS] += self._micro_step(net, mb, epoch, norm, tg, sums)
        self._sync_grads()
        gn = torch.nn.utils.clip_grad_norm_(
            self.params, cfg.max_grad_norm if cfg.max_grad_norm is not None else math.inf
        )
        self.optimizer.step()
        self.scheduler.step()
        return float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)

    def _micro_step(
        self,
        net: torch.nn.Module,
        mb: MicroBatch,
        epoch: int,
        norm: Normalizer,
        tg: _Targets,
        sums: torch.Tensor,
    ) -> float:
        """Forward + backward of one micro-batch; adds its token metrics to ``sums``."""
        cfg = self.config
        ids = mb.target_ids
        dev_ids = ids.to(self.device)
        with self._autocast():
            lp, ent = forward_logprobs(
                net,
                mb.to(self.device),
                entropy=True,
                entropy_grad=cfg.entropy_coef != 0,
                temperature=cfg.temperature,
            )
        assert ent is not None
        if epoch == 0:
            tg.first[dev_ids] = lp.detach()
        old_mb = tg.old[dev_ids]
        old_mb = torch.where(torch.isnan(old_mb), lp.detach(), old_mb)
        token_loss, m = policy_loss(
            lp,
            old_mb,
            tg.advantage[dev_ids],
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            dual_clip=cfg.dual_clip,
            rollout_logp=tg.rollout_logp[dev_ids] if cfg.tis_cap is not None else None,
            tis_cap=cfg.tis_cap,
            ratio_level=cfg.ratio_level,
            tis_level=cfg.tis_level,
            sample_index=tg.sample[ids].to(self.device),
        )
        if tg.ref is not None:
            token_loss = token_loss + cfg.kl_coef * kl_penalty(
                lp, tg.ref[dev_ids], estimator=cfg.kl_estimator
            )
        if cfg.entropy_coef != 0:
            token_loss = token_loss - cfg.entropy_coef * ent
        coef = norm.coefficients(tg.weight[ids], tg.sample[ids], tg.rollout[ids]).to(self.device)
        loss = (coef.to(token_loss.dtype) * token_loss).sum()  # coef: [K]
        # DDP averages gradients over ranks; the normaliser is already global,
        # so undo the average.
        (loss * self.world).backward()
        w = tg.weight[ids].to(self.device, torch.float64)
        terms = {
            _Sum.CLIPPED: m["clipped"],
            _Sum.APPROX_KL: m["approx_kl"],
            _Sum.ENTROPY: ent.detach(),
            _Sum.WEIGHT: torch.ones_like(w),
            _Sum.IS_WEIGHT: m["is_weight"],
            _Sum.IS_TRUNCATED: m["is_truncated"],
        }
        sums[list(terms)] += torch.stack([(w * t).sum() for t in terms.values()]).cpu()
        return float(loss.detach())

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        if self.ddp is None:
            yield
        else:
            with self.ddp.no_sync():  # type: ignore[operator]
                yield

    def _sync_grads(self) -> None:
        """One synchronised zero-loss backward through DDP: it all-reduces the
        gradients accumulated under ``no_sync`` whatever the number of
        micro-batches each rank ran (ranks may differ)."""
        if self.ddp is None:
            return
        dummy = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        with self._autocast():
            out = self.ddp(input_ids=dummy, use_cache=False)
        (out.logits.float().sum() * 0.0).backward()

    def _log(self, metrics: Mapping[str, Any]) -> None:
        if self._log_file is not None:
            clean = {
                k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                for k, v in metrics.items()
            }
            self._log_file.write(json.dumps(clean) + "\n")
            self._log_file.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if k != "step" and isinstance(v, int | float) and math.isfinite(v):
                    self._tb.add_scalar(f"train/{k}", v, metrics["step"])
            self._tb.flush()

    # ----------------------------------------------------------- weights & ckpt
    def export_weights(self, path: str | os.PathLike[str]) -> Path:
        """Write the current policy as a plain HF model directory (safetensors,
        config, tokenizer files), loadable by ``AutoModelForCausalLM.from_pretrained``
        and the engine's ``/admin/load_weights``. LoRA adapters are merged into a
        copy. The directory appears atomically (written aside, then renamed)."""
        target = Path(path)
        full: dict[str, torch.Tensor] | None = None
        if self.fsdp:  # FSDP2 hook: gather the shards (all ranks) onto rank 0's CPU
            from lightning.rl import fsdp

            full = fsdp.full_state_dict(self.model)
        if self.rank == 0:
            model = self.model
            if self.config.lora is not None:
                model = copy.deepcopy(model).merge_and_unload()  # type: ignore[operator]
            target.parent.mkdir(parents=True, exist_ok=True)
            build = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
            with no_progress_bars():
                model.save_pretrained(  # type: ignore[operator]
                    build, safe_serialization=True, state_dict=full
                )
            self.tokenizer.save_pretrained(build)
            if target.exists():
                old = target.with_name(target.name + f".old-{os.getpid()}")
                target.rename(old)
                build.rename(target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                build.rename(target)
        if self.world > 1:
            dist.barrier()
        return target

    def live_weights(self, dtype: str | None = None) -> LiveWeights:
        """The current policy as full tensors gathered one at a time from the live
        (sharded) model, for weight syncs that broadcast without disk
        (``lightning.sync.live_weights``). Every rank must drain it: under
        FSDP2 each gather is a collective. LoRA adapters are merged into a copy.
        ``dtype`` (a torch dtype name, the engine's): floating weights are cast to
        it before they are gathered, so a bf16 engine gets half the bytes of the
        float32 masters (a name, not a ``torch.dtype``: the call is mirrored to the
        other ranks as a pickle)."""
        from lightning.sync.live_weights import LiveWeights

        model = self.model
        if self.config.lora is not None:
            model = copy.deepcopy(model).merge_and_unload()  # type: ignore[operator]
        return LiveWeights.of_module(model, sender=self.rank == 0, dtype=dtype)

    def save_checkpoint(self, directory: str | os.PathLike[str]) -> Path:
        """Model (``model/``, merged, as :meth:`export_weights`), the LoRA adapter
        (``adapter/``) if any, optimizer + scheduler state and the config."""
        root = Path(directory)
        self.export_weights(root / "model")
        if self.fsdp:  # FSDP2 hook: model + optimizer shards, one file per rank
            from lightning.rl import fsdp

            fsdp.save_sharded(root / "sharded", self.model, self.optimizer)
        if self.rank == 0:
            if self.config.lora is not None:
                self.model.save_pretrained(root / "adapter")  # type: ignore[operator]
            torch.save(
                {
                    "optimizer": None if self.fsdp else self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                    "step": self.step_count,
                },
                root / "trainer_state.pt",
            )
            (root / "trainer_config.json").write_text(self.config.model_dump_json(indent=2))
        if self.world > 1:
            dist.barrier()
        return root

    def load_checkpoint(self, directory: str | os.PathLike[str]) -> None:
        """Restore what :meth:`save_checkpoint` wrote into this trainer."""
        from safetensors.torch import load_file

        root = Path(directory)
        if self.fsdp:  # FSDP2 hook: shards of model and optimizer
            from lightning.rl import fsdp

            fsdp.load_sharded(root / "sharded", self.model, self.optimizer)
        elif self.config.lora is not None:
            from peft import set_peft_model_state_dict

            state = load_file(root / "adapter" / "adapter_model.safetensors")
            set_peft_model_state_dict(self.model, state)
        else:
            state = {}
            for f in sorted((root / "model").glob("*.safetensors")):
                state.update(load_file(f))
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
            if set(missing) - tied or unexpected:
                raise ValueError(
                    f"checkpoint {root} does not match the model: missing {missing}, "
                    f"unexpected {unexpected}"
                )
        blob = torch.load(root / "trainer_state.pt", map_location=self.device, weights_only=True)
        if not self.fsdp:
            self.optimizer.load_state_dict(blob["optimizer"])
        self.scheduler.load_state_dict(blob["scheduler"])
        self.step_count = int(blob["step"])

    def close(self) -> None:
        """Flush and close the metric logs."""
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
