"""Engine decode speed against the machine's own limits, new engine vs the plain one.

SmolLM2-135M-Instruct on this machine's CPU. For each batch size B (default 1,
8, 32) it sends B chat requests at once through the HTTP server and the real
OpenAI SDK, each forced to 64 new tokens (``ignore_eos``), and also runs the
same B sequences in-process (``generate_many``, no HTTP). It does so for the
engine as it ships (weights prepacked for oneDNN, batched sampling) and for the
baseline engine with ``prepack=False`` (plain ``F.linear``), in the same run.

Measured in the same process, with the engine's thread count:
- matmul FLOP/s: a 1024x1024 float32 ``torch.mm`` (best of 5);
- read bandwidth: ``sum`` over a 256 MiB float32 tensor (best of 5).

Printed per row: tokens/s (wall), tokens per CPU-second of this process (the
figure that moves least when neighbours load a shared machine), the fraction of
the compute roofline reached (model FLOPs per token x tokens/s / matmul FLOP/s)
and, for B = 1, the fraction of the memory bound (weight bytes read per token x
tokens/s / bandwidth): at batch 1 every weight is read once per token.

Run: ``python benches/engine.py [--batch 1 8 32] [--tokens 64]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import time
from collections.abc import Callable
from typing import Any

import openai
import torch

from lightning.engine import Engine, SamplingParams
from lightning.engine.server import RunningServer
from lightning.model_cache import smollm2_dir


def machine() -> str:
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        commit = "?"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"machine: {cpu}, {os.cpu_count()} cpus, torch {torch.__version__} "
        f"threads={torch.get_num_threads()}, load1={load:.1f}, commit {commit or '?'}"
    )


def best_of(fn: Callable[[], object], clock: Callable[[], float], n: int = 5) -> float:
    fn()
    times = []
    for _ in range(n):
        t = clock()
        fn()
        times.append(clock() - t)
    return min(times)


def limits() -> dict[str, float]:
    """Matmul FLOP/s and read bandwidth, per wall second and per CPU-second."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    x = torch.ones(64 * 2**20)  # 256 MiB
    out = {}
    for clock_name, clock in (("wall", time.perf_counter), ("cpu", time.process_time)):
        out[f"flops_{clock_name}"] = 2 * 1024**3 / best_of(lambda: torch.mm(a, b), clock)
        out[f"bandwidth_{clock_name}"] = x.numel() * 4 / best_of(lambda: x.sum(), clock)
    return out


def model_cost(engine: Engine, context: int) -> tuple[float, float]:
    """(FLOPs, weight bytes) per decoded token at ``context`` tokens of KV cache.

    FLOPs: 2 per multiply-add of every linear layer (LM head included) plus the
    attention scores and the weighted sum over the cache (4 x layers x context x
    attention width). Bytes: every linear weight once (the embedding lookup reads
    one row; with tied embeddings the LM head reads them all and is counted).
    """
    weights = [m.weight for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
    params = sum(w.numel() for w in weights)
    cfg = engine.model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attention = 4 * cfg.num_hidden_layers * context * cfg.num_attention_heads * head_dim
    return 2.0 * params + attention, float(sum(w.numel() * w.element_size() for w in weights))


def prompts_for(engine: Engine, batch: int) -> list[list[int]]:
    return [
        engine.chat_prompt_ids([{"role": "user", "content": f"Write a short story about {i}."}])
        for i in range(batch)
    ]


async def http_burst(url: str, batch: int, tokens: int) -> tuple[int, float, float]:
    client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)

    async def one(i: int) -> int:
        resp = await client.chat.completions.create(
            model="",
            messages=[{"role": "user", "content": f"Write a short story about {i}."}],
            max_tokens=tokens,
            temperature=1.0,
            seed=i,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return len(resp.choices[0].model_extra["token_ids"])

    start, cpu0 = time.perf_counter(), os.times()
    counts = await asyncio.gather(*(one(i) for i in range(batch)))
    cpu1 = os.times()
    await client.close()
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return sum(counts), time.perf_counter() - start, cpu


def local_burst(engine: Engine, batch: int, tokens: int) -> tuple[int, float, float]:
    params = SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True, seed=0)
    prompts = prompts_for(engine, batch)
    start, cpu0 = time.perf_counter(), os.times()
    results = engine.generate_many(prompts, params)
    cpu1 = os.times()
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return sum(len(r.token_ids) for r in results), time.perf_counter() - start, cpu


def run_variant(
    name: str, engine: Engine, args: argparse.Namespace, limits: dict[str, float]
) -> dict[int, float]:
    flops, nbytes = model_cost(engine, context=30 + args.tokens // 2)
    rates: dict[int, float] = {}
    with RunningServer(engine) as server:
        url = server.url + "/v1"
        asyncio.run(http_burst(url, 2, 4))  # warm up
        for b in args.batch:
            results: dict[str, Any] = {
                "http": asyncio.run(http_burst(url, b, args.tokens)),
                "in-process": local_burst(engine, b, args.tokens),
            }
            for path, (n, wall, cpu) in results.items():
                rate, per_cpu = n / wall, n / cpu
                roof = 100 * flops * rate / limits["flops_wall"]
                roof_cpu = 100 * flops * per_cpu / limits["flops_cpu"]
                bound = ""
                if b == 1:
                    mem = 100 * nbytes * rate / limits["bandwidth_wall"]
                    mem_cpu = 100 * nbytes * per_cpu / limits["bandwidth_cpu"]
                    bound = f" {mem:>7.1f}% {mem_cpu:>7.1f}%"
                print(
                    f"{name:>9} {path:>10} {b:>4} {rate:>9.1f} {per_cpu:>10.1f}"
                    f" {roof:>7.1f}% {roof_cpu:>7.1f}%{bound}",
                    flush=True,
                )
                if path == "http":
                    rates[b] = rate
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="default: cores")
    args = parser.parse_args()
    model = smollm2_dir()
    engines = {
        "prepacked": Engine(model, max_batch=max(args.batch), num_threads=args.threads),
        "plain": Engine(model, max_batch=max(args.batch), num_threads=args.threads, prepack=False),
    }
    print(machine())
    lim = limits()
    flops, nbytes = model_cost(engines["plain"], context=30 + args.tokens // 2)
    print(
        f"limits: matmul {lim['flops_wall'] / 1e9:.1f} GFLOP/s ({lim['flops_cpu'] / 1e9:.1f} per "
        f"CPU-s), read bandwidth {lim['bandwidth_wall'] / 1e9:.1f} GB/s "
        f"({lim['bandwidth_cpu'] / 1e9:.1f} per CPU-s)"
    )
    print(
        f"model: {flops / 1e6:.0f} MFLOP and {nbytes / 1e6:.0f} MB of weights per token; "
        f"batch-1 bounds: compute {lim['flops_wall'] / flops:.0f} tok/s, memory "
        f"{lim['bandwidth_wall'] / nbytes:.0f} tok/s; {args.tokens} new tokens per request"
    )
    print(
        "roofline = model FLOPs/token x tok/s / matmul FLOP/s; mem = weight bytes/token x "
        "tok/s / bandwidth (B=1); each per wall second and per CPU-second"
    )
    print(
        f"{'engine':>9} {'path':>10} {'B':>4} {'tok/s':>9} {'tok/cpu-s':>10} {'roof':>8}"
        f" {'roof/cpu':>8} {'mem':>8} {'mem/cpu':>8}"
    )
    rates = {}
    for name, engine in engines.items():
        with engine:
            rates[name] = run_variant(name, engine, args, lim)
    for b in args.batch:
        ratio = rates["prepacked"][b] / rates["plain"][b]
        print(f"B={b}: prepacked / plain over HTTP = {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
