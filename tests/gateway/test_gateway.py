"""The gateway end to end: the real ``openai`` SDK as the harness, the gateway
from the extension, and a fake vLLM engine process as the upstream."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

import lightning
from fake_vllm import FakeEngine
from gateways import start_gateway, wait_until
from lightning import Gateway, GatewayClient, GatewayConfig, GatewayRequestError, Store

ENGINE = {"name": "A"}
# retry_base_ms: retries in tests need not wait long.
GATEWAY = {"weight_version": 3, "retry_base_ms": 5}


def start(tmp_path: Path, upstreams: list[dict[str, Any]], **kw: Any) -> lightning.GatewayHandle:
    return start_gateway(upstreams, tmp_path / "gw.db", retry_base_ms=5, **kw)


_OPEN: list[openai.OpenAI] = []


def sdk(rollout: lightning.Rollout, base_url: str | None = None, **kw: Any) -> openai.OpenAI:
    """An SDK client for the rollout, closed when the test ends: one left to the
    garbage collector reports its sockets during whichever test runs then."""
    c = openai.OpenAI(base_url=base_url or rollout.base_url, api_key=rollout.token, **kw)
    _OPEN.append(c)
    return c


@pytest.fixture(autouse=True)
def _close_sdks() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().close()


def assert_matches_engine(
    records: list[lightning.CallRecord], answers: list[dict[str, Any]]
) -> None:
    """The store holds exactly the ids and logprobs the engine produced."""
    flat = [(a, i, ch) for a in answers for i, ch in enumerate(a["choices"])]
    assert len(records) == len(flat)
    for rec, (a, i, ch) in zip(records, flat, strict=True):
        prompt = a["prompt_ids"][0]  # one prompt per request in these tests
        assert rec.prompt_ids is not None and rec.completion_ids is not None
        assert rec.prompt_ids.dtype == np.uint32 and rec.completion_ids.dtype == np.uint32
        np.testing.assert_array_equal(rec.prompt_ids, prompt)
        np.testing.assert_array_equal(rec.completion_ids, ch["ids"])
        assert rec.logprobs is not None
        np.testing.assert_array_equal(rec.logprobs, np.asarray(ch["logprobs"], np.float32))
        assert rec.finish_reason == ch["finish_reason"]
        assert rec.choice_index == i


MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say something [[len:9]]"},
]


def test_chat_non_streaming_recorded_exactly(client: GatewayClient, engine: FakeEngine) -> None:
    r = client.create_rollout({"q": "hello"}, group="g1")
    resp = sdk(r).chat.completions.create(model="m", messages=MESSAGES)
    ans = engine.log()["answers"]
    assert resp.choices[0].message.content == ans[0]["choices"][0]["text"]
    recs = client.records(r.id)
    assert_matches_engine(recs, ans)
    rec = recs[0]
    assert (rec.status, rec.delivered, rec.flags, rec.weight_version) == ("ok", True, [], 3)
    assert rec.group is None  # records() leaves group to trace(); Store fills it
    info = client.get_rollout(r.id)
    assert info["status"] == "running" and info["n_calls"] == 1 and info["group"] == "g1"
    (call,) = client.trace(r.id)
    assert isinstance(call, lightning.Call) and call.group == "g1" and call.rollout_id == r.id
    np.testing.assert_array_equal(call.prompt_ids, rec.prompt_ids)
    np.testing.assert_array_equal(call.logprobs, rec.logprobs)
    assert call.finish_reason == rec.finish_reason and call.weight_version == 3


def test_harness_sees_engine_answer_unchanged(client: GatewayClient, engine: FakeEngine) -> None:
    r = client.create_rollout()
    raw = sdk(r).chat.completions.with_raw_response.create(model="m", messages=MESSAGES)
    through = json.loads(raw.http_response.content)
    # Ask the engine directly with the body the gateway forwarded.
    body = {"model": "m", "messages": MESSAGES, "return_token_ids": True, "logprobs": True}
    direct = httpx.post(engine.url + "/chat/completions", json=body).json()
    through.pop("created"), direct.pop("created")
    assert through == direct
    assert raw.http_response.headers["content-type"] == "application/json"


def test_completions_and_bearer_route(
    client: GatewayClient, gw: lightning.GatewayHandle, engine: FakeEngine
) -> None:
    r = client.create_rollout()
    # Harnesses that can only set an API key use /v1 with the rollout token.
    oa = sdk(r, base_url=gw.url + "/v1")
    resp = oa.completions.create(model="m", prompt="Once upon [[len:7]]", max_tokens=7)
    ans = engine.log()["answers"]
    assert resp.choices[0].text == ans[0]["choices"][0]["text"]
    recs = client.records(r.id)
    assert_matches_engine(recs, ans)
    assert recs[0].kind == "completion"
    assert oa.models.list().data[0].id == "fake-model"


def test_chat_n2_and_tool_calls(client: GatewayClient, engine: FakeEngine) -> None:
    r = client.create_rollout()
    oa = sdk(r)
    msgs = [{"role": "user", "content": "weather? [[tool]]"}]
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ]
    resp = oa.chat.completions.create(model="m", messages=msgs, tools=tools, n=2)  # type: ignore[arg-type]
    tc = resp.choices[0].message.tool_calls
    assert tc is not None and tc[0].function.name == "get_weather"
    assert resp.choices[0].finish_reason == "tool_calls"
    recs = client.records(r.id)
    assert [x.choice_index for x in recs] == [0, 1]
    assert len({x.request_id for x in recs}) == 1
    assert_matches_engine(recs, engine.log()["answers"])


def test_streaming_chat_sync_and_async(client: GatewayClient, engine: FakeEngine) -> None:
    r = client.create_rollout()
    text = ""
    for chunk in sdk(r).chat.completions.create(
        model="m", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content

    async def run_async() -> str:
        oa = openai.AsyncOpenAI(base_url=r.base_url, api_key=r.token)
        out = ""
        stream = await oa.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "more [[len:12]]"}], stream=True, n=2
        )
        async for chunk in stream:
            for ch in chunk.choices:
                if ch.index == 1 and ch.delta.content:
                    out += ch.delta.content
        await oa.close()
        return out

    text2 = asyncio.run(run_async())
    ans = engine.log()["answers"]
    assert text == ans[0]["choices"][0]["text"]
    assert text2 == ans[1]["choices"][1]["text"]
    recs = client.records(r.id)
    assert_matches_engine(recs, ans)
    assert recs[0].usage is not None and recs[0].usage["completion_tokens"] == 9
    assert recs[0].text == text
    assert all(x.status == "ok" and x.delivered and not x.flags for x in recs)


def test_streaming_completions(client: GatewayClient, engine: FakeEngine) -> None:
    r = client.create_rollout()
    out = "".join(
        c.choices[0].text
        for c in sdk(r).completions.create(
            model="m", prompt="abc [[len:6]]", stream=True, logprobs=2
        )
        if c.choices
    )
    ans = engine.log()["answers"]
    assert out == ans[0]["choices"][0]["text"]
    assert_matches_engine(client.records(r.id), ans)


def test_rollout_api(client: GatewayClient) -> None:
    a = client.create_rollout({"t": 1}, group="G", rollout_id="fixed-1")
    again = client.create_rollout({"t": 1}, group="G", rollout_id="fixed-1")
    assert again.token == a.token and again.id == "fixed-1"
    with pytest.raises(GatewayRequestError) as e:
        client.create_rollout({"t": 2}, group="G", rollout_id="fixed-1")
    assert e.value.status == 409
    b = client.create_rollout({"t": 2}, group="H", mode="eval")
    assert {x["rollout_id"] for x in client.list_rollouts(group="G")} == {"fixed-1"}
    client.set_status(b.id, "succeeded")
    assert [x["rollout_id"] for x in client.list_rollouts(status="succeeded")] == [b.id]
    assert client.reward(a.id, 0.5, source="judge", token=a.token) == 0
    client.event(a.id, "note", {"k": [1, 2]}, token=a.token)
    client.reward(a.id, 1.0)
    ev = client.events(a.id)
    assert [(x["type"], x["seq"]) for x in ev] == [("reward", 0), ("note", 1), ("reward", 2)]
    assert ev[1]["data"] == {"k": [1, 2]}
    assert client.get_rollout(a.id)["reward"] == 1.0
    with pytest.raises(GatewayRequestError) as e:
        client.set_status(a.id, "exploded")  # type: ignore[arg-type]
    assert e.value.status == 400


def test_auth_and_errors(client: GatewayClient, gw: lightning.GatewayHandle) -> None:
    a = client.create_rollout()
    b = client.create_rollout()
    url = f"{gw.url}/rollouts/{a.id}/v1/chat/completions"
    body = {"model": "m", "messages": MESSAGES}

    def post(
        u: str, token: str | None, headers: dict[str, str] | None = None, **kw: Any
    ) -> httpx.Response:
        h = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.post(u, headers={**h, **(headers or {})}, **kw)

    JSON = {"Content-Type": "application/json"}

    cases = [
        (post(url, None, json=body), 401, "invalid_api_key"),
        (post(url, "lt-nope", json=body), 401, "invalid_api_key"),
        (post(url, b.token, json=body), 403, "wrong_rollout"),
        # A missing rollout answers as an existing one does (no existence oracle).
        (
            post(f"{gw.url}/rollouts/nope/v1/chat/completions", a.token, json=body),
            403,
            "wrong_rollout",
        ),
        (post(url, a.token, content=b"{not json", headers=JSON), 400, "invalid_json"),
        (
            post(f"{gw.url}/rollouts/{a.id}/reward", b.token, json={"value": 1}),
            403,
            "wrong_rollout",
        ),
        (
            post(f"{gw.url}/rollouts/{a.id}/reward", a.token, json={"value": "x"}),
            400,
            "invalid_reward",
        ),
        (post(f"{gw.url}/rollouts", a.token, json={}), 401, "invalid_api_key"),
        (post(f"{gw.url}/admin/pause", a.token, json={}), 401, "invalid_api_key"),
        (post(f"{gw.url}/v1/chat/completions", "lt-unknown", json=body), 401, "invalid_api_key"),
        (httpx.get(f"{gw.url}/nowhere"), 404, "route_not_found"),
    ]
    for resp, status, code in cases:
        assert resp.status_code == status, resp.text
        err = resp.json()["error"]
        assert err["code"] == code and err["message"] and err["type"]
    # The SDK surfaces these as its own exception types.
    with pytest.raises(openai.PermissionDeniedError):
        with openai.OpenAI(base_url=a.base_url, api_key=b.token) as oa:
            oa.chat.completions.create(model="m", messages=MESSAGES)


def test_body_limit(engine: FakeEngine, tmp_path: Path) -> None:
    with start(tmp_path, [{"url": engine.url}], max_body_bytes=2048) as h:
        c = h.client()
        r = c.create_rollout()
        big = {"model": "m", "messages": [{"role": "user", "content": "x" * 4096}]}
        resp = httpx.post(
            r.base_url + "/chat/completions",
            headers={"Authorization": f"Bearer {r.token}"},
            json=big,
        )
        assert resp.status_code == 413
        assert "max_body_bytes" in resp.json()["error"]["message"]
        c.close()


def test_pause_drain_resume(client: GatewayClient, engine: FakeEngine) -> None:
    r = client.create_rollout()
    oa = sdk(r, max_retries=0)
    done: list[str] = []

    def slow_call() -> None:
        msgs = [{"role": "user", "content": "slow [[len:10]] [[slow:0.03]]"}]
        text = ""
        for c in oa.chat.completions.create(model="m", messages=msgs, stream=True):
            if c.choices and c.choices[0].delta.content:
                text += c.choices[0].delta.content
        done.append(text)

    t = threading.Thread(target=slow_call)
    t.start()
    wait_until(lambda: client.state()["in_flight"], "the slow call in flight", every=0.005)
    st = client.pause(drain=True, timeout_s=10)
    # pause() returned only after the in-flight stream finished.
    assert st["paused"] and st["drained"] and st["in_flight"] == 0
    t.join(5)
    assert len(done) == 1 and len(done[0]) == 10
    with pytest.raises(openai.InternalServerError) as e:
        oa.chat.completions.create(model="m", messages=MESSAGES)
    assert e.value.status_code == 503
    assert e.value.response.headers["retry-after"] == "1"
    client.resume()
    assert not client.state()["paused"]
    oa.chat.completions.create(model="m", messages=MESSAGES)
    assert [x.status for x in client.records(r.id)] == ["ok", "ok"]


def test_client_disconnect_records_aborted(
    client: GatewayClient, gw: lightning.GatewayHandle
) -> None:
    r = client.create_rollout()
    body = {
        "model": "m",
        "stream": True,
        "messages": [{"role": "user", "content": "x [[len:40]] [[slow:0.02]]"}],
    }
    with httpx.stream(
        "POST",
        r.base_url + "/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {r.token}"},
    ) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
    recs = wait_until(lambda: client.records(r.id), "the aborted call's record")
    assert len(recs) == 1
    rec = recs[0]
    assert rec.status == "aborted" and not rec.delivered
    assert client.trace(r.id) == []  # the harness never saw it whole: not trained on
    assert rec.completion_ids is not None and 0 < len(rec.completion_ids) < 40
    assert client.state()["in_flight"] == 0


def test_midstream_upstream_failure(client: GatewayClient, engine: FakeEngine) -> None:
    r = client.create_rollout()
    engine.control(break_stream_after=3)
    with pytest.raises(openai.APIError) as e:
        for _ in sdk(r).chat.completions.create(model="m", messages=MESSAGES, stream=True):
            pass
    assert "stream" in str(e.value)
    rec = client.records(r.id)[0]
    assert rec.status == "upstream_error" and not rec.delivered
    assert rec.completion_ids is not None and len(rec.completion_ids) == 3


def test_inconsistent_stream_is_flagged(client: GatewayClient, engine: FakeEngine) -> None:
    r = client.create_rollout()
    engine.control(extra_stream_id=True)
    list(
        sdk(r).chat.completions.create(
            model="m", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
    )
    rec = client.records(r.id)[0]
    assert rec.status == "ok"
    assert set(rec.flags) == {"ids_usage_mismatch", "logprobs_count_mismatch"}


def test_sdk_retry_is_recorded(engine: FakeEngine, tmp_path: Path) -> None:
    engine.reset()
    with start(tmp_path, [{"url": engine.url}], max_retries=0) as h:
        c = h.client()
        r = c.create_rollout()
        engine.control(fail_next=1, fail_status=500)
        sdk(r, max_retries=2).chat.completions.create(model="m", messages=MESSAGES)
        recs = c.records(r.id)
        assert [(x.status, x.delivered, x.retry_count, x.http_status) for x in recs] == [
            # The engine's 500 reached the harness (delivered), but it is no completion.
            ("upstream_error", True, 0, 500),
            ("ok", True, 1, 200),
        ]
        c.close()


def test_gateway_retries_before_first_byte(client: GatewayClient, engine: FakeEngine) -> None:
    r = client.create_rollout()
    engine.control(fail_next=2, fail_status=503)
    resp = sdk(r, max_retries=0).chat.completions.create(model="m", messages=MESSAGES)
    assert resp.choices[0].message.content
    recs = client.records(r.id)
    assert [x.status for x in recs] == ["ok"]
    assert "lightning_upstream_retries_total 2" in client.metrics()


def test_store_file_and_healthz(
    client: GatewayClient, gw: lightning.GatewayHandle, tmp_path: Path
) -> None:
    r = client.create_rollout(group="grp")
    sdk(r).chat.completions.create(model="m", messages=MESSAGES)
    client.reward(r.id, 2.5)
    with Store(tmp_path / "gw.db") as s:
        recs = s.records(r.id)
        via_http = client.records(r.id)
        assert len(recs) == 1
        np.testing.assert_array_equal(recs[0].completion_ids, via_http[0].completion_ids)
        np.testing.assert_array_equal(recs[0].logprobs, via_http[0].logprobs)
        assert recs[0].group == "grp"
        assert s.rewards() == {r.id: 2.5}
        assert s.rollout_ids(group="grp") == [r.id]
        # Straight into lightning.Call (and so into merge_calls), no HTTP.
        (call,) = s.trace(r.id)
        assert isinstance(call, lightning.Call) and call.group == "grp" and call.weight_version == 3
        np.testing.assert_array_equal(call.completion_ids, recs[0].completion_ids)
        assert lightning.merge_calls([call]).samples[0].rollout_id == r.id
    h = client.healthz()
    assert h["status"] == "ok" and h["weight_version"] == 3
    m = client.metrics()
    assert 'lightning_recorded_calls_total{status="ok"} 1' in m
    assert "lightning_store_commit_seconds_count" in m


def test_config_toml_and_bad_config(tmp_path: Path) -> None:
    p = tmp_path / "gw.toml"
    p.write_text(
        'listen = "127.0.0.1:0"\nadmin_key = "k" \n[[upstreams]]\nurl = "http://127.0.0.1:1/v1"\nweight_version = 4\n'
    )
    cfg = GatewayConfig.from_toml(p)
    assert cfg.upstreams[0].weight_version == 4
    with pytest.raises(lightning.GatewayError, match="admin_key"):
        Gateway(cfg.model_copy(update={"db": str(tmp_path / "x.db")})).start()
    bad = cfg.model_dump() | {
        "admin_key": "long-enough-key",
        "upstreams": [{"url": "https://x/v1"}],
    }
    with pytest.raises(lightning.GatewayError, match="http://"):
        Gateway(GatewayConfig.model_validate(bad)).start()


def test_config_plain_url_upstreams() -> None:
    cfg = GatewayConfig(upstreams=["http://127.0.0.1:9/v1"], weight_version=4)  # type: ignore[list-item]
    assert cfg.upstreams[0].url == "http://127.0.0.1:9/v1" and cfg.upstreams[0].weight_version == 4
    assert "weight_version" not in json.loads(cfg.to_json())
