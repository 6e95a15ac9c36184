"""``lightning show ROLLOUT_ID (--db PATH | --run RUN_DIR)``: one rollout's
merged trace in the terminal, generated tokens coloured.

From a store it reads the rollout's calls through ``lightning.Store`` (the
gateway's Rust reader), merges them with the radix trie (divergences classified
with the policy's tokenizer) and decodes each token; from a run directory it
prints the records the loop wrote to ``traces.jsonl``. Rows and drawing come
from ``lightning.traces``, the same ones the report and the view use.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from lightning.run.harnesses import harness_of
from lightning.run.report import read_jsonl
from lightning.traces import (
    divergence_rows,
    fmt_value,
    render_trace_terminal,
    sample_row,
    trace_record,
)
from lightning.view.data import run_paths


def trace_records_from_store(
    db: str, rollout_id: str, model_dir: str | None = None
) -> list[dict[str, Any]]:
    """One rollout's merged samples from the gateway store, as ``traces.jsonl`` records.

    Without a tokenizer (a standalone gateway's store and no ``model_dir``) the
    samples are still merged and shown, each token as its id (``⟨id⟩``), and
    divergences are unclassified.
    """
    from lightning import Store, Tokenizer, merge_calls

    path = Path(db)
    if not path.exists():
        raise FileNotFoundError(f"store {db} does not exist")
    with Store(path) as store:
        calls = store.trace(rollout_id)
        reward = store.rewards().get(rollout_id)
        info = next((r for r in store.rollouts() if r["rollout_id"] == rollout_id), None)
    if info is None:
        raise LookupError(f"rollout {rollout_id!r} is not in {db}")
    if not calls:
        return []
    # A store inside a run directory: the policy named by RUN_DIR/config.json.
    model = model_dir or run_paths(path.parent)[1]
    tokenizer = Tokenizer.from_dir(str(model)) if model else None
    merged = merge_calls(calls, tokenizer=tokenizer)
    divergences = divergence_rows(merged, rollout_id)
    records = []
    for sample in merged.samples:
        row = sample_row(sample, tokenizer)
        # Every sample of the rollout is printed, each with the divergences
        # that fall inside it.
        inside = [d for d in divergences if d["position"] < len(row["tokens"])]
        records.append(
            {
                **trace_record(
                    row,
                    inside,
                    rollout_id=rollout_id,
                    reward=reward,
                    task=info["task"],
                    harness=harness_of(info["task"]),
                ),
                "decoded": tokenizer is not None,
            }
        )
    return records


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="lightning show", description="Print one rollout's merged trace, coloured."
    )
    p.add_argument("rollout_id")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--db", help="gateway store (SQLite file)")
    src.add_argument("--run", help="run directory with traces.jsonl")
    p.add_argument("--model", help="model dir for the tokenizer (default: from the run's config)")
    p.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="ANSI colours (auto: when stdout is a terminal); never: generated text in «…»",
    )
    args = p.parse_args(argv)
    if args.db:
        try:
            records = trace_records_from_store(args.db, args.rollout_id, args.model)
        except FileNotFoundError as e:
            print(f"lightning show: {e}", file=sys.stderr)
            return 2
        except LookupError as e:
            print(f"lightning show: {e}", file=sys.stderr)
            return 1
    else:
        records = [
            t
            for t in read_jsonl(Path(args.run) / "traces.jsonl")
            if str(t.get("rollout_id")) == args.rollout_id
        ]
    if not records:
        print(f"lightning show: no trace for rollout {args.rollout_id!r}", file=sys.stderr)
        return 1
    if any(t.get("decoded") is False for t in records):
        print(
            "lightning show: no tokenizer for this store (no run config next to it): "
            "tokens are shown as ids; pass --model DIR to decode them",
            file=sys.stderr,
        )
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    for i, t in enumerate(records):
        divs = t.get("divergences") or []
        harness = f" · harness {t['harness']}" if t.get("harness") else ""
        print(
            f"— rollout {t.get('rollout_id')}{harness} · step {t.get('step', '?')} · sample {i} · "
            f"reward {fmt_value(t.get('reward'))} · {len(divs)} divergences"
        )
        print(
            render_trace_terminal(t.get("pieces") or [], t.get("weights") or [], divs, color=color)
        )
    return 0
