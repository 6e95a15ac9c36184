"""Which ranks an engine's workers take in the trainer's weight-update group.

The trainer is rank 0 of one group; every engine is told its first rank
(``rank_offset``) and the group's size, and each of its workers then joins under
a rank the *engine* computes. The two engines compute it differently, so the
group's size and each engine's offset follow the engine's own arithmetic, written
out here (torch-free: ``lightning.config`` refuses a layout an engine cannot
serve when the file is loaded), and tests/sync/test_sync_engine_rules.py holds each
function to the engine's released code.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLayout:
    """How an engine spreads one model over its GPUs: tensor, pipeline and data
    parallel sizes (SGLang ``--tp``/``--pp``/``--dp``, vLLM
    ``--tensor-parallel-size``/``--pipeline-parallel-size``/``--data-parallel-size``)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        if min(self.tp, self.pp, self.dp) < 1:
            raise ValueError(f"{self}: every parallel size is at least 1")


def sglang_worker_ranks(layout: EngineLayout, rank_offset: int) -> list[int]:
    """The rank each SGLang worker joins with, one entry per worker.

    sglang 0.5.23: ``WeightUpdater.init_weights_update_group``
    (``srt/model_executor/model_runner_components/weight_updater.py``) joins as
    ``rank_offset + self.tp_rank``, where ``tp_rank`` counts within one TP group
    (0 … tp-1); ``DataParallelController.send_control_message``
    (``srt/managers/data_parallel_controller.py``) hands the init request to every
    DP worker, and every pipeline stage runs its own TP group of workers. So each
    DP replica and each PP stage repeats the same ranks."""
    return [
        rank_offset + tp_rank
        for _replica in range(layout.dp)
        for _stage in range(layout.pp)
        for tp_rank in range(layout.tp)
    ]


def vllm_worker_ranks(layout: EngineLayout, rank_offset: int) -> list[int]:
    """The rank each vLLM worker joins with: vllm 0.34.0
    ``distributed/weight_transfer/nccl_common.py`` ``_worker_group_rank``:
    ``rank_offset + data_parallel_index * world_size + rank``, with ``world_size``
    = TP × PP and ``rank`` the worker's rank within its DP replica. Every worker
    gets a rank of its own."""
    per_replica = layout.tp * layout.pp
    return [
        rank_offset + dp_index * per_replica + rank
        for dp_index in range(layout.dp)
        for rank in range(per_replica)
    ]


def sglang_distributed_size(layout: EngineLayout) -> int:
    """The ranks an SGLang engine adds to an ``update_weights_from_distributed``
    group; ``ValueError`` with the reason for a layout whose workers would collide
    (two workers under one rank, while the ranks up to TP × PP × DP never come)."""
    ranks = Counter(sglang_worker_ranks(layout, 0))
    if max(ranks.values()) > 1:
        parts = []
        if layout.dp > 1:
            parts.append(
                f"--dp {layout.dp}: DataParallelController sends the group init to every DP worker"
            )
        if layout.pp > 1:
            parts.append(f"--pp {layout.pp}: every pipeline stage has TP ranks 0..{layout.tp - 1}")
        raise ValueError(
            f"weight_sync = 'sglang-distributed' cannot serve an SGLang engine with "
            f"tp={layout.tp}, pp={layout.pp}, dp={layout.dp}: sglang 0.5.23 joins the "
            f"weight-update group as rank_offset + tp_rank, and {'; '.join(parts)}, so "
            f"{max(ranks.values())} workers would join under each rank. Run one engine "
            "per DP replica without pipeline parallelism (list each in [engine] urls), "
            "or use 'sglang-disk'"
        )
    return len(ranks)


def vllm_size(layout: EngineLayout) -> int:
    """The ranks a vLLM engine adds to its NCCL weight-transfer group."""
    return len(set(vllm_worker_ranks(layout, 0)))
