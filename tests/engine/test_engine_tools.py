"""Tool calls in the embedded engine (`lightning serve`): rendering, parsing, wire shape.

The parser is checked against the plain reference (tests/support/reference.py) and, streamed
in any chunking, against its own non-streamed answer. The server tests run the tiny
model with lightning's ChatML tool template through the real `openai` SDK; a scripted
sampler makes the model "choose" a tool call: it returns the script's next token and
the model's real log-probability of it, so everything after sampling (detokenizing,
parsing, ids, logprobs, the wire) is the engine's own and the ids returned are
exactly the ids generated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

import lightning.engine.core as engine_core
from lightning.engine import Engine, tools
from lightning.engine.sampling import Choice
from lightning.engine.server import RunningServer
from lightning.model_cache import tiny_model_dir
from reference import hermes_tool_calls

SHELL = {
    "type": "function",
    "function": {
        "name": "exec_command",
        "description": "Run a shell command.",
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string"}},
            "required": ["cmd"],
        },
    },
}
CALL_TEXT = (
    '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "echo hi > a.txt"}}\n</tool_call>'
)
MESSAGES = [{"role": "user", "content": "Write hi into a.txt."}]


# ---------------------------------------------------------------------- the parser
def stream_all(text: str, cuts: list[int]) -> tuple[str, list[dict[str, Any]], list[str]]:
    """Feed ``text`` growing at ``cuts``; assemble content, calls and per-delta keys."""
    parser = tools.StreamParser()
    content, calls = "", []
    shapes = []
    bounds = [*sorted({c for c in cuts if 0 < c < len(text)}), len(text)]
    for end in bounds:
        delta = parser.feed(text[:end], finished=end == len(text))
        if delta is None:
            continue
        shapes.append(",".join(sorted(delta)))
        content += delta["content"] or ""
        for d in delta["tool_calls"]:
            if "id" in d:
                assert d["index"] == len(calls) and d["type"] == "function"
                assert d["id"].startswith("chatcmpl-tool-")
                calls.append({"name": d["function"]["name"], "arguments": ""})
            else:
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return content, calls, shapes


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)
CALLS = st.lists(
    st.tuples(
        st.text("abc_", min_size=1, max_size=6),
        st.dictionaries(st.text("xyz", max_size=3), JSON_VALUES, max_size=3),
    ),
    min_size=1,
    max_size=3,
)


@st.composite
def generated_texts(draw: Any) -> str:
    """What a model might write: content, then calls (well-formed or not), maybe cut."""
    head = draw(st.sampled_from(["", "Sure. ", "<tool", "a < b "]))
    parts = []
    for name, args in draw(CALLS):
        body = json.dumps({"name": name, "arguments": args})
        body = draw(st.sampled_from([body, body[:-1], "not json", body.replace('"', "'")]))
        parts.append(f"<tool_call>\n{body}\n</tool_call>")
    text = head + "\n".join(parts)
    cut = draw(st.integers(0, len(text)))
    return draw(st.sampled_from([text, text[:cut]]))


@settings(max_examples=300, deadline=None)
@given(generated_texts())
@example('Sure. <tool_call>\n{"name": "f", "arguments": {"x": [1, "}"]}}\n</tool_call>')
@example("<tool_call>\nnot json\n</tool_call>")
@example("no calls at all <tool_")
def test_extract_matches_reference(text: str) -> None:
    expected = hermes_tool_calls(text)
    got = tools.extract(text)
    if expected is None:
        assert got is None
        return
    assert got is not None
    content, calls = expected
    assert got.content == content
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got.tool_calls
    ] == calls
    assert all(
        c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in got.tool_calls
    )


@settings(max_examples=300, deadline=None)
@given(generated_texts(), st.lists(st.integers(0, 400), max_size=30))
@example(CALL_TEXT, [3, 15, 40])
@example("<tool_call>\nnot json\n</tool_call>", [1, 5])
def test_stream_assembles_to_the_non_streamed_answer(text: str, cuts: list[int]) -> None:
    content, calls, shapes = stream_all(text, cuts)
    assert all(shape == "content,tool_calls" for shape in shapes)  # vLLM's delta keys
    found = tools.extract(text)
    if found is None:
        if not calls:  # text that fails to parse stays text, whole
            assert content == text
        return
    assert content == (found.content or "")
    assert [c["name"] for c in calls] == [c["function"]["name"] for c in found.tool_calls]
    for streamed, final in zip(calls, found.tool_calls, strict=True):
        assert json.loads(streamed["arguments"]) == json.loads(final["function"]["arguments"])


def test_stream_holds_back_only_a_possible_tag() -> None:
    parser = tools.StreamParser()
    assert parser.feed("Sure <tool", finished=False) == {"content": "Sure ", "tool_calls": []}
    assert parser.feed("Sure <tool_c", finished=False) is None
    delta = parser.feed('Sure <tool_call>{"name": "f", "arguments": {"a', finished=False)
    assert delta is not None and delta["content"] is None
    assert [d["function"] for d in delta["tool_calls"]] == [{"name": "f"}, {"arguments": '{"a'}]
    delta = parser.feed('Sure <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_', False)
    assert delta == {
        "content": None,
        "tool_calls": [{"index": 0, "function": {"arguments": '": 1}'}}],
    }


# ---------------------------------------------------------------------- the server
class ScriptedSampler:
    """Stands in for `sample_row` (prefill) and, row by row, for `sample_rows`
    (decode steps): each sequence emits `ids` in order, then EOS."""

    def __init__(self, ids: list[int], eos: int) -> None:
        self.ids, self.eos = ids, eos
        self.position: dict[int, int] = {}

    def __call__(self, logits, raw, params, generator, mode) -> Choice:  # type: ignore[no-untyped-def]
        i = self.position.get(id(generator), 0)
        self.position[id(generator)] = i + 1
        token = self.ids[i] if i < len(self.ids) else self.eos
        top = None
        if params.logprobs:
            values, ids = torch.topk(raw, params.logprobs)
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        return Choice(token=token, logprob=float(raw[token]), top=top)

    def rows(self, logits, raw, params, generators, mode) -> list[Choice]:  # type: ignore[no-untyped-def]
        return [self(logits[i], raw[i], params[i], generators[i], mode) for i in range(len(params))]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir()


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = tools.CHATML_TOOLS_TEMPLATE.read_text(encoding="utf-8")
    return tok


@pytest.fixture(scope="module")
def server(model_dir: Path):
    engine = Engine(model_dir, max_batch=4, chat_template=tools.CHATML_TOOLS_TEMPLATE).start()
    assert engine.tool_parser == "hermes"
    with RunningServer(engine) as running:
        yield running
    engine.close()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def script(monkeypatch: pytest.MonkeyPatch, tokenizer, text: str) -> list[int]:
    """Make the model write ``text`` then EOS; the ids it will generate."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    sampler = ScriptedSampler(ids, tokenizer.eos_token_id)
    monkeypatch.setattr(engine_core, "sample_row", sampler)
    monkeypatch.setattr(engine_core, "sample_rows", sampler.rows)
    return [*ids, tokenizer.eos_token_id]


def model_logprobs(model_dir: Path, prompt: list[int], completion: list[int]) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(completion)]


def test_tool_call_not_streamed(monkeypatch, tokenizer, client, model_dir) -> None:
    ids = script(monkeypatch, tokenizer, "Let me do that." + CALL_TEXT)
    resp = client.chat.completions.create(
        model="",
        messages=MESSAGES,
        tools=[SHELL],
        logprobs=True,
        max_tokens=200,
        extra_body={"return_token_ids": True},
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me do that."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "exec_command"
    assert json.loads(call.function.arguments) == {"cmd": "echo hi > a.txt"}
    # The exact ids: the prompt is the template with the tools, the completion what was sampled.
    prompt = tokenizer.apply_chat_template(MESSAGES, tools=[SHELL], add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    assert resp.model_extra["prompt_token_ids"] == prompt
    assert choice.model_extra["token_ids"] == ids
    got = [t.logprob for t in choice.logprobs.content]
    assert got == pytest.approx(model_logprobs(model_dir, prompt, ids), abs=1e-4)


def test_tool_call_streamed_like_vllm(monkeypatch, tokenizer, client) -> None:
    ids = script(monkeypatch, tokenizer, "Let me do that." + CALL_TEXT)
    stream = client.chat.completions.create(
        model="",
        messages=MESSAGES,
        tools=[SHELL],
        max_tokens=200,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    content, name, arguments, call_ids, token_ids, finish = "", None, "", [], [], None
    for chunk in stream:
        choice = chunk.choices[0]
        token_ids += choice.model_extra.get("token_ids") or []
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            assert d.index == 0
            if d.id:
                call_ids.append(d.id)
                assert d.type == "function" and d.function.arguments is None
                name = d.function.name
            else:
                arguments += d.function.arguments
        finish = choice.finish_reason or finish
    assert content == "Let me do that."
    assert len(call_ids) == 1 and name == "exec_command"
    assert json.loads(arguments) == {"cmd": "echo hi > a.txt"}
    assert token_ids == ids  # every generated id, in order, even from chunks with no text
    assert finish == "tool_calls"


def test_unparsable_call_stays_text(monkeypatch, tokenizer, client) -> None:
    text = "<tool_call>\nnot json at all\n</tool_call>"
    script(monkeypatch, tokenizer, text)
    resp = client.chat.completions.create(model="", messages=MESSAGES, tools=[SHELL], max_tokens=60)
    assert resp.choices[0].message.content == text and not resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason == "stop"
    script(monkeypatch, tokenizer, text)
    stream = client.chat.completions.create(
        model="", messages=MESSAGES, tools=[SHELL], max_tokens=60, stream=True
    )
    chunks = [c.choices[0] for c in stream]
    assert "".join(c.delta.content or "" for c in chunks) == text
    assert chunks[-1].finish_reason == "stop"


def test_tool_choice_none_is_plain_text(monkeypatch, tokenizer, client) -> None:
    script(monkeypatch, tokenizer, CALL_TEXT)
    resp = client.chat.completions.create(
        model="", messages=MESSAGES, tools=[SHELL], tool_choice="none", max_tokens=60
    )
    assert resp.choices[0].message.content == CALL_TEXT
    assert resp.choices[0].finish_reason == "stop"


def test_history_with_tool_calls_renders_as_the_template(tokenizer, client, server) -> None:
    """An assistant turn with tool calls (arguments as a JSON string, content null) and the
    tool's answer render exactly as the template renders them with argument objects."""
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "exec_command", "arguments": '{"cmd": "ls"}'},
    }
    wire = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
    ]
    resp = client.chat.completions.create(
        model="", messages=wire, tools=[SHELL], max_tokens=1, extra_body={"return_token_ids": True}
    )
    as_objects = [
        *wire[:1],
        {
            **wire[1],
            "content": "",
            "tool_calls": [
                {**call, "function": {"name": "exec_command", "arguments": {"cmd": "ls"}}}
            ],
        },
        wire[2],
    ]
    expected = tokenizer.apply_chat_template(as_objects, tools=[SHELL], add_generation_prompt=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert resp.model_extra["prompt_token_ids"] == expected
    text = tokenizer.decode(expected)
    assert '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "ls"}}\n</tool_call>' in text
    assert "<tool_response>\na.txt\n</tool_response>" in text


def test_tool_errors_are_openai_shaped(server, model_dir) -> None:
    url = server.url + "/v1/chat/completions"
    for body, param in [
        ({"messages": MESSAGES, "tools": [SHELL], "tool_choice": "required"}, "tool_choice"),
        ({"messages": MESSAGES, "tools": [{"type": "web_search"}]}, "tools"),
        ({"messages": MESSAGES, "tool_choice": "auto"}, "tool_choice"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": "{"}}],
                    }
                ],
                "tools": [SHELL],
            },
            "messages",
        ),
    ]:
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    # A template with no tool-call format: tools are refused, not silently ignored.
    with Engine(model_dir, max_batch=1) as plain, RunningServer(plain) as running:
        assert plain.tool_parser is None
        r = httpx.post(
            running.url + "/v1/chat/completions",
            json={"messages": MESSAGES, "tools": [SHELL]},
            timeout=30,
        )
        assert r.status_code == 400 and "--chat-template" in r.json()["error"]["message"]
