"""Real harness CLIs from the npm registry, installed once into a cache outside the clone.

``npm_executable(package, version, bin)`` installs ``package@version`` into
``$LIGHTNING_CACHE/npm/<name>/<version>`` on first use (into a sibling, then
renamed into place, so concurrent test processes never see half an install) and
returns ``node_modules/.bin/<bin>`` after checking it prints its version. If node,
npm or the registry cannot be reached the calling test fails and says so: it is
never skipped.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from lightning.model_cache import cache_dir


def npm_executable(package: str, version: str, bin: str, *, cache_name: str) -> Path:
    """The pinned launcher ``bin`` of ``package@version``, installed on first use."""
    root = cache_dir() / "npm" / cache_name / version
    launcher = root / "node_modules" / ".bin" / bin
    if not launcher.exists():
        _install(root, f"{package}@{version}")
    out = subprocess.run([str(launcher), "--version"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0 or version not in out.stdout:
        pytest.fail(
            f"{launcher} --version printed {out.stdout!r} {out.stderr!r}, expected {version}; "
            f"delete {root} to reinstall {package}"
        )
    return launcher


def _install(root: Path, spec: str) -> None:
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        pytest.fail(f"installing {spec} for the harness tests needs `node` and `npm` on PATH")
    root.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=f"{root.name}.build-", dir=root.parent))
    cmd = [npm, "install", "--prefix", str(build), "--no-audit", "--no-fund", spec]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        shutil.rmtree(build, ignore_errors=True)
        pytest.fail(f"`{' '.join(cmd)}` ran past 600 s: is the npm registry reachable?")
    if out.returncode != 0:
        shutil.rmtree(build, ignore_errors=True)
        pytest.fail(
            f"could not install {spec} from the npm registry (is it reachable? "
            f"`npm config get registry` names it):\n$ {' '.join(cmd)}\n{out.stderr[-3000:]}"
        )
    try:
        build.rename(root)
    except OSError:
        # Another process installed it first; its copy is complete.
        shutil.rmtree(build, ignore_errors=True)
