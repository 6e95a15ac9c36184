"""Weight-sync choreographies against fake vLLM / SGLang control planes (real HTTP on
loopback, real gloo transfers; see tests/fake_rl_engines.py for the sources)."""

from __future__ import annotations

import base64
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from fake_rl_engines import FakeSglang, FakeVllm
from lightning.run.weight_sync import (
    EmbeddedSync,
    SglangDiskSync,
    SglangDistributedSync,
    SglangTensorSync,
    TorchDistTransport,
    VllmNcclSync,
    VllmSync,
    WeightSyncError,
    WeightUpdate,
    make_weight_sync,
    vllm_nccl_init_info,
    vllm_nccl_update_info,
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
    real data plane is vLLM's PyNccl: lightning.run.weight_sync.VllmNcclTransport)."""

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
    class InMemory(WeightUpdate):
        def tensors(self) -> Any:
            return iter(tensors.items())

    return InMemory(version=1, path=Path("/nonexistent"))


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
            "update_weights_from_distributed",
            "continue_generation",
        ]
        assert e.log[1][1] == {"mode": "retract"}
        body = e.log[2][1]
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
    import io

    def serialize(named: list[tuple[str, torch.Tensor]]) -> bytes:
        buf = io.BytesIO()
        torch.save(dict(named), buf)
        return buf.getvalue()

    engine = FakeSglang()
    sync = SglangTensorSync([engine.root], serializer=serialize, tp_size=2)
    try:
        sync.push(update)
    finally:
        sync.close()
        engine.stop()
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
    with pytest.raises(ValueError, match="vllm-ipc"):
        make_weight_sync("vllm-ipc", ["http://x"])
    sync = make_weight_sync("vllm-nccl", ["http://x/v1"], world_sizes=[2])
    assert isinstance(sync, VllmNcclSync) and (sync.world, sync.offsets) == (3, {"http://x": 1})
    sync.close()


def test_config_names_the_replacement_of_vllm_disk() -> None:
    from pydantic import ValidationError

    from lightning.config import EngineSection

    with pytest.raises(ValidationError, match=r"vllm-disk' was removed.*use 'vllm-nccl'"):
        EngineSection(kind="external", urls=["http://x/v1"], weight_sync="vllm-disk")
