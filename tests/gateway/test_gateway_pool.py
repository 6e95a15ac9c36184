"""Upstream pool behaviour: affinity, failover, mark-down, run-time replacement,
502/504, and engines that return no ids."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

import lightning
from fake_vllm import FakeEngine
from lightning import Gateway, GatewayConfig

MESSAGES = [{"role": "user", "content": "hello [[len:5]]"}]


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[FakeEngine, FakeEngine]]:
    a, b = FakeEngine("A"), FakeEngine("B")
    yield a, b
    a.stop()
    b.stop()


def start(tmp_path: Path, upstreams: list[dict[str, Any]], **kw: Any) -> lightning.GatewayHandle:
    cfg = GatewayConfig.model_validate(
        {
            "listen": "127.0.0.1:0",
            "upstreams": upstreams,
            "db": str(tmp_path / "p.db"),
            "retry_base_ms": 5,
            **kw,
        }
    )
    return Gateway(cfg).start()


def served_by(r: lightning.Rollout) -> str:
    with openai.OpenAI(base_url=r.base_url, api_key=r.token, max_retries=0) as oa:
        raw = oa.chat.completions.with_raw_response.create(model="m", messages=MESSAGES)
        return raw.http_response.headers["x-fake-server"]


def test_affinity_failover_and_replacement(
    engines: tuple[FakeEngine, FakeEngine], tmp_path: Path
) -> None:
    a, b = engines
    for e in engines:
        e.reset()
    ups = [{"url": a.url, "weight_version": 1}, {"url": b.url, "weight_version": 2}]
    with start(tmp_path, ups, mark_down_after=1, down_for_s=60) as h, h.client() as c:
        rollouts = [c.create_rollout() for _ in range(12)]
        first = {r.id: served_by(r) for r in rollouts}
        assert set(first.values()) == {"A", "B"}  # spread over both
        assert all(served_by(r) == first[r.id] for r in rollouts)  # and sticky
        # Each call carries the weight version of the engine that served it.
        for r in rollouts[:4]:
            recs = c.records(r.id)
            assert {x.weight_version for x in recs} == {1 if first[r.id] == "A" else 2}
        # A fails once: that call is retried on B before any byte reached the
        # harness, A is marked down, and A's rollouts move to B.
        on_a = [r for r in rollouts if first[r.id] == "A"]
        a.control(fail_next=1, fail_status=503)
        assert served_by(on_a[0]) == "B"
        assert all(served_by(r) == "B" for r in on_a[1:])
        ups_state = {u["url"]: u for u in c.upstreams()}
        assert not ups_state[a.url]["up"] and ups_state[b.url]["up"]
        # Replacing the set at run time (weight sync) brings A back with a new version.
        c.set_upstreams([{"url": a.url, "weight_version": 7}])
        assert c.state()["weight_version"] == 7
        assert served_by(on_a[0]) == "A"
        assert c.records(on_a[0].id)[-1].weight_version == 7


def test_upstream_down_502_and_timeout_504(
    engines: tuple[FakeEngine, FakeEngine], tmp_path: Path
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    with start(tmp_path, [{"url": dead}], max_retries=1) as h, h.client() as c:
        r = c.create_rollout()
        with openai.OpenAI(base_url=r.base_url, api_key=r.token, max_retries=0) as oa:
            with pytest.raises(openai.APIStatusError) as e:
                oa.chat.completions.create(model="m", messages=MESSAGES)
        assert e.value.status_code == 502
        assert "is the engine running" in str(e.value)
        rec = c.records(r.id)[0]
        assert (rec.status, rec.delivered, rec.http_status) == ("upstream_error", False, 502)
    a = engines[0]
    a.reset()
    (tmp_path / "t").mkdir()
    with start(tmp_path / "t", [{"url": a.url}], upstream_timeout_s=0.3) as h, h.client() as c:
        r = c.create_rollout()
        a.control(delay_s=1.0)
        with openai.OpenAI(base_url=r.base_url, api_key=r.token, max_retries=0) as oa:
            with pytest.raises(openai.APIStatusError) as e:
                oa.chat.completions.create(model="m", messages=MESSAGES)
        a.control()
        assert e.value.status_code == 504
        assert "upstream_timeout_s" in str(e.value)


def test_engine_without_ids_is_recorded_and_flagged(tmp_path: Path) -> None:
    plain = FakeEngine("plain", no_ids=True)
    try:
        with start(tmp_path, [{"url": plain.url, "engine": "openai"}]) as h, h.client() as c:
            r = c.create_rollout()
            with openai.OpenAI(base_url=r.base_url, api_key=r.token) as oa:
                text = (
                    oa.chat.completions.create(model="m", messages=MESSAGES)
                    .choices[0]
                    .message.content
                )
                streamed = "".join(
                    ch.choices[0].delta.content or ""
                    for ch in oa.chat.completions.create(model="m", messages=MESSAGES, stream=True)
                    if ch.choices
                )
            recs = c.records(r.id)
            assert [x.text for x in recs] == [text, streamed]
            for x in recs:
                assert x.status == "ok" and x.completion_ids is None
                assert "no_ids" in x.flags and "no_prompt_ids" in x.flags
                assert not x.trainable
    finally:
        plain.stop()


def test_eval_mode_without_capture(engines: tuple[FakeEngine, FakeEngine], tmp_path: Path) -> None:
    a = engines[0]
    a.reset()
    with (
        start(tmp_path, [{"url": a.url}], eval_capture=False, eval_temperature=0.0) as h,
        h.client() as c,
    ):
        r = c.create_rollout(mode="eval")
        with openai.OpenAI(base_url=r.base_url, api_key=r.token) as oa:
            resp = oa.chat.completions.create(model="m", messages=MESSAGES)
        assert resp.choices[0].logprobs is None  # nothing was asked of the engine
        rec = c.records(r.id)[0]
        assert rec.completion_ids is None and rec.flags == []
