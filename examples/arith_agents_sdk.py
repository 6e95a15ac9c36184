#!/usr/bin/env python3
"""The arithmetic agent on the OpenAI Agents SDK, over the Responses API.

The same task as ``arith_agent.py`` (ask, check with the same checker, retry
once with its feedback) written the way an Agents SDK user writes it: an
``Agent`` with instructions, run by ``Runner.run``; the retry continues the
conversation from ``result.to_input_list()``. The SDK's default model provider
speaks Responses (``/v1/responses``), which the gateway records exactly like chat.
It knows nothing about lightning.

One difference from the chat agent is the SDK's, not ours: a reply cut off at
``max_tokens`` is an error to the SDK (``ModelBehaviorError``), with no text to
check, so it scores 0 here where the chat agent would still read a number from it.

As a process: ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and ``LIGHTNING_TASK`` in
the environment; prints one JSON line with ``"reward"``. In-process: ``await
run(task, client)`` with an ``openai.AsyncOpenAI`` client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from agents import Agent, ModelBehaviorError, ModelSettings, OpenAIProvider, RunConfig, Runner

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared checker
from arith_agent import (
    MAX_TURNS,
    REWARD_AFTER_RETRY,
    REWARD_FIRST_TRY,
    check_answer,
)

INSTRUCTIONS = "You solve arithmetic problems."

# The SDK logs every reply it refuses (below) as an error before raising it; the
# agent handles those, and any other failure still raises.
logging.getLogger("openai.agents").setLevel(logging.CRITICAL)


async def run(task: dict[str, Any], client: Any) -> float:
    """One rollout of ``task``: the reward (1.0 first try, 0.5 after the retry, else 0)."""
    seed = task.get("sampling_seed")
    settings = ModelSettings(
        temperature=float(task.get("temperature", 1.0)),
        max_tokens=int(task.get("max_tokens", 16)),
        extra_body=None if seed is None else {"seed": int(seed)},
    )
    agent = Agent(
        name="arith",
        instructions=INSTRUCTIONS,
        model=str(task.get("model") or os.environ.get("OPENAI_MODEL") or "default"),
        model_settings=settings,
    )
    # The rollout's client, not the SDK's process-wide default: rollouts run at once.
    config = RunConfig(
        model_provider=OpenAIProvider(openai_client=client, use_responses=True),
        tracing_disabled=True,  # traces would go to api.openai.com with the rollout token
    )
    conversation: Any = task["prompt"]
    for turn in range(MAX_TURNS):
        try:
            result = await Runner.run(agent, conversation, run_config=config)
        except ModelBehaviorError:
            # The SDK refuses a reply cut off at max_tokens (Responses status
            # "incomplete") and keeps no text of it: no answer, reward 0. The
            # call is recorded all the same, so training sees the long reply.
            return 0.0
        ok, feedback = check_answer(task, str(result.final_output or ""))
        if ok:
            return REWARD_FIRST_TRY if turn == 0 else REWARD_AFTER_RETRY
        conversation = [*result.to_input_list(), {"role": "user", "content": feedback}]
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
