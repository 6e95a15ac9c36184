#!/usr/bin/env python3
"""The arithmetic agent on the ``anthropic`` SDK, over the Messages API.

The same task as ``arith_agent.py`` (ask, check with the same checker, retry
once with its feedback), written as an Anthropic SDK program: a ``system``
prompt and ``messages.create``; the retry appends the model's reply and the
feedback to ``messages``. The gateway speaks Messages at the rollout's address
without ``/v1`` (``Rollout.anthropic_base_url``). It knows nothing about lightning.

As a process: ``ANTHROPIC_BASE_URL`` and ``ANTHROPIC_API_KEY`` (or, as the runner
sets them, ``OPENAI_BASE_URL``/``OPENAI_API_KEY``) and ``LIGHTNING_TASK``; prints
one JSON line with ``"reward"``. In-process: ``await run(task, client)``, where
``client`` is the runner's ``openai.AsyncOpenAI`` for the rollout: its address
and key are the rollout's, which this agent gives its Anthropic client.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import anthropic

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared checker
from arith_agent import (
    MAX_TURNS,
    REWARD_AFTER_RETRY,
    REWARD_FIRST_TRY,
    check_answer,
)

SYSTEM = "You are a helpful assistant. Answer arithmetic questions."


async def solve(task: dict[str, Any], claude: anthropic.AsyncAnthropic) -> float:
    seed = task.get("sampling_seed")
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["prompt"]}]
    for turn in range(MAX_TURNS):
        reply = await claude.messages.create(
            model=str(task.get("model") or os.environ.get("OPENAI_MODEL") or "default"),
            system=SYSTEM,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=int(task.get("max_tokens", 16)),
            # This SDK release takes no `temperature` argument; the Messages body does.
            extra_body={
                "temperature": float(task.get("temperature", 1.0)),
                **({} if seed is None else {"seed": int(seed) + turn}),
            },
        )
        text = "".join(b.text for b in reply.content if b.type == "text")
        ok, feedback = check_answer(task, text)
        if ok:
            return REWARD_FIRST_TRY if turn == 0 else REWARD_AFTER_RETRY
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": feedback},
        ]
    return 0.0


async def run(task: dict[str, Any], client: Any) -> float:
    """One rollout of ``task`` through Messages at the rollout's address."""
    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    async with anthropic.AsyncAnthropic(base_url=base, api_key=client.api_key) as claude:
        return await solve(task, claude)


def main() -> int:
    task = json.loads(os.environ["LIGHTNING_TASK"])
    base = os.environ.get("ANTHROPIC_BASE_URL") or os.environ["OPENAI_BASE_URL"].removesuffix("/v1")
    key = os.environ.get("ANTHROPIC_API_KEY") or os.environ["OPENAI_API_KEY"]

    async def go() -> float:
        async with anthropic.AsyncAnthropic(base_url=base, api_key=key, max_retries=1) as c:
            return await solve(task, c)

    print(json.dumps({"reward": asyncio.run(go())}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
