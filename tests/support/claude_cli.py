"""The real Claude Code (``@anthropic-ai/claude-code`` from the npm registry) as a test harness.

``claude_executable()`` installs the pinned version once into
``$LIGHTNING_CACHE/npm/claude-code/<version>`` (outside the clone) and returns its
``claude`` launcher. The package is a small wrapper whose ``postinstall`` copies its
native binary from the optional dependency ``@anthropic-ai/claude-code-linux-x64``
(same registry, ~400 MB) over ``bin/claude.exe``; no Node process stays resident.
If npm or the registry cannot be reached the calling test fails and says so: it is
never skipped.

``claude_env()`` and ``claude_argv()`` come from the example harness
(examples/claude_agent.py), so the tests drive Claude Code exactly as users do.
``claude_env()`` points it at a gateway: ``ANTHROPIC_BASE_URL`` (Claude
Code appends ``/v1/messages?beta=true``), ``ANTHROPIC_API_KEY`` (sent as
``x-api-key``), no non-essential traffic, a private config dir, and ``IS_SANDBOX=1``:
Claude Code refuses ``--dangerously-skip-permissions`` for root unless the
environment declares a disposable sandbox, which the tests' temporary directories
are. What Claude Code sends is summarised in the README section on it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from npm_cli import npm_executable

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from claude_agent import claude_argv, claude_env

__all__ = ["claude_argv", "claude_executable", "claude_test_env"]

CLAUDE_VERSION = "2.1.332"


def claude_executable() -> Path:
    """The pinned Claude Code launcher, installed from the npm registry on first use."""
    return npm_executable(
        "@anthropic-ai/claude-code", CLAUDE_VERSION, "claude", cache_name="claude-code"
    )


def claude_test_env(config_dir: Path, base_url: str, token: str) -> dict[str, str]:
    """This process's environment without any Claude settings of the machine's own,
    pointed at ``base_url`` (``http://HOST/rollouts/ID``) with the rollout ``token``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("CLAUDE_")}
    return claude_env(base, config_dir, base_url=base_url, token=token)
