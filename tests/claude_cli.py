"""The real Claude Code (``@anthropic-ai/claude-code`` from the npm registry) as a test harness.

``claude_executable()`` installs the pinned version once into
``$LIGHTNING_CACHE/npm/claude-code/<version>`` (outside the clone) and returns its
``claude`` launcher. The package is a small wrapper whose ``postinstall`` copies its
native binary from the optional dependency ``@anthropic-ai/claude-code-linux-x64``
(same registry, ~400 MB) over ``bin/claude.exe``; no Node process stays resident.
If npm or the registry cannot be reached the calling test fails and says so: it is
never skipped.

``claude_env()`` points Claude Code at a gateway: ``ANTHROPIC_BASE_URL`` (Claude
Code appends ``/v1/messages?beta=true``), ``ANTHROPIC_API_KEY`` (sent as
``x-api-key``), no non-essential traffic, a private config dir, and ``IS_SANDBOX=1``:
Claude Code refuses ``--dangerously-skip-permissions`` for root unless the
environment declares a disposable sandbox, which the tests' temporary directories
are. What Claude Code sends is summarised in the README section on it.
"""

from __future__ import annotations

import os
from pathlib import Path

from npm_cli import npm_executable

CLAUDE_VERSION = "2.1.332"


def claude_executable() -> Path:
    """The pinned Claude Code launcher, installed from the npm registry on first use."""
    return npm_executable(
        "@anthropic-ai/claude-code", CLAUDE_VERSION, "claude", cache_name="claude-code"
    )


def claude_argv(launcher: Path, prompt: str, *, model: str, tools: str | None = None) -> list[str]:
    """``claude -p`` for one task, permissions bypassed (the run is in a disposable dir).

    ``tools`` limits the built-in tools (``"Bash"``: the prompt shrinks from ~50 kB to
    ~40 kB; ``None``: Claude Code's default set). No session is saved, no MCP server or
    settings file is read.
    """
    argv = [
        str(launcher),
        "-p",
        prompt,
        "--model",
        model,
        "--dangerously-skip-permissions",
        "--no-session-persistence",
        "--strict-mcp-config",
        "--setting-sources",
        "",
    ]
    if tools is not None:
        argv += ["--tools", tools]
    return argv


def claude_env(config_dir: Path, base_url: str, token: str) -> dict[str, str]:
    """The environment for one run: ``base_url`` without ``/v1`` (a rollout's gateway
    URL is ``http://HOST/rollouts/ID``), ``token`` the rollout token."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
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
