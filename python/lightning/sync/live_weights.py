"""The trainer's live weights as a stream of full tensors, for weight syncs that
broadcast without disk (``lightning.sync``).

Under FSDP2 each parameter is a ``DTensor`` shard; :class:`LiveWeights` gathers
one whole tensor at a time (``full_tensor()``, a collective every rank joins in
the same order) and only rank 0 keeps it, so no host ever holds the whole model.
:func:`plan_buckets` groups tensors, from their shapes alone, into the units the
engines transfer (an SGLang flattened bucket, a vLLM packed buffer), and
:class:`GatherStats` counts what the sender materialised, so tests and benches can
hold it to "one bucket plus the largest tensor".
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning.sync.kinds import WeightSyncError

if TYPE_CHECKING:
    import torch

# Bytes a push gathers before it hands them to the engines as one unit: one SGLang
# update_weights_from_distributed call (one broadcast of a flattened bucket), one
# vLLM packed buffer. It bounds what the sender holds beyond its shards.
DEFAULT_BUCKET_BYTES = 256 << 20


def _itemsize(dtype: str) -> int:
    import torch

    return int(getattr(torch, dtype).itemsize)


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # a torch dtype attribute name: "bfloat16", "float32", ...
    shape: list[int]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


def meta_of(name: str, t: torch.Tensor) -> TensorMeta:
    return TensorMeta(name, str(t.dtype).removeprefix("torch."), list(t.shape))


def plan_buckets(
    metas: Sequence[TensorMeta], bucket_bytes: int, *, aligned: bool = True
) -> list[list[TensorMeta]]:
    """Consecutive runs of ``metas`` of at most ``bucket_bytes`` each (a tensor larger
    than that is a bucket of its own), in order. ``aligned``: a tensor also starts a
    new bucket where its byte offset in the flattened bucket would not be a multiple
    of its item size, which SGLang's receiver refuses (``FlattenedTensorBucket.empty``
    in sglang 0.5.23 raises "Unaligned received tensor"; the layout has no padding).
    The plan needs only shapes and dtypes, so every rank computes the same one
    without gathering anything."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes = {bucket_bytes}: must be positive")
    buckets: list[list[TensorMeta]] = []
    current: list[TensorMeta] = []
    size = 0
    for m in metas:
        n = m.nbytes
        misaligned = aligned and size % _itemsize(m.dtype) != 0
        if current and (size + n > bucket_bytes or misaligned):
            buckets.append(current)
            current, size = [], 0
        current.append(m)
        size += n
    if current:
        buckets.append(current)
    return buckets


@dataclass
class GatherStats:
    """What a sender materialised for one push, counted per tensor from its creation
    until it is freed (``weakref.finalize``): gathered full tensors, dtype casts,
    packing buffers. A model's own unsharded parameters are not counted (they exist
    anyway); a view that outlives the tensor it was taken from is not either."""

    live_bytes: int = 0
    peak_bytes: int = 0
    materialised_bytes: int = 0
    sent_bytes: int = 0
    largest_bytes: int = 0

    def track(self, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        self.live_bytes += n
        self.materialised_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.largest_bytes = max(self.largest_bytes, n)
        weakref.finalize(t, self._free, n)

    def _free(self, n: int) -> None:
        self.live_bytes -= n


class LiveWeights:
    """A live model's weights as ``(name, full tensor)``, materialised one at a time.

    Built from ``module.state_dict(keep_vars=True)`` (persistent buffers included;
    a tensor reachable under two names, tied embeddings, is sent once, under its
    first name, as ``save_pretrained`` writes it). An FSDP2 ``DTensor`` is gathered
    with ``full_tensor()``, a collective: every rank of the trainer iterates the
    same source in the same order, and only the ``sender`` (rank 0) gets the
    tensors; the others gather and drop them (:meth:`drain`). So the source is
    single-pass, and must be drained on every rank even when a push fails halfway
    (use it as a context manager). Shapes and dtypes (:meth:`metas`) come from the
    global shapes, without gathering.

    ``dtype``: cast floating tensors to it before they are gathered and sent (the
    engine's dtype: :meth:`lightning.sync.WeightSync.engine_dtype`, or
    ``[engine] sync_dtype``); a name (``"bfloat16"``) or a ``torch.dtype``.
    ``stats`` counts what the sender materialised (:class:`GatherStats`)."""

    def __init__(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        *,
        sender: bool = True,
        dtype: torch.dtype | str | None = None,
    ) -> None:
        if isinstance(dtype, str):
            import torch

            dtype = getattr(torch, dtype)
        seen: set[int] = set()
        self._named: list[tuple[str, torch.Tensor]] = []
        for name, t in named:
            if id(t) not in seen:
                seen.add(id(t))
                self._named.append((name, t))
        self.sender = sender
        self.dtype: torch.dtype | None = dtype
        self.stats = GatherStats()
        self._iter: Iterator[tuple[str, torch.Tensor]] | None = None

    @classmethod
    def of_module(
        cls,
        module: torch.nn.Module,
        *,
        sender: bool = True,
        dtype: torch.dtype | str | None = None,
    ) -> LiveWeights:
        return cls(module.state_dict(keep_vars=True).items(), sender=sender, dtype=dtype)

    def metas(self) -> list[TensorMeta]:
        out = []
        for name, t in self._named:
            dtype = self.dtype if self._casts(t) else t.dtype
            out.append(TensorMeta(name, str(dtype).removeprefix("torch."), list(t.shape)))
        return out

    def _casts(self, t: torch.Tensor) -> bool:
        return self.dtype is not None and t.is_floating_point() and t.dtype != self.dtype

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._iter is not None:
            raise WeightSyncError(
                "LiveWeights is single-pass (its gathers are collectives the other ranks "
                "run once): read shapes with metas(), iterate tensors() once"
            )
        self._iter = self._gather()
        return self._iter

    def _gather(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._named:
            t = t.detach()
            cast = self._casts(t)
            if cast:
                # The shard is cast before the gather (a DTensor casts shard-wise), so
                # FSDP2's all-gather and everything after it move the engine's dtype:
                # half the bytes of float32 masters for a bf16 engine. Rounding is
                # elementwise, so this equals casting the gathered tensor.
                t = t.to(self.dtype)
            fresh = hasattr(t, "full_tensor")
            full = t.full_tensor() if fresh else t  # type: ignore[attr-defined]
            fresh = fresh or cast
            if fresh and self.sender:
                self.stats.track(full)
            if self.sender:
                yield name, full
            del full, t

    def drain(self) -> None:
        """Run the gathers not run yet (all of them on a rank that sends nothing)."""
        it = self._iter if self._iter is not None else self.tensors()
        for _ in it:
            pass

    def __enter__(self) -> LiveWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.drain()
