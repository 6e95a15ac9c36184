"""`lightning train` under torchrun (2 gloo CPU ranks, FSDP2): rank 0 runs the loop,
rank 1 trains its shard through the mirrored trainer calls, the engine receives
the gathered weights after every step, and the sharded checkpoint is written."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

pytestmark = pytest.mark.slow


def test_two_ranks_fsdp2_train(tmp_path: Path) -> None:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import arith_tasks
    finally:
        sys.path.remove(str(EXAMPLES))
    tasks = tmp_path / "tasks"
    assert (
        arith_tasks.main(["--n", "40", "--eval-size", "2", "--seed", "5", "--out", str(tasks)]) == 0
    )
    out = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(
        f"""
steps = 2
eval_every = 0
checkpoint_every = 2
output_dir = "{out}"
[model]
builtin = "tiny"
[harness]
command = ["{{python}}", "{EXAMPLES / "arith_agent.py"}"]
concurrency = 6
env = {{ OPENAI_MODEL = "policy" }}
[tasks]
train = "{tasks / "train.jsonl"}"
eval = "{tasks / "eval.jsonl"}"
[algorithm]
group_size = 3
tasks_per_step = 2
train_temperature = 0.7
[trainer]
lr = 1e-3
compute_dtype = "float32"
parallel = "fsdp2"
batching = "packed"
"""
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(port),
        "-m", "lightning.cli", "train", str(config), "--quiet",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-6000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m["step"] in (0, 1)]
    assert len(steps) == 2
    for m in steps:
        assert m["weight_version"] == m["step"] + 1 and m["tokens"] > 0
    ckpt = out / "checkpoints" / "latest"
    # Both ranks wrote their shard; rank 0 exported the whole model for the engine.
    assert len(list((ckpt / "sharded").glob("*.distcp"))) == 2
    assert (ckpt / "model" / "model.safetensors").stat().st_size > 1000
