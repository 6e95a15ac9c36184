"""FSDP2 for the trainer: ``trainer.parallel = "fsdp2"`` under ``torchrun``.

Beside DDP (the default), the model is sharded with ``torch.distributed.fsdp.
fully_shard``: each decoder layer is its own unit (its parameters all-gathered
just for its forward and backward), the root holds the rest (embeddings, final
norm, the LM head, tied or not). Parameters, gradients and optimizer state live
as ``DTensor`` shards, so each rank holds 1/world of them.

What stays the same as DDP, and why it needs care here:

1. The loss normalisers are global (all-reduced before any backward, see
   ``lightning.rl.losses.Normalizer``), and FSDP2's reduce-scatter averages gradients
   over ranks like DDP does, so the trainer's ``loss * world`` gives the same sum.
2. Every forward and backward is a collective (all-gather, reduce-scatter), so
   every rank must run the same number of micro-batches, while the token-balanced
   split can give ranks different counts. :func:`balance` pads the shorter lists
   with a one-token micro-batch that has no targets: its loss is an empty sum,
   zero, whose backward still walks every layer and joins every reduce-scatter.
3. Checkpoints: :func:`save_sharded` / :func:`load_sharded` write and read model
   and optimizer shards with ``torch.distributed.checkpoint`` (each rank its own
   files, resharding on load to any world size); :func:`full_state_dict` gathers
   the whole model on rank 0 (CPU) for ``export_weights`` — a plain safetensors
   directory that engines load.

Not supported yet: LoRA with FSDP2 (a config error), CPU offload, HSDP.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """Apply ``fully_shard`` to every decoder layer, then to the root (in place)."""
    from torch.distributed.fsdp import fully_shard

    layers = _decoder_layers(model)
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _decoder_layers(model: torch.nn.Module) -> Sequence[torch.nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(
            f"fsdp2: {type(model).__name__} has no .model.layers (decoder layers) to shard; "
            "use parallel = 'ddp' for this architecture"
        )
    return list(layers)


def _empty_micro_batch(like: Any) -> Any:
    from lightning.rl.batching import MicroBatch

    zero = torch.zeros(1, 1, dtype=torch.long)
    none = torch.zeros(0, dtype=torch.long)
    return MicroBatch(
        input_ids=zero,
        position_ids=zero.clone(),
        attention_mask=None,
        keep=torch.zeros(1, dtype=torch.long),
        gather=none,
        target_tokens=none.clone(),
        target_ids=none.clone(),
        forward_tokens=0,
    )


def balance(mini_mbs: list[list[Any]], device: torch.device) -> list[list[Any]]:
    """Pad each mini-batch's micro-batch list to the longest across ranks."""
    counts = torch.tensor([len(m) for m in mini_mbs], dtype=torch.long, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    return [
        m + [_empty_micro_batch(m) for _ in range(int(c) - len(m))]
        for m, c in zip(mini_mbs, counts.tolist(), strict=True)
    ]


def full_tensor(t: Any) -> torch.Tensor:
    """A DTensor's whole value (a collective), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model on CPU, on rank 0 (other ranks get ``{}``); all ranks call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def save_sharded(directory: Path, model: torch.nn.Module, optimizer: Any) -> None:
    """Model and optimizer shards, one file per rank (``torch.distributed.checkpoint``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(directory))


def load_sharded(directory: Path, model: torch.nn.Module, optimizer: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
