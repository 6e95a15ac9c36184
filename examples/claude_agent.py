#!/usr/bin/env python3
"""The real Claude Code as a lightning harness: one unmodified ``claude -p`` per rollout.

lightning runs this once per rollout with ``OPENAI_BASE_URL`` (the rollout's
gateway URL, ``.../rollouts/ID/v1``), ``OPENAI_API_KEY`` (its token),
``OPENAI_MODEL`` and ``LIGHTNING_TASK`` in the environment. Claude Code speaks
Anthropic Messages, which the gateway serves on the same rollout URL: it gets
``ANTHROPIC_BASE_URL`` (the URL without ``/v1``; Claude Code appends
``/v1/messages``) and the token as ``ANTHROPIC_API_KEY`` (sent as ``x-api-key``).
It runs ``claude -p PROMPT`` in a fresh temporary directory and prints the reward
as a final JSON line: 1.0 when the task's ``expect_file`` exists there and holds
``expect_text`` (when given), else 0.0.

    [harness]
    command = ["{python}", "claude_agent.py"]
    env = { CLAUDE = "/path/to/node_modules/.bin/claude", CLAUDE_CODE_MAX_OUTPUT_TOKENS = "512", CLAUDE_CODE_MAX_CONTEXT_TOKENS = "8192" }

    task: {"prompt": "Write hello into hello.txt", "expect_file": "hello.txt", "expect_text": "hello"}

Claude Code runs its tools without asking (``--dangerously-skip-permissions``; as
root it also needs ``IS_SANDBOX=1``, set here): run it only where the temporary
directory is disposable. Only its ``Bash`` tool is offered (``CLAUDE_TOOLS``
overrides: a comma list, or ``default`` for Claude Code's own set); no
non-essential traffic, no session files, no settings or MCP servers from the
machine. ``CLAUDE_CODE_MAX_OUTPUT_TOKENS`` bounds ``max_tokens`` (Claude Code
asks for 32000, more than a small model's context holds);
``CLAUDE_CODE_MAX_CONTEXT_TOKENS`` gives it the engine's context (it assumes 1M
tokens for a model name it does not know). Exits with Claude Code's status.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path


def claude_env(
    base: Mapping[str, str], config_dir: Path, *, base_url: str, token: str
) -> dict[str, str]:
    """``base`` with Claude Code pointed at ``base_url`` (a gateway rollout URL
    without ``/v1``: Claude Code appends ``/v1/messages``) and ``token`` as its key."""
    env = {k: v for k, v in base.items() if not k.startswith("ANTHROPIC_")}
    config_dir.mkdir(parents=True, exist_ok=True)
    env.update(
        ANTHROPIC_BASE_URL=base_url,
        ANTHROPIC_API_KEY=token,
        CLAUDE_CONFIG_DIR=str(config_dir),
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_AUTOUPDATER="1",
        IS_SANDBOX="1",
    )
    return env


def claude_argv(claude: str, prompt: str, *, model: str, tools: str | None) -> list[str]:
    """``claude -p`` for one task, permissions bypassed (the run is in a disposable
    dir), no session saved, no MCP server or settings file read; ``tools`` limits the
    built-in tools (``None``: Claude Code's default set)."""
    argv = [claude, "-p", prompt, "--model", model, "--dangerously-skip-permissions"]
    argv += ["--no-session-persistence", "--strict-mcp-config", "--setting-sources", ""]
    return argv if tools is None else [*argv, "--tools", tools]


def main() -> int:
    task = json.loads(os.environ["LIGHTNING_TASK"])
    with tempfile.TemporaryDirectory(prefix="claude-rollout-") as tmp:
        work = Path(tmp, "work")
        work.mkdir()
        env = claude_env(
            os.environ,
            Path(tmp, "claude-config"),
            base_url=os.environ["OPENAI_BASE_URL"].removesuffix("/v1"),
            token=os.environ["OPENAI_API_KEY"],
        )
        tools = os.environ.get("CLAUDE_TOOLS", "Bash")
        argv = claude_argv(
            os.environ.get("CLAUDE", "claude"),
            task["prompt"],
            model=os.environ.get("OPENAI_MODEL", "default"),
            tools=None if tools == "default" else tools,
        )
        done = subprocess.run(argv, env=env, cwd=work, stdin=subprocess.DEVNULL)
        target = work / task["expect_file"] if task.get("expect_file") else None
        ok = target is not None and target.is_file()
        if ok and task.get("expect_text") is not None:
            ok = target.read_text(errors="replace").strip() == task["expect_text"]
    print(json.dumps({"reward": 1.0 if ok else 0.0, "claude_exit": done.returncode}), flush=True)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
