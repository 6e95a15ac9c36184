"""Rollouts on a Ray cluster: ``[harness] backend = "ray"``.

Each rollout's harness process runs inside a Ray task on whichever node has the
capacity (``num_cpus`` / custom ``resources`` per rollout), through exactly the code
the local runner uses (:func:`lightning.run.runner.run_process`): the runner's
environment (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``LIGHTNING_ROLLOUT_ID``,
``LIGHTNING_TASK``, ``LIGHTNING_GATEWAY_URL``) laid over the node's own, its own
process group killed at the timeout, the tails of stdout/stderr sent back. Rewards,
statuses and store events stay on the driver, in :class:`lightning.run.runner.Runner`,
so a rollout that ran on a node is recorded exactly as a local one.

Failures of the cluster rather than of the harness come back as ``failed`` with
the reason in ``RolloutResult.error``, prefixed ``ray:``: the worker or node died
(``WorkerCrashedError``, ``NodeDiedError``), the task could not be placed within
``schedule_timeout_s`` (no node has the resources asked for), the task raised.
Tasks are not retried (``max_retries=0``): a rollout is not idempotent (its
calls are already in the store), so a retry would need a new rollout id.

Nodes need lightning-rl installed (the task imports ``lightning.run.runner``), the
harness command and ``cwd`` present, and a route to the gateway's ``listen``
address (bind it to an address the nodes reach, not 127.0.0.1).

Ray is an optional dependency: ``pip install 'lightning-rl[ray]'``.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Mapping
from typing import Any

from lightning.run.runner import ProcessOutcome, RunnerError


def _run_on_node(
    argv: list[str], env: dict[str, str], cwd: str | None, timeout_s: float
) -> dict[str, Any]:
    """The body of the Ray task (runs on the node)."""
    from lightning.run.runner import run_process

    outcome = asyncio.run(run_process(argv, env, cwd, timeout_s))
    return {**outcome.__dict__, "node": socket.gethostname()}


class RayLauncher:
    """Launches harness processes as Ray tasks. ``address``: ``None`` joins the
    cluster of an already initialized Ray (``ray.init`` done by the caller) or
    starts/joins one as ``ray.init()`` would; ``"auto"`` or ``"ray://head:10001"``
    name an existing cluster."""

    def __init__(
        self,
        *,
        address: str | None = None,
        num_cpus: float = 1.0,
        resources: Mapping[str, float] | None = None,
        schedule_timeout_s: float = 600.0,
        runtime_env: Mapping[str, Any] | None = None,
    ) -> None:
        try:
            import ray
        except ImportError as e:
            raise RunnerError(
                "[harness] backend = 'ray' needs Ray: pip install 'lightning-rl[ray]'"
            ) from e
        self._ray = ray
        self.address = address
        self.num_cpus = num_cpus
        self.resources = dict(resources or {})
        self.schedule_timeout_s = schedule_timeout_s
        self.runtime_env = dict(runtime_env or {})
        self._task: Any = None

    def _remote(self) -> Any:
        ray = self._ray
        if not ray.is_initialized():
            ray.init(address=self.address, log_to_driver=False)
        if self._task is None:
            self._task = ray.remote(_run_on_node).options(
                num_cpus=self.num_cpus,
                resources=self.resources or None,
                max_retries=0,
                runtime_env=self.runtime_env or None,
            )
        return self._task

    async def launch(
        self, argv: list[str], env: dict[str, str], cwd: str | None, timeout_s: float
    ) -> ProcessOutcome:
        ray = self._ray
        ref = self._remote().remote(argv, env, cwd, timeout_s)
        # The node enforces the harness timeout; this bound also covers waiting for
        # a node with capacity (and a node that vanished without a word).
        bound = timeout_s + self.schedule_timeout_s
        try:
            done = await asyncio.wait_for(asyncio.wrap_future(ref.future()), bound)
        except TimeoutError:
            ray.cancel(ref, force=True)
            return _failed(
                f"ray: no result within {bound:g}s (harness timeout {timeout_s:g}s + "
                f"schedule_timeout_s {self.schedule_timeout_s:g}s): no node offered "
                f"num_cpus={self.num_cpus:g} resources={self.resources} in time, or the "
                "node stopped answering"
            )
        except ray.exceptions.RayError as e:
            return _failed(f"ray: {type(e).__name__}: {_first_line(e)}")
        node = done.pop("node")
        outcome = ProcessOutcome(**done)
        if outcome.error is not None:
            outcome.error = f"{outcome.error} (node {node})"
        return outcome


def _failed(error: str) -> ProcessOutcome:
    return ProcessOutcome("failed", None, "", "", error)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else repr(e)
