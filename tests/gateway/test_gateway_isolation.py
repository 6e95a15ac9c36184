"""Isolation and auth (issue 15, section 6), against the ``lightning-gateway``
command on loopback with debug logging captured: one rollout's token cannot
touch another rollout on any protocol route, admin routes need the admin key,
a keyless gateway needs ``--insecure-local`` on a loopback listener, and the
log never holds a token or the admin key."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from fake_vllm import FakeEngine
from gateways import serving, wait_until
from lightning import GatewayClient

ADMIN = "isolation-admin-key-0123456789"
MSGS = [{"role": "user", "content": "hi [[len:4]]"}]
# Each harness route with a body its protocol accepts; the last item names the error shape.
CALLS: list[tuple[str, dict[str, Any], str]] = [
    ("chat/completions", {"model": "m", "messages": MSGS}, "openai"),
    ("completions", {"model": "m", "prompt": "hi"}, "openai"),
    ("responses", {"model": "m", "input": "hi"}, "openai"),
    ("messages", {"model": "m", "max_tokens": 8, "messages": MSGS}, "anthropic"),
]


@dataclass
class Gw:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path


ENGINE = {"name": "I"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(tmp: Path, *flags: str, listen: str | None = None) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-c", "import sys; from lightning.gateway.server import main; sys.exit(main())",
        "--listen", listen or f"127.0.0.1:{free_port()}", "--db", str(tmp / "gw.db"),
        "--threads", "1", *flags,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_ADMIN_KEY"}
    env["RUST_LOG"] = "debug"
    with open(tmp / "gw.log", "wb") as log:  # the child keeps its own copy of the fd
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_up(proc: subprocess.Popen[bytes], url: str) -> None:
    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited with {proc.returncode}")
        return serving(url)

    wait_until(up, "the gateway to come up", timeout=20, every=0.05)


def start(tmp: Path, upstream: str, *flags: str) -> Gw:
    port = free_port()
    proc = launch(tmp, "--upstream", upstream, *flags, listen=f"127.0.0.1:{port}")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(proc, url)
    except RuntimeError:
        proc.kill()
        raise
    return Gw(proc, url, tmp / "gw.log")


def stop(gw: Gw) -> str:
    gw.proc.terminate()
    gw.proc.wait(15)
    return gw.log.read_text(errors="replace")


@pytest.fixture
def admin(gw: Gw) -> Iterator[GatewayClient]:
    c = GatewayClient(gw.url, ADMIN)
    yield c
    c.close()


@pytest.fixture
def gw(engine: FakeEngine, tmp_path: Path) -> Iterator[Gw]:
    engine.reset()
    g = start(tmp_path, engine.url, "--admin-key", ADMIN)
    yield g
    if g.proc.poll() is None:
        stop(g)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def assert_protocol_error(r: httpx.Response, status: int, shape: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    if shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "permission_error", body
        assert "another rollout" in body["error"]["message"]
    else:
        assert "another rollout" in body["error"]["message"], body


def test_token_of_one_rollout_cannot_touch_another(
    gw: Gw, admin: GatewayClient, engine: FakeEngine
) -> None:
    c = admin
    a, b = c.create_rollout(), c.create_rollout()
    h = httpx.Client(base_url=gw.url, headers=bearer(a.token), timeout=10)
    for route, body, shape in CALLS:
        # Both header styles the SDKs use.
        r = h.post(f"/rollouts/{b.id}/v1/{route}", json=body)
        assert_protocol_error(r, 403, shape)
        r = httpx.post(
            f"{gw.url}/rollouts/{b.id}/v1/{route}", json=body, headers={"x-api-key": a.token}
        )
        assert_protocol_error(r, 403, shape)
    assert engine.log()["requests"] == 0, "a refused call must not reach the engine"
    for method, path, body in [
        ("POST", "reward", {"value": 1.0}),
        ("POST", "events", {"type": "note", "data": {}}),
        ("GET", "events", None),
        ("GET", "trace", None),
        ("GET", "", None),
    ]:
        r = h.request(method, f"/rollouts/{b.id}/{path}".rstrip("/"), json=body)
        assert r.status_code == 403, (method, path, r.status_code, r.text)
    # Setting a status is admin-only, for every rollout token.
    assert h.post(f"/rollouts/{b.id}/status", json={"status": "done"}).status_code == 401
    # B is untouched, and A's own token still works on A.
    assert c.trace(b.id) == [] and c.events(b.id) == []
    assert c.get_rollout(b.id)["reward"] is None
    for route, body, _ in CALLS:
        assert h.post(f"/rollouts/{a.id}/v1/{route}", json=body).status_code == 200, route
    assert len(c.records(a.id)) == len(CALLS)
    # An unknown token is 401, not 403: it proves nothing about which rollout it belongs to.
    r = httpx.post(f"{gw.url}/rollouts/{b.id}/reward", json={"value": 1}, headers=bearer("lt-x"))
    assert r.status_code == 401
    h.close()


ADMIN_ROUTES = [
    ("POST", "/rollouts", {}),
    ("GET", "/rollouts", None),
    ("GET", "/admin/state", None),
    ("GET", "/admin/upstreams", None),
    ("GET", "/admin/keys", None),
    ("POST", "/admin/pause", {}),  # every POST is JSON (415 otherwise)
    ("POST", "/admin/resume", {}),
]


def test_admin_routes_need_the_admin_key(gw: Gw, admin: GatewayClient) -> None:
    c = admin
    token = c.create_rollout().token
    for method, path, body in ADMIN_ROUTES:
        for headers in [{}, bearer("wrong-admin-key"), bearer(token), {"x-api-key": token}]:
            r = httpx.request(method, gw.url + path, json=body, headers=headers)
            assert r.status_code == 401, (method, path, headers, r.text)
        r = httpx.request(method, gw.url + path, json=body, headers=bearer(ADMIN))
        assert r.is_success, (method, path, r.text)


def test_empty_admin_key_needs_insecure_local_on_loopback(
    engine: FakeEngine, tmp_path: Path
) -> None:
    for flags, listen, needle in [
        ((), None, "admin_key is not set"),
        (("--admin-key", ""), None, "admin_key is not set"),
        (("--insecure-local",), "0.0.0.0:0", "loopback"),
    ]:
        proc = launch(tmp_path, "--upstream", engine.url, *flags, listen=listen)
        assert proc.wait(20) != 0, flags
        assert needle in (tmp_path / "gw.log").read_text(), flags
    # With --insecure-local on loopback admin routes are open, yet rollouts stay isolated.
    g = start(tmp_path, engine.url, "--insecure-local")
    try:
        c = GatewayClient(g.url)
        a, b = c.create_rollout(), c.create_rollout()
        c.close()
        assert httpx.get(g.url + "/admin/state").status_code == 200
        r = httpx.post(
            f"{g.url}/rollouts/{b.id}/reward", json={"value": 1}, headers=bearer(a.token)
        )
        assert r.status_code == 403
        r = httpx.get(f"{g.url}/rollouts/{b.id}/trace")
        assert r.status_code == 401
    finally:
        stop(g)


def test_debug_log_never_holds_tokens_or_the_admin_key(
    gw: Gw, admin: GatewayClient, engine: FakeEngine
) -> None:
    c = admin
    a, b = c.create_rollout(), c.create_rollout()
    for route, body, _ in CALLS:
        for stream in (False, True):
            payload = {**body, "stream": True} if stream else body
            for rid, tok in [(a.id, a.token), (b.id, a.token)]:
                httpx.post(f"{gw.url}/rollouts/{rid}/v1/{route}", json=payload, headers=bearer(tok))
            httpx.post(f"{gw.url}/v1/{route}", json=payload, headers={"x-api-key": b.token})
    c.reward(a.id, 1.0, token=a.token)
    httpx.get(f"{gw.url}/admin/state", headers=bearer(ADMIN[:-1] + "X"))
    engine.control(fail_next=1, fail_status=500)
    httpx.post(
        f"{gw.url}/rollouts/{a.id}/v1/chat/completions", json=CALLS[0][1], headers=bearer(a.token)
    )
    log = stop(gw)
    assert "DEBUG" in log, "the gateway did not log at debug level; the check would prove nothing"
    for secret in (ADMIN, ADMIN[:-1] + "X", a.token, b.token, a.token[3:], b.token[3:]):
        assert secret not in log
