"""The gradient of an optimizer step does not depend on how the step is split:
into micro-batches (any token budget, any batching layout) or across
data-parallel ranks (2 gloo CPU ranks under torchrun), for every aggregation mode."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning.rl.losses import AGGREGATION_MODES
from split_case import grads_per_mode, trainer

HERE = Path(__file__).resolve().parents[1] / "support"  # the worker scripts


@pytest.fixture(scope="module")
def whole_step() -> dict[str, torch.Tensor]:
    """One micro-batch holding the whole step, plain padded layout."""
    return grads_per_mode(trainer(batching="padded", micro_batch_tokens=100_000))


@pytest.mark.parametrize(("layout", "budget"), [("packed", 25), ("tree", 40)])
def test_micro_batches_match_whole_step(
    whole_step: dict[str, torch.Tensor], layout: str, budget: int
) -> None:
    got = grads_per_mode(trainer(batching=layout, micro_batch_tokens=budget))
    for mode in AGGREGATION_MODES:
        torch.testing.assert_close(got[mode], whole_step[mode], atol=1e-5, rtol=1e-4, msg=mode)


def test_epochs_and_mini_batches_keep_normalisation(whole_step: dict[str, torch.Tensor]) -> None:
    # Two mini-batches: each optimizer step is normalised over its own half,
    # whatever its micro-batching.
    modes = ("seq-mean-token-mean", "rollout-mean")
    a = grads_per_mode(trainer(batching="packed", micro_batch_tokens=25), modes, mini_batches=2)
    b = grads_per_mode(trainer(batching="tree", micro_batch_tokens=10**5), modes, mini_batches=2)
    for mode in a:
        torch.testing.assert_close(a[mode], b[mode], atol=1e-5, rtol=1e-4, msg=mode)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_two_gloo_ranks_match_single_process(
    whole_step: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    out = tmp_path / "grads.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        str(HERE / "dist_worker.py"),
        str(out),
        "tree",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out, weights_only=True)
    for mode in AGGREGATION_MODES:
        torch.testing.assert_close(got[mode], whole_step[mode], atol=1e-5, rtol=1e-4, msg=mode)
