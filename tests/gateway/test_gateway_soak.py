"""Many streaming harness connections on every protocol at once, then a mixed
soak: every answer a client saw whole is recorded with byte-exact ids, and no
client ever got another call's answer. A short run of ``benches/gateway_soak.py``
(real gateway binary, static Rust engine, Rust load generator); the long run
(256 connections x 60 s per protocol, 10 min soak) is by hand, see the bench."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_short_soak_loses_and_mixes_up_nothing() -> None:
    cmd = [sys.executable, "benches/gateway_soak.py", "--connections", "64", "--seconds", "3",
           "--soak-connections", "12", "--soak-seconds", "6"]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    seen = int(re.search(r"saw whole with their own nonce: (\d+)", out)[1])  # type: ignore[index]
    exact = int(re.search(r"byte-exact ids, logprobs and text: (\d+)", out)[1])  # type: ignore[index]
    recorded = int(re.search(r"recorded ok \+ delivered calls: (\d+)", out)[1])  # type: ignore[index]
    assert seen > 500 and exact == recorded == seen, out
    assert "successes without it (wrong): 0; failed requests: 0" in out, out
    assert "RESULT: nothing lost or corrupt" in out
