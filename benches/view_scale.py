"""`lightning view` on a large store: time to the first page and per page.

    .venv/bin/python benches/view_scale.py [--rollouts 100000] [--calls-per 10]
        [--sessions 10000] [--db PATH] [--pages 200]

Writes a store of ROLLOUTS x CALLS_PER calls (default 1,000,000) plus SESSIONS
online sessions of two calls each, through the store's own writer
(``rust/gateway/examples/fill_store.rs``: ``Store::create_rollout``,
``insert_calls``, ... with many writes in flight), unless ``--db`` names one
already written. Then, through the view's real HTTP API (starlette's test
client, in process):

- time to first page: open the store, ``GET /api/summary`` (counts per mode and
  status) and ``GET /api/rollouts?limit=50``, from a fresh ``View``;
- time per page: ``PAGES`` pages following ``next`` from the start, and pages
  deep in the table, filtered by status, mode and group;
- the calls chart (``/api/rate``) and the sessions page (``/api/sessions``).

Baseline, in the same run: what the view did before the reader could page,
reading every rollout row (``StoreReader.rollouts()``) to cut one page. The
page cache is warm (the store was just written or read); a cold disk adds its
reads to the first numbers.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def fill(db: Path, rollouts: int, per: int, sessions: int) -> None:
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    subprocess.run(
        ["cargo", "build", "--release", "-q", "-p", "lightning-gateway", "--example", "fill_store"],
        cwd=ROOT,
        check=True,
    )
    exe = target / "release" / "examples" / "fill_store"
    out = subprocess.run(
        [str(exe), str(db), str(rollouts), str(per), str(sessions)],
        check=True,
        capture_output=True,
        text=True,
    )
    print(f"filled: {out.stdout.strip()}  ({db.stat().st_size / 1e6:.0f} MB)")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def ms(s: float) -> str:
    return f"{s * 1000:.2f} ms"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rollouts", type=int, default=100_000)
    p.add_argument("--calls-per", type=int, default=10)
    p.add_argument("--sessions", type=int, default=10_000)
    p.add_argument("--db", type=Path, help="a store already written (skips the fill)")
    p.add_argument("--pages", type=int, default=200)
    args = p.parse_args()

    from starlette.testclient import TestClient

    from lightning._core import StoreReader
    from lightning.view.data import View
    from lightning.view.server import create_app

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    print(f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs, "
          f"{platform.system()} {platform.release()}; python {sys.version.split()[0]}; commit {commit}")  # fmt: skip
    tmp = None
    if args.db is None:
        tmp = tempfile.TemporaryDirectory(prefix="view-scale-")
        db = Path(tmp.name) / "big.db"
        t, _ = timed(lambda: fill(db, args.rollouts, args.calls_per, args.sessions))
        print(f"fill: {t:.1f} s")
    else:
        db = args.db

    # Time to first page: a fresh View, the summary and the first page, over HTTP.
    def first() -> tuple[dict[str, Any], dict[str, Any]]:
        with TestClient(create_app(View(db)), base_url="http://127.0.0.1") as c:
            s = c.get("/api/summary").json()
            page = c.get("/api/rollouts?limit=50").json()
        return s, page

    t_first, (summary, page) = timed(first)
    total = summary["rollouts"]
    print(f"store: {total} rollouts; by mode {summary['by_mode']}")
    print(f"time to first page (open + summary + 50 rollouts): {ms(t_first)}")
    assert len(page["rollouts"]) == 50 and page["next"]

    with TestClient(create_app(View(db)), base_url="http://127.0.0.1") as c:
        t_summary = min(timed(lambda: c.get("/api/summary"))[0] for _ in range(5))
        print(f"summary alone (best of 5): {ms(t_summary)}")
        per_page: list[float] = []
        nxt = None
        for _ in range(args.pages):
            q = "/api/rollouts?limit=50" + (f"&after={nxt}" if nxt else "")
            t, got = timed(lambda q=q: c.get(q).json())
            per_page.append(t)
            nxt = got["next"]
        print(f"time per page ({args.pages} pages of 50 from the start): "
              f"median {ms(statistics.median(per_page))}, max {ms(max(per_page))}")  # fmt: skip
        deep = f"r{max(total - 1000, 0):08d}"
        cases = {
            "deep (after the last 1000th)": f"/api/rollouts?limit=50&after={deep}",
            "status=running": "/api/rollouts?limit=50&status=running",
            "status=running, deep": f"/api/rollouts?limit=50&status=running&after={deep}",
            "mode=eval": "/api/rollouts?limit=50&mode=eval",
            "group=g1234": "/api/rollouts?limit=50&group=g1234",
            "calls chart (/api/rate, 600 s in 5 s buckets)": "/api/rate",
            "sessions page (50)": "/api/sessions?limit=50",
            "sessions with feedback, tag support": "/api/sessions?limit=50&feedback=1&tag=support",
            "sessions not trained, key bench": "/api/sessions?limit=50&trained=0&key=bench",
        }
        for name, url in cases.items():
            t = statistics.median(timed(lambda url=url: c.get(url).json())[0] for _ in range(5))
            print(f"  {name}: {ms(t)} (median of 5)")
        sessions = c.get("/api/sessions?limit=50").json()
        if sessions["next"]:
            t = statistics.median(
                timed(lambda: c.get(f"/api/sessions?limit=50&after={sessions['next']}").json())[0]
                for _ in range(5)
            )
            print(f"  sessions, second page: {ms(t)} (median of 5)")

    # Baseline: every rollout row read to cut one page (the view before this change).
    reader = StoreReader(db)
    t_all, rows = timed(reader.rollouts)
    print(f"baseline: every rollout row read ({len(rows)} rows) for one page: {ms(t_all)}; "
          f"paged query {t_all / statistics.median(per_page):.0f}x faster per page")  # fmt: skip
    if tmp is not None:
        tmp.cleanup()
    ok = t_first < 1.0
    print(f"under a second to the first page: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
