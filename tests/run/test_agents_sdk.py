"""The real OpenAI Agents SDK (``openai-agents``) as the harness, in its default
Responses mode, against a rollout on the gateway in front of the fake vLLM
engine scripted to answer with a function tool call and then a final message:
the SDK runs the tool with the scripted arguments, finishes with the scripted
text, and the rollout's trace holds exactly the engine's ids and merges into one
sample. Both ``Runner.run`` and ``Runner.run_streamed``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from agents import (
    Agent,
    ItemHelpers,
    OpenAIProvider,
    RunConfig,
    Runner,
    RunResult,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

import lightning
import store_sql
from fake_vllm import FakeEngine
from lightning import GatewayClient, Store

ARGS = {"cmd": "echo hi > a.txt"}
SCRIPT = [
    {"content": "On it.", "tool_calls": [{"name": "exec_command", "arguments": ARGS}]},
    {"content": "Done: a.txt written."},
]
TASK = "Write hi into a.txt."


ENGINE = {"name": "A", "script": SCRIPT}


def make_agent(oa: AsyncOpenAI, ran: list[str]) -> Agent:
    """An Agent whose model talks Responses through ``oa``, with one function tool."""

    @function_tool
    def exec_command(cmd: str) -> str:
        """Run a shell command.

        Args:
            cmd: The command line to run.
        """
        ran.append(cmd)
        return "ok"

    return Agent(
        name="shell",
        instructions="Use the shell to do the task.",
        model="m",
        tools=[exec_command],
    )


def rollout_client(rollout: lightning.Rollout) -> AsyncOpenAI:
    # Traces would otherwise go to api.openai.com with the rollout token.
    set_tracing_disabled(True)
    return AsyncOpenAI(base_url=rollout.base_url, api_key=rollout.token, max_retries=0)


def default_mode(oa: AsyncOpenAI) -> RunConfig:
    """The SDK's default provider (Responses unless told otherwise) on ``oa``,
    without touching the SDK's process-wide default client."""
    return RunConfig(model_provider=OpenAIProvider(openai_client=oa))


def assert_trace(client: GatewayClient, rollout_id: str, engine: FakeEngine) -> None:
    """Every call the SDK made is in the store with exactly the engine's ids and
    logprobs, and the rollout merges into one sample (the SDK sent the tool call
    and its result back unchanged)."""
    answers = engine.log()["answers"]
    recs = client.records(rollout_id)
    assert len(recs) == len(answers) == len(SCRIPT)
    for rec, a in zip(recs, answers, strict=True):
        (ch,) = a["choices"]
        assert rec.status == "ok" and rec.delivered and rec.flags == []
        np.testing.assert_array_equal(rec.prompt_ids, a["prompt_ids"][0])
        np.testing.assert_array_equal(rec.completion_ids, ch["ids"])
        np.testing.assert_array_equal(rec.logprobs, np.asarray(ch["logprobs"], np.float32))
    merged = lightning.merge_calls(client.trace(rollout_id))
    assert len(merged.samples) == 1, merged.divergences
    assert merged.divergences == []


def protocols(tmp_path: Path, rollout_id: str) -> list[tuple[str, bool]]:
    """Each recorded call's protocol and whether the harness asked for a stream."""
    # (in another process while this one's gateway has the store open)
    rows = store_sql.rows(
        tmp_path / "gw.db",
        "SELECT seq, protocol FROM calls WHERE rollout_id = ? ORDER BY seq",
        rollout_id,
    )
    # The bodies through the store's reader: the table keeps only what each call adds.
    with Store(tmp_path / "gw.db") as store:
        bodies = {seq: harness for seq, _, harness in store.requests(rollout_id)}
    return [(p, bool(json.loads(bodies[seq] or "{}").get("stream"))) for seq, p in rows]


def test_runner_run(client: GatewayClient, engine: FakeEngine, tmp_path: Path) -> None:
    r = client.create_rollout({"task": TASK})
    ran: list[str] = []

    async def go() -> RunResult:
        async with rollout_client(r) as oa:
            return await Runner.run(make_agent(oa, ran), TASK, run_config=default_mode(oa))

    result = asyncio.run(go())
    assert result.final_output == "Done: a.txt written."
    assert ran == [ARGS["cmd"]]  # the SDK really ran the tool, with the scripted arguments
    assert len(result.raw_responses) == 2
    assert_trace(client, r.id, engine)
    # The SDK's default mode is the Responses API.
    assert protocols(tmp_path, r.id) == [("openai_responses", False)] * 2


def test_runner_run_streamed(client: GatewayClient, engine: FakeEngine, tmp_path: Path) -> None:
    r = client.create_rollout({"task": TASK})
    ran: list[str] = []

    async def go() -> tuple[list[str], str]:
        async with rollout_client(r) as oa:
            result = Runner.run_streamed(make_agent(oa, ran), TASK, run_config=default_mode(oa))
            deltas: list[str] = []
            async for ev in result.stream_events():
                if ev.type == "raw_response_event" and ev.data.type == "response.output_text.delta":
                    deltas.append(ev.data.delta)
                if ev.type == "run_item_stream_event" and ev.item.type == "message_output_item":
                    deltas.append("|" + ItemHelpers.text_message_output(ev.item))
            return deltas, str(result.final_output)

    deltas, final = asyncio.run(go())
    assert final == "Done: a.txt written."
    assert ran == [ARGS["cmd"]]
    assert "".join(deltas) == "On it.|On it.Done: a.txt written.|Done: a.txt written."
    assert_trace(client, r.id, engine)
    assert protocols(tmp_path, r.id) == [("openai_responses", True)] * 2


def test_readme_snippet_in_a_harness_process(
    client: GatewayClient, engine: FakeEngine, tmp_path: Path
) -> None:
    """The README's configuration, in its own process, from the standard variables."""
    r = client.create_rollout({"task": TASK})
    env = {
        **os.environ,
        "OPENAI_BASE_URL": r.base_url,
        "OPENAI_API_KEY": r.token,
        "OPENAI_MODEL": "m",
        "LIGHTNING_TASK": json.dumps({"task": TASK}),
    }
    harness = Path(__file__).resolve().parents[1] / "support" / "agents_harness.py"
    out = subprocess.run(
        [sys.executable, str(harness)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    said = json.loads(out.stdout.splitlines()[-1])
    assert said == {"final": "Done: a.txt written.", "ran": [ARGS["cmd"]]}
    assert_trace(client, r.id, engine)
    assert protocols(tmp_path, r.id) == [("openai_responses", False)] * 2
