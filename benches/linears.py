"""What the CPU's matmul kernels allow a decode step: the model's linears alone.

A decode step of B rows multiplies B activation rows by every weight of the
model once. This bench runs exactly those matmuls (SmolLM2-135M's shapes as
the fused engine packs them: per layer q/k/v 960x576, o 576x576, gate/up
3072x576, down 576x1536; then the 49152x576 LM head) on random rows, nothing
else, and reports per kernel:

- ``streamed``: all 121 weights in model order, each read once per pass, as a
  decode step reads them (538 MB in float32: more than stays in cache);
- ``in cache``: one weight of each shape, repeated (its 2-7 MB stay in cache).

Kernels: oneDNN prepacked (what the engine uses, ``lightning/engine/linear.py``),
``F.linear``, ``mm`` on a pre-transposed copy, and oneDNN prepacked in
bfloat16 (AMX where the CPU has it). Limits measured in the same run: a
1024-cube float32 ``mm`` and a 256 MiB ``sum`` (``benches/engine.py``'s ``limits``).

Run: ``python benches/linears.py [--batch 32] [--threads N]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

# benches/engine.py: the machine's limits, measured the same way in both benches.
from engine import best_of, limits

HIDDEN, WIDTH, INNER, QKV, VOCAB, LAYERS = 576, 576, 1536, 960, 49152, 30
# (out, in) of each weight in the order a forward reads them.
SHAPES = [(QKV, HIDDEN), (HIDDEN, WIDTH), (2 * INNER, HIDDEN), (HIDDEN, INNER)] * LAYERS + [
    (VOCAB, HIDDEN)
]


def packed(w: torch.Tensor, batch: int) -> Callable[[torch.Tensor], torch.Tensor]:
    p = torch.ops.mkldnn._reorder_linear_weight(w, batch)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")


def kernels(batch: int) -> dict[str, Callable[[torch.Tensor], Callable[[torch.Tensor], object]]]:
    def transposed(w: torch.Tensor) -> Callable[[torch.Tensor], object]:
        t = w.t().contiguous()
        return lambda x: torch.mm(x, t)

    return {
        "oneDNN prepacked": lambda w: packed(w, batch),
        "F.linear": lambda w: lambda x: F.linear(x, w),
        "mm, transposed": transposed,
        "oneDNN prepacked bf16": lambda w: packed(w.to(torch.bfloat16), batch),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    b = args.batch
    lim = limits()
    peak, bandwidth = lim["flops_wall"], lim["bandwidth_wall"]
    flops = sum(2.0 * b * n * k for n, k in SHAPES)
    weight_bytes = sum(4 * n * k for n, k in SHAPES)
    print(
        f"torch {torch.__version__}, threads={torch.get_num_threads()}, B={b}: matmul limit "
        f"{peak / 1e9:.0f} GFLOP/s, read bandwidth {bandwidth / 1e9:.1f} GB/s; one pass = "
        f"{flops / 1e9:.2f} GFLOP over {weight_bytes / 1e6:.0f} MB of float32 weights"
    )
    print(f"{'kernel':>22} {'streamed ms':>12} {'GFLOP/s':>8} {'of limit':>9} {'weights GB/s':>13}"
          f" {'in cache GFLOP/s':>17}")  # fmt: skip
    with torch.inference_mode():
        for name, make in kernels(b).items():
            dtype = torch.bfloat16 if "bf16" in name else torch.float32
            rows = {k: torch.randn(b, k, dtype=dtype) for k in {k for _, k in SHAPES}}
            calls = [(make(torch.randn(n, k)), rows[k]) for n, k in SHAPES]

            def streamed(calls: list = calls) -> None:
                for f, x in calls:
                    f(x)

            seconds = best_of(streamed, time.perf_counter)
            del calls
            cached_s = 0.0
            for n, k in dict.fromkeys(SHAPES):
                f, x = make(torch.randn(n, k)), rows[k]
                cached_s += SHAPES.count((n, k)) * best_of(
                    lambda f=f, x=x: f(x), time.perf_counter, 20
                )
            rate = flops / seconds
            read = weight_bytes / (2 if dtype == torch.bfloat16 else 1) / seconds
            print(
                f"{name:>22} {seconds * 1e3:>12.1f} {rate / 1e9:>8.0f} {100 * rate / peak:>8.0f}%"
                f" {read / 1e9:>13.1f} {flops / cached_s / 1e9:>17.0f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
