#!/usr/bin/env python3
"""The real Codex CLI as a lightning harness: one unmodified ``codex exec`` per rollout.

lightning runs this once per rollout with ``OPENAI_BASE_URL`` (the rollout's
gateway URL), ``OPENAI_API_KEY`` (its token), ``OPENAI_MODEL`` and
``LIGHTNING_TASK`` in the environment. It writes a ``CODEX_HOME`` whose
``config.toml`` makes the gateway Codex's model provider (Responses API), runs
``codex exec PROMPT`` in a fresh temporary directory, and prints the reward as a
final JSON line: 1.0 when the task's ``expect_file`` exists in that directory and
holds ``expect_text`` (when given), else 0.0.

    [harness]
    command = ["{python}", "codex_agent.py"]
    env = { CODEX = "/path/to/node_modules/.bin/codex" }   # default: `codex` on PATH

    task: {"prompt": "Write hello into hello.txt", "expect_file": "hello.txt", "expect_text": "hello"}

Codex runs its commands unsandboxed and without asking (``approval_policy =
"never"``, ``sandbox_mode = "danger-full-access"``): run it only where the
temporary directory is disposable. Its hosted web-search tool is disabled (a
self-hosted model cannot serve it) and it does not retry failed calls (a failed
call is the rollout's failure, not a silent repeat). Exits with Codex's status.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIG = """model = "{model}"
model_provider = "lightning"
approval_policy = "never"
sandbox_mode = "danger-full-access"
web_search = "disabled"
check_for_update_on_startup = false

[analytics]
enabled = false

[model_providers.lightning]
name = "lightning"
base_url = "{base_url}"
env_key = "{env_key}"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
"""


def write_codex_home(
    home: Path, *, base_url: str, model: str, env_key: str = "OPENAI_API_KEY"
) -> Path:
    """A ``CODEX_HOME`` whose ``config.toml`` sends every model call to ``base_url``.

    ``base_url`` ends in ``/v1`` (Codex appends ``/responses``; 0.171 accepts no
    other ``wire_api``); Codex reads the token from the environment variable
    ``env_key`` and sends it as ``Authorization: Bearer``."""
    home.mkdir(parents=True, exist_ok=True)
    config = CONFIG.format(model=model, base_url=base_url, env_key=env_key)
    (home / "config.toml").write_text(config, encoding="utf-8")
    return home


def codex_exec_argv(codex: str, work: Path, prompt: str) -> list[str]:
    """``codex exec`` for one task in ``work`` (not a git repository; no session files)."""
    argv = [codex, "exec", "--strict-config", "--skip-git-repo-check", "--ephemeral"]
    return [*argv, "--color", "never", "-C", str(work), prompt]


def main() -> int:
    task = json.loads(os.environ["LIGHTNING_TASK"])
    with tempfile.TemporaryDirectory(prefix="codex-rollout-") as tmp:
        home, work = Path(tmp, "codex-home"), Path(tmp, "work")
        work.mkdir()
        write_codex_home(
            home,
            base_url=os.environ["OPENAI_BASE_URL"],
            model=os.environ.get("OPENAI_MODEL", "default"),
        )
        env = {**os.environ, "CODEX_HOME": str(home)}
        argv = codex_exec_argv(os.environ.get("CODEX", "codex"), work, task["prompt"])
        done = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL)
        target = work / task["expect_file"] if task.get("expect_file") else None
        ok = target is not None and target.is_file()
        if ok and task.get("expect_text") is not None:
            ok = target.read_text(errors="replace").strip() == task["expect_text"]
    print(json.dumps({"reward": 1.0 if ok else 0.0, "codex_exit": done.returncode}), flush=True)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
