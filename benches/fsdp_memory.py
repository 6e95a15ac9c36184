"""Peak host memory per trainer rank: one process against FSDP2 on 2 gloo CPU ranks.

Each run builds a :class:`lightning.rl.trainer.Trainer` (KL on, so the
reference model counts too) and takes one step on a small GRPO-shaped batch.
Per rank it prints three numbers from ``/proc/self/status``:

- ``build``: the resident-set high-water mark (``VmHWM``) after construction;
- ``step``: the high-water mark during the step (reset after the build by
  writing 5 to ``/proc/self/clear_refs``);
- ``kept``: the resident set after the step once glibc has returned its free
  memory (``malloc_trim``): what the rank holds between steps (weights,
  gradients, optimizer state, the reference model, the Python process itself).

Runs, per model:

- ``1 rank``: a plain single process (the whole model, optimizer and reference
  model in one place): the per-rank peak the FSDP2 runs should undercut;
- ``2 ranks, full load`` (baseline, the trainer before meta-device init): every
  rank loads the whole model with ``from_pretrained`` (and the reference model
  unsharded), then shards the policy;
- ``2 ranks, meta``: what the trainer does now (``lightning.rl.fsdp.build_sharded``):
  parameters on the meta device, ``fully_shard``, each rank allocates its shards,
  rank 0 reads the checkpoint and broadcasts; the reference model sharded alike.

    python benches/fsdp_memory.py                      # tiny and SmolLM2-135M
    python benches/fsdp_memory.py --model tiny

Each configuration runs in fresh processes (a high-water mark never falls).
CPU, float32 compute (bf16 on this CPU is slow and changes no host memory
beyond the gathered copies).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()


def _status_mib(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} in /proc/self/status (Linux only)")


def _full_load(
    path: Any, device: Any, *, compute_dtype: Any, storage_dtype: Any = None, prepare: Any = None
) -> Any:
    """The baseline: what the trainer did before meta-device init."""
    import torch
    from transformers import AutoModelForCausalLM

    from lightning.rl import fsdp

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=storage_dtype or torch.float32, attn_implementation="sdpa"
    ).to(device)
    model.config.use_cache = False
    if prepare is not None:
        prepare(model)
    if storage_dtype is None:  # the policy was sharded; the reference model was not
        fsdp.shard(model, compute_dtype)
    return model


def _batch(vocab: int, seed: int = 0) -> tuple[list[Any], dict[str, float], dict[str, str]]:
    import numpy as np

    from lightning.run.distributed import PlainSample

    rng = np.random.default_rng(seed)
    samples, rewards, groups = [], {}, {}
    for g in range(2):
        prompt = rng.integers(5, vocab, 64)
        for k in range(4):
            rid = f"g{g}r{k}"
            tokens = np.concatenate([prompt, rng.integers(5, vocab, 64)]).astype(np.uint32)
            weights = (np.arange(len(tokens)) >= len(prompt)).astype(np.float32)
            call = np.where(weights > 0, 0, -1).astype(np.int32)
            lps = np.full(len(tokens), np.nan, np.float32)
            samples.append(PlainSample(rid, f"g{g}", tokens, weights, lps, call))
            rewards[rid], groups[rid] = float(k % 2), f"g{g}"
    return samples, rewards, groups


def worker(model_dir: str, load: str) -> None:
    import torch
    import torch.distributed as dist

    from lightning.rl import fsdp
    from lightning.rl.trainer import Trainer, TrainerConfig

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    if load == "full":
        fsdp.build_sharded = _full_load  # type: ignore[assignment]
    cfg = TrainerConfig(
        model=model_dir,
        parallel="fsdp2",
        compute_dtype="float32",
        kl_coef=0.05,
        lr=1e-6,
        micro_batch_tokens=512,
        device="cpu",
    )
    import ctypes
    import gc

    tr = Trainer(cfg)
    built = _status_mib("VmHWM")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts here
    tr.step(*_batch(tr.tokenizer.vocab_size))
    stepped = _status_mib("VmHWM")
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    row = {"built": built, "stepped": stepped, "kept": _status_mib("VmRSS")}
    rows = [row]
    if world > 1:
        rows = [None] * world  # type: ignore[list-item]
        dist.all_gather_object(rows, row)
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    del torch


# glibc keeps what a process frees on its heap, and (its mmap threshold rising to
# 32 MiB after the first large free) serves later large blocks from there too, so
# without these the step's high-water mark counts memory the trainer had already
# freed: measured at commit c4d947f, SmolLM2-135M on 2 ranks peaked at 3805 MiB
# with glibc's defaults against 2378 MiB with these. A fixed threshold returns
# every block over 128 KiB to the system when it is freed, so the peak is what was
# live at once. ``--glibc-default`` measures without them.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def _run(model_dir: Path, ranks: int, load: str, malloc: dict[str, str]) -> list[dict[str, float]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **malloc}
    args = [str(HERE), "--worker", str(model_dir), load]
    if ranks == 1:
        cmd = [sys.executable, *args]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
            "--master-addr", "127.0.0.1", "--master-port", str(port), *args,
        ]  # fmt: skip
    for _ in range(2):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode == 0 and lines:
            return json.loads(lines[0][len("RESULT ") :])
        # Seen once in ten runs: gloo aborting at process exit ("terminate called
        # without an active exception"). Run the configuration again, fresh.
        print(f"  (run failed with exit code {proc.returncode}; once more)", flush=True)
    raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
        return
    from lightning.model_cache import smollm2_dir, tiny_model_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", nargs="+", choices=["tiny", "smollm2"], default=["tiny", "smollm2"])
    ap.add_argument(
        "--glibc-default",
        action="store_true",
        help="keep glibc's malloc thresholds (see MALLOC_ENV)",
    )
    args = ap.parse_args()
    malloc = {} if args.glibc_default else MALLOC_ENV
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE.parent
    ).stdout.strip()
    print(f"machine: {platform.machine()} {platform.processor()} {os.cpu_count()} cpus; "
          f"python {platform.python_version()}; commit {commit}")  # fmt: skip
    print(f"glibc: {' '.join(f'{k}={v}' for k, v in malloc.items()) or 'defaults'}")
    print("per rank, MiB: peak RSS while building / peak RSS during one step / RSS kept after it")
    dirs = {"tiny": tiny_model_dir, "smollm2": smollm2_dir}
    for name in args.model:
        path = dirs[name]()
        runs = [
            ("1 rank", 1, "meta"),
            ("2 ranks, full load", 2, "full"),
            ("2 ranks, meta", 2, "meta"),
        ]
        peak = {}
        for label, ranks, load in runs:
            rows = _run(path, ranks, load, malloc)
            cells = "  ".join(
                f"rank {k}: {r['built']:5.0f} / {r['stepped']:5.0f} / {r['kept']:5.0f}"
                for k, r in enumerate(rows)
            )
            peak[label] = {k: max(r[k] for r in rows) for k in ("built", "stepped", "kept")}
            print(f"{name:8} {label:20} {cells}")
        for k in ("built", "stepped", "kept"):
            one = peak["1 rank"][k]
            full, meta = peak["2 ranks, full load"][k], peak["2 ranks, meta"][k]
            print(
                f"{name:8} largest rank's {k:7} vs 1 rank: full load {full / one:.2f}x, "
                f"meta {meta / one:.2f}x"
            )


if __name__ == "__main__":
    main()
