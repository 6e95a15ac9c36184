"""Fail when a tracked path is a symlink that points outside the repository.

A committed `.venv -> /root/.cache/...` link once broke `make test` on every
machine without that cache (`[Errno 17] File exists: '.venv'`).
"""

import subprocess
import sys
from pathlib import Path

root = Path(__file__).resolve().parent.parent
listing = subprocess.run(
    ["git", "ls-files", "-s"], cwd=root, capture_output=True, text=True, check=True
).stdout
bad = []
for line in listing.splitlines():
    meta, path = line.split("\t", 1)
    if meta.split()[0] != "120000":  # git's mode for a symlink
        continue
    target = (root / path).parent / Path((root / path).readlink())
    if not target.resolve().is_relative_to(root):
        bad.append(f"{path} -> {(root / path).readlink()}")
if bad:
    sys.exit("tracked symlinks leave the repository (remove them, ignore the path):\n  " + "\n  ".join(bad))
