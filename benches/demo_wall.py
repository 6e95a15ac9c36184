"""The wall clock of `lightning demo` (what `make demo` runs) with the prefix cache on vs off.

Runs ``lightning demo`` twice, one after the other, in fresh output directories:
once as shipped (``[engine] kv_cache_bytes`` of examples/demo.toml, default 1 GiB)
and once with ``--kv-cache-bytes 0`` (the cache off); every other flag is passed
through to both (``--steps``, ``--seed``, ``--model``). Prints per run the wall
clock, the CPU-seconds of the demo and everything it started and waited for
(its engine process included; the figure a loaded machine moves least), the
demo's own ``wall_s`` from ``demo.json`` (task generation to the end of the
final eval), its held-out reward, then the off/on ratios.

Run (the full demo, twice; on an idle machine that is about 2 x 10 minutes):
``.venv/bin/python benches/demo_wall.py``. Smallest check that it works:
``nice -n 19 .venv/bin/python benches/demo_wall.py --steps 1 --model tiny``
(a random tiny model: it checks the plumbing, its times say nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benches"))

from engine import machine  # noqa: E402

VARIANTS = {"on": [], "off": ["--kv-cache-bytes", "0"]}


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_demo(lightning: str, flags: list[str], out: Path) -> dict[str, float]:
    argv = [lightning, "demo", *flags, "--output-dir", str(out)]
    print("$ " + " ".join(argv), flush=True)
    cpu, start = children_cpu(), time.perf_counter()
    done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - start, children_cpu() - cpu
    if done.returncode != 0:
        raise SystemExit(f"lightning demo exited {done.returncode}:\n{done.stderr[-4000:]}")
    record = json.loads((out / "demo.json").read_text())
    final = record["evals"][-1]["reward"] if record["evals"] else float("nan")
    return {"wall": wall, "cpu": cpu, "demo_wall": record["wall_s"], "final": final}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, help="passed to lightning demo (default: its 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", choices=["smollm2-135m-instruct", "tiny"])
    parser.add_argument("--order", nargs=2, choices=list(VARIANTS), default=["on", "off"])
    parser.add_argument("--keep", help="keep the demo output dirs under this directory")
    args = parser.parse_args()
    lightning = str(Path(sys.executable).with_name("lightning"))
    flags = ["--seed", str(args.seed)]
    if args.steps is not None:
        flags += ["--steps", str(args.steps)]
    if args.model is not None:
        flags += ["--model", args.model]
    print(machine(), flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="demo-wall-") as tmp:
        base = Path(args.keep) if args.keep else Path(tmp)
        for name in args.order:
            results[name] = run_demo(lightning, flags + VARIANTS[name], base / f"cache-{name}")
    print(
        f"\n{'cache':>5} {'wall':>9} {'cpu-s':>9} {'demo wall_s':>12} {'final reward':>13}"
        f"  (flags: {' '.join(flags)})"
    )
    for name, r in results.items():
        print(
            f"{name:>5} {r['wall']:>8.1f}s {r['cpu']:>9.1f} {r['demo_wall']:>11.1f}s"
            f" {r['final']:>13.3f}"
        )
    on, off = results["on"], results["off"]
    print(
        f"off/on: wall {off['wall'] / on['wall']:.2f}x, cpu-s {off['cpu'] / on['cpu']:.2f}x, "
        f"demo wall_s {off['demo_wall'] / on['demo_wall']:.2f}x"
    )
    print(f"after: {machine()}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
