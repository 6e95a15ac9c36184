"""What every sync shares: the update a push carries (:class:`WeightUpdate`), the
base class (:class:`WeightSync`: HTTP to each engine, setup/push/close), the
torch.distributed data plane (:class:`TorchDistTransport`, :func:`join_group`,
:func:`flatten_bucket`), and the syncs that need no engine-specific code
(:class:`EmbeddedSync`, :class:`NoSync`). The engine APIs: the package docstring."""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx

from lightning.sync.kinds import WeightSyncError
from lightning.sync.live_weights import (
    GatherStats,
    LiveWeights,
    TensorMeta,
    meta_of,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger("lightning.sync")

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
        device: torch.device | None = None,
    ) -> None:
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend
        self.group_name = group_name
        self.timeout_s = timeout_s
        # Resolved at open(): under torchrun the trainer's GPU is set by then.
        self.device = device
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
        self.device = self.device or group_device(self.backend)
        self.group = join_group(
            self.master_address,
            self.master_port,
            rank=0,
            world_size=world_size,
            backend=self.backend,
            group_name=self.group_name,
            timeout_s=self.timeout_s,
            device=self.device,
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
        """Where sent tensors go: the device the group is bound to."""
        return str(self.device or group_device(self.backend))

    def send(self, update: WeightUpdate) -> None:
        self.send_tensors(update.tensors(), update.stats)

    def send_tensors(
        self, tensors: Iterable[tuple[str, torch.Tensor]], stats: GatherStats | None = None
    ) -> None:
        """One broadcast per tensor, in order: what SGLang's
        ``update_weights_from_distributed`` receives without a ``load_format``."""
        for _, tensor in tensors:
            send = tensor.to(self._device()).contiguous()
            self.broadcast(send)
            if stats is not None:
                stats.sent_bytes += send.numel() * send.element_size()
            del send, tensor  # before the next gather

    def broadcast(self, tensor: torch.Tensor) -> None:
        """One broadcast from rank 0, finished on the device before it returns.

        Under torchrun the trainer's FSDP2 gathers (``full_tensor()``, collectives
        on the default group) and this broadcast (this group, other peers) are two
        NCCL communicators on rank 0's GPU. NCCL does not order collectives of two
        communicators against each other, and a kernel of one that waits for its
        peers can keep the other's from running; so no gather is issued while a
        broadcast is in flight: ``wait()`` makes the current stream wait for it, and
        the stream synchronize holds the CPU, which issues the next gather, until it
        has run. (On gloo the broadcast is synchronous already.)"""
        import torch
        import torch.distributed as dist

        work = dist.broadcast(tensor, src=0, group=self._group(), async_op=True)
        work.wait()
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()

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
        flat = flatten_bucket(metas, tensors, self._device(), stats)
        self.broadcast(flat)
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


def group_device(backend: str) -> torch.device:
    """The device a transfer group of ``backend`` is bound to: for NCCL the current
    CUDA device (``LOCAL_RANK``'s under torchrun: ``lightning.run.distributed`` sets
    it before anything else), for gloo ``cpu:0`` (torch wants an index)."""
    import torch

    if backend != "nccl":
        return torch.device("cpu", 0)
    if not torch.cuda.is_available():
        raise WeightSyncError(
            "an NCCL weight-update group needs a CUDA device on the trainer; use "
            "backend='gloo' for engines on the CPU"
        )
    return torch.device("cuda", torch.cuda.current_device())


def join_group(
    master_address: str,
    master_port: int,
    *,
    rank: int,
    world_size: int,
    backend: str,
    group_name: str,
    timeout_s: float = 600.0,
    device: torch.device | None = None,
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
    rather than building a backend by hand (tests/sync/test_weight_sync.py runs SGLang's
    function on the other side). ``group_name`` must be non-empty (SGLang asserts it)
    and unique in this process; :func:`leave_group` frees it.

    ``device`` (default :func:`group_device`) is passed as torch's ``device_id``,
    which SGLang's ``init_custom_process_group`` also takes: the group is bound to
    the trainer's GPU when it is created (NCCL connects eagerly there) instead of
    at its first broadcast, on whatever device is current by then. The default
    process group must stay unbound (``lightning.run.distributed`` binds none):
    torch 2.x builds a new group by splitting a bound default group's
    communicator, which would ask the trainer's other ranks to join this one.
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
        device_id=device or group_device(backend),
        **{options: None},
    )
    # Group ranks are global ranks: lets torch.distributed.broadcast(group=...) work.
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def leave_group(group: Any) -> None:
    """Destroy a group made by :func:`join_group` (its name can be joined again)."""
    import torch.distributed as dist

    dist.destroy_process_group(group)


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

    def engine_dtype(self, model_config: dict[str, Any]) -> str | None:
        """The dtype every engine holds its weights in (a torch dtype name), read
        from the engines; ``model_config`` is the policy's ``config.json``, for an
        engine that reports only ``"auto"``. None when they do not say."""
        return None

    def send_dtype(self, configured: str, model_config: dict[str, Any]) -> str | None:
        """What a streamed push casts floating weights to: ``configured`` (``[engine]
        sync_dtype``) unless it is ``"auto"``, then :meth:`engine_dtype`; None (send
        the trainer's own dtype) when neither says."""
        if configured != "auto":
            return configured
        found = self.engine_dtype(model_config)
        if found is None:
            log.info(
                "the engines do not report their dtype: weights are sent as the trainer "
                "holds them (set [engine] sync_dtype to cast them before they leave)"
            )
        return found

    # -- helpers --------------------------------------------------------------

    def _get(self, root: str, route: str, params: dict[str, Any] | None = None) -> Any:
        try:
            r = self.http.get(root + route, params=params)
        except httpx.HTTPError as e:
            raise WeightSyncError(f"{root}{route}: {type(e).__name__}: {e}") from e
        if r.status_code != 200:
            raise WeightSyncError(f"{root}{route} answered {r.status_code}: {r.text[:500]}")
        try:
            return r.json()
        except ValueError as e:
            raise WeightSyncError(f"{root}{route} answered no JSON: {r.text[:200]!r}") from e

    def _one_dtype(self, read: Callable[[str], str]) -> str:
        """``read`` on every engine; they must agree (one trainer sends one dtype)."""
        found = dict(zip(self.roots, self._all(read), strict=True))
        if len(set(found.values())) > 1:
            raise WeightSyncError(
                f"the engines hold weights in different dtypes ({found}): the trainer sends "
                "one; start them with the same --dtype"
            )
        return next(iter(found.values()))

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


class EmbeddedSync(WeightSync):
    """``lightning serve``'s ``POST /admin/load_weights``, with the engine's key
    (``key``, else ``$LIGHTNING_ENGINE_KEY``): every route of it but ``/health``
    needs one."""

    def __init__(
        self, roots: Sequence[str], *, timeout_s: float = 600.0, key: str | None = None
    ) -> None:
        super().__init__(roots, timeout_s=timeout_s)
        key = key or os.environ.get("LIGHTNING_ENGINE_KEY")
        if key:
            self.http.headers["Authorization"] = f"Bearer {key}"

    def push(self, update: WeightUpdate) -> None:
        path = update.disk_path("weight_sync = 'embedded'")
        body = {"path": str(path.resolve()), "version": update.version}
        self._all(lambda root: self._post(root, "/admin/load_weights", body))


class NoSync(WeightSync):
    """Engines that are not updated (evaluation-only runs, LoRA served elsewhere)."""

    def push(self, update: WeightUpdate) -> None:
        log.info("weight sync disabled: engines keep their weights (version %d)", update.version)


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
