"""A run directory for the view's tests: a store written by a real gateway in
front of the fake engine (groups, rewards, a drifted prompt, weight versions,
a rollout still in flight) and a metrics.jsonl as the loop writes it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai

from gateways import start_gateway

GROUPS = {"g0": [1.0, 0.0, 0.5], "g1": [None]}  # g1's rollout stays in flight


class ByteDecoder:
    """The fake engine's byte-level tokenizer (id = byte + 10), as a decoder."""

    def decode(self, ids: list[int]) -> str:
        return bytes(i - 10 for i in ids).decode("utf-8", errors="replace")


def chat(base_url: str, token: str, tag: str, drift: bool) -> None:
    """Two turns; with ``drift`` the harness sends its first answer back edited,
    so the second prompt leaves the first call's path (a split point)."""
    messages: list[Any] = [{"role": "user", "content": f"{tag} [[len:12]]"}]
    with openai.OpenAI(base_url=base_url, api_key=token) as sdk:
        resp = sdk.chat.completions.create(model="m", messages=messages)
        answer = resp.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": answer.upper() if drift else answer})
        messages.append({"role": "user", "content": "again [[len:8]]"})
        sdk.chat.completions.create(model="m", messages=messages)


def metrics_row(step: int) -> dict[str, Any]:
    row: dict[str, Any] = {
        "step": step,
        "reward_mean": 0.2 + 0.1 * step,
        "loss": 1.0 / step,
        "approx_kl": 0.01 * step,
        "entropy": 2.0 - 0.1 * step,
        "trainer_idle_frac": 0.3,
        "engine_idle_frac": 0.1,
        "staleness_mean": 0.5,
    }
    if step % 2 == 0:
        row.update(eval_reward=0.3 + 0.05 * step, eval_ci_low=0.2, eval_ci_high=0.4 + 0.05 * step)
    return row


def append_metrics(run_dir: Path, steps: range) -> None:
    with open(run_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
        for step in steps:
            f.write(json.dumps(metrics_row(step)) + "\n")


def record_run(engine_url: str, run_dir: Path) -> dict[str, list[str]]:
    """Write the store (RUN_DIR/lightning.db) and three steps of metrics; the
    rollout ids per group, in creation order."""
    run_dir.mkdir(parents=True, exist_ok=True)
    ids: dict[str, list[str]] = {}
    with start_gateway(engine_url, run_dir / "lightning.db", weight_version=1) as gw:
        with gw.client() as client:
            for group, rewards in GROUPS.items():
                for k, reward in enumerate(rewards):
                    if group == "g0" and k == 2:  # the last one served by newer weights
                        client.set_upstreams([{"url": engine_url, "weight_version": 2}])
                    r = client.create_rollout({"task": f"{group} task"}, group=group)
                    chat(r.base_url, r.token, f"{group}-{k}", drift=(k == 1))
                    if reward is not None:
                        client.reward(r.id, reward)
                        client.set_status(r.id, "succeeded")
                    ids.setdefault(group, []).append(r.id)
    append_metrics(run_dir, range(1, 4))
    return ids
