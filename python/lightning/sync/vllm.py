"""vLLM's two syncs, each driving vLLM's own trainer-side engine: ``vllm-nccl``
(:class:`VllmNcclSync`, ``NCCLTrainerWeightTransferEngine``) and ``vllm-ipc``
(:class:`VllmIpcSync`, ``IPCTrainerWeightTransferEngine``, colocated through sleep
mode); :class:`VllmSync` for a transport of one's own. Endpoints and payloads:
the package docstring."""

from __future__ import annotations

import base64
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from lightning.sync.base import (
    Transport,
    WeightSync,
    WeightUpdate,
)
from lightning.sync.kinds import WeightSyncError
from lightning.sync.live_weights import (
    DEFAULT_BUCKET_BYTES,
    TensorMeta,
    _itemsize,
    plan_buckets,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger("lightning.sync")


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


def vllm_engine_dtype(sync: WeightSync) -> str:
    """vLLM's dev-mode ``GET /server_info?config_format=json`` (vllm 0.34.0
    ``entrypoints/serve/dev/server_info/api_router.py`` ``show_server_info``; the RL
    routes need ``VLLM_SERVER_DEV_MODE=1`` anyway) dumps its ``VllmConfig``, whose
    ``model_config.dtype`` is the resolved ``torch.dtype`` (``"auto"`` already
    applied), written with ``fallback=str`` as ``"torch.bfloat16"``."""

    def read(root: str) -> str:
        info = sync._get(root, "/server_info", params={"config_format": "json"})
        try:
            dtype = info["vllm_config"]["model_config"]["dtype"]
        except (KeyError, TypeError) as e:
            raise WeightSyncError(
                f"{root}/server_info has no vllm_config.model_config.dtype ({e!r}): start "
                "vLLM with VLLM_SERVER_DEV_MODE=1, or set [engine] sync_dtype"
            ) from e
        return str(dtype).removeprefix("torch.")

    return sync._one_dtype(read)


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

    def engine_dtype(self, model_config: dict[str, Any]) -> str | None:
        return vllm_engine_dtype(self)

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
    communicator's GPU; tests/support/vllm_nccl_trainer.py runs the engine on the CPU)."""

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

    def engine_dtype(self, model_config: dict[str, Any]) -> str | None:
        return vllm_engine_dtype(self)

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
    byte offset that is a multiple of the item size (tests/sync/test_weight_sync.py runs
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

    def engine_dtype(self, model_config: dict[str, Any]) -> str | None:
        return vllm_engine_dtype(self)

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
