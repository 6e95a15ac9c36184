"""PPO-family per-token losses and split-invariant aggregation.

Methods (DESIGN.md §6):

- PPO clip (Schulman et al. 2017) with decoupled ``clip_low`` / ``clip_high``
  (DAPO's clip-higher, Yu et al. 2025); dual clip (Ye et al. 2020) bounding the
  loss of negative-advantage tokens by ``-c·A``.
- GSPO (Zheng et al. 2025): a sequence-level ratio ``exp(mean_t log ρ_t)`` used
  for every token of the sequence (the GSPO-token form, whose gradient flows
  through each token's own log-probability).
- Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework
  secretly brings you off-policy RL training"): the loss is multiplied by
  ``min(exp(logπ_old − logπ_rollout), C)`` (per token, or per sequence with the
  product of the token ratios) to correct for the inference engine's numerics.
- KL to a reference (Schulman's k1 / k3 estimators) and an entropy bonus.

Aggregation: every mode is a weighted sum ``Σ_t c_t ℓ_t`` whose coefficients
``c_t`` depend only on the weights and sample/rollout membership of the *whole
optimizer step*. :class:`Normalizer` computes them once (all-reducing across
data-parallel ranks), so summing gradients of micro-batches (and of ranks)
gives the gradient of the whole step exactly. :func:`aggregate` is that
function applied to one un-split step.

Departures:

1. Samples and rollouts whose tokens all have weight 0 do not count in the
   ``seq-mean-*`` / ``rollout-mean`` denominators (they carry no loss; counting
   them would make the result depend on whether context tokens are passed in).
2. Unknown rollout log-probabilities (NaN) get an importance weight of 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import torch
import torch.distributed as dist

from lightning.modes import AGGREGATION_MODES, AggregationMode, KLEstimator, RatioLevel

__all__ = [
    "AGGREGATION_MODES",
    "AggregationMode",
    "Normalizer",
    "aggregate",
    "check_mode",
    "entropy_from_logits",
    "kl_penalty",
    "policy_loss",
    "sequence_log_ratio",
]


def check_mode(mode: str, max_len: float | None = None) -> None:
    """Raise ``ValueError`` for an unknown aggregation mode or a missing ``max_len``."""
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; use one of {AGGREGATION_MODES}")
    if mode == "seq-mean-token-sum-norm" and (max_len is None or max_len <= 0):
        raise ValueError(
            "aggregation mode 'seq-mean-token-sum-norm' needs max_len > 0 "
            f"(the constant L of Dr. GRPO), got {max_len!r}"
        )


def _segment_sum(values: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    out = torch.zeros(size, dtype=values.dtype, device=values.device)
    return out.index_add_(0, index, values)


@dataclass(frozen=True)
class Normalizer:
    """Whole-step denominators of one aggregation mode.

    Build it from the step's token weights and *step-global* sample / rollout
    ids (unique across ranks) with :meth:`build`; then
    ``(normalizer.coefficients(w, s, r) * token_losses).sum()`` on any subset of
    the tokens is that subset's exact share of the step loss.
    """

    mode: AggregationMode
    sample_weight: torch.Tensor  # [n_sample_ids] float64, Σ w per sample id
    rollout_weight: torch.Tensor  # [n_rollout_ids] float64, Σ w per rollout id
    total_weight: float
    n_samples: int
    n_rollouts: int
    max_len: float | None

    @classmethod
    def build(
        cls,
        weights: torch.Tensor,
        sample_index: torch.Tensor,
        rollout_index: torch.Tensor,
        *,
        mode: AggregationMode,
        max_len: float | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> Normalizer:
        """Denominators over all tokens given here, summed over every rank of
        ``group`` when ``torch.distributed`` is initialised (each rank passes its
        own tokens; every rank must call this)."""
        check_mode(mode, max_len)
        w = weights.detach().to(torch.float64).reshape(-1)  # [T]
        s = sample_index.reshape(-1).long().to(w.device)  # [T]
        r = rollout_index.reshape(-1).long().to(w.device)  # [T]
        if not (w.numel() == s.numel() == r.numel()):
            raise ValueError(
                f"weights ({w.numel()}), sample_index ({s.numel()}) and rollout_index "
                f"({r.numel()}) must have one entry per token"
            )
        if (w < 0).any():
            raise ValueError("token weights must be >= 0")
        distributed = dist.is_available() and dist.is_initialized()
        # NCCL reduces device tensors only; gloo and the local case use the CPU.
        comm = (
            w.device if distributed and dist.get_backend(group) == "nccl" else torch.device("cpu")
        )
        sizes = torch.tensor(
            [int(s.max()) + 1 if s.numel() else 0, int(r.max()) + 1 if r.numel() else 0],
            device=comm,
        )
        if distributed:
            dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
        n_s, n_r = int(sizes[0]), int(sizes[1])
        per = torch.cat([_segment_sum(w, s, n_s), _segment_sum(w, r, n_r)]).to(comm)
        if distributed:
            dist.all_reduce(per, group=group)
        per = per.cpu()
        sample_weight, rollout_weight = per[:n_s], per[n_s:]
        return cls(
            mode=mode,
            sample_weight=sample_weight,
            rollout_weight=rollout_weight,
            total_weight=float(sample_weight.sum()),
            n_samples=int((sample_weight > 0).sum()),
            n_rollouts=int((rollout_weight > 0).sum()),
            max_len=max_len,
        )

    def coefficients(
        self, weights: torch.Tensor, sample_index: torch.Tensor, rollout_index: torch.Tensor
    ) -> torch.Tensor:
        """Per-token ``c_t`` (float64 ``[T]``, on ``weights``' device) with
        step loss ``= Σ_t c_t ℓ_t``; 0 when the step has no weight at all."""
        w = weights.detach().to(torch.float64).reshape(-1)  # [T]
        s = sample_index.reshape(-1).long().cpu()
        r = rollout_index.reshape(-1).long().cpu()
        if self.total_weight <= 0:
            return torch.zeros_like(w)
        if self.mode == "token-mean":
            denom = torch.full_like(w, self.total_weight)
        elif self.mode == "seq-mean-token-mean":
            denom = self.sample_weight[s].to(w.device) * self.n_samples
        elif self.mode == "seq-mean-token-sum":
            denom = torch.full_like(w, float(self.n_samples))
        elif self.mode == "seq-mean-token-sum-norm":
            assert self.max_len is not None
            denom = torch.full_like(w, self.n_samples * float(self.max_len))
        else:  # rollout-mean
            denom = self.rollout_weight[r].to(w.device) * self.n_rollouts
        # Tokens of zero weight may sit in zero-weight samples (denominator 0).
        coef = torch.where(w > 0, w / denom.clamp(min=1e-300), torch.zeros_like(w))
        return coef


def aggregate(
    token_losses: torch.Tensor,
    weights: torch.Tensor,
    sample_index: torch.Tensor,
    rollout_index: torch.Tensor,
    *,
    mode: AggregationMode,
    max_len: float | None = None,
) -> torch.Tensor:
    """The step's scalar loss for ``mode`` (DESIGN.md §6), differentiable in ``token_losses``.

    All arguments are 1-D per-token tensors over the generated tokens of one
    optimizer step: ``weights`` from the merge, integer ``sample_index`` /
    ``rollout_index`` naming each token's sample and rollout.

    - ``token-mean``: Σ w ℓ / Σ w
    - ``seq-mean-token-mean``: mean over samples of Σ_s w ℓ / Σ_s w
    - ``seq-mean-token-sum``: mean over samples of Σ_s w ℓ
    - ``seq-mean-token-sum-norm``: Σ w ℓ / (n_samples · max_len)
    - ``rollout-mean``: mean over rollouts of Σ_r w ℓ / Σ_r w
    """
    check_mode(mode, max_len)
    norm = Normalizer.build(weights, sample_index, rollout_index, mode=mode, max_len=max_len)
    coef = norm.coefficients(weights, sample_index, rollout_index)  # [T]
    return (coef.to(token_losses.dtype) * token_losses.reshape(-1)).sum()


def sequence_log_ratio(
    logp: torch.Tensor, old_logp: torch.Tensor, sample_index: torch.Tensor
) -> torch.Tensor:
    """GSPO's per-token log ratio ``mean_{t∈s} (logπ − logπ_old)`` with the
    gradient of each token's own ``logπ`` (GSPO-token): ``[T]`` like ``logp``."""
    s = sample_index.reshape(-1).long()
    n = int(s.max()) + 1 if s.numel() else 0
    diff = (logp - old_logp).reshape(-1)  # [T]
    count = _segment_sum(torch.ones_like(diff.detach()), s, n)
    mean = _segment_sum(diff.detach(), s, n) / count.clamp(min=1)  # [n]
    return mean[s] + logp.reshape(-1) - logp.reshape(-1).detach()


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    rollout_logp: torch.Tensor | None = None,
    tis_cap: float | None = None,
    ratio_level: RatioLevel = "token",
    tis_level: RatioLevel = "token",
    sample_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO-clip losses ``[T]`` ready for :func:`aggregate`.

    ``logp`` (with grad), ``old_logp``, ``advantages`` are ``[T]``. With
    ``dual_clip=c`` (> 1) a negative-advantage token's loss is at most ``-c·A``.
    With ``rollout_logp`` and ``tis_cap`` the loss is multiplied by the detached
    truncated importance weight ``min(exp(old − rollout), tis_cap)`` (per token,
    or per sequence with ``tis_level="sequence"``). ``ratio_level="sequence"``
    uses GSPO's sequence ratio. Both sequence levels need ``sample_index``.

    Metrics are detached per-token tensors (weight them like the loss):
    ``ratio``, ``clipped`` (1.0 where the clipped branch was taken),
    ``approx_kl`` (k3 estimate of KL(old‖new)) and ``is_weight``.
    """
    if ratio_level not in get_args(RatioLevel) or tis_level not in get_args(RatioLevel):
        raise ValueError(
            f"ratio_level / tis_level must be 'token' or 'sequence', got {ratio_level!r} / {tis_level!r}"
        )
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    needs_index = ratio_level == "sequence" or (tis_cap is not None and tis_level == "sequence")
    if needs_index and sample_index is None:
        raise ValueError("sequence-level ratios need sample_index")
    logp = logp.reshape(-1)  # [T]
    old_logp = old_logp.reshape(-1).detach().to(logp.dtype)  # [T]
    adv = advantages.reshape(-1).to(logp.dtype)  # [T]
    if ratio_level == "sequence":
        assert sample_index is not None
        log_ratio = sequence_log_ratio(logp, old_logp, sample_index)
    else:
        log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)  # [T]
    surr = ratio * adv
    surr_clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    loss = -torch.minimum(surr, surr_clipped)  # [T]
    clipped = (surr_clipped < surr).to(logp.dtype)
    if dual_clip is not None:
        bound = -dual_clip * adv
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        clipped = torch.where(dual, torch.ones_like(clipped), clipped)
    is_weight = torch.ones_like(loss.detach())
    if tis_cap is not None and rollout_logp is not None:
        rl = rollout_logp.reshape(-1).to(logp.dtype)
        gap = torch.where(torch.isnan(rl), torch.zeros_like(rl), old_logp - rl)  # [T]
        if tis_level == "sequence":
            assert sample_index is not None
            s = sample_index.reshape(-1).long()
            n = int(s.max()) + 1 if s.numel() else 0
            gap = _segment_sum(gap, s, n)[s]
        is_weight = torch.exp(gap).clamp(max=tis_cap).detach()
        loss = loss * is_weight
    lr = log_ratio.detach()
    metrics = {
        "ratio": ratio.detach(),
        "clipped": clipped.detach(),
        "approx_kl": torch.expm1(lr) - lr,
        "is_weight": is_weight,
    }
    return loss, metrics


def kl_penalty(
    logp: torch.Tensor, ref_logp: torch.Tensor, *, estimator: KLEstimator = "k3"
) -> torch.Tensor:
    """Per-token KL(π‖π_ref) estimate on tokens sampled from π: k1 = logπ − logπ_ref,
    k3 = exp(logπ_ref − logπ) − (logπ_ref − logπ) − 1 (unbiased, non-negative)."""
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k3":
        d = ref_logp - logp
        return torch.expm1(d) - d
    raise ValueError(f"unknown KL estimator {estimator!r}; use 'k1' or 'k3'")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution in each row: ``[..., V] -> [...]``."""
    logits = logits.float()
    logz = torch.logsumexp(logits, dim=-1, keepdim=True)
    p = torch.exp(logits - logz)
    return logz.squeeze(-1) - (p * logits).sum(-1)
