"""The real Codex CLI (``@openai/codex`` from the npm registry) as a test harness.

``codex_executable()`` installs the pinned version once into
``$LIGHTNING_CACHE/npm/codex/<version>`` (outside the clone) and returns its
launcher. The package is a small node launcher plus its native binary, which
npm pulls as the optional dependency ``@openai/codex-linux-x64`` (published as
``@openai/codex@<version>-linux-x64`` in the same registry). If npm or the
registry cannot be reached the calling test fails and says so: it is never
skipped.

``write_codex_home()`` and ``codex_exec_argv()`` come from the example harness
(examples/codex_agent.py): the tests drive Codex exactly as users do. What Codex
sends is summarised in the README section on it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from npm_cli import npm_executable

# How to point Codex at a gateway is the example harness's job; the tests use its code.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from codex_agent import codex_exec_argv, write_codex_home

__all__ = ["codex_env", "codex_exec_argv", "codex_executable", "write_codex_home"]

CODEX_VERSION = "0.171.0"


def codex_executable() -> Path:
    """The pinned Codex CLI launcher, installed from the npm registry on first use."""
    return npm_executable("@openai/codex", CODEX_VERSION, "codex", cache_name="codex")


def codex_env(home: Path, token: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))}
    env["CODEX_HOME"] = str(home)
    env["OPENAI_API_KEY"] = token  # the `env_key` of write_codex_home
    return env
