"""The real Codex CLI's first two model calls through the gateway, prefix cache on vs off.

For each variant (the embedded engine with its prefix cache on, 1 GiB, and off,
``kv_cache_bytes=0``; both in this run) it starts SmolLM2-135M-Instruct in
float32 behind the engine module's HTTP app with the ChatML tool template, a
recording gateway in front of it, and one rollout; then the pinned Codex CLI
(tests/support/codex_cli.py installs it) pointed at the rollout exactly as
examples/codex_agent.py points it, and runs:

1. ``codex exec PROMPT`` in a fresh directory: call 1 (~9.2k prompt tokens:
   Codex's instructions, environment context and tool list);
2. ``codex exec resume --last FOLLOW_UP`` in the same directory: call 2, the
   same session's whole history (call 1's prompt and answer) plus the new user
   message. SmolLM2 answers Codex in text rather than calling a tool, so Codex
   ends its turn after one call; a second turn of the same session is the
   honest way to get a call that extends the first.

Per call it prints the prompt tokens (as recorded by the gateway), the tokens
the engine computed and the tokens it took from its prefix cache (the engine's
``prefill_tokens`` / ``prefill_cached_tokens`` counters, read before and after
the call), the time to first token and the total at the engine's HTTP door, and
the process CPU-seconds the call cost (engine and gateway run in this process;
the figure a loaded machine moves least), then the off/on ratios.

Two departures from a plain ``lightning serve``, both needed on SmolLM2:
- Codex 0.171's first prompt (~9.2k tokens with SmolLM2's tokenizer) does not
  fit SmolLM2's 8,192 positions, so the engine loads a copy of the model whose
  ``config.json`` says 16,384 (the weights are the same files, linked). RoPE
  past 8k is extrapolation: the answers there mean little, but the compute per
  token (what this bench measures) is exactly the model's.
- Codex sends no output budget and 0.171's config has no key for one, so the
  engine would answer up to the context's end. The bench's HTTP door adds
  ``max_tokens = --max-tokens`` (default 32) to a chat request that has none,
  so the bench measures prefill, not a long decode. An answer cut there is
  ``incomplete`` to Codex, which then exits 1 after the call is recorded (its
  session keeps the cut answer, so the second turn still extends it); the bench
  reports Codex's exit codes and counts the calls the gateway recorded. The door
  also adds ``seed = 0`` (Codex sends none): the engine samples the same tokens
  with the cache on and off, so both variants see the same answers and the same
  second prompt, and the bench checks that they do.

Run: ``nice -n 19 .venv/bin/python benches/codex_prefix.py [--variants on off]
[--max-tokens 32] [--threads N]``. Needs npm (first run: installs Codex) and
``$LIGHTNING_CACHE`` with SmolLM2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(ROOT / "benches"))

from codex_cli import codex_env, codex_executable, write_codex_home  # noqa: E402
from engine import machine  # noqa: E402
from lightning import Gateway, GatewayConfig  # noqa: E402
from lightning.engine import Engine  # noqa: E402
from lightning.engine.server import AppServer, build_app  # noqa: E402
from lightning.engine.tools import CHATML_TOOLS_TEMPLATE  # noqa: E402
from lightning.model_cache import smollm2_dir  # noqa: E402

CONTEXT = 16384
MODEL = "lightning"
TASK = "Write the word hello into hello.txt using the shell."
FOLLOW_UP = "Now also write the word world into world.txt."

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass
class CallTiming:
    """One chat call as the engine's HTTP door saw it."""

    max_tokens_added: bool
    ttft_s: float = float("nan")
    total_s: float = float("nan")
    cpu_s: float = float("nan")
    computed: int = 0  # prompt tokens the engine prefilled
    cached: int = 0  # prompt tokens it took from the prefix cache
    generated: int = 0


def with_budget(body: bytes, cap: int, seed: int) -> tuple[bytes, bool]:
    """The chat request ``body`` with ``max_tokens = cap`` when it names no budget,
    and ``seed`` when it names none; True when the budget was added."""
    request = json.loads(body)
    if not isinstance(request, dict):
        return body, False
    added = request.get("max_tokens") is None and request.get("max_completion_tokens") is None
    if added:
        request["max_tokens"] = cap
    if request.get("seed") is None:
        request["seed"] = seed
    return json.dumps(request).encode(), added


class TimedDoor:
    """ASGI wrapper around the engine's app: caps the output budget of chat calls
    and seeds them (``with_budget``), and times each one. The first body bytes of the answer
    are its first token: the engine's stream sends nothing before it has one."""

    def __init__(self, app: ASGIApp, engine: Engine, cap: int) -> None:
        self.app, self.engine, self.cap = app, engine, cap
        self.calls: list[CallTiming] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            await self.app(scope, receive, send)
            return
        parts = []
        while True:
            message = await receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body, added = with_budget(b"".join(parts), self.cap, seed=0)
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        call = CallTiming(max_tokens_added=added)
        before = dict(self.engine.stats)
        start, cpu = time.perf_counter(), time.process_time()

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.body":
                now = time.perf_counter()
                if message.get("body") and call.ttft_s != call.ttft_s:
                    call.ttft_s = now - start
                if not message.get("more_body"):
                    call.total_s = now - start
                    call.cpu_s = time.process_time() - cpu
                    after = self.engine.stats
                    call.computed = after["prefill_tokens"] - before["prefill_tokens"]
                    call.cached = after["prefill_cached_tokens"] - before["prefill_cached_tokens"]
                    call.generated = after["generated_tokens"] - before["generated_tokens"]
            await send(message)

        self.calls.append(call)
        await self.app(scope, replay, timed_send)


def long_context_copy(source: Path, target: Path, positions: int) -> Path:
    """``source``'s files linked into ``target``, with ``max_position_embeddings``
    raised to ``positions`` in its config (see the module docstring)."""
    target.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.name != "config.json":
            (target / f.name).symlink_to(f)
    config = json.loads((source / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def run_codex(argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> int:
    done = subprocess.run(
        argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        print(f"  codex exited {done.returncode}: {' | '.join(tail)}", flush=True)
    return done.returncode


Calls = list[tuple[list[int], list[int]]]  # (prompt ids, completion ids) per recorded call
Result = tuple[list[CallTiming], Calls, list[int]]


def variant(name: str, model: Path, codex: Path, tmp: Path, args: argparse.Namespace) -> Result:
    """One engine + gateway + rollout; Codex's two turns. Returns the door's call
    timings, the ids the gateway recorded, and Codex's exit codes."""
    engine = Engine(
        str(model),
        dtype="float32",
        max_batch=4,
        served_model_name=MODEL,
        num_threads=args.threads,
        max_model_len=CONTEXT,
        chat_template=str(CHATML_TOOLS_TEMPLATE),
        kv_cache_bytes=args.kv_cache_bytes if name == "on" else 0,
    ).start()
    door = TimedDoor(build_app(engine), engine, args.max_tokens)
    server = AppServer(door)
    gateway = Gateway(
        GatewayConfig(
            listen="127.0.0.1:0",
            upstreams=[{"url": server.url, "weight_version": 0}],
            db=str(tmp / f"{name}.db"),
            # A cold 9k-token prefill on a loaded CPU takes minutes: never cut or retry it.
            upstream_timeout_s=3600.0,
            max_retries=0,
        )
    ).start()
    client = gateway.client()
    try:
        rollout = client.create_rollout({"task": TASK}, group=f"codex-prefix-{name}")
        # The same paths for both variants: Codex puts its working directory in the
        # prompt, and the two must send the same prompt ids.
        run = tmp / "run"
        shutil.rmtree(run, ignore_errors=True)
        home = write_codex_home(run / "home", base_url=rollout.base_url, model=MODEL)
        env = codex_env(home, rollout.token)
        work = run / "work"
        work.mkdir()
        # Session files are kept (no --ephemeral) so that the second turn can resume.
        common = [
            "--strict-config",
            "--skip-git-repo-check",
            "-c",
            "model_providers.lightning.stream_idle_timeout_ms=3600000",
        ]
        first = [str(codex), "exec", *common, "--color", "never", "-C", str(work), TASK]
        second = [str(codex), "exec", "resume", *common, "--last", FOLLOW_UP]
        codes = []
        for turn, argv in enumerate((first, second), 1):
            print(f"[{name}] turn {turn}: codex exec{' resume' if turn == 2 else ''}", flush=True)
            codes.append(run_codex(argv, env, work, args.timeout))
        recorded = [
            (
                [] if r.prompt_ids is None else r.prompt_ids.tolist(),
                [] if r.completion_ids is None else r.completion_ids.tolist(),
            )
            for r in client.records(rollout.id)
        ]
        return list(door.calls), recorded, codes
    finally:
        client.close()
        gateway.stop()
        server.stop()
        engine.close()


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def report(results: dict[str, Result]) -> None:
    print(
        f"\n{'cache':>5} {'call':>4} {'prompt':>7} {'computed':>8} {'cached':>7} {'gen':>4}"
        f" {'TTFT':>8} {'total':>8} {'cpu-s':>7}"
    )
    for name, (calls, recorded, codes) in results.items():
        for i, c in enumerate(calls):
            prompt = len(recorded[i][0]) if i < len(recorded) else -1
            print(
                f"{name:>5} {i + 1:>4} {prompt:>7} {c.computed:>8} {c.cached:>7} {c.generated:>4}"
                f" {c.ttft_s:>7.1f}s {c.total_s:>7.1f}s {c.cpu_s:>7.1f}",
                flush=True,
            )
        print(f"{name:>5} codex exit codes {codes}; gateway recorded {len(recorded)} calls")
        if len(recorded) >= 2:
            (p1, c1), (p2, _) = recorded[0], recorded[1]
            print(
                f"{name:>5} call 2's first {shared_prefix(p1 + c1, p2)} of {len(p2)} prompt tokens"
                f" are call 1's prompt + answer ({len(p1)} + {len(c1)})"
            )
    if {"on", "off"} <= results.keys():
        on, off = results["on"], results["off"]
        print(f"the same ids recorded with the cache on and off: {on[1] == off[1]}")
        for i in range(min(len(on[0]), len(off[0]))):
            a, b = on[0][i], off[0][i]
            print(
                f"call {i + 1}: off/on TTFT {b.ttft_s / a.ttft_s:.2f}x, total "
                f"{b.total_s / a.total_s:.2f}x, cpu-s {b.cpu_s / a.cpu_s:.2f}x"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", choices=["on", "off"], default=["on", "off"])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    parser.add_argument("--threads", type=int, default=None, help="default: cores")
    parser.add_argument("--timeout", type=float, default=3600.0, help="per codex turn, seconds")
    args = parser.parse_args()
    codex = codex_executable()
    print(machine(), flush=True)
    print(
        f"SmolLM2-135M-Instruct float32, context {CONTEXT} (config copy), ChatML tool template;"
        f" max_tokens {args.max_tokens} added where Codex sends none; cache on ="
        f" {args.kv_cache_bytes >> 20} MiB",
        flush=True,
    )
    results = {}
    with tempfile.TemporaryDirectory(prefix="codex-prefix-") as raw:
        tmp = Path(raw)
        model = long_context_copy(smollm2_dir(), tmp / "smollm2-16k", CONTEXT)
        for name in args.variants:
            results[name] = variant(name, model, codex, tmp, args)
    report(results)
    print(f"after: {machine()}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
