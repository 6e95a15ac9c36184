"""Weight-sync choreographies against fake vLLM / SGLang control planes (real HTTP on
loopback, real gloo transfers; see tests/support/fake_rl_engines.py for the sources)."""

from __future__ import annotations

import base64
import contextlib
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from fake_rl_engines import FAKE_GPU_UUID, FakeSglang, FakeVllm
from lightning.sync import (
    EmbeddedSync,
    LiveWeights,
    SglangDiskSync,
    SglangDistributedSync,
    SglangTensorSync,
    TorchDistTransport,
    VllmIpcSync,
    VllmNcclSync,
    VllmSync,
    WeightSyncError,
    WeightUpdate,
    make_weight_sync,
    plan_buckets,
    vllm_ipc_json_safe,
    vllm_nccl_init_info,
    vllm_nccl_update_info,
    vllm_packed_misaligned,
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def update(tmp_path: Path) -> WeightUpdate:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(7, 4, generator=g),
        "model.norm.weight": torch.randn(4, generator=g).to(torch.bfloat16),
        "lm_head.weight": torch.randn(7, 4, generator=g),
    }
    d = tmp_path / "v3"
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    return WeightUpdate(version=3, path=d)


def _same(got: dict[str, Any], update: WeightUpdate) -> None:
    want = dict(update.tensors())
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


class GlooVllmTransport(TorchDistTransport):
    """vLLM's NCCL payloads, carried by gloo so the fake can receive on a CPU (the
    real data plane is vLLM's PyNccl: lightning.sync.VllmNcclTransport)."""

    def init_info(self, rank_offset: int, world_size: int) -> dict[str, Any]:
        return vllm_nccl_init_info(
            self.master_address, self.master_port, rank_offset, world_size, packed=False
        )

    def update_info(self, update: WeightUpdate) -> dict[str, Any]:
        return vllm_nccl_update_info(update.metas())


def test_vllm_nccl_choreography_two_engines(update: WeightUpdate) -> None:
    engines = [FakeVllm("nccl"), FakeVllm("nccl")]
    transport = GlooVllmTransport("127.0.0.1", _port(), backend="gloo", group_name="vllm_fake")
    sync = VllmSync([e.root + "/v1" for e in engines], transport)
    try:
        sync.setup()
        sync.push(update)
        update.version = 4
        sync.push(update)
    finally:
        sync.close()
        for e in engines:
            e.stop()
    for e in engines:
        assert e.routes() == [
            "init_weight_transfer_engine",
            *["pause", "start_weight_update", "update_weights", "finish_weight_update", "resume"]
            * 2,
        ]
        assert e.pause_modes == ["wait", "wait"]
        assert e.version == "4" and not e.paused
        _same(e.weights, update)
    # Each engine got its own first rank in one group of trainer + 2 workers.
    offsets = sorted(e.log[0][1]["init_info"]["rank_offset"] for e in engines)
    assert offsets == [1, 2]
    assert {e.log[0][1]["init_info"]["world_size"] for e in engines} == {3}
    names = engines[0].log[3][1]["update_info"]["names"]
    assert names == [n for n, _ in update.tensors()]


def test_vllm_refusal_is_an_error_naming_the_engine_and_resumes(update: WeightUpdate) -> None:
    engine = FakeVllm("nccl")
    transport = GlooVllmTransport("127.0.0.1", _port(), backend="gloo", group_name="vllm_fake")
    sync = VllmSync([engine.root], transport)
    try:
        # No init: the engine refuses start_weight_update; generation must resume.
        with pytest.raises(WeightSyncError, match=r"start_weight_update answered 400"):
            sync.push(update)
    finally:
        sync.close()
        engine.stop()
    assert engine.routes() == ["pause", "start_weight_update", "resume"]
    assert not engine.paused


def test_sglang_own_join_receives_the_trainers_broadcast() -> None:
    """SGLang's ``init_custom_process_group`` (the pinned release, in its own process,
    called as SGLang's weight updater calls it) on one side, our transport on the
    other: the group forms and a broadcast arrives. Before the trainer joined the way
    SGLang does, this timed out on mismatched store keys."""
    engine = FakeSglang(data_plane="sglang")
    transport = TorchDistTransport("127.0.0.1", _port(), backend="gloo", timeout_s=60)
    sync = SglangDistributedSync([engine.root], transport)
    try:
        sync.setup()
        assert engine.side is not None
        sent = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        update = _memory_update({"w": sent})
        sync.push(update)
    finally:
        sync.close()
        engine.stop()
    assert engine.log[0][1]["group_name"] == "lightning_weight_sync"
    assert torch.equal(engine.weights["w"], sent)


def _memory_update(tensors: dict[str, torch.Tensor]) -> WeightUpdate:
    return WeightUpdate(version=1, source=LiveWeights(tensors.items()))


def test_sglang_distributed_choreography_with_pause(update: WeightUpdate) -> None:
    engines = [FakeSglang(), FakeSglang()]
    transport = TorchDistTransport("127.0.0.1", _port(), backend="gloo")
    sync = SglangDistributedSync(
        [e.root for e in engines], transport, world_sizes=[1, 1], pause_mode="retract"
    )
    try:
        sync.setup()
        sync.push(update)
    finally:
        sync.close()
        for e in engines:
            e.stop()
    for e in engines:
        assert e.routes() == [
            "init_weights_update_group",
            "pause_generation",
            "begin_weight_update",
            "update_weights_from_distributed",
            "end_weight_update",
            "continue_generation",
        ]
        assert e.log[1][1] == {"mode": "retract"}
        body = e.log[3][1]
        assert body["load_format"] == "flattened_bucket" and body["weight_version"] == "3"
        metas = dict(
            zip(body["names"], zip(body["dtypes"], body["shapes"], strict=True), strict=True)
        )
        assert metas["model.norm.weight"] == ("bfloat16", [4])
        assert metas["lm_head.weight"] == ("float32", [7, 4])
        assert e.version == "3" and e.paused is None
        _same(e.weights, update)


def test_sglang_disk_waits_without_pause_by_default(update: WeightUpdate) -> None:
    engine = FakeSglang()
    sync = SglangDiskSync([engine.root])
    try:
        sync.push(update)
    finally:
        sync.close()
        engine.stop()
    assert engine.routes() == ["update_weights_from_disk"]
    assert engine.log[0][1]["model_path"] == str(update.path)
    assert engine.log[0][1]["weight_version"] == "3"
    _same(engine.weights, update)


def test_sglang_tensor_payload_one_per_tp_rank(update: WeightUpdate) -> None:
    """Named tensors (no flattening) through a pluggable serializer: one payload per
    TP rank, each serialized on its own."""
    import io

    def serialize(named: list[tuple[str, torch.Tensor]]) -> bytes:
        buf = io.BytesIO()
        torch.save(dict(named), buf)
        return buf.getvalue()

    engine = FakeSglang(data_plane="lightning")  # keeps the payloads, opens nothing
    sync = SglangTensorSync([engine.root], serializer=serialize, tp_sizes=[2], flatten=False)
    try:
        sync.push(update)
    finally:
        sync.close()
        engine.stop()
    assert engine.routes() == [
        "begin_weight_update",
        "update_weights_from_tensor",
        "end_weight_update",
    ]
    assert engine.log[1][1]["load_format"] is None and engine.version == "3"
    assert len(engine.tensor_payloads) == 2
    got = torch.load(io.BytesIO(base64.b64decode(engine.tensor_payloads[1])))
    _same(got, update)


def test_sglang_failure_answer_raises(update: WeightUpdate, tmp_path: Path) -> None:
    engine = FakeSglang()
    sync = SglangDiskSync([engine.root])
    try:
        with pytest.raises(WeightSyncError, match="update_weights_from_disk answered 400"):
            sync.push(WeightUpdate(version=1, path=tmp_path / "missing"))
    finally:
        sync.close()
        engine.stop()


def test_embedded_load_weights(update: WeightUpdate) -> None:
    class FakeEmbedded(FakeSglang):
        def r_admin_load_weights(self, body: Any, query: dict[str, str]) -> Any:
            self._load_dir(body["path"])
            return {"status": "ok", "weight_version": body["version"]}

    engine = FakeEmbedded()
    sync = make_weight_sync("embedded", [engine.root + "/v1"])
    assert isinstance(sync, EmbeddedSync)
    try:
        sync.push(update)
    finally:
        sync.close()
        engine.stop()
    assert engine.log == [("admin_load_weights", {"path": str(update.path), "version": 3})]
    _same(engine.weights, update)


def test_factory() -> None:
    with pytest.raises(ValueError, match=r"no vLLM release has a disk.*use 'vllm-nccl'"):
        make_weight_sync("vllm-disk", ["http://x"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"vllm-ipc' with sync_world_sizes = \[1, 2\].*one worker"):
        make_weight_sync("vllm-ipc", ["http://x", "http://y"], world_sizes=[1, 2])
    ipc = make_weight_sync("vllm-ipc", ["http://x/v1"], bucket_bytes=1 << 20, colocate=True)
    assert isinstance(ipc, VllmIpcSync) and ipc.streams and ipc.colocated and ipc.packed
    sync = make_weight_sync("vllm-nccl", ["http://x/v1"], world_sizes=[2])
    assert isinstance(sync, VllmNcclSync) and (sync.world, sync.offsets) == (3, {"http://x": 1})
    sync.close()


def test_config_names_the_replacement_of_vllm_disk() -> None:
    from pydantic import ValidationError

    from lightning.config import EngineSection

    with pytest.raises(ValidationError, match=r"vllm-disk' was removed.*use 'vllm-nccl'"):
        EngineSection(kind="external", urls=["http://x/v1"], weight_sync="vllm-disk")


def test_config_offers_exactly_the_syncs_make_weight_sync_builds() -> None:
    """``[engine] weight_sync`` and ``SyncKind`` list the same kinds (the config adds
    only "sglang", the older name of "sglang-disk"): a kind added to one and not the
    other would load and then fail, or never be reachable from a config."""
    from typing import get_args

    from lightning.config import EngineSection
    from lightning.sync import SyncKind

    offered = set(get_args(EngineSection.model_fields["weight_sync"].annotation))
    assert offered - {"sglang"} == set(get_args(SyncKind))
    for kind in get_args(SyncKind):
        url = ["http://127.0.0.1:9/v1"]
        make_weight_sync(kind, url, world_sizes=[1]).close()


def test_aliases_are_mapped_once_by_the_factory() -> None:
    """``"sglang"`` means ``"sglang-disk"`` wherever a kind is named (``[engine]
    weight_sync``, an online pass's ``[weight_sync] policy``): ``make_weight_sync``
    maps it, through ``lightning.sync.kinds.canonical``, and nothing else does."""
    from typing import get_args

    from lightning.online.train import WeightSyncSection
    from lightning.sync import ALIASES, DiskSyncKind, canonical

    assert ALIASES == {"sglang": "sglang-disk"}
    assert canonical("sglang") == "sglang-disk" and canonical("vllm-ipc") == "vllm-ipc"
    with pytest.raises(ValueError, match=r"unknown weight_sync 'sglang-nccl': one of embedded"):
        canonical("sglang-nccl")
    sync = make_weight_sync("sglang", ["http://127.0.0.1:9/v1"])
    assert type(sync) is SglangDiskSync
    sync.close()
    # An online pass pushes an exported directory: only the disk kinds are offered.
    policies = set(get_args(WeightSyncSection.model_fields["policy"].annotation))
    assert policies == set(get_args(DiskSyncKind)) == {"none", "embedded", "sglang", "sglang-disk"}
    for policy in policies:
        sync = make_weight_sync(policy, ["http://127.0.0.1:9/v1"])
        assert not sync.streams, policy
        sync.close()


# -- no disk: buckets from the live model ------------------------------------------


def _mixed(n: int = 12) -> dict[str, torch.Tensor]:
    """Tensors of three dtypes and odd sizes, so a flattened bucket would misalign
    a float32 behind an odd number of bfloat16 bytes unless the plan cuts there."""
    g = torch.Generator().manual_seed(1)
    out: dict[str, torch.Tensor] = {}
    for i in range(n):
        shape = (3 + i % 4, 5 + 2 * (i % 3))
        t = torch.randn(shape, generator=g)
        out[f"layers.{i}.w"] = t.to([torch.float32, torch.bfloat16, torch.float16][i % 3])
    out["layers.3.odd"] = torch.randn(7, generator=g).to(torch.bfloat16)  # 14 bytes
    return out


def test_plan_buckets_bound_order_and_alignment() -> None:
    metas = LiveWeights(_mixed().items()).metas()
    for limit in (1, 100, 300, 10_000):
        plan = plan_buckets(metas, limit)
        assert [m for b in plan for m in b] == metas  # every tensor once, in order
        for bucket in plan:
            size = sum(m.nbytes for m in bucket)
            assert size <= limit or len(bucket) == 1
            offset = 0
            for m in bucket:  # what FlattenedTensorBucket.empty checks
                assert offset % torch.empty(0, dtype=getattr(torch, m.dtype)).element_size() == 0
                offset += m.nbytes
    assert len(plan_buckets(metas, 10_000, aligned=False)) == 1
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(metas, 0)


def test_live_weights_single_pass_drain_and_tied_names() -> None:
    w = torch.randn(4, 3)
    src = LiveWeights([("embed.weight", w), ("norm.weight", torch.ones(3)), ("lm_head.weight", w)])
    assert [m.name for m in src.metas()] == ["embed.weight", "norm.weight"]  # tied: once
    it = src.tensors()
    assert next(it)[0] == "embed.weight"
    with pytest.raises(WeightSyncError, match="single-pass"):
        src.tensors()
    src.drain()  # the rest
    assert next(it, None) is None
    # A rank that sends nothing still runs every gather and yields nothing.
    assert list(LiveWeights([("a", w)], sender=False).tensors()) == []
    with pytest.raises(WeightSyncError, match="streams from the live model"):
        EmbeddedSync(["http://x"]).push(WeightUpdate(version=1, source=src))


def test_sglang_flattened_buckets_received_by_sglangs_own_bucket() -> None:
    """Buckets map to update_weights_from_distributed calls in one session; each is
    one broadcast that SGLang 0.5.23's own ``FlattenedTensorBucket`` allocates (with
    its alignment check) and unpacks; what arrives is bitwise what was sent, and the
    version moves only with the last bucket."""
    tensors = _mixed()
    engine = FakeSglang(data_plane="sglang")
    transport = TorchDistTransport("127.0.0.1", _port(), backend="gloo", timeout_s=60)
    sync = SglangDistributedSync([engine.root], transport, bucket_bytes=300)
    plan = plan_buckets(LiveWeights(tensors.items()).metas(), 300)
    assert len(plan) > 3
    try:
        sync.setup()
        sync.push(WeightUpdate(version=7, source=LiveWeights(tensors.items())))
    finally:
        sync.close()
        engine.stop()
    n = len(plan)
    assert engine.routes() == [
        "init_weights_update_group",
        "begin_weight_update",
        *["update_weights_from_distributed"] * n,
        "end_weight_update",
    ]
    assert engine.calls == [len(b) for b in plan]
    assert engine.versions == [None] * (n - 1) + ["7"] and engine.version == "7"
    flushes = [body["flush_cache"] for r, body in engine.log if r.startswith("update_")]
    assert flushes == [False] * (n - 1) + [True]
    assert set(engine.weights) == set(tensors)
    for name, t in tensors.items():
        got = engine.weights[name]
        assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8))


def test_sender_holds_at_most_a_bucket_and_a_tensor() -> None:
    """Casting to bfloat16 makes every sent tensor a fresh copy the sender owns, as
    an FSDP2 gather does: with small buckets the peak is at most a bucket plus the
    largest tensor, far below the model; with one bucket it is the whole model
    (the counter sees what a sync that held everything would hold)."""
    g = torch.Generator().manual_seed(2)
    model = {f"layers.{i}.w": torch.randn(64, 64, generator=g) for i in range(16)}
    model["embed.weight"] = torch.randn(256, 64, generator=g)
    total = sum(t.numel() * 2 for t in model.values())  # in bfloat16
    largest = 256 * 64 * 2
    peaks = {}
    for bucket in (10_000, 1 << 30):
        engine = FakeSglang(data_plane="lightning")
        transport = TorchDistTransport("127.0.0.1", _port(), backend="gloo", timeout_s=60)
        sync = SglangDistributedSync([engine.root], transport, bucket_bytes=bucket)
        source = LiveWeights(model.items(), dtype=torch.bfloat16)
        try:
            sync.setup()
            sync.push(WeightUpdate(version=1, source=source))
        finally:
            sync.close()
            engine.stop()
        for name, t in model.items():
            assert torch.equal(engine.weights[name], t.to(torch.bfloat16)), name
        assert source.stats.sent_bytes == total
        assert source.stats.live_bytes == 0  # nothing kept after the push
        peaks[bucket] = source.stats.peak_bytes
    assert peaks[10_000] <= 10_000 + largest < total / 2
    assert peaks[1 << 30] >= total


def test_fsdp2_two_ranks_stream_the_live_model_without_disk(tmp_path: Path) -> None:
    """2 gloo ranks, FSDP2, one real step, then ``sglang-distributed`` from the
    sharded parameters, driven as under torchrun (LeaderTrainer / follow): the
    engine gets bitwise the full state dict, in several buckets; no safetensors
    writer runs and no file appears in either rank's cwd or temp dir; the sender's
    peak stays within a bucket plus the largest tensor (and one huge bucket, the
    control, holds the whole model)."""
    import os
    import subprocess
    import sys

    from lightning.model_cache import tiny_model_dir
    from sync_worker import MODEL

    tiny_model_dir(**MODEL)  # built once here, not by two ranks at once
    here = Path(__file__).resolve().parents[1] / "support"
    out, watch, bucket = tmp_path / "out.pt", tmp_path / "watch", 1 << 20
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{here}:{os.environ.get('PYTHONPATH', '')}",
    }
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(_port()),
        str(here / "sync_worker.py"), str(out), str(watch), str(bucket),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = torch.load(out, weights_only=True)
    reference: dict[str, torch.Tensor] = r["reference"]
    assert r["safetensors_calls"] == []
    small, whole = r["pushes"]
    for push in (small, whole):
        assert push["files"] == []  # neither rank wrote anything during the syncs
        got = push["weights"]
        # Tied lm_head is sent once, as save_pretrained writes it.
        assert set(got) == set(reference) - {"lm_head.weight"}
        for name, t in got.items():
            assert t.dtype == reference[name].dtype and torch.equal(t, reference[name]), name
    total = sum(t.numel() * t.element_size() for n, t in reference.items() if n != "lm_head.weight")
    assert len(small["calls"]) > 4 and len(whole["calls"]) == 1
    assert small["sent_bytes"] == whole["sent_bytes"] == total
    assert small["peak_bytes"] <= bucket + small["largest_bytes"] < total
    assert whole["peak_bytes"] >= total


class _Recorder:
    """Stands in for the gateway client, the trainer and the sync around
    ``Run._sync_weights``."""

    def __init__(self, streams: bool, fail: bool = False) -> None:
        self.streams, self.fail = streams, fail
        self.calls: list[str] = []
        self.source = LiveWeights([(f"w{i}", torch.full((2,), float(i))) for i in range(4)])

    def pause(self, **kw: Any) -> None:
        self.calls.append("pause")

    def resume(self) -> None:
        self.calls.append("resume")

    def set_upstreams(self, ups: Any) -> None:
        self.calls.append("set_upstreams")

    def live_weights(self, dtype: str | None = None) -> LiveWeights:
        self.calls.append("live_weights")
        return self.source

    def export_weights(self, path: str) -> None:
        self.calls.append("export_weights")
        Path(path).mkdir(parents=True)

    def push(self, update: WeightUpdate) -> None:
        self.calls.append("push")
        self.update = update
        if update.source is None:
            return
        it = update.tensors()
        next(it)  # a push that dies after its first tensor, when fail
        if self.fail:
            raise WeightSyncError("engine refused")
        for _ in it:
            pass


@pytest.mark.parametrize("fail", [False, True])
def test_run_streams_without_export_and_drains_a_failed_push(tmp_path: Path, fail: bool) -> None:
    """The loop hands a streaming sync the live model (no export_weights, no
    directory) and, when the push dies halfway, still runs the remaining gathers:
    under torchrun the other ranks are inside them."""
    from types import SimpleNamespace

    from lightning.run.loop import Run

    r = _Recorder(streams=True, fail=fail)
    run = object.__new__(Run)
    run.config = SimpleNamespace(  # type: ignore[assignment]
        algorithm=SimpleNamespace(max_staleness=0, asynchronous=False),
        engine=SimpleNamespace(urls=["http://e"]),
    )
    run.out, run.engine, run.sync_dtype = tmp_path, None, None
    run.client = run.trainer = run.weight_sync = r  # type: ignore[assignment]
    if fail:
        with pytest.raises(WeightSyncError):
            run._sync_weights(5)
        assert r.calls == ["pause", "live_weights", "push", "resume"]
    else:
        run._sync_weights(5)
        assert r.calls == ["pause", "live_weights", "push", "set_upstreams", "resume"]
    assert r.update.source is r.source and r.update.path is None and r.update.version == 5
    assert r.source._iter is not None and next(r.source._iter, None) is None  # all gathered
    assert not (tmp_path / "weights").exists()
    disk = _Recorder(streams=False)
    run.client = run.trainer = run.weight_sync = disk  # type: ignore[assignment]
    run._sync_weights(6)
    assert disk.calls == ["pause", "export_weights", "push", "set_upstreams", "resume"]
    assert disk.update.path == tmp_path / "weights" / "v6" and disk.update.source is None


# -- sglang-tensor: buckets opened by SGLang's own code; colocated memory handoff ----


@pytest.mark.parametrize("flatten", [True, False])
def test_sglang_tensor_buckets_opened_by_sglangs_own_deserializer(flatten: bool) -> None:
    """Each bucket is one ``update_weights_from_tensor`` call in one session; every
    TP rank's payload is opened by SGLang 0.5.23's own ``MultiprocessingSerializer``
    (its ``SafeUnpickler``) in the engine's process and, flattened, unpacked by its
    own ``FlattenedTensorBucket``: what arrives is bitwise what was sent, and the
    version and the cache flush come with the last bucket only."""
    tensors = _mixed()
    engine = FakeSglang(data_plane="sglang")
    sync = SglangTensorSync(
        [engine.root], tp_sizes=[2], bucket_bytes=300, flatten=flatten, device="cpu"
    )
    plan = plan_buckets(LiveWeights(tensors.items()).metas(), 300, aligned=flatten)
    assert len(plan) > 3
    source = LiveWeights(tensors.items())
    try:
        sync.push(WeightUpdate(version=7, source=source))
    finally:
        sync.close()
        engine.stop()
    n = len(plan)
    assert engine.routes() == [
        "begin_weight_update",
        *["update_weights_from_tensor"] * n,
        "end_weight_update",
    ]
    assert engine.calls == [len(b) for b in plan]
    assert engine.versions == [None] * (n - 1) + ["7"] and engine.version == "7"
    bodies = [body for r, body in engine.log if r == "update_weights_from_tensor"]
    assert [b["flush_cache"] for b in bodies] == [False] * (n - 1) + [True]
    assert {b["load_format"] for b in bodies} == {"flattened_bucket" if flatten else None}
    assert all(len(b["serialized_named_tensors"]) == 2 for b in bodies)
    for rank in (0, 1):
        got = engine.ranks[rank]
        assert set(got) == set(tensors)
        for name, t in tensors.items():
            assert got[name].dtype == t.dtype, name
            assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name
    assert source.stats.sent_bytes == sum(m.nbytes for b in plan for m in b)


class _Trainer:
    """The trainer and gateway client around ``Run._before_train`` / ``_sync_weights``."""

    def __init__(self, tensors: dict[str, torch.Tensor], log: list[str]) -> None:
        self.tensors, self.log = tensors, log

    def pause(self, **kw: Any) -> None:
        self.log.append("gateway pause")

    def resume(self) -> None:
        self.log.append("gateway resume")

    def set_upstreams(self, ups: Any) -> None:
        pass

    def live_weights(
        self, dtype: str | None = None
    ) -> contextlib.AbstractContextManager[LiveWeights]:
        return contextlib.nullcontext(LiveWeights(self.tensors.items(), dtype=dtype))

    def export_weights(self, path: str) -> None:
        raise AssertionError(f"export_weights({path!r}): sglang-tensor must not touch disk")


def _run(tmp_path: Path, trainer: _Trainer, sync: Any) -> Any:
    from types import SimpleNamespace

    from lightning.run.loop import Run

    run = object.__new__(Run)
    run.config = SimpleNamespace(  # type: ignore[assignment]
        algorithm=SimpleNamespace(max_staleness=0, asynchronous=False),
        engine=SimpleNamespace(urls=["http://e"]),
    )
    run.out, run.engine = tmp_path, None
    run.client = run.trainer = trainer  # type: ignore[assignment]
    run.weight_sync = sync
    run.sync_dtype = None
    return run


def test_run_streams_sglang_tensor_from_the_live_model_without_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop hands sglang-tensor the live model as it does sglang-distributed:
    several buckets reach the engine (opened by SGLang's own code), no export runs,
    no safetensors writer is called and nothing appears under the run directory."""
    import safetensors.torch

    def no_write(*args: Any, **kw: Any) -> None:
        raise AssertionError("a safetensors file was written")

    for name in ("save_file", "save_model", "save"):
        monkeypatch.setattr(safetensors.torch, name, no_write)
    tensors = _mixed()
    engine = FakeSglang(data_plane="sglang")
    sync = make_weight_sync("sglang-tensor", [engine.root + "/v1"], bucket_bytes=300)
    assert isinstance(sync, SglangTensorSync) and sync.streams
    run = _run(tmp_path, _Trainer(tensors, []), sync)
    try:
        run._sync_weights(4)
    finally:
        sync.close()
        engine.stop()
    assert len(engine.calls) > 3 and engine.version == "4"
    for name, t in tensors.items():
        assert torch.equal(engine.weights[name].view(torch.uint8), t.view(torch.uint8)), name
    assert list(tmp_path.iterdir()) == []


def test_colocated_engine_releases_memory_for_the_step_and_resumes_it_around_the_push(
    tmp_path: Path,
) -> None:
    """``colocate``: the gateway drains, SGLang gives back every tag before the
    optimizer step; the push resumes the weights first, loads every bucket, then
    resumes the KV cache and CUDA graphs."""
    tensors = _mixed()
    engine = FakeSglang(data_plane="lightning")
    sync = make_weight_sync("sglang-tensor", [engine.root], bucket_bytes=300, colocate=True)
    log: list[str] = []
    run = _run(tmp_path, _Trainer(tensors, log), sync)
    try:
        for version in (1, 2):
            run._before_train()
            log.append("train")
            run._sync_weights(version)
    finally:
        sync.close()
        engine.stop()
    n = len(plan_buckets(LiveWeights(tensors.items()).metas(), 300))
    one = [
        "release_memory_occupation",
        "resume_memory_occupation",
        "begin_weight_update",
        *["update_weights_from_tensor"] * n,
        "end_weight_update",
        "resume_memory_occupation",
    ]
    assert engine.routes() == one * 2
    memory = [(r, body["tags"]) for r, body in engine.log if r.endswith("memory_occupation")]
    assert memory[:3] == [
        ("release_memory_occupation", ["kv_cache", "weights", "cuda_graph"]),
        ("resume_memory_occupation", ["weights"]),
        ("resume_memory_occupation", ["kv_cache", "cuda_graph"]),
    ]
    assert engine.released == [] and engine.version == "2"
    step = ["gateway pause", "gateway resume", "train", "gateway pause", "gateway resume"]
    assert log == step * 2


def test_colocated_refusals_are_clear_errors_and_a_failed_push_resumes(tmp_path: Path) -> None:
    engine = FakeSglang(data_plane="lightning")
    engine.refuse_memory = "release_memory_occupation should be called only when server is idle."
    sync = SglangTensorSync([engine.root], colocate=True)
    log: list[str] = []
    run = _run(tmp_path, _Trainer({"w": torch.ones(3)}, log), sync)
    try:
        with pytest.raises(WeightSyncError, match=r"colocated engine .*release_memory_occupation.*"
                           r"answered 400.*only when server is idle"):  # fmt: skip
            run._before_train()
        assert log == ["gateway pause", "gateway resume"]  # the gateway is not left paused
        engine.refuse_memory = None
        sync.before_train()

        def broken(obj: Any) -> bytes:
            raise RuntimeError("serializer died")

        sync.serializer = broken
        with pytest.raises(RuntimeError, match="serializer died"):
            sync.push(WeightUpdate(version=1, source=LiveWeights([("w", torch.ones(3))])))
    finally:
        sync.close()
        engine.stop()
    assert engine.released == []  # the engine got all its memory back
    assert engine.routes()[-4:] == [
        "resume_memory_occupation",
        "begin_weight_update",
        "end_weight_update",
        "resume_memory_occupation",
    ]


def test_colocate_needs_sglang_tensor_and_a_synchronous_run() -> None:
    from pydantic import ValidationError

    from lightning.config import EngineSection, RunConfig

    with pytest.raises(ValidationError, match=r"colocate = true.*set weight_sync = 'sglang-tensor' "
                       r"\(SGLang\) or 'vllm-ipc' \(vLLM\) \(it is 'sglang-distributed'\)"):  # fmt: skip
        EngineSection(
            kind="external", urls=["http://x/v1"], weight_sync="sglang-distributed", colocate=True
        )
    with pytest.raises(ValidationError, match=r"\(it is 'embedded'\)"):
        EngineSection(colocate=True)
    with pytest.raises(ValueError, match="sglang-tensor"):
        make_weight_sync("sglang-disk", ["http://x"], colocate=True)
    examples = Path(__file__).resolve().parents[2] / "examples"
    colocated = {
        "engine.kind": "external",
        "engine.urls": ["http://x/v1"],
        "engine.weight_sync": "sglang-tensor",
        "engine.colocate": True,
    }
    assert RunConfig.load(examples / "demo.toml", colocated).engine.colocate
    with pytest.raises(ValidationError, match=r"synchronous run.*max_staleness = 0 \(it is 1\)"):
        RunConfig.load(examples / "demo.toml", {**colocated, "algorithm.max_staleness": 1})


@pytest.mark.parametrize("colocate", [False, True])
def test_sglang_tensor_warns_at_setup_what_has_not_run(
    colocate: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """CUDA IPC handles (and, colocated, SGLang's memory saver) have not run in these
    tests: a user starting a run is told so, as for vllm-nccl."""
    sync = make_weight_sync("sglang-tensor", ["http://127.0.0.1:9"], colocate=colocate)
    with caplog.at_level("WARNING", logger="lightning.sync"):
        sync.setup()
    (record,) = caplog.records
    assert "experimental" in record.message and "CUDA IPC" in record.message
    assert ("memory saver" in record.message) == colocate


# -- vllm-ipc: vLLM's own trainer engine, parser and unpacker; colocated sleep mode ----


def _vllm_ipc_trainer(root: str, tmp_path: Path, *flags: str) -> dict[str, Any]:
    """Run tests/support/vllm_ipc_trainer.py (VllmIpcSync with vLLM's own trainer engine) in
    the pinned vLLM's environment, in an empty working directory."""
    return _vllm_trainer("vllm_ipc_trainer.py", tmp_path, "--root", root, *flags)


def _vllm_trainer(script_name: str, tmp_path: Path, *flags: str) -> dict[str, Any]:
    import subprocess

    import lightning
    from engine_envs import engines_python

    work, out = tmp_path / "work", tmp_path / "result.pt"
    work.mkdir()
    script = Path(__file__).resolve().parents[1] / "support" / script_name
    env = {**os.environ, "PYTHONPATH": str(Path(lightning.__file__).resolve().parents[1])}
    cmd = [str(engines_python("vllm")), str(script), "--out", str(out), *flags]
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(torch.load(out))


@pytest.mark.parametrize(
    ("colocate", "packed", "odd"),
    [(True, True, False), (False, True, False), (False, False, True)],
    ids=["colocated-packed", "packed", "unpacked-mixed-alignment"],
)
def test_vllm_ipc_runs_vllms_own_trainer_engine_parser_and_unpacker(
    tmp_path: Path, colocate: bool, packed: bool, odd: bool
) -> None:
    """Two steps through vLLM's ``IPCTrainerWeightTransferEngine``: every update info
    is parsed by vLLM's ``IPCWeightTransferUpdateInfo`` and unpacked by vLLM's
    ``unpack_tensor``, bitwise equal to what the trainer held. Packed: one
    ``/update_weights`` per fill of a buffer of ``bucket_bytes``, grown to the largest
    tensor. Colocated: sleep (level 2, mode wait) → wake weights → update → wake KV
    cache, no pause/resume; otherwise pause(wait) → update → resume. Nothing on disk.
    Unpacked, tensors need no alignment (each has a handle of its own)."""
    from vllm_ipc_trainer import weights

    engine = FakeVllm("ipc")
    flags = ["--bucket", "300", *["--colocate"] * colocate, *["--unpacked"] * (not packed)]
    try:
        got = _vllm_ipc_trainer(engine.root, tmp_path, *flags, *["--odd"] * odd)
    finally:
        engine.stop()
    assert got["error"] is None
    tensors = weights(2, odd)
    metas = LiveWeights(tensors.items()).metas()
    largest = max(m.nbytes for m in metas)
    assert largest > 300
    n = len(plan_buckets(metas, max(300, largest), aligned=False)) if packed else 1
    assert n > 3 or not packed
    update = ["start_weight_update", *["update_weights"] * n, "finish_weight_update"]
    step = ["sleep", "wake_up", *update, "wake_up"] if colocate else ["pause", *update, "resume"]
    assert engine.routes() == ["init_weight_transfer_engine", *step * 2]
    assert engine.log[0][1] == {"init_info": {"packed": packed}}
    if colocate:
        queries = [body for route, body in engine.log if route in ("sleep", "wake_up")]
        sleep, weights_first, kv_last = (
            {"level": "2", "mode": "wait"},
            {"tags": "weights"},
            {"tags": "kv_cache"},
        )
        assert queries == [sleep, weights_first, kv_last] * 2
    else:
        assert engine.pause_modes == ["wait", "wait"]
    assert engine.asleep == [] and not engine.paused and engine.version == "2"
    assert sum(engine.calls) == 2 * len(tensors)
    for name, t in tensors.items():
        assert engine.weights[name].dtype == t.dtype, name
        assert torch.equal(engine.weights[name].view(torch.uint8), t.view(torch.uint8)), name
    assert got["sent"] == [sum(m.nbytes for m in metas)] * 2
    assert got["json_safe"] and got["cwd"] == []
    assert torch.equal(got["tensors"]["lm_head.weight"], tensors["lm_head.weight"])


# -- vllm-nccl: vLLM's own trainer engine and packer, worker parsers and receive -------


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_vllm_nccl_runs_vllms_own_trainer_engine_and_worker_parsers(
    tmp_path: Path, packed: bool
) -> None:
    """Two pushes through vllm 0.34.0's ``NCCLTrainerWeightTransferEngine`` to two
    engines (tests/support/vllm_nccl_trainer.py; only PyNccl is stood in, by a communicator
    that records what vLLM broadcasts). Each engine's init info is accepted by vLLM's
    worker-side ``parse_init_info``/``init_transfer_engine`` with its own rank offset
    in a group of 3 and the trainer's wire params; every update info by
    ``parse_update_info``; then vLLM's ``receive_weights`` (packed: its
    ``packed_nccl_broadcast_consumer``) unpacks the recorded broadcasts, bitwise equal
    to the weights pushed. The second push reuses the first's metadata: vLLM sends
    empty lists and the worker falls back on what it kept."""
    from vllm_ipc_trainer import weights

    engines = [FakeVllm("nccl", vllm_worker=True) for _ in range(2)]
    port = _port()
    flags = ["--port", str(port), "--bucket", "300", *["--unpacked"] * (not packed)]
    recorded = tmp_path / "broadcasts.pt"
    try:
        got = _vllm_trainer(
            "vllm_nccl_trainer.py", tmp_path, "--roots", *[e.root for e in engines], *flags
        )
        assert got["error"] is None
        torch.save(got["broadcasts"], recorded)
        received = [e.replay(recorded) for e in engines]
    finally:
        for e in engines:
            e.stop()
    step = ["pause", "start_weight_update", "update_weights", "finish_weight_update", "resume"]
    for e in engines:
        assert e.routes() == ["init_weight_transfer_engine", *step * 2]
        assert e.pause_modes == ["wait", "wait"] and not e.paused and e.version == "2"
    # The trainer's endpoint: rank 0 of trainer + 2 workers, at our address.
    address = {"master_address": "127.0.0.1", "master_port": port}
    assert got["endpoint"] == {**address, "world_size": 3, "rank": 0}
    assert got["destroyed"]
    # Init: vLLM's parser took every field; each worker joins at its own rank.
    offsets = []
    for e in engines:
        (init,) = e.worker_inits
        offset = init["init"]["rank_offset"]
        offsets.append(offset)
        assert init["init"] == {
            **address,
            "rank_offset": offset,
            "world_size": 3,
            "nccl_unique_id_b64": None,
            "packed": packed,
            "packed_buffer_size_bytes": 300,
            "packed_num_buffers": 2,
            "use_load_plan": False,
            "metadata": None,
        }
        assert init["joined"] == {**address, "rank": offset, "world_size": 3}
        assert init["engine"] == [offset, packed, 300, 2]
    assert sorted(offsets) == [1, 2]
    # Updates: vLLM's parser took both; the second is vLLM's reuse (empty lists).
    tensors = [weights(1), weights(2)]
    metas = LiveWeights(tensors[0].items()).metas()
    first = {
        "names": [m.name for m in metas],
        "dtype_names": [m.dtype for m in metas],
        "shapes": [m.shape for m in metas],
        "src": 0,
    }
    empty = {"names": [], "dtype_names": [], "shapes": [], "src": 0}
    for e in engines:
        assert [u["update"] for u in e.worker_updates] == [first, empty]
    # The broadcasts: packed, vLLM's chunks (flushed once past the buffer size).
    sizes = [m.nbytes for m in metas]
    if packed:
        chunks, fill = [], 0
        for size in sizes:
            fill += size
            if fill > 300:
                chunks, fill = [*chunks, fill], 0
        chunks += [fill] * (fill > 0)
        assert len(chunks) >= 3  # several chunks, and two buffers reused
        want = [(0, torch.uint8, (c,)) for c in chunks]
    else:
        want = [(0, getattr(torch, m.dtype), tuple(m.shape)) for m in metas]
    assert [(s, t.dtype, tuple(t.shape)) for s, t in got["broadcasts"]] == want * 2
    # The bytes, through vLLM's own receive on each worker.
    for per_update in received:
        assert len(per_update) == 2
        for step_got, pushed in zip(per_update, tensors, strict=True):
            assert list(step_got) == list(pushed)
            for name, t in pushed.items():
                assert step_got[name].dtype == t.dtype and step_got[name].shape == t.shape
                assert torch.equal(step_got[name].view(torch.uint8), t.view(torch.uint8)), name
    assert got["sent"] == [sum(sizes)] * 2
    assert got["cwd"] == []


def test_vllm_packed_ipc_refuses_what_vllms_unpacker_cannot_view(tmp_path: Path) -> None:
    """vllm 0.34.0 packs tensors end to end with no padding and its worker views each
    slice as the dtype: a float32 after an odd number of bfloat16 elements fails in
    vLLM's own ``unpack_tensor`` ("storage_offset() must be divisible by 4"). The
    sync finds such a tensor from shapes alone and sends nothing."""
    from vllm_ipc_trainer import weights

    metas = LiveWeights(weights(1, odd=True).items()).metas()
    bad = vllm_packed_misaligned(metas, 1 << 20)
    assert bad is not None and bad.dtype == "float32"
    assert vllm_packed_misaligned(LiveWeights(weights(1).items()).metas(), 300) is None
    engine = FakeVllm("ipc")
    try:
        got = _vllm_ipc_trainer(engine.root, tmp_path, "--odd", "--bucket", str(1 << 20))
        # The same chunk, sent anyway, is what vLLM's unpacker refuses.
        engine.packed = True
        update = {"names": ["a", "b"], "dtype_names": ["bfloat16", "float32"], "shapes": [[3], [2]]}
        handle = _cpu_handle(torch.zeros(14, dtype=torch.uint8))
        info = {**update, "ipc_handles": {FAKE_GPU_UUID: handle}, "tensor_sizes": [6, 8]}
        engine.session = True
        with pytest.raises(Exception, match="storage_offset"):
            engine._receive_ipc(vllm_ipc_json_safe(info))
    finally:
        engine.stop()
    assert got["error"] is not None and bad.name in got["error"] and "packed=False" in got["error"]
    assert engine.routes() == ["init_weight_transfer_engine", "pause", "resume"]


def _cpu_handle(t: torch.Tensor) -> tuple[Any, ...]:
    from torch.multiprocessing.reductions import reduce_tensor

    return tuple(reduce_tensor(t)[1])


class _IpcStub:
    """Stands in for vLLM's trainer engine and source where the test is about the
    sleep choreography around them (vLLM is not importable in this process)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.packed_buffer_size_bytes = fail, 0

    def use(self, update: WeightUpdate) -> None:
        pass

    def send_weights(self) -> None:
        if self.fail:
            raise RuntimeError("send died")

    def shutdown(self) -> None:
        pass


def test_vllm_ipc_colocated_refusals_are_clear_errors_and_a_failed_push_wakes(
    tmp_path: Path,
) -> None:
    engine = FakeVllm("ipc")
    engine.refuse["sleep"] = "Sleep mode is not enabled"
    sync = VllmIpcSync([engine.root], colocate=True)
    sync.engine = sync.source = _IpcStub(fail=True)
    log: list[str] = []
    run = _run(tmp_path, _Trainer({"w": torch.ones(3)}, log), sync)
    update = WeightUpdate(version=1, source=LiveWeights([("w", torch.ones(3))]))
    try:
        with pytest.raises(WeightSyncError, match=r"colocated engine .*/sleep .*--enable-sleep-mode"
                           r".*answered 500.*Sleep mode is not enabled"):  # fmt: skip
            run._before_train()
        assert log == ["gateway pause", "gateway resume"] and not sync.asleep
        del engine.refuse["sleep"]
        sync.before_train()
        with pytest.raises(RuntimeError, match="send died"):
            sync.push(update)
        assert engine.routes()[-3:] == ["sleep", "wake_up", "wake_up"]
        assert engine.asleep == [] and not sync.asleep  # the engine was woken anyway
        sync.before_train()
        engine.refuse["wake_up"] = "CUDA out of memory"
        with pytest.raises(WeightSyncError, match=r"/wake_up \{'tags': \['weights'\]\}.*out of"):
            sync.push(update)
    finally:
        sync.close()
        engine.stop()


def test_vllm_ipc_warns_at_setup_and_names_what_to_install(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """CUDA IPC on a GPU and vLLM's sleep mode have not run in these tests: a user
    starting a run is told so; without vLLM on the trainer, what to install."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is importable here: setup would need a GPU")
    sync = VllmIpcSync(["http://127.0.0.1:9"], colocate=True)
    with caplog.at_level("WARNING", logger="lightning.sync"):
        with pytest.raises(WeightSyncError, match=r"install vllm==0\.34\.0"):
            sync.setup()
    (record,) = caplog.records
    assert "experimental" in record.message and "CUDA IPC" in record.message
    assert "sleep mode" in record.message
    sync.close()


def test_colocate_with_vllm_needs_vllm_ipc() -> None:
    from pydantic import ValidationError

    from lightning.config import EngineSection

    ok = EngineSection(kind="external", urls=["http://x/v1"], weight_sync="vllm-ipc", colocate=True)
    assert ok.colocate
    with pytest.raises(ValidationError, match=r"or 'vllm-ipc' \(vLLM\) \(it is 'vllm-nccl'\)"):
        EngineSection(kind="external", urls=["http://x/v1"], weight_sync="vllm-nccl", colocate=True)
    with pytest.raises(ValueError, match="vllm-ipc"):
        make_weight_sync("vllm-nccl", ["http://x"], colocate=True)
