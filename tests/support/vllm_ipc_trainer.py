"""The trainer side of tests/sync/test_weight_sync.py's vllm-ipc tests, run in the pinned
vLLM's environment (tests/support/engine_envs.py): ``VllmIpcSync`` drives vLLM's own
``IPCTrainerWeightTransferEngine`` (vllm 0.34.0 ``weight_transfer/ipc_engine.py``,
its packed producer in ``packed_tensor.py``) against a fake vLLM server.

vLLM's trainer engine asks the GPU for its index and UUID, allocates its packed
buffer with ``device="cuda"``, synchronizes the current stream and calls
``torch.cuda.ipc_collect``; on a CPU those few device calls are answered here (the
UUID is the fake's, the buffer lives in host memory, the others do nothing). The
engine's own logic runs unchanged: the buffer filled and flushed chunk by chunk, one
``reduce_tensor`` handle for the buffer (per tensor unpacked), the update infos it
builds with ``IPCWeightTransferUpdateInfo`` and the client calls it makes. Nothing
may be written to disk: safetensors' writers raise, and the working directory must
stay empty.

Writes ``--out`` (``torch.save``): the tensors of the last push, what
``GatherStats`` counted, and whether our JSON encoding of an update info equals
vLLM's own HTTP client's (``clients._json_safe_update_info``).
"""

from __future__ import annotations

import argparse
import types
from pathlib import Path
from typing import Any

import torch

from fake_rl_engines import FAKE_GPU_UUID


def _cpu_device() -> None:
    torch.accelerator.current_device_index = lambda: 0  # type: ignore[assignment]
    props = types.SimpleNamespace(uuid=FAKE_GPU_UUID)
    torch.cuda.get_device_properties = lambda *a, **k: props  # type: ignore[assignment]
    torch.cuda.ipc_collect = lambda: None  # type: ignore[assignment]
    stream = types.SimpleNamespace(synchronize=lambda: None)
    torch.accelerator.current_stream = lambda *a, **k: stream  # type: ignore[assignment]
    empty = torch.empty

    def host_empty(*args: Any, **kw: Any) -> torch.Tensor:
        if kw.get("device") == "cuda":
            kw["device"] = "cpu"
        return empty(*args, **kw)

    torch.empty = host_empty  # type: ignore[assignment]


def _no_disk() -> None:
    import safetensors.torch

    def no_write(*args: Any, **kw: Any) -> None:
        raise AssertionError("a safetensors file was written")

    for name in ("save_file", "save_model", "save"):
        setattr(safetensors.torch, name, no_write)


def weights(step: int, odd: bool = False) -> dict[str, torch.Tensor]:
    """Three dtypes and one tensor larger than the tests' bucket. Without ``odd``,
    every tensor has an even number of elements, so each starts at a multiple of its
    item size when packed end to end (as in a model of one dtype); with it, a
    float32 tensor follows an odd number of bfloat16 / float16 elements."""
    g = torch.Generator().manual_seed(step)
    out: dict[str, torch.Tensor] = {}
    for i in range(10):
        rows = 3 + i % 4 if odd else 4 + 2 * (i % 2)
        t = torch.randn((rows, 5 + 2 * (i % 3)), generator=g)
        out[f"layers.{i}.w"] = t.to([torch.float32, torch.bfloat16, torch.float16][i % 3])
    out["lm_head.weight"] = torch.randn(10, 8, generator=g)  # 320 bytes
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--bucket", type=int, default=300)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--colocate", action="store_true")
    p.add_argument("--unpacked", action="store_true")
    p.add_argument("--odd", action="store_true")
    args = p.parse_args()
    _cpu_device()
    _no_disk()
    from vllm.distributed.weight_transfer.clients import _json_safe_update_info

    from lightning.sync import (
        LiveWeights,
        VllmIpcSync,
        WeightSyncError,
        WeightUpdate,
        vllm_ipc_json_safe,
    )

    sync = VllmIpcSync(
        [args.root + "/v1"],
        packed=not args.unpacked,
        bucket_bytes=args.bucket,
        colocate=args.colocate,
        device="cpu",
    )
    sent: list[int] = []
    error = None
    try:
        sync.setup()
        for step in range(1, args.steps + 1):
            tensors = weights(step, args.odd)
            sync.before_train()
            source = LiveWeights(tensors.items())
            sync.push(WeightUpdate(version=step, source=source))
            sent.append(source.stats.sent_bytes)
    except WeightSyncError as e:
        error = str(e)
    finally:
        sync.close()
    info = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]}
    handles = {"ipc_handles": [{FAKE_GPU_UUID: (1, b"\x00", "x")}]}
    same = all(
        vllm_ipc_json_safe(i) == _json_safe_update_info(i) for i in (info, {**info, **handles})
    )
    here = [p.name for p in Path.cwd().iterdir()]
    result = {"tensors": tensors, "sent": sent, "json_safe": same, "cwd": here, "error": error}
    torch.save(result, args.out)


if __name__ == "__main__":
    main()
