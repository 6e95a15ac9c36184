"""The package's import graph: no circles and no upward arrows.

Every ``import`` of a ``lightning`` module counts, wherever it sits (top of the
file, inside a function, under ``TYPE_CHECKING``): a function-local import
still ties the two modules together, it only hides the tie from the reader.
The layers are declared once, here; a new module lands in its package's layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "python" / "lightning"

# Lowest first. A module may import its own layer or any layer below it; within
# one layer the graph must still be acyclic. `lightning` is the package's
# `__init__` (the public names), which sits on top of `gateway`; its lazy
# front door (`from lightning import Trainer`) names higher modules by dotted
# path and imports them only on first use, so it is no import of this module.
LAYERS: list[set[str]] = [
    {"_core"},
    {"modes", "model_cache", "traces", "data"},
    {"gateway"},
    {"lightning"},
    {"sync"},
    {"config"},
    {"engine"},
    {"rl"},
    {"run"},
    {"online"},
    {"view"},
    {"apps"},
    {"cli"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found = {module_name(p): p for p in ROOT.rglob("*.py")}
    found["lightning._core"] = ROOT / "_core.pyi"
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The `lightning` modules `path` imports, resolved to modules (not names)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from lightning.x import y` imports lightning.x.y when that is a module.
            targets = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                for a in node.names
            ]
        else:
            continue
        out.update(t for t in targets if t == "lightning" or t.startswith("lightning."))
    return out


def layer(module: str) -> str:
    parts = module.split(".")
    return "lightning" if len(parts) == 1 else parts[1]


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(p, known) - {m} for m, p in known.items() if p.suffix == ".py"}


def test_every_module_has_a_layer() -> None:
    assert {layer(m) for m in graph()} <= set(RANK), "add the new package to LAYERS"


def test_no_upward_import() -> None:
    upward = [
        f"{m} -> {t}" for m, ts in graph().items() for t in ts if RANK[layer(t)] > RANK[layer(m)]
    ]
    assert upward == []


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for t in sorted(g.get(n, ())):
            if state.get(t) == 1:
                return [*stack[stack.index(t) :], t]
            if t not in state and (found := visit(t)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_circle() -> None:
    assert find_cycle(graph()) is None


@pytest.mark.parametrize(
    "g, cyclic",
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
        ({"a": {"a"}}, True),
    ],
)
def test_cycle_finder(g: dict[str, set[str]], cyclic: bool) -> None:
    assert (find_cycle(g) is not None) is cyclic


def test_the_package_never_opens_sqlite_itself() -> None:
    """Every store access goes through the Rust store: a second SQLite library
    in a process that has the store open loses commits
    (``lightning/gateway/store_guard.py``)."""
    users = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(n.split(".")[0] in ("sqlite3", "_sqlite3") for n in names):
                users.append(str(path.relative_to(ROOT)))
    assert users == []
