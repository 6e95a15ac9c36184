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
3. Mixed precision: the sharded parameters (the optimizer's master weights)
   and its state stay float32; ``MixedPrecisionPolicy(param_dtype=compute,
   reduce_dtype=float32)`` casts each unit's all-gathered parameters to the
   compute dtype for its forward and backward, and reduce-scatters gradients in
   float32 into float32 shards. No autocast on top: the policy already sets the
   dtype of every matmul, and one mechanism is easier to reason about.
4. Memory: :func:`build_sharded` builds the model with its parameters on the meta
   device (no storage), shards it, allocates only this rank's shards, then fills
   them tensor by tensor: rank 0 reads one tensor from the safetensors files and
   ``distribute_tensor`` scatters each rank its shard. No rank ever holds the
   whole model, rank 0 included. The KL reference model is built
   the same way, stored in the compute dtype (exactly what the policy's policy
   casts to, so the two agree before the first update) and frozen.
5. Checkpoints: :func:`save_sharded` / :func:`load_sharded` write and read model
   and optimizer shards with ``torch.distributed.checkpoint`` (each rank its own
   files, resharding on load to any world size); :func:`full_state_dict` gathers
   the whole model on rank 0 (CPU) for ``export_weights`` — a plain safetensors
   directory that engines load.
6. CPU offload (``[trainer] cpu_offload``): ``CPUOffloadPolicy`` keeps the float32
   shards, their gradients and the optimizer state in host memory, so the
   optimizer step and gradient clipping run on the CPU; FSDP2 copies each unit's
   shards to the GPU for its all-gather. The shards are therefore allocated on
   the CPU (:func:`build_sharded`) while buffers go to the GPU, and collectives on
   CPU tensors (the gradient norm, ``full_tensor()`` for the weight push and
   export) need a gloo backend beside NCCL: the process group is
   ``cpu:gloo,cuda:nccl`` (``lightning.run.distributed.init_from_env``). On this
   project's CPU machines offload changes no placement (tests check the step equals
   the plain FSDP2 one); it has not run on a GPU, and says so at start.

Not supported yet: LoRA with FSDP2 (a config error), HSDP.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def shard(
    model: torch.nn.Module, compute_dtype: torch.dtype = torch.float32, *, offload: bool = False
) -> torch.nn.Module:
    """Apply ``fully_shard`` to every decoder layer, then to the root (in place).
    Parameters are all-gathered in ``compute_dtype``; gradients reduced in float32.
    ``offload``: the shards live in host memory (point 6 of the module docstring)."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    # Pinned host memory makes the per-unit copies to the GPU asynchronous.
    where = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    layers = _decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mp_policy=policy, offload_policy=where)
    fully_shard(model, mp_policy=policy, offload_policy=where)
    return model


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no storage,
    initialisers are no-ops) while buffers stay real. Why not ``torch.device("meta")``:
    non-persistent buffers (rotary ``inv_freq``) are computed in ``__init__``, are
    not in any checkpoint, and would be lost."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: Any) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def _checkpoint_index(path: Path) -> dict[str, Path]:
    """Which safetensors file holds each tensor (names only, no data read)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"fsdp2 loads safetensors; {path} has none (re-save the model with "
            "save_pretrained(safe_serialization=True))"
        )
    index: dict[str, Path] = {}
    for f in files:
        with safe_open(f, framework="pt") as handle:
            index.update(dict.fromkeys(handle.keys(), f))
    return index


def build_sharded(
    path: str | Path,
    device: torch.device,
    *,
    compute_dtype: torch.dtype,
    storage_dtype: torch.dtype = torch.float32,
    prepare: Any = None,
    offload: bool = False,
) -> torch.nn.Module:
    """The Hugging Face causal LM at ``path``, sharded, each rank materialising only
    its shards (point 4 of the module docstring), in host memory with ``offload``
    (point 6). ``prepare(model)`` runs on the unsharded meta model (activation
    checkpointing must wrap layers before ``fully_shard``). Collective: every rank
    calls it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(
            config, dtype=storage_dtype, attn_implementation="sdpa"
        )
    model.config.use_cache = False
    if prepare is not None:
        prepare(model)
    shard(model, compute_dtype, offload=offload)
    buffers = dict(model.named_buffers())
    # This rank's shards: allocated, not yet filled (FSDP2 refuses offloaded shards
    # anywhere but on the CPU).
    model.to_empty(device="cpu" if offload else device)
    for name, value in buffers.items():  # to_empty left the buffers uninitialised
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = value.to(device)
    # Tied weights are one parameter (named once by named_parameters); the
    # checkpoint may or may not carry the tied copy.
    targets = dict(model.named_parameters()) | {
        n: b for n, b in model.named_buffers() if n in model.state_dict()
    }
    index: dict[str, Path] = {}
    problem: list[str | None] = [None]
    if dist.get_rank() == 0:
        try:
            index = _checkpoint_index(Path(path))
        except OSError as e:
            problem[0] = str(e)
        tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
        missing, unexpected = set(targets) - set(index), set(index) - set(targets) - tied
        if problem[0] is None and (missing or unexpected):
            problem[0] = (
                f"fsdp2: the checkpoint at {path} does not name the model's parameters "
                f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}); "
                "use parallel = 'ddp' for this model"
            )
    # Every rank learns of rank 0's failure (else they would wait in a collective).
    dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise ValueError(problem[0])
    _load_streamed(targets, index, device)
    return model


def _load_streamed(
    targets: dict[str, torch.Tensor], index: dict[str, Path], device: torch.device
) -> None:
    """Fill each sharded parameter (and persistent buffer) from the checkpoint, one
    tensor at a time: rank 0 reads it, ``distribute_tensor`` scatters each rank its
    shard. At most one whole tensor is in flight, on any rank, so no rank ever
    holds the whole model. (``set_model_state_dict(broadcast_from_rank0=True)``
    wants the whole state dict on rank 0 at once; with it, rank 0's build peak on
    SmolLM2-135M was above what loading the whole model on every rank had cost:
    ``benches/fsdp_memory.py``.)"""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, distribute_tensor

    rank0 = dist.get_rank() == 0
    for name, target in targets.items():
        if rank0:
            # Opened per tensor: a handle maps its whole file, and the pages read
            # stay resident (and count) until it closes.
            with safe_open(index[name], framework="pt") as handle:
                whole = handle.get_tensor(name).to(device, target.dtype)
        else:  # received into
            whole = torch.empty(target.shape, dtype=target.dtype, device=device)
        with torch.no_grad():
            if isinstance(target, DTensor):
                mine = distribute_tensor(
                    whole, target.device_mesh, target.placements, src_data_rank=0
                )
                target.to_local().copy_(mine.to_local())
            else:
                dist.broadcast(whole, src=0)
                target.copy_(whole)
        del whole


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
