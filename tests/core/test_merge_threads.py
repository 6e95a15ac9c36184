"""The merge plans and writes rollouts in parallel (rayon); its output must not
depend on how many threads ran it. Each run is a fresh interpreter, because rayon
sizes its global pool once per process from RAYON_NUM_THREADS."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# Many rollouts (so the pool splits them across threads), each with branches
# (a turn that rewrites history) and duplicates, interleaved as a gateway records them.
SCRIPT = r"""
import hashlib
import numpy as np
from lightning import Call, merge_calls

rng = np.random.default_rng(7)
calls = []
hist = {}
for turn in range(6):
    for r in range(300):
        h = hist.get(r, rng.integers(0, 1000, 50 + r % 7, dtype=np.uint32))
        if turn == 3 and r % 3 == 0:
            h = h.copy()
            h[len(h) // 2] += 1  # a rewritten history: the rollout branches
        comp = rng.integers(0, 1000, 5 + (r + turn) % 11, dtype=np.uint32)
        lps = -rng.random(len(comp), dtype=np.float32)
        calls.append(Call(f"r{r}", h, comp, lps, group=f"g{r // 8}"))
        if r % 50 == 0:
            calls.append(Call(f"r{r}", h, comp, lps, group=f"g{r // 8}"))  # duplicate
        hist[r] = np.concatenate([h, comp, rng.integers(0, 1000, 4, dtype=np.uint32)])

m = merge_calls(calls, max_tokens=400)
d = hashlib.sha256()
for s in m.samples:
    d.update(s.rollout_id.encode())
    for a in (s.tokens, s.weights, s.logprobs, s.call_index, s.weight_version):
        d.update(np.ascontiguousarray(a).tobytes())
for v in m.divergences:
    d.update(repr((v.rollout_id, v.call_index, v.position, v.left_call_index, v.kind)).encode())
d.update(repr(m.stats).encode())
for across in (False, True):
    t = m.packed(across_rollouts=across)
    for a in (t.tokens, t.parent, t.depth, t.weights, t.logprobs, t.gen_offsets, t.gen_call,
              t.tree_offsets, t.rollout, t.group, t.weight_version):
        d.update(np.ascontiguousarray(a).tobytes())
    d.update(repr(t.tree_keys).encode())
print(len(m.samples), len(m.divergences), d.hexdigest())
"""


def run_with_threads(n: int) -> str:
    env = dict(os.environ, RAYON_NUM_THREADS=str(n))
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[2] / "python"), env.get("PYTHONPATH", "")]
    )
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_merge_output_is_independent_of_thread_count() -> None:
    one = run_with_threads(1)
    samples, divergences, _ = one.split()
    # The data must exercise what parallelism could reorder: many samples and branches.
    assert int(samples) > 300
    assert int(divergences) > 50
    for n in (2, 4, 8):
        assert run_with_threads(n) == one, f"{n} threads"
