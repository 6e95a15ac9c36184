"""Run by ``torchrun --nproc-per-node 2`` from test_fsdp.py (gloo, CPU).

``grads OUT LAYOUT``: one FSDP2 step per aggregation mode; rank 0 saves the whole
gradients. ``ckpt OUT DIR``: a real step, a sharded checkpoint, a fresh trainer
that loads it; both take the same next step; rank 0 saves the parameters of both
and the exported safetensors directory is left in DIR/export. ``mp OUT``: one
lr 1e-6 step with float32 and with bf16 compute (precision_case), the weights
right after loading, and the KL reference model's log-probs against the policy's."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from lightning.rl import fsdp
from split_case import batch, grads_per_mode, trainer


def full_params(tr: object) -> dict[str, torch.Tensor]:
    return {n: fsdp.full_tensor(p.detach()).clone() for n, p in tr.model.named_parameters()}  # type: ignore[attr-defined]


def mixed_precision() -> dict[str, object]:
    from lightning.rl.batching import micro_batches, seq_items
    from precision_case import full_params as flat
    from precision_case import one_step_delta

    kw = {"parallel": "fsdp2", "lr": 1e-6, "micro_batch_tokens": 40}
    fp32 = trainer(compute_dtype="float32", **kw)
    loaded = flat(fp32)
    assert fp32.ref_model is None  # KL off: no reference model at all
    delta32 = one_step_delta(fp32)
    bf16 = trainer(compute_dtype="bfloat16", kl_coef=0.1, **kw)
    assert bf16._amp_dtype is None  # the FSDP2 policy casts, not autocast
    seen: list[torch.dtype] = []
    layer = bf16.model.model.layers[0].self_attn.q_proj  # type: ignore[union-attr]
    hook = layer.register_forward_pre_hook(lambda m, _: seen.append(m.weight.dtype))
    # The reference model: sharded like the policy, stored in the compute dtype,
    # and before any update its log-probs are the policy's, bit for bit.
    ref = bf16.ref_model
    assert ref is not None
    assert all(hasattr(p, "full_tensor") and p.dtype == torch.bfloat16 for p in ref.parameters())
    samples, _, _ = batch()
    items = seq_items(samples)
    mbs = micro_batches(items, 10**6, mode="packed")
    n = sum(len(i.positions) for i in items)
    ref_lp = bf16._ref_logprobs(mbs, n)
    pol_lp = bf16._logprobs(bf16.model, mbs, n)
    delta16 = one_step_delta(bf16)
    hook.remove()
    # A short bf16 run learns: the objective the policy gradient ascends rises.
    learner = trainer(compute_dtype="bfloat16", **{**kw, "lr": 1e-3})
    samples, rewards, groups = batch()
    for _ in range(3):
        learner.step(samples, rewards, groups)
    learned = fsdp.full_state_dict(learner.model)  # collective; rank 0 gets it
    return {
        "loaded": loaded,
        "delta32": delta32,
        "delta16": delta16,
        "compute_dtypes": sorted({str(d) for d in seen}),
        "ref_lp": ref_lp,
        "pol_lp": pol_lp,
        "local_numel": sum(p.to_local().numel() for p in fp32.params),  # type: ignore[attr-defined]
        "learned": learned,
    }


def main() -> None:
    dist.init_process_group("gloo")
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "grads":
        offload = sys.argv[4:] == ["offload"]
        tr = trainer(
            batching=sys.argv[3], micro_batch_tokens=40, parallel="fsdp2", cpu_offload=offload
        )
        # Really sharded: parameters are DTensor shards, no DDP wrapper.
        assert tr.fsdp and tr.ddp is None
        assert all(hasattr(p, "full_tensor") for p in tr.params)
        # The fused head (no [tokens, vocabulary] logits) runs under FSDP2 too: the
        # head module's own forward, the unfused path, is never called.
        head_calls: list[int] = []
        tr.model.get_output_embeddings().register_forward_hook(lambda *_: head_calls.append(1))  # type: ignore[operator]
        result: dict[str, object] = grads_per_mode(tr)
        result["head_forwards"] = len(head_calls)
        # Which placement FSDP2 was given, for every unit of the policy.
        units = [m for m in tr.model.modules() if isinstance(m, FSDPModule)]
        result["offloaded"] = sorted(
            {type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__ for m in units}  # type: ignore[union-attr]
        )
    elif mode == "mp":
        result = mixed_precision()
    else:
        root = Path(sys.argv[3])
        samples, rewards, groups = batch()
        kw = {"parallel": "fsdp2", "lr": 1e-3, "batching": "packed", "micro_batch_tokens": 40}
        a = trainer(**kw)
        a.step(samples, rewards, groups)
        a.save_checkpoint(root / "ckpt")
        a.export_weights(root / "export")
        saved = full_params(a)
        b = trainer(**kw)
        b.load_checkpoint(root / "ckpt")
        loaded = full_params(b)
        a.step(samples, rewards, groups)
        b.step(samples, rewards, groups)
        result = {
            "saved": saved,
            "loaded": loaded,
            "next_a": full_params(a),
            "next_b": full_params(b),
        }
    if dist.get_rank() == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
