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


def app(listen_host: str = "127.0.0.1", key: str | None = KEY) -> LocalGuard:
    inner = Starlette(routes=[Route("/x", echo, methods=["GET", "POST"]), Route("/health", echo)])
    return LocalGuard(
        inner,
        listen_host=listen_host,
        key=key,
        error=lambda s, code, m: {"status": s, "code": code, "message": m},
        open_paths=("/health",),
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
    # A non-loopback listener: any name (the key guards it).
    with TestClient(app("0.0.0.0"), base_url="http://box.internal") as c:
        assert c.get("/x", headers=auth).status_code == 200
    # Without a key (in-process helpers): Host and JSON still apply.
    with TestClient(app(key=None), base_url="http://rebound.example") as c:
        assert c.get("/x").status_code == 403
