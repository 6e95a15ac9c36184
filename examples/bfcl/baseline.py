"""A BFCL baseline without training: the first N test ids of each category,
temperature 0, each answer capped at ``--max-tokens``, through the same harness
the recipe trains with (one rollout per case, BFCL's checker scores it).

    python examples/bfcl/baseline.py --engine-url http://127.0.0.1:PORT/v1 \\
        --categories irrelevance,live_simple --per-category 8 --max-tokens 256

The engine is any OpenAI-compatible server already running (``lightning serve``).
Prints one table row per category: mean score and its 95% bootstrap interval, and
how BFCL's checker judged the answers (its ``error_type`` counts; ``ast_decoder:*``
means no call was found). ``--temperature 0.7 --samples 8`` asks whether sampling
ever writes a call: what GRPO needs to find a gradient (the shaped reward's mean is
printed too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from lightning import Gateway, GatewayConfig
from lightning.apps import bfcl
from lightning.run.runner import Runner
from lightning.run.stats import reward_interval

HERE = Path(__file__).resolve().parent
HARNESS = HERE / "harness.sh"
sys.path.insert(0, str(HERE))
from bfcl_harness import shaped_reward  # noqa: E402  (pure Python, no BFCL import)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine-url", required=True)
    p.add_argument("--categories", required=True)
    p.add_argument("--per-category", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--samples", type=int, default=1, help="rollouts per test case")
    p.add_argument("--out", default="runs/bfcl-baseline")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    db = Path(tempfile.mkdtemp(prefix="bfcl-baseline-")) / "lightning.db"
    config = GatewayConfig(
        listen="127.0.0.1:0",
        upstreams=[{"url": args.engine_url, "weight_version": 1}],
        db=str(db),
        # `lightning serve` needs its key: export LIGHTNING_ENGINE_KEY for both.
        upstream_api_key=os.environ.get("LIGHTNING_ENGINE_KEY"),
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
            task = {"category": cat, "temperature": args.temperature, "max_tokens": args.max_tokens}
            tasks = [{"id": i, **task} for i in ids for _ in range(args.samples)]
            t0 = time.monotonic()
            results = runner.run([(t, None) for t in tasks], mode="eval")
            rewards: dict[str, list[float]] = {}
            verdicts: Counter[str] = Counter()
            shaped = []
            for t, r in zip(tasks, results, strict=True):
                rewards.setdefault(t["id"], []).append(r.reward if r.reward is not None else 0.0)
                error_type = bfcl.last_json(r.stdout_tail).get("bfcl", {}).get("error_type")
                verdicts[error_type or ("correct" if r.reward else "harness failed")] += 1
                shaped.append(shaped_reward(r.reward or 0.0, error_type))
            iv = reward_interval(rewards)
            row = {
                "category": cat,
                "cases": len(ids),
                "samples": args.samples,
                "temperature": args.temperature,
                "score": iv.mean,
                "ci_low": iv.low,
                "ci_high": iv.high,
                "shaped_mean": sum(shaped) / len(shaped),
                "verdicts": dict(verdicts),
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
            f"({r['ci_low']:.3f}-{r['ci_high']:.3f}) | {r['shaped_mean']:.3f} | "
            f"{r['verdicts']} | {r['failed']} | {r['wall_s']} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
