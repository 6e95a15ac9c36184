"""The property tests' profile: derandomized exactly when CI is set (tests/conftest.py)."""

from __future__ import annotations

import os

from hypothesis import settings


def test_property_tests_draw_fixed_examples_exactly_under_ci() -> None:
    in_ci = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
    assert settings.default.derandomize is in_ci
    if in_ci:
        # No example database either: a run cannot replay another run's failures.
        assert settings.default.database is None
