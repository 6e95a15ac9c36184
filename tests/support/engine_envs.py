"""Released engine packages, installed once into a cached environment of their own.

The engines' GPU dependencies (CUDA kernels, flashinfer, ...) do not install on a CPU
machine, but the parts a weight-sync handshake runs (SGLang's process-group join,
vLLM's IPC update-info parser and trainer engine) need only torch. So each engine is
installed ``--no-deps`` at a pinned version into an environment of its own under
``$LIGHTNING_CACHE`` (default ``~/.cache/lightning``): ``engines-venv`` for SGLang,
``engines-venv-vllm`` for vLLM (apart, so neither sees the other's package and takes
an optional import path), with the few pure Python packages its import chain needs,
and a ``.pth`` that reuses this interpreter's site-packages (torch included). Tests run
the engine's code in a subprocess of that environment: its import side effects stay
out of the test process.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

# The newest release on PyPI when this was written (2026-12-05), and what
# ``import sglang.srt.utils`` pulls in beyond torch and our own dependencies.
SGLANG = "sglang==0.5.23"
SGLANG_IMPORT_DEPS = ["orjson", "pybase64", "msgspec", "pyzmq", "ipython"]
# The newest vLLM on PyPI (2026-12-05); ``import vllm.distributed.weight_transfer.
# ipc_engine`` needs these beyond torch and our own dependencies.
VLLM = "vllm==0.34.0"
VLLM_IMPORT_DEPS = ["pybase64", "pyzmq"]
ENGINES = {"sglang": (SGLANG, SGLANG_IMPORT_DEPS), "vllm": (VLLM, VLLM_IMPORT_DEPS)}


def cache_dir() -> Path:
    return Path(os.environ.get("LIGHTNING_CACHE", Path.home() / ".cache" / "lightning"))


def engines_python(engine: Literal["sglang", "vllm"] = "sglang") -> Path:
    """The cached environment's interpreter, with the pinned ``engine`` importable."""
    package, deps = ENGINES[engine]
    env = cache_dir() / ("engines-venv" if engine == "sglang" else f"engines-venv-{engine}")
    python = env / "bin" / "python"
    env.parent.mkdir(parents=True, exist_ok=True)
    with open(env.parent / (env.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent test runs install once
        if not python.exists():
            _run([sys.executable, "-m", "venv", "--without-pip", str(env)])
        purelib = _paths(python)
        # Reuse this interpreter's packages (torch): rewritten each time, so the
        # cache follows whichever environment runs the tests.
        host = [p for p in sys.path if p.endswith("-packages")]
        (Path(purelib) / "lightning-host.pth").write_text("".join(p + "\n" for p in host))
        marker = env / (package + ".installed")
        if not marker.exists():
            pip = [sys.executable, "-m", "pip", "install", "-q", "--target", purelib]
            _run([*pip, "--no-deps", package])
            _run([*pip, *deps])
            marker.write_text("")
    return python


def _paths(python: Path) -> str:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"installing the engine test environment failed ({' '.join(cmd)}):\n"
            f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}\n"
            "It needs PyPI once; remove the cache directory to retry from scratch."
        )
