#!/usr/bin/env python3
"""The demo's unseen harness: the arithmetic agent in another style.

An openai-SDK chat program like ``arith_agent.py``, but written by someone else:
a system prompt that asks for a fixed answer format, the question wrapped in
its own words, and blunter feedback on a wrong answer. ``lightning demo
--harnesses all`` never trains through it (``eval_only``): its eval says how
much of what the policy learned through the other three harnesses carries over
to a prompt it never saw.

In-process: ``await run(task, client)``; as a process, like ``arith_agent.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared checker
from arith_agent import MAX_TURNS, REWARD_AFTER_RETRY, REWARD_FIRST_TRY, parse_answer

SYSTEM = "You are a calculator. Reply with one line: 'Answer: <number>'."


async def run(task: dict[str, Any], client: Any) -> float:
    """One rollout of ``task``: the reward (1.0 first try, 0.5 after the retry, else 0)."""
    seed = task.get("sampling_seed")
    messages: list[dict[str, str]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Question: {task['prompt']}"},
    ]
    expected = int(str(task["answer"]).strip())
    for turn in range(MAX_TURNS):
        reply = await client.chat.completions.create(
            model=str(task.get("model") or os.environ.get("OPENAI_MODEL") or "default"),
            messages=messages,
            temperature=float(task.get("temperature", 1.0)),
            max_tokens=int(task.get("max_tokens", 16)),
            **({} if seed is None else {"seed": int(seed) + turn}),
        )
        text = reply.choices[0].message.content or ""
        if parse_answer(text) == expected:
            return REWARD_FIRST_TRY if turn == 0 else REWARD_AFTER_RETRY
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": "Wrong. Compute it again."},
        ]
    return 0.0


def main() -> int:
    from openai import AsyncOpenAI

    task = json.loads(os.environ["LIGHTNING_TASK"])

    async def go() -> float:
        async with AsyncOpenAI(max_retries=1) as client:
            return await run(task, client)

    print(json.dumps({"reward": asyncio.run(go())}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
