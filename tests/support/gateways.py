"""A real gateway (in process, on loopback) in front of one engine, as most tests
want it, and the polling helpers that tests of live servers share."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx

import lightning
from lightning import Gateway, GatewayClient, GatewayConfig

T = TypeVar("T")


def gateway_config(
    upstreams: str | list[Any], db: Path, *, weight_version: int = 1, **overrides: Any
) -> GatewayConfig:
    """A loopback gateway's config with the store at ``db``. ``upstreams`` is one
    engine URL (served at ``weight_version``) or a full upstream list;
    ``overrides`` are any other ``GatewayConfig`` fields (limits, retries)."""
    if isinstance(upstreams, str):
        upstreams = [{"url": upstreams, "weight_version": weight_version}]
    return GatewayConfig(listen="127.0.0.1:0", upstreams=upstreams, db=str(db), **overrides)


def start_gateway(upstreams: str | list[Any], db: Path, **kw: Any) -> lightning.GatewayHandle:
    """A started gateway (see ``gateway_config`` for the arguments)."""
    return Gateway(gateway_config(upstreams, db, **kw)).start()


@contextmanager
def gateway_client(engine_url: str, db: Path, **kw: Any) -> Iterator[GatewayClient]:
    """An admin client of a gateway started for the block, stopped after it."""
    handle = start_gateway(engine_url, db, **kw)
    client = handle.client()
    try:
        yield client
    finally:
        client.close()
        handle.stop()


def wait_until(check: Callable[[], T], what: str, timeout: float = 10.0, every: float = 0.02) -> T:
    """Poll ``check`` until it returns something truthy and return that.

    Tests of live servers wait for a state (a record written, a call in flight)
    rather than sleep a fixed time, so a slow CI machine only makes them slower;
    on timeout the test fails naming ``what`` it waited for."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


def serving(url: str) -> bool:
    """Whether a gateway at ``url`` answers its health check with 200."""
    try:
        return httpx.get(url + "/healthz", timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False
