"""Builds ``tests/gateway/store_v1/``: a small store written by the gateway's first
layout (every call's prompt ids and request bodies stored whole; no
``schema_version`` in ``meta``), and ``expected.json``, what every read path
returned from it at the time. ``tests/gateway/test_store_layout.py`` opens that file
with today's code and must read the same, then writes new calls into a copy.

Run with the layout-1 gateway built (commit 8097bb9, before the prefix-shared
layout): ``.venv/bin/python tests/gateway/store_v1/make.py``. The fake engine and the
gateway are the tests' own (``tests/support/fake_vllm.py``); no network."""

from __future__ import annotations

import json
import shutil
import sqlite3
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent / "support"))

import lightning  # noqa: E402
from fake_vllm import FakeEngine  # noqa: E402
from gateways import start_gateway  # noqa: E402
from lightning import Store  # noqa: E402


def post(url: str, token: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    r.raise_for_status()
    return dict(r.json())


def chat(r: lightning.Rollout, turns: int, tag: str) -> None:
    """Chat completions: every answer goes back as context of the next call."""
    messages: list[Any] = [
        {"role": "system", "content": "You are terse. " * 3},
        {"role": "user", "content": f"{tag} [[len:5]]"},
    ]
    for t in range(turns):
        a = post(r.base_url + "/chat/completions", r.token, {"model": "m", "messages": messages})
        messages.append({"role": "assistant", "content": a["choices"][0]["message"]["content"]})
        messages.append({"role": "user", "content": f"more {t} [[len:4]]"})
    # An edited history: the first answer rewritten, then one more call.
    messages[2] = {"role": "assistant", "content": "edited"}
    post(r.base_url + "/chat/completions", r.token, {"model": "m", "messages": messages, "n": 2})


def completions(r: lightning.Rollout) -> None:
    prompt = "Once upon a time [[len:6]]"
    for _ in range(3):
        a = post(r.base_url + "/completions", r.token, {"model": "m", "prompt": prompt})
        prompt += a["choices"][0]["text"] + " and then [[len:3]]"


def responses(r: lightning.Rollout) -> None:
    history: list[Any] = [{"role": "user", "content": "Plan it [[len:5]]"}]
    for t in range(3):
        a = post(
            r.base_url + "/responses", r.token, {"model": "m", "input": history, "store": False}
        )
        history.extend(a["output"])
        history.append({"role": "user", "content": f"go on {t} [[len:3]]"})


def anthropic(r: lightning.Rollout) -> None:
    messages: list[Any] = [{"role": "user", "content": "Hello [[len:5]]"}]
    for t in range(3):
        a = post(
            r.anthropic_base_url + "/v1/messages",
            r.token,
            {"model": "m", "max_tokens": 64, "system": "Be terse.", "messages": messages},
        )
        messages.append({"role": "assistant", "content": a["content"]})
        messages.append({"role": "user", "content": f"next {t} [[len:4]]"})


def jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v.tolist() if hasattr(v, "tolist") else v for k, v in d.items()}


def reads(db: Path) -> dict[str, Any]:
    """Every read path's answer for every rollout, as JSON values."""
    out: dict[str, Any] = {}
    with Store(db) as store:
        reader = store._reader
        for rid in store.rollout_ids():
            records = [jsonable(vars(r)) for r in store.records(rid)]
            step = store.step([rid])
            out[rid] = {
                "records": records,
                "call_bodies": [list(b) for b in reader.call_bodies(rid)],
                "trace": [
                    [c.prompt_ids.tolist(), c.completion_ids.tolist(), c.weight_version]
                    for c in store.trace(rid)
                ],
                "samples": [
                    [s.tokens.tolist(), s.weights.tolist(), s.logprobs.tolist()]
                    for s in step.samples
                ],
            }
    with sqlite3.connect(db) as c:
        for rid, seq, request, harness in c.execute(
            "SELECT rollout_id, seq, request, harness_request FROM calls ORDER BY rollout_id, seq"
        ):
            out[rid].setdefault("requests", []).append([seq, request, harness])
    return out


def main() -> None:
    engine = FakeEngine("S")
    tmp = Path(tempfile.mkdtemp())
    db = tmp / "store.db"
    try:
        with start_gateway(engine.url, db) as gw, gw.client() as client:
            for k in range(2):
                chat(client.create_rollout({"task": f"chat-{k}"}, group="g"), 3, f"c{k}")
            completions(client.create_rollout({"task": "completions"}))
            responses(client.create_rollout({"task": "responses"}))
            anthropic(client.create_rollout({"task": "anthropic"}))
            r = client.create_rollout({"task": "reward"})
            chat(r, 1, "rw")
            client.reward(r.id, 0.5)
        with sqlite3.connect(db) as c:
            c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            c.execute("VACUUM")
        expected = reads(db)
        shutil.copy(db, HERE / "store.db")
        (HERE / "expected.json").write_text(json.dumps(expected, sort_keys=True) + "\n")
        print(
            f"wrote {HERE / 'store.db'} ({(HERE / 'store.db').stat().st_size} bytes), {len(expected)} rollouts"
        )
    finally:
        engine.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
