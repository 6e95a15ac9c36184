"""One version for the whole project (house rule 12)."""

import importlib.metadata
import tomllib
from pathlib import Path

import lightning

ROOT = Path(__file__).resolve().parent.parent


def test_version_matches_cargo_and_metadata() -> None:
    cargo = tomllib.loads((ROOT / "Cargo.toml").read_text())
    assert lightning.__version__ == cargo["workspace"]["package"]["version"]
    assert importlib.metadata.version("lightning-rl") == lightning.__version__


def test_error_root_is_exception() -> None:
    assert issubclass(lightning.LightningError, Exception)
