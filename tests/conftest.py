"""Shared pytest configuration. Heavy fixtures (real models, tokenizers) live in
tests/tokenizer_fixtures.py and are built once into $LIGHTNING_CACHE (never committed)."""

from __future__ import annotations

from tokenizer_fixtures import smol, smol_hf  # noqa: F401  (tokenizer fixtures)
