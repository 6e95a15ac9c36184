"""An engine's data plane in its own process: joins a weight-update group and
receives broadcasts, driven by JSON lines on stdin (one answer line each on stdout).

``--join sglang`` joins with SGLang's own ``init_custom_process_group``, called as
SGLang's ``WeightUpdater.init_weights_update_group`` calls it (run under the cached
engine environment, tests/support/engine_envs.py); ``--join lightning`` uses
``lightning.sync.join_group`` (for fakes of engines whose real data plane
needs a GPU). Receiving is ``torch.distributed.broadcast(buf, src=0, group=...)`` per
name, as SGLang's ``update_weights_from_distributed`` receives.

Commands: ``{"op": "join", "address", "port", "rank", "world", "name"}``;
``{"op": "recv", "names", "dtypes", "shapes", "flat", "out"}`` (the tensors are
written to ``out`` with ``torch.save``, or dropped if it is null; ``flat``: one broadcast of the bucket's bytes,
SGLang's ``load_format = "flattened_bucket"``); ``{"op": "tensor", "payloads", "rank",
"flat", "authkey", "out"}`` (one TP rank's ``update_weights_from_tensor`` payload,
opened with SGLang's own code, written to ``out``); ``{"op": "cuda_ipc", "payloads",
"rank", "gpus"}`` (a CUDA IPC payload's device, as SGLang resolves it); ``{"op": "vllm_ipc", "info",
"packed", "uuid", "out"}`` (one vLLM ``/update_weights`` of the IPC backend, parsed and
unpacked with vLLM's own code, ``--join vllm``); ``{"op": "vllm_nccl_init" |
"vllm_nccl_update", "info"}`` and ``{"op": "vllm_nccl_replay", "broadcasts", "out"}``
(a vLLM worker of the NCCL backend, ``--join vllm``: see ``_VllmNcclWorker``);
``{"op": "quit"}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _join_sglang(cmd: dict[str, Any]) -> Any:
    from sglang.srt.utils import init_custom_process_group
    from sglang.srt.utils.network import NetworkAddress

    return init_custom_process_group(
        backend="gloo",
        init_method=NetworkAddress(cmd["address"], cmd["port"]).to_tcp(),
        world_size=cmd["world"],
        rank=cmd["rank"],
        group_name=cmd["name"],
    )


def _join_lightning(cmd: dict[str, Any]) -> Any:
    from lightning.sync import join_group

    return join_group(
        cmd["address"],
        cmd["port"],
        rank=cmd["rank"],
        world_size=cmd["world"],
        backend="gloo",
        group_name=cmd["name"],
        timeout_s=60.0,
    )


def _unpack_sglang(cmd: dict[str, Any], group: Any) -> Any:
    """SGLang's own receive of a flattened bucket (sglang 0.5.23
    ``WeightUpdater._receive_bucketed_weights_from_distributed``: allocate with
    ``FlattenedTensorBucket.empty``, which checks alignment, one broadcast, then
    ``reconstruct_tensors``), with SGLang's class doing the layout."""
    import torch.distributed as dist
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    bucket = FlattenedTensorBucket.empty(cmd["names"], cmd["dtypes"], cmd["shapes"], "cpu")
    dist.broadcast(bucket.get_flattened_tensor(), src=0, group=group)
    return bucket.reconstruct_tensors()


def _unpack_lightning(cmd: dict[str, Any], group: Any) -> Any:
    """The same layout without SGLang: bytes of each tensor end to end."""
    import math

    import torch
    import torch.distributed as dist

    dtypes = [getattr(torch, d) for d in cmd["dtypes"]]
    sizes = [math.prod(s) * d.itemsize for s, d in zip(cmd["shapes"], dtypes, strict=True)]
    flat = torch.empty(sum(sizes), dtype=torch.uint8)
    dist.broadcast(flat, src=0, group=group)
    parts = flat.split(sizes)
    for name, part, dtype, shape in zip(cmd["names"], parts, dtypes, cmd["shapes"], strict=True):
        yield name, part.view(dtype).reshape(shape)


def _open_tensors(cmd: dict[str, Any]) -> list[tuple[str, Any]]:
    """One TP rank's ``update_weights_from_tensor`` payload, opened as sglang 0.5.23
    opens it: the tokenizer manager's ``normalize_serialized_named_tensor_payloads``
    (base64 to bytes), then ``TpModelWorker.deserialize_own_rank``
    (``monkey_patch_torch_reductions`` and ``MultiprocessingSerializer.deserialize``,
    whose ``SafeUnpickler`` refuses any global it does not list); for
    ``flattened_bucket`` what ``WeightUpdater._update_weights_from_flattened_bucket``
    does: rebuild ``FlattenedTensorMetadata`` by attribute and unpack with
    ``FlattenedTensorBucket``. (That module itself does not import without the GPU
    stack, so its few lines of glue are mirrored here; the classes are SGLang's.)

    The sender is the test process, holding the tensors while its request is open.
    torch pickles a CPU tensor as a shared-memory fd that the receiver fetches from
    the sender's ``multiprocessing`` resource sharer, which authenticates with the
    process authkey: a process not forked from the sender must take its key, or
    the fetch fails ("digest sent was rejected"). Real colocated engines get CUDA
    IPC handles, which need no such fetch (not run here: no GPU)."""
    import multiprocessing

    multiprocessing.current_process().authkey = bytes.fromhex(cmd["authkey"])
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import (
        FlattenedTensorBucket,
        FlattenedTensorMetadata,
    )

    raw = normalize_serialized_named_tensor_payloads(cmd["payloads"])
    monkey_patch_torch_reductions()
    obj = MultiprocessingSerializer.deserialize(raw[cmd["rank"]])
    if not cmd["flat"]:
        return list(obj)
    metadata = [
        FlattenedTensorMetadata(
            name=m.name,
            shape=m.shape,
            dtype=m.dtype,
            start_idx=m.start_idx,
            end_idx=m.end_idx,
            numel=m.numel,
        )
        for m in obj["metadata"]
    ]
    bucket = FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"], metadata=metadata)
    return bucket.reconstruct_tensors()


def _open_cuda_ipc(cmd: dict[str, Any]) -> dict[str, Any]:
    """A CUDA IPC payload opened the way an SGLang 0.5.23 TP worker opens it, on a
    machine whose GPUs this process sees as ``cmd["gpus"]`` (UUIDs, in this
    process's index order, as ``CUDA_VISIBLE_DEVICES`` would order them). The
    worker's ``monkey_patch_torch_reductions`` (``srt/utils/patch_torch.py``)
    installs ``_rebuild_cuda_tensor_modified``, whose ``_device_from_maybe_uuid``
    turns a UUID into this process's index and passes an integer through; then
    ``MultiprocessingSerializer.deserialize`` (its ``SafeUnpickler``). Without a GPU
    only the last step is stood in: torch's own ``rebuild_cuda_tensor`` (which would
    open the IPC handle on that device) records the device it was given and returns
    zeros of the announced shape. ``torch.cuda``'s device count and properties answer
    from ``cmd["gpus"]``. Answers the devices the tensors were opened on and the
    names SGLang's ``FlattenedTensorBucket`` rebuilt."""
    import types

    import torch
    from torch.multiprocessing import reductions

    gpus = cmd["gpus"]
    torch.cuda.device_count = lambda: len(gpus)
    torch.cuda.get_device_properties = lambda i: types.SimpleNamespace(uuid=gpus[i])
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import (
        FlattenedTensorBucket,
        FlattenedTensorMetadata,
    )

    monkey_patch_torch_reductions()
    opened: list[int] = []

    def rebuild(tensor_cls: Any, size: Any, stride: Any, offset: Any, storage_cls: Any,
                dtype: Any, device: Any, *rest: Any) -> Any:  # fmt: skip
        opened.append(device)
        return torch.zeros(size, dtype=dtype)

    reductions._rebuild_cuda_tensor_original = rebuild  # type: ignore[attr-defined]
    raw = normalize_serialized_named_tensor_payloads(cmd["payloads"])
    obj = MultiprocessingSerializer.deserialize(raw[cmd["rank"]])
    metadata = [
        FlattenedTensorMetadata(
            name=m.name, shape=m.shape, dtype=m.dtype,
            start_idx=m.start_idx, end_idx=m.end_idx, numel=m.numel,
        )
        for m in obj["metadata"]
    ]  # fmt: skip
    bucket = FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"], metadata=metadata)
    return {"devices": opened, "names": [n for n, _ in bucket.reconstruct_tensors()]}


def _open_vllm_ipc(cmd: dict[str, Any]) -> list[tuple[str, Any]]:
    """One ``/update_weights`` of vllm 0.34.0's IPC backend, received as its worker
    receives it (``weight_transfer/ipc_engine.py``): ``parse_update_info`` (vLLM's,
    on a bare ``IPCWeightTransferEngine``: it reads only the class) builds
    ``IPCWeightTransferUpdateInfo``, whose ``__post_init__`` unpickles
    ``ipc_handles_pickled`` (allowed by VLLM_ALLOW_INSECURE_SERIALIZATION=1, what the
    server must run with) and checks the lengths; then ``receive_weights``: the
    handle under this GPU's UUID, and for packed transfers ``packed_ipc_consumer``'s
    steps (the buffer cut to ``sum(tensor_sizes)``, vLLM's ``unpack_tensor``, clones).
    The one departure is the rebuild: vLLM calls ``rebuild_cuda_tensor`` (the handle
    is a CUDA IPC handle); on a CPU the trainer's ``reduce_tensor`` gives
    ``rebuild_tensor`` arguments, its storage pickled by value, which we rebuild."""
    import os

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    import torch
    from torch.multiprocessing.reductions import rebuild_tensor
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

    info = object.__new__(IPCWeightTransferEngine).parse_update_info(cmd["info"])
    uuid = cmd["uuid"]
    if cmd["packed"]:
        if info.tensor_sizes is None:
            raise ValueError("`tensor_sizes` is required when packed=True")
        if uuid not in info.ipc_handles:
            raise ValueError(f"IPC handle not found for GPU UUID {uuid}")
        packed = rebuild_tensor(*info.ipc_handles[uuid])[: sum(info.tensor_sizes)]
        dtypes = [getattr(torch, d) for d in info.dtype_names]
        parts = unpack_tensor(packed, info.names, info.shapes, dtypes, info.tensor_sizes)
        return [(name, t.clone()) for name, t in parts]
    out = []
    for name, handle in zip(info.names, info.ipc_handles, strict=True):
        if uuid not in handle:
            raise ValueError(f"IPC handle not found for GPU UUID {uuid}")
        out.append((name, rebuild_tensor(*handle[uuid])))
    return out


class _VllmNcclWorker:
    """One vLLM worker of the NCCL backend (vllm 0.34.0 ``weight_transfer/
    nccl_engine.py`` ``NCCLWeightTransferEngine``, built with its own ``__init__``;
    ``--join vllm``), with only its data plane stood in.

    ``init``: vLLM's ``parse_init_info`` and ``init_transfer_engine``, which records
    the wire params and joins the group through ``worker_init_process_group``; that
    one name (PyNccl on the worker's GPU) is replaced by a call that notes the rank
    vLLM's ``_worker_group_rank`` gives this worker and returns a stand-in
    communicator. ``update``: ``parse_update_info``; the info is kept, as the real
    worker's ``receive_weights`` would run it now, concurrently with the trainer's
    broadcast. ``replay``: once the trainer's broadcasts are recorded
    (tests/support/vllm_nccl_trainer.py), vLLM's ``receive_weights`` runs on each kept info
    in turn — its ``src`` check, its reuse of the last info for an empty one, and
    (packed) ``packed_nccl_broadcast_consumer``, which sizes every receive buffer
    from the info — and the stand-in's ``broadcast`` fills each buffer from the
    next recorded one, refusing one of another dtype or shape. The model's
    ``load_weights`` keeps clones of what it is handed.

    vLLM's model-reload module (``model_executor/model_loader/reload``) does not
    import here (it needs ``cbor2`` and the GPU stack) and there is no model to
    reload: its names stand in, and raise if the NCCL engine calls them (it calls
    ``check_plannable``/``plan_loads``/``load_planned`` only with ``use_load_plan``,
    which lightning never sends; ``start_reload``/``finish_reload`` belong to
    ``/start_weight_update``/``/finish_weight_update``, not run here)."""

    def __init__(self) -> None:
        import sys
        import types

        import torch

        from vllm_nccl_trainer import cpu_streams

        cpu_streams()
        reload = types.ModuleType("vllm.model_executor.model_loader.reload")

        def not_here(*args: Any, **kw: Any) -> None:
            raise AssertionError("vLLM's model reload was called (use_load_plan?)")

        for name in ("check_plannable", "plan_loads", "load_planned"):
            setattr(reload, name, not_here)
        sys.modules[reload.__name__] = reload
        from vllm.distributed.weight_transfer import nccl_engine

        self.nccl_engine = nccl_engine
        self.got: list[tuple[str, Any]] = []
        self.queue: list[tuple[int, Any]] = []
        self.infos: list[Any] = []
        worker = self

        class Model(torch.nn.Module):
            def load_weights(self, weights: Any) -> None:
                worker.got.extend((name, t.clone()) for name, t in weights)

        class Group:
            device = torch.device("cpu")

            def __init__(self, rank: int) -> None:
                self.rank = rank

            def broadcast(self, tensor: Any, src: int, stream: Any = None) -> None:
                if not worker.queue:
                    raise ValueError("a receive with no broadcast left")
                sent_src, sent = worker.queue.pop(0)
                if sent_src != src or sent.dtype != tensor.dtype or sent.shape != tensor.shape:
                    raise ValueError(
                        f"received into {tensor.dtype} {list(tensor.shape)} from {src}, "
                        f"but {sent.dtype} {list(sent.shape)} was broadcast from {sent_src}"
                    )
                tensor.copy_(sent)

            def destroy(self) -> None:
                pass

        self.group_cls = Group
        parallel = types.SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
        config = types.SimpleNamespace(parallel_config=parallel, model_config=None)
        engine_cls = nccl_engine.NCCLWeightTransferEngine
        self.engine = engine_cls(None, config, torch.device("cpu"), Model())

    def init(self, info: dict[str, Any]) -> dict[str, Any]:
        from dataclasses import asdict

        from vllm.distributed.weight_transfer.nccl_common import _worker_group_rank

        parsed = self.engine.parse_init_info(info)
        joined: dict[str, Any] = {}

        def join(init_info: Any, parallel_config: Any) -> Any:
            rank = _worker_group_rank(init_info.rank_offset, parallel_config)
            joined.update(
                rank=rank,
                world_size=init_info.world_size,
                master_address=init_info.master_address,
                master_port=init_info.master_port,
            )
            return self.group_cls(rank)

        self.nccl_engine.worker_init_process_group = join
        self.engine.init_transfer_engine(parsed)
        e = self.engine
        wire = [e.rank_offset, e.packed, e.packed_buffer_size_bytes, e.packed_num_buffers]
        return {"init": asdict(parsed), "joined": joined, "engine": wire}

    def update(self, info: dict[str, Any]) -> dict[str, Any]:
        from dataclasses import asdict

        parsed = self.engine.parse_update_info(info)
        self.infos.append(parsed)
        return {"update": asdict(parsed)}

    def replay(self, broadcasts: str, out: str) -> dict[str, Any]:
        import torch

        self.queue = list(torch.load(broadcasts))
        received = []
        for info in self.infos:
            self.got = []
            self.engine.receive_weights(info)
            received.append(dict(self.got))
        torch.save(received, out)
        return {"left": len(self.queue)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--join", choices=["sglang", "vllm", "lightning"], required=True)
    join = _join_sglang if parser.parse_args().join == "sglang" else _join_lightning

    import torch
    import torch.distributed as dist

    group = None
    worker: _VllmNcclWorker | None = None
    for line in sys.stdin:
        cmd = json.loads(line)
        answer: dict[str, Any]
        try:
            if cmd["op"].startswith("vllm_nccl_"):
                worker = worker or _VllmNcclWorker()
                if cmd["op"] == "vllm_nccl_init":
                    answer = {"ok": True, **worker.init(cmd["info"])}
                elif cmd["op"] == "vllm_nccl_update":
                    answer = {"ok": True, **worker.update(cmd["info"])}
                else:
                    answer = {"ok": True, **worker.replay(cmd["broadcasts"], cmd["out"])}
            elif cmd["op"] == "join":
                group = join(cmd)
                answer = {"ok": True, "module": join.__name__}
            elif cmd["op"] == "cuda_ipc":
                answer = {"ok": True, **_open_cuda_ipc(cmd)}
            elif cmd["op"] == "vllm_ipc":
                got = dict(_open_vllm_ipc(cmd))
                torch.save(got, cmd["out"])
                answer = {"ok": True}
            elif cmd["op"] == "tensor":
                got = dict(_open_tensors(cmd))
                torch.save({k: v.clone() for k, v in got.items()}, cmd["out"])
                answer = {"ok": True}
            elif cmd["op"] == "recv" and cmd.get("flat"):
                unpack = _unpack_sglang if join is _join_sglang else _unpack_lightning
                got = dict(unpack(cmd, group))
                if cmd["out"] is not None:
                    torch.save({k: v.clone() for k, v in got.items()}, cmd["out"])
            elif cmd["op"] == "recv":
                got = {}
                for name, dtype, shape in zip(
                    cmd["names"], cmd["dtypes"], cmd["shapes"], strict=True
                ):
                    buf = torch.empty(shape, dtype=getattr(torch, dtype))
                    dist.broadcast(buf, src=0, group=group)
                    got[name] = buf
                if cmd["out"] is not None:
                    torch.save(got, cmd["out"])
                answer = {"ok": True}
            else:
                return
        except Exception as e:  # the test reads the message
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
