"""Run by ``torchrun --nproc-per-node 2`` from test_weight_sync.py (gloo, CPU).

``OUT WATCH BUCKET_BYTES``: an FSDP2 trainer takes one step; rank 0 pushes the live
weights to a fake SGLang engine through ``sglang-distributed`` twice (buckets of
BUCKET_BYTES, then one bucket holding everything) while rank 1 follows, the way
``lightning train`` under torchrun does (``LeaderTrainer`` / ``follow``). Every
rank works in a directory of its own under WATCH (its cwd and temp dir) with every
safetensors writer replaced by one that fails; rank 0 then saves, to OUT, what the
engine received, the reference full state dict, the sender's counters and the
files found under WATCH."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning.model_cache import tiny_model_dir
from lightning.rl import fsdp
from lightning.rl.trainer import Trainer, TrainerConfig
from split_case import batch

# Decoder layers big enough that the model is well above one bucket plus its
# largest tensor (the tied embedding), so holding the whole model would show.
MODEL = {"hidden_size": 256, "layers": 8}


def _no_safetensors() -> list[str]:
    """Replace every way the trainer could write safetensors; returns the log."""
    import safetensors.torch
    import transformers

    calls: list[str] = []

    def refuse(name: str) -> Any:
        def writer(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            raise AssertionError(f"{name} called during a no-disk weight sync")

        return writer

    for name in ("save_file", "save", "save_model"):
        setattr(safetensors.torch, name, refuse(f"safetensors.torch.{name}"))
    transformers.PreTrainedModel.save_pretrained = refuse("save_pretrained")  # type: ignore[method-assign]
    return calls


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out, watch, bucket_bytes = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    config = TrainerConfig(
        model=str(tiny_model_dir(**MODEL)), parallel="fsdp2", lr=1e-2, max_len=64
    )
    tr = Trainer(config)
    assert tr.fsdp and all(hasattr(p, "full_tensor") for p in tr.params)  # really sharded
    samples, rewards, groups = batch()
    tr.step(samples, rewards, groups)  # the engine must get trained weights, not the files
    reference = fsdp.full_state_dict(tr.model)  # a collective: rank 0 gets the model

    own = watch / f"rank{rank}"
    own.mkdir(parents=True)
    os.chdir(own)
    tempfile.tempdir = str(own)
    calls = _no_safetensors()

    from lightning.run.distributed import LeaderTrainer, follow

    if rank != 0:
        follow(tr)
        dist.barrier()
        dist.destroy_process_group()
        return

    from fake_rl_engines import FakeSglang
    from lightning.sync import SglangDistributedSync, TorchDistTransport, WeightUpdate

    # The fake's own plumbing (it hands received tensors over through a file) stays
    # out of the watched directories.
    scratch = Path(tempfile.mkdtemp(dir=watch.parent))
    leader = LeaderTrainer(tr)
    results: dict[str, Any] = {"reference": reference, "pushes": []}
    for bucket in (bucket_bytes, 1 << 40):
        engine = FakeSglang(data_plane="lightning", scratch=scratch)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        transport = TorchDistTransport("127.0.0.1", port, backend="gloo", timeout_s=120)
        sync = SglangDistributedSync([engine.root], transport, bucket_bytes=bucket)
        try:
            sync.setup()
            with leader.live_weights() as source:
                sync.push(WeightUpdate(version=1, source=source))
            stats = source.stats
        finally:
            sync.close()
            engine.stop()
        results["pushes"].append(
            {
                "bucket_bytes": bucket,
                "weights": engine.weights,
                "calls": list(engine.calls),
                "routes": engine.routes(),
                "peak_bytes": stats.peak_bytes,
                "largest_bytes": stats.largest_bytes,
                "sent_bytes": stats.sent_bytes,
                "files": _files(watch),
            }
        )
    results["safetensors_calls"] = calls
    leader.close()
    torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
