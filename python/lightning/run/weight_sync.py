"""Weight sync: how a new policy reaches the engines, through each engine's own API.

One interface, :class:`WeightSync` (``setup`` once, ``push`` after every optimizer
step, ``close``), with one implementation per engine API. The HTTP choreography
lives here; moving the tensors themselves (NCCL broadcast, CUDA IPC, a shared
disk) is a :class:`Transport`, so the choreography is the same whatever carries
the bytes and can be tested on a CPU.

Engine APIs, with the sources every endpoint and payload was checked against:

``embedded`` (lightning's own engine, ``lightning serve``)
    ``POST /admin/load_weights {"path", "version"}`` (``lightning/engine/server.py``).

``sglang-disk`` / ``sglang-distributed`` / ``sglang-tensor`` (SGLang HTTP server)
    Request models in ``python/sglang/srt/managers/io_struct.py`` (sgl-project/sglang,
    read 2026-12), routes of the same names in ``srt/entrypoints/http_server.py``;
    every answer is ``{"success": bool, "message": str}`` (HTTP 400 on failure).

    - ``POST /update_weights_from_disk`` ``UpdateWeightFromDiskReqInput{model_path,
      load_format, abort_all_requests, weight_version, flush_cache, ...}``.
    - ``POST /init_weights_update_group`` ``InitWeightsUpdateGroupReqInput
      {master_address, master_port, rank_offset, world_size, group_name, backend}``:
      a collective, it returns once the trainer has joined the group too.
    - ``POST /update_weights_from_distributed`` ``UpdateWeightsFromDistributedReqInput
      {names, dtypes, shapes, group_name, flush_cache, abort_all_requests,
      weight_version}``: the engine receives one broadcast from rank 0 per name, in
      order, while the request is open.
    - ``POST /update_weights_from_tensor`` ``UpdateWeightsFromTensorReqInput
      {serialized_named_tensors: [base64, one per TP rank], load_format, flush_cache,
      weight_version}`` (colocated engines: the bytes are SGLang's
      ``MultiprocessingSerializer`` output, CUDA IPC handles).
    - ``POST /pause_generation {"mode": "abort"|"retract"|"in_place"}`` and
      ``POST /continue_generation``.

    SGLang's tokenizer manager takes its model-update writer lock for every weight
    update, which waits for in-flight requests: calls in flight finish on the old
    weights without any pause. ``pause_mode`` adds ``pause_generation`` /
    ``continue_generation`` around the update for users who would rather abort
    (``abort``) or requeue (``retract``) long generations than wait for them.

``vllm-disk`` / ``vllm-nccl`` / ``vllm-ipc`` (vLLM's RL endpoints)
    ``vllm/entrypoints/rl/online/api_router.py`` (vllm-project/vllm, read 2026-12;
    the server needs ``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config
    '{"backend": "nccl"|"ipc"|"disk"}'``, docs: docs.vllm.ai/en/latest/training/
    weight_transfer/). The four-phase protocol:

    - once: ``POST /init_weight_transfer_engine {"init_info": {...}}`` (NCCL:
      ``NCCLWeightTransferInitInfo{master_address, master_port, rank_offset,
      world_size}``, a collective like SGLang's; disk: ``{}``);
    - per push: ``POST /pause?mode=wait`` (in-flight requests finish on the old
      weights), ``POST /start_weight_update``, ``POST /update_weights
      {"update_info": {...}}`` (NCCL: ``NCCLWeightTransferUpdateInfo{names,
      dtype_names, shapes, packed}``, received while the request is open; disk:
      ``DiskWeightTransferUpdateInfo{path}``, an absolute directory of
      safetensors), ``POST /finish_weight_update {"weight_version": "N"}``,
      ``POST /resume``.

Data-plane caveat: vLLM's NCCL receiver joins through its own
``StatelessProcessGroup`` + ``PyNcclCommunicator``, so the trainer side must be
vLLM's ``NCCLWeightTransferEngine.trainer_init`` / ``trainer_send_weights``
(:class:`VllmNcclTransport`, needs ``vllm`` importable on the trainer). SGLang's
receiver is a plain ``torch.distributed`` group, which :class:`TorchDistTransport`
joins (``nccl`` on GPUs, ``gloo`` on CPUs and in the tests).
"""

from __future__ import annotations

import base64
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx

from lightning._core import LightningError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("lightning.run.weight_sync")

SyncKind = Literal[
    "embedded",
    "sglang-disk",
    "sglang-distributed",
    "sglang-tensor",
    "vllm-disk",
    "vllm-nccl",
    "vllm-ipc",
    "none",
]
PauseMode = Literal["none", "abort", "retract"]
GROUP_NAME = "lightning_weight_sync"


class WeightSyncError(LightningError, RuntimeError):
    """An engine refused a weight update; the message names the engine and the step."""


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # a torch dtype attribute name: "bfloat16", "float32", ...
    shape: list[int]


@dataclass
class WeightUpdate:
    """One new policy. ``path`` is the exported HF directory (safetensors);
    ``tensors`` yields the same weights as ``(name, tensor)`` for transports that
    stream them (by default: read back from ``path``)."""

    version: int
    path: Path

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise WeightSyncError(f"{self.path} holds no .safetensors files to send")
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    def metas(self) -> list[TensorMeta]:
        return [
            TensorMeta(n, str(t.dtype).removeprefix("torch."), list(t.shape))
            for n, t in self.tensors()
        ]


# -- transports -------------------------------------------------------------------


class Transport(ABC):
    """Moves tensors from the trainer (rank 0 of a group) to the engines' workers."""

    @abstractmethod
    def init_info(self, rank_offset: int, world_size: int) -> dict[str, Any]:
        """What an engine is told at init (its first rank in the group, the group size)."""

    def open(self, world_size: int) -> None:  # noqa: B027 (optional hook)
        """Join the group as rank 0; runs while the engines' init requests are open."""

    @abstractmethod
    def update_info(self, update: WeightUpdate) -> dict[str, Any]:
        """What an engine is told for one update."""

    def send(self, update: WeightUpdate) -> None:  # noqa: B027 (optional hook)
        """Send the tensors; runs while the engines' update requests are open."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        pass


class DiskTransport(Transport):
    """The weights are already on a disk every engine can read: send the path."""

    def init_info(self, rank_offset: int, world_size: int) -> dict[str, Any]:
        return {}

    def update_info(self, update: WeightUpdate) -> dict[str, Any]:
        return {"path": str(update.path.resolve())}


class TorchDistTransport(Transport):
    """A ``torch.distributed`` process group of its own (not the default group, so
    it lives beside torchrun's), rendezvous through a TCP store at
    ``master_address:master_port``, store keys prefixed with the group name as
    ``init_process_group`` does. One broadcast from rank 0 per tensor, in order:
    what SGLang's ``update_weights_from_distributed`` receives."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        *,
        backend: Literal["nccl", "gloo"] = "nccl",
        group_name: str = GROUP_NAME,
        timeout_s: float = 600.0,
    ) -> None:
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend
        self.group_name = group_name
        self.timeout_s = timeout_s
        self.group: Any = None

    def init_info(self, rank_offset: int, world_size: int) -> dict[str, Any]:
        return {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": self.group_name,
            "backend": self.backend,
        }

    def open(self, world_size: int) -> None:
        self.group = join_group(
            self.master_address,
            self.master_port,
            rank=0,
            world_size=world_size,
            backend=self.backend,
            group_name=self.group_name,
            timeout_s=self.timeout_s,
        )

    def update_info(self, update: WeightUpdate) -> dict[str, Any]:
        metas = update.metas()
        return {
            "names": [m.name for m in metas],
            "dtypes": [m.dtype for m in metas],
            "shapes": [m.shape for m in metas],
            "group_name": self.group_name,
        }

    def send(self, update: WeightUpdate) -> None:
        if self.group is None:
            raise WeightSyncError("TorchDistTransport.send before open(): call setup() first")
        device = "cuda" if self.backend == "nccl" else "cpu"
        for _, tensor in update.tensors():
            self.group.broadcast(tensor.to(device).contiguous(), 0).wait()

    def close(self) -> None:
        self.group = None


def join_group(
    master_address: str,
    master_port: int,
    *,
    rank: int,
    world_size: int,
    backend: str,
    group_name: str,
    timeout_s: float = 600.0,
) -> Any:
    """A standalone process group (TCP store + backend), as both sides build it."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=rank == 0,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    prefixed = dist.PrefixStore(f"{group_name}/", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timedelta(seconds=timeout_s))
    return dist.ProcessGroupNCCL(prefixed, rank, world_size)


def vllm_nccl_init_info(
    master_address: str, master_port: int, rank_offset: int, world_size: int
) -> dict[str, Any]:
    """vLLM's ``NCCLWeightTransferInitInfo`` (``weight_transfer/nccl_engine.py``)."""
    return {
        "master_address": master_address,
        "master_port": master_port,
        "rank_offset": rank_offset,
        "world_size": world_size,
    }


def vllm_nccl_update_info(metas: Sequence[TensorMeta], *, packed: bool) -> dict[str, Any]:
    """vLLM's ``NCCLWeightTransferUpdateInfo`` (``weight_transfer/nccl_engine.py``)."""
    return {
        "names": [m.name for m in metas],
        "dtype_names": [m.dtype for m in metas],
        "shapes": [m.shape for m in metas],
        "packed": packed,
    }


class VllmNcclTransport(Transport):
    """vLLM's own trainer side of its NCCL backend (``NCCLWeightTransferEngine``)."""

    def __init__(self, master_address: str, master_port: int, *, packed: bool = True) -> None:
        self.master_address = master_address
        self.master_port = master_port
        self.packed = packed
        self.group: Any = None

    def init_info(self, rank_offset: int, world_size: int) -> dict[str, Any]:
        return vllm_nccl_init_info(self.master_address, self.master_port, rank_offset, world_size)

    def open(self, world_size: int) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        self.group = NCCLWeightTransferEngine.trainer_init(
            {
                "master_address": self.master_address,
                "master_port": self.master_port,
                "world_size": world_size,
            }
        )

    def update_info(self, update: WeightUpdate) -> dict[str, Any]:
        return vllm_nccl_update_info(update.metas(), packed=self.packed)

    def send(self, update: WeightUpdate) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        tensors = ((n, t.cuda()) for n, t in update.tensors())
        NCCLWeightTransferEngine.trainer_send_weights(
            tensors, {"group": self.group, "packed": self.packed}
        )


class PlainTransport(Transport):
    """For engines whose update info is built by a user-supplied function (vLLM's
    IPC backend: CUDA IPC handles of tensors that live on the engine's GPU)."""

    def __init__(self, update_info: Callable[[WeightUpdate], dict[str, Any]]) -> None:
        self._update_info = update_info

    def init_info(self, rank_offset: int, world_size: int) -> dict[str, Any]:
        return {}

    def update_info(self, update: WeightUpdate) -> dict[str, Any]:
        return self._update_info(update)


# -- the interface -----------------------------------------------------------------


class WeightSync(ABC):
    """Pushes each new policy to every engine. ``roots`` are the engines' server
    roots (``http://host:port``, no ``/v1``)."""

    def __init__(self, roots: Sequence[str], *, timeout_s: float = 600.0) -> None:
        self.roots = [_root(u) for u in roots]
        self.http = httpx.Client(timeout=timeout_s)
        self._pool = ThreadPoolExecutor(max_workers=max(2, len(self.roots) + 1))

    def setup(self) -> None:  # noqa: B027 (optional hook)
        """Once, before the first push (opens transfer groups)."""

    @abstractmethod
    def push(self, update: WeightUpdate) -> None: ...

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.http.close()

    # -- helpers --------------------------------------------------------------

    def _post(
        self, root: str, route: str, body: Any = None, params: dict[str, Any] | None = None
    ) -> Any:
        try:
            r = self.http.post(root + route, json=body, params=params)
        except httpx.HTTPError as e:
            raise WeightSyncError(f"{root}{route}: {type(e).__name__}: {e}") from e
        if r.status_code != 200:
            raise WeightSyncError(f"{root}{route} answered {r.status_code}: {r.text[:500]}")
        try:
            return r.json()
        except ValueError:
            return None

    def _all(self, fn: Callable[[str], Any]) -> list[Any]:
        """Run ``fn`` on every engine at once (collective steps need all of them)."""
        futures = [self._pool.submit(fn, root) for root in self.roots]
        return [f.result() for f in futures]

    def _group_ranks(self, world_sizes: Sequence[int] | None) -> tuple[int, dict[str, int]]:
        """The transfer group's size and each engine's first rank: the trainer is
        rank 0, then every engine's workers (``world_sizes``: TP × PP × DP each)."""
        sizes = list(world_sizes or [1] * len(self.roots))
        if len(sizes) != len(self.roots):
            raise ValueError(f"world_sizes has {len(sizes)} entries for {len(self.roots)} engines")
        offsets = {root: 1 + sum(sizes[:i]) for i, root in enumerate(self.roots)}
        return 1 + sum(sizes), offsets

    def _beside(self, requests: Callable[[], Any], transfer: Callable[[], None]) -> None:
        """Engine requests and the trainer's side of a collective, concurrently: each
        blocks until the other has joined."""
        pending: Future[Any] = self._pool.submit(requests)
        # If the transfer fails, the engines wait for a peer that is gone and their
        # requests fail on the engines' own timeout; the transfer error is raised.
        transfer()
        pending.result()


def _root(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1")


def _check_sglang(root: str, route: str, answer: Any) -> None:
    if not isinstance(answer, dict) or not answer.get("success", False):
        raise WeightSyncError(f"{root}{route} failed: {answer!r}")


class EmbeddedSync(WeightSync):
    def push(self, update: WeightUpdate) -> None:
        body = {"path": str(update.path.resolve()), "version": update.version}
        self._all(lambda root: self._post(root, "/admin/load_weights", body))


class _SglangBase(WeightSync):
    def __init__(
        self, roots: Sequence[str], *, pause_mode: PauseMode = "none", timeout_s: float = 600.0
    ) -> None:
        super().__init__(roots, timeout_s=timeout_s)
        self.pause_mode = pause_mode

    def push(self, update: WeightUpdate) -> None:
        if self.pause_mode != "none":
            self._all(lambda r: self._post(r, "/pause_generation", {"mode": self.pause_mode}))
        try:
            self._update(update)
        finally:
            if self.pause_mode != "none":
                self._all(lambda r: self._post(r, "/continue_generation", {}))

    @abstractmethod
    def _update(self, update: WeightUpdate) -> None: ...


class SglangDiskSync(_SglangBase):
    def _update(self, update: WeightUpdate) -> None:
        body = {
            "model_path": str(update.path.resolve()),
            "weight_version": str(update.version),
            "abort_all_requests": False,
            "flush_cache": True,
        }

        def one(root: str) -> None:
            _check_sglang(
                root,
                "/update_weights_from_disk",
                self._post(root, "/update_weights_from_disk", body),
            )

        self._all(one)


class SglangDistributedSync(_SglangBase):
    """``world_sizes``: each engine's number of workers (TP × PP × DP ranks)."""

    def __init__(
        self,
        roots: Sequence[str],
        transport: TorchDistTransport,
        *,
        world_sizes: Sequence[int] | None = None,
        pause_mode: PauseMode = "none",
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__(roots, pause_mode=pause_mode, timeout_s=timeout_s)
        self.transport = transport
        self.world, self.offsets = self._group_ranks(world_sizes)

    def setup(self) -> None:
        world, offsets = self.world, self.offsets

        def init(root: str) -> None:
            body = self.transport.init_info(offsets[root], world)
            _check_sglang(
                root,
                "/init_weights_update_group",
                self._post(root, "/init_weights_update_group", body),
            )

        self._beside(lambda: self._all(init), lambda: self.transport.open(world))

    def _update(self, update: WeightUpdate) -> None:
        body = {
            **self.transport.update_info(update),
            "flush_cache": True,
            "abort_all_requests": False,
            "weight_version": str(update.version),
        }

        def one(root: str) -> None:
            route = "/update_weights_from_distributed"
            _check_sglang(root, route, self._post(root, route, body))

        self._beside(lambda: self._all(one), lambda: self.transport.send(update))

    def close(self) -> None:
        self.transport.close()
        super().close()


Serializer = Callable[[list[tuple[str, "torch.Tensor"]]], bytes]


def sglang_serializer(named: list[tuple[str, torch.Tensor]]) -> bytes:
    """SGLang's own serializer (CUDA IPC handles: engine and trainer share GPUs)."""
    from sglang.srt.utils import MultiprocessingSerializer

    return bytes(MultiprocessingSerializer.serialize(named))


class SglangTensorSync(_SglangBase):
    """``tp_size``: the engine's tensor-parallel ranks (one payload each)."""

    def __init__(
        self,
        roots: Sequence[str],
        *,
        serializer: Serializer = sglang_serializer,
        tp_size: int = 1,
        load_format: str | None = None,
        pause_mode: PauseMode = "none",
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__(roots, pause_mode=pause_mode, timeout_s=timeout_s)
        self.serializer = serializer
        self.tp_size = tp_size
        self.load_format = load_format

    def _update(self, update: WeightUpdate) -> None:
        payload = base64.b64encode(self.serializer(list(update.tensors()))).decode("ascii")
        body = {
            "serialized_named_tensors": [payload] * self.tp_size,
            "load_format": self.load_format,
            "flush_cache": True,
            "abort_all_requests": False,
            "weight_version": str(update.version),
        }

        def one(root: str) -> None:
            route = "/update_weights_from_tensor"
            _check_sglang(root, route, self._post(root, route, body))

        self._all(one)


class VllmSync(WeightSync):
    """vLLM's four-phase weight transfer; ``world_sizes`` as for SGLang."""

    def __init__(
        self,
        roots: Sequence[str],
        transport: Transport,
        *,
        world_sizes: Sequence[int] | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__(roots, timeout_s=timeout_s)
        self.transport = transport
        self.world, self.offsets = self._group_ranks(world_sizes)

    def setup(self) -> None:
        world, offsets = self.world, self.offsets

        def init(root: str) -> None:
            body = {"init_info": self.transport.init_info(offsets[root], world)}
            self._post(root, "/init_weight_transfer_engine", body)

        self._beside(lambda: self._all(init), lambda: self.transport.open(world))

    def push(self, update: WeightUpdate) -> None:
        # mode=wait: requests in flight finish on the old weights (vLLM's default,
        # abort, would cut them off; keep would resume them on the new weights,
        # mixing two policies inside one call).
        self._all(lambda r: self._post(r, "/pause", params={"mode": "wait"}))
        try:
            self._all(lambda r: self._post(r, "/start_weight_update"))
            body = {"update_info": self.transport.update_info(update)}
            self._beside(
                lambda: self._all(lambda r: self._post(r, "/update_weights", body)),
                lambda: self.transport.send(update),
            )
            version = {"weight_version": str(update.version)}
            self._all(lambda r: self._post(r, "/finish_weight_update", version))
        finally:
            self._all(lambda r: self._post(r, "/resume"))

    def close(self) -> None:
        self.transport.close()
        super().close()


class NoSync(WeightSync):
    """Engines that are not updated (evaluation-only runs, LoRA served elsewhere)."""

    def push(self, update: WeightUpdate) -> None:
        log.info("weight sync disabled: engines keep their weights (version %d)", update.version)


def make_weight_sync(
    kind: SyncKind,
    urls: Iterable[str],
    *,
    master_address: str = "127.0.0.1",
    master_port: int = 0,
    world_sizes: Sequence[int] | None = None,
    pause_mode: PauseMode = "none",
    backend: Literal["nccl", "gloo"] = "nccl",
) -> WeightSync:
    """The sync for ``[engine] weight_sync = kind`` (see the module docstring)."""
    roots = list(urls)
    if kind == "embedded":
        return EmbeddedSync(roots)
    if kind == "sglang-disk":
        return SglangDiskSync(roots, pause_mode=pause_mode)
    if kind == "sglang-tensor":
        return SglangTensorSync(roots, pause_mode=pause_mode)
    if kind == "sglang-distributed":
        port = master_port or _free_port(master_address)
        transport = TorchDistTransport(master_address, port, backend=backend)
        return SglangDistributedSync(
            roots, transport, world_sizes=world_sizes, pause_mode=pause_mode
        )
    if kind == "vllm-disk":
        return VllmSync(roots, DiskTransport(), world_sizes=world_sizes)
    if kind == "vllm-nccl":
        port = master_port or _free_port(master_address)
        return VllmSync(roots, VllmNcclTransport(master_address, port), world_sizes=world_sizes)
    if kind == "vllm-ipc":
        raise ValueError(
            "weight_sync = 'vllm-ipc' needs a trainer colocated on the engine's GPU; build "
            "VllmSync(urls, PlainTransport(update_info_fn)) in code with vLLM's IPC helpers"
        )
    if kind == "none":
        return NoSync(roots)
    raise ValueError(f"unknown weight_sync {kind!r}")


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
