"""Forward+backward throughput of the trainer's three batching layouts.

A GRPO-shaped batch (``--tasks`` tasks × ``--group`` rollouts sharing a
``--prompt``-token prompt, ``--completion``-token completions) is run through
padded, packed and tree-packed micro-batches of ``--budget`` tokens; the padded
layout is the baseline measured in the same run. Prints the machine, the
commit, forward-token counts, times and the ratios against padded.

    python benches/train_step.py                       # tiny model, full batch
    python benches/train_step.py --model smollm2 --tasks 1
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
from lightning.batching import BATCH_MODES, SeqItem, forward_logprobs, micro_batches
from lightning.models import smollm2_dir, tiny_model_dir
from transformers import AutoModelForCausalLM


def grpo_items(tasks: int, group: int, prompt: int, completion: int, seed: int) -> list[SeqItem]:
    rng = np.random.default_rng(seed)
    items, tid = [], 0
    for _ in range(tasks):
        p = rng.integers(5, 40000, size=prompt)
        for _ in range(group):
            tokens = np.concatenate([p, rng.integers(5, 40000, size=completion)]).astype(np.int64)
            pos = np.arange(prompt, prompt + completion)
            items.append(SeqItem(tokens, pos, np.arange(tid, tid + completion)))
            tid += completion
    return items


def machine(device: torch.device) -> str:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = "?"
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return (
        f"machine: {platform.node()} {platform.machine()} cpus={torch.get_num_threads()} "
        f"device={device} ({dev}) torch={torch.__version__} commit={commit or '?'}"
    )


def run(
    model: torch.nn.Module, items: list[SeqItem], mode: str, budget: int, amp: object
) -> tuple[int, float]:
    mbs = micro_batches(items, budget, mode=mode)  # type: ignore[arg-type]
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for mb in mbs:
        with amp:  # type: ignore[attr-defined]
            lp, _ = forward_logprobs(model, mb.to(device))
        lp.sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return sum(mb.forward_tokens for mb in mbs), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["tiny", "smollm2"], nargs="+", default=["tiny"])
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--completion", type=int, default=128)
    ap.add_argument("--budget", type=int, default=4096, help="micro-batch token budget")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--autocast", choices=["auto", "none", "bfloat16"], default="auto")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    amp_name = (
        args.autocast
        if args.autocast != "auto"
        else ("bfloat16" if device.type == "cuda" else "none")
    )
    print(machine(device))
    print(
        f"batch: {args.tasks} tasks x {args.group} rollouts, prompt {args.prompt}, "
        f"completion {args.completion}; budget {args.budget}; autocast {amp_name}"
    )
    items = grpo_items(args.tasks, args.group, args.prompt, args.completion, seed=0)
    trained = sum(len(i.positions) for i in items)
    for name in args.model:
        path = tiny_model_dir() if name == "tiny" else smollm2_dir()
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="sdpa"
        )
        model = model.to(device).train()
        model.config.use_cache = False
        amp = (
            torch.autocast(device.type, dtype=torch.bfloat16)
            if amp_name == "bfloat16"
            else contextlib.nullcontext()
        )
        run(model, items[:2], "packed", args.budget, amp)  # warm-up
        total = sum(len(i.tokens) for i in items)
        print(f"\n[{name}] trained tokens {trained}, sample tokens {total}")
        print(
            f"{'layout':8} {'fwd tokens':>10} {'time s':>8} {'tok/s':>9} {'fewer tok':>9} {'speedup':>8}"
        )
        base: tuple[int, float] | None = None
        for mode in BATCH_MODES:  # padded first: the baseline
            runs = [run(model, items, mode, args.budget, amp) for _ in range(args.repeat)]
            n, t = runs[0][0], min(r[1] for r in runs)
            base = base or (n, t)
            print(
                f"{mode:8} {n:>10} {t:>8.2f} {total / t:>9.0f} {base[0] / n:>8.2f}x {base[1] / t:>7.2f}x",
                flush=True,
            )
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
