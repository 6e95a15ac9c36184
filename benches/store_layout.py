"""Store growth per rollout: layout 1 (every call whole, ``store_layout="full"``)
vs the prefix-shared layout 2 (``"shared"``), in one run.

A coding-agent-shaped rollout through the real gateway: a Claude-Code-sized
system prompt (~12k tokens), then per turn ~2 KB of tool output and the
model's answer, the whole conversation resent every call. The engine is a
small in-process vLLM-wire server that renders the chat with SmolLM2-135M's
real tokenizer and chat template (``lightning.Tokenizer``; exact prompt ids
the way vLLM computes them) and answers a fixed text, so what is measured is
the store, not a model. Reported at 10, 40 and 100 turns:

- store bytes per rollout: the calls' stored bytes (every column), and the
  file's growth (pages after a WAL checkpoint);
- unique content: the final conversation's text plus its token ids at 4
  bytes each (what the rollout says, counted once), and the ratio to it;
- commit time per call against the turn number (the writer's mean
  group-commit duration from ``/metrics`` over the 10 calls before the mark,
  one call in flight, fsync included: ``sync = "full"``).

    python benches/store_layout.py        # STORE_BENCH_TURNS=100
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

import lightning
from lightning.model_cache import smollm2_dir

ROOT = Path(__file__).resolve().parent.parent
TURNS = int(os.environ.get("STORE_BENCH_TURNS", "100"))
MARKS = [t for t in (10, 40, 100) if t <= TURNS]
ADMIN = "bench-admin-key"
ANSWER = "I ran the command; two tests fail in test_parser.py, fixing the tokenizer edge case next."


def system_prompt() -> str:
    """~48 KB of varied instructions: the size of Claude Code's opening prompt."""
    rules = [
        f"Rule {i}: when the user asks about module_{i % 37}, read the file first, "
        f"prefer small diffs, run the tests named test_{i % 53} and report failures verbatim."
        for i in range(330)
    ]
    return "You are a coding agent.\n" + "\n".join(rules)


def tool_output(turn: int) -> str:
    lines = [
        f"tests/test_{turn}_{k}.py::case_{k} {'PASSED' if k % 5 else 'FAILED'}" for k in range(40)
    ]
    return "\n".join(lines)[:2048]


class Engine(BaseHTTPRequestHandler):
    tok: lightning.Tokenizer
    answer: list[int]

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = self.tok.encode_chat(req["messages"], add_generation_prompt=True)
        ids = [int(i) for i in self.answer]
        body = json.dumps(
            {
                "id": "chatcmpl-bench",
                "object": "chat.completion",
                "model": "m",
                "prompt_token_ids": [int(i) for i in prompt],
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": ANSWER},
                        "finish_reason": "stop",
                        "token_ids": ids,
                        "logprobs": {
                            "content": [
                                {"token": str(i), "logprob": -0.5, "bytes": [], "top_logprobs": []}
                                for i in ids
                            ]
                        },
                    }
                ],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids)},
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def commit_seconds(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    s = re.search(r"^lightning_store_commit_seconds_sum (\S+)", text, re.M)
    n = re.search(r"^lightning_store_commit_seconds_count (\S+)", text, re.M)
    return (float(s.group(1)) if s else 0.0, float(n.group(1)) if n else 0.0)


def stored_bytes(db: Path) -> tuple[int, int]:
    """(bytes in the calls' columns, file bytes after a checkpoint)."""
    with sqlite3.connect(db) as c:
        cols = [r[1] for r in c.execute("PRAGMA table_info(calls)")]
        expr = " + ".join(f"COALESCE(length({col}), 0)" for col in cols)
        (calls,) = c.execute(f"SELECT COALESCE(SUM({expr}), 0) FROM calls").fetchone()
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        (pages,) = c.execute("PRAGMA page_count").fetchone()
        (size,) = c.execute("PRAGMA page_size").fetchone()
    return int(calls), int(pages) * int(size)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def gateway(db: Path, engine_url: str, layout: str) -> Iterator[str]:
    """The gateway in its own process: this process opens the file with
    Python's sqlite3, and two SQLite copies in one process break each other's
    POSIX locks (closing one's file drops the other's, and the WAL goes)."""
    port = free_port()
    cmd = [sys.executable, "-c", "import sys; from lightning.gateway.server import main; sys.exit(main())",
           "--listen", f"127.0.0.1:{port}", "--upstream", engine_url, "--db", str(db),
           "--admin-key", ADMIN, "--threads", "1", "--store-layout", layout]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                httpx.get(url + "/healthz", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def compressibility(db: Path) -> tuple[int, int, float]:
    """What compressing each stored value on its own would save (zlib level 1,
    a stand-in for zstd, which this environment lacks): (raw bytes, compressed
    bytes, microseconds of compression per call)."""
    raw = packed = 0
    t0 = time.perf_counter()
    with sqlite3.connect(db) as c:
        rows = c.execute(
            "SELECT prompt_ids, completion_ids, logprobs, request, harness_request, text FROM calls"
        ).fetchall()
    for row in rows:
        for v in row:
            if v is None:
                continue
            b = v.encode() if isinstance(v, str) else bytes(v)
            raw += len(b)
            packed += min(len(b), len(zlib.compress(b, 1)))
    return raw, packed, (time.perf_counter() - t0) / max(len(rows), 1) * 1e6


def run(layout: str, engine_url: str, tok: lightning.Tokenizer, tmp: Path) -> list[dict[str, Any]]:
    db = tmp / f"{layout}.db"
    rows = []
    with gateway(db, engine_url, layout) as url, lightning.GatewayClient(url, ADMIN) as client:
        _, base_pages = stored_bytes(db)
        r = client.create_rollout({"task": "bench"})
        messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt()}]
        messages.append({"role": "user", "content": "Fix the failing parser tests."})
        with httpx.Client(timeout=60) as http:
            s0, n0 = commit_seconds(url)
            for turn in range(1, TURNS + 1):
                a = http.post(
                    r.base_url + "/chat/completions",
                    json={"model": "m", "messages": messages, "max_tokens": 256},
                    headers={"Authorization": f"Bearer {r.token}"},
                )
                a.raise_for_status()
                messages.append(
                    {"role": "assistant", "content": a.json()["choices"][0]["message"]["content"]}
                )
                messages.append({"role": "user", "content": tool_output(turn)})
                if turn in MARKS or turn % 10 == 0:
                    # Mean commit over the calls since the last mark.
                    s1, n1 = commit_seconds(url)
                    commit_ms = (s1 - s0) / max(n1 - n0, 1) * 1000
                    calls, file_bytes = stored_bytes(db)
                    s0, n0 = commit_seconds(url)
                    text = sum(len(m["content"].encode()) for m in messages[:-1])
                    ids = len(tok.encode_chat(messages[:-1])) * 4
                    raw, packed, us = compressibility(db) if turn == TURNS else (0, 0, 0.0)
                    rows.append(
                        {
                            "raw": raw,
                            "packed": packed,
                            "us": us,
                            "turn": turn,
                            "calls_bytes": calls,
                            "file_bytes": file_bytes - base_pages,
                            "unique": text + ids,
                            "commit_ms": commit_ms,
                        }
                    )
    return rows


def main() -> int:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs; load: {os.getloadavg()}")
    print(f"commit:  {commit}")
    tok = lightning.Tokenizer.from_dir(smollm2_dir())
    print(
        f"tokenizer: SmolLM2-135M-Instruct; system prompt {len(tok.encode(system_prompt()))} tokens"
    )
    Engine.tok = tok
    Engine.answer = [int(i) for i in tok.encode(ANSWER)]
    server = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    engine_url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for layout in ("full", "shared"):
            t0 = time.monotonic()
            results[layout] = {row["turn"]: row for row in run(layout, engine_url, tok, Path(d))}
            print(f"{layout}: {TURNS} turns in {time.monotonic() - t0:.1f} s")
    server.shutdown()
    print(
        f"\n{'turns':>5} | {'unique MB':>9} | {'full MB':>8} {'x unique':>8} | {'shared MB':>9} {'x unique':>8} | {'file full':>9} {'file shared':>11} | {'commit ms full':>14} {'shared':>7}"
    )
    for turn in sorted(results["full"]):
        f, s = results["full"][turn], results["shared"][turn]
        print(
            f"{turn:>5} | {f['unique'] / 1e6:>9.3f} | {f['calls_bytes'] / 1e6:>8.2f} {f['calls_bytes'] / f['unique']:>8.2f} | "
            f"{s['calls_bytes'] / 1e6:>9.3f} {s['calls_bytes'] / s['unique']:>8.2f} | "
            f"{f['file_bytes'] / 1e6:>9.2f} {s['file_bytes'] / 1e6:>11.3f} | {f['commit_ms']:>14.3f} {s['commit_ms']:>7.3f}"
        )
    for layout in ("full", "shared"):
        last = results[layout][max(results[layout])]
        print(
            f"compression per value, {layout} at {TURNS} turns (zlib level 1): {last['raw'] / 1e6:.3f} MB -> "
            f"{last['packed'] / 1e6:.3f} MB ({last['packed'] / max(last['raw'], 1):.2f}), {last['us']:.0f} us per call incl. reading"
        )
    print(f"load after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
