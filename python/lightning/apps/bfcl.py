"""BFCL v4 (the Berkeley Function Calling Leaderboard) through its own harness and checker.

``bfcl-eval`` pins heavy dependencies (``numpy==1.26.4``, sentence-transformers and
so torch, faiss), so it lives in an environment of its own under
``$LIGHTNING_CACHE/bfcl-venv`` and runs only as the harness process, never in the
trainer's interpreter. It is installed ``--no-deps`` at a pinned version, plus the
packages its generation and checker import chains need (found by importing
``bfcl_eval.__main__``, which loads every model handler, and the checker). Left out:
sentence-transformers and faiss-cpu, imported only by the ``memory`` category's
vector backend, which needs outside services anyway.

``python -m lightning.apps.bfcl setup`` creates it; ``examples/bfcl/harness.sh``
runs ``examples/bfcl/bfcl_harness.py`` in it, one BFCL test case per rollout.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import subprocess
import sys
from pathlib import Path

from lightning.model_cache import cache_dir

# The newest release on PyPI when this was written (2026-03-23).
BFCL_EVAL = "bfcl-eval==2026.3.23"
# bfcl-eval's own requirements (its pins kept), less sentence-transformers and
# faiss-cpu; soundfile is what qwen-agent's import needs on top.
BFCL_DEPS = [
    "requests",
    "tqdm",
    "numpy==1.26.4",
    "pandas<3",
    "huggingface_hub",
    "pydantic>=2.8.2",
    "python-dotenv>=1.0.1",
    "tree_sitter==0.21.3",
    "tree-sitter-java==0.21.0",
    "tree-sitter-javascript==0.21.4",
    "openai>=1.86.0",
    "mistralai==1.7.0",
    "anthropic>=0.75.0",
    "cohere==5.18.0",
    "typer>=0.12.5",
    "tabulate>=0.9.0",
    "datamodel-code-generator==0.25.7",
    "google-genai>=1.52.0",
    "qwen-agent",
    "soundfile",
    "mpmath==1.3.0",
    "tenacity>=8.5.0",
    "writer-sdk>=2.1.0",
    "overrides",
    "boto3",
    "beautifulsoup4",
    "html2text",
    "rank_bm25==0.2.2",
    "google-search-results",
    "networkx==3.3",
    "filelock==3.20.0",
]
# What must import for generation (every handler) and scoring (the checker).
IMPORT_CHECK = (
    "import bfcl_eval.__main__, bfcl_eval.eval_checker.eval_runner, "
    "bfcl_eval.model_handler.api_inference.openai_completion"
)


def venv_dir() -> Path:
    return cache_dir() / "bfcl-venv"


def bfcl_python(*, quiet: bool = False) -> Path:
    """The interpreter of BFCL's cached environment, created on first use (needs PyPI once)."""
    env = venv_dir()
    python = env / "bin" / "python"
    marker = env / (BFCL_EVAL + ".installed")
    env.parent.mkdir(parents=True, exist_ok=True)
    with open(env.parent / "bfcl-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent callers install once
        if marker.exists() and python.exists():
            return python
        if not python.exists():
            _run([sys.executable, "-m", "venv", str(env)], quiet)
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        _run([*pip, "--no-deps", BFCL_EVAL], quiet)
        _run([*pip, *BFCL_DEPS], quiet)
        _run([str(python), "-c", IMPORT_CHECK], quiet)
        marker.write_text("")
    return python


def _run(cmd: list[str], quiet: bool) -> None:
    if not quiet:
        print("+", " ".join(cmd[:6]), "..." if len(cmd) > 6 else "", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"setting up BFCL's environment failed ({' '.join(cmd)}):\n"
            f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}\n"
            f"It needs PyPI once; remove {venv_dir()} to retry from scratch."
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lightning.apps.bfcl", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("setup", help="create BFCL's cached environment; print its interpreter")
    args = p.parse_args(argv)
    if args.cmd == "setup":
        print(bfcl_python())
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
