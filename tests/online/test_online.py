"""Online mode end to end: a simulated production service behind one application
key (real gateway process, real OpenAI SDK, fake vLLM engine wire), sessions by
explicit id and by token continuity, feedback later / out of order / duplicated /
for unknown ids, a kill -9 of the gateway mid-way, redaction, retention, export,
and ``lightning train --online`` on the tiny model."""

from __future__ import annotations

import json
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import lightning
from fake_vllm import FakeEngine
from gateways import start_gateway, wait_until
from lightning import GatewayClient, GatewayRequestError, LightningError, StoreError, _core
from online_gateway import Gw, db_rows, feedback, new_key

ENGINE = {"name": "O", "unique_ids": True}


def test_application_keys_admin(engine: FakeEngine, tmp_path: Path) -> None:
    gw = Gw(tmp_path / "keys.db", engine.url)
    try:
        with pytest.raises(GatewayRequestError) as bad:
            gw.api.create_app_key("x", mode="prod")  # type: ignore[arg-type]
        assert bad.value.status == 400 and bad.value.code == "invalid_mode"
        with pytest.raises(GatewayRequestError) as anon, GatewayClient(gw.url) as nobody:
            nobody.create_app_key("x")
        assert anon.value.status == 401
        made = gw.api.create_app_key("support-bot", tags=["support"])
        assert made.key is not None and made.key.startswith("lk-")
        assert made.defaults["tags"] == ["support"] and made.revoked is None
        key = made.key
        (listed,) = gw.api.app_keys()
        assert (listed.id, listed.name, listed.key, listed.revoked) == (
            made.id,
            "support-bot",
            None,
            None,
        )
        assert key not in gw.admin("GET", "/admin/keys").text
        with pytest.raises(LightningError, match="shown only when created"):
            listed.openai_env(gw.url)
        # Stored hashed: the key itself is nowhere in the database file.
        assert key.encode() not in (tmp_path / "keys.db").read_bytes()
        client = openai.OpenAI(**_sdk_args(made.openai_env(gw.url)), max_retries=0)
        out = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], temperature=0.3
        )
        assert out.id.startswith("chatcmpl-")
        # The harness's own temperature reached the engine unchanged.
        sent = db_rows(tmp_path / "keys.db", "SELECT request FROM calls")[0][0]
        assert json.loads(sent)["temperature"] == 0.3
        (session,) = gw.api.sessions()
        assert (session.key_id, session.n_calls, session.closed, session.feedback) == (
            made.id,
            1,
            False,
            0,
        )
        assert gw.api.sessions(with_feedback=True) == []
        with pytest.raises(GatewayRequestError) as bad_query:
            gw.api.sessions(limit=0)
        assert (bad_query.value.status, bad_query.value.code) == (400, "invalid_query")
        got = gw.api.feedback(key, "f1", name="thumbs", value=True, response_id=out.id)
        assert (got.session_id, got.value, got.duplicate) == (session.session_id, 1.0, False)
        assert gw.api.feedback(key, "f1", name="thumbs", value=True, response_id=out.id).duplicate
        assert [s.feedback for s in gw.api.sessions(with_feedback=True)] == [1]
        assert gw.api.sweep(idle_timeout_s=0) == {"closed": 1, "deleted": 0}
        assert gw.api.sessions(closed=False) == [] and gw.api.sessions(closed=True)[0].closed
        gw.api.revoke_app_key(made.id)
        assert gw.api.app_keys()[0].revoked is not None
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        with pytest.raises(GatewayRequestError) as gone:
            gw.api.revoke_app_key(made.id)
        assert (gone.value.status, gone.value.code) == (404, "key_not_found")
        client.close()
    finally:
        gw.stop()


def test_feedback_values_must_be_finite_and_in_the_configured_range(
    engine: FakeEngine, tmp_path: Path
) -> None:
    """Issue 26, bug 1: ``value: 1e308`` was accepted and made the next online
    pass's reward statistics infinite. Out of ``[online] feedback_min ..
    feedback_max``, not finite, or not a number: 400 naming the range."""
    gw = Gw(tmp_path / "fb.db", engine.url, online="feedback_min = -10\nfeedback_max = 10")
    try:
        key = new_key(gw, "fb")
        client = openai.OpenAI(
            **_sdk_args({"OPENAI_BASE_URL": gw.url + "/v1", "OPENAI_API_KEY": key}), max_retries=0
        )
        rid = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        ).id
        client.close()
        target = {"response_id": rid, "name": "thumbs"}
        for i, value in enumerate([1e308, -1e308, 10.5, -11, "NaN", "1e308"]):
            r = feedback(gw, key, feedback_id=f"bad-{i}", value=value, **target)
            assert r.status_code == 400, (value, r.text)
            assert r.json()["error"]["code"] == "invalid_feedback", r.text
            if not isinstance(value, str):
                assert "[-10, 10]" in r.json()["error"]["message"], r.text
        # Not JSON numbers at all (Python's json writes these), or past f64.
        for raw in ['{"value": NaN', '{"value": Infinity', '{"value": 1e309']:
            body = raw + f', "feedback_id": "raw", "response_id": "{rid}", "name": "n"}}'
            headers = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
            r = httpx.post(gw.url + "/v1/feedback", content=body, headers=headers, timeout=30)
            assert r.status_code == 400, (raw, r.text)
        assert db_rows(tmp_path / "fb.db", "SELECT COUNT(*) FROM feedback") == [(0,)]
        for i, value in enumerate([10, -10, 0.25, True]):
            r = feedback(gw, key, feedback_id=f"ok-{i}", value=value, **target)
            assert r.status_code == 200, r.text
        assert sorted(v for (v,) in db_rows(tmp_path / "fb.db", "SELECT value FROM feedback")) == [
            -10.0, 0.25, 1.0, 10.0,
        ]  # fmt: skip
    finally:
        gw.stop()
    # The default range is -1e6..1e6; a bad range is refused at start.
    with pytest.raises(ValueError, match="feedback_min"):
        lightning.GatewayConfig(online={"feedback_min": 1, "feedback_max": 0})


def test_mark_trained_is_refused_while_a_gateway_writes_the_store(
    engine: FakeEngine, tmp_path: Path
) -> None:
    """One writer per store file: online mode's ``mark_trained`` without a
    gateway URL opens the store's own writer, which must not run beside a
    gateway's; it fails at once and says how to mark through the gateway."""
    db = tmp_path / "gw.db"
    handle = start_gateway(engine.url, db)
    try:
        with pytest.raises(StoreError, match="gateway = URL") as held:
            _core.mark_trained(str(db), ["ro-x"], 1.0)
        assert str(db) in str(held.value)
        # A second gateway on the same file is refused too.
        with pytest.raises(StoreError, match="already has a writer"):
            start_gateway(engine.url, db)
        # Reading needs no lock.
        assert lightning.Store(db).rollouts() == []
    finally:
        handle.stop()
    assert _core.mark_trained(str(db), ["ro-x"], 1.0) == 0
    start_gateway(engine.url, db).stop()


def _sdk_args(env: dict[str, str]) -> dict[str, str]:
    return {"base_url": env["OPENAI_BASE_URL"], "api_key": env["OPENAI_API_KEY"]}


def converse(client: openai.OpenAI, user: int, turns: range, history: list[dict[str, Any]],
             session: str | None, stream: bool) -> list[str]:  # fmt: skip
    """Runs the given turns of one user's conversation; returns the acknowledged response ids."""
    ids = []
    headers = {"x-session-id": session} if session else {}
    for t in turns:
        history.append({"role": "user", "content": f"user {user} turn {t}: [[len:{12 + user}]]"})
        if stream:
            text, rid = "", ""
            for chunk in client.chat.completions.create(
                model="m", messages=history, stream=True, extra_headers=headers
            ):
                rid = chunk.id
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
        else:
            out = client.chat.completions.create(model="m", messages=history, extra_headers=headers)
            text, rid = out.choices[0].message.content or "", out.id
        history.append({"role": "assistant", "content": text})
        ids.append(rid)
    return ids


def test_production_service_sessions_feedback_and_kill9(engine: FakeEngine, tmp_path: Path) -> None:
    db = tmp_path / "prod.db"
    gw = Gw(db, engine.url, "idle_timeout_s = 600\nsweep_interval_s = 3600")
    key = new_key(gw, "prod")
    n_users = 12
    histories: list[list[dict[str, Any]]] = [
        [{"role": "system", "content": f"You help customer {u}."}] for u in range(n_users)
    ]
    explicit = {u: f"conv-{u}" for u in range(0, n_users, 2)}  # odd users: continuity only
    acked: dict[int, list[str]] = {u: [] for u in range(n_users)}

    def phase(turns: range, url: str) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)

        def run(u: int) -> None:
            acked[u] += converse(client, u, turns, histories[u], explicit.get(u), stream=u % 3 == 0)

        with ThreadPoolExecutor(n_users) as pool:
            list(pool.map(run, range(n_users)))

    phase(range(2), gw.url)
    # Many calls of one session at once: one session, every call in it.
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)

    def burst(i: int) -> str:
        return client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"burst {i}"}],
            extra_headers={"x-session-id": "burst"},
        ).id  # fmt: skip

    with ThreadPoolExecutor(16) as pool:
        burst_ids = list(pool.map(burst, range(16)))
    # Feedback before the crash, for the first turn of every user.
    fb_acked: dict[str, tuple[str, float]] = {}
    for u in range(n_users):
        r = feedback(
            gw, key, feedback_id=f"pre-{u}", response_id=acked[u][0], name="thumbs", value=1
        )
        assert r.status_code == 200, r.text
        fb_acked[f"pre-{u}"] = (acked[u][0], 1.0)

    # kill -9 with traffic in flight: whatever was acknowledged must survive.
    stop = threading.Event()
    inflight_acked: list[str] = []

    def hammer() -> None:
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=5)
        i = 0
        while not stop.is_set():
            i += 1
            try:
                inflight_acked.append(
                    c.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": f"crash {i}"}]
                    ).id
                )
            except openai.OpenAIError:
                pass

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    # Kill once traffic has been acknowledged (however slow the machine), with
    # more still in flight.
    wait_until(lambda: inflight_acked, "acknowledged traffic", timeout=60, every=0.05)
    time.sleep(0.2)
    gw.kill9()
    stop.set()
    for t in threads:
        t.join()
    assert inflight_acked, "no traffic was acknowledged before the kill"

    gw = Gw(db, engine.url, "idle_timeout_s = 600\nsweep_interval_s = 3600", port=gw.port)
    try:
        phase(range(2, 3), gw.url)
        stored = {r[0]: r[1] for r in db_rows(db, "SELECT response_id, rollout_id FROM calls")}
        for rid in inflight_acked + burst_ids:
            assert rid in stored, f"acknowledged call {rid} lost by kill -9"
        # Sessions as the client intended: one per user (explicit or by continuity),
        # across the restart, and one for the burst.
        sessions = {}
        for u in range(n_users):
            owners = {stored[r] for r in acked[u]}
            assert len(acked[u]) == 3 and len(owners) == 1, (u, owners)
            sessions[u] = owners.pop()
        assert len(set(sessions.values())) == n_users
        assert len({stored[r] for r in burst_ids}) == 1
        burst_session = stored[burst_ids[0]]
        assert db_rows(
            db, "SELECT n_calls FROM online_sessions WHERE rollout_id = ?", burst_session
        ) == [(16,)]
        assert db_rows(db, "SELECT origin, status FROM rollouts WHERE id = ?", sessions[0]) == [
            ("online", "running")
        ]

        # Feedback later, out of order, duplicated, and some for unknown ids.
        posts: list[dict[str, Any]] = []
        for u in range(n_users // 2):  # only half the users give feedback
            value = 1.0 if u % 2 == 0 else -1.0
            posts.append(
                {
                    "feedback_id": f"late-{u}",
                    "response_id": acked[u][2],
                    "name": "thumbs",
                    "value": value,
                }
            )
        posts.append(
            {"feedback_id": "sess-1", "session_id": "conv-2", "name": "task_success", "value": True}
        )
        dupes = [dict(p) for p in posts[:3]]
        unknown = [{"feedback_id": f"nope-{i}", "response_id": f"chatcmpl-nope{i}", "name": "thumbs", "value": 1}
                   for i in range(3)]  # fmt: skip
        batch = posts + dupes + unknown
        random.Random(0).shuffle(batch)
        results = []
        for body in batch:
            r = feedback(gw, key, **body)
            results.append((body, r))
        for body, r in results:
            if body["feedback_id"].startswith("nope"):
                assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_target", (
                    r.text
                )
            else:
                assert r.status_code == 200, r.text
                fb_acked[body["feedback_id"]] = (
                    body.get("response_id") or "",
                    float(body["value"]),
                )
        assert (
            sum(r.json().get("duplicate", False) for _, r in results if r.status_code == 200) == 3
        )
        reused = feedback(
            gw, key, feedback_id="late-0", response_id=acked[0][2], name="thumbs", value=0
        )
        assert reused.status_code == 409
        assert (
            feedback(gw, key, feedback_id="x", response_id=acked[0][2], name="thumbs").status_code
            == 400
        )
        # Every acknowledged signal is stored once, on the right session, and as an event.
        rows = db_rows(db, "SELECT feedback_id, rollout_id, value FROM feedback")
        assert {r[0] for r in rows} == set(fb_acked)
        for fid, rid, value in rows:
            resp = fb_acked[fid][0]
            if resp:
                assert stored[resp] == rid
            assert value == fb_acked[fid][1]
        assert db_rows(db, "SELECT COUNT(*) FROM events WHERE type = 'feedback'") == [
            (len(fb_acked),)
        ]
        with_feedback = {rid for _, rid, _ in rows}
        assert with_feedback == {sessions[u] for u in range(n_users)}
        (tmp_path / "prod.json").write_text(
            json.dumps({"key": key, "sessions": sessions, "port": gw.port})
        )
    finally:
        gw.stop()


def test_continuity_window_and_idle_close(engine: FakeEngine, tmp_path: Path) -> None:
    db = tmp_path / "idle.db"
    gw = Gw(db, engine.url, "idle_timeout_s = 1.0\nsweep_interval_s = 0.2")
    try:
        key = new_key(gw, "idle")
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        hist: list[dict[str, Any]] = [{"role": "system", "content": "s"}]
        first = converse(client, 1, range(1), hist, None, stream=False)
        time.sleep(2.0)  # the sweep closes the session
        second = converse(client, 1, range(1, 2), hist, None, stream=False)
        owner = dict(db_rows(db, "SELECT response_id, rollout_id FROM calls"))
        assert owner[first[0]] != owner[second[0]]
        assert db_rows(db, "SELECT status FROM rollouts WHERE id = ?", owner[first[0]]) == [
            ("succeeded",)
        ]
        assert db_rows(
            db, "SELECT closed FROM online_sessions WHERE rollout_id = ?", owner[first[0]]
        ) == [(1,)]
    finally:
        gw.stop()


def test_redaction_retention_export(engine: FakeEngine, tmp_path: Path) -> None:
    from lightning.online.export import export_sessions

    db = tmp_path / "priv.db"
    gw = Gw(
        db, engine.url, "idle_timeout_s = 600\nsweep_interval_s = 3600\nretention_days = 0.00002"
    )
    try:
        secret = new_key(gw, "secret", redact=True)
        plain = new_key(gw, "plain")
        ids = {}
        for name, key in (("secret", secret), ("plain", plain)):
            with openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0) as c:
                out = c.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": f"my password is hunter2 {name}"}],
                )
            ids[name] = out.id
            assert (
                feedback(
                    gw, key, feedback_id="f", response_id=out.id, name="thumbs", value=1
                ).status_code
                == 200
            )
        rows = dict(
            db_rows(
                db,
                "SELECT response_id, request || COALESCE(harness_request, '') || COALESCE(text, '') FROM calls",
            )
        )
        assert "hunter2" not in rows[ids["secret"]] and "hunter2" in rows[ids["plain"]]
        assert (db_rows(db, "SELECT LENGTH(prompt_ids) > 0, LENGTH(completion_ids) > 0 FROM calls "
                            "WHERE response_id = ?", ids["secret"]) == [(1, 1)])  # fmt: skip
        done = export_sessions(str(db), tmp_path / "out.jsonl")
        assert (done.sessions, done.redacted_sessions, done.skipped) == (2, 1, [])
        lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
        assert {x["app_key"] for x in lines} == {"secret", "plain"}
        for x in lines:
            assert x["reward"] == 1.0
            call = x["calls"][0]
            if x["app_key"] == "plain":
                assert x["messages"][0]["content"].startswith("my password")
                assert x["messages"][-1]["role"] == "assistant"
                assert call["prompt_ids"] and call["completion_ids"] and not x["redacted"]
            else:  # no text, and no ids that decode to it unless asked for
                assert x["messages"] == [] and call["text"] is None and x["redacted"]
                assert call["prompt_ids"] is None and call["completion_ids"] is None
        # Issue 39: the files are private whatever the umask, an old 0644 file too.
        (tmp_path / "ids.jsonl").write_text("")
        (tmp_path / "ids.jsonl").chmod(0o644)
        old_umask = os.umask(0o022)
        try:
            export_sessions(str(db), tmp_path / "ids.jsonl", with_ids=True)
        finally:
            os.umask(old_umask)
        for name in ("out.jsonl", "ids.jsonl"):
            assert (tmp_path / name).stat().st_mode & 0o777 == 0o600, name
        for x in map(json.loads, (tmp_path / "ids.jsonl").read_text().splitlines()):
            assert x["calls"][0]["prompt_ids"] and x["calls"][0]["completion_ids"]
        # Retention: ~1.7 s. Open sessions are never deleted; closed, expired ones are.
        time.sleep(2.0)
        assert gw.admin("POST", "/admin/online/sweep").json() == {"closed": 0, "deleted": 0}
        swept = gw.admin("POST", "/admin/online/sweep", {"idle_timeout_s": 0}).json()
        assert swept == {"closed": 2, "deleted": 2}
        for table in ("calls", "feedback", "events", "online_sessions", "rollouts"):
            assert db_rows(db, f"SELECT COUNT(*) FROM {table}") == [(0,)], table
    finally:
        gw.stop()


def test_retention_bytes_keeps_newest(engine: FakeEngine, tmp_path: Path) -> None:
    db = tmp_path / "bytes.db"
    gw = Gw(db, engine.url, "sweep_interval_s = 3600\nretention_bytes = 3000")
    try:
        key = new_key(gw, "b")
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        order = []
        for i in range(6):
            out = c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"q{i} [[len:100]]"}]
            )
            order.append(out.id)
        swept = gw.admin("POST", "/admin/online/sweep", {"idle_timeout_s": 0}).json()
        assert swept["closed"] == 6 and 0 < swept["deleted"] < 6
        left = {r[0] for r in db_rows(db, "SELECT response_id FROM calls")}
        assert left == set(order[swept["deleted"] :])  # the oldest went first
    finally:
        gw.stop()
