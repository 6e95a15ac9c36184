"""The real Codex CLI (pinned, from npm; see tests/support/codex_cli.py) as the harness.

``codex exec`` runs a small task in a temporary directory with its model provider
pointed at a rollout's gateway URL (Responses API) in front of the fake vLLM engine,
scripted to answer the first call with a call to Codex's shell tool (``exec_command``)
that writes a file and the second with a final message. Asserted: Codex exits 0, the
file exists (Codex really ran the tool), each call Codex made is in the store with
the engine's exact ids and logprobs, and the rollout merges into one sample.

What Codex 0.171 sends (recorded with a capture server): ``stream: true``, no
``instructions`` (its system prompt is a ``developer`` message in ``input``), the
whole history on every call (``store: false``, never ``previous_response_id``),
function tools plus a ``namespace`` tool (sub-agents) unless disabled, a hosted
``web_search`` tool unless ``web_search = "disabled"``, ``reasoning``, ``include:
["reasoning.encrypted_content"]``, ``prompt_cache_key``, ``client_metadata``, and
for catalog models (gpt-5.x) a freeform ``custom`` tool ``apply_patch``. Its shell
tool is ``exec_command`` with required ``cmd`` (string).
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import lightning
from cli_harness import assert_recorded_exactly, scripted_gateway, two_tiny_steps
from codex_cli import codex_env, codex_exec_argv, codex_executable, write_codex_home
from fake_vllm import FakeEngine
from lightning.run.loop import Run
from lightning.run.runner import RolloutTrace

# The tiny model's context for Codex: its first prompt is ~9.2k tokens through the
# gateway with SmolLM2's tokenizer and the ChatML tool template (its instructions,
# environment context and 8 function tools incl. the sub-agent namespace).
CONTEXT = 16384

PROOF = "codex was here"
SCRIPT = [
    {
        "content": "",
        "tool_calls": [{"name": "exec_command", "arguments": {"cmd": f"echo {PROOF} > proof.txt"}}],
    },
    {"content": "I wrote proof.txt."},
]


@pytest.fixture(scope="module")
def codex() -> Path:
    return codex_executable()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[FakeEngine, lightning.GatewayHandle]]:
    with scripted_gateway("codex", SCRIPT, tmp_path / "gw.db") as pair:
        yield pair


def run_codex(codex: Path, home: Path, token: str, workdir: Path) -> subprocess.CompletedProcess:
    workdir.mkdir()
    return subprocess.run(
        codex_exec_argv(str(codex), workdir, f"Write '{PROOF}' into proof.txt using the shell."),
        env=codex_env(home, token),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_codex_exec_runs_a_shell_tool_through_the_gateway(
    codex: Path, served: tuple[FakeEngine, lightning.GatewayHandle], tmp_path: Path
) -> None:
    engine, gateway = served
    client = gateway.client()
    rollout = client.create_rollout({"task": "proof"}, group="codex")
    home = write_codex_home(tmp_path / "codex-home", base_url=rollout.base_url, model="lightning")
    out = run_codex(codex, home, rollout.token, tmp_path / "work")
    assert out.returncode == 0, f"codex exec failed:\n{out.stdout}\n{out.stderr}"
    assert (tmp_path / "work" / "proof.txt").read_text() == PROOF + "\n"
    assert "I wrote proof.txt." in out.stdout
    assert_recorded_exactly(client, rollout.id, engine, ["tool_calls", "stop"])
    client.close()


def answer_length_reward(task: object, trace: RolloutTrace) -> float:
    """A reward that varies between rollouts of the random model (it never writes the
    task's file), so the GRPO advantages and the update are not all zero."""
    return float(sum(len(call.completion_ids) for call in trace.calls))


@pytest.mark.slow
def test_lightning_train_through_codex_on_the_tiny_model(codex: Path, tmp_path: Path) -> None:
    """2 steps of `lightning train` with `codex exec` (examples/codex_agent.py) as the
    harness against the embedded engine: the tiny model (random weights, so it writes
    text, not tool calls; made to end its answers after ~40 tokens, since Codex exits
    1 on a cut-off answer) with a 16k context that holds Codex's ~9.2k-token prompt
    (instructions + tool list) and lightning's ChatML tool template."""
    tasks = tmp_path / "tasks.jsonl"
    task = {"prompt": "Write hello into hello.txt", "expect_file": "hello.txt"}
    tasks.write_text(json.dumps(task) + "\n")
    out = tmp_path / "run"
    config = two_tiny_steps(
        out,
        tasks,
        context=CONTEXT,
        agent="codex_agent.py",
        rollouts=3,
        extra={
            "harness.env": {"CODEX": str(codex)},
            "reward.source": "function",
            "reward.function": f"{__file__}:answer_length_reward",
        },
    )
    with Run(config, quiet=True) as run:
        assert run.engine is not None
        engine_root = run.engine.root
        run.run()
        health = httpx.get(engine_root + "/health").json()
    assert health["weight_version"] == 2  # weights were pushed after each step
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m["step"] in (0, 1)]
    assert len(steps) == 2
    for m in steps:
        assert m["rollout_status"] == {"succeeded": 3}, m  # codex exec exited 0 every time
        assert m["samples"] == 3 and m["tokens"] > 3 * 8000  # Codex's prompt is context
        assert m["samples_per_rollout"] == 1.0
    assert any(m["grad_norm"] > 0 for m in steps)  # the calls were really trained on
    with sqlite3.connect(out / "lightning.db") as db:
        (n_calls,) = db.execute("SELECT count(*) FROM calls").fetchone()
    assert n_calls >= 6  # at least one model call per rollout
