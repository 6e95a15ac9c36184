"""Store layouts: a store written by the first layout (every call whole,
``tests/gateway/store_v1/``, built by its ``make.py``) opens with today's code and
reads the same through every read path; a gateway writing into it adds calls
in the prefix-shared layout, and both kinds of rows read back whole. And a
shared store reads exactly like a ``store_layout="full"`` one on the same
conversations (the property test over random conversations is
``rust/gateway/tests/store_layout.rs``)."""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fake_vllm import FakeEngine
from gateways import start_gateway
from lightning import LightningError, Store

V1 = Path(__file__).parent / "store_v1"


def jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v.tolist() if hasattr(v, "tolist") else v for k, v in d.items()}


def same(a: Any, b: Any) -> bool:
    """Equal as JSON text (NaN logprobs compare equal to NaN)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def reads(db: Path) -> dict[str, Any]:
    """What ``tests/gateway/store_v1/make.py`` recorded, read through today's reader."""
    out: dict[str, Any] = {}
    with Store(db) as store:
        for rid in store.rollout_ids():
            step = store.read_step([rid])
            out[rid] = {
                "records": [jsonable(vars(r)) for r in store.records(rid)],
                "call_bodies": [list(b) for b in store._reader.call_bodies(rid)],
                "trace": [
                    [c.prompt_ids.tolist(), c.completion_ids.tolist(), c.weight_version]
                    for c in store.trace(rid)
                ],
                "samples": [
                    [s.tokens.tolist(), s.weights.tolist(), s.logprobs.tolist()]
                    for s in step.samples
                ],
                "requests": [list(r) for r in store.requests(rid)],
            }
    return out


@pytest.fixture(scope="module")
def engine() -> Iterator[FakeEngine]:
    e = FakeEngine("S")
    yield e
    e.stop()


def test_a_layout_1_store_reads_as_it_did(tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    shutil.copy(V1 / "store.db", db)
    expected = json.loads((V1 / "expected.json").read_text())
    got = reads(db)
    assert got.keys() == expected.keys() and len(got) == 6
    for rid in expected:
        assert same(got[rid], expected[rid]), rid


def post(url: str, token: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    r.raise_for_status()
    return dict(r.json())


def test_new_calls_in_an_old_store_use_the_new_layout(tmp_path: Path, engine: FakeEngine) -> None:
    db = tmp_path / "store.db"
    shutil.copy(V1 / "store.db", db)
    # The fixture's token secret was not kept: a new one (the old rollouts'
    # tokens are revoked; only new calls are made here).
    secret = tmp_path / "store.db.secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    expected = json.loads((V1 / "expected.json").read_text())
    with start_gateway(engine.url, db) as gw, gw.client() as client:
        r = client.create_rollout({"task": "new"})
        messages: list[Any] = [{"role": "system", "content": "Be brief. " * 30}]
        for t in range(4):
            messages.append({"role": "user", "content": f"turn {t} [[len:5]]"})
            a = post(
                r.base_url + "/chat/completions", r.token, {"model": "m", "messages": messages}
            )
            messages.append({"role": "assistant", "content": a["choices"][0]["message"]["content"]})
        trace = client.trace(r.id)
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (2,)
        rows = c.execute(
            "SELECT seq, prompt_base, prompt_shared, length(prompt_ids), text_base, length(request),"
            " length(harness_request) FROM calls WHERE rollout_id = ? ORDER BY seq",
            (r.id,),
        ).fetchall()
        old = c.execute(
            "SELECT COUNT(*) FROM calls WHERE rollout_id != ? AND (prompt_base IS NOT NULL"
            " OR text_base IS NOT NULL)",
            (r.id,),
        ).fetchone()
    assert old == (0,)  # layout-1 rows stay as they were
    # Every call after the first stores what it adds to the one before it.
    assert [row[1] for row in rows] == [None, 0, 1, 2]
    assert [row[4] for row in rows] == [None, 0, 1, 2]
    with Store(db) as store:
        full = [c.prompt_ids.tolist() for c in store.trace(r.id)]
        requests = store.requests(r.id)
    for (seq, _, shared, stored, _, req_len, harness_len), ids, (_, req, harness) in zip(
        rows[1:], full[1:], requests[1:], strict=True
    ):
        assert shared + stored // 4 == len(ids)
        assert stored // 4 < len(ids) / 2, seq
        assert req_len < len(req) / 2 and harness is not None and harness_len < len(harness) / 2
        assert json.loads(req)["messages"][-1]["content"].startswith(f"turn {seq} ")
    assert full == [c.prompt_ids.tolist() for c in trace]
    # The old rollouts still read as they did, next to the new ones.
    got = reads(db)
    for rid in expected:
        assert same(got[rid], expected[rid]), rid


def conversation(base_url: str, token: str, tag: str) -> None:
    """Branching, retries, an edited history and n=2 over chat; completions; Responses; Anthropic."""
    messages: list[Any] = [{"role": "system", "content": "Think. " * 40}]
    for t in range(3):
        messages.append({"role": "user", "content": f"{tag} {t} [[len:5]]"})
        body = {"model": "m", "messages": messages, "n": 2 if t == 1 else 1}
        a = post(base_url + "/chat/completions", token, body)
        if t == 1:
            post(base_url + "/chat/completions", token, body)  # a retry
        messages.append({"role": "assistant", "content": a["choices"][0]["message"]["content"]})
    messages[2]["content"] = "rewritten"
    post(base_url + "/chat/completions", token, {"model": "m", "messages": messages})
    prompt = f"{tag} story [[len:4]]"
    for _ in range(2):
        a = post(base_url + "/completions", token, {"model": "m", "prompt": prompt})
        prompt += a["choices"][0]["text"] + " then [[len:3]]"
    history: list[Any] = [{"role": "user", "content": f"{tag} plan [[len:4]]"}]
    for _ in range(2):
        a = post(base_url + "/responses", token, {"model": "m", "input": history, "store": False})
        history += a["output"] + [{"role": "user", "content": "go [[len:3]]"}]
    msgs: list[Any] = [{"role": "user", "content": f"{tag} hi [[len:4]]"}]
    for _ in range(2):
        a = post(
            base_url.removesuffix("/v1") + "/v1/messages",
            token,
            {"model": "m", "max_tokens": 32, "system": "Brief.", "messages": msgs},
        )
        msgs += [
            {"role": "assistant", "content": a["content"]},
            {"role": "user", "content": "more [[len:3]]"},
        ]


def normalized(got: dict[str, Any]) -> str:
    """Reads as JSON text minus what differs between two runs of the same
    conversation: latencies, timestamps, the upstream's port and the random
    part of request and answer ids."""
    for r in got.values():
        for rec in r["records"]:
            for k in ("latency_ms", "created", "upstream", "rollout_id"):
                rec.pop(k, None)
    text = json.dumps(got, sort_keys=True)
    return re.sub(r"[0-9a-f]{16}", "ID", text)


def test_shared_and_full_layouts_read_the_same(tmp_path: Path, engine: FakeEngine) -> None:
    out = {}
    sizes = {}
    for layout in ("full", "shared"):
        db = tmp_path / f"{layout}.db"
        with start_gateway(engine.url, db, store_layout=layout) as gw, gw.client() as client:
            for k in range(2):
                r = client.create_rollout({"task": k}, rollout_id=f"r{k}")
                conversation(r.base_url, r.token, f"t{k}")
        got = reads(db)
        out[layout] = normalized(got)
        with sqlite3.connect(db) as c:
            sizes[layout] = c.execute(
                "SELECT SUM(length(prompt_ids) + length(request) + COALESCE(length(harness_request), 0))"
                " FROM calls"
            ).fetchone()[0]
    assert out["shared"] == out["full"]
    assert sizes["shared"] < sizes["full"] / 2, sizes


def test_a_store_from_a_newer_layout_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    shutil.copy(V1 / "store.db", db)
    with sqlite3.connect(db) as c:
        c.execute("INSERT INTO meta(key, value) VALUES ('schema_version', 3)")
    with pytest.raises(LightningError, match=r"layout 3.*upgrade lightning"):
        Store(db)
