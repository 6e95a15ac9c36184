"""FSDP2 (``trainer.parallel = "fsdp2"``) over 2 gloo CPU ranks under torchrun: the
gradient of one step equals single-process training for every aggregation mode;
sharded checkpoints restore model and optimizer exactly; ``export_weights`` writes
the whole model as safetensors that transformers loads."""

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

HERE = Path(__file__).parent


def _torchrun(*args: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{HERE}:{os.environ.get('PYTHONPATH', '')}",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        str(HERE / "fsdp_worker.py"),
        *args,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.slow
def test_fsdp2_gradient_matches_single_process(tmp_path: Path) -> None:
    whole = grads_per_mode(trainer(batching="padded", micro_batch_tokens=100_000))
    out = tmp_path / "grads.pt"
    _torchrun("grads", str(out), "packed")
    got = torch.load(out, weights_only=True)
    for mode in AGGREGATION_MODES:
        torch.testing.assert_close(got[mode], whole[mode], atol=1e-5, rtol=1e-4, msg=mode)


@pytest.mark.slow
def test_fsdp2_sharded_checkpoint_and_full_export(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "params.pt"
    _torchrun("ckpt", str(out), str(tmp_path))
    r = torch.load(out, weights_only=True)
    # Each rank wrote its own shard files.
    assert len(list((tmp_path / "ckpt" / "sharded").glob("*.distcp"))) == 2
    for name in r["saved"]:
        torch.testing.assert_close(r["loaded"][name], r["saved"][name], atol=0, rtol=0, msg=name)
        # Same next step from the restored optimizer state (Adam moments included).
        torch.testing.assert_close(
            r["next_b"][name], r["next_a"][name], atol=1e-7, rtol=0, msg=name
        )
        assert not torch.equal(r["next_a"][name], r["saved"][name]) or "norm" in name
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    got = dict(exported.named_parameters())
    for name, value in r["saved"].items():
        torch.testing.assert_close(got[name], value, atol=0, rtol=0, msg=name)
