"""`lightning train` under torchrun: one run, a trainer on every rank.

    torchrun --nproc-per-node 8 -m lightning.cli train run.toml

Rank 0 is the run (engines, gateway, harness runner, store, metrics: everything
`lightning train` does on one process); every rank holds a shard of the trainer
(DDP, or FSDP2 with ``[trainer] parallel = "fsdp2"``). Rank 0's trainer is a
:class:`LeaderTrainer`: each call the run makes (``step``, ``export_weights``,
``live_weights``, ``save_checkpoint``, ``load_checkpoint``, ``close``) is first
broadcast to the other ranks, which run :func:`follow` and make the same call on
their trainer, so the collectives inside line up (``live_weights``: rank 0 sends
what it gathers to the engines, the others drain theirs). Samples cross as plain numpy records.

The process group is ``nccl`` when CUDA is available (each rank on the GPU
``LOCAL_RANK``), else ``gloo``; the mirrored calls travel on a gloo group of
their own (followers wait on the CPU while rank 0 generates rollouts).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


@dataclass
class PlainSample:
    """A ``lightning.Sample``'s training fields, picklable."""

    rollout_id: str
    group: str | None
    tokens: np.ndarray
    weights: np.ndarray
    logprobs: np.ndarray
    call_index: np.ndarray


def plain(sample: Any) -> PlainSample:
    return PlainSample(
        sample.rollout_id,
        sample.group,
        np.asarray(sample.tokens),
        np.asarray(sample.weights),
        np.asarray(sample.logprobs),
        np.asarray(sample.call_index),
    )


def init_from_env() -> tuple[int, int]:
    """Join torchrun's process group when started by it; ``(rank, world)``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or dist.is_initialized():
        return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # CPU tensors get gloo (offloaded FSDP2 shards: their gradient norm and
        # full_tensor() gathers), CUDA tensors NCCL; torch's own default pairing.
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


# Followers wait here while rank 0 generates rollouts, which can take far longer
# than a collective's default timeout: control messages use a gloo group of their
# own (a CPU wait, no GPU kernel spinning, no NCCL watchdog) with a long timeout.
CONTROL_TIMEOUT = timedelta(days=1)
_control: list[Any] = []


def _broadcast(message: Any) -> Any:
    if not _control:  # every rank reaches its first broadcast, so this lines up
        _control.append(dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT))
    box = [message]
    dist.broadcast_object_list(box, src=0, group=_control[0])
    return box[0]


class LeaderTrainer:
    """Rank 0's trainer: mirrors every call to the follower ranks first."""

    MIRRORED = ("step", "export_weights", "live_weights", "save_checkpoint", "load_checkpoint")

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if name not in self.MIRRORED:
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            if name == "step":
                # A MergeResult lives in Rust and cannot be pickled to the other
                # ranks: every rank (this one too, so all take the same layout
                # path) trains on its samples as plain records.
                batch = args[0]
                samples = batch.samples if hasattr(batch, "samples") else batch
                args = ([plain(s) for s in samples], *args[1:])
            _broadcast((name, args, kwargs))
            return value(*args, **kwargs)

        return call

    def close(self) -> None:
        _broadcast(("close", (), {}))
        if hasattr(self.inner, "close"):
            self.inner.close()


def follow(trainer: Any) -> None:
    """Ranks > 0: make the calls rank 0's trainer makes, until it closes."""
    while True:
        name, args, kwargs = _broadcast(None)
        if name == "close":
            if hasattr(trainer, "close"):
                trainer.close()
            return
        result = getattr(trainer, name)(*args, **kwargs)
        if name == "live_weights":
            # Rank 0 streams these weights to the engines; this rank joins each
            # gather (FSDP2 full_tensor) in the same order and keeps nothing.
            result.drain()


def follower_main(config: Any, *, resume: bool) -> None:
    """What a rank > 0 runs for `lightning train`."""
    from lightning.rl.trainer import Trainer

    trainer = Trainer(config.trainer_config(config.model.resolve()))
    follow(trainer)
