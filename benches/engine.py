"""Engine decode speed against the machine's own limits, new engine vs the plain one.

SmolLM2-135M-Instruct on this machine's CPU. For each batch size B (default 1,
8, 32) it sends B chat requests at once through the HTTP server and the real
OpenAI SDK, each forced to 64 new tokens (``ignore_eos``), and also runs the
same B sequences in-process (``generate_many``, no HTTP). Both of those rates
are end to end: they include the B prompts' prefill (~39 tokens each, about as
many FLOPs as 25 of the 64 decode steps at B = 32), which the roofline column
does not count. The ``decode`` row is the decode step alone: in-process, from
the moment every row has its first token until the first row finishes (B rows
in every step), tokens and CPU time counted over that window only.

It does so for three engines in the same run: ``fused`` (as it ships: the lean
fused forward of ``lightning/engine/fused.py`` with prepacked oneDNN weights,
prompts prefilled together), ``prepacked`` (``fuse=False``: transformers'
modules with prepacked linears, the engine before the fused forward) and
``plain`` (``prepack=False``: transformers with plain ``F.linear``).

Measured in the same process, with the engine's thread count:
- matmul FLOP/s: a 1024x1024 float32 ``torch.mm`` (best of 5);
- read bandwidth: ``sum`` over a 256 MiB float32 tensor (best of 5).

- the ceiling of the kernels themselves: the fused engine's own packed
  weights (every layer's q/k/v, o, gate/up and down, then the LM head) applied
  to B random rows in model order, as a decode step applies them, with nothing
  else (best of 5). At B = 32 the step streams all 538 MB of float32 weights
  from memory, and this is the fastest any decode step built on these kernels
  can go on this machine: its fraction of the matmul limit bounds the
  roofline column.

Printed per row: tokens/s (wall), tokens per CPU-second of this process (the
figure that moves least when neighbours load a shared machine), the fraction of
the compute roofline reached (model FLOPs per token x tokens/s / matmul FLOP/s)
and, for B = 1, the fraction of the memory bound (weight bytes read per token x
tokens/s / bandwidth): at batch 1 every weight is read once per token.

Prefix cache (``--only group turns``), the engine with its prefix cache on vs
off (``kv_cache_bytes=0``), in the same run, in-process (no HTTP):

- ``group``: 8 samples of one fresh ~600-token chat prompt submitted together,
  against one sample of another fresh prompt of the same length: time until
  every sample has its first token (the group's prefill) and until all finish.
- ``turns``: a conversation of ``--turns`` turns, each adding ``--turn-tokens``
  new prompt tokens after the previous turn's completion; the time to first
  token of each turn (its prefill) against the turn number. The cache-off
  engine runs only the turns in ``--off-turns`` (each of its turns recomputes
  the whole context, so all 20 would take many minutes on a small CPU); it gets
  the same prompt ids the cache-on engine saw.

Run: ``python benches/engine.py [--only decode group turns] [--batch 1 8 32] [--tokens 64]
[--engines fused prepacked plain]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import openai
import torch

from lightning.engine import Engine, Event, SamplingParams, openmp
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


def linears_alone(engine: Engine, batch: int) -> tuple[float, float]:
    """(seconds, FLOPs) of one pass of the fused engine's packed weights over
    ``batch`` random rows, in model order (best of 5)."""
    fz = engine.fused
    if fz is None:
        raise RuntimeError("the linears-alone ceiling needs the fused engine (--engines fused ...)")
    weights = [w for layer in fz.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    weights.append(fz.head)
    hidden, width = fz.embed.shape[1], fz.heads * fz.head_dim
    # The input width of each: q/k/v and gate/up read the hidden state, o the
    # attention output, down the MLP's inner activation, the LM head the hidden state.
    shapes = [k for layer in fz.layers for k in (hidden, width, hidden, layer.inner)] + [hidden]
    inputs = {k: torch.randn(batch, k) for k in set(shapes)}
    flops = sum(2.0 * batch * k * w.out_features for w, k in zip(weights, shapes, strict=True))

    def one_pass() -> None:
        for w, k in zip(weights, shapes, strict=True):
            w(inputs[k])

    with torch.inference_mode():
        one_pass()
        return best_of(one_pass, time.perf_counter), flops


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


def decode_window(engine: Engine, batch: int, tokens: int) -> tuple[int, float, float]:
    """(tokens, wall s, CPU s) of the decode steps in which all ``batch`` rows run:
    from the last row's first token (the end of the prefills) to the first row's
    last token (that step included)."""
    params = SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True, seed=0)
    done = threading.Event()
    first: set[int] = set()
    marks: dict[str, tuple[float, float, int]] = {}  # wall, CPU, steps run so far
    finished = [0]

    def mark(name: str) -> None:
        if name not in marks:
            t = os.times()
            marks[name] = (time.perf_counter(), t.user + t.system, engine.stats["steps"])

    def sink_for(i: int) -> Callable[[Event], None]:
        # Called on the scheduler thread only: no lock needed.
        def sink(ev: Event) -> None:
            if ev.token is not None:
                first.add(i)
                if len(first) == batch:
                    mark("start")
            if ev.finish_reason is not None or ev.error is not None:
                mark("stop")
                finished[0] += 1
                if finished[0] == batch:
                    done.set()

        return sink

    prompts = prompts_for(engine, batch)
    engine.submit_many([(p, params, sink_for(i)) for i, p in enumerate(prompts)])
    done.wait()
    (w0, c0, s0), (w1, c1, s1) = marks["start"], marks["stop"]
    if s1 <= s0:
        raise RuntimeError(f"no decode step ran with all {batch} rows; raise --tokens")
    return batch * (s1 - s0), w1 - w0, c1 - c0


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
                "decode": decode_window(engine, b, args.tokens),
            }
            for path, (n, wall, cpu) in results.items():
                rate, per_cpu = n / wall, n / cpu
                roof = 100 * flops * rate / limits["flops_wall"]
                roof_cpu = 100 * flops * per_cpu / limits["flops_cpu"]
                bound = ""
                if b == 1 and path != "decode":
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


def timed(engine: Engine, items: list[tuple[list[int], SamplingParams]]) -> tuple[float, float]:
    """Submit every item at once; (seconds until each has its first token, until all finish)."""
    lock = threading.Lock()
    done = threading.Event()
    first: dict[int, float] = {}
    finished: dict[int, float] = {}
    errors: list[str] = []

    def sink_for(i: int) -> Callable[[Event], None]:
        def sink(ev: Event) -> None:
            now = time.perf_counter()
            with lock:
                if ev.token is not None:
                    first.setdefault(i, now)
                if ev.error is not None:
                    errors.append(ev.error)
                if ev.finish_reason is not None or ev.error is not None:
                    finished[i] = now
                    if len(finished) == len(items):
                        done.set()

        return sink

    start = time.perf_counter()
    engine.submit_many([(p, params, sink_for(i)) for i, (p, params) in enumerate(items)])
    done.wait()
    if errors:
        raise RuntimeError(errors[0])
    return max(first.values()) - start, max(finished.values()) - start


def fresh_prompt(engine: Engine, tag: str, words: int) -> list[int]:
    """A chat prompt whose first tokens differ per ``tag`` (so nothing is cached)."""
    body = " ".join(f"item {i}: call lookup(id={i}) returns a record." for i in range(words // 8))
    content = f"Run {tag}. Read these tool docs, then answer.\n{body}"
    return engine.chat_prompt_ids([{"role": "user", "content": content}])


async def http_group(url: str, prompt: list[int], n: int, tokens: int) -> tuple[float, float]:
    """n concurrent streaming completions of one prompt (own seeds), as a GRPO group
    sends them; (seconds until every one has its first token, until all finish)."""
    client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
    start = time.perf_counter()

    async def one(i: int) -> tuple[float, float]:
        stream = await client.completions.create(
            model="",
            prompt=prompt,
            max_tokens=tokens,
            seed=i,
            stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        first = float("nan")
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].model_extra.get("token_ids") and first != first:
                first = time.perf_counter() - start
        return first, time.perf_counter() - start

    times = await asyncio.gather(*(one(i) for i in range(n)))
    await client.close()
    return max(t for t, _ in times), max(t for _, t in times)


def bench_group(engines: dict[str, Engine], args: argparse.Namespace) -> None:
    print(
        f"\n# group over HTTP: {args.group} concurrent streaming requests of one fresh prompt vs "
        f"one request of another; {args.group_tokens} new tokens each; best of {args.repeats}"
    )
    print(
        f"{'cache':>6} {'prompt':>7} {'one TTFT':>9} {'group TTFT':>11} {'ratio':>6}"
        f" {'one total':>10} {'group total':>12} {'ratio':>6}"
    )
    for name, engine in engines.items():
        best: dict[str, float] = {}
        with RunningServer(engine) as server:
            url = server.url + "/v1"
            asyncio.run(http_group(url, [1, 2, 3], 2, 2))  # warm up
            for rep in range(args.repeats):
                one = fresh_prompt(engine, f"{name}-one-{rep}", args.group_words)
                many = fresh_prompt(engine, f"{name}-many-{rep}", args.group_words)
                t1, total1 = asyncio.run(http_group(url, one, 1, args.group_tokens))
                tg, totalg = asyncio.run(http_group(url, many, args.group, args.group_tokens))
                for key, value in (("t1", t1), ("total1", total1), ("tg", tg), ("totalg", totalg)):
                    best[key] = min(best.get(key, float("inf")), value)
        print(
            f"{name:>6} {len(one):>7} {best['t1']:>8.2f}s {best['tg']:>10.2f}s"
            f" {best['tg'] / best['t1']:>5.2f}x {best['total1']:>9.2f}s {best['totalg']:>11.2f}s"
            f" {best['totalg'] / best['total1']:>5.2f}x",
            flush=True,
        )


def bench_turns(engines: dict[str, Engine], args: argparse.Namespace) -> None:
    on, off = engines["on"], engines["off"]
    words = on.tokenizer(
        " ".join(
            f"observation {i}: the file src/mod_{i}.py has {i * 7} lines." for i in range(4000)
        ),
        add_special_tokens=False,
    )["input_ids"]
    params = SamplingParams(max_tokens=args.turn_completion, ignore_eos=True, seed=0)
    print(
        f"\n# turns: {args.turns} turns, {args.turn_tokens} new prompt tokens + "
        f"{args.turn_completion} generated per turn; time to first token = the turn's prefill"
    )
    print(
        f"{'turn':>4} {'context':>8} {'cache on':>9} {'cpu-s':>6} {'computed':>9}"
        f" {'cache off':>10} {'cpu-s':>6} {'off/on':>7}"
    )
    prompt: list[int] = []
    firsts: dict[int, float] = {}
    for turn in range(1, args.turns + 1):
        new = words[(turn - 1) * args.turn_tokens : turn * args.turn_tokens]
        prompt = prompt + new
        before = on.stats["prefill_tokens"]
        cpu = time.process_time()
        ttft, _ = timed(on, [(prompt, params)])
        cpu = time.process_time() - cpu  # the whole request: prefill + 8 decode steps
        computed = on.stats["prefill_tokens"] - before
        firsts[turn] = ttft
        off_col = ""
        if turn in args.off_turns:
            cpu_off = time.process_time()
            ttft_off, _ = timed(off, [(prompt, params)])
            cpu_off = time.process_time() - cpu_off
            off_col = f" {ttft_off:>9.2f}s {cpu_off:>6.1f} {ttft_off / ttft:>6.1f}x"
        print(
            f"{turn:>4} {len(prompt):>8} {ttft:>8.2f}s {cpu:>6.1f} {computed:>9}{off_col}",
            flush=True,
        )
        result = on.generate(prompt, params)  # the same seed: the same completion
        prompt = prompt + result.token_ids
    later = [firsts[t] for t in firsts if t >= 2]
    if later:
        print(
            f"cache on: turn {args.turns} prefill / turn 2 = {firsts[args.turns] / firsts[2]:.2f}x "
            f"(flat = 1.0); {on.status()['kv_cache_bytes'] / 2**20:.0f} MiB cached"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", default=["decode", "group", "turns"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="default: cores")
    parser.add_argument(
        "--engines", nargs="+", default=["fused", "prepacked", "plain"], help="decode variants"
    )
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--group-words", type=int, default=320, help="~600 prompt tokens")
    parser.add_argument("--group-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    # SmolLM2 has 8,192 positions: 20 turns of 500 new tokens would not fit.
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--turn-tokens", type=int, default=380)
    parser.add_argument("--turn-completion", type=int, default=8)
    parser.add_argument("--off-turns", type=int, nargs="*", default=[1, 2, 10, 20])
    args = parser.parse_args()
    model = smollm2_dir()
    print(machine())
    if "group" in args.only or "turns" in args.only:
        cached = {
            "on": Engine(model, max_batch=max(args.group, 8), num_threads=args.threads),
            "off": Engine(
                model, max_batch=max(args.group, 8), num_threads=args.threads, kv_cache_bytes=0
            ),
        }
        for engine in cached.values():
            engine.start()
        try:
            if "group" in args.only:
                bench_group(cached, args)
            if "turns" in args.only:
                bench_turns(cached, args)
        finally:
            for engine in cached.values():
                engine.close()
        print(f"after: {machine()}")
    if "decode" not in args.only:
        return 0
    options: dict[str, dict[str, Any]] = {
        "fused": {},
        "prepacked": {"fuse": False},
        "plain": {"prepack": False},
    }
    engines = {
        name: Engine(model, max_batch=max(args.batch), num_threads=args.threads, **options[name])
        for name in args.engines
    }
    lim = limits()
    flops, nbytes = model_cost(next(iter(engines.values())), context=30 + args.tokens // 2)
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
    if "fused" in engines:
        for b in args.batch:
            seconds, lin_flops = linears_alone(engines["fused"], b)
            print(
                f"linears alone, B={b}: {seconds * 1e3:.1f} ms per pass, "
                f"{lin_flops / seconds / 1e9:.0f} GFLOP/s = "
                f"{100 * lin_flops / seconds / lim['flops_wall']:.0f}% of the matmul limit "
                "(the ceiling of the roofline column at this B)"
            )
    # The measurements above ran parallel regions on this thread; its OpenMP pool
    # would throttle the engines' scheduler threads (lightning/engine/openmp.py).
    openmp.release_workers()
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
    base = args.engines[-1]
    for name in args.engines[:-1]:
        for b in args.batch:
            print(f"B={b}: {name} / {base} over HTTP = {rates[name][b] / rates[base][b]:.2f}x")
    print(f"after: {machine()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
