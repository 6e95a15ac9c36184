"""The mixed-precision scenario shared by test_trainer.py (one process) and
fsdp_worker.py (FSDP2 over 2 gloo ranks): one AdamW step at lr 1e-6 from the
same weights and batch, and how far it moved every weight.

With float32 master weights a step at lr 1e-6 changes nearly every weight that
has a gradient (Adam's first step moves each by ~lr). Weights stored in bf16
(8 bits of mantissa) round most such updates away: ~2% change. So the fraction
of weights changed and the direction of the update tell the two apart."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lightning.rl import fsdp
from split_case import batch


def full_params(tr: Any) -> torch.Tensor:
    """Every trained parameter, whole (a collective under FSDP2), flattened."""
    return torch.cat(
        [fsdp.full_tensor(p.detach()).reshape(-1).double() for p in tr.params]  # type: ignore[attr-defined]
    )


def one_step_delta(tr: Any) -> torch.Tensor:
    """``[P]`` float64: how one step on the split-invariance batch moved the weights."""
    assert all(p.dtype == torch.float32 for p in tr.params), "master weights must be float32"
    before = full_params(tr)
    samples, rewards, groups = batch()
    tr.step(samples, rewards, groups)
    return full_params(tr) - before


def moved(delta: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """The fraction of weights each delta changed, and the cosine between them."""
    cos = torch.nn.functional.cosine_similarity(delta, ref, dim=0)
    return {
        "changed": float((delta != 0).double().mean()),
        "ref_changed": float((ref != 0).double().mean()),
        "cosine": float(cos),
    }


def bf16_storage_changed(tr: Any, lr: float = 1e-6) -> float:
    """The plain reference of the old ``param_dtype = "bfloat16"``: the same
    model's weights stored in bf16 (no master copy), given the float32 run's
    gradients, one AdamW step; the fraction of weights that changed."""
    params = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in tr.params]
    for p, q in zip(params, tr.params, strict=True):
        p.grad = q.grad.detach().to(torch.bfloat16)
    before = [p.detach().clone() for p in params]
    torch.optim.AdamW(params, lr=lr, weight_decay=0.0).step()
    changed = sum(int((p.detach() != b).sum()) for p, b in zip(params, before, strict=True))
    return changed / sum(p.numel() for p in params)


def objective(model: torch.nn.Module) -> float:
    """Plain reference of what the policy gradient ascends on the batch: each
    rollout's group-centred reward times the summed log-probability of its
    trained tokens (float32, one sequence at a time, the model's own head)."""
    samples, rewards, groups = batch()
    by_group: dict[str, list[float]] = {}
    for rid, g in groups.items():
        by_group.setdefault(g, []).append(rewards[rid])
    total = 0.0
    with torch.no_grad():
        for s in samples:
            ids = torch.from_numpy(s.tokens.astype(np.int64))[None]
            lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            logp = lp[:-1].gather(1, ids[0, 1:, None])[:, 0]  # [T-1]: token t+1 given ≤ t
            trained = torch.from_numpy(s.weights[1:] > 0)
            centred = rewards[s.rollout_id] - float(np.mean(by_group[groups[s.rollout_id]]))
            total += centred * float(logp[trained].sum())
    return total
