"""A gateway process on a TOML config (so ``[online]`` settings apply), and the
helpers the online-mode tests (and the view's demo run) share with it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

import store_sql
from gateways import serving, wait_until
from lightning import GatewayClient

ADMIN = "online-admin-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Gw:
    """A gateway process on a TOML config (so ``[online]`` settings apply)."""

    def __init__(
        self, db: Path, upstream: str, online: str = "", port: int | None = None, top: str = ""
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = db.with_suffix(".toml")
        cfg.write_text(
            f'listen = "127.0.0.1:{self.port}"\ndb = "{db}"\nadmin_key = "{ADMIN}"\n{top}\n'
            f'[[upstreams]]\nurl = "{upstream}"\n[online]\n{online}\n'
        )
        cmd = [sys.executable, "-c", "import sys; from lightning.gateway.server import main; sys.exit(main())",
               "--config", str(cfg), "--threads", "2"]  # fmt: skip
        self.api = GatewayClient(self.url, ADMIN, timeout=30)
        self.log = db.with_suffix(f".{self.port}.log")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        try:
            wait_until(lambda: serving(self.url), "the gateway to come up", timeout=30, every=0.05)
        except AssertionError:
            self.proc.kill()
            raise RuntimeError(f"gateway did not come up: {self.log.read_text()}") from None

    def admin(self, method: str, path: str, body: Any = None) -> httpx.Response:
        return httpx.request(
            method,
            self.url + path,
            # Every POST is JSON, an empty one too (the gateway refuses others: 415).
            json={} if body is None and method == "POST" else body,
            headers={"Authorization": f"Bearer {ADMIN}"},
            timeout=30,
        )

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.api.close()

    def stop(self) -> None:
        self.api.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(20)


def new_key(gw: Gw, name: str, **defaults: Any) -> str:
    key = gw.api.create_app_key(name, **defaults).key
    assert key is not None and key.startswith("lk-")
    return key


def feedback(gw: Gw, key: str, **body: Any) -> httpx.Response:
    """A raw ``POST /v1/feedback``, for bodies the typed client would refuse."""
    return httpx.post(
        gw.url + "/v1/feedback", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30
    )


def db_rows(db: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    return store_sql.rows(db, sql, *args)
