"""The repository's ``examples/``: where the demos find their agent, tasks and config."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any


def examples_dir() -> Path:
    """The repository's examples/ (the demo runs from a source checkout)."""
    for base in (Path.cwd(), *Path(__file__).resolve().parents):
        candidate = base / "examples"
        if (candidate / "demo.toml").exists() and (candidate / "arith_agent.py").exists():
            return candidate
    raise FileNotFoundError(
        "examples/demo.toml not found; run `lightning demo` from the lightning source checkout"
    )


def load_example(path: Path) -> Any:
    """Import a bundled example file (a task generator, an agent) as a module."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
