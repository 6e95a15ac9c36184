"""A harness program built on the OpenAI Agents SDK, configured exactly as the
README says (the client from ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``, tracing
off), with one function tool. It runs ``LIGHTNING_TASK``'s ``task`` and prints one
JSON line: the final output and the commands the tool was asked to run."""

from __future__ import annotations

import asyncio
import json
import os

from agents import (
    Agent,
    Runner,
    function_tool,
    set_default_openai_client,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

RAN: list[str] = []


@function_tool
def exec_command(cmd: str) -> str:
    """Run a shell command.

    Args:
        cmd: The command line to run.
    """
    RAN.append(cmd)
    return "ok"


async def main() -> None:
    task = json.loads(os.environ["LIGHTNING_TASK"])["task"]
    async with AsyncOpenAI(
        base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"]
    ) as client:
        set_default_openai_client(client)
        set_tracing_disabled(True)  # traces would go to api.openai.com with the rollout token
        agent = Agent(
            name="shell",
            instructions="Use the shell to do the task.",
            model=os.environ["OPENAI_MODEL"],
            tools=[exec_command],
        )
        result = await Runner.run(agent, task)
    print(json.dumps({"final": result.final_output, "ran": RAN}))


if __name__ == "__main__":
    asyncio.run(main())
