"""Prepacked oneDNN matmuls for CPU decode.

A decode step multiplies a few activation rows (one per running sequence) by
every weight matrix of the model. PyTorch's ``F.linear`` on CPU re-lays out
(packs) the weight inside MKL on every call; for the few-row shapes of decode
that packing and the generic blocking cost up to half the time (measured on
SmolLM2-135M, 2-core AVX-512 EPYC, one thread: the 49152x576 LM head at 32 rows
took 37 ms with ``F.linear`` and 21 ms prepacked). oneDNN can pack a weight once
into its own blocked layout (``torch.ops.mkldnn._reorder_linear_weight``) and
reuse it (``torch.ops.mkldnn._linear_pointwise``): the same path PyTorch's
inductor takes for frozen CPU linears, without compiling anything.

The result is the same product in float32 with a different summation order
(measured max abs difference to a float64 reference about 5e-6 per matmul, as
for ``F.linear``), so logprobs still match a plain transformers forward within
the engine's 1e-4 contract (tests/engine/test_engine_smollm2.py).

The packed copy is derived state: after the weights change in place
(``load_state_dict``), call :func:`repack`.
"""

from __future__ import annotations

import torch
from torch import nn


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether prepacking applies: float32 on a CPU build with oneDNN's linear ops."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` that multiplies by a oneDNN-prepacked copy of its weight.

    It shares the original ``weight``/``bias`` Parameters (so state dicts,
    tied weights and ``load_state_dict`` see exactly the module it replaced).
    """

    packed: torch.Tensor

    def __init__(self, base: nn.Linear, batch_hint: int) -> None:
        nn.Module.__init__(self)
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.batch_hint = batch_hint
        self.repack()

    def repack(self) -> None:
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(
                self.weight.detach(), self.batch_hint
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.detach() if self.bias is not None else None
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def pack(model: nn.Module, batch_hint: int) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a PackedLinear; returns how many."""
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear and module.weight.dtype == torch.float32
    ]
    for name, module in targets:
        model.set_submodule(name, PackedLinear(module, batch_hint))
    return len(targets)


def repack(model: nn.Module) -> None:
    """Refresh the packed copies after the weights changed in place."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.repack()
