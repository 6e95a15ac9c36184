"""Run by ``torchrun --nproc-per-node 2`` from test_split_invariance.py: each
rank trains its shard with DDP over gloo; rank 0 saves the gradients."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from split_case import grads_per_mode, trainer


def main() -> None:
    dist.init_process_group("gloo")
    grads = grads_per_mode(trainer(batching=sys.argv[2], micro_batch_tokens=40))
    if dist.get_rank() == 0:
        torch.save(grads, sys.argv[1])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
