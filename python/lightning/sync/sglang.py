"""SGLang's three syncs: ``sglang-disk`` (:class:`SglangDiskSync`),
``sglang-distributed`` (:class:`SglangDistributedSync`, flattened buckets over a
process group SGLang joins with its own ``init_custom_process_group``) and
``sglang-tensor`` (:class:`SglangTensorSync`, CUDA IPC payloads, colocated with
memory release/resume). Endpoints and payloads: the package docstring."""

from __future__ import annotations

import base64
import contextlib
import functools
import logging
from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from lightning.sync.base import (
    TorchDistTransport,
    WeightSync,
    WeightUpdate,
    flatten_bucket,
)
from lightning.sync.kinds import PauseMode, WeightSyncError
from lightning.sync.live_weights import (
    DEFAULT_BUCKET_BYTES,
    TensorMeta,
    meta_of,
    plan_buckets,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger("lightning.sync")


def _check_sglang(root: str, route: str, answer: Any) -> None:
    if not isinstance(answer, dict) or not answer.get("success", False):
        raise WeightSyncError(f"{root}{route} failed: {answer!r}")


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

    def engine_dtype(self, model_config: dict[str, Any]) -> str | None:
        """SGLang's ``GET /server_info`` (sglang 0.5.23 ``http_server.py``
        ``server_info``: the resolved server args) carries ``dtype``, the ``--dtype``
        it was started with; ``"auto"`` is resolved from the checkpoint's config as
        SGLang resolves it (:func:`sglang_auto_dtype`)."""

        def read(root: str) -> str:
            info = self._get(root, "/server_info")
            dtype = info.get("dtype") if isinstance(info, dict) else None
            if not isinstance(dtype, str):
                raise WeightSyncError(f"{root}/server_info has no dtype: {str(info)[:200]}")
            return sglang_auto_dtype(model_config) if dtype == "auto" else _dtype_name(dtype)

        return self._one_dtype(read)


def _dtype_name(dtype: str) -> str:
    """A dtype as engines spell it (``"bf16"``, ``"half"``, ``"torch.bfloat16"``) as
    a torch attribute name."""
    name = dtype.lower().removeprefix("torch.")
    return {"bf16": "bfloat16", "half": "float16", "fp16": "float16", "float": "float32"}.get(
        name, name
    )


def sglang_auto_dtype(model_config: dict[str, Any]) -> str:
    """The dtype SGLang serves a checkpoint in under ``--dtype auto``: sglang 0.5.23
    ``srt/configs/model_config.py`` ``_get_and_verify_dtype``: the config's ``dtype``
    (or ``torch_dtype``), float32 when absent; a float32 checkpoint is served in
    float16 (bfloat16 for Gemma models); any other as it is."""
    config_dtype = model_config.get("dtype") or model_config.get("torch_dtype") or "float32"
    name = _dtype_name(str(config_dtype))
    if name != "float32":
        return name
    return "bfloat16" if str(model_config.get("model_type", "")).startswith("gemma") else "float16"


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


SGLANG_DISTRIBUTED_UNVERIFIED = (
    "weight_sync = 'sglang-distributed' is experimental on GPUs: lightning's tests ran "
    "SGLang 0.5.23's own group join (init_custom_process_group) and FlattenedTensorBucket "
    "over gloo on CPU tensors, but the NCCL group and its broadcasts on GPUs have not run "
    "there"
)


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
        if self.transport.backend == "nccl":
            log.warning(SGLANG_DISTRIBUTED_UNVERIFIED)
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
        """Pipelined: bucket ``i + 1`` is gathered (FSDP2's collectives) while the
        engines still load bucket ``i`` and answer its request; its request goes out
        once theirs for ``i`` has returned (the engine receives in request order)
        and its broadcast then. A broadcast has finished before the next gather is
        issued (:meth:`TorchDistTransport.broadcast`), so the trainer's collectives
        and the engines' never overlap on rank 0's GPU."""
        plan = plan_buckets(update.metas(), self.bucket_bytes, aligned=self.flatten)
        tensors = update.tensors()
        stats = update.stats
        with _sglang_session(self):
            loading: Future[Any] | None = None  # the engines' request for the last bucket
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
                bucket = _checked(metas, tensors)
                if self.flatten:
                    gathered: Any = flatten_bucket(metas, bucket, self.transport._device(), stats)
                else:
                    gathered = list(bucket)
                if loading is not None:
                    loading.result()
                loading = self._pool.submit(
                    self._all, functools.partial(self._call_update, body=body)
                )
                # If a broadcast fails the engines wait for a peer that is gone and
                # their request fails on their own timeout; this error is raised.
                if self.flatten:
                    self.transport.broadcast(gathered)
                    if stats is not None:
                        stats.sent_bytes += gathered.numel()
                else:
                    self.transport.send_tensors(gathered, stats)
                del gathered, bucket
            if loading is not None:
                loading.result()
            extra = next(tensors, None)  # also frees the source's last tensor
            if extra is not None:
                raise WeightSyncError(f"{extra[0]!r} was sent but not announced (metas())")

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


# sglang 0.5.23 ``srt/utils/patch_torch.py`` ``_REDUCE_TENSOR_ARG_DEVICE_INDEX``: where
# the device sits among the arguments torch's ``reduce_tensor`` gives
# ``rebuild_cuda_tensor`` (tensor_cls, size, stride, offset, storage_cls, dtype,
# storage_device, handle, ...).
DEVICE_ARG = 6


def device_uuid(index: int) -> str:
    """A CUDA device's UUID as SGLang writes it (``_device_to_uuid``:
    ``str(torch.cuda.get_device_properties(index).uuid)``)."""
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def _with_device_uuid(reduce_tensor: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """torch's tensor reduction, with a CUDA tensor's device index replaced by the
    device's UUID, what sglang 0.5.23's ``_reduce_tensor_modified`` sends
    (``srt/utils/patch_torch.py``, applied by ``monkey_patch_torch_reductions``).
    The engine's workers run that patch too (``TpModelWorker.__init__``), so their
    ``rebuild_cuda_tensor`` is ``_rebuild_cuda_tensor_modified``, which maps a UUID
    back to the index the device has in the engine's process
    (``_device_from_maybe_uuid``) and passes an integer through unchanged: an index
    names a different GPU, or none, when the engine sees the GPUs under another
    ``CUDA_VISIBLE_DEVICES``. CPU tensors (tests, ``--device cpu``) keep torch's
    reduction: SGLang's patch would index past their shorter argument tuple."""

    def reduce(tensor: Any) -> Any:
        rebuild, args = reduce_tensor(tensor)
        # rebuild_cuda_tensor, or SGLang's _rebuild_cuda_tensor_modified in a trainer
        # process that ran SGLang's patch itself.
        cuda = "rebuild_cuda_tensor" in getattr(rebuild, "__name__", "")
        if cuda and isinstance(args[DEVICE_ARG], int):
            args = (*args[:DEVICE_ARG], device_uuid(args[DEVICE_ARG]), *args[DEVICE_ARG + 1 :])
        return rebuild, args

    return reduce


def multiprocessing_serializer(obj: Any) -> bytes:
    """What SGLang's ``MultiprocessingSerializer.serialize`` does on a trainer that
    has run ``monkey_patch_torch_reductions`` (sglang 0.5.23 ``srt/utils/common.py``:
    one ``ForkingPickler`` dump; ``srt/weight_sync/utils.py`` ``update_weights``
    patches first), without importing SGLang on the trainer: CUDA tensors go as IPC
    handles keyed by the GPU's UUID (:func:`_with_device_uuid`). torch's reductions
    write a CUDA tensor as an IPC handle to its memory (engine and trainer share the
    GPU) and a CPU tensor as a shared-memory file descriptor that the receiver
    fetches from this process, so either way the tensor must stay alive until the
    engine has loaded it: :class:`SglangTensorSync` holds each bucket until its
    request returns."""
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.multiprocessing

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    # ForkingPickler copies its registered reducers into this pickler's own table;
    # torch registers reduce_tensor for every tensor class.
    for cls, reduce in list(pickler.dispatch_table.items()):
        if isinstance(cls, type) and issubclass(cls, torch.Tensor):
            pickler.dispatch_table[cls] = _with_device_uuid(reduce)
    pickler.dump(obj)
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
        """Pipelined: bucket ``i + 1`` is gathered and serialized while the engines
        load bucket ``i``; bucket ``i`` (whose memory their handles point at) is
        kept until its request returns, so the sender holds at most two buckets."""
        plan = plan_buckets(update.metas(), self.bucket_bytes, aligned=self.flatten)
        tensors = update.tensors()
        with _sglang_session(self):
            loading: Future[Any] | None = None
            held: Any = None  # the bucket the engines are loading
            try:
                for i, metas in enumerate(plan):
                    last = i == len(plan) - 1
                    bucket = _checked(metas, tensors)
                    if self.flatten:
                        flat = flatten_bucket(metas, bucket, self._device(), update.stats)
                        obj: Any = flattened_bucket_payload(metas, flat)
                        del flat
                    else:
                        obj = list(bucket)
                    payloads = {
                        root: [
                            base64.b64encode(self.serializer(obj)).decode("ascii") for _ in range(n)
                        ]
                        for root, n in self.tp_sizes.items()
                    }
                    body = {
                        "load_format": "flattened_bucket" if self.flatten else None,
                        "flush_cache": last,
                        "abort_all_requests": False,
                        "weight_version": str(update.version) if last else None,
                    }
                    if loading is not None:
                        loading.result()
                    # The engines have loaded the last bucket: its handles may die.
                    held = obj
                    loading = self._pool.submit(
                        self._all,
                        functools.partial(self._call_update, body=body, payloads=payloads),
                    )
                    if update.stats is not None:
                        update.stats.sent_bytes += sum(m.nbytes for m in metas)
                    del obj, payloads, bucket
                if loading is not None:
                    loading.result()
                    loading = None
            finally:
                if loading is not None:  # a failure while a bucket is out: let it land
                    with contextlib.suppress(Exception):
                        loading.result()
                del held
            extra = next(tensors, None)  # also frees the source's last tensor
            if extra is not None:
                raise WeightSyncError(f"{extra[0]!r} was sent but not announced (metas())")

    def _call_update(self, root: str, body: dict[str, Any], payloads: dict[str, list[str]]) -> None:
        route = "/update_weights_from_tensor"
        full = {"serialized_named_tensors": payloads[root], **body}
        _check_sglang(root, route, self._post(root, route, full))
