"""The doors of the local HTTP services (``lightning.gateway.local_http``): Host,
JSON content type and key, on a real ASGI app through starlette's test client."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from lightning.gateway.local_http import (
    LocalGuard,
    check_key,
    host_name,
    is_loopback,
    new_key,
)

KEY = "k" * 16


async def echo(req: Request) -> JSONResponse:
    return JSONResponse({"ok": True, "body": (await req.body()).decode()})


def app(
    listen_host: str = "127.0.0.1",
    key: str | None = KEY,
    allowed_hosts: list[str] | None = None,
) -> LocalGuard:
    inner = Starlette(routes=[Route("/x", echo, methods=["GET", "POST"]), Route("/health", echo)])
    return LocalGuard(
        inner,
        listen_host=listen_host,
        key=key,
        error=lambda s, code, m: {"status": s, "code": code, "message": m},
        open_paths=("/health",),
        allowed_hosts=allowed_hosts,
    )


def test_names() -> None:
    assert host_name("[::1]:80") == "::1" and host_name("a.example:80") == "a.example"
    assert host_name("localhost") == "localhost"
    for h in ("localhost", "LOCALHOST", "127.0.0.1", "127.9.9.9", "::1", "[::1]"):
        assert is_loopback(h), h
    for h in ("0.0.0.0", "example.com", "10.0.0.1", "localhost.attacker.example"):
        assert not is_loopback(h), h
    assert len(new_key()) >= 16 and new_key() != new_key()
    with pytest.raises(ValueError, match="at least 16"):
        check_key("short", "SOME_ENV")


def test_rebinding_content_type_and_key() -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    with TestClient(app(), base_url="http://rebound.example:8000") as c:
        r = c.get("/x", headers=auth)
        assert r.status_code == 403 and r.json()["code"] == "host_not_allowed"
    with TestClient(app(), base_url="http://127.0.0.1:8000") as c:
        assert c.get("/x").status_code == 401
        assert (
            c.get("/x", headers={"Authorization": "Bearer wrong-key-wrong-key"}).status_code == 401
        )
        assert c.get("/health").status_code == 200  # open
        for scheme in ("Bearer", "bearer", "BEARER"):
            assert c.get("/x", headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200
        assert c.get("/x", headers={"x-api-key": KEY}).status_code == 200
        assert c.get(f"/x?key={KEY}").status_code == 200
        # A cross-site "simple" POST: text/plain or a form, even with the key.
        for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
            h = {**auth, **({"Content-Type": ctype} if ctype else {})}
            r = c.post("/x", content=b'{"a": 1}', headers=h)
            assert r.status_code == 415 and r.json()["code"] == "unsupported_media_type"
        r = c.post("/x", json={"a": 1}, headers=auth)
        assert r.status_code == 200 and r.json()["body"] == '{"a":1}'
    # A listener on every interface: only its own and the allowed names, even with the key.
    with TestClient(app("0.0.0.0"), base_url="http://box.internal") as c:
        r = c.get("/x", headers=auth)
        assert r.status_code == 403 and "LIGHTNING_ALLOWED_HOSTS" in r.json()["message"]
    with TestClient(app("10.1.2.3"), base_url="http://10.1.2.3:80") as c:
        assert c.get("/x", headers=auth).status_code == 200  # its listen address
    # Without a key (in-process helpers): Host and JSON still apply.
    with TestClient(app(key=None), base_url="http://rebound.example") as c:
        assert c.get("/x").status_code == 403


def test_allowed_names_the_environment_and_the_address_reached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    monkeypatch.setenv("LIGHTNING_ALLOWED_HOSTS", "gw.example, Other.Example")
    for base in ("http://gw.example:1", "http://OTHER.example", "http://localhost"):
        with TestClient(app("0.0.0.0"), base_url=base) as c:
            assert c.get("/x", headers=auth).status_code == 200, base
    with TestClient(app("0.0.0.0"), base_url="http://evil.example") as c:
        assert c.get("/x", headers=auth).status_code == 403
    # Given names replace the environment's; `*` serves any name.
    with TestClient(app("0.0.0.0", allowed_hosts=["a.example"]), base_url="http://gw.example") as c:
        assert c.get("/x", headers=auth).status_code == 403
    with TestClient(app("0.0.0.0", allowed_hosts=["*"]), base_url="http://evil.example") as c:
        assert c.get("/x", headers=auth).status_code == 200
    guard = app("0.0.0.0", allowed_hosts=[])
    # The address the connection reached (ASGI `server`), IPv4 seen through `::` too.
    assert guard.host_ok("192.168.1.5:8765", ("192.168.1.5", 8765))
    assert guard.host_ok("192.168.1.5", ("::ffff:192.168.1.5", 8765))
    assert not guard.host_ok("192.168.1.6", ("192.168.1.5", 8765))
    assert not guard.host_ok("0.0.0.0", ("192.168.1.5", 8765))
    # TestClient's `server` is the URL's name: a name there is never "reached".
    assert not guard.host_ok("box", ("box", 80))
