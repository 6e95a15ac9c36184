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
def settled(count):
    # Up to 10 s for the thread count to reach ``count`` (threads exit asynchronously).
    import time
    deadline = time.monotonic() + 10
    while threads() != count and time.monotonic() < deadline:
        time.sleep(0.01)
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
        engine.model.save_pretrained({str(tmp_path / "w")!r})
        openmp.release_workers()
        engine.load_weights({str(tmp_path / "w")!r}, 1)
        # The scheduler frees its own pool once idle (the next test); wait for that.
        settled(seen["loaded"])
        seen["reloaded"] = threads()
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        seen["ids"] = len(engine.generate([1, 2, 3], params).token_ids)
        engine.close()
        """
    )
    assert seen["pool"] == seen["loaded"] + 1
    assert seen["reloaded"] == seen["loaded"]  # reading the weights left no pool here
    assert seen["ids"] == 4


def test_an_idle_scheduler_holds_no_pool() -> None:
    model_dir = tiny_model_dir()
    seen = run(
        f"""
        from lightning.engine import Engine, SamplingParams
        engine = Engine({str(model_dir)!r}, max_batch=2, num_threads=2).start()
        seen["started"] = threads()
        params = SamplingParams(max_tokens=64, ignore_eos=True)
        seen["ids"] = len(engine.generate([1, 2, 3] * 200, params).token_ids)
        settled(seen["started"])
        seen["idle"] = threads()
        engine.close()
        """
    )
    assert seen["ids"] == 64
    assert seen["idle"] == seen["started"]
