"""Resource limits (issue 15, section 6) through real clients on loopback: calls
in flight per rollout and overall (429 with Retry-After in each protocol's own
error shape, nothing reaching the engine), rollouts created per minute, the
largest SSE event from the engine, the header-read and idle timeouts. Each
limit is set low in the typed config so the test can cross it; the request
body limit is `tests/gateway/test_gateway.py::test_body_limit`."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

import lightning
from fake_vllm import FakeEngine
from gateways import start_gateway, wait_until

MSGS: list[Any] = [{"role": "user", "content": "hi [[len:4]]"}]


@pytest.fixture(scope="module")
def engine() -> Iterator[FakeEngine]:
    e = FakeEngine("L")
    yield e
    e.stop()


def start(engine: FakeEngine, tmp_path: Path, **limits: Any) -> lightning.GatewayHandle:
    engine.reset()
    return start_gateway([engine.url], tmp_path / "gw.db", max_retries=0, **limits)


def oa(r: lightning.Rollout) -> openai.OpenAI:
    return openai.OpenAI(base_url=r.base_url, api_key=r.token, max_retries=0)


def an(r: lightning.Rollout) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=r.anthropic_base_url, api_key=r.token, max_retries=0)


def chat(r: lightning.Rollout, stream: bool = False) -> str:
    with oa(r) as c:
        if not stream:
            answer = c.chat.completions.create(model="m", messages=MSGS)
            return answer.choices[0].message.content or ""
        parts = c.chat.completions.create(model="m", messages=MSGS, stream=True)
        return "".join(p.choices[0].delta.content or "" for p in parts if p.choices)


def refused_on_every_protocol(r: lightning.Rollout, needle: str) -> None:
    """Chat, completions, Responses and Messages each answer 429 through their SDK."""
    with oa(r) as c:
        calls = [
            lambda: c.chat.completions.create(model="m", messages=MSGS),
            lambda: c.completions.create(model="m", prompt="hi"),
            lambda: c.responses.create(model="m", input="hi"),
        ]
        for call in calls:
            with pytest.raises(openai.RateLimitError) as e:
                call()
            assert e.value.response.headers["retry-after"] == "1"
            assert needle in e.value.message
    with an(r) as c, pytest.raises(anthropic.RateLimitError) as ae:
        c.messages.create(model="m", max_tokens=8, messages=MSGS)
    body = ae.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error", body
    assert ae.value.response.headers["retry-after"] == "1"


def test_calls_in_flight_are_limited_per_rollout_and_overall(
    engine: FakeEngine, tmp_path: Path
) -> None:
    with (
        start(engine, tmp_path, max_calls_per_rollout=1, max_concurrent_calls=2) as h,
        h.client() as c,
        ThreadPoolExecutor(2) as pool,
    ):
        a, b, idle = c.create_rollout(), c.create_rollout(), c.create_rollout()
        engine.control(delay_s=4.0)
        held = [pool.submit(chat, a), pool.submit(chat, b)]
        wait_until(lambda: engine.log()["requests"] == 2, "two calls at the engine", timeout=20)
        refused_on_every_protocol(a, "max_calls_per_rollout")
        # `idle` has nothing in flight, but the gateway as a whole is full.
        refused_on_every_protocol(idle, "max_concurrent_calls")
        assert engine.log()["requests"] == 2, "a refused call reached the engine"
        assert all(f.result(timeout=30) for f in held)
        engine.control()
        # Refused calls are not recorded; freed places serve again, streamed too.
        assert len(c.records(a.id)) == 1 and c.records(idle.id) == []
        assert chat(idle) and chat(idle, stream=True) and chat(a)


def test_a_stream_holds_its_place_until_it_ends(engine: FakeEngine, tmp_path: Path) -> None:
    with start(engine, tmp_path, max_calls_per_rollout=1) as h, h.client() as c:
        r = c.create_rollout()
        slow: list[Any] = [{"role": "user", "content": "hi [[len:8]] [[slow:0.3]]"}]
        with oa(r) as client:
            parts = client.chat.completions.create(model="m", messages=slow, stream=True)
            first = next(iter(parts))  # the stream is open, its answer unfinished
            assert first.choices
            with pytest.raises(openai.RateLimitError):
                chat(r)
            rest = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
            assert rest
        assert chat(r)


def test_rollouts_created_per_minute(engine: FakeEngine, tmp_path: Path) -> None:
    with start(engine, tmp_path, max_rollouts_per_minute=3) as h, h.client() as c:
        for _ in range(3):
            c.create_rollout()
        r = httpx.post(
            h.url + "/rollouts", json={}, headers={"Authorization": f"Bearer {h.admin_key}"}
        )
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "too_many_rollouts"
        assert 1 <= int(r.headers["retry-after"]) <= 60
        assert len(c.list_rollouts()) == 3


def test_sse_event_over_the_limit_ends_the_stream(engine: FakeEngine, tmp_path: Path) -> None:
    # The fake engine's chunks are a few hundred bytes; 64 refuses the first one.
    with start(engine, tmp_path, max_sse_event_bytes=64) as h, h.client() as c:
        r = c.create_rollout()
        with pytest.raises(openai.APIError, match="max_sse_event_bytes"):
            chat(r, stream=True)
        with an(r) as client, pytest.raises(anthropic.APIError, match="max_sse_event_bytes"):
            with client.messages.stream(model="m", max_tokens=8, messages=MSGS) as s:
                "".join(s.text_stream)
        assert [x.status for x in c.records(r.id)] == ["upstream_error"] * 2
        assert chat(r), "a whole (unstreamed) answer is not an SSE event"


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def closed_after(s: socket.socket) -> float:
    """Seconds until the gateway closes `s` (reading and dropping what it sends)."""
    t0 = time.monotonic()
    while s.recv(65536):
        pass
    return time.monotonic() - t0


def test_header_read_timeout_closes_slow_and_idle_connections(
    engine: FakeEngine, tmp_path: Path
) -> None:
    with start(engine, tmp_path, header_read_timeout_s=0.5) as h:
        with connect(h.url) as s:  # a head that never ends
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n")
            assert 0.3 < closed_after(s) < 8
        with connect(h.url) as s:  # a keep-alive connection left idle after an answer
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
            assert 0.3 < closed_after(s) < 8
    # The default (30 s) keeps the same idle connection open.
    with start(engine, tmp_path) as h, connect(h.url) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        s.settimeout(1.0)
        with pytest.raises(TimeoutError):
            s.recv(1)


def test_idle_client_mid_body_gets_408(engine: FakeEngine, tmp_path: Path) -> None:
    with start(engine, tmp_path, idle_timeout_s=0.5) as h, h.client() as c:
        r = c.create_rollout()
        path = r.base_url.removeprefix(h.url) + "/chat/completions"
        with connect(h.url) as s:
            head = (
                f"POST {path} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {r.token}\r\n"
                "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
            )
            s.sendall(head.encode() + b'{"model": "m",')
            t0 = time.monotonic()
            answer = b""
            while b"}}" not in answer and (chunk := s.recv(65536)):
                answer += chunk
            assert time.monotonic() - t0 > 0.3
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"idle_timeout_s" in answer
        assert engine.log()["requests"] == 0
        assert c.records(r.id) == []
