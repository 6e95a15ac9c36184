"""Gateway CPU per forwarded SSE event, per protocol, in microseconds: the
issue's unit (<= 2 us an event), where ``gateway_instructions.py`` counts
instructions. The gateway (one tokio worker, CPU 0, ``sync=full``) serves
CONCURRENCY streaming connections from the closed-loop load generator (CPU 1)
in front of the static engine, first streaming 200 completion events a call,
then (the upstream swapped through the admin API) 400. Its CPU seconds per
call (from /proc, all threads) at each length give the per-event cost,
(cpu/call at 400 - cpu/call at 200) / 200, for chat passthrough and for the
Responses and Messages adapters translating the same engine stream. Each point
runs ROUNDS times, interleaved, and the median is reported: the machine may be
shared, and CPU seconds move less with other tenants' load than wall time.

    python benches/gateway_event_cpu.py [GATEWAY_BINARY]   # default: this build

Compare two builds by running it once per binary on the same machine.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_instructions import point_at, translated_bodies, upstream
from gateway_load import (
    ADMIN,
    TARGET,
    bench_dir,
    build,
    commit,
    cpu_seconds,
    gateway_args,
    load,
    machine,
    stop_servers,
    stream_body,
    wait_http,
)

SECONDS = float(os.environ.get("GATEWAY_BENCH_SECONDS", "4"))
CONCURRENCY = int(os.environ.get("GATEWAY_BENCH_CONCURRENCY", "64"))
ROUNDS = int(os.environ.get("GATEWAY_BENCH_ROUNDS", "3"))


def cpu_per_call(pid: int, url: str, body: Path, token: str) -> float:
    """Gateway CPU seconds per call over SECONDS of closed-loop streaming calls."""
    load(url, CONCURRENCY, body, token, 1.0)  # warm-up
    c0 = cpu_seconds(pid)
    out = load(url, CONCURRENCY, body, token, SECONDS)
    if out["errors"]:
        raise RuntimeError(f"load saw errors: {out}")
    return (cpu_seconds(pid) - c0) / out["requests"]


def main() -> int:
    binary = Path(sys.argv[1]) if len(sys.argv) > 1 else TARGET / "lightning-gateway"
    if len(sys.argv) <= 1:
        build()
    print(f"machine: {machine()}")
    print(f"commit:  {commit()}; gateway binary {binary}")
    print(
        f"setup:   {CONCURRENCY} streaming connections, {SECONDS:.0f} s a point, median of {ROUNDS}"
    )
    tmp = bench_dir("lightning-event-cpu-")
    chat = tmp / "body_stream.json"
    chat.write_bytes(stream_body())
    bodies = {"chat": ("/v1/chat/completions", chat), **translated_bodies(tmp)}
    ups = [upstream(200), upstream(400)]
    port = 19500 + os.getpid() % 400
    gw = subprocess.Popen(
        ["taskset", "-c", "0",
         *gateway_args(binary, port, f"http://127.0.0.1:{ups[0][1]}/v1", tmp / "bench.db", sync="full")],
        stderr=subprocess.DEVNULL,
        env=dict(os.environ, RUST_LOG="warn"),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    admin = {"Authorization": f"Bearer {ADMIN}"}
    samples: dict[tuple[str, int], list[float]] = {}
    try:
        wait_http(url + "/healthz")
        r = httpx.post(url + "/rollouts", headers=admin, json={}).json()
        token, rid = r["token"], r["rollout_id"]
        for _ in range(ROUNDS):
            for events, (_, up_port) in zip((200, 400), ups, strict=True):
                point_at(url, up_port)
                time.sleep(0.2)
                for proto, (path, body) in bodies.items():
                    cpu = cpu_per_call(gw.pid, f"{url}/rollouts/{rid}{path}", body, token)
                    samples.setdefault((proto, events), []).append(cpu)
        print(f"\n{'protocol':<10}{'cpu us/call, 200 ev':>21}{'400 ev':>10}{'us per event':>14}")
        for proto in bodies:
            c200 = statistics.median(samples[(proto, 200)]) * 1e6
            c400 = statistics.median(samples[(proto, 400)]) * 1e6
            per = (c400 - c200) / 200
            verdict = "met" if per <= 2.0 else "over"
            print(f"{proto:<10}{c200:>21.0f}{c400:>10.0f}{per:>14.2f}  (target <= 2 us: {verdict})")
    finally:
        stop_servers(gw, timeout=60)
        stop_servers(*(p for p, _ in ups))
    return 0


if __name__ == "__main__":
    sys.exit(main())
