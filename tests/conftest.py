"""Shared pytest configuration. Heavy fixtures (real models, tokenizers) live in
tests/support/tokenizer_fixtures.py and are built once into $LIGHTNING_CACHE (never committed)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

import lightning
from fake_vllm import FakeEngine
from gateways import start_gateway
from tokenizer_fixtures import smol, smol_hf  # noqa: F401  (tokenizer fixtures)

# Under CI every property test draws the same examples on every run, so a red CI
# is reproducible, never a coin flip. (Hypothesis's own "ci" profile does the same
# when it detects CI; registering ours keeps it so on any Hypothesis version.)
# By hand, without CI, each run draws new examples: pass --hypothesis-seed=N to
# replay one, and pin every failure found that way with @example.
settings.register_profile(
    "lightning-ci", derandomize=True, database=None, deadline=None, print_blob=True
)
if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
    settings.load_profile("lightning-ci")


# -- the shared fake engine and gateway ------------------------------------------
# One fake vLLM engine per test module and a fresh in-process gateway per test,
# in front of it. A module shapes them with module-level dicts:
#   ENGINE = {"name": "A", "script": [...], "unique_ids": True}   (FakeEngine's arguments)
#   GATEWAY = {"weight_version": 3, "max_retries": 0}             (start_gateway's)
# and overrides a fixture by defining its own only when it needs another shape.


@pytest.fixture(scope="module")
def engine(request: pytest.FixtureRequest) -> Iterator[FakeEngine]:
    e = FakeEngine(**getattr(request.module, "ENGINE", {}))
    yield e
    e.stop()


@pytest.fixture
def gw(
    engine: FakeEngine, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[lightning.GatewayHandle]:
    """A gateway on a fresh store; the engine's request log is cleared and its
    script (when the module has one) restored, so no test sees another's."""
    engine.reset()
    script = getattr(request.module, "ENGINE", {}).get("script")
    if script is not None:
        engine.script(script)
    h = start_gateway(engine.url, tmp_path / "gw.db", **getattr(request.module, "GATEWAY", {}))
    yield h
    h.stop()


@pytest.fixture
def client(gw: lightning.GatewayHandle) -> Iterator[lightning.GatewayClient]:
    """The gateway's admin client."""
    c = gw.client()
    yield c
    c.close()
