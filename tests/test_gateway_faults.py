"""Upstream faults on every protocol (issue 15, section 2): the engine answers
500 or 429, sends a body or a stream event that is not JSON, or closes the
connection half-way. Through the real SDKs the harness gets its protocol's typed
error (or an error event in its stream vocabulary), the call is recorded as an
upstream error, and the gateway keeps serving."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

import lightning
from fake_vllm import FakeEngine
from lightning import Gateway, GatewayClient, GatewayConfig

MSGS = [{"role": "user", "content": "hi [[len:6]]"}]


@pytest.fixture(scope="module")
def engine() -> Iterator[FakeEngine]:
    e = FakeEngine("F")
    yield e
    e.stop()


@pytest.fixture(scope="module")
def gw(engine: FakeEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    db = Path(tmp_path_factory.mktemp("faults")) / "gw.db"
    # No gateway retries: each injected fault reaches the harness.
    cfg = GatewayConfig(listen="127.0.0.1:0", upstreams=[engine.url], db=str(db), max_retries=0)
    h = Gateway(cfg).start()
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
    cfg = GatewayConfig(
        listen="127.0.0.1:0",
        upstreams=[engine.url],
        db=str(tmp_path / "gw.db"),
        max_retries=0,
        upstream_timeout_s=0.5,
    )
    call = PROTOCOLS[proto]
    with Gateway(cfg).start() as h, h.client() as c:
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
