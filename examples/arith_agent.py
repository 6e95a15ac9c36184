#!/usr/bin/env python3
"""A small multi-turn arithmetic agent: the demo's harness.

It is an ordinary OpenAI-SDK program and knows nothing about lightning: it asks
the model an arithmetic question, checks the reply with a tool function, and if
the reply is wrong it retries once, adding the checker's feedback as a new user
turn to the same conversation (so the second call's prompt extends the first
call's full conversation — the multi-turn case the gateway's merge collapses
into one training sample).

Run as a process (the runner's mode):

    OPENAI_BASE_URL=... OPENAI_API_KEY=... \\
    LIGHTNING_TASK='{"id": "t1", "prompt": "What is 17 + 25? Answer with just the number.", "answer": "42"}' \\
    python examples/arith_agent.py

It prints one final JSON line ``{"reward", "turns", "correct", "answers", ...}`` on
stdout and exits 0; it exits non-zero only on real errors (bad task, API failure).
Or in-process: ``await run(task, client)`` with an ``openai.AsyncOpenAI`` (or
``OpenAI``) client returns the reward.

Reward is gated on correctness (a reward for brevity alone gets gamed with empty
answers): 1.0 right on the first try, 0.5 right after the retry, 0.0 otherwise.

Settings, task field first, then environment, then default:
temperature (``AGENT_TEMPERATURE``, 1.0), max_tokens (``AGENT_MAX_TOKENS``, 16),
model (``OPENAI_MODEL``, "default"). A task's ``sampling_seed`` (lightning's
loop derives one per rollout from the run seed) becomes the request ``seed`` of
the first turn (plus the turn number after), so a run can repeat its own draws;
without it the engine draws fresh randomness.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

REWARD_FIRST_TRY = 1.0
REWARD_AFTER_RETRY = 0.5
MAX_TURNS = 2

_NUMBER = re.compile(r"-?\d+")
# "17 + 25 = 42", "The answer is 42", "Answer: 42": the number after the last
# "=", "is" or ":" is the answer; SmolLM2-135M often restates the question first.
_STATED = re.compile(r"(?:=|\bis\b|:)\s*(-?\d+)")


def parse_answer(text: str) -> int | None:
    """The integer the reply gives as its answer: the one after the last "=",
    "is" or ":" if any, else the first integer ("42", "1,234"); None if none."""
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text or "")
    stated = _STATED.findall(text)
    if stated:
        return int(stated[-1])
    match = _NUMBER.search(text)
    return int(match.group()) if match else None


def check_answer(task: dict[str, Any], reply: str) -> tuple[bool, str]:
    """The agent's tool: is the reply right? If not, feedback for the next turn
    (direction only, never the answer itself)."""
    expected = int(str(task["answer"]).strip())
    got = parse_answer(reply)
    if got == expected:
        return True, "Correct."
    if got is None:
        return False, "I could not find a number in your answer. Answer with just the number."
    hint = "too low" if got < expected else "too high"
    return False, f"{got} is {hint}. Try again. Answer with just the number."


@dataclass
class Result:
    reward: float
    turns: int
    correct: bool
    answers: list[str] = field(default_factory=list)
    expected: str = ""
    task_id: str = ""


def _setting(task: dict[str, Any], key: str, env: str, default: float) -> float:
    if task.get(key) is not None:
        return float(task[key])
    if os.environ.get(env):
        return float(os.environ[env])
    return default


async def solve(task: dict[str, Any], client: Any) -> Result:
    """Ask, check, maybe retry once. ``client`` is an OpenAI or AsyncOpenAI client."""
    if not isinstance(task.get("prompt"), str) or task.get("answer") is None:
        raise ValueError(f"task needs 'prompt' (str) and 'answer'; got keys {sorted(task)}")
    temperature = _setting(task, "temperature", "AGENT_TEMPERATURE", 1.0)
    max_tokens = int(_setting(task, "max_tokens", "AGENT_MAX_TOKENS", 16))
    model = str(task.get("model") or os.environ.get("OPENAI_MODEL") or "default")
    seed = task.get("sampling_seed")

    messages: list[dict[str, str]] = [{"role": "user", "content": task["prompt"]}]
    result = Result(reward=0.0, turns=0, correct=False, expected=str(task["answer"]))
    result.task_id = str(task.get("id", ""))
    for turn in range(MAX_TURNS):
        extra: dict[str, Any] = {} if seed is None else {"seed": int(seed) + turn}
        reply = client.chat.completions.create(
            model=model,
            messages=messages,
            temperature=temperature,
            max_tokens=max_tokens,
            **extra,
        )
        if inspect.isawaitable(reply):
            reply = await reply
        text = reply.choices[0].message.content or ""
        result.turns += 1
        result.answers.append(text)
        ok, feedback = check_answer(task, text)
        if ok:
            result.correct = True
            result.reward = REWARD_FIRST_TRY if turn == 0 else REWARD_AFTER_RETRY
            break
        # Keep the model's reply verbatim so the next prompt extends this one.
        messages.append({"role": "assistant", "content": text})
        messages.append({"role": "user", "content": feedback})
    return result


async def run(task: dict[str, Any], client: Any) -> float:
    """The in-process harness: the reward for one rollout of ``task``."""
    return (await solve(task, client)).reward


def main() -> int:
    raw = os.environ.get("LIGHTNING_TASK")
    if not raw:
        print("arith_agent: set LIGHTNING_TASK to the task as JSON", file=sys.stderr)
        return 2
    try:
        task = json.loads(raw)
        if not isinstance(task, dict):
            raise ValueError(f"expected a JSON object, got {type(task).__name__}")
        int(str(task["answer"]).strip())
    except (ValueError, KeyError) as e:
        print(f"arith_agent: bad LIGHTNING_TASK ({e}): {raw[:200]}", file=sys.stderr)
        return 2

    from openai import AsyncOpenAI, OpenAIError

    async def go() -> Result:
        # The SDK reads OPENAI_BASE_URL and OPENAI_API_KEY itself.
        async with AsyncOpenAI(max_retries=1) as client:
            return await solve(task, client)

    try:
        result = asyncio.run(go())
    except (OpenAIError, ValueError) as e:
        print(f"arith_agent: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(asdict(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
