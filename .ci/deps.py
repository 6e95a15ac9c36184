"""Print the dependencies of pyproject.toml extras (resolving self-references), one per line.

The Makefile installs these into the venv before building the extension, so
`maturin develop` finds every dependency already satisfied and stays fast.
"""

import re
import sys
import tomllib
from pathlib import Path

project = tomllib.loads(Path(__file__).resolve().parent.parent.joinpath("pyproject.toml").read_text())[
    "project"
]
name = project["name"]
extras = project.get("optional-dependencies", {})


def expand(requirement: str, seen: set[str]) -> list[str]:
    match = re.fullmatch(rf"{re.escape(name)}\[([^\]]+)\]", requirement.strip())
    if not match:
        return [requirement]
    out: list[str] = []
    for extra in match.group(1).split(","):
        extra = extra.strip()
        if extra in seen:
            continue
        seen.add(extra)
        for req in extras[extra]:
            out.extend(expand(req, seen))
    return out


wanted = sys.argv[1:] or ["dev"]
reqs = list(project["dependencies"])
for extra in wanted:
    reqs.extend(expand(f"{name}[{extra}]", set()))
print("\n".join(dict.fromkeys(reqs)))
