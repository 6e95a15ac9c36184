"""The runner against the real gateway (Rust, in process) and a vLLM-format fake
engine, with real harness subprocesses: exit codes, timeouts, crashes, and every
reward path (stdout line, harness POST, reward function, Python callable)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import lightning
from lightning import GatewayClient
from lightning.run.runner import RolloutTrace, Runner, RunnerError

ENGINE = {"name": "R"}


def script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "harness.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


# A harness that talks to its model with the openai SDK and knows nothing else.
CHAT = """
    import json, os, openai
    task = json.loads(os.environ["LIGHTNING_TASK"])
    client = openai.OpenAI()
    r = client.chat.completions.create(
        model="R", messages=[{"role": "user", "content": task["prompt"]}], max_tokens=5)
    print("noise that is not json")
    print(json.dumps({"reward": task["score"], "text": r.choices[0].message.content}))
"""


def test_stdout_reward_and_environment(client: GatewayClient, tmp_path: Path) -> None:
    runner = Runner(client, script(tmp_path, CHAT), reward_source="stdout", concurrency=3)
    jobs = [({"prompt": f"hi {i}", "score": i / 4}, "g") for i in range(4)]
    results = runner.run(jobs)
    assert [r.status for r in results] == ["succeeded"] * 4
    assert [r.reward for r in results] == [0.0, 0.25, 0.5, 0.75]
    for r in results:
        info = client.get_rollout(r.rollout_id)
        assert info["status"] == "succeeded"
        assert info["group"] == "g"
        # The reward went to the durable store, and the call was recorded.
        assert info["reward"] == pytest.approx(r.reward)
        calls = client.trace(r.rollout_id)
        assert len(calls) == 1 and len(calls[0].completion_ids) > 0
        kinds = [e["type"] for e in client.events(r.rollout_id)]
        assert "stdout" in kinds


def test_crash_is_failed_with_stderr_tail(client: GatewayClient, tmp_path: Path) -> None:
    harness = script(tmp_path, "import sys\nprint('boom ' * 3000, file=sys.stderr)\nsys.exit(3)\n")
    [r] = Runner(client, harness).run([({"x": 1}, None)])
    assert r.status == "failed" and r.exit_code == 3 and r.reward is None
    assert r.stderr_tail.endswith("boom \n") and len(r.stderr_tail) <= 4096
    assert client.get_rollout(r.rollout_id)["status"] == "failed"
    assert any(e["type"] == "stderr" for e in client.events(r.rollout_id))


def test_timeout_kills_the_process_group(client: GatewayClient, tmp_path: Path) -> None:
    # The harness starts a child that would outlive it; the timeout must kill both.
    marker = tmp_path / "child-alive"
    body = f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c",
            "import time, pathlib; time.sleep(3); pathlib.Path({str(marker)!r}).write_text('x')"])
        time.sleep(60)
    """
    [r] = Runner(client, script(tmp_path, body), timeout_s=1.0).run([({}, None)])
    assert r.status == "timed_out" and r.duration_s < 10
    assert client.get_rollout(r.rollout_id)["status"] == "timed_out"
    import time

    time.sleep(3.5)
    assert not marker.exists(), "the harness's child survived the timeout"


def test_harness_posts_its_own_reward(client: GatewayClient, tmp_path: Path) -> None:
    body = """
        import os, httpx
        rid = os.environ["LIGHTNING_ROLLOUT_ID"]
        r = httpx.post(f"{os.environ['LIGHTNING_GATEWAY_URL']}/rollouts/{rid}/reward",
                       json={"value": 0.625},
                       headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"})
        r.raise_for_status()
    """
    [r] = Runner(client, script(tmp_path, body), reward_source="harness").run([({}, None)])
    assert r.status == "succeeded" and r.reward == 0.625


def reward_from_trace(task: Any, trace: RolloutTrace) -> float:
    # A reward function sees the task, the recorded calls and the output.
    assert isinstance(trace.calls[0], lightning.Call)
    return float(len(trace.calls)) + task["bonus"]


def test_reward_function(client: GatewayClient, tmp_path: Path) -> None:
    runner = Runner(
        client,
        script(tmp_path, CHAT),
        reward_source="function",
        reward_fn=f"{__name__}:reward_from_trace",
    )
    [r] = runner.run([({"prompt": "q", "score": 0, "bonus": 0.5}, None)])
    assert r.reward == 1.5
    assert client.get_rollout(r.rollout_id)["reward"] == pytest.approx(1.5)


def test_python_callable_harness(client: GatewayClient) -> None:
    async def harness(task: Any, openai_client: Any) -> float:
        r = await openai_client.chat.completions.create(
            model="R", messages=[{"role": "user", "content": "x"}], max_tokens=3
        )
        return 1.0 if r.choices[0].message.content else 0.0

    async def broken(task: Any, openai_client: Any) -> float:
        raise KeyError("oops")

    [ok] = Runner(client, harness).run([({}, "g1")])
    assert ok.status == "succeeded" and ok.reward == 1.0
    assert len(client.trace(ok.rollout_id)) == 1
    [bad] = Runner(client, broken).run([({}, "g1")])
    assert bad.status == "failed" and bad.reward is None and "oops" in (bad.error or "")


def test_bad_configuration_is_refused(client: GatewayClient) -> None:
    with pytest.raises(RunnerError, match="needs reward_fn"):
        Runner(client, ["true"], reward_source="function")
    with pytest.raises(RunnerError, match="list of argv"):
        Runner(client, "python harness.py")  # type: ignore[arg-type]
    with pytest.raises(RunnerError, match="no callable"):
        Runner(client, ["true"], reward_source="function", reward_fn="json:nope")
    [r] = Runner(client, ["/nonexistent/harness"]).run([({}, None)])
    assert r.status == "failed" and "cannot start" in (r.error or "")
