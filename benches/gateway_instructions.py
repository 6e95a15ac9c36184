"""Gateway CPU cost in instructions (valgrind callgrind), which a loaded machine
does not blur: the gateway binary runs under callgrind in front of the static
fake engine (``examples/static_upstream.rs``, run natively), one call at a time
through the closed-loop load generator (``examples/load.rs``). For each point
the counters are zeroed after a warm-up, a few seconds of calls run, and the
gateway's instructions (every thread: proxy, store writer, readers) are divided
by the calls served. The per-SSE-event cost is the difference between streams
of 400 and 200 completion events, over 200, for chat (the engine's stream passed
through) and for the Responses and Messages adapters (the same engine stream
translated event by event). The top functions by self cost are printed for the
JSON and the stream point.

    python benches/gateway_instructions.py [GATEWAY_BINARY]   # default: this build

The baseline is a binary given as the argument (e.g. one built from an earlier
commit); run the script once per binary on the same machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_load import (
    ADMIN,
    TARGET,
    bench_dir,
    build,
    commit,
    gateway_args,
    machine,
    request_body,
    spawn,
    stop_servers,
    stream_body,
    wait_http,
)

SECONDS = float(os.environ.get("GATEWAY_BENCH_SECONDS", "4"))


def callgrind_totals(path: Path) -> int:
    for line in path.read_text().splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {path}")


def top_functions(path: Path, n: int = 12) -> list[str]:
    out = subprocess.run(
        ["callgrind_annotate", "--threshold=100", str(path)], capture_output=True, text=True
    ).stdout
    rows = [ln for ln in out.splitlines() if "(" in ln and ln.strip()[:1].isdigit()]
    return rows[:n]


def load(url: str, body: Path, token: str, seconds: float) -> int:
    cmd = [str(TARGET / "examples" / "load"), url, "1", str(seconds), str(body), token]
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    if out["errors"]:
        raise RuntimeError(f"load saw errors: {out}")
    return int(out["requests"])


def measure(pid: int, url: str, body: Path, token: str, out: Path) -> tuple[int, int]:
    """(instructions, calls) of `SECONDS` of calls after a warm-up."""
    load(url, body, token, 1.0)
    subprocess.run(["callgrind_control", "-z", str(pid)], check=True, capture_output=True)
    calls = load(url, body, token, SECONDS)
    time.sleep(0.2)  # the last commit's writer work
    for old in out.parent.glob("callgrind.out.*"):
        old.unlink()
    subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
    dumps = sorted(out.parent.glob("callgrind.out.*"), key=lambda p: p.stat().st_mtime)
    dumps[-1].rename(out)
    return callgrind_totals(out), calls


def translated_bodies(tmp: Path) -> dict[str, tuple[str, Path]]:
    """The bench's conversation as a streamed Responses and Messages request."""
    msgs = json.loads(request_body())["messages"]
    turns = [m for m in msgs if m["role"] != "system"]
    bodies = {
        "responses": ("/v1/responses", {"model": "static", "stream": True, "max_output_tokens": 400,
                                        "instructions": msgs[0]["content"], "input": turns}),
        "messages": ("/v1/messages", {"model": "static", "stream": True, "max_tokens": 400,
                                      "system": msgs[0]["content"], "messages": turns}),
    }  # fmt: skip
    out = {}
    for proto, (path, body) in bodies.items():
        file = tmp / f"body_{proto}.json"
        file.write_text(json.dumps(body))
        out[proto] = (path, file)
    return out


def upstream(tokens: int) -> tuple[subprocess.Popen[str], int]:
    """The static engine streaming `tokens` completion events a call, on CPU 1."""
    p = spawn("1", [str(TARGET / "examples" / "static_upstream"), "0", str(tokens)])
    assert p.stdout is not None
    return p, int(p.stdout.readline().split()[1])


def point_at(gateway: str, engine_port: int) -> None:
    """Swaps the gateway's upstream list for the static engine on `engine_port`."""
    httpx.post(
        gateway + "/admin/upstreams",
        headers={"Authorization": f"Bearer {ADMIN}"},
        json={"upstreams": [{"url": f"http://127.0.0.1:{engine_port}/v1"}]},
    ).raise_for_status()


def main() -> int:
    build()
    binary = Path(sys.argv[1]) if len(sys.argv) > 1 else TARGET / "lightning-gateway"
    print(f"machine: {machine()}")
    print(f"commit:  {commit()}; gateway binary {binary}")
    tmp = bench_dir("lightning-callgrind-")
    body_json = tmp / "body.json"
    body_json.write_bytes(request_body())
    body_stream = tmp / "body_stream.json"
    body_stream.write_bytes(stream_body())
    ups = [upstream(200), upstream(400)]
    port = 19000 + os.getpid() % 1000
    cmd = [
        "valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/callgrind.out.%p",
        *gateway_args(binary, port, f"http://127.0.0.1:{ups[0][1]}/v1", tmp / "bench.db", sync="full"),
    ]  # fmt: skip
    gw = subprocess.Popen(cmd, stderr=subprocess.DEVNULL, env=dict(os.environ, RUST_LOG="warn"))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/healthz")
        r = httpx.post(url + "/rollouts", headers={"Authorization": f"Bearer {ADMIN}"}, json={})
        token, rid = r.json()["token"], r.json()["rollout_id"]
        call = f"{url}/rollouts/{rid}/v1/chat/completions"
        res = {}
        for name, body in (("json", body_json), ("stream200", body_stream)):
            ir, n = measure(gw.pid, call, body, token, tmp / f"{name}.out")
            res[name] = (ir, n)
        # Streams translated by the Responses and Messages adapters (same engine stream).
        translated = translated_bodies(tmp)
        for proto, (path, body) in translated.items():
            res[f"{proto}200"] = measure(
                gw.pid, f"{url}/rollouts/{rid}{path}", body, token, tmp / f"{proto}200.out"
            )
        # The same streams with 400 events: point the gateway at the second engine.
        point_at(url, ups[1][1])
        res["stream400"] = measure(gw.pid, call, body_stream, token, tmp / "stream400.out")
        for proto, (path, body) in translated.items():
            res[f"{proto}400"] = measure(
                gw.pid, f"{url}/rollouts/{rid}{path}", body, token, tmp / f"{proto}400.out"
            )
        print(f"\n{'point':<14}{'calls':>7}{'instructions/call':>20}")
        for name, (ir, n) in res.items():
            print(f"{name:<14}{n:>7}{ir / n:>20,.0f}")
        for proto in ("stream", *translated):
            per_event = (res[f"{proto}400"][0] / res[f"{proto}400"][1]) - (
                res[f"{proto}200"][0] / res[f"{proto}200"][1]
            )
            label = "chat" if proto == "stream" else proto
            print(
                f"per SSE event, {label:<9} ({proto}400 - {proto}200) / 200: {per_event / 200:,.0f} instructions"
            )
        for name in ("json", "stream200"):
            print(f"\ntop functions by self instructions, {name} ({tmp / (name + '.out')}):")
            for row in top_functions(tmp / f"{name}.out"):
                print("  " + row.strip()[:150])
    finally:
        stop_servers(gw, timeout=60)
        stop_servers(*(p for p, _ in ups))
    return 0


if __name__ == "__main__":
    sys.exit(main())
