"""The real Codex CLI (``@openai/codex`` from the npm registry) as a test harness.

``codex_executable()`` installs the pinned version once into
``$LIGHTNING_CACHE/npm/codex/<version>`` (outside the clone) and returns its
launcher. The package is a small node launcher plus its native binary, which
npm pulls as the optional dependency ``@openai/codex-linux-x64`` (published as
``@openai/codex@<version>-linux-x64`` in the same registry). If npm or the
registry cannot be reached the calling test fails and says so: it is never
skipped.

``write_codex_home()`` writes the ``config.toml`` that points Codex at a
gateway (a custom model provider speaking the Responses API; Codex 0.171 accepts
no other ``wire_api``). What Codex sends is summarised in the README section on it.
"""

from __future__ import annotations

import os
from pathlib import Path

from npm_cli import npm_executable

CODEX_VERSION = "0.171.0"
# The environment variable Codex reads the gateway token from (`env_key`).
TOKEN_ENV = "LIGHTNING_API_KEY"


def codex_executable() -> Path:
    """The pinned Codex CLI launcher, installed from the npm registry on first use."""
    return npm_executable("@openai/codex", CODEX_VERSION, "codex", cache_name="codex")


def write_codex_home(home: Path, base_url: str, *, model: str) -> Path:
    """A ``CODEX_HOME`` whose config sends every model call to ``base_url``.

    ``base_url`` ends in ``/v1`` (Codex appends ``/responses``); the token goes in
    the ``TOKEN_ENV`` environment variable and arrives as ``Authorization: Bearer``.
    Codex runs commands unsandboxed and never asks for approval: the tests run it
    in a disposable temporary directory (as root, where its sandbox cannot apply).
    ``web_search = "disabled"`` drops the hosted web-search tool Codex otherwise
    sends; no retries, so a gateway error fails the run instead of repeating it.
    """
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f"""model = "{model}"
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
env_key = "{TOKEN_ENV}"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
""",
        encoding="utf-8",
    )
    return home


def codex_exec_argv(launcher: Path, workdir: Path, prompt: str) -> list[str]:
    """``codex exec`` for one task in ``workdir`` (not a git repository; no session files)."""
    return [
        str(launcher),
        "exec",
        "--strict-config",
        "--skip-git-repo-check",
        "--ephemeral",
        "--color",
        "never",
        "-C",
        str(workdir),
        prompt,
    ]


def codex_env(home: Path, token: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))}
    env["CODEX_HOME"] = str(home)
    env[TOKEN_ENV] = token
    return env
