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


def record_online(engine: Any, db: Path) -> dict[str, Any]:
    """A store written by a real gateway process in online mode: two application
    keys, three sessions by ``x-session-id``, feedback posted to ``/v1/feedback``,
    one session marked trained, one call that failed upstream. ``conv-1`` speaks
    all three protocols in one session (chat, Responses, Anthropic Messages).
    Returns the session ids (by session key), the response ids of ``conv-1``
    and the key ids."""
    import anthropic

    from lightning.online.sessions import mark_trained
    from online_gateway import ADMIN, Gw, new_key

    gw = Gw(db, engine.url, "idle_timeout_s = 600\nsweep_interval_s = 3600")
    try:
        support = new_key(gw, "support-bot", tags=["support"])
        other = new_key(gw, "other-bot")
        conv1 = {"x-session-id": "conv-1"}
        with openai.OpenAI(base_url=gw.url + "/v1", api_key=support, max_retries=0) as oa:
            history: list[Any] = [{"role": "user", "content": "first question [[len:6]]"}]
            chat_out = oa.chat.completions.create(model="m", messages=history, extra_headers=conv1)
            history.append({"role": "assistant", "content": chat_out.choices[0].message.content})
            history.append({"role": "user", "content": "second, via responses [[len:5]]"})
            resp_out = oa.responses.create(model="m", input=history, extra_headers=conv1)
            history.append({"role": "assistant", "content": resp_out.output_text})
            history.append({"role": "user", "content": "third, via messages [[len:4]]"})
            with anthropic.Anthropic(base_url=gw.url, api_key=support, max_retries=0) as an:
                msg_out = an.messages.create(
                    model="m", max_tokens=64, messages=history, extra_headers=conv1
                )
            oa.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "another user [[len:3]]"}],
                extra_headers={"x-session-id": "conv-3"},
            )
        with openai.OpenAI(base_url=gw.url + "/v1", api_key=other, max_retries=0) as oa:
            oa.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "other key [[len:3]]"}],
                extra_headers={"x-session-id": "conv-2"},
            )
            engine.control(break_stream_after=2)  # the next stream fails upstream
            try:
                for _ in oa.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": "breaks [[len:9]]"}],
                    stream=True,
                    extra_headers={"x-session-id": "conv-2"},
                ):
                    pass
            except openai.APIError:
                pass
            engine.control()
        gw.api.feedback(support, "f1", name="thumbs", value=True, response_id=resp_out.id)
        gw.api.feedback(support, "f2", name="rating", value=0.5, session_id="conv-1")
        gw.api.feedback(support, "f3", name="thumbs", value=False, session_id="conv-3")
        sessions = {s.session_key: s.session_id for s in gw.api.sessions()}
        mark_trained(str(db), [sessions["conv-3"]], gateway=gw.url, admin_key=ADMIN)
        keys = {k.name: k.id for k in gw.api.app_keys()}
    finally:
        gw.stop()
    return {
        "sessions": sessions,
        "responses": [chat_out.id, resp_out.id, msg_out.id],
        "keys": keys,
    }
