"""The runner: launch the unmodified harness once per rollout and collect what it did.

A rollout is one run of the harness on one task. The runner creates the rollout at
the gateway, then starts the harness as a subprocess with only its OpenAI settings
changed (``OPENAI_BASE_URL`` is the rollout's gateway URL, ``OPENAI_API_KEY`` the
rollout's token) plus ``LIGHTNING_ROLLOUT_ID``, ``LIGHTNING_TASK`` (the task as JSON)
and ``LIGHTNING_GATEWAY_URL``. Everything the harness says to its model is recorded
by the gateway; the runner only records how the process ended:

- exit status 0 → ``succeeded``, anything else → ``failed``, past the per-rollout
  timeout → ``timed_out`` (the whole process group is killed);
- the last few KB of stdout and stderr are stored as events of the rollout.

The reward comes from one of three places (``RewardSource``):

- ``"harness"``: the harness POSTs it to the gateway itself (with its own token);
- ``"stdout"``: the harness prints a final JSON line with a ``"reward"`` key, as a
  harness that knows nothing about lightning naturally would;
- ``"function"``: a reward function ``module:function(task, trace) -> float``.

In the last two cases the runner posts the reward to the gateway, so every reward
is in the durable store next to the calls it rewards.

A Python-callable harness (``async def run(task, client) -> float | None``, with an
``openai.AsyncOpenAI`` client already pointed at the rollout) runs in-process with
the same bookkeeping, for users who prefer it.

Where harness processes run is the runner's ``launcher``: this machine by default,
a Ray cluster with ``lightning.run.ray.RayLauncher``. The contract (environment
in; status, tails and reward out) is the same wherever the process runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import inspect
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from lightning._core import LightningError

log = logging.getLogger("lightning.run.runner")

RewardSource = Literal["harness", "stdout", "function"]
RolloutStatus = Literal["succeeded", "failed", "timed_out"]

TAIL_BYTES = 4096


class RunnerError(LightningError, RuntimeError):
    """A harness or reward function could not be set up (not: a rollout failed)."""


class _Rollout(Protocol):
    id: str
    token: str
    base_url: str


class GatewayLike(Protocol):
    """What the runner needs from `lightning.GatewayClient`."""

    base_url: str

    def create_rollout(
        self,
        task: Any,
        group: str | None = None,
        mode: str = "train",
        rollout_id: str | None = None,
    ) -> Any: ...

    def set_status(self, rollout_id: str, status: str) -> Any: ...

    def reward(
        self, rollout_id: str, value: float, source: str | None = None, token: str | None = None
    ) -> Any: ...

    def event(self, rollout_id: str, type: str, data: Any, token: str | None = None) -> Any: ...

    def trace(self, rollout_id: str) -> list[Any]: ...

    def get_rollout(self, rollout_id: str) -> Any: ...


@dataclass
class RolloutTrace:
    """What a reward function sees of one finished rollout."""

    rollout_id: str
    task: Any
    calls: list[Any]
    stdout: str
    stderr: str
    exit_code: int | None
    status: RolloutStatus

    def final_json(self) -> dict[str, Any] | None:
        """The last line of stdout that parses as a JSON object, if any."""
        return _last_json_line(self.stdout)


@dataclass
class RolloutResult:
    rollout_id: str
    group: str | None
    task: Any
    status: RolloutStatus
    reward: float | None
    exit_code: int | None
    duration_s: float
    stdout_tail: str = ""
    stderr_tail: str = ""
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


def load_callable(spec: str) -> Callable[..., Any]:
    """Resolve ``"module:function"`` (a file path ending in .py also works as module)."""
    if ":" not in spec:
        raise RunnerError(f"expected 'module:function', got {spec!r}")
    module_name, _, func_name = spec.rpartition(":")
    if module_name.endswith(".py"):
        path = os.path.abspath(module_name)
        mod_spec = importlib.util.spec_from_file_location(
            os.path.splitext(os.path.basename(path))[0], path
        )
        if mod_spec is None or mod_spec.loader is None:
            raise RunnerError(f"cannot load {path!r}: not a Python file")
        module = importlib.util.module_from_spec(mod_spec)
        # Registered before it runs, as `import` would: dataclasses and pickling
        # look the module up in sys.modules while it executes.
        sys.modules[mod_spec.name] = module
        try:
            mod_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[mod_spec.name]
            raise
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise RunnerError(f"cannot import {module_name!r} for {spec!r}: {e}") from e
    func = getattr(module, func_name, None)
    if not callable(func):
        raise RunnerError(f"{spec!r}: {module_name} has no callable {func_name!r}")
    return func


def _last_json_line(text: str) -> dict[str, Any] | None:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    return None


class _Tail:
    """Keeps the last `limit` bytes of a stream without holding all of it."""

    def __init__(self, limit: int = TAIL_BYTES) -> None:
        self.limit = limit
        self.buf = bytearray()
        self.total = 0

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        self.buf += chunk
        if len(self.buf) > 2 * self.limit:
            del self.buf[: len(self.buf) - self.limit]

    def text(self) -> str:
        data = bytes(self.buf[-self.limit :])
        return data.decode("utf-8", errors="replace")


async def _drain(stream: asyncio.StreamReader | None, tail: _Tail) -> None:
    if stream is None:
        return
    while chunk := await stream.read(65536):
        tail.feed(chunk)


@dataclass
class ProcessOutcome:
    """How one harness process ended, wherever it ran."""

    status: RolloutStatus
    exit_code: int | None
    stdout: str
    stderr: str
    error: str | None


class Launcher(Protocol):
    """Where harness processes run: here (:class:`LocalLauncher`) or on a cluster
    (``lightning.run.ray.RayLauncher``). The contract is the same everywhere:
    ``env`` is laid over the environment of the machine the process runs on, the
    process group is killed past ``timeout_s``, the tails of stdout/stderr return."""

    async def launch(
        self, argv: list[str], env: dict[str, str], cwd: str | None, timeout_s: float
    ) -> ProcessOutcome: ...


def resolve_argv(argv: Sequence[str]) -> list[str]:
    """``{python}`` in a harness command is the interpreter of the machine it runs on."""
    return [sys.executable if a == "{python}" else str(a) for a in argv]


async def run_process(
    argv: Sequence[str], env: Mapping[str, str], cwd: str | None, timeout_s: float
) -> ProcessOutcome:
    """Run one harness process here: own process group, tails kept, killed on timeout."""
    argv = resolve_argv(argv)
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env={**os.environ, **env},
            cwd=cwd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            # Own process group, so a timeout kills the harness and its children.
            start_new_session=True,
        )
    except OSError as e:
        return ProcessOutcome("failed", None, "", "", f"cannot start harness {argv[0]!r}: {e}")
    out, err = _Tail(), _Tail()
    readers = asyncio.gather(_drain(proc.stdout, out), _drain(proc.stderr, err))
    status: RolloutStatus
    try:
        await asyncio.wait_for(proc.wait(), timeout=timeout_s)
        status = "succeeded" if proc.returncode == 0 else "failed"
        error = None if proc.returncode == 0 else f"harness exited with {proc.returncode}"
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        status = "timed_out"
        error = f"harness ran past the {timeout_s:g}s timeout and was killed"
    with contextlib.suppress(Exception):
        await asyncio.wait_for(readers, timeout=5.0)
    return ProcessOutcome(status, proc.returncode, out.text(), err.text(), error)


class LocalLauncher:
    """Harness processes on this machine (the default)."""

    async def launch(
        self, argv: list[str], env: dict[str, str], cwd: str | None, timeout_s: float
    ) -> ProcessOutcome:
        return await run_process(argv, env, cwd, timeout_s)


class Runner:
    """Runs rollouts against a gateway with bounded concurrency.

    `harness` is either a command (list of argv strings, run as a subprocess) or an
    async callable ``run(task, client)``. `reward_source` and `reward_fn` say where
    rewards come from (see the module docstring).
    """

    def __init__(
        self,
        gateway: GatewayLike,
        harness: Sequence[str] | Callable[[Any, Any], Awaitable[Any]],
        *,
        reward_source: RewardSource = "stdout",
        reward_fn: Callable[[Any, RolloutTrace], float] | str | None = None,
        concurrency: int = 8,
        timeout_s: float = 300.0,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        launcher: Launcher | None = None,
    ) -> None:
        if isinstance(reward_fn, str):
            reward_fn = load_callable(reward_fn)
        if reward_source == "function" and reward_fn is None:
            raise RunnerError("reward_source='function' needs reward_fn ('module:function')")
        if concurrency < 1:
            raise RunnerError(f"concurrency must be >= 1, got {concurrency}")
        if isinstance(harness, str):
            raise RunnerError("harness command must be a list of argv strings, not one string")
        self.gateway = gateway
        self.harness = harness
        self.reward_source: RewardSource = reward_source
        self.reward_fn = reward_fn
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.env = dict(env or {})
        self.cwd = cwd
        self.launcher: Launcher = launcher or LocalLauncher()
        if callable(harness) and not isinstance(self.launcher, LocalLauncher):
            raise RunnerError(
                "a Python-callable harness runs in this process; a remote launcher needs a "
                "harness command"
            )

    # -- public -----------------------------------------------------------------

    def run(
        self, jobs: Sequence[tuple[Any, str | None]], *, mode: str = "train"
    ) -> list[RolloutResult]:
        """Run one rollout per ``(task, group)`` job; results in job order."""
        return asyncio.run(self.run_async(jobs, mode=mode))

    async def run_async(
        self, jobs: Sequence[tuple[Any, str | None]], *, mode: str = "train"
    ) -> list[RolloutResult]:
        sem = asyncio.Semaphore(self.concurrency)

        async def one(task: Any, group: str | None) -> RolloutResult:
            async with sem:
                return await self.run_one(task, group=group, mode=mode)

        return list(await asyncio.gather(*(one(t, g) for t, g in jobs)))

    async def run_one(self, task: Any, *, group: str | None, mode: str = "train") -> RolloutResult:
        rollout = await asyncio.to_thread(self.gateway.create_rollout, task, group, mode)
        started = time.monotonic()
        await asyncio.to_thread(self.gateway.set_status, rollout.id, "running")
        if callable(self.harness):
            status, code, out, err, returned, error = await self._run_callable(rollout, task)
        else:
            status, code, out, err, error = await self._run_process(rollout, task)
            returned = None
        duration = time.monotonic() - started

        for kind, text in (("stdout", out), ("stderr", err)):
            if text:
                await asyncio.to_thread(
                    self.gateway.event, rollout.id, kind, {"tail": text, "exit_code": code}
                )

        final = _last_json_line(out)
        reward: float | None = None
        try:
            reward = await self._resolve_reward(
                rollout, task, status, code, out, err, returned, final
            )
        except Exception as e:  # a broken reward function must not lose the rollout
            error = f"reward: {type(e).__name__}: {e}"
            log.warning("rollout %s: %s", rollout.id, error)
        await asyncio.to_thread(self.gateway.set_status, rollout.id, status)
        return RolloutResult(
            rollout_id=rollout.id,
            group=group,
            task=task,
            status=status,
            reward=reward,
            exit_code=code,
            duration_s=duration,
            stdout_tail=out,
            stderr_tail=err,
            error=error,
            info=final or {},
        )

    # -- internals --------------------------------------------------------------

    def _environment(self, rollout: _Rollout, task: Any) -> dict[str, str]:
        """What the harness gets on top of the environment of the machine it runs on."""
        env = dict(self.env)
        env.update(
            {
                "OPENAI_BASE_URL": rollout.base_url,
                "OPENAI_API_KEY": rollout.token,
                "LIGHTNING_ROLLOUT_ID": rollout.id,
                "LIGHTNING_TASK": json.dumps(task),
                "LIGHTNING_GATEWAY_URL": self.gateway.base_url,
                # Harness output should arrive line by line, not at exit.
                "PYTHONUNBUFFERED": "1",
            }
        )
        return env

    async def _run_process(
        self, rollout: _Rollout, task: Any
    ) -> tuple[RolloutStatus, int | None, str, str, str | None]:
        assert not callable(self.harness)
        argv = [str(a) for a in self.harness]
        o = await self.launcher.launch(
            argv, self._environment(rollout, task), self.cwd, self.timeout_s
        )
        return o.status, o.exit_code, o.stdout, o.stderr, o.error

    async def _run_callable(
        self, rollout: _Rollout, task: Any
    ) -> tuple[RolloutStatus, int | None, str, str, Any, str | None]:
        import openai

        assert callable(self.harness)
        client = openai.AsyncOpenAI(base_url=rollout.base_url, api_key=rollout.token)
        try:
            result = self.harness(task, client)
            if inspect.isawaitable(result):
                result = await asyncio.wait_for(result, timeout=self.timeout_s)
            return "succeeded", 0, "", "", result, None
        except TimeoutError:
            return "timed_out", None, "", "", None, f"harness ran past {self.timeout_s:g}s"
        except Exception as e:
            return "failed", 1, "", f"{type(e).__name__}: {e}", None, f"harness raised {e!r}"
        finally:
            await client.close()

    async def _resolve_reward(
        self,
        rollout: _Rollout,
        task: Any,
        status: RolloutStatus,
        code: int | None,
        out: str,
        err: str,
        returned: Any,
        final: dict[str, Any] | None,
    ) -> float | None:
        value: float | None = None
        source = self.reward_source
        if callable(self.harness) and isinstance(returned, int | float) and source != "function":
            value, source_name = float(returned), "harness"
        elif source == "harness":
            info = await asyncio.to_thread(self.gateway.get_rollout, rollout.id)
            reward = info.get("reward") if isinstance(info, dict) else getattr(info, "reward", None)
            return None if reward is None else float(reward)
        elif source == "stdout":
            if final is not None and isinstance(final.get("reward"), int | float):
                value, source_name = float(final["reward"]), "stdout"
        else:
            assert self.reward_fn is not None
            calls = await asyncio.to_thread(self.gateway.trace, rollout.id)
            trace = RolloutTrace(rollout.id, task, calls, out, err, code, status)
            result = self.reward_fn(task, trace)
            if inspect.isawaitable(result):
                result = await result
            value, source_name = float(result), "function"
        if value is None:
            return None
        await asyncio.to_thread(self.gateway.reward, rollout.id, value, source_name)
        return value
