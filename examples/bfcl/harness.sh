#!/bin/sh
# The rollout's harness: BFCL's generation + checker for one test case, run in
# BFCL's cached environment (created by `python -m lightning.apps.bfcl setup`).
exec "${LIGHTNING_CACHE:-$HOME/.cache/lightning}/bfcl-venv/bin/python" "$(dirname "$0")/bfcl_harness.py" "$@"
