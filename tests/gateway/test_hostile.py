"""Hostile and careless clients at the gateway's door (issue 26): a real gateway on
loopback in front of the fake vLLM engine.

For each protocol (chat, completions, Responses, Messages) wrong types, null
fields and huge values are answered 400 in that protocol's error shape, at once
(no retry, nothing reaches the engine) and nothing is recorded; the calls
already in the store are untouched. Then the auth and online edge cases: a
case-insensitive ``Bearer``, no rollout-existence oracle, session ids over the
limit, ``GET /v1/responses/{id}`` and ``conversation`` with an application key,
answers that carry only what the client asked for, a reused feedback id, a
trickled body and Claude Code's ``HEAD /`` probe."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import lightning
from fake_vllm import ID_OFFSET, FakeEngine
from gateways import start_gateway
from lightning import GatewayClient

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"


ENGINE = {"name": "hostile", "unique_ids": True}
GATEWAY = {"max_retries": 2, "body_timeout_s": 1.0}


def post(url: str, path: str, token: str, body: Any, **headers: str) -> httpx.Response:
    return httpx.post(
        url + path,
        json=body,
        headers={"Authorization": f"Bearer {token}", **headers},
        timeout=30,
    )


def assert_protocol_error(path: str, r: httpx.Response, status: int) -> str:
    """The error is in ``path``'s protocol shape with ``status``; returns its message."""
    assert r.status_code == status, r.text
    body = r.json()
    if path == MESSAGES:
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert body["error"]["type"] == "invalid_request_error" or status != 400
        return str(body["error"]["message"])
    # Responses errors also carry OpenAI's `param`.
    assert {"message", "type", "code"} <= set(body["error"]) <= {"message", "type", "code", "param"}
    assert body["error"]["type"] == "invalid_request_error" or status != 400
    return str(body["error"]["message"])


GOOD: dict[str, dict[str, Any]] = {
    CHAT: {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    COMPLETIONS: {"model": "m", "prompt": "hi", "max_tokens": 4},
    RESPONSES: {"model": "m", "input": "hi", "max_output_tokens": 4},
    MESSAGES: {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
}

# (path, fields to set on the good body, a word the message must name)
BAD: list[tuple[str, dict[str, Any], str]] = [
    (CHAT, {"messages": "hello"}, "messages"),
    (CHAT, {"messages": None}, "messages"),
    (CHAT, {"messages": [None]}, "messages[0]"),
    (CHAT, {"max_tokens": "ten"}, "max_tokens"),
    (CHAT, {"stream": "yes"}, "stream"),
    (CHAT, {"temperature": "hot"}, "temperature"),
    (CHAT, {"n": 1_000_000}, "max_n"),
    (CHAT, {"max_tokens": 10**12}, "max_output_tokens"),
    (CHAT, {"top_logprobs": 10_000}, "max_top_logprobs"),
    (CHAT, {"n": -1}, "n"),
    (COMPLETIONS, {"prompt": None}, "prompt"),
    (COMPLETIONS, {"prompt": {"text": "x"}}, "prompt"),
    (COMPLETIONS, {"n": 1_000_000}, "max_n"),
    (COMPLETIONS, {"logprobs": 1000}, "max_top_logprobs"),
    (COMPLETIONS, {"stream": 1}, "stream"),
    (RESPONSES, {"instructions": "Be brief.", "input": None}, "input"),
    (RESPONSES, {"input": 7}, "input"),
    (RESPONSES, {"input": ["hi"]}, "input[0]"),
    (RESPONSES, {"max_output_tokens": "ten"}, "max_output_tokens"),
    (RESPONSES, {"max_output_tokens": 10**12}, "max_output_tokens"),
    (RESPONSES, {"stream": "yes"}, "stream"),
    (RESPONSES, {"conversation": 5}, "conversation"),
    (MESSAGES, {"messages": "hello"}, "messages"),
    (MESSAGES, {"max_tokens": "ten"}, "max_tokens"),
    (MESSAGES, {"max_tokens": None}, "max_tokens"),
    (MESSAGES, {"max_tokens": 10**12}, "max_output_tokens"),
    (MESSAGES, {"stream": "yes"}, "stream"),
    (MESSAGES, {"system": 5}, "system"),
]


def test_bad_requests_are_400_in_their_protocol_and_reach_nothing(
    client: GatewayClient, engine: FakeEngine
) -> None:
    r = client.create_rollout()
    url = r.base_url.removesuffix("/v1")
    # One good call per protocol first: the store has calls to keep intact.
    for path, body in GOOD.items():
        ok = post(url, path, r.token, body)
        assert ok.status_code == 200, (path, ok.text)
    before = client.records(r.id)
    assert len(before) == 4
    engine.reset()
    for path, change, named in BAD:
        started = time.monotonic()
        got = post(url, path, r.token, {**GOOD[path], **change})
        message = assert_protocol_error(path, got, 400)
        assert named in message, (path, change, message)
        # Refused at once: no engine attempt, no retries with backoff.
        assert time.monotonic() - started < 2.0, (path, change)
    assert engine.log()["answers"] == []
    after = client.records(r.id)
    assert [(c.seq, c.status, c.completion_ids.tolist()) for c in after] == [
        (c.seq, c.status, c.completion_ids.tolist()) for c in before
    ]
    # Bodies that are not objects, or not JSON at all, are the client's too.
    for path in GOOD:
        assert_protocol_error(path, post(url, path, r.token, [1, 2]), 400)
        raw = httpx.post(
            url + path,
            content=b"{not json",
            headers={"Authorization": f"Bearer {r.token}", "Content-Type": "application/json"},
            timeout=30,
        )
        assert_protocol_error(path, raw, 400)
    assert len(client.records(r.id)) == 4


def test_caps_follow_the_config(engine: FakeEngine, tmp_path: Path) -> None:
    h = start_gateway(engine.url, tmp_path / "caps.db", max_n=2, max_output_tokens=8)
    try:
        with h.client() as c:
            r = c.create_rollout()
            url = r.base_url.removesuffix("/v1")
            assert post(url, CHAT, r.token, {**GOOD[CHAT], "n": 2}).status_code == 200
            over = post(url, CHAT, r.token, {**GOOD[CHAT], "n": 3})
            assert "limit of 2" in assert_protocol_error(CHAT, over, 400)
            over = post(url, MESSAGES, r.token, {**GOOD[MESSAGES], "max_tokens": 9})
            assert "limit of 8" in assert_protocol_error(MESSAGES, over, 400)
            assert len(c.records(r.id)) == 2  # one record per choice of the n = 2 call
    finally:
        h.stop()


def test_auth_edges(client: GatewayClient, gw: lightning.GatewayHandle) -> None:
    r = client.create_rollout()
    url = r.base_url.removesuffix("/v1")
    # The scheme is case-insensitive.
    ok = httpx.post(
        url + CHAT, json=GOOD[CHAT], headers={"Authorization": f"BEARER {r.token}"}, timeout=30
    )
    assert ok.status_code == 200, ok.text
    # A wrong token answers the same for a rollout that exists and one that does not.
    answers = []
    for rid in (r.id, "no-such-rollout"):
        bad = httpx.post(
            f"{gw.url}/rollouts/{rid}/v1/chat/completions",
            json=GOOD[CHAT],
            headers={"Authorization": "Bearer lt-wrong"},
            timeout=30,
        )
        answers.append((bad.status_code, bad.json()["error"]["code"]))
    assert answers[0] == answers[1] == (401, "invalid_api_key")
    # The admin key still learns that a rollout is missing.
    missing = httpx.get(
        f"{gw.url}/rollouts/no-such-rollout/v1/models",
        headers={"Authorization": f"Bearer {client.admin_key}"},
        timeout=30,
    )
    assert missing.status_code == 404


def test_head_probe_is_not_a_routing_error(gw: lightning.GatewayHandle) -> None:
    assert httpx.head(gw.url + "/", timeout=10).status_code == 200
    metrics = httpx.get(gw.url + "/metrics", timeout=10).text
    assert 'code="route_not_found"' not in metrics


def test_a_trickled_body_meets_the_total_deadline(
    client: GatewayClient, gw: lightning.GatewayHandle
) -> None:
    r = client.create_rollout()
    host, port = gw.url.removeprefix("http://").split(":")
    body = json.dumps(GOOD[MESSAGES]).encode()
    head = (
        f"POST /rollouts/{r.id}/v1/messages HTTP/1.1\r\nHost: localhost\r\n"
        f"Authorization: Bearer {r.token}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head)
        started = time.monotonic()
        answer = b""
        # A byte every 0.2 s never trips the idle timeout (60 s), only the total (1 s).
        for b in body:
            try:
                s.sendall(bytes([b]))
            except OSError:
                break
            s.settimeout(0.2)
            try:
                answer = s.recv(65536)
            except TimeoutError:
                continue
            if answer:
                break
        s.settimeout(5)
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            more = s.recv(65536)
            if not more:
                break
            answer += more
    assert time.monotonic() - started < 10
    status_line, _, rest = answer.partition(b"\r\n")
    assert b" 408 " in status_line, answer
    payload = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert payload["type"] == "error" and "body_timeout_s" in payload["error"]["message"]
    assert client.records(r.id) == []


# ------------------------------------------------------------------ online mode


def app_key(client: GatewayClient) -> str:
    key = client.create_app_key("hostile").key
    assert key is not None
    return key


def sessions(gw: lightning.GatewayHandle, client: GatewayClient) -> list[dict[str, Any]]:
    r = httpx.get(
        gw.url + "/admin/online/sessions",
        headers={"Authorization": f"Bearer {client.admin_key}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return list(r.json()["sessions"])


def test_online_answers_carry_only_what_was_asked(
    client: GatewayClient, gw: lightning.GatewayHandle
) -> None:
    key = app_key(client)
    plain = post(gw.url, CHAT, key, GOOD[CHAT]).json()
    assert "prompt_token_ids" not in plain and "kv_transfer_params" not in plain
    assert all("token_ids" not in c and "logprobs" not in c for c in plain["choices"])
    asked = post(gw.url, CHAT, key, {**GOOD[CHAT], "logprobs": True}).json()
    assert asked["choices"][0]["logprobs"]["content"]
    assert "prompt_token_ids" not in asked
    done = httpx.post(
        gw.url + COMPLETIONS,
        json={**GOOD[COMPLETIONS], "stream": True},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert done.status_code == 200 and "data: [DONE]" in done.text
    assert "token_ids" not in done.text and "logprobs" not in done.text
    # ... and the store still has every id and logprob.
    rows = sessions(gw, client)
    assert sum(s["n_calls"] for s in rows) == 3
    for s in rows:
        for rec in client.records(s["session_id"]):
            assert len(rec.completion_ids) > 0 and len(rec.prompt_ids) > 0


def test_online_wording_and_session_id_limit(
    client: GatewayClient, gw: lightning.GatewayHandle
) -> None:
    key = app_key(client)
    nokey = httpx.post(gw.url + CHAT, json=GOOD[CHAT], timeout=30)
    assert nokey.status_code == 401 and "application key" in nokey.json()["error"]["message"]
    long = post(gw.url, CHAT, key, GOOD[CHAT], **{"x-session-id": "s" * 257})
    message = assert_protocol_error(CHAT, long, 400)
    assert "256" in message and "x-session-id" in message
    fine = post(gw.url, CHAT, key, GOOD[CHAT], **{"x-session-id": "s" * 256})
    assert fine.status_code == 200
    assert [s["session_key"] for s in sessions(gw, client)] == ["s" * 256]


def test_responses_get_and_conversation_with_an_application_key(
    client: GatewayClient, gw: lightning.GatewayHandle, engine: FakeEngine
) -> None:
    key = app_key(client)
    oa = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    try:
        first = oa.responses.create(model="m", input="Hello there", conversation="conv-7")
        assert first.conversation is not None and first.conversation.id == "conv-7"
        # GET finds a stored response of an application key's session.
        again = oa.responses.retrieve(first.id)
        assert again.id == first.id and again.output_text == first.output_text
        engine.reset()
        second = oa.responses.create(model="m", input="And again", conversation={"id": "conv-7"})
        # The conversation's earlier turns went to the engine before the new input.
        prompt = bytes(t - ID_OFFSET for t in engine.log()["answers"][0]["prompt_ids"][0])
        text = prompt.decode(errors="replace")
        assert "Hello there" in text and first.output_text in text and "And again" in text
        other = oa.responses.create(model="m", input="Unrelated", conversation="conv-8")
        rows = {s["session_key"]: s for s in sessions(gw, client)}
        assert rows["conv-7"]["n_calls"] == 2 and rows["conv-8"]["n_calls"] == 1
        assert second.id != other.id
        with pytest.raises(openai.NotFoundError):
            oa.responses.retrieve("resp_nothere")
        with pytest.raises(openai.BadRequestError):
            oa.responses.create(
                model="m", input="x", conversation="conv-7", previous_response_id=first.id
            )
    finally:
        oa.close()


def test_a_reused_feedback_id_on_another_target_says_so(
    client: GatewayClient, gw: lightning.GatewayHandle
) -> None:
    key = app_key(client)
    a = post(gw.url, CHAT, key, GOOD[CHAT], **{"x-session-id": "a"}).json()["id"]
    b = post(gw.url, CHAT, key, GOOD[CHAT], **{"x-session-id": "b"}).json()["id"]

    def fb(**body: Any) -> httpx.Response:
        return post(gw.url, "/v1/feedback", key, {"name": "thumbs", "value": 1, **body})

    assert fb(feedback_id="f1", response_id=a).json()["duplicate"] is False
    assert fb(feedback_id="f1", response_id=a).json()["duplicate"] is True
    other = fb(feedback_id="f1", response_id=b)
    assert other.status_code == 409, other.text
    assert other.json()["error"]["code"] == "feedback_id_reused"
    assert "another target" in other.json()["error"]["message"]
    assert fb(feedback_id="f2", session_id="a").json()["duplicate"] is False
    assert fb(feedback_id="f2", session_id="a").json()["duplicate"] is True
    assert fb(feedback_id="f2", session_id="b").status_code == 409
