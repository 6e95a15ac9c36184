"""The engine leaves no OpenMP worker pool on the threads that load it (openmp.py).

Each check runs in a fresh interpreter, where the only threads that appear
when torch runs a parallel region are OpenMP workers, and counts the
process's threads in /proc/self/task."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning.model_cache import tiny_model_dir

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc; torch uses libgomp on Linux"
)

# Prints, as JSON, the thread count around the steps of ``body``. ``parallel()``
# runs one parallel region on the calling thread (2 threads: one worker).
PRELUDE = """
import json, os, sys, torch
torch.set_num_threads(2)
from lightning.engine import openmp
def threads():
    return len(os.listdir("/proc/self/task"))
def parallel():
    torch.ones(2**22).sum()
seen = {}
"""


def run(body: str) -> dict[str, int]:
    script = PRELUDE + textwrap.dedent(body) + "\nprint(json.dumps(seen))\n"
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_release_frees_the_calling_threads_pool() -> None:
    seen = run(
        """
        seen["before"] = threads()
        parallel()
        seen["pool"] = threads()
        seen["released"] = int(openmp.release_workers())
        seen["after"] = threads()
        parallel()
        seen["again"] = threads()
        """
    )
    assert seen["released"] == 1
    assert seen["pool"] == seen["before"] + 1  # the region left one worker behind
    assert seen["after"] == seen["before"]  # released: the worker exited
    assert seen["again"] == seen["pool"]  # a later region builds a new pool


def test_engine_releases_the_loading_and_reloading_threads(tmp_path: Path) -> None:
    model_dir = tiny_model_dir()
    seen = run(
        f"""
        from lightning.engine import Engine, SamplingParams
        engine = Engine({str(model_dir)!r}, max_batch=2, num_threads=2).start()
        seen["loaded"] = threads()
        parallel()  # no pool was left on this thread: this region builds one
        seen["pool"] = threads()
        openmp.release_workers()
        engine.model.save_pretrained({str(tmp_path / "w")!r})
        openmp.release_workers()
        # The scheduler's own pool (which the reload uses too) is built here.
        engine.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
        seen["saved"] = threads()
        engine.load_weights({str(tmp_path / "w")!r}, 1)
        seen["reloaded"] = threads()
        seen["ids"] = len(engine.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)).token_ids)
        engine.close()
        """
    )
    assert seen["pool"] == seen["loaded"] + 1
    assert seen["reloaded"] == seen["saved"]  # the reload's reading left no pool here
    assert seen["ids"] == 4
