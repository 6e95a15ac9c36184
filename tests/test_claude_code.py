"""The real Claude Code (pinned, from npm; see tests/claude_cli.py) as the harness.

``claude -p`` runs a small task in a temporary directory with ``ANTHROPIC_BASE_URL``
at a rollout's gateway URL and the rollout token as ``ANTHROPIC_API_KEY``, in front of
the fake vLLM engine, scripted to answer the first call with a call to Claude Code's
``Bash`` tool that writes a file and the second with a final message. Asserted: Claude
Code exits 0, the file exists (Claude Code really ran the tool), each call it made is in
the store with the engine's exact ids and logprobs, and the rollout merges into one
sample.

What Claude Code 2.1.332 sends (recorded with a capture server; notes in the README's
Claude Code section): ``stream: true`` always, ``x-api-key``, ``anthropic-beta``
(claude-code, interleaved-thinking, context-management, ...), a three-block ``system``
with ``cache_control``, ``role: "system"`` turns mid-conversation, ``thinking:
{"type": "adaptive"}``, ``context_management``, ``output_config.effort``, ``metadata``,
one ``defer_loading`` placeholder tool beside the real ones, ``max_tokens`` 32000.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import lightning
from claude_cli import claude_argv, claude_env, claude_executable
from fake_vllm import FakeEngine
from lightning import Gateway, GatewayConfig

PROOF = "claude was here"
SCRIPT = [
    {
        "content": "",
        "tool_calls": [
            {
                "name": "Bash",
                "arguments": {"command": f"echo {PROOF} > proof.txt", "description": "Write it"},
            }
        ],
    },
    {"content": "I wrote proof.txt."},
]


@pytest.fixture(scope="module")
def claude() -> Path:
    return claude_executable()


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    e = FakeEngine("claude", script=SCRIPT)
    yield e
    e.stop()


@pytest.fixture
def gateway(engine: FakeEngine, tmp_path: Path) -> Iterator[lightning.GatewayHandle]:
    cfg = GatewayConfig(
        listen="127.0.0.1:0",
        upstreams=[{"url": engine.url, "weight_version": 1}],
        db=str(tmp_path / "gw.db"),
    )
    handle = Gateway(cfg).start()
    yield handle
    handle.stop()


def test_claude_code_runs_a_bash_tool_through_the_gateway(
    claude: Path, engine: FakeEngine, gateway: lightning.GatewayHandle, tmp_path: Path
) -> None:
    client = gateway.client()
    rollout = client.create_rollout({"task": "proof"}, group="claude")
    work = tmp_path / "work"
    work.mkdir()
    out = subprocess.run(
        claude_argv(
            claude, f"Write '{PROOF}' into proof.txt using Bash.", model="lightning", tools="Bash"
        ),
        env=claude_env(tmp_path / "claude-config", rollout.anthropic_base_url, rollout.token),
        cwd=work,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, f"claude -p failed:\n{out.stdout}\n{out.stderr}"
    assert (work / "proof.txt").read_text() == PROOF + "\n"
    assert "I wrote proof.txt." in out.stdout

    # Every call Claude Code made is in the store, with the engine's exact ids and logprobs.
    answers = engine.log()["answers"]
    records = client.records(rollout.id)
    assert len(answers) == len(records) == 2
    for rec, answer in zip(records, answers, strict=True):
        (choice,) = answer["choices"]
        np.testing.assert_array_equal(rec.prompt_ids, answer["prompt_ids"][0])
        np.testing.assert_array_equal(rec.completion_ids, choice["ids"])
        np.testing.assert_array_equal(rec.logprobs, np.asarray(choice["logprobs"], np.float32))
        assert rec.status == "ok" and rec.delivered
    assert [r.finish_reason for r in records] == ["tool_calls", "stop"]

    # The second prompt extends the first call: the rollout is one sample.
    merged = lightning.merge_calls(client.trace(rollout.id))
    (sample,) = merged.samples
    assert sample.rollout_id == rollout.id
    full = np.concatenate([records[1].prompt_ids, records[1].completion_ids])
    np.testing.assert_array_equal(np.asarray(sample.tokens), full)
    assert merged.divergences == []
    client.close()
