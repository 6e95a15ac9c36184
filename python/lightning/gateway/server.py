"""The recording gateway, started from Python or as the ``lightning-gateway`` command.

The server is Rust (hyper + tokio + SQLite); this module only validates the
configuration (a pydantic model, TOML in) and hands it over. While it runs the
GIL is released, so a trainer in the same process keeps running.

    from lightning import Gateway, GatewayConfig
    gw = Gateway(GatewayConfig(upstreams=[{"url": "http://127.0.0.1:8000/v1"}], listen="127.0.0.1:0"))
    handle = gw.start()          # background thread; handle.url, handle.stop()
"""

from __future__ import annotations

import json
import secrets
import sys
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lightning import _core

if TYPE_CHECKING:
    from lightning.gateway.client import GatewayClient


# The Rust config (rust/gateway/src/config.rs) is the one definition: defaults
# and closed sets come from it; tests/test_gateway_config.py checks every field.
_RUST = json.loads(_core.gateway_config_schema())
_DEFAULTS = _RUST["defaults"]
_UPSTREAM = _RUST["upstream_defaults"]

EngineKind = Literal["vllm", "sglang", "openai"]
StoreFailure = Literal["refuse", "serve"]
SyncMode = Literal["full", "normal"]


class UpstreamConfig(BaseModel):
    """One inference engine behind the gateway."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="Base URL with the API prefix, e.g. http://127.0.0.1:8000/v1")
    weight_version: int = Field(
        default=_UPSTREAM["weight_version"], ge=0, description="Weight version this engine serves"
    )
    engine: EngineKind = _UPSTREAM["engine"]


class OnlineSection(BaseModel):
    """``[online]``: sessions, idle closing and retention of production traffic
    recorded with application keys (``rust/gateway/src/online/mod.rs``)."""

    model_config = ConfigDict(extra="forbid")

    session_window_s: float = Field(default=_DEFAULTS["online"]["session_window_s"], gt=0)
    idle_timeout_s: float = Field(default=_DEFAULTS["online"]["idle_timeout_s"], gt=0)
    retention_days: float | None = Field(default=_DEFAULTS["online"]["retention_days"], gt=0)
    retention_bytes: int | None = Field(default=_DEFAULTS["online"]["retention_bytes"], gt=0)
    sweep_interval_s: float = Field(default=_DEFAULTS["online"]["sweep_interval_s"], gt=0)


class GatewayConfig(BaseModel):
    """Gateway settings: the fields, meanings and defaults of the Rust ``Config``
    (``rust/gateway/src/config.rs``), validated here so a bad value fails in Python
    naming the field; ``threads`` and ``weight_version`` are Python-side only."""

    model_config = ConfigDict(extra="forbid")

    listen: str = _DEFAULTS["listen"]
    upstreams: list[UpstreamConfig] = Field(default_factory=list)
    db: str = _DEFAULTS["db"]
    admin_key: str | None = Field(
        default=_DEFAULTS["admin_key"],
        description="Admin key; None generates a random one on start()",
    )
    insecure_local: bool = Field(
        default=_DEFAULTS["insecure_local"],
        description="Run without an admin key (admin routes open); only on a loopback listen address",
    )
    public_url: str | None = _DEFAULTS["public_url"]
    max_body_bytes: int = Field(default=_DEFAULTS["max_body_bytes"], gt=0)
    max_upstream_answer_bytes: int = Field(
        default=_DEFAULTS["max_upstream_answer_bytes"],
        gt=0,
        description="Largest engine answer (whole body or whole stream) read for one call; 502 above",
    )
    max_concurrent_calls: int = Field(default=_DEFAULTS["max_concurrent_calls"], gt=0)
    max_calls_per_rollout: int = Field(default=_DEFAULTS["max_calls_per_rollout"], gt=0)
    max_sse_event_bytes: int = Field(default=_DEFAULTS["max_sse_event_bytes"], gt=0)
    header_read_timeout_s: float = Field(
        default=_DEFAULTS["header_read_timeout_s"], gt=0, allow_inf_nan=False
    )
    idle_timeout_s: float = Field(default=_DEFAULTS["idle_timeout_s"], gt=0, allow_inf_nan=False)
    max_rollouts_per_minute: int = Field(default=_DEFAULTS["max_rollouts_per_minute"], gt=0)
    upstream_timeout_s: float = Field(
        default=_DEFAULTS["upstream_timeout_s"], gt=0, allow_inf_nan=False
    )
    max_retries: int = Field(default=_DEFAULTS["max_retries"], ge=0)
    retry_base_ms: int = Field(default=_DEFAULTS["retry_base_ms"], ge=1)
    mark_down_after: int = Field(default=_DEFAULTS["mark_down_after"], ge=1)
    down_for_s: float = Field(default=_DEFAULTS["down_for_s"], ge=0)
    upstream_api_key: str | None = _DEFAULTS["upstream_api_key"]
    train_temperature: float | None = _DEFAULTS["train_temperature"]
    eval_temperature: float | None = _DEFAULTS["eval_temperature"]
    eval_capture: bool = _DEFAULTS["eval_capture"]
    sync: SyncMode = _DEFAULTS["sync"]
    on_store_failure: StoreFailure = Field(
        default=_DEFAULTS["on_store_failure"],
        description="While the store cannot write: refuse new calls (503) or serve them unrecorded",
    )
    drain_timeout_s: float = Field(default=_DEFAULTS["drain_timeout_s"], ge=0)
    body_timeout_s: float = Field(
        default=_DEFAULTS["body_timeout_s"],
        gt=0,
        allow_inf_nan=False,
        description="Longest time a client may take to send a whole request body (408 after it)",
    )
    max_n: int = Field(
        default=_DEFAULTS["max_n"],
        gt=0,
        description="Most answers per request (n, best_of); 400 above",
    )
    max_output_tokens: int = Field(
        default=_DEFAULTS["max_output_tokens"],
        gt=0,
        description="Most tokens one answer may ask for (max_tokens, max_output_tokens); 400 above",
    )
    max_top_logprobs: int = Field(
        default=_DEFAULTS["max_top_logprobs"],
        ge=0,
        description="Most alternatives per token (top_logprobs, completions' logprobs); 400 above",
    )
    online: OnlineSection = Field(default_factory=OnlineSection)
    threads: int = Field(
        default=2, ge=1, description="tokio worker threads (not sent to Rust config)"
    )

    weight_version: int = Field(
        default=0, ge=0, description="Weight version of upstreams given as plain URL strings"
    )

    @model_validator(mode="before")
    @classmethod
    def _plain_urls(cls, data: object) -> object:
        # `upstreams=["http://...", ...]` is shorthand for {"url": ..., "weight_version": weight_version}.
        if isinstance(data, dict) and isinstance(data.get("upstreams"), list):
            version = data.get("weight_version", 0)
            data = dict(data)
            data["upstreams"] = [
                {"url": u, "weight_version": version} if isinstance(u, str) else u
                for u in data["upstreams"]
            ]
        return data

    @classmethod
    def from_toml(cls, path: str | Path) -> GatewayConfig:
        with open(path, "rb") as f:
            return cls.model_validate(tomllib.load(f))

    def to_json(self) -> str:
        return json.dumps(self.model_dump(exclude={"threads", "weight_version"}))


class GatewayHandle:
    """A running gateway: ``.url``, ``.admin_key``, ``.stop()``; a context manager."""

    def __init__(self, inner: _core.GatewayHandle, admin_key: str) -> None:
        self._inner = inner
        self.admin_key = admin_key

    @property
    def url(self) -> str:
        return self._inner.url

    @property
    def running(self) -> bool:
        return self._inner.running

    def stop(self) -> None:
        """Drain in-flight calls, flush the store, join the server thread."""
        self._inner.stop()

    def client(self) -> GatewayClient:
        """An HTTP client for this gateway."""
        from lightning.gateway.client import GatewayClient

        return GatewayClient(self.url, self.admin_key)

    def __enter__(self) -> GatewayHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"GatewayHandle(url={self.url!r}, running={self.running})"


class Gateway:
    """The gateway server. ``start()`` runs it on a background thread; ``serve()``
    blocks until SIGINT/SIGTERM."""

    def __init__(self, config: GatewayConfig | None = None, **overrides: object) -> None:
        cfg = config or GatewayConfig()
        if overrides:
            cfg = cfg.model_copy(update=overrides)
            cfg = GatewayConfig.model_validate(cfg.model_dump())
        if cfg.admin_key is None and not cfg.insecure_local:
            cfg = cfg.model_copy(update={"admin_key": secrets.token_urlsafe(24)})
        self.config = cfg

    @property
    def admin_key(self) -> str:
        return self.config.admin_key or ""

    def start(self) -> GatewayHandle:
        inner = _core.gateway_start(self.config.to_json(), self.config.threads)
        return GatewayHandle(inner, self.admin_key)

    def serve(self) -> None:
        _core.gateway_serve(self.config.to_json(), self.config.threads)


def main(argv: list[str] | None = None) -> int:
    """The ``lightning-gateway`` console command: same flags as the Rust binary."""
    args = list(sys.argv[1:] if argv is None else argv)
    return int(_core.gateway_main(args))


if __name__ == "__main__":
    raise SystemExit(main())
