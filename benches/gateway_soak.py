"""Gateway load and soak, every harness protocol, nothing lost or corrupt.

Phase 1 (load): CONNECTIONS concurrent streaming harness connections for
SECONDS through the gateway, once per protocol (chat completions, Responses,
Messages), each request carrying a nonce of its own. The engine is the static
Rust fake in ``unique`` mode (``examples/static_upstream.rs``): the nonce comes
back as the first completion token's text and id, so every answer is
different and checkable. Baseline in the same run: the same connections
straight to the engine (chat stream; the engine's work is the same for every
protocol), for added latency.

Phase 2 (soak): SOAK_CONNECTIONS connections split over the three protocols
for SOAK_SECONDS at once, with the gateway's RSS sampled every 10 s.

Then the check, from the store on disk: every answer a client saw whole (its
own nonce in it; a success without it counts as ``wrong``) is a call recorded
``ok`` and delivered, and every recorded ok call has byte-exact ids and
logprobs: prompt ids, completion ids (the nonce first) and logprobs equal
what the engine sent.

    python benches/gateway_soak.py                        # 256 x 60 s per protocol, 10 min soak
    python benches/gateway_soak.py --seconds 5 --soak-seconds 20 --connections 64   # quick

Same setup as ``gateway_load.py``: gateway with one tokio worker on CPU 0,
engine and load generator on CPU 1, store ``sync=full``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sqlite3
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import httpx
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
    rss_mb,
    spawn,
    stop_servers,
    wait_http,
)

PROMPT, COMPLETION = 1000, 200
SYSTEM = "You are a careful coding agent. " * 40
ASK = "Fix the remaining failure, case #n={{n}}#."


def bodies() -> dict[str, bytes]:
    """One streaming request template per protocol (``{{n}}``: the nonce)."""
    chat = {
        "model": "static",
        "stream": True,
        "max_tokens": COMPLETION,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}],
    }
    responses = {
        "model": "static",
        "stream": True,
        "max_output_tokens": COMPLETION,
        "instructions": SYSTEM,
        "input": ASK,
    }
    messages = {
        "model": "static",
        "stream": True,
        "max_tokens": COMPLETION,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": ASK}],
    }
    return {
        k: json.dumps(v).encode()
        for k, v in (("chat", chat), ("responses", responses), ("messages", messages))
    }


PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


def expected() -> tuple[bytes, np.ndarray, bytes]:
    """What the static engine sends (see ``bodies`` in static_upstream.rs)."""
    prompt = np.array([1000 + i * 7 % 30000 for i in range(PROMPT)], "<u4").tobytes()
    ids = np.array([500 + i * 13 % 30000 for i in range(COMPLETION)], "<u4")
    lps = np.array(
        [-((i % 17) / 8.0) for i in range(COMPLETION)], "<f4"
    ).tobytes()  # -0.0 first, as Rust
    return prompt, ids, lps


RUNS = iter(range(7))  # direct, 3 protocols, 3 soak streams: each its own nonces


def run_load(url: str, conc: int, seconds: float, body: Path, token: str, seen: Path) -> dict:
    # Nonces are token ids (u32): 300 M apart per run, workers 1 M apart within one.
    env = {"LOAD_SEEN": str(seen), "LOAD_NONCE_BASE": str(next(RUNS) * 300_000_000)}
    return load(url, conc, body, token, seconds, env)


def sample_rss(
    pid: int, every: float, stop: threading.Event, into: list[tuple[float, float]]
) -> None:
    t0 = time.time()
    while not stop.wait(every):
        into.append((time.time() - t0, rss_mb(pid)))


def verify(db: Path, seen: set[int]) -> dict[str, int]:
    prompt, ids, lps = expected()
    nonce = re.compile(r"#n=(\d+)#")
    counts = {
        "ok_calls": 0,
        "exact": 0,
        "bad_ids": 0,
        "no_nonce": 0,
        "seen_missing": 0,
        "ok_not_seen": 0,
    }
    recorded: set[int] = set()
    with sqlite3.connect(db) as con:
        rows = con.execute(
            "SELECT request, prompt_ids, completion_ids, logprobs, text FROM calls WHERE status = 'ok' AND delivered = 1"
        )
        for request, p, c, lp, text in rows:
            counts["ok_calls"] += 1
            m = nonce.search(request)
            if m is None:
                counts["no_nonce"] += 1
                continue
            n = int(m.group(1))
            recorded.add(n)
            want = ids.copy()
            want[0] = n
            if p == prompt and c == want.tobytes() and lp == lps and text.startswith(f"{n:010}"):
                counts["exact"] += 1
            else:
                counts["bad_ids"] += 1
    counts["seen_missing"] = len(seen - recorded)
    counts["ok_not_seen"] = len(recorded - seen)
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--connections", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--soak-connections", type=int, default=48)
    ap.add_argument("--soak-seconds", type=float, default=600)
    args = ap.parse_args()
    build()
    print(f"machine: {machine()}\ncommit:  {commit()}")
    print(
        f"setup:   gateway 1 tokio worker on CPU 0, store sync=full; engine + load generator on CPU 1; "
        f"{args.connections} streaming connections x {args.seconds:.0f} s per protocol, then "
        f"{args.soak_connections} connections over the 3 protocols for {args.soak_seconds:.0f} s"
    )
    tmp = bench_dir("lightning-soak-")
    files = {}
    for k, b in bodies().items():
        files[k] = tmp / f"{k}.json"
        files[k].write_bytes(b)
    upstream = spawn(
        "1", [str(TARGET / "examples" / "static_upstream"), "0", str(COMPLETION), "unique"]
    )
    assert upstream.stdout is not None
    up = f"http://127.0.0.1:{int(upstream.stdout.readline().split()[1])}"
    db = tmp / "soak.db"
    port = 19000 + os.getpid() % 1000
    gw = spawn(
        "0",
        # Layout 1 (every call whole): `verify` reads each row's bytes straight from
        # the calls table. That layout 2 reads back the same bytes on every read path
        # is rust/gateway/tests/store_layout.rs's property.
        gateway_args(
            TARGET / "lightning-gateway", port, f"{up}/v1", db, sync="full", layout="full"
        ),
        env=dict(os.environ, RUST_LOG="warn"),
    )
    url = f"http://127.0.0.1:{port}"
    seen: set[int] = set()
    wrong = errors = 0
    try:
        wait_http(url + "/healthz")
        r = httpx.post(
            url + "/rollouts", headers={"Authorization": f"Bearer {ADMIN}"}, json={"task": "soak"}
        )
        token, rid = r.json()["token"], r.json()["rollout_id"]
        base = f"{url}/rollouts/{rid}"
        print(f"gateway RSS at start: {rss_mb(gw.pid):.1f} MB\n")
        direct = run_load(
            f"{up}/v1/chat/completions",
            args.connections,
            args.seconds,
            files["chat"],
            "x",
            tmp / "d.txt",
        )
        print(
            f"direct to the engine (chat stream): {direct['rps']:.0f} calls/s, p50 {direct['p50_ms']:.2f} ms, p99 {direct['p99_ms']:.2f} ms"
        )
        hdr = f"{'protocol':<10}{'conns':>6} | {'calls/s':>8} {'p50 ms':>8} {'p99 ms':>8} | {'+p50 ms':>8} {'+p99 ms':>8} | {'errors':>6} {'wrong':>5} | {'gw CPU':>6} {'RSS MB':>7}"
        print(hdr + "\n" + "-" * len(hdr))
        for proto in ("chat", "responses", "messages"):
            out = tmp / f"seen-{proto}.txt"
            cpu0, t0 = cpu_seconds(gw.pid), time.time()
            via = run_load(
                base + PATHS[proto], args.connections, args.seconds, files[proto], token, out
            )
            cpu = (cpu_seconds(gw.pid) - cpu0) / (time.time() - t0)
            seen |= {int(x) for x in out.read_text().split()}
            wrong += int(via["wrong"])
            errors += int(via["errors"])
            print(
                f"{proto:<10}{args.connections:>6} | {via['rps']:>8.0f} {via['p50_ms']:>8.2f} {via['p99_ms']:>8.2f} | "
                f"{via['p50_ms'] - direct['p50_ms']:>8.2f} {via['p99_ms'] - direct['p99_ms']:>8.2f} | "
                f"{via['errors']:>6} {via['wrong']:>5} | {cpu * 100:>5.0f}% {rss_mb(gw.pid):>7.1f}"
            )
        print(f"\nsoak: {args.soak_connections} connections for {args.soak_seconds:.0f} s")
        samples: list[tuple[float, float]] = []
        stop = threading.Event()
        sampler = threading.Thread(target=sample_rss, args=(gw.pid, 10.0, stop, samples))
        sampler.start()
        per = max(args.soak_connections // 3, 1)
        results: dict[str, dict] = {}

        def soak(proto: str) -> None:
            out = tmp / f"soak-{proto}.txt"
            results[proto] = run_load(
                base + PATHS[proto], per, args.soak_seconds, files[proto], token, out
            )
            results[proto]["seen"] = {int(x) for x in out.read_text().split()}

        cpu0, t0 = cpu_seconds(gw.pid), time.time()
        threads = [threading.Thread(target=soak, args=(p,)) for p in PATHS]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        cpu = (cpu_seconds(gw.pid) - cpu0) / (time.time() - t0)
        stop.set()
        sampler.join()
        for proto, res in results.items():
            overlap = seen & res["seen"]
            assert not overlap, f"nonces reused across phases: {sorted(overlap)[:5]}"
            seen |= res["seen"]
            wrong += int(res["wrong"])
            errors += int(res["errors"])
            print(
                f"  {proto:<10} {res['rps']:>7.0f} calls/s  p50 {res['p50_ms']:.2f} ms  p99 {res['p99_ms']:.2f} ms  "
                f"errors {res['errors']}  wrong {res['wrong']}"
            )
        print(f"  gateway CPU {cpu * 100:.0f}%")
        rss = [m for _, m in samples]
        if rss:
            first, rest = rss[0], rss[1:] or rss
            print(
                f"  RSS every 10 s (MB): {' '.join(f'{m:.1f}' for m in rss)}\n"
                f"  RSS after the first sample: min {min(rest):.1f}, max {max(rest):.1f} "
                f"({(max(rest) - first) / first * 100:+.1f}% / {(min(rest) - first) / first * 100:+.1f}% of {first:.1f} MB)"
            )
    finally:
        stop_servers(gw, upstream)
    counts = verify(db, seen)
    print(
        f"\ncheck against the store ({db.stat().st_size / 1e6:.0f} MB):\n"
        f"  answers clients saw whole with their own nonce: {len(seen)}; successes without it (wrong): {wrong}; "
        f"failed requests: {errors}\n"
        f"  recorded ok + delivered calls: {counts['ok_calls']}; byte-exact ids, logprobs and text: {counts['exact']}; "
        f"not exact: {counts['bad_ids']}; without a nonce: {counts['no_nonce']}\n"
        f"  seen by a client but not recorded ok: {counts['seen_missing']}; recorded ok but not seen whole: {counts['ok_not_seen']}"
    )
    lost = counts["seen_missing"] + counts["bad_ids"] + counts["no_nonce"] + wrong
    print("RESULT: " + ("nothing lost or corrupt" if lost == 0 else f"{lost} LOST OR CORRUPT"))
    return 0 if lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
