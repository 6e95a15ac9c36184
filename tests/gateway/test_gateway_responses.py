"""The OpenAI Responses API on the gateway, with the real ``openai`` SDK as the
harness and the fake vLLM engine (scripted Hermes tool calls in vLLM's exact
wire shape) as the upstream: streamed and not, a function-tool round trip,
``previous_response_id`` (also after a gateway restart), ``GET`` of stored
responses, 400s in the Responses error shape, and the exact trace that merges
into one sample."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

import lightning
import store_sql
from fake_vllm import FakeEngine
from gateways import start_gateway
from lightning import GatewayClient

SHELL = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
}
SCRIPT = [
    {
        "content": "On it.",
        "tool_calls": [{"name": "exec_command", "arguments": {"cmd": "echo hi > a.txt"}}],
    },
    {"content": "Done: a.txt written."},
]
TASK = "Write hi into a.txt."


ENGINE = {"name": "R", "script": SCRIPT}


def start(tmp_path: Path, engine: FakeEngine) -> lightning.GatewayHandle:
    return start_gateway(engine.url, tmp_path / "gw.db")


def sdk(rollout: lightning.Rollout) -> openai.OpenAI:
    return openai.OpenAI(base_url=rollout.base_url, api_key=rollout.token, max_retries=0)


def assert_trace_exact(client: GatewayClient, rollout_id: str, engine: FakeEngine) -> None:
    """Every call in the store holds exactly the ids and logprobs the engine sent."""
    answers = engine.log()["answers"]
    recs = client.records(rollout_id)
    assert len(recs) == len(answers) > 0
    for rec, a in zip(recs, answers, strict=True):
        (ch,) = a["choices"]
        assert rec.status == "ok" and rec.delivered and rec.flags == []
        np.testing.assert_array_equal(rec.prompt_ids, a["prompt_ids"][0])
        np.testing.assert_array_equal(rec.completion_ids, ch["ids"])
        np.testing.assert_array_equal(rec.logprobs, np.asarray(ch["logprobs"], np.float32))
        assert rec.kind == "chat"


def assert_one_sample(client: GatewayClient, rollout_id: str) -> None:
    calls = client.trace(rollout_id)
    merged = lightning.merge_calls(calls)
    assert len(merged.samples) == 1, merged.divergences
    assert merged.divergences == []


def test_tool_round_trip_not_streamed(
    client: GatewayClient, engine: FakeEngine, tmp_path: Path
) -> None:
    r = client.create_rollout({"task": TASK})
    oa = sdk(r)
    first = oa.responses.create(model="m", input=TASK, tools=[SHELL], metadata={"k": "v"})
    assert first.status == "completed" and first.metadata == {"k": "v"}
    kinds = [item.type for item in first.output]
    assert kinds == ["message", "function_call"]
    assert first.output_text == "On it."
    call = first.output[1]
    assert call.name == "exec_command" and json.loads(call.arguments) == {"cmd": "echo hi > a.txt"}
    assert call.call_id.startswith("chatcmpl-tool-")
    assert first.usage is not None and first.usage.output_tokens == len(
        engine.log()["answers"][0]["choices"][0]["ids"]
    )
    # The harness sends the whole history back (as Codex does), with the tool result.
    history: list[Any] = [
        {"role": "user", "content": TASK},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "ok"},
    ]
    second = oa.responses.create(model="m", input=history, tools=[SHELL], store=False)
    assert second.output_text == "Done: a.txt written."
    assert [i.type for i in second.output] == ["message"]
    # What the engine saw is the faithful translation.
    seen = engine.log()["answers"]
    assert len(seen) == 2
    assert_trace_exact(client, r.id, engine)
    assert_one_sample(client, r.id)
    # The store says which protocol each call spoke and keeps the harness's own body.
    # (from another process while this one's gateway has the store open)
    rows = store_sql.rows(
        tmp_path / "gw.db",
        "SELECT protocol, harness_request, request FROM calls WHERE rollout_id = ? ORDER BY seq",
        r.id,
    )
    assert [p for p, _, _ in rows] == ["openai_responses", "openai_responses"]
    assert json.loads(rows[0][1])["input"] == TASK
    assert json.loads(rows[0][2])["messages"] == [{"role": "user", "content": TASK}]
    # Stored responses can be fetched (store defaults to true); store=false ones cannot.
    assert oa.responses.retrieve(first.id).output_text == "On it."
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(second.id)


def test_streamed_events_and_previous_response_id(
    client: GatewayClient, engine: FakeEngine
) -> None:
    r = client.create_rollout()
    oa = sdk(r)
    events = list(oa.responses.create(model="m", input=TASK, tools=[SHELL], stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for needed in (
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ):
        assert needed in types
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    final = events[-1].response
    assert text == final.output_text == "On it."
    assert json.loads(args) == {"cmd": "echo hi > a.txt"}
    call = final.output[1]
    # Continue from the stored response: only the tool output is sent.
    second = oa.responses.create(
        model="m",
        previous_response_id=final.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "ok"}],
        tools=[SHELL],
        stream=True,
    )
    done = [e for e in second if e.type == "response.completed"]
    assert done[0].response.output_text == "Done: a.txt written."
    assert done[0].response.previous_response_id == final.id
    assert_trace_exact(client, r.id, engine)
    assert_one_sample(client, r.id)


def test_previous_response_survives_restart(engine: FakeEngine, tmp_path: Path) -> None:
    engine.reset()
    h = start(tmp_path, engine)
    c = h.client()
    r = c.create_rollout()
    first = sdk(r).responses.create(model="m", input=TASK, tools=[SHELL])
    c.close()
    h.stop()
    h = start(tmp_path, engine)  # same db
    try:
        c = h.client()
        r2 = c.create_rollout(rollout_id=r.id)
        assert r2.token == r.token
        oa = openai.OpenAI(base_url=h.url + f"/rollouts/{r.id}/v1", api_key=r.token)
        second = oa.responses.create(
            model="m",
            previous_response_id=first.id,
            input=[
                {"type": "function_call_output", "call_id": first.output[1].call_id, "output": "ok"}
            ],
            tools=[SHELL],
        )
        assert second.output_text == "Done: a.txt written."
        assert_one_sample(c, r.id)
        c.close()
    finally:
        h.stop()


def test_refusals_and_auth(client: GatewayClient, gw: lightning.GatewayHandle) -> None:
    r = client.create_rollout()
    oa = sdk(r)
    cases: list[dict[str, Any]] = [
        {"input": "x", "tools": [{"type": "web_search"}]},
        {"input": "x", "background": True},
        {
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": "http://x/y.png"}],
                }
            ]
        },
    ]
    for body in cases:
        with pytest.raises(openai.BadRequestError) as e:
            oa.responses.create(model="m", **body)
        err = e.value.body
        assert isinstance(err, dict) and err.get("type") == "invalid_request_error", err
        assert err.get("message")
    with pytest.raises(openai.NotFoundError):
        oa.responses.create(model="m", input="x", previous_response_id="resp_nope")
    # Bad credentials get the same shape on /v1.
    bad = openai.OpenAI(base_url=gw.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as auth:
        bad.responses.create(model="m", input="x")
    assert isinstance(auth.value.body, dict) and auth.value.body.get("code") == "invalid_api_key"
    assert client.records(r.id) == []  # refused calls never reach the engine or the trace
    # The rollout token also works as `x-api-key` (Anthropic-style clients).
    ok = httpx.post(
        gw.url + "/v1/responses",
        headers={"x-api-key": r.token},
        json={"model": "m", "input": TASK, "store": False},
    )
    assert ok.status_code == 200 and ok.json()["status"] == "completed"
    assert len(client.records(r.id)) == 1
    assert oa.models.list().data[0].id == "fake-model"
