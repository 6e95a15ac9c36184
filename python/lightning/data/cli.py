"""``lightning data IN [IN ...] --out DIR``: clean tasks and split them."""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lightning.data.clean import DataConfig, clean, format_reports
from lightning.data.files import load_records, load_tokenizer, write_jsonl

# Fields that `--flag none` sets to None.
_NULLABLE = frozenset({"answer_field", "id_field", "split", "max_tokens", "eval_size"})


def main(argv: list[str]) -> int:
    """``lightning data IN [IN ...] --out DIR``: writes train.jsonl, eval.jsonl
    and report.json (the stage counts) into DIR and prints the counts."""
    p = argparse.ArgumentParser(
        prog="lightning data", description="Clean tasks and split them into train/eval."
    )
    p.add_argument("inputs", nargs="+", help=".jsonl, .parquet, or a datasets directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--config", help="TOML with DataConfig fields (top level or [data])")
    p.add_argument("--tokenizer", help="tokenizer.json or a model directory (length filter)")
    p.add_argument(
        "--sampler",
        help="module:function sample(task, k) -> list of k rewards (pass-rate filter)",
    )
    for name, field in DataConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        p.add_argument(flag, dest=name, default=None, help=f"override {name} ({field.annotation})")
    args = p.parse_args(argv)

    raw: dict[str, Any] = {}
    if args.config:
        with open(args.config, "rb") as f:
            loaded = tomllib.load(f)
        raw.update(loaded.get("data", loaded))
    for name in DataConfig.model_fields:
        value = getattr(args, name)
        if value is not None:
            nullable = name in _NULLABLE and value.lower() in ("none", "null")
            raw[name] = None if nullable else value
    try:
        cfg = DataConfig.model_validate(raw)
    except ValueError as e:
        print(f"lightning data: invalid configuration:\n{e}", file=sys.stderr)
        return 2

    records: list[dict[str, Any]] = []
    for path in args.inputs:
        records.extend(load_records(path, split=cfg.split))
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    sample = None
    if args.sampler:
        import importlib

        module_name, _, func_name = args.sampler.partition(":")
        sample = getattr(importlib.import_module(module_name), func_name)
    result = clean(records, cfg, tokenizer=tokenizer, sample=sample)

    out = Path(args.out)
    write_jsonl(out / "train.jsonl", result.train)
    write_jsonl(out / "eval.jsonl", result.eval)
    (out / "report.json").write_text(
        json.dumps([asdict(r) for r in result.reports], indent=2) + "\n", encoding="utf-8"
    )
    print(format_reports(result.reports))
    print(f"wrote {len(result.train)} train and {len(result.eval)} eval tasks to {out}")
    return 0
