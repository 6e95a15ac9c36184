"""The doors of lightning's local HTTP services (``lightning view``,
``lightning serve``), checked before any route runs; the Rust gateway checks
the same in ``rust/gateway/src/http.rs`` (docs/guarantees.md, "Local services").

- ``Host``: whatever the listen address, only ``localhost``, a loopback IP
  literal, the listen host itself (unless it is ``0.0.0.0``/``::``), the IP
  address the connection reached (ASGI's ``server``: a page can send an IP
  literal only when its own origin is that address) and the names the
  operator allows (``allowed_hosts``, else ``$LIGHTNING_ALLOWED_HOSTS``,
  comma-separated; ``*`` serves any name) are served. A web page whose name an
  attacker points at this machine (DNS rebinding) sends its own name, and gets
  403, on loopback and on a LAN address alike.
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
import os
import secrets
from collections.abc import Callable, Collection
from typing import Any
from urllib.parse import parse_qs

ASGIApp = Callable[..., Any]

KEY_MIN_LEN = 16  # a random per-start key is 32 characters
ALLOWED_HOSTS_ENV = "LIGHTNING_ALLOWED_HOSTS"


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


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return None
    # A `::` listener sees an IPv4 client's address as `::ffff:a.b.c.d`.
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped if mapped is not None else ip


def env_allowed_hosts() -> list[str]:
    """The names in ``$LIGHTNING_ALLOWED_HOSTS`` (comma-separated; empty: none)."""
    return [h.strip() for h in os.environ.get(ALLOWED_HOSTS_ENV, "").split(",") if h.strip()]


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
    shape; ``open_paths`` need no key (``/health``: a load balancer's probe);
    ``allowed_hosts`` are the extra names ``Host`` may give (None: from
    ``$LIGHTNING_ALLOWED_HOSTS``)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        listen_host: str,
        key: str | None,
        error: Callable[[int, str, str], dict[str, Any]],
        open_paths: Collection[str] = (),
        allowed_hosts: Collection[str] | None = None,
    ) -> None:
        self.app, self.key, self.error = app, key, error
        self.listen_host = listen_host.strip("[]")
        self.open_paths = frozenset(open_paths)
        allowed = list(env_allowed_hosts() if allowed_hosts is None else allowed_hosts)
        self.any_host = any(h.strip() == "*" for h in allowed)
        names = {host_name(h).lower() for h in allowed if h.strip() != "*"}
        listen_ip = _ip(self.listen_host)
        if not (listen_ip is not None and listen_ip.is_unspecified):
            names.add(self.listen_host.lower())
        self.names = frozenset(n for n in names if n)

    def host_ok(self, host: str, server: Any) -> bool:
        """Whether a request with ``Host: host`` that reached ``server`` (ASGI's
        ``(ip, port)`` of this side of the connection) is served."""
        if self.any_host:
            return True
        name = host_name(host)
        ip = _ip(name)
        if is_loopback(name) or name.lower() in self.names:
            return True
        reached = _ip(str(server[0])) if server else None
        return ip is not None and reached is not None and ip == reached

    def _refusal(self, scope: dict[str, Any]) -> tuple[int, str, str] | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host")
        if host is not None and not self.host_ok(host, scope.get("server")):
            named = "".join(f", {n}" for n in sorted(self.names))
            return (
                403,
                "host_not_allowed",
                f"this server (listening on {self.listen_host}) answers only requests addressed "
                f"to localhost, a loopback address, the address it was reached at{named}; "
                f"not Host {host!r} (a page of another site can point its name at this "
                f"machine). Open it by one of those, or allow the name with "
                f"{ALLOWED_HOSTS_ENV}=NAME (`lightning view --allowed-host NAME`)",
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
