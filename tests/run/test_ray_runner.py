"""Rollouts as Ray tasks on a real local Ray cluster (started once for this module),
against the real gateway and a vLLM-format fake engine: the local runner's
contract (environment, timeouts killing the process group, tails, rewards) and
cluster-side failures surfaced as ``failed`` with the reason."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning import GatewayClient
from lightning.run.ray import RayLauncher
from lightning.run.runner import Runner, RunnerError

# The optional extra lightning-rl[ray] (part of the dev extra): without it the
# Ray backend cannot run, so the module skips, saying why, instead of erroring.
ray = pytest.importorskip("ray", reason="the Ray backend needs lightning-rl[ray]")


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
    )
    yield
    ray.shutdown()


ENGINE = {"name": "R"}


def script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "harness.py"
    path.write_text(textwrap.dedent(body))
    return ["{python}", str(path)]


GOOD = """
    import json, os, openai
    task = json.loads(os.environ["LIGHTNING_TASK"])
    parent = open(f"/proc/{os.getppid()}/cmdline", "rb").read().replace(b"\\0", b" ")
    client = openai.OpenAI()
    r = client.chat.completions.create(
        model="R", messages=[{"role": "user", "content": task["prompt"]}], max_tokens=5)
    print(json.dumps({
        "reward": task["score"],
        "rollout_id": os.environ["LIGHTNING_ROLLOUT_ID"],
        "base_url": os.environ["OPENAI_BASE_URL"],
        "gateway": os.environ["LIGHTNING_GATEWAY_URL"],
        "extra": os.environ.get("HARNESS_EXTRA"),
        "parent": parent.decode(errors="replace"),
    }))
"""


def test_good_harness_runs_as_a_ray_task(
    cluster: None, client: GatewayClient, tmp_path: Path
) -> None:
    runner = Runner(
        client,
        script(tmp_path, GOOD),
        launcher=RayLauncher(),
        env={"HARNESS_EXTRA": "yes"},
        concurrency=2,
    )
    jobs = [({"prompt": f"hi {i}", "score": i / 2}, "g") for i in range(2)]
    results = runner.run(jobs)
    assert [r.status for r in results] == ["succeeded", "succeeded"], [r.error for r in results]
    assert [r.reward for r in results] == [0.0, 0.5]
    for r in results:
        # The environment contract of the local runner, seen from inside the task.
        assert r.info["rollout_id"] == r.rollout_id
        assert r.info["base_url"].endswith(f"/rollouts/{r.rollout_id}/v1")
        assert r.info["gateway"] == client.base_url
        assert r.info["extra"] == "yes"
        # The harness's parent is a Ray worker executing our task, not this process.
        assert "ray::_run_on_node" in r.info["parent"]
        info = client.get_rollout(r.rollout_id)
        assert info["status"] == "succeeded" and info["reward"] == pytest.approx(r.reward)
        assert len(client.trace(r.rollout_id)) == 1


def test_crash_is_failed_with_the_stderr_tail(
    cluster: None, client: GatewayClient, tmp_path: Path
) -> None:
    harness = script(tmp_path, "import sys\nprint('boom ' * 3000, file=sys.stderr)\nsys.exit(3)\n")
    [r] = Runner(client, harness, launcher=RayLauncher()).run([({"x": 1}, None)])
    assert r.status == "failed" and r.exit_code == 3
    assert r.error is not None and r.error.startswith("harness exited with 3 (node ")
    assert r.stderr_tail.endswith("boom \n") and len(r.stderr_tail) == 4096
    assert client.get_rollout(r.rollout_id)["status"] == "failed"
    assert "stderr" in [e["type"] for e in client.events(r.rollout_id)]


def test_timeout_kills_the_process_group_on_the_node(
    cluster: None, client: GatewayClient, tmp_path: Path
) -> None:
    pidfile = tmp_path / "child.pid"
    body = f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(pidfile)!r}, "w").write(str(child.pid))
        print("started", flush=True)
        time.sleep(60)
    """
    runner = Runner(client, script(tmp_path, body), launcher=RayLauncher(), timeout_s=3.0)
    [r] = runner.run([({"x": 1}, None)])
    assert r.status == "timed_out" and "3s timeout" in (r.error or "")
    assert r.stdout_tail == "started\n"
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child), "the harness's child outlived the timeout"
    assert client.get_rollout(r.rollout_id)["status"] == "timed_out"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_worker_death_is_failed_with_the_reason(
    cluster: None, client: GatewayClient, tmp_path: Path
) -> None:
    # The harness takes its Ray worker down with it: what a node lost mid-rollout
    # looks like from the driver.
    body = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nimport time; time.sleep(30)\n"
    [r] = Runner(client, script(tmp_path, body), launcher=RayLauncher()).run([({"x": 1}, None)])
    assert r.status == "failed"
    assert r.error is not None and r.error.startswith("ray: WorkerCrashedError"), r.error
    assert client.get_rollout(r.rollout_id)["status"] == "failed"


def test_unplaceable_task_is_failed_with_the_reason(
    cluster: None, client: GatewayClient, tmp_path: Path
) -> None:
    launcher = RayLauncher(resources={"sandbox_node": 1.0}, schedule_timeout_s=1.0)
    runner = Runner(client, script(tmp_path, "print('never')\n"), launcher=launcher, timeout_s=1.0)
    [r] = runner.run([({"x": 1}, None)])
    assert r.status == "failed"
    assert r.error is not None and "no node offered" in r.error and "sandbox_node" in r.error


def test_callable_harness_is_refused_for_a_remote_launcher(
    cluster: None, client: GatewayClient
) -> None:
    async def harness(task: object, openai_client: object) -> float:
        return 1.0

    with pytest.raises(RunnerError, match="remote launcher needs a harness command"):
        Runner(client, harness, launcher=RayLauncher())


def test_python_placeholder_is_resolved_on_the_node() -> None:
    from lightning.run.runner import resolve_argv

    assert resolve_argv(["{python}", "x.py"]) == [sys.executable, "x.py"]
    assert os.path.isabs(resolve_argv(["{python}"])[0])
