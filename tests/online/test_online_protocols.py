"""Online mode on the other protocols the gateway serves: a deployed harness with an
application key talks the OpenAI Responses API (real ``openai`` SDK,
``responses.create`` streamed and not) and Anthropic Messages (real ``anthropic``
SDK, ``messages.create`` and ``messages.stream``) through ``/v1/...``.

Asserted for each protocol: calls group into sessions by ``x-session-id`` and by
token continuity (a harness resending its whole history), the ids the client was
given (``resp_…``, ``msg_…``) take ``POST /v1/feedback`` (an unknown one is a 404),
and ``lightning online export`` writes those sessions with the ids, token ids,
messages and rewards."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from fake_vllm import FakeEngine
from gateways import wait_until
from lightning import GatewayClient, GatewayRequestError
from online_gateway import Gw, db_rows, feedback, new_key

ENGINE = {"name": "P", "unique_ids": True}


@pytest.fixture
def gw(engine: FakeEngine, tmp_path: Path) -> Iterator[Gw]:
    g = Gw(tmp_path / "proto.db", engine.url, "idle_timeout_s = 600\nsweep_interval_s = 3600")
    yield g
    g.stop()


@pytest.fixture
def sdks(gw: Gw) -> Iterator[Callable[[str], tuple[openai.OpenAI, anthropic.Anthropic]]]:
    """Both SDKs for an application key, pointed at the gateway; closed after the test."""
    made: list[openai.OpenAI | anthropic.Anthropic] = []

    def make(key: str) -> tuple[openai.OpenAI, anthropic.Anthropic]:
        oa = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        an = anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0)
        made.extend((oa, an))
        return oa, an

    yield make
    for c in made:
        c.close()


# A turn: (history so far, session header or None) -> (response id, assistant text).
Turn = Callable[[list[dict[str, Any]], str | None], tuple[str, str]]


def responses_turn(client: openai.OpenAI, stream: bool) -> Turn:
    def turn(history: list[dict[str, Any]], session: str | None) -> tuple[str, str]:
        headers = {"x-session-id": session} if session else {}
        if not stream:
            out = client.responses.create(
                model="m", instructions="Be brief.", input=history, extra_headers=headers
            )
            return out.id, out.output_text
        done = None
        deltas = ""
        for ev in client.responses.create(
            model="m", instructions="Be brief.", input=history, stream=True, extra_headers=headers
        ):
            if ev.type == "response.output_text.delta":
                deltas += ev.delta
            elif ev.type == "response.completed":
                done = ev.response
        assert done is not None, "stream ended without response.completed"
        assert done.output_text == deltas
        return done.id, deltas

    return turn


def messages_turn(client: anthropic.Anthropic, stream: bool) -> Turn:
    def turn(history: list[dict[str, Any]], session: str | None) -> tuple[str, str]:
        headers = {"x-session-id": session} if session else {}
        kw: dict[str, Any] = dict(
            model="m", max_tokens=256, system="Be brief.", messages=history, extra_headers=headers
        )
        if stream:
            with client.messages.stream(**kw) as s:
                text = "".join(s.text_stream)
                msg = s.get_final_message()
        else:
            msg = client.messages.create(**kw)
            text = ""
        full = "".join(b.text for b in msg.content if b.type == "text")
        if stream:
            assert full == text
        return msg.id, full

    return turn


def chat_turn(client: openai.OpenAI, stream: bool) -> Turn:
    def turn(history: list[dict[str, Any]], session: str | None) -> tuple[str, str]:
        headers = {"x-session-id": session} if session else {}
        msgs = [{"role": "system", "content": "Be brief."}, *history]
        if not stream:
            out = client.chat.completions.create(model="m", messages=msgs, extra_headers=headers)  # type: ignore[arg-type]
            return out.id, out.choices[0].message.content or ""
        rid, text = "", ""
        for chunk in client.chat.completions.create(
            model="m",
            messages=msgs,
            stream=True,
            extra_headers=headers,
        ):
            rid = chunk.id
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
        return rid, text

    return turn


PROTOCOLS = ("chat", "responses", "messages")
PREFIX = {"chat": "chatcmpl-", "responses": "resp_", "messages": "msg_"}


def turn_for(protocol: str, oa: openai.OpenAI, an: anthropic.Anthropic, stream: bool) -> Turn:
    """One user turn over ``protocol`` with the SDK clients of an application key."""
    if protocol == "chat":
        return chat_turn(oa, stream)
    return responses_turn(oa, stream) if protocol == "responses" else messages_turn(an, stream)


def conversation(turn: Turn, tag: str, n: int, session: str | None, carry: bool) -> list[str]:
    """``n`` turns of one user. ``carry``: resend the whole history (continuity);
    else each turn is a fresh prompt (only the session header can join them)."""
    history: list[dict[str, Any]] = []
    ids = []
    for t in range(n):
        if not carry:
            history = []
        history.append({"role": "user", "content": f"{tag} turn {t} [[len:{10 + t}]]"})
        rid, text = turn(history, session)
        assert text, "empty answer"
        history.append({"role": "assistant", "content": text})
        ids.append(rid)
    return ids


def export_run(db: Path, out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """``lightning online export`` as a user runs it."""
    cli = [sys.executable, "-m", "lightning.cli", "online", "export", "--db", str(db), "--out", str(out), *flags]  # fmt: skip
    res = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return res


def strict_lines(path: Path) -> list[dict[str, Any]]:
    """JSONL lines, refusing ``Infinity``/``NaN`` (not JSON)."""

    def refuse(c: str) -> None:
        raise AssertionError(f"{path} holds {c}, which is not JSON")

    return [json.loads(x, parse_constant=refuse) for x in path.read_text().splitlines()]


def export(db: Path, out: Path, *flags: str) -> dict[str, dict[str, Any]]:
    """``lightning online export``; lines keyed by session."""
    export_run(db, out, *flags)
    return {x["session_id"]: x for x in strict_lines(out)}


def check_protocol(
    gw: Gw, key: str, tmp_path: Path, turn: Turn, prefix: str, protocol: str
) -> None:
    db = tmp_path / "proto.db"
    explicit_a = conversation(turn, "alice", 3, "conv-a", carry=False)
    explicit_b = conversation(turn, "bob", 2, "conv-b", carry=False)
    carried = conversation(turn, "carol", 3, None, carry=True)
    lone = conversation(turn, "dave", 1, None, carry=False)
    everyone = explicit_a + explicit_b + carried + lone
    assert all(r.startswith(prefix) for r in everyone), everyone
    assert len(set(everyone)) == len(everyone)

    owner = dict(db_rows(db, "SELECT response_id, rollout_id FROM calls"))
    assert set(owner) == set(everyone)
    sessions = []
    for ids in (explicit_a, explicit_b, carried, lone):
        owners = {owner[r] for r in ids}
        assert len(owners) == 1, (ids, owners)
        sessions.append(owners.pop())
    assert len(set(sessions)) == 4, "distinct conversations shared a session"
    for rid, n in zip(sessions, (3, 2, 3, 1), strict=True):
        assert db_rows(db, "SELECT n_calls FROM online_sessions WHERE rollout_id = ?", rid) == [
            (n,)
        ]
        assert db_rows(db, "SELECT origin FROM rollouts WHERE id = ?", rid) == [("online",)]
    assert {p for (p,) in db_rows(db, "SELECT DISTINCT protocol FROM calls")} == {protocol}
    assert db_rows(
        db, "SELECT session_key FROM online_sessions WHERE rollout_id = ?", sessions[0]
    ) == [("conv-a",)]

    # Feedback on the ids the client got; one duplicated, one unknown.
    fb = {explicit_a[1]: 1.0, carried[2]: -1.0, lone[0]: 0.5}
    for i, (rid, v) in enumerate(fb.items()):
        r = feedback(gw, key, feedback_id=f"f{i}", response_id=rid, name="thumbs", value=v)
        assert r.status_code == 200, r.text
    again = feedback(gw, key, feedback_id="f0", response_id=explicit_a[1], name="thumbs", value=1)
    assert again.status_code == 200 and again.json().get("duplicate") is True, again.text
    unknown = feedback(
        gw, key, feedback_id="nope", response_id=f"{prefix}nope0", name="thumbs", value=1
    )
    assert unknown.status_code == 404, unknown.text
    assert unknown.json()["error"]["code"] == "unknown_target"
    assert sorted(db_rows(db, "SELECT response_id, rollout_id, value FROM feedback")) == sorted(
        (rid, owner[rid], v) for rid, v in fb.items()
    )

    lines = export(db, tmp_path / "out.jsonl")
    assert set(lines) == set(sessions)
    for rid, ids in zip(sessions, (explicit_a, explicit_b, carried, lone), strict=True):
        x = lines[rid]
        assert [c["response_id"] for c in x["calls"]] == ids
        assert all(c["protocol"] == protocol for c in x["calls"])
        assert all(c["prompt_ids"] and c["completion_ids"] for c in x["calls"])
        # The conversation as the harness last sent it, plus the last answer.
        assert x["messages"], x
        assert x["messages"][-1]["role"] == "assistant" and x["messages"][-1]["content"]
        assert x["messages"][-1]["content"] == x["calls"][-1]["text"]
    carol = lines[sessions[2]]["messages"]
    assert carol[0] == {"role": "system", "content": "Be brief."}
    assert [m["role"] for m in carol[1:]] == ["user", "assistant"] * 3
    assert carol[5]["content"] == "carol turn 2 [[len:12]]"
    assert lines[sessions[0]]["reward"] == 1.0
    assert lines[sessions[2]]["reward"] == -1.0
    assert lines[sessions[3]]["reward"] == 0.5
    assert lines[sessions[1]]["reward"] is None


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_responses_sessions_feedback_export(
    gw: Gw, sdks: Any, tmp_path: Path, stream: bool
) -> None:
    key = new_key(gw, "harness")
    client, _ = sdks(key)
    check_protocol(gw, key, tmp_path, responses_turn(client, stream), "resp_", "openai_responses")


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_messages_sessions_feedback_export(gw: Gw, sdks: Any, tmp_path: Path, stream: bool) -> None:
    key = new_key(gw, "harness")
    _, client = sdks(key)
    check_protocol(gw, key, tmp_path, messages_turn(client, stream), "msg_", "anthropic_messages")


def test_responses_previous_response_id_session_and_export(
    gw: Gw, sdks: Any, tmp_path: Path
) -> None:
    """A harness that lets the server keep state (``previous_response_id``) sends
    only the new turn: the chain is one session, and the export rebuilds the
    whole conversation from it."""
    key = new_key(gw, "harness")
    client, _ = sdks(key)
    first = client.responses.create(model="m", instructions="Be brief.", input="erin turn 0")
    second = client.responses.create(model="m", input="erin turn 1", previous_response_id=first.id)
    other = client.responses.create(model="m", instructions="Be brief.", input="frank turn 0")
    db = tmp_path / "proto.db"
    owner = dict(db_rows(db, "SELECT response_id, rollout_id FROM calls"))
    assert owner[first.id] == owner[second.id] != owner[other.id]
    r = feedback(gw, key, feedback_id="e", response_id=second.id, name="thumbs", value=1)
    assert r.status_code == 200, r.text
    x = export(db, tmp_path / "out.jsonl")[owner[first.id]]
    assert x["reward"] == 1.0
    assert [c["response_id"] for c in x["calls"]] == [first.id, second.id]
    assert x["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "erin turn 0"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "erin turn 1"},
        {"role": "assistant", "content": second.output_text},
    ]


def test_concurrent_sessions_and_user_fields(gw: Gw, sdks: Any, tmp_path: Path) -> None:
    """Many calls of one session at once stay one session on both protocols (the
    header for Messages, Responses' ``metadata.session_id``); a user field
    (Anthropic ``metadata.user_id``) names the user, not the session."""
    key = new_key(gw, "harness")
    oa, an = sdks(key)

    def resp(i: int) -> str:
        return oa.responses.create(
            model="m", input=f"burst r{i}", metadata={"session_id": "burst-r"}
        ).id

    def msg(i: int) -> str:
        return an.messages.create(
            model="m", max_tokens=64, messages=[{"role": "user", "content": f"burst m{i}"}],
            extra_headers={"x-session-id": "burst-m"},
        ).id  # fmt: skip

    with ThreadPoolExecutor(16) as pool:
        r_ids = list(pool.map(resp, range(8)))
        m_ids = list(pool.map(msg, range(8)))
    same_user = [
        an.messages.create(
            model="m", max_tokens=64, messages=[{"role": "user", "content": f"topic {t}"}],
            metadata={"user_id": "u-42"},
        ).id
        for t in ("billing", "shipping")
    ]  # fmt: skip
    db = tmp_path / "proto.db"
    owner = dict(db_rows(db, "SELECT response_id, rollout_id FROM calls"))
    (r_session,) = {owner[i] for i in r_ids}
    (m_session,) = {owner[i] for i in m_ids}
    assert r_session != m_session
    sql = "SELECT session_key, n_calls, user FROM online_sessions WHERE rollout_id = ?"
    assert db_rows(db, sql, r_session) == [("burst-r", 8, None)]
    assert db_rows(db, sql, m_session) == [("burst-m", 8, None)]
    a, b = (owner[i] for i in same_user)
    assert a != b
    assert db_rows(db, sql, a) == [(None, 1, "u-42")]


def test_redacting_key_stores_no_text_on_any_protocol(gw: Gw, sdks: Any, tmp_path: Path) -> None:
    """A ``redact`` key keeps token ids but no text, also not in the Responses
    object the gateway would keep for ``previous_response_id`` (so continuing
    from one is a clear 404: resend the conversation)."""
    key = new_key(gw, "secret", redact=True)
    oa, an = sdks(key)
    first = oa.responses.create(model="m", input="my password is hunter2")
    with pytest.raises(openai.NotFoundError, match="send the whole conversation"):
        oa.responses.create(model="m", input="and?", previous_response_id=first.id)
    with an.messages.stream(
        model="m", max_tokens=64, messages=[{"role": "user", "content": "pin 4321 hunter2"}]
    ) as s:
        msg = s.get_final_message()
    db = tmp_path / "proto.db"
    gw.stop()
    for f in (db, db.with_name(db.name + "-wal")):
        assert not f.exists() or b"hunter2" not in f.read_bytes(), f
    owner = dict(db_rows(db, "SELECT response_id, rollout_id FROM calls"))
    assert set(owner) == {first.id, msg.id}
    # The ids decode to the text redaction removed: the export leaves them out
    # unless asked for, and says so.
    res = export_run(db, tmp_path / "out.jsonl")
    assert "2 redacted (token ids left out unless --with-ids)" in res.stdout
    lines = {x["session_id"]: x for x in strict_lines(tmp_path / "out.jsonl")}
    for rid in (first.id, msg.id):
        x = lines[owner[rid]]
        assert x["redacted"] is True and x["messages"] == [] and x["calls"][0]["text"] is None
        assert x["calls"][0]["prompt_ids"] is None and x["calls"][0]["completion_ids"] is None
    lines = export(db, tmp_path / "ids.jsonl", "--with-ids")
    for rid in (first.id, msg.id):
        x = lines[owner[rid]]
        assert x["messages"] == [] and x["calls"][0]["text"] is None
        assert x["calls"][0]["prompt_ids"] and x["calls"][0]["completion_ids"]


def test_export_skips_and_reports_a_call_it_cannot_read(
    engine: FakeEngine, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A recorded Responses call with ``"input": null`` (answered 200 by
    gateways before the door checked request shapes) made
    ``lightning online export`` die with a TypeError. The export now leaves that
    call out, says which and why (stderr, its summary line, the session's
    ``skipped_calls``) and writes every other call and session. Such stores were
    written whole (layout 1), so this gateway writes every call whole too: the
    row edited below is then the request itself, not its difference from another."""
    db = tmp_path / "proto.db"
    gw = Gw(
        db, engine.url, "idle_timeout_s = 600\nsweep_interval_s = 3600", top='store_layout = "full"'
    )
    request.addfinalizer(gw.stop)
    key = new_key(gw, "harness")
    auth = {"Authorization": f"Bearer {key}"}

    def post(body: dict[str, Any], session: str) -> httpx.Response:
        return httpx.post(gw.url + "/v1/responses", json=body, timeout=30,
                          headers={**auth, "x-session-id": session})  # fmt: skip

    good = post({"model": "m", "instructions": "Be brief.", "input": "hi [[len:6]]"}, "s-odd")
    assert good.status_code == 200, good.text
    refused = post({"model": "m", "instructions": "Be brief.", "input": None}, "s-odd")
    assert refused.status_code == 400, refused.text  # the door refuses it now
    other = post({"model": "m", "input": "fine [[len:6]]"}, "s-fine")
    assert other.status_code == 200, other.text
    # A store written before the door holds such rows: record a call, then make it one.
    odd = post({"model": "m", "input": "later [[len:6]]"}, "s-odd")
    odd_id = odd.json()["id"]
    gw.stop()
    with sqlite3.connect(db) as c:
        c.execute("UPDATE calls SET harness_request = ? WHERE response_id = ?",
                  ('{"model": "m", "instructions": "Be brief.", "input": null}', odd_id))  # fmt: skip
    owner = dict(db_rows(db, "SELECT response_id, rollout_id FROM calls"))
    seq = dict(db_rows(db, "SELECT response_id, seq FROM calls"))
    assert owner[odd_id] == owner[good.json()["id"]] != owner[other.json()["id"]]
    res = export_run(db, tmp_path / "out.jsonl")
    assert "Traceback" not in res.stderr
    assert (
        f"skipped call {seq[odd_id]} of session {owner[odd_id]} (openai_responses): "
        "Responses `input` is null, not a string or a list of items"
    ) in res.stderr
    assert "wrote 2 sessions (2 calls)" in res.stdout
    assert "skipped 1 calls it could not read" in res.stdout
    lines = {x["session_id"]: x for x in strict_lines(tmp_path / "out.jsonl")}
    x = lines[owner[odd_id]]
    assert [c["response_id"] for c in x["calls"]] == [good.json()["id"]]
    assert x["skipped_calls"] == [{"seq": seq[odd_id], "protocol": "openai_responses",
        "reason": "Responses `input` is null, not a string or a list of items"}]  # fmt: skip
    assert x["messages"][:2] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi [[len:6]]"},
    ]
    y = lines[owner[other.json()["id"]]]
    assert y["skipped_calls"] == [] and y["messages"][0] == {
        "role": "user",
        "content": "fine [[len:6]]",
    }


@contextlib.contextmanager
def sdk_clients(url: str, key: str, timeout: float = 30) -> Iterator[tuple[openai.OpenAI, anthropic.Anthropic]]:  # fmt: skip
    oa = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=timeout)
    an = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=timeout)
    try:
        yield oa, an
    finally:
        oa.close()
        an.close()


@pytest.mark.parametrize("protocol", ["responses", "messages"])
def test_kill9_keeps_acknowledged_sessions_and_feedback(
    engine: FakeEngine, tmp_path: Path, protocol: str
) -> None:
    """A kill -9 of the gateway while Responses / Messages traffic (streamed and
    not) and feedback are in flight: every call and signal that was
    acknowledged is in the store after a restart on the same database, and the
    users' conversations continue in their sessions across the restart."""
    db = tmp_path / "crash.db"
    online = "idle_timeout_s = 600\nsweep_interval_s = 3600"
    gw = Gw(db, engine.url, online)
    key = new_key(gw, "prod")
    n_users = 6
    explicit = {u: f"conv-{u}" for u in range(0, n_users, 2)}  # odd users: continuity only
    histories: dict[int, list[dict[str, Any]]] = {u: [] for u in range(n_users)}
    acked: dict[int, list[str]] = {u: [] for u in range(n_users)}

    def phase(turns: int) -> None:
        with sdk_clients(gw.url, key) as (oa, an):

            def run(u: int) -> None:
                turn = turn_for(protocol, oa, an, stream=u % 2 == 1)
                for _ in range(turns):
                    hist = histories[u]
                    hist.append({"role": "user", "content": f"user {u} turn {len(acked[u])} [[len:{8 + u}]]"})  # fmt: skip
                    rid, text = turn(hist, explicit.get(u))
                    hist.append({"role": "assistant", "content": text})
                    acked[u].append(rid)

            with ThreadPoolExecutor(n_users) as pool:
                list(pool.map(run, range(n_users)))

    phase(2)
    fb_acked: dict[str, str] = {}  # feedback id -> response id
    for u in range(n_users):
        gw.api.feedback(key, f"pre-{u}", name="thumbs", value=1, response_id=acked[u][0])
        fb_acked[f"pre-{u}"] = acked[u][0]

    stop = threading.Event()
    crash_calls: list[str] = []
    lock = threading.Lock()

    def calls(t: int) -> None:
        with sdk_clients(gw.url, key, timeout=5) as (oa, an):
            turn = turn_for(protocol, oa, an, stream=t % 2 == 1)
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    rid, _ = turn([{"role": "user", "content": f"crash {t}.{i}"}], None)
                    crash_calls.append(rid)
                except Exception:  # cut by the kill, however the SDK says it
                    pass  # (API error, transport error mid-stream, no final event)

    def signals() -> None:
        with GatewayClient(gw.url, timeout=5) as c:
            i = 0
            while not stop.is_set():
                i += 1
                u = i % n_users
                try:
                    c.feedback(key, f"crash-{i}", name="thumbs", value=1, response_id=acked[u][1])
                    with lock:
                        fb_acked[f"crash-{i}"] = acked[u][1]
                except (GatewayRequestError, httpx.HTTPError):
                    pass

    threads = [threading.Thread(target=calls, args=(t,)) for t in range(3)]
    threads.append(threading.Thread(target=signals))
    for t in threads:
        t.start()
    # Kill once calls and feedback have been acknowledged (however slow the
    # machine), with more still in flight.
    wait_until(
        lambda: crash_calls and len(fb_acked) > n_users,
        "acknowledged calls and feedback",
        timeout=60,
        every=0.05,
    )
    time.sleep(0.2)
    gw.kill9()
    stop.set()
    for t in threads:
        t.join()
    assert crash_calls and len(fb_acked) > n_users, "nothing was acknowledged during the crash"

    gw = Gw(db, engine.url, online, port=gw.port)
    try:
        phase(1)
        owner = dict(db_rows(db, "SELECT response_id, rollout_id FROM calls"))
        lost = [
            r for r in crash_calls + [x for ids in acked.values() for x in ids] if r not in owner
        ]
        assert not lost, f"acknowledged calls lost by kill -9: {lost}"
        sessions = set()
        for u in range(n_users):
            (s,) = {owner[r] for r in acked[u]}  # one session per user, across the restart
            sessions.add(s)
        assert len(sessions) == n_users
        stored = dict(db_rows(db, "SELECT feedback_id, rollout_id FROM feedback"))
        missing = set(fb_acked) - set(stored)
        assert not missing, f"acknowledged feedback lost by kill -9: {sorted(missing)}"
        assert all(stored[f] == owner[r] for f, r in fb_acked.items())
        assert db_rows(db, "SELECT COUNT(*) FROM events WHERE type = 'feedback'") == [
            (len(stored),)
        ]
        rated = {s.session_id for s in gw.api.sessions(with_feedback=True, limit=10_000)}
        assert rated == sessions
        assert {p for (p,) in db_rows(db, "SELECT DISTINCT protocol FROM calls")} == {
            "openai_responses" if protocol == "responses" else "anthropic_messages"
        }
    finally:
        gw.stop()
