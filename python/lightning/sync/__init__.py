"""Weight sync: how a new policy reaches the engines, through each engine's own API.

One interface, :class:`WeightSync` (``setup`` once, ``push`` after every optimizer
step, ``close``), with one implementation per engine API. The HTTP choreography
lives here; moving the tensors themselves (NCCL broadcast, CUDA IPC, a shared
disk) is a :class:`Transport`, so the choreography is the same whatever carries
the bytes and can be tested on a CPU. The package, the one home of weight sync:
``kinds.py`` (the kinds, their aliases and :class:`WeightSyncError`, torch-free so
the configs validate against them), ``live_weights.py`` (the trainer's live
weights as buckets of full tensors), ``base.py`` (what every sync shares:
:class:`WeightUpdate`, :class:`WeightSync`, the torch.distributed transport, the
embedded and no-op syncs), ``sglang.py`` and ``vllm.py`` (each engine's syncs), and
here :func:`make_weight_sync`, the one factory, which picks one from the config.

What a push carries, :class:`WeightUpdate`, is a directory or a stream. The disk
paths (``embedded``, ``sglang-disk``) get an exported safetensors directory. The
streaming paths (``sglang-distributed``, ``sglang-tensor``, ``vllm-nccl``, ``vllm-ipc``;
``WeightSync.streams``) get :class:`LiveWeights` (``live_weights.py``): the
trainer's live parameters, each FSDP2 shard gathered
(``full_tensor()``) only when its turn comes, grouped into buckets of
``bucket_bytes`` (:func:`plan_buckets`, from shapes alone) that map to the engine's
own unit of transfer: one SGLang ``update_weights_from_distributed`` call with
``load_format = "flattened_bucket"`` (one broadcast per bucket), one SGLang
``update_weights_from_tensor`` call (one flattened tensor per bucket), one vLLM
packed buffer (one ``/update_weights`` per fill for ``vllm-ipc``). Nothing is written to disk and the sender holds at most a bucket plus the
tensor being gathered (``LiveWeights.stats``; tests/sync/test_weight_sync.py checks it on
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
0.5.23's own ``init_custom_process_group`` in tests/sync/test_weight_sync.py), and its
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
trainer broadcast, bitwise (tests/support/vllm_nccl_trainer.py, engine_side.py); the data
plane was a stand-in there: PyNccl (the group join over vLLM's
``StatelessProcessGroup``, the broadcast, CUDA streams) has not run, and it logs
:data:`VLLM_NCCL_UNVERIFIED` at setup. ``vllm-ipc``: vLLM 0.34.0's own
``IPCTrainerWeightTransferEngine``, ``IPCWeightTransferUpdateInfo`` parser and
``unpack_tensor`` ran on CPU tensors (tests/support/vllm_ipc_trainer.py answers the engine's
few device queries), bitwise; CUDA IPC handles and vLLM's sleep mode (checked
against a fake of its routes) have not run, and it logs :data:`VLLM_IPC_UNVERIFIED`
at setup.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

from lightning.sync.base import (
    GROUP_NAME,
    EmbeddedSync,
    NoSync,
    PlainTransport,
    TorchDistTransport,
    Transport,
    WeightSync,
    WeightUpdate,
    _free_port,
    flatten_bucket,
    join_group,
    leave_group,
)
from lightning.sync.kinds import (
    ALIASES,
    COLOCATE_NEEDS_IPC,
    COLOCATE_SYNCS,
    SYNC_KINDS,
    ConfigSyncKind,
    DiskSyncKind,
    PauseMode,
    SyncKind,
    WeightSyncError,
    canonical,
)
from lightning.sync.layout import (
    EngineLayout,
    sglang_distributed_size,
    sglang_worker_ranks,
    vllm_size,
    vllm_worker_ranks,
)
from lightning.sync.live_weights import (
    DEFAULT_BUCKET_BYTES,
    GatherStats,
    LiveWeights,
    TensorMeta,
    meta_of,
    plan_buckets,
)
from lightning.sync.sglang import (
    SGLANG_DISTRIBUTED_UNVERIFIED,
    SGLANG_TENSOR_UNVERIFIED,
    SglangDiskSync,
    SglangDistributedSync,
    SglangTensorSync,
    flattened_bucket_payload,
    multiprocessing_serializer,
)
from lightning.sync.vllm import (
    VLLM_IPC_UNVERIFIED,
    VLLM_NCCL_UNVERIFIED,
    VllmIpcSync,
    VllmNcclSync,
    VllmSync,
    vllm_ipc_json_safe,
    vllm_nccl_init_info,
    vllm_nccl_update_info,
    vllm_packed_misaligned,
)

__all__ = [
    "ALIASES",
    "COLOCATE_SYNCS",
    "DEFAULT_BUCKET_BYTES",
    "GROUP_NAME",
    "SGLANG_DISTRIBUTED_UNVERIFIED",
    "SGLANG_TENSOR_UNVERIFIED",
    "SYNC_KINDS",
    "VLLM_IPC_UNVERIFIED",
    "VLLM_NCCL_UNVERIFIED",
    "ConfigSyncKind",
    "DiskSyncKind",
    "EmbeddedSync",
    "EngineLayout",
    "GatherStats",
    "LiveWeights",
    "NoSync",
    "PauseMode",
    "PlainTransport",
    "SglangDiskSync",
    "SglangDistributedSync",
    "SglangTensorSync",
    "SyncKind",
    "TensorMeta",
    "TorchDistTransport",
    "Transport",
    "VllmIpcSync",
    "VllmNcclSync",
    "VllmSync",
    "WeightSync",
    "WeightSyncError",
    "WeightUpdate",
    "canonical",
    "flatten_bucket",
    "flattened_bucket_payload",
    "join_group",
    "leave_group",
    "make_weight_sync",
    "meta_of",
    "multiprocessing_serializer",
    "plan_buckets",
    "sglang_distributed_size",
    "sglang_worker_ranks",
    "vllm_ipc_json_safe",
    "vllm_nccl_init_info",
    "vllm_nccl_update_info",
    "vllm_packed_misaligned",
    "vllm_size",
    "vllm_worker_ranks",
]


def make_weight_sync(
    kind: ConfigSyncKind,
    urls: Iterable[str],
    *,
    master_address: str = "127.0.0.1",
    master_port: int = 0,
    world_sizes: Sequence[int] | None = None,
    pause_mode: PauseMode = "none",
    backend: Literal["nccl", "gloo"] = "nccl",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    colocate: bool = False,
    layouts: Sequence[EngineLayout] | None = None,
    engine_key: str | None = None,
) -> WeightSync:
    """The sync for ``[engine] weight_sync = kind`` (see the module docstring; an
    alias such as ``"sglang"`` is mapped by :func:`canonical`); ``colocate`` only
    with ``sglang-tensor`` or ``vllm-ipc``.

    Each engine's share of the transfer group: ``world_sizes`` (the ranks it joins
    with) or ``layouts`` (its TP/PP/DP sizes, turned into ranks by the engine's own
    arithmetic, ``lightning.sync.layout``; a layout SGLang cannot serve is refused
    here, with the reason). ``engine_key``: the embedded engine's key (default
    ``$LIGHTNING_ENGINE_KEY``)."""
    kind = canonical(kind)
    roots = list(urls)
    if layouts is not None:
        if world_sizes is not None:
            raise ValueError("give each engine's world size or its layout, not both")
        if kind == "sglang-distributed":
            world_sizes = [sglang_distributed_size(lay) for lay in layouts]
        elif kind == "sglang-tensor":  # one payload per TP rank; DP and PP ranks share them
            world_sizes = [lay.tp for lay in layouts]
        else:
            world_sizes = [vllm_size(lay) for lay in layouts]
    if colocate and kind not in COLOCATE_SYNCS:
        raise ValueError(COLOCATE_NEEDS_IPC.format(kind=kind))
    if kind == "embedded":
        return EmbeddedSync(roots, key=engine_key)
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
    assert kind == "none", kind  # canonical() refused every other name
    return NoSync(roots)
