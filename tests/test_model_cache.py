"""lightning.model_cache: fixtures build quietly and leave the caller's settings alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers.utils import logging as hf_logging

from lightning.model_cache import tiny_model_dir


def test_building_a_model_draws_no_progress_bar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # A fresh cache: the model is built (and saved) here, not found.
    monkeypatch.setenv("LIGHTNING_CACHE", str(tmp_path))
    hf_logging.enable_progress_bar()
    built = tiny_model_dir(seed=7)
    printed, errors = capfd.readouterr()
    assert (built / "config.json").exists() and built.is_relative_to(tmp_path)
    assert "Writing model shards" not in printed + errors
    assert hf_logging.is_progress_bar_enabled()  # the caller's setting is restored
