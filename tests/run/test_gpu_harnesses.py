"""examples/gpu_harnesses.toml, Codex CLI and Claude Code as harnesses of one
run, set up on the CPU up to each CLI's first call.

The config is loaded as written except for what needs a GPU: the model (the
tiny one: random weights, SmolLM2's tokenizer) with the CPU demo model's 8192
positions on the embedded engine in float32 with lightning's ChatML tool template
(SmolLM2's own ignores tools), the trainer without bf16, and the paths; its
harnesses run unchanged. The CLIs, pinned and installed
from npm (tests/support/codex_cli.py, tests/support/claude_cli.py), are put on PATH, where the
config's harnesses look for them. The run sets itself up (trainer, engine, gateway,
one runner per harness) and one held-out task goes through every harness, as its
eval sends it.

Asserted, per harness: the rollout records its harness; the CLI's first call
reached the gateway in the CLI's own protocol with the CLI's own tools and was
recorded. Codex's first prompt and Claude Code's with all its tools do not fit
8192 tokens: the engine refuses them with its context-length error, recorded
with the call and reported by the CLI (the reason the config is a GPU one).
Claude Code with Bash alone (the eval-only harness) fits and is answered.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
from pathlib import Path

import pytest

from claude_cli import claude_executable
from codex_cli import codex_executable
from lightning import Store
from lightning.config import RunConfig
from lightning.engine.tools import CHATML_TOOLS_TEMPLATE
from lightning.model_cache import tiny_model_dir
from lightning.run.harnesses import HARNESS_KEY
from lightning.run.loop import Run

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# SmolLM2-135M-Instruct's context, the model of the CPU demo.
CPU_CONTEXT = 8192
TASK = {
    "id": "t0",
    "prompt": "Compute 12 + 30 and write just the resulting number into the file answer.txt.",
    "answer": "42",
    "expect_file": "answer.txt",
    "expect_text": "42",
}
# The engine's refusal (lightning.engine.core), as the CLIs print it.
REFUSED = re.compile(
    rf"maximum context length is {CPU_CONTEXT} tokens\. However, you requested \d+ tokens "
    r"\((\d+) in the messages"
)


def test_the_gpu_config_lists_the_coding_clis() -> None:
    config = RunConfig.load(EXAMPLES / "gpu_harnesses.toml")
    by_name = {h.name: h for h in config.all_harnesses()}
    assert list(by_name) == ["codex", "claude-code", "claude-code-bash-unseen"]
    assert [h.name for h in config.trained_harnesses()] == ["codex", "claude-code"]
    assert by_name["codex"].command == ["{python}", "codex_agent.py"]
    assert by_name["claude-code"].env["CLAUDE_TOOLS"] == "default"
    assert by_name["claude-code-bash-unseen"].env["CLAUDE_TOOLS"] == "Bash"
    for h in by_name.values():
        assert h.cwd == str(EXAMPLES.resolve())  # the agents next to the config
    # Equal shares of a step's groups between the two trained CLIs.
    assert config.harness_groups(0) == {"codex": 4, "claude-code": 4}
    # A whole rollout (one sample up to the context) fits a micro-batch.
    assert config.engine.max_model_len is not None
    assert config.trainer.micro_batch_tokens >= config.engine.max_model_len


def _calls(db: Path) -> dict[str, list[tuple[str, str, int, str]]]:
    """Per rollout id, in order: each recorded call's protocol, status, HTTP status
    and the harness's own request."""
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT rollout_id, protocol, status, http_status, harness_request FROM calls "
            "ORDER BY seq"
        ).fetchall()
    calls: dict[str, list[tuple[str, str, int, str]]] = {}
    for rid, protocol, status, http, body in rows:
        calls.setdefault(rid, []).append((protocol, status, http, body))
    return calls


def _tool_names(body: str) -> set[str]:
    """The tools a CLI offered: Responses (`name`) and Messages (`name`) alike;
    Claude Code's placeholder for deferred tools is not one."""
    names = {t.get("name") for t in json.loads(body).get("tools", [])}
    return names - {"DeferredToolPlaceholder", None}


def _refused_prompt_tokens(output: str) -> int:
    """The prompt length in the engine's refusal that the CLI printed."""
    found = REFUSED.search(output)
    assert found, f"no context-length refusal in the CLI's output:\n{output}"
    return int(found.group(1))


@pytest.mark.slow
def test_the_gpu_config_sets_up_on_the_cpu_up_to_each_clis_first_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Took 27-99 s on a loaded 2-core machine."""
    codex, claude = codex_executable(), claude_executable()
    monkeypatch.setenv(
        "PATH", os.pathsep.join([str(codex.parent), str(claude.parent), os.environ["PATH"]])
    )
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(TASK) + "\n")
    out = tmp_path / "run"
    gpu = RunConfig.load(EXAMPLES / "gpu_harnesses.toml")
    config = RunConfig.load(
        EXAMPLES / "gpu_harnesses.toml",
        {
            "model.path": str(tiny_model_dir(context=CPU_CONTEXT, answer_tokens=40)),
            "engine.chat_template": str(CHATML_TOOLS_TEMPLATE),
            "engine.max_model_len": CPU_CONTEXT,
            "engine.dtype": "float32",
            "engine.max_batch": 3,
            "trainer.autocast": "none",
            "trainer.gradient_checkpointing": False,
            "output_dir": str(out),
            "tasks.train": str(tasks),
            "tasks.eval": str(tasks),
        },
    )
    assert [h.model_dump(exclude={"cwd"}) for h in config.all_harnesses()] == [
        h.model_dump(exclude={"cwd"}) for h in gpu.all_harnesses()
    ]  # the harnesses run exactly as the GPU config gives them
    names = [h.name for h in config.all_harnesses()]
    with Run(config, quiet=True) as run:
        jobs = [({**TASK, "temperature": 0.7, HARNESS_KEY: name}, None) for name in names]
        results = dict(zip(names, run.runner.run(jobs, mode="eval"), strict=True))
    output = {name: r.stdout_tail + r.stderr_tail for name, r in results.items()}
    for name in ("claude-code", "claude-code-bash-unseen"):
        # CLAUDE_CODE_MAX_CONTEXT_TOKENS gave Claude Code the engine's window for
        # a model name it does not know (else it assumes 1M tokens and says so).
        assert "assumes a context window" not in output[name], output[name]

    with Store(out / "lightning.db") as store:
        recorded = {r["rollout_id"]: r["task"][HARNESS_KEY] for r in store.rollouts()}
    assert recorded == {r.rollout_id: name for name, r in results.items()}
    calls = _calls(out / "lightning.db")
    assert set(calls) == set(recorded), "a CLI's call never reached the gateway"

    # Codex: one call over the Responses API with its own tools, refused (Codex
    # does not retry: request_max_retries = 0), and Codex exits 1 on it.
    (codex_call,) = calls[results["codex"].rollout_id]
    assert codex_call[:3] == ("openai_responses", "upstream_error", 400)
    assert "exec_command" in _tool_names(codex_call[3])
    assert results["codex"].exit_code == 1
    codex_prompt = _refused_prompt_tokens(output["codex"])

    # Claude Code with all its tools: Anthropic Messages, refused, exits 1.
    claude_call = calls[results["claude-code"].rollout_id][0]
    assert claude_call[:3] == ("anthropic_messages", "upstream_error", 400)
    assert _tool_names(claude_call[3]) >= {"Bash", "Read", "Edit", "Write"}
    assert results["claude-code"].exit_code == 1
    claude_prompt = _refused_prompt_tokens(output["claude-code"])

    # Neither first prompt fits the CPU model; both fit the GPU config's context
    # with Claude Code's answer budget on top.
    budget = int(gpu.harnesses[1].env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"])
    assert gpu.engine.max_model_len is not None
    for prompt in (codex_prompt, claude_prompt):
        assert CPU_CONTEXT < prompt <= gpu.engine.max_model_len - budget

    # The eval-only harness, Claude Code with Bash alone, fits 8192 tokens: answered.
    unseen = results["claude-code-bash-unseen"]
    first = calls[unseen.rollout_id][0]
    assert first[:3] == ("anthropic_messages", "ok", 200)
    assert _tool_names(first[3]) == {"Bash"}
    assert unseen.status == "succeeded" and unseen.exit_code == 0
    assert REFUSED.search(output["claude-code-bash-unseen"]) is None
