"""The real Claude Code (pinned, from npm; see tests/support/claude_cli.py) as the harness.

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

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import lightning
from claude_cli import claude_argv, claude_executable, claude_test_env
from cli_harness import assert_recorded_exactly, scripted_gateway, two_tiny_steps
from fake_vllm import FakeEngine
from lightning.run.loop import Run

# The tiny model's context for Claude Code with only its Bash tool: system prompt
# (~6.7 kB) + Bash (~4 kB) + the first turns come to ~3k tokens with SmolLM2's
# tokenizer and the ChatML tool template; the rest bounds each answer.
CONTEXT = 8192

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
def served(tmp_path: Path) -> Iterator[tuple[FakeEngine, lightning.GatewayHandle]]:
    with scripted_gateway("claude", SCRIPT, tmp_path / "gw.db") as pair:
        yield pair


def test_claude_code_runs_a_bash_tool_through_the_gateway(
    claude: Path, served: tuple[FakeEngine, lightning.GatewayHandle], tmp_path: Path
) -> None:
    engine, gateway = served
    client = gateway.client()
    rollout = client.create_rollout({"task": "proof"}, group="claude")
    work = tmp_path / "work"
    work.mkdir()
    out = subprocess.run(
        claude_argv(
            str(claude),
            f"Write '{PROOF}' into proof.txt using Bash.",
            model="lightning",
            tools="Bash",
        ),
        env=claude_test_env(tmp_path / "claude-config", rollout.anthropic_base_url, rollout.token),
        cwd=work,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, f"claude -p failed:\n{out.stdout}\n{out.stderr}"
    assert (work / "proof.txt").read_text() == PROOF + "\n"
    assert "I wrote proof.txt." in out.stdout
    merged = assert_recorded_exactly(client, rollout.id, engine, ["tool_calls", "stop"])
    assert merged.divergences == []
    client.close()


@pytest.mark.slow
def test_lightning_train_through_claude_code_on_the_tiny_model(
    claude: Path, tmp_path: Path
) -> None:
    """2 steps of `lightning train` with `claude -p` (examples/claude_agent.py) as the
    harness against the embedded engine: the tiny model (random weights, so it writes
    text, not tool calls; made to end its answers after ~40 tokens) with an 8k context
    that holds Claude Code's prompt; Claude Code asks for at most 256 new tokens.
    Took 85-133 s on a loaded 2-core machine."""
    tasks = tmp_path / "tasks.jsonl"
    task = {"prompt": "Write hello into hello.txt", "expect_file": "hello.txt"}
    tasks.write_text(json.dumps(task) + "\n")
    out = tmp_path / "run"
    config = two_tiny_steps(
        out,
        tasks,
        context=CONTEXT,
        agent="claude_agent.py",
        rollouts=2,
        extra={"harness.env": {"CLAUDE": str(claude), "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "256"}},
    )
    started = time.monotonic()
    with Run(config, quiet=True) as run:
        assert run.engine is not None
        engine_root = run.engine.root
        run.run()
        health = httpx.get(engine_root + "/health").json()
    print(f"2 steps through Claude Code: {time.monotonic() - started:.0f} s")
    assert health["weight_version"] == 2  # weights were pushed after each step
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m["step"] in (0, 1)]
    assert len(steps) == 2
    for m in steps:
        assert m["rollout_status"] == {"succeeded": 2}, m  # claude -p exited 0 every time
        assert m["tokens"] > 2 * 2000  # Claude Code's whole prompt is trained context
    # Bodies whole through the store's reader (the file keeps what each call adds).
    with lightning.Store(out / "lightning.db") as store:
        rows = [
            (protocol, body)
            for rid in store.rollout_ids()
            for _, protocol, body, _ in store._reader.call_bodies(rid)
        ]
    assert {p for p, _ in rows} == {"anthropic_messages"}
    assert len(rows) >= 4  # at least one call per rollout
    # A random model often answers with EOS alone; Claude Code then asks again without
    # that empty answer ("Your previous response had no visible output"), which starts a
    # second sample. Every other call extends its rollout's conversation.
    re_asks = sum("had no visible output" in body for _, body in rows)
    assert sum(m["samples"] for m in steps) == 4 + re_asks
