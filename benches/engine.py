"""Engine throughput: concurrent chat requests, batched scheduler vs one at a time.

SmolLM2-135M-Instruct on this machine's CPU, through the HTTP server and the
real OpenAI SDK. For each concurrency C (default 1, 8, 32) it sends C chat
requests at once, each forced to 64 new tokens (``ignore_eos``), twice in the
same process: with the continuous-batching scheduler (max_batch = 32) and with
max_batch = 1 (requests served strictly one at a time), and prints tokens/s and
the ratio. Run: ``.venv/bin/python benches/engine.py [--concurrency 1 8 32]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import time

import openai
from lightning.engine import Engine
from lightning.engine.server import RunningServer
from lightning.models import smollm2_dir


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
    import torch

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"machine: {cpu}, {os.cpu_count()} cpus, torch {torch.__version__} "
        f"threads={torch.get_num_threads()}, load1={load:.1f}, commit {commit or '?'}"
    )


async def burst(client: openai.AsyncOpenAI, concurrency: int, tokens: int) -> tuple[int, float]:
    async def one(i: int) -> int:
        resp = await client.chat.completions.create(
            model="",
            messages=[{"role": "user", "content": f"Write a short story about lighthouse {i}."}],
            max_tokens=tokens,
            temperature=1.0,
            seed=i,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return len(resp.choices[0].model_extra["token_ids"])

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(concurrency)))
    return sum(counts), time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=32)
    args = parser.parse_args()
    engine = Engine(smollm2_dir(), max_batch=args.max_batch)
    print(machine())
    print(f"model: {engine.model_name} on {engine.device}, {args.tokens} new tokens per request")
    with RunningServer(engine) as server:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

        async def run() -> None:
            await burst(client, 2, 4)  # warm up
            print(f"{'C':>4} {'batched tok/s':>14} {'one-at-a-time tok/s':>20} {'ratio':>7}")
            for c in args.concurrency:
                engine.max_batch = args.max_batch
                n_b, t_b = await burst(client, c, args.tokens)
                engine.max_batch = 1
                n_s, t_s = await burst(client, c, args.tokens)
                engine.max_batch = args.max_batch
                rb, rs = n_b / t_b, n_s / t_s
                print(f"{c:>4} {rb:>14.1f} {rs:>20.1f} {rb / rs:>6.2f}x", flush=True)

        asyncio.run(run())
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
