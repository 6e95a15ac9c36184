"""Shared pytest configuration. Heavy fixtures (real models, tokenizers) live in
tests/support/tokenizer_fixtures.py and are built once into $LIGHTNING_CACHE (never committed)."""

from __future__ import annotations

import os

from hypothesis import settings

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
