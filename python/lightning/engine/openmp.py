"""Keep the engine's OpenMP workers spinning: release the pool of a thread that is done.

Why: PyTorch's CPU kernels run on GNU OpenMP (libgomp). Every thread that
opens a parallel region gets a pool of worker threads of its own, and libgomp
counts the workers of all pools together. While that count is at most the
number of CPUs, a worker that finishes a region spins for about 3 ms before it
sleeps, so the next region starts at once. When the count exceeds the CPUs,
libgomp "throttles": workers spin 100 iterations and then sleep on a futex,
and every later region pays to wake them. A decode step opens ~1,000 small
regions, so that wake-up is a large share of it.

The engine loads the model on the caller's thread (which opens regions and so
gets a pool) and then computes on its scheduler thread (a second pool). On a
2-core machine that is 4 managed threads for 2 CPUs: throttled. Measured with
SmolLM2-135M, batch 32, on the 2-core machine of benches/README.md: a decode
forward took ~114 ms on the scheduler thread and ~88 ms on the loading thread
itself; after the loading thread released its pool, ~87 ms on the scheduler.

``omp_pause_resource_all`` (OpenMP 5.0) frees the calling thread's pool; in
libgomp it also lowers the managed count, so the scheduler's pool spins
again. A later parallel region on the released thread builds a new pool (a
few thread creations), so calling it is always safe, only never free.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path

import torch

# omp_pause_resource_t: omp_pause_soft = 1 (libgomp treats soft and hard alike).
_PAUSE_SOFT = 1


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp that torch itself loaded, or None (another OpenMP runtime, or
    not Linux). Found in /proc/self/maps, because other wheels bundle their own
    copies of libgomp (each with its own pools and counts) and loading by name
    may pick one of those."""
    if not sys.platform.startswith("linux"):
        return None
    torch_dir = str(Path(torch.__file__).resolve().parent)
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if path.startswith(torch_dir):
            lib = ctypes.CDLL(path)
            if hasattr(lib, "omp_pause_resource_all"):
                lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
                lib.omp_pause_resource_all.restype = ctypes.c_int
                return lib
    return None


def release_workers() -> bool:
    """Free the calling thread's OpenMP worker pool; True when it was done.

    Call it on a thread that has finished its torch work (the thread that
    loaded the engine's model), never from inside a parallel region.
    """
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(_PAUSE_SOFT) == 0
