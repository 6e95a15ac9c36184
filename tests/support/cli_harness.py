"""What the real-CLI harness tests (Codex CLI, Claude Code) share.

A scripted fake vLLM engine behind a gateway, the check that every call the CLI
made is in the store with the engine's exact ids and logprobs and merges into one
sample, and the `lightning train` config for two steps on the tiny model with the
CLI's example harness (examples/codex_agent.py, examples/claude_agent.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

import lightning
from fake_vllm import FakeEngine
from gateways import start_gateway
from lightning.config import RunConfig
from lightning.engine.tools import CHATML_TOOLS_TEMPLATE
from lightning.model_cache import tiny_model_dir

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@contextmanager
def scripted_gateway(
    name: str, script: list[dict[str, Any]], db: Path
) -> Iterator[tuple[FakeEngine, lightning.GatewayHandle]]:
    """A fake engine answering with ``script``, and a gateway in front of it."""
    engine = FakeEngine(name, script=script)
    try:
        handle = start_gateway(engine.url, db)
        try:
            yield engine, handle
        finally:
            handle.stop()
    finally:
        engine.stop()


def assert_recorded_exactly(
    client: lightning.GatewayClient, rollout_id: str, engine: FakeEngine, finish: list[str]
) -> lightning.MergeResult:
    """Every call is in the store with the engine's exact ids and logprobs, and the
    rollout (each prompt extends the last call) merges into one sample."""
    answers = engine.log()["answers"]
    records = client.records(rollout_id)
    assert len(answers) == len(records) == len(finish)
    for rec, answer in zip(records, answers, strict=True):
        (choice,) = answer["choices"]
        np.testing.assert_array_equal(rec.prompt_ids, answer["prompt_ids"][0])
        np.testing.assert_array_equal(rec.completion_ids, choice["ids"])
        np.testing.assert_array_equal(rec.logprobs, np.asarray(choice["logprobs"], np.float32))
        assert rec.status == "ok" and rec.delivered
    assert [r.finish_reason for r in records] == finish
    merged = lightning.merge_calls(client.trace(rollout_id))
    (sample,) = merged.samples
    assert sample.rollout_id == rollout_id
    full = np.concatenate([records[-1].prompt_ids, records[-1].completion_ids])
    np.testing.assert_array_equal(np.asarray(sample.tokens), full)
    return merged


def two_tiny_steps(
    out: Path, tasks: Path, *, context: int, agent: str, rollouts: int, extra: dict[str, Any]
) -> RunConfig:
    """Two steps of `lightning train` with ``examples/<agent>`` as a process harness,
    ``rollouts`` rollouts of one task per step, against the embedded engine serving the
    tiny model (random weights, made to end its answers after ~40 tokens) with the
    ChatML tool template and a ``context`` that holds the CLI's prompt."""
    overrides: dict[str, Any] = {
        "model.builtin": None,
        "model.path": str(tiny_model_dir(context=context, answer_tokens=40)),
        "engine.max_batch": rollouts,
        "engine.chat_template": str(CHATML_TOOLS_TEMPLATE),
        "engine.max_model_len": context,
        "harness.callable": None,
        "harness.command": ["{python}", str(EXAMPLES / agent)],
        "harness.concurrency": rollouts,
        "harness.timeout_s": 900,
        "reward.source": "stdout",
        "steps": 2,
        "eval_every": 0,
        "checkpoint_every": 0,
        "output_dir": str(out),
        "tasks.train": str(tasks),
        "tasks.eval": None,
        "algorithm.group_size": rollouts,
        "algorithm.tasks_per_step": 1,
        "algorithm.eval_samples": 1,
        "trainer.lr": 1e-3,
    }
    return RunConfig.load(EXAMPLES / "demo.toml", {**overrides, **extra})
