"""A real gateway (in process, on loopback) in front of one engine, as most tests want it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning
from lightning import Gateway, GatewayClient, GatewayConfig


def start_gateway(engine_url: str, db: Path) -> lightning.GatewayHandle:
    """A started gateway with the store at ``db`` and one upstream at weight version 1."""
    cfg = GatewayConfig(
        listen="127.0.0.1:0",
        upstreams=[{"url": engine_url, "weight_version": 1}],
        db=str(db),
    )
    return Gateway(cfg).start()


@contextmanager
def gateway_client(engine_url: str, db: Path) -> Iterator[GatewayClient]:
    """An admin client of a gateway started for the block, stopped after it."""
    handle = start_gateway(engine_url, db)
    client = handle.client()
    try:
        yield client
    finally:
        client.close()
        handle.stop()
