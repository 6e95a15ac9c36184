"""Chat rendering + encoding throughput: lightning vs transformers vs tokenizers.

Workloads (SmolLM2-135M-Instruct's real tokenizer and template):
1. single: N conversations of 9 messages (~900 tokens), each rendered and
   encoded once. Baselines: transformers ``apply_chat_template(tokenize=True)``
   and ``tokenizers`` (Python) encoding of the pre-rendered text.
2. multi-turn: each conversation is a rollout of 5 calls whose prompts extend
   the previous one (what an agent harness resends); ours reuses the rollout's
   already-encoded segments through the segment cache.

Two kinds of content, each run through both workloads:
- words: sentences drawn from a 50-word list (a small vocabulary: every word
  repeats, the best case for any word-level cache);
- code: slices of CPython's standard-library sources (identifiers, comments,
  docstrings, indentation: a large, open vocabulary like real tool output).

Usage: python benches/retokenize.py [N]   (default 10000)
"""

from __future__ import annotations

import os
import platform
import random
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from transformers import AutoTokenizer

import lightning
from lightning.model_cache import smollm2_dir

WORDS = (
    "the a agent tool call file read write error return value list python rust token "
    "model train reward step search query result page line function class test run "
    "config path output input json http server client weight merge sample loss"
).split()


def conversation(rng: random.Random) -> list[dict[str, str]]:
    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."

    msgs = [{"role": "system", "content": "You are a careful coding agent. " + text(20)}]
    for _ in range(4):
        msgs.append({"role": "user", "content": text(rng.randint(60, 110))})
        msgs.append({"role": "assistant", "content": text(rng.randint(60, 110))})
    return msgs  # 9 messages


def stdlib_lines() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    lines: list[str] = []
    for f in sorted(root.glob("*.py")):
        lines.extend(f.read_text(encoding="utf-8", errors="replace").splitlines())
    return lines


def code_conversation(rng: random.Random, lines: list[str]) -> list[dict[str, str]]:
    def text(n: int) -> str:
        # ~8 tokens per line: n words' worth of lines, like a file-read result.
        k = max(1, n // 8)
        i = rng.randrange(len(lines) - k)
        return "\n".join(lines[i : i + k])

    msgs = [{"role": "system", "content": "You are a careful coding agent. " + text(20)}]
    for _ in range(4):
        msgs.append({"role": "user", "content": text(rng.randint(60, 110))})
        msgs.append({"role": "assistant", "content": text(rng.randint(60, 110))})
    return msgs


def rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    d = smollm2_dir()
    hf = AutoTokenizer.from_pretrained(d)
    ours = lightning.Tokenizer.from_dir(d)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(f"machine: {platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()}")
    print(f"python {platform.python_version()}  commit {commit}  conversations={n}")
    print(f"word path: {ours.word_path}")
    rng = random.Random(0)
    lines = stdlib_lines()
    for kind, make in (
        ("words", lambda: conversation(rng)),
        ("code", lambda: code_conversation(rng, lines)),
    ):
        run(kind, [make() for _ in range(n)], hf, ours)


def run(kind: str, convs: list[list[dict[str, str]]], hf, ours) -> None:
    n = len(convs)
    # Correctness first: identical ids on a sample.
    for m in convs[:50]:
        want = hf.apply_chat_template(m, tokenize=True)
        want = want["input_ids"] if hasattr(want, "keys") else want
        assert list(ours.encode_chat(m)) == list(want)
    ntok = sum(len(ours.encode_chat(m)) for m in convs[:200]) / 200
    print(f"\n##### content: {kind}  (avg tokens/conversation: {ntok:.0f})")

    t = time.perf_counter()
    for m in convs:
        hf.apply_chat_template(m, tokenize=True)
    t_hf = time.perf_counter() - t

    rendered = [ours.render_chat(m) for m in convs]
    fast = hf.backend_tokenizer if hasattr(hf, "backend_tokenizer") else hf._tokenizer
    t = time.perf_counter()
    for s in rendered:
        fast.encode(s, add_special_tokens=False)
    t_tk = time.perf_counter() - t

    ours.clear_cache()  # segment and word caches start empty
    t = time.perf_counter()
    for m in convs:
        ours.encode_chat(m)
    t_ours = time.perf_counter() - t

    print("== single: render + encode each conversation once")
    print(f"transformers apply_chat_template : {rate(n, t_hf):9.0f} conv/s  (baseline)")
    print(f"tokenizers encode (pre-rendered) : {rate(n, t_tk):9.0f} conv/s  {t_hf / t_tk:5.2f}x")
    print(
        f"lightning encode_chat            : {rate(n, t_ours):9.0f} conv/s  {t_hf / t_ours:5.2f}x"
    )

    # Multi-turn: 5 calls per rollout, prompt i = messages[: 2i + 1].
    calls = [[m[: 2 * i + 1] for i in range(5)] for m in convs]
    ncalls = 5 * n
    t = time.perf_counter()
    for rollout in calls:
        for p in rollout:
            hf.apply_chat_template(p, tokenize=True, add_generation_prompt=True)
    t_hf2 = time.perf_counter() - t
    ours.clear_cache()
    t = time.perf_counter()
    for rollout in calls:
        for p in rollout:
            ours.encode_chat(p, add_generation_prompt=True)
    t_ours2 = time.perf_counter() - t
    print("== multi-turn: 5 calls per rollout, each extending the previous (segment reuse)")
    print(f"transformers apply_chat_template : {rate(ncalls, t_hf2):9.0f} calls/s  (baseline)")
    print(
        f"lightning encode_chat            : {rate(ncalls, t_ours2):9.0f} calls/s  "
        f"{t_hf2 / t_ours2:5.2f}x"
    )


if __name__ == "__main__":
    main()
