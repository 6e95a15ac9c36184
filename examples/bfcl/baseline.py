"""A BFCL baseline without training: the first N test ids of each category,
temperature 0, each answer capped at ``--max-tokens``, through the same harness
the recipe trains with (one rollout per case, BFCL's checker scores it).

    python examples/bfcl/baseline.py --engine-url http://127.0.0.1:PORT/v1 \\
        --categories irrelevance,live_simple --per-category 8 --max-tokens 256

The engine is any OpenAI-compatible server already running (``lightning serve``).
Prints one table row per category: mean score and its 95% bootstrap interval.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from lightning import Gateway, GatewayConfig
from lightning.apps import bfcl
from lightning.run.runner import Runner
from lightning.run.stats import reward_interval

HARNESS = Path(__file__).resolve().parent / "harness.sh"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine-url", required=True)
    p.add_argument("--categories", required=True)
    p.add_argument("--per-category", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--out", default="runs/bfcl-baseline")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    db = Path(tempfile.mkdtemp(prefix="bfcl-baseline-")) / "lightning.db"
    config = GatewayConfig(
        listen="127.0.0.1:0", upstreams=[{"url": args.engine_url, "weight_version": 1}], db=str(db)
    )
    handle = Gateway(config).start()
    client = handle.client()
    rows = []
    try:
        runner = Runner(
            client,
            ["sh", str(HARNESS)],
            reward_source="stdout",
            timeout_s=600,
            concurrency=args.concurrency,
        )
        for cat in args.categories.split(","):
            ids = bfcl.category_ids(cat)[: args.per_category]
            tasks = [
                {"id": i, "category": cat, "temperature": 0.0, "max_tokens": args.max_tokens}
                for i in ids
            ]
            t0 = time.monotonic()
            results = runner.run([(t, None) for t in tasks], mode="eval")
            rewards = {
                t["id"]: [r.reward if r.reward is not None else 0.0]
                for t, r in zip(tasks, results, strict=True)
            }
            iv = reward_interval(rewards)
            row = {
                "category": cat,
                "cases": len(ids),
                "score": iv.mean,
                "ci_low": iv.low,
                "ci_high": iv.high,
                "failed": sum(r.status != "succeeded" for r in results),
                "wall_s": round(time.monotonic() - t0, 1),
                "rewards": rewards,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        client.close()
        handle.stop()
    (out / "baseline.json").write_text(json.dumps(rows, indent=2))
    for r in rows:
        print(
            f"| {r['category']} | {r['cases']} | {r['score']:.3f} "
            f"({r['ci_low']:.3f}-{r['ci_high']:.3f}) | {r['failed']} | {r['wall_s']} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
