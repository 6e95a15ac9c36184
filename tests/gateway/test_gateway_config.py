"""One gateway configuration: Python's `GatewayConfig` and the `[gateway]`
section of `lightning train` match the Rust `Config` field for field."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import ValidationError

from lightning import _core
from lightning.config import GatewaySection, RunConfig
from lightning.gateway.server import GatewayConfig, UpstreamConfig

RUST = json.loads(_core.gateway_config_schema())
PYTHON_ONLY = {"threads", "weight_version"}


def test_fields_and_defaults_match_rust() -> None:
    fields = GatewayConfig.model_fields
    assert set(fields) - PYTHON_ONLY == set(RUST["defaults"])
    python_defaults = json.loads(GatewayConfig().to_json())
    assert python_defaults == RUST["defaults"]
    upstream = UpstreamConfig(url="http://x/v1").model_dump(exclude={"url"})
    assert upstream == RUST["upstream_defaults"]


def _generator() -> typing.Any:
    path = Path(__file__).resolve().parents[2] / ".ci" / "gateway_config.py"
    spec = importlib.util.spec_from_file_location("gateway_config_gen", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_fields_are_the_rust_schema() -> None:
    """The generated block of `GatewayConfig` is what the Rust schema writes
    (run `python .ci/gateway_config.py` after changing rust/gateway/src/config.rs)."""
    gen = _generator()
    text = gen.target().read_text()
    assert gen.current(text) == gen.render(RUST), "run: python .ci/gateway_config.py"
    for field in RUST["fields"]:
        info = GatewayConfig.model_fields[field["name"]]
        assert info.description == field["doc"]
        assert info.default == field["default"], field["name"]


def test_rust_bounds_hold_in_python() -> None:
    """Each bound the Rust schema states rejects its first bad value in Python, naming the field."""
    bad: dict[str, list[float]] = {
        "positive": [0],
        "positive_finite": [0.0, float("inf")],
        "non_negative": [-1],
        "at_least_one": [0],
    }
    checked = 0
    for field in RUST["fields"]:
        for value in bad.get(field["bound"], []):
            with pytest.raises(ValidationError, match=field["name"]):
                GatewayConfig(**{field["name"]: value})
            checked += 1
    assert checked >= 12


def test_closed_sets_match_rust() -> None:
    engine = UpstreamConfig.model_fields["engine"].annotation
    assert set(typing.get_args(engine)) == set(RUST["engines"])
    sync = GatewayConfig.model_fields["sync"].annotation
    assert set(typing.get_args(sync)) == set(RUST["sync_modes"])


def test_every_python_config_starts_in_rust(tmp_path: Path) -> None:
    """A config Python accepts, with every field off its default, is one Rust accepts."""
    cfg = GatewayConfig(
        listen="127.0.0.1:0",
        upstreams=[{"url": "http://127.0.0.1:9/v1", "weight_version": 2, "engine": "sglang"}],
        db=str(tmp_path / "g.db"),
        admin_key="k" * 16,
        public_url="http://example/",
        max_body_bytes=1024,
        max_concurrent_calls=7,
        max_calls_per_rollout=3,
        max_sse_event_bytes=4096,
        header_read_timeout_s=2.5,
        idle_timeout_s=3.5,
        max_rollouts_per_minute=11,
        upstream_timeout_s=1.5,
        max_retries=0,
        retry_base_ms=2,
        mark_down_after=1,
        down_for_s=0.5,
        upstream_api_key="up",
        train_temperature=0.7,
        eval_temperature=0.0,
        eval_capture=False,
        sync="normal",
        drain_timeout_s=1.0,
    )
    handle = _core.gateway_start(cfg.to_json(), 1)  # raises where Rust refuses the config
    try:
        assert handle.running and handle.url.startswith("http://127.0.0.1:")
    finally:
        handle.stop()
    assert not handle.running


def test_run_gateway_section_is_the_gateway_config() -> None:
    assert issubclass(GatewaySection, GatewayConfig)
    section = GatewaySection(max_retries=5, sync="normal")
    algo = RunConfig.model_fields["algorithm"].default_factory()  # type: ignore[misc]
    cfg = section.for_run(db="x.db", admin_key="k" * 16, upstreams=[], algorithm=algo)
    assert (cfg.max_retries, cfg.sync, cfg.listen, cfg.db) == (5, "normal", "127.0.0.1:0", "x.db")
    assert cfg.train_temperature == algo.train_temperature
    # A saved run config loads again (the run-set fields are not written out).
    assert GatewaySection.model_validate(section.model_dump()) == section
    with pytest.raises(ValidationError, match="max_retrys"):
        GatewaySection(max_retrys=5)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="upstreams is set by the run"):
        GatewaySection(upstreams=["http://x/v1"])  # type: ignore[list-item]


def test_help_names_every_protocol() -> None:
    """`lightning-gateway --help` tells a newcomer which clients it serves."""
    out = subprocess.run(
        [sys.executable, "-m", "lightning.gateway.server", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    first = " ".join(out.stdout.split("\n\n")[0].split())
    for protocol in ("chat completions", "completions", "Responses", "Anthropic Messages"):
        assert protocol in first, f"{protocol!r} is not in the --help summary: {first!r}"
