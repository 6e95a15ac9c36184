#!/usr/bin/env python3
"""Seeded arithmetic tasks for the demo, cleaned by ``lightning.data``.

    python examples/arith_tasks.py --n 400 --seed 0 --out runs/tasks
        → runs/tasks/raw.jsonl, train.jsonl, eval.jsonl, report.json

Difficulty knobs: the operand range (``--lo``/``--hi``) and the operations
(``--ops +,-,*``). ``--file answer.txt`` makes them tasks for coding agents
(examples/codex_agent.py, examples/claude_agent.py): write the result into that
file, checked through the task's ``expect_file`` and ``expect_text``. Subtraction keeps the first operand the larger one, so
answers are never negative (SmolLM2-135M is small). Tasks are sampled with
replacement; the cleaning pipeline's dedupe removes repeats, its split holds
out eval tasks and decontamination keeps their prompts out of train.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
PROMPT = "What is {a} {op} {b}? Answer with just the number."
FILE_PROMPT = "Compute {a} {op} {b} and write just the resulting number into the file {file}."

# What `lightning demo` generates: sums of operands 1..12, a range of difficulty
# from one-digit sums to sums with a two-digit operand (harder for SmolLM2-135M;
# its held-out reward over the mix starts near 0.3 at temperature 0.7). Single-digit sums alone give
# only 81 distinct tasks, too few for a held-out set that can tell a gain from
# noise; 1..12 gives 144: 48 held out, 96 to train on.
DEMO_FLAGS = ["--n", "1500", "--lo", "1", "--hi", "12", "--ops", "+", "--eval-size", "48"]


def make_task(a: int, op: str, b: int, task_id: str, *, file: str | None = None) -> dict[str, Any]:
    if op == "-" and b > a:
        a, b = b, a
    answer = str(OPS[op](a, b))
    if file is None:
        return {"id": task_id, "prompt": PROMPT.format(a=a, op=op, b=b), "answer": answer, "op": op}
    return {
        "id": task_id,
        "prompt": FILE_PROMPT.format(a=a, op=op, b=b, file=file),
        "answer": answer,
        "op": op,
        # What the coding-agent harnesses check in their working directory.
        "expect_file": file,
        "expect_text": answer,
    }


def generate(
    n: int,
    *,
    seed: int = 0,
    lo: int = 1,
    hi: int = 50,
    ops: str | list[str] = "+",
    file: str | None = None,
) -> list[dict[str, Any]]:
    """``n`` tasks ``{"id", "prompt", "answer", "op"}``, the same for the same seed
    (with ``file``: to be written into that file, plus ``expect_file``/``expect_text``)."""
    op_list = [o.strip() for o in ops.split(",")] if isinstance(ops, str) else list(ops)
    unknown = [o for o in op_list if o not in OPS]
    if unknown or not op_list:
        raise ValueError(f"unknown operations {unknown or op_list}; choose from {sorted(OPS)}")
    if lo > hi:
        raise ValueError(f"operand range lo={lo} > hi={hi}; swap them")
    rng = random.Random(seed)
    return [
        make_task(
            rng.randint(lo, hi),
            rng.choice(op_list),
            rng.randint(lo, hi),
            f"arith-{seed}-{i}",
            file=file,
        )
        for i in range(n)
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", type=int, default=400, help="tasks to generate (before cleaning)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lo", type=int, default=1, help="smallest operand")
    p.add_argument("--hi", type=int, default=50, help="largest operand")
    p.add_argument("--ops", default="+", help="comma-separated operations from + - *")
    p.add_argument("--eval-size", type=int, default=50, help="held-out eval tasks")
    p.add_argument("--file", help="tasks for coding agents: write the result into this file")
    p.add_argument("--out", required=True, help="output directory")
    args = p.parse_args(argv)

    from lightning import data
    from lightning.data.cli import main as clean_main

    out = Path(args.out)
    tasks = generate(args.n, seed=args.seed, lo=args.lo, hi=args.hi, ops=args.ops, file=args.file)
    data.write_jsonl(out / "raw.jsonl", tasks)
    # The same pipeline as `lightning data raw.jsonl --out DIR`.
    flags = ["--eval-size", str(args.eval_size), "--seed", str(args.seed)]
    return clean_main([str(out / "raw.jsonl"), "--out", str(out), *flags])


if __name__ == "__main__":
    sys.exit(main())
