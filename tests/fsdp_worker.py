"""Run by ``torchrun --nproc-per-node 2`` from test_fsdp.py (gloo, CPU).

``grads OUT LAYOUT``: one FSDP2 step per aggregation mode; rank 0 saves the whole
gradients. ``ckpt OUT DIR``: a real step, a sharded checkpoint, a fresh trainer
that loads it; both take the same next step; rank 0 saves the parameters of both
and the exported safetensors directory is left in DIR/export."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lightning.rl import fsdp
from split_case import batch, grads_per_mode, trainer


def full_params(tr: object) -> dict[str, torch.Tensor]:
    return {n: fsdp.full_tensor(p.detach()).clone() for n, p in tr.model.named_parameters()}  # type: ignore[attr-defined]


def main() -> None:
    dist.init_process_group("gloo")
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "grads":
        tr = trainer(batching=sys.argv[3], micro_batch_tokens=40, parallel="fsdp2")
        # Really sharded: parameters are DTensor shards, no DDP wrapper.
        assert tr.fsdp and tr.ddp is None
        assert all(hasattr(p, "full_tensor") for p in tr.params)
        result: dict[str, object] = grads_per_mode(tr)
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
