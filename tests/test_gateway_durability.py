"""Durability: kill -9 the gateway (started through the ``lightning-gateway``
console entry point) with calls in flight; everything the harness saw
complete (chat, Responses and Messages, streamed and not) and every
acknowledged reward must be in the store after restart."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from fake_vllm import FakeEngine
from lightning import GatewayClient, Store

ADMIN = "durability-admin-key"


@pytest.fixture(scope="module")
def engine() -> Iterator[FakeEngine]:
    e = FakeEngine("D")
    yield e
    e.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(db: Path, upstream: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [
        sys.executable, "-c", "import sys; from lightning.gateway import main; sys.exit(main())",
        "--listen", f"127.0.0.1:{port}", "--upstream", upstream, "--db", str(db),
        "--admin-key", ADMIN, "--threads", "2",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            if httpx.get(url + "/healthz", timeout=0.5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("gateway did not come up")


def test_sigterm_drains_and_exits_cleanly(engine: FakeEngine, tmp_path: Path) -> None:
    proc, url = launch(tmp_path / "t.db", engine.url)
    c = GatewayClient(url, ADMIN)
    r = c.create_rollout()
    oa = openai.OpenAI(base_url=r.base_url, api_key=r.token, max_retries=0)
    result: list[str] = []

    def slow() -> None:
        msgs = [{"role": "user", "content": "x [[len:10]] [[slow:0.03]]"}]
        stream = oa.chat.completions.create(model="m", messages=msgs, stream=True)
        result.append("".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices))

    t = threading.Thread(target=slow)
    t.start()
    while c.state()["in_flight"] == 0:
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    t.join(10)
    oa.close()
    assert proc.wait(10) == 0
    assert proc.stderr is not None
    log = proc.stderr.read().decode()
    proc.stderr.close()
    assert "store flushed" in log and ADMIN not in log and r.token not in log
    assert len(result) == 1 and len(result[0]) == 10  # the in-flight call finished
    c.close()
    with Store(tmp_path / "t.db") as s:
        assert [x.status for x in s.records(r.id)] == ["ok"]


def test_kill9_keeps_every_acknowledged_write(engine: FakeEngine, tmp_path: Path) -> None:
    db = tmp_path / "k.db"
    proc, url = launch(db, engine.url)
    c = GatewayClient(url, ADMIN)
    rollouts = [c.create_rollout(rollout_id=f"r{i}") for i in range(6)]
    seen: dict[str, list[str]] = {r.id: [] for r in rollouts}
    rewards: dict[str, list[int]] = {r.id: [] for r in rollouts}
    stop = threading.Event()
    errors: list[str] = []

    def ask(oa: openai.OpenAI, an: anthropic.Anthropic, kind: int, text: str) -> str:
        """One harness call; kinds cycle through every protocol, whole and streamed."""
        msgs: Any = [{"role": "user", "content": text}]
        stream = kind % 2 == 1
        if kind < 2:
            if not stream:
                return (
                    oa.chat.completions.create(model="m", messages=msgs).choices[0].message.content
                    or ""
                )
            parts = oa.chat.completions.create(model="m", messages=msgs, stream=True)
            return "".join(ch.choices[0].delta.content or "" for ch in parts if ch.choices)
        if kind < 4:
            if not stream:
                return oa.responses.create(model="m", input=text).output_text
            events = oa.responses.create(model="m", input=text, stream=True)
            done = [e.response.output_text for e in events if e.type == "response.completed"]
            if not done:
                raise openai.APIError(
                    "stream ended without response.completed", httpx.Request("POST", url), body=None
                )
            return done[0]
        if not stream:
            msg = an.messages.create(model="m", max_tokens=64, messages=msgs)
            return "".join(b.text for b in msg.content if b.type == "text")
        with an.messages.stream(model="m", max_tokens=64, messages=msgs) as s:
            return "".join(s.text_stream)

    def worker(i: int) -> None:
        r = rollouts[i]
        oa = openai.OpenAI(base_url=r.base_url, api_key=r.token, max_retries=0, timeout=5)
        an = anthropic.Anthropic(
            base_url=r.anthropic_base_url, api_key=r.token, max_retries=0, timeout=5
        )
        rc = GatewayClient(url, timeout=5)
        n = 0
        while not stop.is_set():
            try:
                seen[r.id].append(ask(oa, an, (n + i) % 6, f"turn {n} [[len:8]]"))
                rewards[r.id].append(rc.reward(r.id, float(n), token=r.token))
            except (openai.APIError, anthropic.APIError, httpx.HTTPError) as e:
                errors.append(repr(e))
                break
            n += 1
        oa.close()
        an.close()
        rc.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(rollouts))]
    for t in threads:
        t.start()
    # Kill once there is real traffic (the machine may be slow), mid-stream.
    deadline = time.time() + 60
    while sum(len(v) for v in seen.values()) < 12 and time.time() < deadline and not errors:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(5)
    stop.set()
    for t in threads:
        t.join(10)
    if proc.stderr:
        proc.stderr.close()
    c.close()
    assert sum(len(v) for v in seen.values()) > 10, f"too little traffic before the kill: {errors}"
    # Restart on the same file: it opens (WAL recovery) and serves the old rollouts.
    proc2, url2 = launch(db, engine.url)
    try:
        c2 = GatewayClient(url2, ADMIN)
        with Store(db) as s:
            for r in rollouts:
                recs = [x for x in s.records(r.id) if x.status == "ok" and x.delivered]
                texts = [x.text for x in recs]
                # Every answer the harness saw complete is stored, in order.
                assert texts[: len(seen[r.id])] == seen[r.id]
                ev = s.events(r.id)
                assert set(rewards[r.id]) <= {e["seq"] for e in ev if e["type"] == "reward"}
            # And the restarted gateway serves the same data.
            assert len(c2.records(rollouts[0].id)) == len(s.records(rollouts[0].id))
        # Same rollout id, same token: harnesses keep working after a restart.
        assert c2.create_rollout(rollout_id="r0").token == rollouts[0].token
        c2.close()
    finally:
        proc2.send_signal(signal.SIGTERM)
        proc2.wait(10)
        if proc2.stderr:
            proc2.stderr.close()
