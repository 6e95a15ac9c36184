"""Weight sync through a process group, through disk (baseline) vs streamed from the
live sharded model (no disk): time per push, the sender's peak host memory, bytes.

    .venv/bin/python benches/weight_sync.py [--models tiny,smollm2] [--steps 3] [--bucket-mb 64]

For each model the script runs itself under ``torchrun --nproc-per-node 2`` (gloo,
CPU): every rank holds an FSDP2 shard of a real ``Trainer``; rank 0 drives
``SglangDistributedSync`` against the fake SGLang engine of the tests
(``tests/support/fake_rl_engines.py``: real HTTP, and an engine process of its own that
joins the transfer group and receives every byte, then drops it), and rank 1
follows as under ``lightning train`` (``LeaderTrainer`` / ``follow``). Per step,
in the same processes, alternating:

- ``disk`` (the baseline, what every push did before): ``export_weights`` gathers
  the whole model onto rank 0 and writes safetensors, the sync reads it back and
  broadcasts one tensor at a time in one call;
- ``stream``: ``Trainer.live_weights()``, gathered one parameter at a time into
  flattened buckets of ``--bucket-mb``, one ``update_weights_from_distributed``
  call per bucket, nothing written; the float32 masters as they are (what every
  stream sent before the engine's dtype was read);
- ``stream-bf16``: the same to an engine that reports ``--dtype bfloat16`` on
  ``/server_info``: the dtype is read from it (``WeightSync.send_dtype``, as the
  loop does at setup) and the shards are cast before they are gathered, so the
  bytes sent must halve (the script exits 1 if they do not).

Peak host memory is rank 0's ``VmHWM`` over the push, reset just before it
(``/proc/self/clear_refs`` = 5), minus its ``VmRSS`` at the reset: what the push
added on the sender. Workers run with ``MALLOC_MMAP_THRESHOLD_=65536`` so freed
tensors go back to the OS and a later push cannot hide in memory an earlier one
left in malloc's arenas. ``ru_maxrss`` is rank 0's lifetime peak (both modes).
Bytes: broadcast to the engine, written and read back through the filesystem
(the page cache here: timings include no device flush), and materialised on the
sender (gathered tensors and bucket buffers).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests" / "support"


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> int:
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model_dir(name: str) -> Path:
    from lightning.model_cache import smollm2_dir, tiny_model_dir

    return tiny_model_dir() if name == "tiny" else smollm2_dir()


def worker(model: str, steps: int, bucket_mb: int, scratch: Path) -> None:
    import torch.distributed as dist

    from lightning.rl.trainer import Trainer, TrainerConfig
    from lightning.run.distributed import LeaderTrainer, follow

    dist.init_process_group("gloo")
    config = TrainerConfig(model=str(_model_dir(model)), parallel="fsdp2", max_len=64)
    trainer = Trainer(config)
    if dist.get_rank() != 0:
        follow(trainer)
        dist.destroy_process_group()
        return

    sys.path.insert(0, str(TESTS))
    from fake_rl_engines import FakeSglang
    from lightning.sync import (
        LiveWeights,
        SglangDistributedSync,
        TorchDistTransport,
        WeightUpdate,
    )

    leader = LeaderTrainer(trainer)
    engine = FakeSglang(data_plane="lightning")
    engine.keep = False
    transport = TorchDistTransport("127.0.0.1", _port(), backend="gloo", timeout_s=600)
    sync = SglangDistributedSync([engine.root], transport)
    # Global shapes, tied weights once: what either path sends.
    model_bytes = sum(m.nbytes for m in LiveWeights.of_module(trainer.model).metas())
    rows: dict[str, list[dict[str, float]]] = {"disk": [], "stream": [], "stream-bf16": []}
    engine.dtype = "bfloat16"  # what the engine's GET /server_info reports
    config_json = json.loads((_model_dir(model) / "config.json").read_text())
    bf16 = sync.send_dtype("auto", config_json)
    assert bf16 == "bfloat16", bf16

    def disk(version: int) -> dict[str, float]:
        sync.flatten, sync.bucket_bytes = False, 1 << 62  # one call, tensor by tensor
        path = scratch / f"v{version}"
        leader.export_weights(str(path))
        files = sorted(path.glob("*.safetensors"))
        written = sum(f.stat().st_size for f in files)
        sync.push(WeightUpdate(version=version, path=path))
        # Tensor bytes: a safetensors file is an 8-byte header length, a JSON
        # header, then the data (save_pretrained keeps a tied lm_head here).
        sent = sum(
            f.stat().st_size - 8 - int.from_bytes(f.open("rb").read(8), "little") for f in files
        )
        shutil.rmtree(path)
        # metas() and tensors() each read every tensor back
        return {"sent": sent, "written": written, "read": 2 * written, "held": 0}

    def stream(version: int, dtype: str | None = None) -> dict[str, float]:
        sync.flatten, sync.bucket_bytes = True, bucket_mb << 20
        with leader.live_weights(dtype) as source:
            sync.push(WeightUpdate(version=version, source=source))
        s = source.stats
        return {"sent": s.sent_bytes, "written": 0, "read": 0, "held": s.peak_bytes}

    try:
        sync.setup()
        version = 0
        for step in range(steps + 1):  # step 0 warms both paths up, unrecorded
            modes = (
                ("disk", disk),
                ("stream", stream),
                ("stream-bf16", lambda v: stream(v, bf16)),
            )
            for mode, push in modes:
                version += 1
                before = _reset_peak()
                t0 = time.perf_counter()
                row = push(version)
                row["s"] = time.perf_counter() - t0
                row["peak"] = _status("VmHWM") - before
                row["calls"] = len(engine.calls)
                engine.calls.clear()
                if step > 0:
                    rows[mode].append(row)
    finally:
        sync.close()
        engine.stop()
        leader.close()
    result = {
        "model": model,
        "model_bytes": model_bytes,
        "bucket_mb": bucket_mb,
        "rows": rows,
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def machine() -> str:
    import torch

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE
    ).stdout.strip()
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return (
        f"machine: {platform.node()} {platform.machine()} cpus={os.cpu_count()} "
        f"torch={torch.__version__} commit={commit or '?'} load={load}"
    )


def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def report(r: dict[str, Any]) -> float:
    """Prints the table; returns bytes sent to the bf16 engine / float32 stream."""
    print(
        f"\n{r['model']}: {_mb(r['model_bytes'])} MiB of weights, 2 FSDP2 ranks, "
        f"bucket {r['bucket_mb']} MiB, {len(r['rows']['disk'])} pushes per mode"
    )
    print(
        f"  {'mode':<11} {'s/push':>8} {'peak MiB':>9} {'held MiB':>9} {'sent MiB':>9} "
        f"{'disk w MiB':>10} {'disk r MiB':>10} {'calls':>6}"
    )
    med: dict[str, dict[str, float]] = {}
    for mode in ("disk", "stream", "stream-bf16"):
        rows = r["rows"][mode]
        m = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        med[mode] = m
        print(
            f"  {mode:<11} {m['s']:>8.3f} {_mb(m['peak']):>9} {_mb(m['held']):>9} "
            f"{_mb(m['sent']):>9} {_mb(m['written']):>10} {_mb(m['read']):>10} {m['calls']:>6.0f}"
        )
    d, s = med["disk"], med["stream"]
    print(
        f"  stream vs disk (baseline): time {d['s'] / s['s']:.2f}x faster, "
        f"peak host memory {d['peak'] / max(s['peak'], 1):.2f}x lower; "
        f"rank 0 ru_maxrss {_mb(r['ru_maxrss'])} MiB"
    )
    b = med["stream-bf16"]
    ratio = b["sent"] / s["sent"]
    print(
        f"  to a bf16 engine: {_mb(b['sent'])} MiB sent vs {_mb(s['sent'])} MiB of float32 "
        f"masters ({ratio:.3f}x), {s['s'] / b['s']:.2f}x faster"
    )
    return ratio


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "SCRATCH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], args.steps, args.bucket_mb, Path(args.worker[1]))
        return
    print(machine())
    for model in args.models.split(","):
        _model_dir(model)  # built or converted once, before two ranks race for it
        scratch = Path(tempfile.mkdtemp(prefix="weight-sync-bench-"))
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "MALLOC_MMAP_THRESHOLD_": "65536",
            "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        }
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(_port()),
            str(Path(__file__).resolve()), "--worker", model, str(scratch),
            "--steps", str(args.steps), "--bucket-mb", str(args.bucket_mb),
        ]  # fmt: skip
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.exit(f"{model}: worker failed\n{proc.stderr[-4000:]}")
        ratio = report(json.loads(lines[-1].removeprefix("RESULT ")))
        if abs(ratio - 0.5) > 1e-9:
            sys.exit(f"{model}: a bf16 engine got {ratio:.4f}x the float32 bytes, not 0.5x")


if __name__ == "__main__":
    main()
