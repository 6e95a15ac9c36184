"""examples/: the arithmetic agent against a real loopback OpenAI-compatible stub,
and the seeded task generator through lightning.data."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


agent = load_example("arith_agent")
arith_tasks = load_example("arith_tasks")

TASK = {"id": "t1", "prompt": "What is 17 + 25? Answer with just the number.", "answer": "42"}


class StubOpenAI:
    """A tiny OpenAI-compatible chat-completions server on loopback that answers
    with canned replies in order and records every request."""

    def __init__(self, replies: list[str], status: int = 200) -> None:
        self.replies = list(replies)
        self.status = status
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append(body)
                stub.headers.append({k.lower(): v for k, v in self.headers.items()})
                if self.path != "/v1/chat/completions":
                    return self._send(404, {"error": {"message": "no route", "type": "x"}})
                if stub.status != 200:
                    err = {"message": "stub failure", "type": "invalid_request_error", "code": "x"}
                    return self._send(stub.status, {"error": err})
                text = stub.replies.pop(0) if stub.replies else ""
                self._send(
                    200,
                    {
                        "id": f"chatcmpl-{len(stub.requests)}",
                        "object": "chat.completion",
                        "created": int(time.time()),
                        "model": body.get("model", "stub"),
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": text},
                                "finish_reason": "stop",
                            }
                        ],
                        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
                    },
                )

            def _send(self, status: int, obj: dict[str, Any]) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # keep test output clean

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self) -> StubOpenAI:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def stub_factory() -> Iterator[Any]:
    stubs: list[StubOpenAI] = []

    def make(replies: list[str], status: int = 200) -> StubOpenAI:
        stub = StubOpenAI(replies, status).__enter__()
        stubs.append(stub)
        return stub

    yield make
    for stub in stubs:
        stub.__exit__()


def solve_in_process(stub: StubOpenAI, task: dict[str, Any]) -> Any:
    from openai import AsyncOpenAI

    async def go() -> Any:
        async with AsyncOpenAI(base_url=stub.base_url, api_key="tok", max_retries=0) as client:
            return await agent.solve(task, client)

    return asyncio.run(go())


# ------------------------------------------------------------------ the tool


def test_parse_and_check_answer() -> None:
    assert agent.parse_answer("42") == 42
    assert agent.parse_answer("The answer is -7.") == -7
    assert agent.parse_answer("1,234 apples") == 1234
    assert agent.parse_answer("no idea") is None
    # Restating the question first is common for a 135M model.
    assert agent.parse_answer("17 + 25 = 42") == 42
    assert agent.parse_answer("2 + 8 is 10, because 2 and 8 are") == 10
    assert agent.parse_answer("Answer: 7") == 7
    assert agent.parse_answer("42 apples and 3 pears") == 42
    assert agent.check_answer(TASK, " 42\n") == (True, "Correct.")
    ok, feedback = agent.check_answer(TASK, "41")
    assert not ok and "too low" in feedback and "42" not in feedback
    assert "too high" in agent.check_answer(TASK, "50")[1]
    assert "could not find a number" in agent.check_answer(TASK, "")[1]


# ------------------------------------------------------------------ in process


def test_first_try_correct(stub_factory: Any) -> None:
    stub = stub_factory(["42"])
    result = solve_in_process(stub, TASK)
    assert (result.reward, result.turns, result.correct) == (1.0, 1, True)
    assert len(stub.requests) == 1
    req = stub.requests[0]
    assert req["messages"] == [{"role": "user", "content": TASK["prompt"]}]
    assert req["max_tokens"] == 16 and req["temperature"] == 1.0


def test_retry_extends_the_first_conversation(stub_factory: Any) -> None:
    stub = stub_factory(["It is 40.", "42"])
    result = solve_in_process(stub, {**TASK, "temperature": 0.3})
    assert (result.reward, result.turns, result.correct) == (0.5, 2, True)
    assert result.answers == ["It is 40.", "42"]
    first, second = (r["messages"] for r in stub.requests)
    # The second prompt is the first conversation, verbatim, plus two turns.
    assert second[: len(first)] == first
    assert second[len(first)] == {"role": "assistant", "content": "It is 40."}
    assert second[len(first) + 1]["role"] == "user"
    assert "40 is too low" in second[len(first) + 1]["content"]
    assert all(r["temperature"] == 0.3 for r in stub.requests)


def test_sampling_seed_becomes_the_request_seed(stub_factory: Any) -> None:
    stub = stub_factory(["41", "42"])
    solve_in_process(stub, {**TASK, "sampling_seed": 1234})
    assert [r["seed"] for r in stub.requests] == [1234, 1235]
    unseeded = stub_factory(["42"])
    solve_in_process(unseeded, TASK)
    assert "seed" not in unseeded.requests[0]


def test_wrong_twice_gets_zero(stub_factory: Any) -> None:
    stub = stub_factory(["41", "43"])
    result = solve_in_process(stub, TASK)
    assert (result.reward, result.turns, result.correct) == (0.0, 2, False)
    assert len(stub.requests) == 2  # retries once, not more


def test_run_returns_the_reward(stub_factory: Any) -> None:
    from openai import OpenAI

    stub = stub_factory(["nope", "42"])
    # A synchronous client works too.
    client = OpenAI(base_url=stub.base_url, api_key="tok", max_retries=0)
    assert asyncio.run(agent.run(TASK, client)) == 0.5
    client.close()


# ------------------------------------------------------------------ as a process


def run_agent(
    stub: StubOpenAI | None, task: Any, **extra_env: str
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "AGENT_"))}
    if stub is not None:
        env.update(OPENAI_BASE_URL=stub.base_url, OPENAI_API_KEY="rollout-token")
    if task is not None:
        env["LIGHTNING_TASK"] = task if isinstance(task, str) else json.dumps(task)
    env.update(extra_env)
    return subprocess.run(
        [sys.executable, str(EXAMPLES / "arith_agent.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_process_prints_final_json_line(stub_factory: Any) -> None:
    stub = stub_factory(["I think 24", "42"])
    proc = run_agent(stub, TASK, AGENT_TEMPERATURE="0.7", OPENAI_MODEL="smol")
    assert proc.returncode == 0, proc.stderr
    final = json.loads(proc.stdout.strip().splitlines()[-1])
    assert final["reward"] == 0.5 and final["turns"] == 2 and final["correct"] is True
    assert final["task_id"] == "t1" and final["expected"] == "42"
    assert [h["authorization"] for h in stub.headers] == ["Bearer rollout-token"] * 2
    assert [r["temperature"] for r in stub.requests] == [0.7, 0.7]
    assert {r["model"] for r in stub.requests} == {"smol"}


def test_process_errors_exit_nonzero(stub_factory: Any) -> None:
    proc = run_agent(None, None)
    assert proc.returncode == 2 and "LIGHTNING_TASK" in proc.stderr
    proc = run_agent(None, {"prompt": "What is 1 + 1?"})
    assert proc.returncode == 2 and "bad LIGHTNING_TASK" in proc.stderr
    stub = stub_factory([], status=400)
    proc = run_agent(stub, TASK)
    assert proc.returncode == 1 and "BadRequestError" in proc.stderr
    assert proc.stdout == ""


# ------------------------------------------------------------------ tasks


def test_task_generator_is_seeded_and_correct() -> None:
    a = arith_tasks.generate(50, seed=1, lo=1, hi=20, ops="+,-,*")
    assert a == arith_tasks.generate(50, seed=1, lo=1, hi=20, ops="+,-,*")
    assert a != arith_tasks.generate(50, seed=2, lo=1, hi=20, ops="+,-,*")
    for t in a:
        expr = t["prompt"].removeprefix("What is ").split("?")[0]
        x, op, y = expr.split()
        assert 1 <= int(x) <= 20 and 1 <= int(y) <= 20 and op == t["op"]
        assert str(eval(expr)) == t["answer"] and int(t["answer"]) >= 0
        assert agent.check_answer(t, t["answer"])[0]
    assert {t["op"] for t in a} == {"+", "-", "*"}
    with pytest.raises(ValueError, match="unknown operations"):
        arith_tasks.generate(3, ops="/")


def test_task_generator_goes_through_lightning_data(tmp_path: Path) -> None:
    out = tmp_path / "tasks"
    code = arith_tasks.main(["--n", "300", "--hi", "15", "--eval-size", "30", "--out", str(out)])
    assert code == 0
    raw = (out / "raw.jsonl").read_text().splitlines()
    train = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]
    held = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert len(raw) == 300 and len(held) == 30
    # Operands 1..15 with "+" give at most 225 distinct prompts: dedupe must bite.
    report = json.loads((out / "report.json").read_text())
    assert report[1]["stage"] == "dedupe_exact" and report[1]["n_out"] <= 225
    prompts = [t["prompt"] for t in train + held]
    assert len(prompts) == len(set(prompts))
    assert {t["prompt"] for t in train}.isdisjoint(t["prompt"] for t in held)
    assert set(train[0]) >= {"id", "prompt", "answer", "op"}


def test_task_generator_writes_file_tasks_for_coding_agents(tmp_path: Path) -> None:
    """`--file` tasks name the file the coding-agent harnesses check (their
    `expect_file`/`expect_text`), and the data pipeline keeps those fields."""
    plain = arith_tasks.generate(20, seed=3, lo=1, hi=30, ops="+,*")
    coding = arith_tasks.generate(20, seed=3, lo=1, hi=30, ops="+,*", file="answer.txt")
    for p, c in zip(plain, coding, strict=True):
        assert c["answer"] == p["answer"] and c["id"] == p["id"]
        expr = p["prompt"].removeprefix("What is ").split("?")[0]
        assert (
            c["prompt"]
            == f"Compute {expr} and write just the resulting number into the file answer.txt."
        )
        assert c["expect_file"] == "answer.txt" and c["expect_text"] == c["answer"]
        assert "expect_file" not in p
    out = tmp_path / "tasks"
    flags = ["--n", "200", "--hi", "30", "--eval-size", "20", "--file", "answer.txt"]
    assert arith_tasks.main([*flags, "--out", str(out)]) == 0
    held = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert len(held) == 20
    assert all(t["expect_file"] == "answer.txt" and t["expect_text"] == t["answer"] for t in held)
