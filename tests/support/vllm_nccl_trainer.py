"""The trainer side of tests/sync/test_weight_sync.py's vllm-nccl test, run in the pinned
vLLM's environment (tests/support/engine_envs.py): ``VllmNcclSync`` drives vLLM's own
``NCCLTrainerWeightTransferEngine`` (vllm 0.34.0 ``weight_transfer/nccl_engine.py``,
its packed producer ``packed_nccl_broadcast_producer`` in ``packed_tensor.py``)
against two fake vLLM servers.

What is stood in, and only that: the data plane. vLLM's trainer engine opens its
endpoint in ``_open_trainer_endpoint`` by calling ``nccl_common.trainer_init``
(imported into ``nccl_engine`` as ``open_trainer_endpoint``), which joins a
``StatelessProcessGroup`` and builds a ``PyNcclCommunicator`` on the current CUDA
device; that one name is replaced by :class:`RecordingGroup`, which keeps a clone of
every tensor vLLM's code hands its ``broadcast``, in order. vLLM's device calls
(the current device index, its packer's side streams and the current stream's
synchronize) are answered on the CPU by :func:`cpu_streams`. Everything else is
vLLM's code as released: ``trainer_init``'s checks, ``_build_worker_init_payload``
and the rendezvous thread, ``send_weights`` with the update infos it builds (and
reuses: an unchanged round sends empty lists), ``_checked_iter`` and the packer.
Nothing may be written to disk.

Writes ``--out`` (``torch.save``): the recorded broadcasts ``[(src, tensor)]``, the
arguments vLLM's engine opened its endpoint with, what ``GatherStats`` counted, the
working directory's listing and any ``WeightSyncError``.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any

import torch

from vllm_ipc_trainer import _no_disk, weights


class _Stream:
    """A CUDA stream with nothing to wait for: CPU copies are done when they return."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass


class _Event:
    def __init__(self, *args: Any, **kw: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


def cpu_streams() -> None:
    """Answer the device calls of vllm 0.34.0's NCCL engines and packed producer /
    consumer (``packed_tensor.py`` ``_get_streams``, ``torch.cuda.stream``,
    ``torch.Event``, ``record_stream``; ``nccl_engine.py``'s
    ``torch.cuda.current_stream()``) on a CPU, where torch has no CUDA driver."""
    torch.accelerator.current_device_index = lambda: 0  # type: ignore[assignment]
    stream = _Stream()
    torch.accelerator.current_stream = lambda *a, **k: stream  # type: ignore[assignment]
    torch.cuda.current_stream = lambda *a, **k: stream  # type: ignore[assignment]
    torch.cuda.Stream = _Stream  # type: ignore[assignment,misc]  # a class: vLLM annotates with it
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    torch.Event = _Event  # type: ignore[assignment,misc]
    torch.Tensor.record_stream = lambda self, stream: None  # type: ignore[method-assign]


class RecordingGroup:
    """Stands in for the trainer's ``PyNcclCommunicator`` (rank 0 of the group)."""

    rank = 0
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.sent: list[tuple[int, torch.Tensor]] = []
        self.destroyed = False

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        # A clone: the producer reuses its buffers' memory once the slot frees.
        self.sent.append((src, tensor.detach().clone()))

    def destroy(self) -> None:
        self.destroyed = True


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--roots", required=True, nargs="+")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--bucket", type=int, default=300)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--unpacked", action="store_true")
    args = p.parse_args()
    cpu_streams()
    _no_disk()
    from vllm.distributed.weight_transfer import nccl_engine

    from lightning.sync import LiveWeights, VllmNcclSync, WeightSyncError, WeightUpdate

    group = RecordingGroup()
    endpoint: dict[str, Any] = {}

    def open_endpoint(init_info: Any, rank: int = 0) -> RecordingGroup:
        endpoint.update(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            world_size=init_info.world_size,
            rank=rank,
        )
        return group

    nccl_engine.open_trainer_endpoint = open_endpoint

    sync = VllmNcclSync(
        [root + "/v1" for root in args.roots],
        "127.0.0.1",
        args.port,
        world_sizes=[1] * len(args.roots),
        packed=not args.unpacked,
        bucket_bytes=args.bucket,
        device="cpu",
    )
    sent: list[int] = []
    error = None
    try:
        sync.setup()
        for step in range(1, args.steps + 1):
            source = LiveWeights(weights(step).items())
            sync.push(WeightUpdate(version=step, source=source))
            sent.append(source.stats.sent_bytes)
    except WeightSyncError as e:
        error = str(e)
    finally:
        sync.close()
    result = {
        "broadcasts": group.sent,
        "endpoint": endpoint,
        "destroyed": group.destroyed,
        "sent": sent,
        "cwd": [p.name for p in Path.cwd().iterdir()],
        "error": error,
    }
    torch.save(result, args.out)


if __name__ == "__main__":
    main()
