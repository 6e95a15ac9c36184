"""Benchmark: `lightning.merge_calls` against the peer's pure-Python linear prefix merge.

Data (issue 2): ROLLOUTS rollouts x TURNS turns; each rollout starts from a 2,000-token
system+task prompt (shared by the GROUP rollouts of one task), then every turn
generates a 200-token completion and adds a 300-token observation, and every
prompt carries the whole history. Token ids are random in a 50k vocabulary.

Both merges run on the same data in this process. `merge_calls` is fed numpy
uint32 arrays and Python lists; the baseline gets Python lists (its natural,
best input). Each list is built separately (`.tolist()` per call), so its ints
are distinct objects, as when ids are decoded from JSON. Times are the best of
--repeats runs. Each run drops the previous run's result first, so from the
second run on a merge writes into the arrays the last one returned to the pool
(see `lightning.release_merge_buffers`), as a training step does; one more run
after emptying the pool shows the first merge of a process, on fresh memory.

Two ceilings are printed: the machine's streaming read bandwidth (one compare
over two large arrays), and the floor on this input as laid out (one array per
call): comparing every prompt once with its rollout's previous call, plus writing
the samples once into warm memory. Run: `.venv/bin/python benches/merge.py` (or
`make bench`).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import platform
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import lightning
from lightning import Call, merge_calls
from lightning._core import _common_prefix_pairs_u32, _common_prefix_u32

Row = tuple[str, list[int], list[int], list[float]]


def linear_prefix_merge(
    calls: Sequence[tuple[str, list[int], list[int], list[float]]],
) -> list[Row]:
    """The peer's algorithm: one row per rollout, a new row whenever the next
    prompt does not start with the row so far. Returns (rollout_id, tokens,
    loss mask, logprobs) rows."""
    by_rollout: dict[str, list[tuple[list[int], list[int], list[float]]]] = {}
    for rid, prompt, completion, logprobs in calls:
        by_rollout.setdefault(rid, []).append((prompt, completion, logprobs))
    rows: list[Row] = []
    nan = math.nan
    for rid, turns in by_rollout.items():
        tokens: list[int] = []
        mask: list[int] = []
        lps: list[float] = []
        for prompt, completion, logprobs in turns:
            if tokens and prompt[: len(tokens)] == tokens:
                extra = prompt[len(tokens) :]
            else:
                if tokens:
                    rows.append((rid, tokens, mask, lps))
                tokens, mask, lps = [], [], []
                extra = prompt
            tokens += extra
            mask += [0] * len(extra)
            lps += [nan] * len(extra)
            tokens += completion
            mask += [1] * len(completion)
            lps += logprobs
        rows.append((rid, tokens, mask, lps))
    return rows


def make_data(
    args: argparse.Namespace,
) -> list[tuple[str, str, np.ndarray, np.ndarray, np.ndarray]]:
    """(rollout_id, group, prompt, completion, logprobs) per call, rollouts interleaved
    turn by turn as a gateway would record them."""
    rng = np.random.default_rng(0)
    vocab = 50_000
    tasks = [
        rng.integers(0, vocab, args.prompt, dtype=np.uint32)
        for _ in range(math.ceil(args.rollouts / args.group))
    ]
    histories = [tasks[r // args.group] for r in range(args.rollouts)]
    calls = []
    for turn in range(args.turns):
        for r in range(args.rollouts):
            if turn > 0:
                obs = rng.integers(0, vocab, args.observation, dtype=np.uint32)
                histories[r] = np.concatenate([histories[r], obs])
            prompt = histories[r]
            completion = rng.integers(0, vocab, args.completion, dtype=np.uint32)
            logprobs = -rng.random(args.completion, dtype=np.float32)
            calls.append((f"r{r}", f"task{r // args.group}", prompt, completion, logprobs))
            histories[r] = np.concatenate([prompt, completion])
    return calls


def best(
    fn: Callable[[], Any], repeats: int, clock: Callable[[], float] = time.process_time
) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeats):
        out = None  # free the previous result before the next run
        t = clock()
        out = fn()
        times.append(clock() - t)
    return min(times), out


def compare_ceiling(n_tokens: int, repeats: int) -> float:
    """Memory bandwidth, in u32 compares per second: the merge's own compare loop
    (``_core._common_prefix_u32``, GIL released) over two equal arrays far larger
    than the caches (8 bytes read per compared token). A merge must read every
    input token from memory at least once (4 bytes), while the other side of its
    compares (the trie's edge: the same rollout's previous call) is mostly in
    cache, so its ceiling is twice this rate; both are printed."""
    a = np.random.default_rng(1).integers(0, 50_000, n_tokens, dtype=np.uint32)
    b = a.copy()
    t, n = best(lambda: _common_prefix_u32(a, b), repeats, time.perf_counter)
    assert n == n_tokens
    return n_tokens / t


def read_floor(
    raw: list[tuple[str, str, np.ndarray, np.ndarray, np.ndarray]], repeats: int
) -> tuple[float, int]:
    """Seconds for the least reading any prefix merge does on this input as laid
    out (one array per call): every call's prompt compared once with its
    rollout's previous call (that call's prompt, then its completion), one
    thread, no trie, no output. The big-array rate of `compare_ceiling` assumes
    one long stream; here every compare starts a new array."""
    by_rollout: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for rid, _, p, c, _ in raw:
        by_rollout.setdefault(rid, []).append((p, c))
    a: list[np.ndarray] = []
    b: list[np.ndarray] = []
    for calls in by_rollout.values():
        for (prev_p, prev_c), (p, _) in itertools.pairwise(calls):
            a += [p[: len(prev_p)], p[len(prev_p) : len(prev_p) + len(prev_c)]]
            b += [prev_p, prev_c]
    runs = [_common_prefix_pairs_u32(a, b) for _ in range(repeats)]
    return min(t for _, t in runs), runs[0][0]


def write_floor(sample_tokens: int, repeats: int) -> float:
    """CPU seconds to write the samples' four 4-byte fields once into memory that
    is already faulted in (numpy fill, one thread): the least a merge that
    writes its samples adds to its reading."""
    arrays = [
        np.zeros(sample_tokens, dtype) for dtype in (np.uint32, np.float32, np.float32, np.int32)
    ]
    for a in arrays:
        a.fill(1)  # fault the pages in before timing

    def fill() -> None:
        for a in arrays:
            a.fill(2)

    return best(fill, repeats)[0]


def machine() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()} | {cpu} | {os.cpu_count()} cpus | {platform.python_version()} | numpy {np.__version__}"


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=1000)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--group", type=int, default=8, help="rollouts per task (GRPO group)")
    ap.add_argument("--prompt", type=int, default=2000)
    ap.add_argument("--completion", type=int, default=200)
    ap.add_argument("--observation", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--ceiling-tokens", type=int, default=64 << 20, help="array length for the bandwidth run"
    )
    args = ap.parse_args()

    print(f"machine: {machine()}")
    print(f"commit:  {commit()}   lightning {lightning.__version__}")
    print(
        f"data:    {args.rollouts} rollouts x {args.turns} turns, prompt {args.prompt}, "
        f"completion {args.completion}, observation {args.observation}, group {args.group}"
    )
    raw = make_data(args)
    n_calls = len(raw)
    call_tokens = sum(len(p) + len(c) for _, _, p, c, _ in raw)
    print(f"calls:   {n_calls}, sum of per-call sequence lengths {call_tokens:,} tokens")

    lists = [(rid, p.tolist(), c.tolist(), lp.tolist()) for rid, _, p, c, lp in raw]

    t_base, rows = best(lambda: linear_prefix_merge(lists), args.repeats)

    def build_numpy() -> list[Call]:
        return [Call(rid, p, c, lp, group=g) for rid, g, p, c, lp in raw]

    def build_lists() -> list[Call]:
        return [Call(rid, p, c, lp, group=raw[i][1]) for i, (rid, p, c, lp) in enumerate(lists)]

    def merge_and_samples(calls: list[Call]) -> Any:
        res = merge_calls(calls)
        res.samples  # noqa: B018  (written on first access)
        return res

    t_np_build, np_calls = best(build_numpy, args.repeats)
    t_np_plan, _ = best(lambda: merge_calls(np_calls), args.repeats)
    t_np_merge, res = best(lambda: merge_and_samples(np_calls), args.repeats)
    w_np_plan, _ = best(lambda: merge_calls(np_calls), args.repeats, time.perf_counter)
    w_np_merge, _ = best(lambda: merge_and_samples(np_calls), args.repeats, time.perf_counter)
    t_ls_build, ls_calls = best(build_lists, args.repeats)
    t_ls_merge, _ = best(lambda: merge_and_samples(ls_calls), args.repeats)
    # The first merge of a process writes into fresh memory: with the pool of
    # dropped results' arrays emptied, that is what one run costs.
    lightning.release_merge_buffers()
    t_np_fresh, fresh = best(lambda: merge_and_samples(np_calls), 1)
    compare = compare_ceiling(args.ceiling_tokens, max(args.repeats, 5))
    ceiling = 2 * compare  # read every input token once: 4 bytes per token
    t_read, compared = read_floor(raw, max(args.repeats, 5))
    t_write = write_floor(res.stats.sample_tokens, max(args.repeats, 5))

    # Same answer as the baseline (linear data: one sample per rollout).
    assert len(rows) == len(res.samples) == args.rollouts
    for (rid, tokens, mask, _), s in zip(rows[:50], res.samples[:50], strict=True):
        assert rid == s.rollout_id and s.tokens.tolist() == tokens
        assert ((s.weights > 0).astype(int)).tolist() == mask

    def report(name: str, seconds: float) -> None:
        print(
            f"  {name:<40} {seconds * 1e3:9.1f} ms  {n_calls / seconds:12,.0f} calls/s  "
            f"{call_tokens / seconds / 1e6:9.1f} M tok/s  {t_base / seconds:7.1f}x  "
            f"{call_tokens / seconds / ceiling:6.0%} of ceiling"
        )

    print(
        "\nthroughput (tokens = sum of per-call sequence lengths; ratio vs baseline; CPU time "
        "of all threads unless marked wall)"
    )
    report("python linear prefix merge (lists)", t_base)
    report("merge_calls, numpy input (+ samples)", t_np_merge)
    report("  same, first merge (fresh memory)", t_np_fresh)
    report("merge_calls, numpy input (plan only)", t_np_plan)
    report("  same, wall clock (+ samples)", w_np_merge)
    report("  same, wall clock (plan only)", w_np_plan)
    report("Call() from numpy + merge_calls", t_np_build + t_np_merge)
    report("merge_calls, list input (+ samples)", t_ls_merge)
    report("Call() from lists + merge_calls", t_ls_build + t_ls_merge)
    print(
        f"  memory bandwidth: {compare * 8 / 1e9:.1f} GB/s read (u32 compare of two "
        f"{args.ceiling_tokens:,}-token arrays, best wall clock) = {compare / 1e6:,.0f} M "
        f"compares/s;\n  ceiling (every input token read once, 4 B): {ceiling / 1e6:,.0f} M tok/s"
    )
    print(
        f"  floor on this input: compare each prompt with its rollout's previous call "
        f"({compared:,} tokens, one array per call, next arrays prefetched, one thread) "
        f"{t_read * 1e3:.1f} ms;\n  write the samples' 4 fields once "
        f"({res.stats.sample_tokens:,} tokens, warm memory, one thread) {t_write * 1e3:.1f} ms"
    )

    print("\nwhere the time goes (numpy input; CPU time unless noted)")
    print(f"  Call() construction (zero-copy)  {t_np_build * 1e3:9.1f} ms")
    print(f"  Call() construction from lists   {t_ls_build * 1e3:9.1f} ms")
    print("  merge_calls phases (wall clock; a run with reused arrays, the first merge):")
    for k in ("borrow", "plan", "allocate", "write", "output"):
        print(f"    {k:<30} {res._timings[k] * 1e3:9.1f} ms {fresh._timings[k] * 1e3:9.1f} ms")
    del fresh

    # What training reads (the trainer packs a step's calls; it never writes samples).
    t_pack, packed = best(lambda: res.packed(), args.repeats)
    w_pack, _ = best(lambda: res.packed(), args.repeats, time.perf_counter)
    t_gpack, gpacked = best(lambda: res.packed(across_rollouts=True), args.repeats)
    w_gpack, _ = best(lambda: res.packed(across_rollouts=True), args.repeats, time.perf_counter)
    sample_tokens = res.stats.sample_tokens
    print("\ncompute that merging saves (tokens through the model)")
    print(f"  per-call sequences               {call_tokens:12,}")
    print(
        f"  merged samples                   {sample_tokens:12,}  ({call_tokens / sample_tokens:.1f}x fewer)"
    )
    print(
        f"  packed tree, per rollout         {len(packed):12,}  ({call_tokens / len(packed):.1f}x fewer)"
        f"  [{t_pack * 1e3:.0f} ms CPU, {w_pack * 1e3:.0f} ms wall]"
    )
    print(
        f"  packed tree, across each group   {len(gpacked):12,}  ({call_tokens / len(gpacked):.1f}x fewer)"
        f"  [{t_gpack * 1e3:.0f} ms CPU, {w_gpack * 1e3:.0f} ms wall]"
    )
    ratio = t_base / t_np_merge
    print(
        f"\ntarget >= 50x with numpy input (samples written, CPU time): {ratio:.1f}x -> "
        f"{'met' if ratio >= 50 else 'NOT met'}; plan only {t_base / t_np_plan:.1f}x; "
        f"bandwidth ceiling {t_base * ceiling / call_tokens:.0f}x;\n"
        f"floor on this input: plan only {t_base / t_read:.1f}x (compares), "
        f"samples written {t_base / (t_read + t_write):.1f}x (compares + writes)"
    )


if __name__ == "__main__":
    main()
