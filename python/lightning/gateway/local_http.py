"""The doors of lightning's local HTTP services (``lightning view``,
``lightning serve``), checked before any route runs; the Rust gateway checks
the same in ``rust/gateway/src/http.rs`` (docs/guarantees.md, "Local services").

- ``Host``: on a loopback listener only ``localhost``, a loopback IP literal or
  the listen host itself is served. A web page whose name an attacker points at
  127.0.0.1 (DNS rebinding) sends its own name, and gets 403. A listener on
  another address needs a key, which a page cannot send; any name passes.
- ``Content-Type``: a POST must be ``application/json``. A page of another
  origin can POST ``text/plain`` without the browser asking the server first
  (no CORS preflight); a JSON content type forces that question, which these
  servers never answer yes to.
- The key: every request but the ones named open carries it, as
  ``Authorization: Bearer KEY`` (scheme in any case), ``x-api-key: KEY``, or
  ``?key=KEY`` (the page itself, so its URL can be printed, as Jupyter does).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import secrets
from collections.abc import Callable, Collection
from typing import Any
from urllib.parse import parse_qs

ASGIApp = Callable[..., Any]

KEY_MIN_LEN = 16  # a random per-start key is 32 characters


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback IP literal (``127.0.0.0/8``, ``::1``), brackets allowed."""
    h = host.strip().strip("[]")
    if h.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def new_key() -> str:
    """A random key for one start of a service (printed in its URL)."""
    return secrets.token_urlsafe(24)


def check_key(key: str, env: str) -> str:
    """``key`` if it is long enough, else a ``ValueError`` naming ``env``."""
    if len(key) < KEY_MIN_LEN:
        raise ValueError(
            f"the key is {len(key)} characters; use a random one of at least {KEY_MIN_LEN} "
            f"(e.g. `export {env}=$(openssl rand -hex 24)`), or set none to get a random one"
        )
    return key


def host_name(value: str) -> str:
    """The name part of a ``Host`` header: ``[::1]:80`` → ``::1``, ``a:80`` → ``a``."""
    v = value.strip()
    if v.startswith("["):
        return v[1:].split("]", 1)[0]
    return v.rsplit(":", 1)[0] if v.count(":") == 1 else v


def presented_key(headers: dict[str, str], query: str) -> str:
    auth = headers.get("authorization", "").strip()
    scheme, _, rest = auth.partition(" ")
    if scheme.lower() == "bearer" and rest.strip():
        return rest.strip()
    if headers.get("x-api-key"):
        return headers["x-api-key"].strip()
    got = parse_qs(query).get("key")
    return got[0] if got else ""


class LocalGuard:
    """ASGI middleware: Host, JSON content type and key, in that order.

    ``error(status, code, message)`` builds the body in the service's own error
    shape; ``open_paths`` need no key (``/health``: a load balancer's probe)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        listen_host: str,
        key: str | None,
        error: Callable[[int, str, str], dict[str, Any]],
        open_paths: Collection[str] = (),
    ) -> None:
        self.app, self.key, self.error = app, key, error
        self.listen_host = listen_host.strip("[]")
        self.loopback = is_loopback(self.listen_host)
        self.open_paths = frozenset(open_paths)

    def _refusal(self, scope: dict[str, Any]) -> tuple[int, str, str] | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host")
        if self.loopback and host is not None:
            name = host_name(host)
            if not (is_loopback(name) or name.lower() == self.listen_host.lower()):
                return (
                    403,
                    "host_not_allowed",
                    f"this server listens on loopback and answers only requests addressed to "
                    f"localhost or a loopback address, not Host {host!r}; open "
                    f"http://127.0.0.1:PORT/ instead",
                )
        if scope["method"] == "POST":
            ctype = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if ctype != "application/json":
                return (
                    415,
                    "unsupported_media_type",
                    "the request body must be JSON sent with `Content-Type: application/json`, "
                    f"not {headers.get('content-type', '')!r}",
                )
        if self.key is not None and scope["path"] not in self.open_paths:
            given = presented_key(headers, scope.get("query_string", b"").decode("latin-1"))
            if not hmac.compare_digest(given.encode(), self.key.encode()):
                return (
                    401,
                    "unauthorized",
                    "this server needs its key: `Authorization: Bearer KEY` (or `?key=KEY` "
                    "in the page's URL, as printed at start)",
                )
        return None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refused = self._refusal(scope)
            if refused is not None:
                status, code, message = refused
                body = json.dumps(self.error(status, code, message)).encode()
                await send(
                    {
                        "type": "http.response.start",
                        "status": status,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
