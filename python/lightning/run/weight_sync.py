"""Weight sync: how a new policy reaches the engines, through each engine's own API.

One interface, :class:`WeightSync` (``setup`` once, ``push`` after every optimizer
step, ``close``), with one implementation per engine API. The HTTP choreography
lives here; moving the tensors themselves (NCCL broadcast, CUDA IPC, a shared
disk) is a :class:`Transport`, so the choreography is the same whatever carries
the bytes and can be tested on a CPU.

What a push carries, :class:`WeightUpdate`, is a directory or a stream. The disk
paths (``embedded``, ``sglang-disk``) get an exported safetensors directory. The
streaming paths (``sglang-distributed``, ``sglang-tensor``, ``vllm-nccl``, ``vllm-ipc``;
``WeightSync.streams``) get :class:`LiveWeights` (``lightning.rl.live_weights``): the trainer's live parameters, each FSDP2 shard gathered
(``full_tensor()``) only when its turn comes, grouped into buckets of
``bucket_bytes`` (:func:`plan_buckets`, from shapes alone) that map to the engine's
own unit of transfer: one SGLang ``update_weights_from_distributed`` call with
``load_format = "flattened_bucket"`` (one broadcast per bucket), one SGLang
``update_weights_from_tensor`` call (one flattened tensor per bucket), one vLLM
packed buffer (one ``/update_weights`` per fill for ``vllm-ipc``). Nothing is written to disk and the sender holds at most a bucket plus the
tensor being gathered (``LiveWeights.stats``; tests/test_weight_sync.py checks it on
2 FSDP2 ranks; benches/weight_sync.py measures it against the disk path).

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
      weight_version, load_format, selector}``: the engine receives one broadcast
      from rank 0 per name, in order, while the request is open; with
      ``load_format = "flattened_bucket"`` one broadcast of all of them, laid end to
      end as bytes (``srt/weight_sync/tensor_bucket.py`` ``FlattenedTensorBucket``).
    - ``POST /begin_weight_update {"selector"}`` / ``POST /end_weight_update {}``:
      sglang 0.5.23's scheduler (``managers/scheduler_components/weight_updater.py``)
      refuses ``update_weights_from_distributed`` and ``update_weights_from_tensor``
      outside such a session, so every push of those two opens one.
    - ``POST /update_weights_from_tensor`` ``UpdateWeightsFromTensorReqInput
      {serialized_named_tensors: [base64, one per TP rank], load_format, flush_cache,
      abort_all_requests, weight_version, selector, torch_empty_cache}`` (colocated
      engines: each rank deserializes its own entry with ``MultiprocessingSerializer``
      — a ``ForkingPickler`` dump, CUDA IPC handles on a GPU; with ``load_format =
      "flattened_bucket"`` the entry is ``{"flattened_tensor", "metadata"}``, read by
      the model runner's ``_update_weights_from_flattened_bucket``).
    - ``POST /release_memory_occupation`` / ``/resume_memory_occupation``
      ``{"tags": [...]}`` of ``kv_cache``, ``weights``, ``cuda_graph``
      (``srt/constants.py``; the scheduler's weight updater asserts the engine is
      idle to release, and fails to resume a tag it had not released); the answer
      is ``null`` (HTTP 200) or ``{"error": {"message"}}`` (400): ``colocate``.
    - ``POST /pause_generation {"mode": "abort"|"retract"|"in_place"}`` and
      ``POST /continue_generation``.

    SGLang's tokenizer manager takes its model-update writer lock for every weight
    update, which waits for in-flight requests: calls in flight finish on the old
    weights without any pause. ``pause_mode`` adds ``pause_generation`` /
    ``continue_generation`` around the update for users who would rather abort
    (``abort``) or requeue (``retract``) long generations than wait for them.

``vllm-nccl`` / ``vllm-ipc`` (vLLM's RL endpoints)
    ``vllm/entrypoints/rl/online/api_router.py`` and ``vllm/distributed/
    weight_transfer/`` of vllm 0.34.0 (the newest on PyPI, 2026-12-05; the server
    needs ``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config '{"backend":
    "nccl"}'``; released backends: nccl, ipc, sparse_nccl, sharded_rdt, nccl_m2n —
    no disk backend, so ``vllm-disk`` is gone). Per push: ``POST /pause?mode=wait``
    (in-flight requests finish on the old weights), then vLLM's own trainer engine
    ``NCCLTrainerWeightTransferEngine.send_weights()`` drives ``/start_weight_update``,
    ``/update_weights {"update_info": NCCLWeightTransferUpdateInfo{names,
    dtype_names, shapes[, src]}}`` (parsed strictly: no other field) while it
    broadcasts, and ``/finish_weight_update {"weight_version"}`` through our
    :class:`_VllmClients`; then ``POST /resume``. ``packed`` and the buffer sizes are
    init-time fields (``NCCLTrainerInitInfo`` → the workers' init info), sent once
    by ``trainer_init`` with ``/init_weight_transfer_engine``.

    ``vllm-ipc`` (``--weight-transfer-config '{"backend": "ipc"}'``, and
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``; ``weight_transfer/ipc_engine.py``):
    vLLM's ``IPCTrainerWeightTransferEngine`` sends ``/init_weight_transfer_engine
    {"init_info": IPCWeightTransferInitInfo{packed}}`` once, then per push the same
    phases, packed: one ``/update_weights {"update_info": IPCWeightTransferUpdateInfo
    {names, dtype_names, shapes, ipc_handles_pickled, tensor_sizes}}`` per fill of its
    one IPC-shared buffer (``packed_tensor.py`` ``packed_ipc_producer``), the handle
    keyed by GPU UUID and pickled by :func:`vllm_ipc_json_safe`. Colocated, sleep mode
    (``--enable-sleep-mode``; ``entrypoints/serve/dev/sleep/api_router.py``):
    ``POST /sleep?level=2&mode=wait`` before the step, ``POST /wake_up?tags=weights``
    before the transfer and ``?tags=kv_cache`` after it (answers ``{"status":
    "awake"|"sleeping", "tags"}``); see :class:`VllmIpcSync`.

Verified: SGLang's group join (the trainer side joins a group built by SGLang
0.5.23's own ``init_custom_process_group`` in tests/test_weight_sync.py), and its
flattened-bucket receive (SGLang's own ``FlattenedTensorBucket`` allocates and
unpacks what the trainer sends, bitwise); ``sglang-tensor`` payloads (SGLang's
own ``MultiprocessingSerializer.deserialize`` and ``FlattenedTensorBucket`` open
every TP rank's payload of every bucket, bitwise, on CPU tensors). Not verified
on a CPU: CUDA IPC handles and SGLang's memory saver (``colocate`` is checked
against a fake of its routes; ``sglang-tensor`` logs :data:`SGLANG_TENSOR_UNVERIFIED`
at setup). ``vllm-nccl``: vLLM 0.34.0's own ``NCCLTrainerWeightTransferEngine``
(``trainer_init``'s checks and worker init payload, ``send_weights``, the update
infos it builds, its packed producer) ran on CPU tensors to two fake engines whose
bodies went to vLLM's own worker-side ``parse_init_info``/``init_transfer_engine``
(each engine's rank offset, the wire params) and ``parse_update_info``, and vLLM's
``receive_weights`` (packed: ``packed_nccl_broadcast_consumer``) unpacked what the
trainer broadcast, bitwise (tests/vllm_nccl_trainer.py, engine_side.py); the data
plane was a stand-in there: PyNccl (the group join over vLLM's
``StatelessProcessGroup``, the broadcast, CUDA streams) has not run, and it logs
:data:`VLLM_NCCL_UNVERIFIED` at setup. ``vllm-ipc``: vLLM 0.34.0's own
``IPCTrainerWeightTransferEngine``, ``IPCWeightTransferUpdateInfo`` parser and
``unpack_tensor`` ran on CPU tensors (tests/vllm_ipc_trainer.py answers the engine's
few device queries), bitwise; CUDA IPC handles and vLLM's sleep mode (checked
against a fake of its routes) have not run, and it logs :data:`VLLM_IPC_UNVERIFIED`
at setup.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx

from lightning.config import COLOCATE_NEEDS_IPC, COLOCATE_SYNCS, VLLM_DISK_GONE
from lightning.rl.live_weights import (
    DEFAULT_BUCKET_BYTES,
    GatherStats,
    LiveWeights,
    TensorMeta,
    WeightSyncError,
    _itemsize,
    meta_of,
    plan_buckets,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger("lightning.run.weight_sync")

SyncKind = Literal[
    "embedded",
    "sglang-disk",
    "sglang-distributed",
    "sglang-tensor",
    "vllm-nccl",
    "vllm-ipc",
    "none",
]
PauseMode = Literal["none", "abort", "retract"]
GROUP_NAME = "lightning_weight_sync"


@dataclass
class WeightUpdate:
    """One new policy, as a directory or as a stream.

    ``path``: an exported HF directory (safetensors), what the disk-based syncs
    (``embedded``, ``sglang-disk``) hand to the engine. ``source``: the live model
    (:class:`LiveWeights`), what the streaming syncs (``sglang-distributed``,
    ``sglang-tensor``, ``vllm-nccl``, ``vllm-ipc``) send from, bucket by bucket, with nothing written to disk.
    :meth:`tensors` and :meth:`metas` read whichever is set (the source first)."""

    version: int
    path: Path | None = None
    source: LiveWeights | None = None

    def __post_init__(self) -> None:
        if self.path is None and self.source is None:
            raise ValueError("WeightUpdate needs a path (exported weights) or a source")

    def disk_path(self, who: str) -> Path:
        if self.path is None:
            raise WeightSyncError(
                f"{who} loads weights from a directory, but update v{self.version} streams "
                "from the live model: export_weights first and pass path="
            )
        return self.path

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.source is not None:
            return self.source.tensors()
        return self._read()

    def _read(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        path = self.disk_path("reading tensors")
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightSyncError(f"{path} holds no .safetensors files to send")
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    def metas(self) -> list[TensorMeta]:
        if self.source is not None:
            return self.source.metas()
        return [meta_of(n, t) for n, t in self._read()]

    @property
    def stats(self) -> GatherStats | None:
        return self.source.stats if self.source is not None else None


# -- transports -------------------------------------------------------------------


class Transport(ABC):
    """Moves tensors from the trainer (rank 0 of a group) to the engines' workers."""

    # Whether it sends from WeightUpdate.tensors() (a live source serves it without
    # disk) rather than handing the engine a path or a handle.
    streams = False

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


class TorchDistTransport(Transport):
    """A ``torch.distributed`` process group of its own (not the default group, so
    it lives beside torchrun's), rendezvous through a TCP store at
    ``master_address:master_port``, store keys prefixed with the group name as
    ``init_process_group`` does. Rank 0 broadcasts one tensor at a time
    (:meth:`send_tensors`) or one flattened bucket at a time (:meth:`send_flat`),
    the two ways SGLang's ``update_weights_from_distributed`` receives."""

    streams = True

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

    def _device(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"

    def send(self, update: WeightUpdate) -> None:
        self.send_tensors(update.tensors(), update.stats)

    def send_tensors(
        self, tensors: Iterable[tuple[str, torch.Tensor]], stats: GatherStats | None = None
    ) -> None:
        """One broadcast per tensor, in order: what SGLang's
        ``update_weights_from_distributed`` receives without a ``load_format``."""
        group = self._group()
        import torch.distributed as dist

        for _, tensor in tensors:
            send = tensor.to(self._device()).contiguous()
            dist.broadcast(send, src=0, group=group)
            if stats is not None:
                stats.sent_bytes += send.numel() * send.element_size()
            del send, tensor  # before the next gather

    def send_flat(
        self,
        metas: Sequence[TensorMeta],
        tensors: Iterable[tuple[str, torch.Tensor]],
        stats: GatherStats | None = None,
    ) -> None:
        """One broadcast of the bucket's tensors laid end to end as bytes, each
        copied in as it is gathered and dropped: the sender holds the bucket buffer
        and one tensor, never the bucket twice. The layout is SGLang's
        ``FlattenedTensorBucket`` (``load_format = "flattened_bucket"``): row-major
        bytes of each tensor in ``metas`` order, no padding."""
        import torch.distributed as dist

        group = self._group()
        flat = flatten_bucket(metas, tensors, self._device(), stats)
        dist.broadcast(flat, src=0, group=group)
        if stats is not None:
            stats.sent_bytes += flat.numel()

    def _group(self) -> Any:
        if self.group is None:
            raise WeightSyncError("TorchDistTransport.send before open(): call setup() first")
        return self.group

    def close(self) -> None:
        if self.group is not None:
            leave_group(self.group)
        self.group = None


def flatten_bucket(
    metas: Sequence[TensorMeta],
    tensors: Iterable[tuple[str, torch.Tensor]],
    device: str,
    stats: GatherStats | None = None,
) -> torch.Tensor:
    """The bucket's tensors laid end to end as bytes on ``device`` (uint8, 1-D), each
    copied in as it is gathered and dropped: the sender holds the bucket buffer and
    one tensor, never the bucket twice. The layout is SGLang's
    ``FlattenedTensorBucket`` (``load_format = "flattened_bucket"``): row-major bytes
    of each tensor in ``metas`` order, no padding."""
    import torch

    total = sum(m.nbytes for m in metas)
    if len(metas) == 1:  # its own bytes are the layout: no copy
        _, tensor = next(iter(tensors))
        return tensor.to(device).contiguous().reshape(-1).view(torch.uint8)
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    if stats is not None:
        stats.track(flat)
    offset = 0
    it = iter(tensors)
    for m in metas:
        # Not zip(): it keeps the previous pair alive while the next is gathered.
        _, tensor = next(it)
        n = m.nbytes
        flat[offset : offset + n].copy_(tensor.contiguous().reshape(-1).view(torch.uint8))
        offset += n
        del tensor
    return flat


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
    """A standalone process group, built the way SGLang's engine side builds it.

    SGLang's ``WeightUpdater.init_weights_update_group`` (sglang 0.5.23,
    ``srt/model_executor/model_runner_components/weight_updater.py``) joins with
    ``sglang.srt.utils.init_custom_process_group(backend, init_method=
    "tcp://{master_address}:{master_port}", world_size, rank=rank_offset + tp_rank,
    group_name)`` (the helper verl and OpenRLHF use on both sides). That helper takes
    torch's own ``tcp://`` rendezvous (a TCP store hosted by rank 0), wraps it in
    ``PrefixStore(group_name)`` and hands it to torch's process-group factory, which
    prefixes its keys with ``"{group_name}/"`` again. The store keys of both sides
    must agree to the byte, so the trainer goes through the same three torch steps
    rather than building a backend by hand (tests/test_weight_sync.py runs SGLang's
    function on the other side). ``group_name`` must be non-empty (SGLang asserts it)
    and unique in this process; :func:`leave_group` frees it.
    """
    from datetime import timedelta

    import torch
    import torch.distributed.distributed_c10d as c10d

    if not group_name:
        raise ValueError("group_name is empty: SGLang refuses an unnamed weight-update group")
    timeout = timedelta(seconds=timeout_s)
    url = f"tcp://{master_address}:{master_port}"
    store, rank, world_size = next(c10d.rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    # torch 2.6 renamed the options argument of the factory (pg_options -> backend_options).
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    options = "backend_options" if (major, minor) >= (2, 6) else "pg_options"
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        c10d.PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
        **{options: None},
    )
    # Group ranks are global ranks: lets torch.distributed.broadcast(group=...) work.
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def leave_group(group: Any) -> None:
    """Destroy a group made by :func:`join_group` (its name can be joined again)."""
    import torch.distributed as dist

    dist.destroy_process_group(group)


def vllm_nccl_init_info(
    master_address: str, master_port: int, rank_offset: int, world_size: int, *, packed: bool
) -> dict[str, Any]:
    """vLLM's worker-side ``NCCLWeightTransferInitInfo`` (vllm 0.34.0,
    ``weight_transfer/nccl_common.py``): the packed wire params live here."""
    return {
        "master_address": master_address,
        "master_port": master_port,
        "rank_offset": rank_offset,
        "world_size": world_size,
        "packed": packed,
    }


def vllm_nccl_update_info(metas: Sequence[TensorMeta]) -> dict[str, Any]:
    """vLLM's ``NCCLWeightTransferUpdateInfo`` (vllm 0.34.0, ``nccl_engine.py``),
    parsed as ``NCCLWeightTransferUpdateInfo(**update_info)``: no other field."""
    return {
        "names": [m.name for m in metas],
        "dtype_names": [m.dtype for m in metas],
        "shapes": [m.shape for m in metas],
    }


class PlainTransport(Transport):
    """For engines whose update info is built by a user-supplied function, with no
    data plane of ours (``weight_sync = "vllm-ipc"`` is :class:`VllmIpcSync`)."""

    def __init__(self, update_info: Callable[[WeightUpdate], dict[str, Any]]) -> None:
        self._update_info = update_info

    def init_info(self, rank_offset: int, world_size: int) -> dict[str, Any]:
        return {}

    def update_info(self, update: WeightUpdate) -> dict[str, Any]:
        return self._update_info(update)


# -- the interface -----------------------------------------------------------------


class WeightSync(ABC):
    """Pushes each new policy to every engine. ``roots`` are the engines' server
    roots (``http://host:port``, no ``/v1``).

    ``streams``: the sync sends tensors over a process group, so the caller passes
    ``WeightUpdate(source=LiveWeights...)`` and writes nothing to disk; otherwise it
    passes an exported directory (``path``).

    ``colocated``: the engines share the trainer's GPUs and give their memory back
    for the optimizer step: the loop drains the gateway and calls
    :meth:`before_train` before each step; the next :meth:`push` takes the memory
    back."""

    streams = False
    colocated = False

    def __init__(self, roots: Sequence[str], *, timeout_s: float = 600.0) -> None:
        self.roots = [_root(u) for u in roots]
        self.http = httpx.Client(timeout=timeout_s)
        self._pool = ThreadPoolExecutor(max_workers=max(2, len(self.roots) + 1))

    def setup(self) -> None:  # noqa: B027 (optional hook)
        """Once, before the first push (opens transfer groups)."""

    def before_train(self) -> None:  # noqa: B027 (optional hook)
        """Before each optimizer step, with the engines idle (colocated syncs)."""

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
        path = update.disk_path("weight_sync = 'embedded'")
        body = {"path": str(path.resolve()), "version": update.version}
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
            "model_path": str(update.disk_path("weight_sync = 'sglang-disk'").resolve()),
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
    """``world_sizes``: each engine's number of workers (TP × PP × DP ranks).

    A push is one weight-update session (``/begin_weight_update`` …
    ``/end_weight_update``, which sglang 0.5.23 requires around
    ``update_weights_from_distributed``) holding one ``update_weights_from_distributed``
    call per bucket of at most ``bucket_bytes`` (:func:`plan_buckets`). With
    ``flatten`` (default) each call is ``load_format = "flattened_bucket"``: one
    broadcast of the bucket's bytes, which the sender fills as it gathers
    (:meth:`TorchDistTransport.send_flat`); without it, one broadcast per tensor.
    Only the last call carries ``weight_version`` and flushes the cache, so the
    engine reports the new version once every bucket has landed.

    Between two calls SGLang may schedule requests on partly updated weights: the
    loop drains the gateway before a synchronous push, so only asynchronous runs
    (``max_staleness > 0``) with ``pause_mode = "none"`` and more than one bucket
    are exposed; use ``pause_mode = "retract"`` (or one bucket) there."""

    streams = True

    def __init__(
        self,
        roots: Sequence[str],
        transport: TorchDistTransport,
        *,
        world_sizes: Sequence[int] | None = None,
        pause_mode: PauseMode = "none",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        flatten: bool = True,
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__(roots, pause_mode=pause_mode, timeout_s=timeout_s)
        self.transport = transport
        self.world, self.offsets = self._group_ranks(world_sizes)
        self.bucket_bytes = bucket_bytes
        self.flatten = flatten

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
        plan = plan_buckets(update.metas(), self.bucket_bytes, aligned=self.flatten)
        tensors = update.tensors()
        with _sglang_session(self):
            for i, metas in enumerate(plan):
                last = i == len(plan) - 1
                body = {
                    "names": [m.name for m in metas],
                    "dtypes": [m.dtype for m in metas],
                    "shapes": [m.shape for m in metas],
                    "group_name": self.transport.group_name,
                    "load_format": "flattened_bucket" if self.flatten else None,
                    "flush_cache": last,
                    "abort_all_requests": False,
                    "weight_version": str(update.version) if last else None,
                }
                self._beside(
                    functools.partial(self._all, functools.partial(self._call_update, body=body)),
                    functools.partial(self._send_bucket, metas, tensors, update.stats),
                )
            extra = next(tensors, None)  # also frees the source's last tensor
            if extra is not None:
                raise WeightSyncError(f"{extra[0]!r} was sent but not announced (metas())")

    def _send_bucket(
        self,
        metas: list[TensorMeta],
        tensors: Iterator[tuple[str, torch.Tensor]],
        stats: GatherStats | None,
    ) -> None:
        bucket = _checked(metas, tensors)
        if self.flatten:
            self.transport.send_flat(metas, bucket, stats)
        else:
            self.transport.send_tensors(bucket, stats)

    def _call_update(self, root: str, body: dict[str, Any]) -> None:
        route = "/update_weights_from_distributed"
        _check_sglang(root, route, self._post(root, route, body))

    def close(self) -> None:
        self.transport.close()
        super().close()


def _checked(
    metas: Sequence[TensorMeta], tensors: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The next ``len(metas)`` tensors, each checked against what the engines were
    told: a mismatch would leave them waiting for bytes that never come."""
    for m in metas:
        got = next(tensors, None)
        if got is None:
            raise WeightSyncError(f"weights ended before {m.name!r} (announced to the engines)")
        name, t = got
        if meta_of(name, t) != m:
            raise WeightSyncError(
                f"announced {m}, about to send {meta_of(name, t)}: shapes come from metas() "
                "and must match the tensors in order"
            )
        yield name, t
        del got, t


@contextlib.contextmanager
def _sglang_session(sync: WeightSync) -> Iterator[None]:
    """sglang 0.5.23's weight-update session (``BeginWeightUpdateReqInput
    {selector}``, ``EndWeightUpdateReqInput {}``): its scheduler refuses
    ``update_weights_from_distributed`` / ``_from_tensor`` outside one, and runs the
    model's post-load hooks once, at the end."""

    def call(route: str) -> Callable[[str], None]:
        return lambda root: _check_sglang(root, route, sync._post(root, route, {}))

    sync._all(call("/begin_weight_update"))
    try:
        yield
    except BaseException:
        try:
            sync._all(call("/end_weight_update"))
        except WeightSyncError as e:  # the first error is the one to report
            log.warning("closing the weight-update session after a failed push: %s", e)
        raise
    sync._all(call("/end_weight_update"))


Serializer = Callable[[Any], bytes]


def multiprocessing_serializer(obj: Any) -> bytes:
    """What SGLang's ``MultiprocessingSerializer.serialize`` does (sglang 0.5.23
    ``srt/utils/common.py``: one ``ForkingPickler`` dump), without importing SGLang
    on the trainer. torch's reductions write a CUDA tensor as an IPC handle to its
    memory (engine and trainer share the GPU) and a CPU tensor as a shared-memory
    file descriptor that the receiver fetches from this process, so either way the
    tensor must stay alive until the engine has loaded it: :class:`SglangTensorSync`
    holds each bucket until its request returns. Device indices go as torch writes
    them (we do not apply SGLang's ``monkey_patch_torch_reductions``, which rewrites
    them to GPU UUIDs and breaks CPU tensors): the engine must see the GPU under the
    same index as the trainer."""
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's tensor reductions)

    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return buf.getvalue()


def flattened_bucket_payload(metas: Sequence[TensorMeta], flat: torch.Tensor) -> dict[str, Any]:
    """What each TP rank of SGLang 0.5.23 deserializes for ``load_format =
    "flattened_bucket"`` (``WeightUpdater._update_weights_from_flattened_bucket``,
    ``srt/model_executor/model_runner_components/weight_updater.py``): a dict with
    ``flattened_tensor`` and ``metadata``, whose items it reads by attribute (name,
    shape, dtype, start_idx, end_idx, numel; ``FlattenedTensorMetadata`` in
    ``srt/weight_sync/tensor_bucket.py``, offsets and numel in bytes) to rebuild a
    ``FlattenedTensorBucket``. The items are ``types.SimpleNamespace``: SGLang's
    ``SafeUnpickler`` allows it, and the trainer needs no SGLang to build them."""
    import types

    import torch

    out, offset = [], 0
    for m in metas:
        out.append(
            types.SimpleNamespace(
                name=m.name,
                shape=torch.Size(m.shape),
                dtype=getattr(torch, m.dtype),
                start_idx=offset,
                end_idx=offset + m.nbytes,
                numel=m.nbytes,
            )
        )
        offset += m.nbytes
    return {"flattened_tensor": flat, "metadata": out}


SGLANG_TENSOR_UNVERIFIED = (
    "weight_sync = 'sglang-tensor' is experimental on GPUs: its payloads were opened by "
    "SGLang 0.5.23's own deserializer on CPU tensors in lightning's tests, but CUDA IPC "
    "handles{colocate} have not run there"
)


# sglang 0.5.23 ``srt/constants.py`` (GPU_MEMORY_TYPE_*): what
# ``/release_memory_occupation`` and ``/resume_memory_occupation`` take as ``tags``.
KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"
RELEASED_TAGS = (KV_CACHE, WEIGHTS, CUDA_GRAPH)


class SglangTensorSync(_SglangBase):
    """``/update_weights_from_tensor``: the engine loads tensors the trainer holds,
    from a serialized handle (CUDA IPC: engine and trainer on the same GPUs).

    A push is one weight-update session holding one call per bucket of at most
    ``bucket_bytes`` (:func:`plan_buckets`) streamed from the live model, nothing on
    disk. With ``flatten`` (default) a bucket is one ``flattened_bucket`` tensor
    (:func:`flatten_bucket` on ``device``, default CUDA when there is one, else CPU;
    :func:`flattened_bucket_payload`); without it, the bucket's named tensors as
    they come. Each engine gets one payload per TP rank (``tp_sizes``, default 1
    each), serialized separately as SGLang's own ``Engine`` does: each rank opens
    only its own, which keeps CUDA IPC reference counts right. Only the last call
    carries ``weight_version`` and flushes the cache.

    ``colocate``: SGLang's memory handoff around the optimizer step.
    :meth:`before_train` posts ``/release_memory_occupation`` with every tag
    (``kv_cache``, ``weights``, ``cuda_graph``; SGLang requires the engine idle);
    :meth:`push` resumes ``weights`` first (the update loads into them), updates,
    then resumes ``kv_cache`` and ``cuda_graph``, so the KV cache comes back only
    once the trainer's bucket buffers are freed. SGLang's scheduler removes each
    resumed tag from its released set and fails on one that was not released, so
    only released tags are resumed; a failed push still resumes them. These two
    routes answer ``null`` with HTTP 200 on success and ``{"error": {"message"}}``
    with 400 on failure (``http_server.py``), so the status is the check."""

    streams = True

    def __init__(
        self,
        roots: Sequence[str],
        *,
        serializer: Serializer = multiprocessing_serializer,
        tp_sizes: Sequence[int] | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        flatten: bool = True,
        device: str | None = None,
        colocate: bool = False,
        pause_mode: PauseMode = "none",
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__(roots, pause_mode=pause_mode, timeout_s=timeout_s)
        sizes = list(tp_sizes or [1] * len(self.roots))
        if len(sizes) != len(self.roots) or min(sizes) < 1:
            raise ValueError(f"tp_sizes = {sizes}: one size of at least 1 per engine")
        self.tp_sizes = dict(zip(self.roots, sizes, strict=True))
        self.serializer = serializer
        self.bucket_bytes = bucket_bytes
        self.flatten = flatten
        self.device = device
        self.colocated = colocate
        self.released: list[str] = []  # tags given back, in release order

    def setup(self) -> None:
        memory_saver = " and SGLang's memory saver (colocate)" if self.colocated else ""
        log.warning(SGLANG_TENSOR_UNVERIFIED.format(colocate=memory_saver))

    def before_train(self) -> None:
        if not self.colocated:
            return
        self._memory("/release_memory_occupation", list(RELEASED_TAGS))
        self.released = list(RELEASED_TAGS)

    def push(self, update: WeightUpdate) -> None:
        if WEIGHTS in self.released:
            self._resume([WEIGHTS])
        try:
            super().push(update)
        finally:
            if self.released:
                self._resume(list(self.released))

    def _resume(self, tags: list[str]) -> None:
        self._memory("/resume_memory_occupation", tags)
        self.released = [t for t in self.released if t not in tags]

    def _memory(self, route: str, tags: list[str]) -> None:
        def one(root: str) -> None:
            try:
                self._post(root, route, {"tags": tags})
            except WeightSyncError as e:
                raise WeightSyncError(
                    f"colocated engine {root}: {route} (tags {tags}) failed; SGLang needs "
                    f"--enable-memory-saver and an idle engine for it: {e}"
                ) from e

        self._all(one)

    def _device(self) -> str:
        if self.device is not None:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def _update(self, update: WeightUpdate) -> None:
        plan = plan_buckets(update.metas(), self.bucket_bytes, aligned=self.flatten)
        tensors = update.tensors()
        with _sglang_session(self):
            for i, metas in enumerate(plan):
                last = i == len(plan) - 1
                bucket = _checked(metas, tensors)
                if self.flatten:
                    flat = flatten_bucket(metas, bucket, self._device(), update.stats)
                    obj: Any = flattened_bucket_payload(metas, flat)
                else:
                    obj = list(bucket)
                payloads = {
                    root: [base64.b64encode(self.serializer(obj)).decode("ascii") for _ in range(n)]
                    for root, n in self.tp_sizes.items()
                }
                body = {
                    "load_format": "flattened_bucket" if self.flatten else None,
                    "flush_cache": last,
                    "abort_all_requests": False,
                    "weight_version": str(update.version) if last else None,
                }
                self._all(functools.partial(self._call_update, body=body, payloads=payloads))
                if update.stats is not None:
                    update.stats.sent_bytes += sum(m.nbytes for m in metas)
                # The engines have loaded it: the handles may die with the bucket.
                del obj, payloads
                if self.flatten:
                    del flat
            extra = next(tensors, None)  # also frees the source's last tensor
            if extra is not None:
                raise WeightSyncError(f"{extra[0]!r} was sent but not announced (metas())")

    def _call_update(self, root: str, body: dict[str, Any], payloads: dict[str, list[str]]) -> None:
        route = "/update_weights_from_tensor"
        full = {"serialized_named_tensors": payloads[root], **body}
        _check_sglang(root, route, self._post(root, route, full))


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
        self.streams = transport.streams

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


VLLM_NCCL_UNVERIFIED = (
    "weight_sync = 'vllm-nccl' is experimental: it drives vLLM's own trainer side "
    "(vllm 0.34.0 NCCLTrainerWeightTransferEngine, packed) through our HTTP client, and "
    "lightning's tests ran that engine, vLLM's worker-side init/update parsers and its "
    "receive on CPU tensors, but with a stand-in for the data plane: PyNccl (the group "
    "join and the NCCL broadcast on CUDA) has not run there"
)


class _VllmClients:
    """vLLM's ``VLLMWeightSyncClient`` protocol (four methods, structural) over every
    engine at once: vLLM's trainer engine drives it. With ``offsets`` (NCCL) each
    engine gets its own ``rank_offset`` in the one transfer group; without (IPC) the
    init info goes as vLLM's trainer built it."""

    def __init__(
        self, sync: WeightSync, offsets: dict[str, int] | None = None, world: int = 0
    ) -> None:
        self.sync = sync
        self.offsets, self.world = offsets, world
        self.version: str | None = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        s = self.sync

        def one(root: str) -> None:
            info = dict(init_info)
            if self.offsets is not None:
                info |= {"rank_offset": self.offsets[root], "world_size": self.world}
            s._post(root, "/init_weight_transfer_engine", {"init_info": info})

        s._all(one)

    def start_weight_update(self) -> None:
        self.sync._all(lambda r: self.sync._post(r, "/start_weight_update"))

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        infos = update_info if isinstance(update_info, list) else [update_info]
        safe = [vllm_ipc_json_safe(i) for i in infos]
        body = {"update_info": safe if isinstance(update_info, list) else safe[0]}
        self.sync._all(lambda r: self.sync._post(r, "/update_weights", body))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = {"weight_version": weight_version or self.version}
        self.sync._all(lambda r: self.sync._post(r, "/finish_weight_update", body))


def vllm_ipc_json_safe(update_info: dict[str, Any]) -> dict[str, Any]:
    """``update_info`` as JSON: vLLM's IPC trainer engine hands the client raw
    ``ipc_handles`` (torch's ``reduce_tensor`` arguments: a storage class, bytes, a
    dtype), which JSON cannot carry. vllm 0.34.0's worker-side
    ``IPCWeightTransferUpdateInfo.__post_init__`` (``weight_transfer/ipc_engine.py``)
    takes them instead as ``ipc_handles_pickled``, base64 of a pickle, and unpickles
    it only when the server runs with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``; giving
    both fields is refused. Other backends' infos carry no handles and pass as they
    are (what vLLM's own ``HTTPVLLMWeightSyncClient`` does, ``clients.py``)."""
    handles = update_info.get("ipc_handles")
    if handles is None:
        return update_info
    import pickle

    out = {k: v for k, v in update_info.items() if k != "ipc_handles"}
    out["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(handles)).decode("ascii")
    return out


def _update_source(device: str = "cuda") -> Any:
    """A vLLM ``WeightSource`` over the update being pushed (rank 0 sends all), its
    tensors moved to ``device`` (a no-op for a model already there)."""
    from functools import cached_property

    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class UpdateSource(WeightSource):  # type: ignore[misc]
        def __init__(self) -> None:
            self.update: WeightUpdate | None = None

        def use(self, update: WeightUpdate) -> None:
            self.update = update
            self.__dict__.pop("metadata", None)  # fixed within one push

        @cached_property
        def metadata(self) -> list[Any]:
            import torch

            if self.update is None:
                return []
            # From shapes alone (a live source gathers nothing for them), so the
            # single pass over the weights is iter_full's.
            return [
                ParamMeta(m.name, getattr(torch, m.dtype), tuple(m.shape))
                for m in self.update.metas()
            ]

        def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
            assert self.update is not None
            stats = self.update.stats
            for name, tensor in self.update.tensors():
                if stats is not None:  # handed to vLLM's producer, which sends it all
                    stats.sent_bytes += tensor.numel() * tensor.element_size()
                yield name, tensor.to(device)

    return UpdateSource()


class VllmNcclSync(WeightSync):
    """vLLM's NCCL backend, sent by vLLM's own ``NCCLTrainerWeightTransferEngine``
    (needs ``vllm`` importable on the trainer); experimental, see
    :data:`VLLM_NCCL_UNVERIFIED`.

    Packed (default): vLLM's producer packs the tensors ``iter_full`` yields into
    ``packed_num_buffers`` (2) buffers of ``bucket_bytes`` each and broadcasts them
    in turn, so the sender holds those buffers and the tensor being gathered.

    ``device``: where the tensors go before vLLM's engine sees them (the
    communicator's GPU; tests/vllm_nccl_trainer.py runs the engine on the CPU)."""

    streams = True

    def __init__(
        self,
        roots: Sequence[str],
        master_address: str,
        master_port: int,
        *,
        world_sizes: Sequence[int] | None = None,
        packed: bool = True,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        device: str = "cuda",
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__(roots, timeout_s=timeout_s)
        self.master_address, self.master_port, self.packed = master_address, master_port, packed
        self.bucket_bytes, self.device = bucket_bytes, device
        self.world, self.offsets = self._group_ranks(world_sizes)
        self.client = _VllmClients(self, self.offsets, self.world)
        self.engine: Any = None

    def setup(self) -> None:
        log.warning(VLLM_NCCL_UNVERIFIED)
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerInitInfo,
            NCCLTrainerWeightTransferEngine,
        )

        self.source = _update_source(self.device)
        info = NCCLTrainerInitInfo(
            master_address=self.master_address,
            master_port=self.master_port,
            world_size=self.world,
            packed=self.packed,
            packed_buffer_size_bytes=self.bucket_bytes,
            rank=0,
        )
        self.engine = NCCLTrainerWeightTransferEngine.trainer_init(
            info, client=self.client, source=self.source
        )

    def push(self, update: WeightUpdate) -> None:
        if self.engine is None:
            raise WeightSyncError("VllmNcclSync.push before setup()")
        self._all(lambda r: self._post(r, "/pause", params={"mode": "wait"}))
        try:
            self.source.use(update)
            self.client.version = str(update.version)
            self.engine.send_weights()
        finally:
            self._all(lambda r: self._post(r, "/resume"))

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        super().close()


VLLM_IPC_UNVERIFIED = (
    "weight_sync = 'vllm-ipc' is experimental: it drives vLLM's own trainer side "
    "(vllm 0.34.0 IPCTrainerWeightTransferEngine, packed) through our HTTP client, and "
    "lightning's tests ran that engine and vLLM's own update-info parser and unpacker on "
    "CPU tensors, but CUDA IPC handles opened by a vLLM worker on the trainer's GPU"
    "{sleep} have not run there"
)

# vllm 0.34.0 ``device_allocator/__init__.py`` DEFERRABLE_TAGS: what ``/wake_up?tags=``
# can bring back one at a time (every other allocation comes back with the first).
VLLM_WEIGHTS, VLLM_KV_CACHE = "weights", "kv_cache"
# ``/sleep?level=2``: vllm 0.34.0 ``v1/worker/gpu_worker.py`` ``Worker.sleep`` discards
# the parameters a weight update rewrites and keeps the rest (buffers, say) on the GPU;
# level 1 would first copy every weight to pinned host memory, for nothing, since the
# push that follows sends them all.
VLLM_SLEEP_LEVEL = 2


def vllm_packed_misaligned(metas: Sequence[TensorMeta], buffer_bytes: int) -> TensorMeta | None:
    """The first tensor vllm 0.34.0's IPC worker could not unpack, or None.

    ``packed_ipc_producer`` (``weight_transfer/packed_tensor.py``) copies tensors end
    to end into its buffer, starting a new chunk when the next would overflow it
    (:func:`plan_buckets` without alignment), and the worker's ``unpack_tensor``
    views each slice of the uint8 buffer as its dtype, which torch allows only at a
    byte offset that is a multiple of the item size (tests/test_weight_sync.py runs
    vLLM's own unpacker on a misaligned chunk). Bf16-only models always pass; a
    float32 tensor behind an odd number of bf16 elements does not."""
    for bucket in plan_buckets(metas, buffer_bytes, aligned=False):
        offset = 0
        for m in bucket:
            if offset % _itemsize(m.dtype):
                return m
            offset += m.nbytes
    return None


class VllmIpcSync(WeightSync):
    """vLLM's IPC backend: the engine runs on the trainer's GPU and loads the
    trainer's tensors through CUDA IPC handles, sent by vLLM's own
    ``IPCTrainerWeightTransferEngine`` (needs ``vllm`` importable on the trainer);
    experimental, see :data:`VLLM_IPC_UNVERIFIED`.

    Packed (default): vLLM's producer copies the tensors ``iter_full`` yields into one
    IPC-shared buffer of ``bucket_bytes`` (grown to the largest tensor, which it would
    refuse otherwise) and sends one ``/update_weights`` per fill, waiting for each to
    return before refilling, so the trainer holds that buffer and the tensor being
    gathered. Unpacked: one ``/update_weights`` with a handle per tensor, every one kept
    alive until the push ends. The server needs ``VLLM_SERVER_DEV_MODE=1``,
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (the handles travel pickled, see
    :func:`vllm_ipc_json_safe`) and ``--weight-transfer-config '{"backend": "ipc"}'``,
    one worker per engine on the trainer's GPU, and one trainer process (vLLM's engine
    all-gathers handles over the default process group, which the loop's other ranks
    never join).

    ``colocate``: vLLM's sleep mode around the optimizer step (``--enable-sleep-mode``).
    :meth:`before_train` posts ``/sleep?level=2&mode=wait`` (:data:`VLLM_SLEEP_LEVEL`;
    vLLM pauses its scheduler first, and the loop has drained the gateway); :meth:`push`
    wakes ``weights``, runs the transfer, then wakes ``kv_cache``, whose answer must
    be ``{"status": "awake"}``: vLLM resumes scheduling only once everything is back.
    No ``/pause`` or ``/resume`` then: the sleep paused the scheduler, and ``/resume``
    would restart it with the KV cache still asleep. A failed push still wakes
    ``kv_cache``. Every route answers HTTP 200 on success; failures are vLLM's error
    JSON with 4xx/5xx, so the status is the check."""

    streams = True

    def __init__(
        self,
        roots: Sequence[str],
        *,
        packed: bool = True,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        colocate: bool = False,
        device: str = "cuda",
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__(roots, timeout_s=timeout_s)
        self.packed, self.bucket_bytes, self.device = packed, bucket_bytes, device
        self.colocated = colocate
        self.client = _VllmClients(self)
        self.engine: Any = None
        self.source: Any = None
        self.asleep = False

    def setup(self) -> None:
        log.warning(VLLM_IPC_UNVERIFIED.format(sleep=" and vLLM's sleep mode" * self.colocated))
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise WeightSyncError(
                f"weight_sync = 'vllm-ipc' runs with one trainer process (this run has "
                f"{dist.get_world_size()}): vLLM's IPC trainer engine all-gathers handles "
                "from every rank, which lightning's other ranks do not join; use 'vllm-nccl'"
            )
        try:
            from vllm.distributed.weight_transfer.ipc_engine import (
                IPCTrainerInitInfo,
                IPCTrainerWeightTransferEngine,
            )
        except ImportError as e:
            raise WeightSyncError(
                "weight_sync = 'vllm-ipc' sends through vLLM's own IPC trainer engine: "
                f"install vllm==0.34.0 in the trainer's environment ({e})"
            ) from e
        self.source = _update_source(self.device)
        info = IPCTrainerInitInfo(
            packed=self.packed, packed_buffer_size_bytes=self.bucket_bytes, rank=0
        )
        # Posts /init_weight_transfer_engine {"init_info": {"packed"}} to every engine.
        self.engine = IPCTrainerWeightTransferEngine.trainer_init(
            info, client=self.client, source=self.source
        )

    def before_train(self) -> None:
        if not self.colocated:
            return
        params = {"level": VLLM_SLEEP_LEVEL, "mode": "wait"}
        self._all(lambda r: self._colocated(r, "/sleep", params))
        self.asleep = True

    def push(self, update: WeightUpdate) -> None:
        if self.engine is None:
            raise WeightSyncError("VllmIpcSync.push before setup()")
        if not self.asleep:
            # mode=wait: as VllmNcclSync; with no sleep, the scheduler runs.
            self._all(lambda r: self._post(r, "/pause", params={"mode": "wait"}))
            try:
                self._send(update)
            finally:
                self._all(lambda r: self._post(r, "/resume"))
            return
        self._all(lambda r: self._colocated(r, "/wake_up", {"tags": [VLLM_WEIGHTS]}))
        try:
            self._send(update)
        finally:
            tags = {"tags": [VLLM_KV_CACHE]}
            answers = self._all(lambda r: self._colocated(r, "/wake_up", tags))
            self.asleep = False
            for root, answer in zip(self.roots, answers, strict=True):
                if not isinstance(answer, dict) or answer.get("status") != "awake":
                    raise WeightSyncError(
                        f"colocated engine {root}: still asleep after /wake_up?tags=kv_cache "
                        f"({answer!r}), so vLLM keeps its scheduler paused; POST /wake_up "
                        "with no tags wakes everything"
                    )

    def _send(self, update: WeightUpdate) -> None:
        if self.packed:
            # vLLM's producer refuses a tensor larger than its buffer; the buffer size
            # is the trainer's alone (the worker reads sizes from each update info).
            metas = update.metas()
            size = max(self.bucket_bytes, max((m.nbytes for m in metas), default=0))
            bad = vllm_packed_misaligned(metas, size)
            if bad is not None:
                raise WeightSyncError(
                    f"{bad.name} ({bad.dtype}) would start at a byte offset that is not a "
                    "multiple of its item size in vLLM's packed IPC buffer (vllm 0.34.0 packs "
                    "tensors end to end, and its worker's unpack_tensor views the bytes as the "
                    "dtype, which torch refuses there); nothing was sent. Build "
                    "VllmIpcSync(urls, packed=False), or use 'vllm-nccl'"
                )
            self.engine.packed_buffer_size_bytes = size
        self.source.use(update)
        self.client.version = str(update.version)
        self.engine.send_weights()

    def _colocated(self, root: str, route: str, params: dict[str, Any]) -> Any:
        try:
            return self._post(root, route, params=params)
        except WeightSyncError as e:
            raise WeightSyncError(
                f"colocated engine {root}: {route} {params} failed; vLLM needs "
                f"--enable-sleep-mode and VLLM_SERVER_DEV_MODE=1 for it: {e}"
            ) from e

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
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
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    colocate: bool = False,
) -> WeightSync:
    """The sync for ``[engine] weight_sync = kind`` (see the module docstring);
    ``colocate`` only with ``sglang-tensor`` or ``vllm-ipc``."""
    roots = list(urls)
    if colocate and kind not in COLOCATE_SYNCS:
        raise ValueError(COLOCATE_NEEDS_IPC.format(kind=kind))
    if kind == "embedded":
        return EmbeddedSync(roots)
    if kind == "sglang-disk":
        return SglangDiskSync(roots, pause_mode=pause_mode)
    if kind == "sglang-tensor":
        return SglangTensorSync(
            roots,
            tp_sizes=world_sizes,
            bucket_bytes=bucket_bytes,
            colocate=colocate,
            pause_mode=pause_mode,
        )
    if kind == "sglang-distributed":
        port = master_port or _free_port(master_address)
        transport = TorchDistTransport(master_address, port, backend=backend)
        return SglangDistributedSync(
            roots,
            transport,
            world_sizes=world_sizes,
            pause_mode=pause_mode,
            bucket_bytes=bucket_bytes,
        )
    if kind == "vllm-disk":  # type: ignore[comparison-overlap]  # a removed kind, named
        raise ValueError(VLLM_DISK_GONE)
    if kind == "vllm-nccl":
        port = master_port or _free_port(master_address)
        return VllmNcclSync(
            roots, master_address, port, world_sizes=world_sizes, bucket_bytes=bucket_bytes
        )
    if kind == "vllm-ipc":
        if any(w != 1 for w in world_sizes or []):
            raise ValueError(
                f"weight_sync = 'vllm-ipc' with sync_world_sizes = {list(world_sizes or [])}: "
                "the trainer exports CUDA IPC handles of its one GPU, so each engine must run "
                "one worker on that GPU (tensor_parallel_size 1); use 'vllm-nccl' for more"
            )
        return VllmIpcSync(roots, bucket_bytes=bucket_bytes, colocate=colocate)
    if kind == "none":
        return NoSync(roots)
    raise ValueError(f"unknown weight_sync {kind!r}")


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
