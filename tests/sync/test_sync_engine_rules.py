"""What the engines' released code requires of a weight push, each held to that code
where it imports on a CPU (SGLang 0.5.23 / vLLM 0.34.0 in the cached environments
of tests/support/engine_envs.py) and to a faithful model of it where it does not:

1. CUDA IPC handles name the GPU by UUID (SGLang's ``_rebuild_cuda_tensor_modified``).
2. The transfer group is bound to the trainer's device when it is created, and a
   broadcast has finished before the next FSDP2 gather is issued; buckets are
   pipelined (the next is gathered while the engine loads the last).
3. The group's ranks follow each engine's own arithmetic (SGLang: ``rank_offset +
   tp_rank``; vLLM: ``_worker_group_rank``); a layout SGLang cannot serve is refused.
4. Weights leave in the engine's dtype, read from the engine.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import subprocess
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from fake_rl_engines import FakeSglang, FakeVllm
from lightning.sync import (
    EngineLayout,
    LiveWeights,
    SglangDistributedSync,
    TorchDistTransport,
    VllmSync,
    WeightSyncError,
    WeightUpdate,
    flatten_bucket,
    flattened_bucket_payload,
    join_group,
    leave_group,
    make_weight_sync,
    multiprocessing_serializer,
    plan_buckets,
    sglang_distributed_size,
    sglang_worker_ranks,
    vllm_size,
    vllm_worker_ranks,
)
from lightning.sync.sglang import sglang_auto_dtype

HERE = Path(__file__).resolve().parents[1] / "support"  # the engine-side scripts


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EngineSide:
    """tests/support/engine_side.py in the pinned engine's environment, one JSON line each way."""

    def __init__(self, engine: str) -> None:
        from engine_envs import engines_python

        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.proc = subprocess.Popen(
            [str(engines_python(engine)), str(HERE / "engine_side.py"), "--join", engine],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        return json.loads(line) if line else {"ok": False, "error": "engine side exited"}

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


# -- 1. CUDA IPC: device UUIDs ------------------------------------------------------

TRAINER_GPUS = [
    "GPU-8a1f0c52-0000-4000-8000-00000000000a",
    "GPU-8a1f0c52-0000-4000-8000-00000000000b",
]


def test_sglang_tensor_names_the_gpu_by_uuid_as_sglangs_own_rebuild_expects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trainer's tensor lives on its GPU 1 (UUID …0b); the engine was started
    with the GPUs in the other order, so it sees that GPU as index 0. SGLang 0.5.23's
    own ``monkey_patch_torch_reductions`` + ``MultiprocessingSerializer.deserialize``
    (engine_side.py ``cuda_ipc``) must open the handle on its index 0: it maps a UUID
    to its own index and passes a bare index through (which would open GPU 1, the
    wrong one). No GPU here: torch's reduction of a CUDA tensor is stood in by the
    exact argument tuple torch's ``reduce_tensor`` builds for one
    (``torch/multiprocessing/reductions.py``: ``rebuild_cuda_tensor`` and 15
    arguments, the device 7th), and the engine side stands in only for the final
    ``cudaIpcOpenMemHandle``; SGLang's code in between is its own."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    def cuda_reduce(t: torch.Tensor) -> Any:
        nbytes = t.numel() * t.element_size()
        args = (type(t), t.size(), t.stride(), t.storage_offset(), torch.storage.TypedStorage,
                t.dtype, 1, b"cuda-ipc-handle", nbytes, 0, False, b"ref-counter", 0,
                b"cuda-event", True)  # fmt: skip
        return reductions.rebuild_cuda_tensor, args

    monkeypatch.setitem(ForkingPickler._extra_reducers, torch.Tensor, cuda_reduce)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=TRAINER_GPUS[i])
    )
    tensors = {"a.weight": torch.randn(3, 4), "b.bias": torch.randn(4).to(torch.bfloat16)}
    live = LiveWeights(tensors.items())
    metas = live.metas()
    flat = flatten_bucket(metas, live.tensors(), "cpu")
    payload = base64.b64encode(multiprocessing_serializer(flattened_bucket_payload(metas, flat)))
    side = EngineSide("sglang")
    try:
        got = side.ask(
            {
                "op": "cuda_ipc",
                "payloads": [payload.decode()],
                "rank": 0,
                "gpus": TRAINER_GPUS[::-1],
            }
        )
    finally:
        side.close()
    assert got["ok"], got
    assert got["devices"] == [0]  # …0b is the engine's index 0
    assert got["names"] == ["a.weight", "b.bias"]


def test_cpu_tensors_keep_torchs_reduction() -> None:
    """SGLang's patch would index past a CPU tensor's shorter argument tuple: CPU
    payloads (tests, ``--device cpu``) go as torch writes them, and still load."""
    import pickle

    t = torch.arange(6.0)
    assert torch.equal(pickle.loads(multiprocessing_serializer({"t": t}))["t"], t)


# -- 2. the NCCL group: bound at creation, ordered, pipelined ---------------------------


def test_the_group_is_bound_to_the_trainers_device_when_created() -> None:
    """torch's ``device_id`` (which SGLang's ``init_custom_process_group`` also
    takes): the group is bound when it is made, not at its first broadcast on
    whatever device is current then. gloo binds to ``cpu:0`` here; NCCL binds to the
    current CUDA device (``group_device``), and refuses without one."""
    from lightning.sync.base import group_device

    group = join_group(
        "127.0.0.1", _port(), rank=0, world_size=1, backend="gloo", group_name="bound_test"
    )
    try:
        assert group.bound_device_id == torch.device("cpu", 0)
    finally:
        leave_group(group)
    if not torch.cuda.is_available():
        with pytest.raises(WeightSyncError, match="NCCL weight-update group needs a CUDA device"):
            group_device("nccl")


def test_sglang_distributed_warns_at_start_that_nccl_has_not_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As vllm-nccl does: the NCCL data plane has not run on GPUs, so an NCCL setup
    says so first (here it then fails: no CUDA, or the fake's gloo-only group)."""
    from lightning.sync import SGLANG_DISTRIBUTED_UNVERIFIED

    engine = FakeSglang(data_plane="lightning")
    sync = make_weight_sync("sglang-distributed", [engine.root], backend="nccl")
    try:
        with caplog.at_level("WARNING", logger="lightning.sync"):
            with pytest.raises(WeightSyncError):
                sync.setup()
    finally:
        sync.close()
        engine.stop()
    assert SGLANG_DISTRIBUTED_UNVERIFIED in caplog.text
    assert "NCCL group and its broadcasts on GPUs have not run" in caplog.text
    gloo = make_weight_sync("sglang-distributed", [engine.root], backend="gloo")
    caplog.clear()
    with caplog.at_level("WARNING", logger="lightning.sync"):
        gloo.transport.open = lambda world: None  # type: ignore[attr-defined,method-assign]
        with contextlib.suppress(WeightSyncError):
            gloo.setup()
    gloo.close()
    assert SGLANG_DISTRIBUTED_UNVERIFIED not in caplog.text  # gloo ran in the tests


def test_buckets_are_pipelined_and_no_gather_overlaps_a_broadcast() -> None:
    """sglang-distributed, 4 buckets, an engine that takes 0.4 s to load each: the
    next bucket is gathered while the engine still loads the last (before its
    request returns) but only once the last broadcast has finished, so FSDP2's
    collectives and the transfer group's never run at once on the trainer."""
    events: list[tuple[str, float]] = []

    class Logged(LiveWeights):
        def _gather(self) -> Any:
            for name, t in super()._gather():
                events.append(("gather " + name, time.monotonic()))
                yield name, t

    class Transport(TorchDistTransport):
        def broadcast(self, tensor: torch.Tensor) -> None:
            events.append(("broadcast", time.monotonic()))
            super().broadcast(tensor)
            events.append(("broadcast done", time.monotonic()))

    tensors = {f"w{i}": torch.full((256,), float(i)) for i in range(4)}  # 1 KiB each
    engine = FakeSglang(data_plane="lightning")
    engine.load_s = 0.4
    transport = Transport("127.0.0.1", _port(), backend="gloo", timeout_s=60)
    sync = SglangDistributedSync([engine.root], transport, bucket_bytes=1024)
    try:
        sync.setup()
        sync.push(WeightUpdate(version=1, source=Logged(tensors.items())))
    finally:
        sync.close()
        engine.stop()
    for name, t in tensors.items():
        assert torch.equal(engine.weights[name], t), name
    answered = [t for what, t in engine.events if what == "answered"]
    gathers = [t for what, t in events if what.startswith("gather")]
    done = [t for what, t in events if what == "broadcast done"]
    starts = [t for what, t in events if what == "broadcast"]
    assert len(answered) == len(gathers) == len(done) == 4
    for i in range(1, 4):
        assert done[i - 1] < gathers[i] < answered[i - 1], i  # after the send, while it loads
        assert gathers[i] < starts[i]
    # The whole push overlaps: well under 4 loads plus 4 gathers done one after another.
    assert answered[-1] - starts[0] < 4 * 0.4 + 1.0


def test_sglang_tensor_gathers_the_next_bucket_while_the_engine_loads() -> None:
    """sglang-tensor (CUDA IPC, no broadcast): bucket i + 1 is gathered while the
    engine still loads bucket i, whose memory stays alive until its request
    returns; every bucket arrives (opened by SGLang's own code) bitwise."""
    gathered: list[float] = []

    class Logged(LiveWeights):
        def _gather(self) -> Any:
            for name, t in super()._gather():
                gathered.append(time.monotonic())
                yield name, t

    tensors = {f"w{i}": torch.full((256,), float(i)) for i in range(4)}
    engine = FakeSglang(data_plane="sglang")
    engine.load_s = 0.4
    sync = make_weight_sync("sglang-tensor", [engine.root], bucket_bytes=1024)
    try:
        sync.push(WeightUpdate(version=1, source=Logged(tensors.items())))
    finally:
        sync.close()
        engine.stop()
    for name, t in tensors.items():
        assert torch.equal(engine.weights[name], t), name
    answered = [t for what, t in engine.events if what == "answered"]
    assert len(answered) == len(gathered) == 4
    for i in range(1, 4):
        assert gathered[i] < answered[i - 1], i


# -- 3. rank layouts ------------------------------------------------------------------


def test_sglang_ranks_repeat_per_dp_replica_and_pp_stage() -> None:
    """SGLang joins as ``rank_offset + tp_rank`` on every worker that gets the init
    (every DP worker, every PP stage): TP alone gives distinct ranks; DP or PP repeat
    them, and such a layout is refused with the reason, at load and in the factory."""
    from lightning.config import EngineSection

    assert sglang_worker_ranks(EngineLayout(tp=4), 3) == [3, 4, 5, 6]
    assert sglang_worker_ranks(EngineLayout(tp=2, dp=2), 1) == [1, 2, 1, 2]
    assert sglang_worker_ranks(EngineLayout(tp=2, pp=2), 1) == [1, 2, 1, 2]
    assert sglang_distributed_size(EngineLayout(tp=4)) == 4
    for bad, reason in ((EngineLayout(tp=2, dp=2), "DataParallelController"),
                        (EngineLayout(tp=2, pp=3), "pipeline stage")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"rank_offset \+ tp_rank.*{reason}"):
            sglang_distributed_size(bad)
        with pytest.raises(ValueError, match=reason):
            make_weight_sync("sglang-distributed", ["http://127.0.0.1:9"], layouts=[bad])
        with pytest.raises(ValidationError, match=reason):
            EngineSection(
                kind="external",
                urls=["http://127.0.0.1:9/v1"],
                weight_sync="sglang-distributed",
                sync_parallel=[{"tp": bad.tp, "pp": bad.pp, "dp": bad.dp}],
            )
    # sglang-tensor sends one payload per TP rank; DP replicas and stages share them.
    tensor = make_weight_sync(
        "sglang-tensor",
        ["http://a:1", "http://b:1"],
        layouts=[EngineLayout(tp=2, dp=2), EngineLayout()],
    )
    assert list(tensor.tp_sizes.values()) == [2, 1]  # type: ignore[attr-defined]
    tensor.close()


def test_sglangs_own_join_forms_the_group_the_layout_computes() -> None:
    """Two engines, TP 2 and TP 1: each worker joins with SGLang 0.5.23's own
    ``init_custom_process_group`` under the rank SGLang gives it
    (:func:`sglang_worker_ranks` of the offset the sync sent), the group has exactly
    the size the sync computed (a rank too many and the join would hang), and every
    worker receives the trainer's broadcast."""
    layouts = [EngineLayout(tp=2), EngineLayout(tp=1)]
    port = _port()
    transport = TorchDistTransport("127.0.0.1", port, backend="gloo", timeout_s=60)
    sync = make_weight_sync(
        "sglang-distributed", ["http://a:1", "http://b:1"], backend="gloo", layouts=layouts
    )
    world, offsets = sync.world, list(sync.offsets.values())  # type: ignore[attr-defined]
    sync.close()
    assert world == 4 and offsets == [1, 3]
    ranks = [
        r for lay, off in zip(layouts, offsets, strict=True) for r in sglang_worker_ranks(lay, off)
    ]
    assert ranks == [1, 2, 3]
    sides = [EngineSide("sglang") for _ in ranks]
    answers: list[dict[str, Any]] = []
    try:

        def join(side: EngineSide, rank: int) -> None:
            cmd = {"op": "join", "address": "127.0.0.1", "port": port, "rank": rank,
                   "world": world, "name": "layout_test"}  # fmt: skip
            answers.append(side.ask(cmd))

        threads = [
            threading.Thread(target=join, args=(s, r)) for s, r in zip(sides, ranks, strict=True)
        ]
        for th in threads:
            th.start()
        transport.group_name = "layout_test"
        transport.open(world)
        for th in threads:
            th.join(60)
        assert [a["ok"] for a in answers] == [True] * 3, answers
        sent = torch.arange(5.0)
        recv: list[dict[str, Any]] = []

        def receive(side: EngineSide) -> None:
            cmd = {
                "op": "recv",
                "names": ["w"],
                "dtypes": ["float32"],
                "shapes": [[5]],
                "out": None,
            }
            recv.append(side.ask(cmd))

        threads = [threading.Thread(target=receive, args=(s,)) for s in sides]
        for th in threads:
            th.start()
        transport.broadcast(sent)
        for th in threads:
            th.join(60)
        assert len(recv) == 3
    finally:
        transport.close()
        for s in sides:
            s.close()


def test_vllm_ranks_are_vllms_own_worker_group_rank(tmp_path: Path) -> None:
    """:func:`vllm_worker_ranks` against vLLM 0.34.0's own ``_worker_group_rank``
    for every worker of several layouts (each worker's ``ParallelConfig`` fields:
    ``data_parallel_index``, ``world_size`` = TP × PP, ``rank``)."""
    from engine_envs import engines_python

    layouts = [
        EngineLayout(),
        EngineLayout(tp=2),
        EngineLayout(tp=2, pp=2, dp=2),
        EngineLayout(dp=3),
    ]
    script = (
        "import json, sys, types\n"
        "from vllm.distributed.weight_transfer.nccl_common import _worker_group_rank\n"
        "out = []\n"
        "for tp, pp, dp, off in json.loads(sys.argv[1]):\n"
        "    out.append([_worker_group_rank(off, types.SimpleNamespace(data_parallel_index=d,"
        " world_size=tp * pp, rank=r)) for d in range(dp) for r in range(tp * pp)])\n"
        "print(json.dumps(out))\n"
    )
    arg = json.dumps([[lay.tp, lay.pp, lay.dp, 5] for lay in layouts])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(engines_python("vllm")), "-c", script, arg],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    assert theirs == [vllm_worker_ranks(lay, 5) for lay in layouts]
    assert [vllm_size(lay) for lay in layouts] == [1, 2, 8, 3]
    sync = make_weight_sync(
        "vllm-nccl",
        ["http://a:1", "http://b:1"],
        layouts=[EngineLayout(tp=2, pp=2, dp=2), EngineLayout()],
    )
    assert sync.world == 10 and list(sync.offsets.values()) == [1, 9]  # type: ignore[attr-defined]
    sync.close()


# -- 4. the engine's dtype --------------------------------------------------------------


def test_the_engines_dtype_is_read_from_them() -> None:
    """SGLang's ``/server_info`` ``dtype`` (``"auto"`` resolved as sglang 0.5.23's
    ``_get_and_verify_dtype``: a float32 checkpoint is served in float16, Gemma in
    bfloat16), vLLM's dev-mode ``/server_info`` ``model_config.dtype``; a configured
    ``sync_dtype`` wins; engines that disagree are refused."""
    a, b = FakeSglang(data_plane="lightning"), FakeSglang(data_plane="lightning")
    vllm = FakeVllm("nccl")
    try:
        sync = make_weight_sync("sglang-tensor", [a.root, b.root])
        a.dtype = b.dtype = "bfloat16"
        assert sync.send_dtype("auto", {}) == "bfloat16"
        a.dtype = b.dtype = "auto"
        assert sync.send_dtype("auto", {"torch_dtype": "bfloat16"}) == "bfloat16"
        assert sync.send_dtype("auto", {"torch_dtype": "float32"}) == "float16"
        assert sync.send_dtype("float32", {"torch_dtype": "bfloat16"}) == "float32"
        b.dtype = "half"
        with pytest.raises(WeightSyncError, match="different dtypes"):
            sync.send_dtype("auto", {"torch_dtype": "bfloat16"})
        sync.close()
        transport = TorchDistTransport("127.0.0.1", _port(), backend="gloo")
        v = VllmSync([vllm.root], transport)
        assert v.send_dtype("auto", {"torch_dtype": "float32"}) == "bfloat16"
        v.close()
    finally:
        for e in (a, b, vllm):
            e.stop()
    assert sglang_auto_dtype({"model_type": "gemma2", "torch_dtype": "float32"}) == "bfloat16"
    assert sglang_auto_dtype({}) == "float16"  # no dtype: float32, served in float16


def test_a_bf16_engine_gets_half_the_bytes_cast_before_the_gather(tmp_path: Path) -> None:
    """The loop's push casts the float32 masters to the engine's dtype before they
    are gathered (``Trainer.live_weights(dtype)``), so a bf16 engine receives bf16
    tensors equal to the cast masters, and half the bytes."""
    from lightning.model_cache import tiny_model_dir
    from lightning.rl.trainer import Trainer, TrainerConfig

    trainer = Trainer(TrainerConfig(model=str(tiny_model_dir()), max_len=32))
    sent: dict[str | None, int] = {}
    for dtype in (None, "bfloat16"):
        engine = FakeSglang(data_plane="lightning")
        transport = TorchDistTransport("127.0.0.1", _port(), backend="gloo", timeout_s=60)
        sync = SglangDistributedSync([engine.root], transport, bucket_bytes=1 << 16)
        try:
            sync.setup()
            with trainer.live_weights(dtype) as source:
                sync.push(WeightUpdate(version=1, source=source))
        finally:
            sync.close()
            engine.stop()
        assert source.stats.sent_bytes > 0
        sent[dtype] = source.stats.sent_bytes
        state = trainer.model.state_dict()
        for name, got in engine.weights.items():
            want = state[name].detach()
            want = want.to(torch.bfloat16) if dtype and want.is_floating_point() else want
            assert got.dtype == want.dtype and torch.equal(got, want), name
    assert sent["bfloat16"] * 2 == sent[None]
    plan = plan_buckets(LiveWeights.of_module(trainer.model, dtype="bfloat16").metas(), 1 << 16)
    assert {m.dtype for b in plan for m in b} == {"bfloat16"}


def test_the_loop_asks_the_engine_and_streams_in_its_dtype(tmp_path: Path) -> None:
    """``Run`` reads the dtype once at setup (``send_dtype`` from ``[engine]
    sync_dtype``) and hands it to every ``live_weights`` call."""
    from types import SimpleNamespace

    from lightning.run.loop import Run

    asked: list[str | None] = []

    class Trainer:
        def live_weights(self, dtype: str | None = None) -> LiveWeights:
            asked.append(dtype)
            return LiveWeights([("w", torch.ones(4))], dtype=dtype)

        def pause(self, **kw: Any) -> None: ...
        def resume(self) -> None: ...
        def set_upstreams(self, ups: Any) -> None: ...

    engine = FakeSglang(data_plane="lightning")
    engine.dtype = "bfloat16"
    sync = make_weight_sync("sglang-tensor", [engine.root])
    run = object.__new__(Run)
    run.config = SimpleNamespace(  # type: ignore[assignment]
        algorithm=SimpleNamespace(max_staleness=0, asynchronous=False),
        engine=SimpleNamespace(urls=[engine.root]),
    )
    run.out, run.engine = tmp_path, None
    run.client = run.trainer = Trainer()  # type: ignore[assignment]
    run.weight_sync = sync
    run.sync_dtype = sync.send_dtype("auto", {})
    try:
        run._sync_weights(2)
    finally:
        sync.close()
        engine.stop()
    assert asked == ["bfloat16"]
    assert engine.version == "2"


def test_config_offers_sync_dtype_and_sync_parallel() -> None:
    from lightning.config import EngineSection

    e = EngineSection(
        kind="external", urls=["http://x/v1"], weight_sync="vllm-nccl",
        sync_dtype="bfloat16", sync_parallel=[{"tp": 2, "dp": 2}],
    )  # fmt: skip
    assert e.sync_dtype == "bfloat16" and e.sync_parallel[0].dp == 2
    with pytest.raises(ValidationError, match="not both"):
        EngineSection(kind="external", urls=["http://x/v1"], sync_world_sizes=[2],
                      sync_parallel=[{"tp": 2}])  # fmt: skip
    with pytest.raises(ValidationError, match="one per engine"):
        EngineSection(kind="external", urls=["http://x/v1"], sync_parallel=[{}, {}])
