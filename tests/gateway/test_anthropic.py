"""Anthropic Messages through the gateway: the official ``anthropic`` SDK as the
harness, the gateway from the extension, the fake vLLM engine (scripted answers in
vLLM's exact wire shape, Hermes tool calls included) as the upstream.

Asserted every time: the SDK parses every answer and event, the engine saw the
faithful chat translation (its prompt text is checked), and the store holds the
engine's exact ids and logprobs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import numpy as np
import pytest

import lightning
import store_sql
from fake_vllm import ID_OFFSET, FakeEngine
from lightning import GatewayClient

TOOLS: list[Any] = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]
TOOL_SCRIPT = [
    {"content": "", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
    {"content": "It is sunny in Paris."},
]


ENGINE = {"name": "anthropic", "script": [{"content": "Hello from the engine."}]}
GATEWAY = {"weight_version": 2}


def sdk(rollout: lightning.Rollout) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=rollout.anthropic_base_url, api_key=rollout.token, max_retries=0
    )


def engine_prompt(answer: dict[str, Any]) -> str:
    """The prompt text the fake engine rendered (its tokenizer is bytes + ID_OFFSET)."""
    return bytes(t - ID_OFFSET for t in answer["prompt_ids"][0]).decode()


def assert_exact(records: list[lightning.CallRecord], answers: list[dict[str, Any]]) -> None:
    assert len(records) == len(answers)
    for rec, ans in zip(records, answers, strict=True):
        (choice,) = ans["choices"]
        np.testing.assert_array_equal(rec.prompt_ids, ans["prompt_ids"][0])
        np.testing.assert_array_equal(rec.completion_ids, choice["ids"])
        np.testing.assert_array_equal(rec.logprobs, np.asarray(choice["logprobs"], np.float32))
        assert rec.finish_reason == choice["finish_reason"]
        assert (rec.status, rec.delivered, rec.flags, rec.weight_version) == ("ok", True, [], 2)


def test_create_is_translated_and_recorded_exactly(
    client: GatewayClient, engine: FakeEngine, tmp_path: Path
) -> None:
    db = tmp_path / "gw.db"
    r = client.create_rollout({"q": "hi"})
    msg = sdk(r).messages.create(
        model="m",
        max_tokens=64,
        system=[{"type": "text", "text": "Be terse.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "Hello"}],
        metadata={"user_id": "u1"},
    )
    (ans,) = engine.log()["answers"]
    assert engine_prompt(ans) == (
        "<|im_start|>system\nBe terse.<|im_end|>\n"
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    )
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == "Hello from the engine."  # type: ignore[union-attr]
    assert (msg.stop_reason, msg.stop_sequence) == ("end_turn", None)
    assert msg.usage.input_tokens == len(ans["prompt_ids"][0])
    assert msg.usage.output_tokens == len(ans["choices"][0]["ids"])
    assert_exact(client.records(r.id), [ans])
    # The store keeps the protocol and the harness's own body beside the engine request.
    # (from another process while this one's gateway has the store open)
    ((protocol, original, request),) = store_sql.rows(
        db, "SELECT protocol, harness_request, request FROM calls"
    )
    assert protocol == "anthropic_messages"
    assert json.loads(original)["metadata"] == {"user_id": "u1"}
    assert json.loads(request)["messages"][0] == {"role": "system", "content": "Be terse."}


def test_stream_equals_create(client: GatewayClient, engine: FakeEngine) -> None:
    r = client.create_rollout()
    req: dict[str, Any] = {
        "model": "m",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "Hello"}],
    }
    whole = sdk(r).messages.create(**req)
    events = []
    with sdk(r).messages.stream(**req) as s:
        for ev in s:
            events.append(ev.type)
        final = s.get_final_message()
    assert final.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})
    # The SDK adds its own events (`text`, ...) and drops `ping`: read the wire too.
    wire = httpx.post(
        r.anthropic_base_url + "/v1/messages",
        json={**req, "stream": True},
        headers={"x-api-key": r.token, "anthropic-version": "2023-06-01"},
    )
    assert wire.headers["content-type"].startswith("text/event-stream")
    names = [line[7:] for line in wire.text.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert [e for e in events if e in names] == [n for n in names if n != "ping"]
    assert_exact(client.records(r.id), engine.log()["answers"])


def test_tool_round_trip_merges_into_one_sample(client: GatewayClient, engine: FakeEngine) -> None:
    engine.script(TOOL_SCRIPT)
    r = client.create_rollout({"q": "weather"}, group="g")
    c = sdk(r)
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    with c.messages.stream(model="m", max_tokens=64, tools=TOOLS, messages=messages) as s:
        first = s.get_final_message()
    assert first.stop_reason == "tool_use"
    (call,) = first.content
    assert call.type == "tool_use" and call.name == "get_weather"
    assert call.input == {"city": "Paris"}
    messages += [
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}],
        },
    ]
    second = c.messages.create(model="m", max_tokens=64, tools=TOOLS, messages=messages)
    assert second.stop_reason == "end_turn"
    assert second.content[0].text == "It is sunny in Paris."  # type: ignore[union-attr]

    answers = engine.log()["answers"]
    # The engine saw the tool call and its result as chat turns.
    assert engine_prompt(answers[1]).endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
        '"Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    records = client.records(r.id)
    assert_exact(records, answers)
    assert [x.finish_reason for x in records] == ["tool_calls", "stop"]
    merged = lightning.merge_calls(client.trace(r.id))
    (sample,) = merged.samples
    full = np.concatenate([records[1].prompt_ids, records[1].completion_ids])
    np.testing.assert_array_equal(np.asarray(sample.tokens), full)
    assert merged.divergences == []


def test_count_tokens_is_the_engine_prompt_length(
    client: GatewayClient, engine: FakeEngine
) -> None:
    r = client.create_rollout()
    req: dict[str, Any] = {
        "model": "m",
        "system": "Be terse.",
        "tools": TOOLS,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
    }
    counted = sdk(r).messages.count_tokens(**req)
    sdk(r).messages.create(max_tokens=16, **req)
    (ans,) = engine.log()["answers"]
    assert counted.input_tokens == len(ans["prompt_ids"][0]) > 0
    (rec,) = client.records(r.id)  # count_tokens generates nothing and is not recorded
    assert rec.prompt_ids.size == counted.input_tokens


def test_refusals_and_auth_in_anthropic_shape(
    client: GatewayClient, gw: lightning.GatewayHandle, engine: FakeEngine
) -> None:
    r = client.create_rollout()
    c = sdk(r)
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
    }
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": [image]}])
    assert e.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "image" in e.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError, match="web_search"):
        c.messages.create(
            model="m",
            max_tokens=8,
            messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "web_search_20250305", "name": "web_search"}],
        )
    bad = anthropic.Anthropic(base_url=r.anthropic_base_url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as auth:
        bad.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    assert auth.value.body["type"] == "error"  # type: ignore[index]
    # The engine's own refusal comes back with its status, in Anthropic's shape.
    engine.control(fail_next=1, fail_status=400)
    with pytest.raises(anthropic.BadRequestError, match="injected failure"):
        c.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    assert engine.log()["answers"] == []
    # /v1/messages without a rollout in the path: the x-api-key picks the rollout.
    plain = anthropic.Anthropic(base_url=gw.url, api_key=r.token, max_retries=0)
    plain.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    assert len(client.records(r.id)) == 2  # the refused-by-engine call is recorded too
    # Not JSON at all: a 400 in Anthropic's shape.
    raw = httpx.post(
        r.anthropic_base_url + "/v1/messages",
        content=b"{",
        headers={"x-api-key": r.token, "content-type": "application/json"},
    )
    assert raw.status_code == 400
    assert raw.json()["type"] == "error"
    assert raw.json()["error"]["type"] == "invalid_request_error"


def test_the_rollout_answer_and_claude_codes_probe(
    client: GatewayClient, gw: lightning.GatewayHandle
) -> None:
    """`POST /rollouts` answers the Anthropic base URL beside the OpenAI one, and
    the `HEAD` probe Claude Code sends to it (2.1.197: `HEAD /rollouts/{id}`) is a
    reachable gateway, not an error in the metrics."""
    created = httpx.post(
        gw.url + "/rollouts",
        json={"task": "t1"},
        headers={"Authorization": f"Bearer {client.admin_key}"},
    ).json()
    rid = created["rollout_id"]
    assert created["base_url"] == f"{gw.url}/rollouts/{rid}/v1"
    assert created["anthropic_base_url"] == f"{gw.url}/rollouts/{rid}"
    # The Python record gives the same URL.
    assert (
        client.create_rollout(rollout_id=rid, task="t1").anthropic_base_url
        == (created["anthropic_base_url"])
    )
    for probe in (created["anthropic_base_url"], gw.url + "/rollouts/no-such-rollout"):
        assert httpx.head(probe).status_code == 200
    errors = [
        line
        for line in httpx.get(gw.url + "/metrics").text.splitlines()
        if line.startswith("lightning_errors_total{")
    ]
    assert errors == [], errors
    # An unknown route still counts.
    assert httpx.delete(created["anthropic_base_url"]).status_code == 404
    assert 'lightning_errors_total{code="route_not_found"} 1' in httpx.get(gw.url + "/metrics").text
