"""Upstream faults on every protocol (issue 15, section 2): the engine answers
500 or 429, sends a body or a stream event that is not JSON, or closes the
connection half-way. Through the real SDKs the harness gets its protocol's typed
error (or an error event in its stream vocabulary), the call is recorded as an
upstream error, and the gateway keeps serving."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

import lightning
from fake_vllm import FakeEngine
from gateways import start_gateway, wait_until
from lightning import GatewayClient

MSGS = [{"role": "user", "content": "hi [[len:6]]"}]


ENGINE = {"name": "F"}


@pytest.fixture(scope="module")
def gw(engine: FakeEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    db = Path(tmp_path_factory.mktemp("faults")) / "gw.db"
    # No gateway retries: each injected fault reaches the harness.
    h = start_gateway([engine.url], db, max_retries=0)
    yield h
    h.stop()


@pytest.fixture
def client(gw: lightning.GatewayHandle) -> Iterator[GatewayClient]:
    c = gw.client()
    yield c
    c.close()


def chat(r: lightning.Rollout, stream: bool, msgs: list[dict[str, str]] = MSGS) -> str:
    with openai.OpenAI(base_url=r.base_url, api_key=r.token, max_retries=0) as oa:
        if not stream:
            return oa.chat.completions.create(model="m", messages=msgs).choices[0].message.content
        parts = oa.chat.completions.create(model="m", messages=msgs, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)


def responses(r: lightning.Rollout, stream: bool, msgs: list[dict[str, str]] = MSGS) -> str:
    with openai.OpenAI(base_url=r.base_url, api_key=r.token, max_retries=0) as oa:
        if not stream:
            return oa.responses.create(model="m", input=msgs[0]["content"]).output_text
        text = ""
        for ev in oa.responses.create(model="m", input=msgs[0]["content"], stream=True):
            if ev.type in ("response.failed", "error"):
                raise StreamFailed(ev.type)
            if ev.type == "response.output_text.delta":
                text += ev.delta
        return text


def messages(r: lightning.Rollout, stream: bool, msgs: list[dict[str, str]] = MSGS) -> str:
    with anthropic.Anthropic(base_url=r.anthropic_base_url, api_key=r.token, max_retries=0) as an:
        if not stream:
            msg = an.messages.create(model="m", max_tokens=16, messages=msgs)  # type: ignore[arg-type]
            return "".join(b.text for b in msg.content if b.type == "text")
        with an.messages.stream(model="m", max_tokens=16, messages=msgs) as s:  # type: ignore[arg-type]
            return "".join(s.text_stream)


class StreamFailed(Exception):
    """A Responses stream ended with its failure event (the SDK yields it, not raises)."""


PROTOCOLS: dict[str, Callable[..., str]] = {
    "chat": chat,
    "responses": responses,
    "messages": messages,
}
OPENAI = {"500": openai.InternalServerError, "429": openai.RateLimitError}
ANTHROPIC = {"500": anthropic.InternalServerError, "429": anthropic.RateLimitError}


def expected_error(proto: str, fault: str, stream: bool) -> type[Exception]:
    sdk = ANTHROPIC if proto == "messages" else OPENAI
    if fault in sdk:  # refused before any byte: an HTTP error, streamed or not
        return sdk[fault]
    if not stream:  # the gateway's 502
        return sdk["500"]
    # Mid-stream: the error event of the protocol's stream vocabulary.
    return {"chat": openai.APIError, "responses": StreamFailed}.get(proto, anthropic.APIError)


def inject(engine: FakeEngine, fault: str) -> None:
    if fault.isdigit():
        engine.control(fail_next=1, fail_status=int(fault))
    else:
        engine.control(fault_next=1, fault=fault)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("fault", ["500", "429", "garbage", "cut"])
@pytest.mark.parametrize("proto", list(PROTOCOLS))
def test_fault_is_typed_recorded_and_survived(
    client: GatewayClient, engine: FakeEngine, proto: str, fault: str, stream: bool
) -> None:
    call = PROTOCOLS[proto]
    r = client.create_rollout()
    inject(engine, fault)
    with pytest.raises(expected_error(proto, fault, stream)):
        call(r, stream)
    (rec,) = client.records(r.id)
    assert rec.status == "upstream_error", (rec.status, rec.flags)
    if fault == "garbage":
        assert rec.flags == ["unparseable_chunk" if stream else "unparseable_answer"]
    # The gateway keeps serving, on the same rollout and protocol.
    assert call(r, stream) != ""
    ok = client.records(r.id)[-1]
    assert (ok.status, ok.delivered) == ("ok", True)
    assert ok.completion_ids is not None and len(ok.completion_ids) == 6


@pytest.mark.parametrize("stall", ["before_headers", "mid_stream"])
@pytest.mark.parametrize("proto", list(PROTOCOLS))
def test_stall_past_the_timeout(engine: FakeEngine, tmp_path: Path, proto: str, stall: str) -> None:
    call = PROTOCOLS[proto]
    with (
        start_gateway([engine.url], tmp_path / "gw.db", max_retries=0, upstream_timeout_s=0.5) as h,
        h.client() as c,
    ):
        r = c.create_rollout()
        sdk = ANTHROPIC if proto == "messages" else OPENAI
        try:
            if stall == "before_headers":
                engine.control(delay_s=1.0)
                with pytest.raises(sdk["500"]) as e:  # 504, raised as the SDK's server error
                    call(r, True)
                assert e.value.status_code == 504
            else:
                slow = [{"role": "user", "content": "hi [[len:6]] [[slow:0.2]]"}]
                with pytest.raises(expected_error(proto, "cut", True)):
                    call(r, True, slow)
        finally:
            engine.control()
        (rec,) = c.records(r.id)
        assert rec.status == "upstream_error"
        assert call(r, False) != ""


# --- raw HTTP per protocol (for what an SDK cannot send or will not drop) ----------

RAW: dict[str, tuple[str, Callable[[str, bool], dict[str, Any]]]] = {
    "chat": ("/chat/completions", lambda text, s: {"model": "m", "stream": s,
             "messages": [{"role": "user", "content": text}]}),
    "responses": ("/responses", lambda text, s: {"model": "m", "stream": s, "input": text}),
    "messages": ("/messages", lambda text, s: {"model": "m", "stream": s, "max_tokens": 64,
                 "messages": [{"role": "user", "content": text}]}),
}  # fmt: skip


def raw_url(r: lightning.Rollout, proto: str) -> str:
    return r.base_url.rstrip("/") + RAW[proto][0]


def raw_headers(r: lightning.Rollout) -> dict[str, str]:
    return {"Authorization": f"Bearer {r.token}", "Content-Type": "application/json"}


def assert_error_shape(proto: str, resp: httpx.Response, status: int) -> None:
    """The gateway's own error, in the protocol's error shape."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    if proto == "messages":
        assert body["type"] == "error" and body["error"]["type"] and body["error"]["message"]
    else:
        assert body["error"]["message"] and body["error"]["type"] and body["error"]["code"]


def wait_for_records(client: GatewayClient, rollout: str, n: int) -> list[Any]:
    def enough() -> list[Any] | None:
        recs = client.records(rollout)
        return recs if len(recs) >= n else None

    return wait_until(enough, f"{n} records of {rollout}")


def wait_for_cancel(engine: FakeEngine, before: int) -> int:
    def cancelled() -> list[Any] | None:
        cancels = engine.log()["cancels"]
        return cancels if len(cancels) > before else None

    return int(wait_until(cancelled, "the engine to see the request cancelled")[-1])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("proto", list(PROTOCOLS))
def test_harness_hangs_up_mid_answer(
    client: GatewayClient, engine: FakeEngine, proto: str, stream: bool
) -> None:
    """The gateway notices, the engine stops generating, the call is recorded
    `aborted` with what was generated so far, and the gateway keeps serving."""
    r = client.create_rollout()
    total = 40
    text = f"hang up [[len:{total}]] [[slow:0.05]]"
    cancels = len(engine.log()["cancels"])
    body = RAW[proto][1](text, stream)
    if stream:
        with (
            httpx.Client(timeout=10) as h,
            h.stream("POST", raw_url(r, proto), json=body, headers=raw_headers(r)) as resp,
        ):
            assert resp.status_code == 200
            seen = 0
            for line in resp.iter_lines():
                seen += line.startswith("data:")
                if seen >= 4:
                    break  # leaving the block closes the connection mid-stream
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(raw_url(r, proto), json=body, headers=raw_headers(r), timeout=0.5)
    generated = wait_for_cancel(engine, cancels)
    assert 0 < generated < total, generated  # the engine stopped early
    (rec,) = wait_for_records(client, r.id, 1)
    assert (rec.status, rec.delivered, rec.finish_reason) == ("aborted", False, None)
    full = engine.log()["answers"][-1]["choices"][0]["ids"]
    if stream:  # what was generated so far, an exact prefix of the engine's answer
        assert rec.completion_ids is not None and 0 < len(rec.completion_ids) < total
        assert list(rec.completion_ids) == full[: len(rec.completion_ids)]
    assert PROTOCOLS[proto](r, stream) != ""
    assert client.records(r.id)[-1].status == "ok"


@pytest.fixture(scope="module")
def small_gw(engine: FakeEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    db = Path(tmp_path_factory.mktemp("small")) / "gw.db"
    h = start_gateway(
        [engine.url], db, max_retries=0, max_body_bytes=32_768, max_upstream_answer_bytes=16_384
    )
    yield h
    h.stop()


@pytest.fixture
def small(small_gw: lightning.GatewayHandle) -> Iterator[GatewayClient]:
    c = small_gw.client()
    yield c
    c.close()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("fault", ["huge", "latin1"])
@pytest.mark.parametrize("proto", list(PROTOCOLS))
def test_oversized_or_non_utf8_answer(
    small: GatewayClient, engine: FakeEngine, proto: str, fault: str, stream: bool
) -> None:
    """An answer (or one SSE event) above max_upstream_answer_bytes, or bytes that
    are not UTF-8: a typed 502 / the stream's error event, never the bytes."""
    call = PROTOCOLS[proto]
    r = small.create_rollout()
    engine.control(fault_next=1, fault=fault, huge_bytes=40_000)
    with pytest.raises(expected_error(proto, "garbage", stream)) as e:
        call(r, stream)
    if not stream:
        assert isinstance(e.value, (openai.APIStatusError, anthropic.APIStatusError))
        assert e.value.status_code == 502
    (rec,) = small.records(r.id)
    assert rec.status == "upstream_error"
    assert {"huge": "answer_too_large", "latin1": "answer_not_utf8"}[fault] in rec.flags
    assert call(r, stream) != ""
    assert small.records(r.id)[-1].status == "ok"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("bad", ["too_large", "not_utf8", "malformed"])
@pytest.mark.parametrize("proto", list(PROTOCOLS))
def test_bad_harness_body_reaches_nothing(
    small: GatewayClient, engine: FakeEngine, proto: str, bad: str, stream: bool
) -> None:
    """413 / 400 in the protocol's error shape; the engine sees nothing, nothing is recorded."""
    r = small.create_rollout()
    good = json.dumps(RAW[proto][1]("hi [[len:6]]", stream)).encode()
    body = {
        "too_large": good.replace(b"hi [[len:6]]", b"x" * 40_000),
        "not_utf8": good.replace(b"hi [[len:6]]", b"hi \xff\xfe"),
        "malformed": good[: len(good) // 2],
    }[bad]
    before = engine.log()["requests"]
    resp = httpx.post(raw_url(r, proto), content=body, headers=raw_headers(r), timeout=10)
    assert_error_shape(proto, resp, 413 if bad == "too_large" else 400)
    assert engine.log()["requests"] == before
    assert small.records(r.id) == []
    # The same connection-less client then gets a normal answer.
    ok = httpx.post(raw_url(r, proto), content=good, headers=raw_headers(r), timeout=10)
    assert ok.status_code == 200, ok.text


KINDS = [(p, s) for p in PROTOCOLS for s in (False, True)]


def run_all(r: lightning.Rollout, text: str) -> tuple[list[threading.Thread], dict[int, Any]]:
    """Every protocol, whole and streamed, at once: the answers (or errors) by kind."""
    out: dict[int, Any] = {}

    def one(k: int) -> None:
        proto, stream = KINDS[k]
        try:
            out[k] = PROTOCOLS[proto](r, stream, [{"role": "user", "content": text}])
        except (openai.APIError, anthropic.APIError, StreamFailed) as e:
            out[k] = e

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(KINDS))]
    for t in threads:
        t.start()
    return threads, out


def wait_in_flight(c: GatewayClient, n: int) -> None:
    wait_until(lambda: c.state()["in_flight"] >= n, f"{n} calls in flight", every=0.01)


def test_upstream_list_changes_under_calls_in_flight(engine: FakeEngine, tmp_path: Path) -> None:
    """POST /admin/upstreams while calls stream: they finish on the engine that
    started them (and record its weight version), new calls go to the new list,
    an empty list refuses new calls in each protocol's shape, nothing is lost."""
    other = FakeEngine("B")
    slow = "in flight [[len:20]] [[slow:0.05]]"
    try:
        with start_gateway(engine.url, tmp_path / "gw.db", max_retries=0) as h, h.client() as c:
            r = c.create_rollout()
            threads, inflight = run_all(r, slow)
            wait_in_flight(c, len(KINDS))
            c.set_upstreams([{"url": other.url, "weight_version": 2}])
            new_threads, fresh = run_all(r, "new list [[len:6]]")
            for t in threads + new_threads:
                t.join(20)
            assert [len(inflight[k]) for k in range(len(KINDS))] == [20] * len(KINDS), inflight
            # Calls in flight on B when B is removed finish too; new calls are refused.
            threads, inflight_b = run_all(r, slow)
            wait_in_flight(c, len(KINDS))
            c.set_upstreams([])
            new_threads, refused = run_all(r, "no engine [[len:6]]")
            for t in threads + new_threads:
                t.join(20)
            assert [len(inflight_b[k]) for k in range(len(KINDS))] == [20] * len(KINDS)
            assert len(refused) == len(KINDS)
            for e in refused.values():
                assert isinstance(e, (openai.APIStatusError, anthropic.APIStatusError)), e
                assert e.status_code == 503, e
            c.set_upstreams([{"url": engine.url, "weight_version": 3}])
            assert PROTOCOLS["chat"](r, False) != ""
            assert [len(fresh[k]) for k in range(len(KINDS))] == [6] * len(KINDS), fresh
            recs = c.records(r.id)
    finally:
        other.stop()
    # One record per call, each on the engine and weights that served it.
    n = len(KINDS)
    assert len(recs) == 4 * n + 1
    refused_recs = [(x.status, x.upstream) for x in recs if x.status != "ok"]
    assert refused_recs == [("upstream_error", "")] * n
    served = [(x.upstream, x.weight_version, len(x.text or "")) for x in recs if x.status == "ok"]
    assert served.count((engine.url, 1, 20)) == n  # first wave: finished on A after the swap
    assert served.count((other.url, 2, 6)) == n  # new calls went to B
    assert served.count((other.url, 2, 20)) == n  # second wave: finished on B after its removal
    assert served.count((engine.url, 3, len(recs[-1].text or ""))) == 1
