"""The fake vLLM engine's scripted tool calls (tests/support/fake_vllm.py --script), through the
real `openai` SDK: the wire shape of vLLM's hermes tool parser, streamed and not, and a
tool conversation whose prompts extend each other (so it merges into one sample)."""

from __future__ import annotations

import json

import openai
import pytest

from fake_vllm import FakeEngine

SHELL = {
    "type": "function",
    "function": {"name": "exec_command", "parameters": {"type": "object"}},
}
SCRIPT = [
    {
        "content": "On it.",
        "tool_calls": [{"name": "exec_command", "arguments": {"cmd": "echo hi > a.txt"}}],
    },
    {"content": "Done: a.txt written."},
]
USER = [{"role": "user", "content": "Write hi into a.txt."}]


@pytest.fixture(scope="module")
def fake():
    engine = FakeEngine(script=SCRIPT)
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def client(fake: FakeEngine) -> openai.OpenAI:
    return openai.OpenAI(base_url=fake.url, api_key="unused", max_retries=0)


def test_script_turns_not_streamed(client: openai.OpenAI, fake: FakeEngine) -> None:
    fake.reset()
    ids = {"return_token_ids": True}
    first = client.chat.completions.create(model="m", messages=USER, tools=[SHELL], extra_body=ids)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "On it."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "exec_command",
        {"cmd": "echo hi > a.txt"},
    )
    history = [
        *USER,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "ok"},
    ]
    second = client.chat.completions.create(
        model="m", messages=history, tools=[SHELL], extra_body=ids
    )
    assert second.choices[0].message.content == "Done: a.txt written."
    assert second.choices[0].finish_reason == "stop"
    # The second prompt extends the first prompt and its completion, id for id.
    p1, c1 = first.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    p2 = second.model_extra["prompt_token_ids"]
    assert p2[: len(p1) + len(c1)] == p1 + c1
    log = fake.log()["answers"]
    assert [a["choices"][0]["ids"] for a in log] == [c1, second.choices[0].model_extra["token_ids"]]


def test_script_streamed_like_vllm(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="m",
        messages=USER,
        tools=[SHELL],
        stream=True,
        extra_body={"return_token_ids": True},
    )
    content, name, arguments, ids, finish = "", None, "", [], None
    for chunk in stream:
        choice = chunk.choices[0]
        ids += choice.model_extra.get("token_ids") or []
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.id:
                assert name is None and d.type == "function"
                name = d.function.name
            else:
                arguments += d.function.arguments
        finish = choice.finish_reason or finish
    text = 'On it.<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "echo hi > a.txt"}}\n</tool_call>'
    assert content == "On it." and name == "exec_command"
    assert json.loads(arguments) == {"cmd": "echo hi > a.txt"}
    assert ids == [b + 10 for b in text.encode()]  # every id of the text the model wrote
    assert finish == "tool_calls"
