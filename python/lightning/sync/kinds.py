"""The weight-sync kinds and their error, defined once and torch-free.

``lightning.config`` validates ``[engine] weight_sync`` and ``lightning.online``
validates ``[weight_sync] policy`` against these names without loading torch;
:func:`lightning.sync.make_weight_sync` builds each one. ``"sglang"`` is the older
name of ``"sglang-disk"``: :func:`canonical` is the one place it is mapped.
"""

from __future__ import annotations

from typing import Literal, cast, get_args

from lightning._core import LightningError


class WeightSyncError(LightningError, RuntimeError):
    """A weight update failed (an engine refused it, or the weights did not match
    what was announced); the message names the engine and the step."""


# Every sync make_weight_sync builds.
SyncKind = Literal[
    "embedded",
    "sglang-disk",
    "sglang-distributed",
    "sglang-tensor",
    "vllm-nccl",
    "vllm-ipc",
    "none",
]
# Older names a config may still use, and the kind each means.
ALIASES: dict[str, SyncKind] = {"sglang": "sglang-disk"}
# What `[engine] weight_sync` accepts: every kind and its aliases.
ConfigSyncKind = Literal[SyncKind, "sglang"]
# The syncs that load an exported directory (what an online pass pushes).
DiskSyncKind = Literal["none", "embedded", "sglang-disk", "sglang"]
# SGLang's optional pause around an update ("none": in-flight requests finish first).
PauseMode = Literal["none", "abort", "retract"]

SYNC_KINDS: tuple[SyncKind, ...] = get_args(SyncKind)
assert set(ALIASES) == set(get_args(ConfigSyncKind)) - set(SYNC_KINDS)


def canonical(kind: str) -> SyncKind:
    """``kind`` under its current name (aliases mapped); ``ValueError`` naming the
    kinds for anything else."""
    if kind == "vllm-disk":
        raise ValueError(VLLM_DISK_GONE)
    kind = ALIASES.get(kind, kind)
    if kind not in SYNC_KINDS:
        raise ValueError(f"unknown weight_sync {kind!r}: one of {', '.join(SYNC_KINDS)}")
    return cast(SyncKind, kind)


VLLM_DISK_GONE = (
    "weight_sync = 'vllm-disk' was removed: no vLLM release has a disk weight-transfer "
    "backend (vLLM 0.34.0 has nccl, ipc, sparse_nccl, sharded_rdt, nccl_m2n); use "
    "'vllm-nccl', or 'sglang-disk' with SGLang"
)

# The syncs that send CUDA IPC handles and can hand the engine's memory to the trainer.
COLOCATE_SYNCS: tuple[SyncKind, ...] = ("sglang-tensor", "vllm-ipc")
COLOCATE_NEEDS_IPC = (
    "[engine] colocate = true hands the engine's GPU memory to the trainer around each "
    "step (SGLang's /release_memory_occupation and /resume_memory_occupation, vLLM's "
    "/sleep and /wake_up) and needs weights sent as CUDA IPC handles: set weight_sync = "
    "'sglang-tensor' (SGLang) or 'vllm-ipc' (vLLM) (it is {kind!r})"
)
