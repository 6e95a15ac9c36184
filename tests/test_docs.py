"""The docs stay true to the tree: README.md, docs/*.md and benches/README.md.

No network, no GPU, no model: links resolve to files (and headings) that exist,
every `lightning <command>` is a real subcommand, every `make <target>` a real
target, every repository path and `tests/...py::test` names a file and a test
that exist, and every `lightning...` import and dotted name imports. The README
stays a front door: short, with the two set-up commands first.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, ROOT / "benches" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 220

FENCE = re.compile(r"^```(\w*)\s*$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
SPAN = re.compile(r"`([^`\n]+)`")
SHELL = {"bash", "sh", "shell", "console"}
# `lightning train`, `python -m lightning.cli train`; not `lightning-gateway`, not `lightning.db`.
COMMAND = re.compile(r"(?<![\w./-])lightning(?:\.cli)?[ \t]+([a-z][\w-]*)")
MAKE = re.compile(r"(?<![\w./-])make[ \t]+([a-z][\w-]*)")
DOTTED = re.compile(r"(?<![\w./-])lightning(?:\.[A-Za-z_]\w*)+")
FILE_SUFFIXES = {"db", "toml", "json", "jsonl", "py", "md", "html", "txt"}
# A repository path in a code span: a top-level folder, then a file with a suffix.
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:python|rust|tests|benches|examples|docs|\.ci)/[\w./-]*\.\w+)(?:::(\w+))?"
)
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")
# `lightning/rl/losses.py`: the package path without `python/`.
PACKAGE_PATH = re.compile(r"(?<![\w./-])(lightning/[\w/]+\.py)\b")


@dataclass
class Doc:
    path: Path
    prose: list[str]  # lines outside fenced blocks
    blocks: list[tuple[str, str]]  # (language, text) of each fenced block

    @property
    def name(self) -> str:
        return str(self.path.relative_to(ROOT))

    def spans(self) -> list[str]:
        return [m.group(1) for line in self.prose for m in SPAN.finditer(line)]


def parse(path: Path) -> Doc:
    prose: list[str] = []
    blocks: list[tuple[str, str]] = []
    lang, body = None, []
    for line in path.read_text().splitlines():
        m = FENCE.match(line)
        if lang is None and m:
            lang, body = m.group(1), []
        elif lang is not None and line.strip() == "```":
            blocks.append((lang, "\n".join(body)))
            lang = None
        elif lang is not None:
            body.append(line)
        else:
            prose.append(line)
    assert lang is None, f"{path}: a ``` block is never closed"
    return Doc(path, prose, blocks)


PARSED = [parse(p) for p in DOCS]


def ids(docs: list[Doc]) -> list[str]:
    return [d.name for d in docs]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in parse(path).prose if line.startswith("#")}


def cli_tables() -> tuple[set[str], set[str]]:
    """`SUBCOMMANDS` and `ONLINE` of python/lightning/cli.py, read without importing."""
    tree = ast.parse((ROOT / "python" / "lightning" / "cli.py").read_text())
    found: dict[str, set[str]] = {}
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        if isinstance(target, ast.Name) and target.id in ("SUBCOMMANDS", "ONLINE"):
            assert node.value is not None
            found[target.id] = set(ast.literal_eval(node.value))
    return found["SUBCOMMANDS"], found["ONLINE"]


def shell_lines(doc: Doc) -> list[str]:
    out = []
    for lang, text in doc.blocks:
        if lang in SHELL:
            out += [re.sub(r"(^|\s)#.*", "", line) for line in text.splitlines()]
    return out


def test_readme_is_a_front_door() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}); move the detail "
        "into docs/ and link it from 'Where to go next'"
    )
    first_lang, first = PARSED[0].blocks[0]
    assert "make demo" in first and "make test" in first, (
        f"README.md's first code block ({first_lang}) must hold `make demo` and `make test`: "
        f"{first!r}"
    )
    linked = {m.group(1) for line in PARSED[0].prose for m in LINK.finditer(line)}
    unlinked = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")} - linked
    assert not unlinked, f"docs the README does not link to: {sorted(unlinked)}"


@pytest.mark.parametrize("doc", PARSED, ids=ids(PARSED))
def test_relative_links_resolve(doc: Doc) -> None:
    broken = []
    for line in doc.prose:
        for m in LINK.finditer(line):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked offline
            file, _, anchor = target.partition("#")
            dest = (doc.path.parent / file).resolve() if file else doc.path
            if not dest.exists():
                broken.append(f"{target} (no {dest.relative_to(ROOT)})")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not broken, f"{doc.name}: broken links: {broken}"


@pytest.mark.parametrize("doc", PARSED, ids=ids(PARSED))
def test_named_commands_exist(doc: Doc) -> None:
    subcommands, online = cli_tables()
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, re.M))
    wrong = []
    for text in shell_lines(doc) + doc.spans():
        for m in COMMAND.finditer(text):
            name = m.group(1)
            if name not in subcommands:
                wrong.append(f"lightning {name}: not in cli.SUBCOMMANDS")
            elif "--online" in text[m.end() :].split("&&")[0] and name not in online:
                wrong.append(f"lightning {name} --online: not in cli.ONLINE")
        for m in MAKE.finditer(text):
            if m.group(1) not in targets:
                wrong.append(f"make {m.group(1)}: no such Makefile target")
    assert not wrong, f"{doc.name}: {wrong}"


@pytest.mark.parametrize("doc", PARSED, ids=ids(PARSED))
def test_named_paths_exist(doc: Doc) -> None:
    missing = []
    # Spans line by line, so that `::test_b` after `tests/x.py::test_a` means tests/x.py.
    texts = [SPAN.findall(line) for line in doc.prose] + [[t] for _, t in doc.blocks]
    for spans in texts:
        last: Path | None = None
        for text in spans:
            if text.startswith("::") and last is not None:
                text = f"{last.relative_to(ROOT)}{text}"
            for m in REPO_PATH.finditer(text):
                path, test = ROOT / m.group(1), m.group(2)
                if any(PLACEHOLDER.match(part.split(".")[0]) for part in path.parts):
                    continue  # benches/NAME.py: a pattern, not a path
                last = path
                if not path.exists():
                    missing.append(m.group(1))
                elif test and path.suffix == ".py" and not has_test(path, test):
                    missing.append(f"{m.group(1)}::{test}")
            missing += check_package_paths(text)
    assert not missing, f"{doc.name}: named but not in the tree: {missing}"


def has_test(path: Path, name: str) -> bool:
    return re.search(rf"^\s*(?:async )?def {name}\b", path.read_text(), re.M) is not None


def check_package_paths(text: str) -> list[str]:
    missing = []
    for m in PACKAGE_PATH.finditer(text):
        if not (ROOT / "python" / m.group(1)).exists():
            missing.append(m.group(1))
    return missing


def python_imports(doc: Doc) -> list[str]:
    """Every `import lightning...` / `from lightning... import ...` of the Python blocks."""
    out = []
    for lang, text in doc.blocks:
        if lang != "python":
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            if any(n == "lightning" or n.startswith("lightning.") for n in names):
                out.append(ast.unparse(node))
    return out


def dotted_names(doc: Doc) -> set[str]:
    texts = doc.spans() + [text for lang, text in doc.blocks if lang == "python"]
    found = {m.group(0) for text in texts for m in DOTTED.finditer(text)}
    return {n for n in found if n.rsplit(".", 1)[-1] not in FILE_SUFFIXES}


# Runs in a fresh interpreter: each import line as written, then each dotted name
# as the longest importable module prefix plus attributes.
CHECK = """
import importlib, json, sys
lines, names = json.loads(sys.argv[1])
bad = []
for line in lines:
    try:
        exec(line, {})
    except Exception as e:
        bad.append(f"{line}: {type(e).__name__}: {e}")
for name in names:
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
            break
        except ModuleNotFoundError:
            continue
    try:
        for attr in parts[k:]:
            obj = getattr(obj, attr)
    except AttributeError as e:
        bad.append(f"{name}: {e}")
print(json.dumps(bad))
"""


def test_python_in_the_docs_imports() -> None:
    lines = sorted({line for d in PARSED for line in python_imports(d)})
    names = sorted({n for d in PARSED for n in dotted_names(d)})
    assert lines and names, "the docs name no lightning imports: has the parser broken?"
    done = subprocess.run(
        [sys.executable, "-c", CHECK, json.dumps([lines, names])],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    bad = json.loads(done.stdout.strip().splitlines()[-1])
    assert not bad, f"imports or names in the docs that do not resolve: {bad}"


# --- The code map and the docs the code cites ---------------------------------

ARCHITECTURE = ROOT / "docs" / "architecture.md"
# The sections of docs/architecture.md that map a source tree, by the path in
# their heading, and the files each must name.
CODE_MAPS = {
    "rust/core": (ROOT / "rust" / "core" / "src", "*.rs"),
    "rust/gateway": (ROOT / "rust" / "gateway" / "src", "*.rs"),
    "rust/python": (ROOT / "rust" / "python" / "src", "*.rs"),
    "python/lightning": (ROOT / "python" / "lightning", "*.py"),
}
# A package's own file: its row in the map stands for it.
PACKAGE_FILES = {"__init__.py", "mod.rs"}
# Where code and docs cite other files: comments and docstrings as well as prose.
CITING = [
    *(
        p
        for d in ("python", "rust", "tests", "benches", "examples", ".ci")
        for p in (ROOT / d).rglob("*")
        if p.suffix in {".py", ".rs", ".js", ".html", ".toml"}
    ),
    ROOT / "Makefile",
    *DOCS,
]
# `docs/design.md#merge`, `notes/x/README.md`, a bare `DESIGN.md`.
CITED_DOC = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w.-]+\.md)(?:#([\w-]+))?")
NOTES = re.compile(r"(?<![\w./-])(notes/[\w./-]*\w)")


def map_sections(text: str) -> dict[str, list[str]]:
    """The table rows of each `### `path` ...` section of the code map."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("#"):
            spans = SPAN.findall(line)
            current = out.setdefault(spans[0], []) if line.startswith("### ") and spans else None
        elif current is not None and line.startswith("| ") and not line.startswith("| module"):
            current.append(line)
    return out


def unmapped(rows: list[str], parts: tuple[str, ...]) -> bool:
    """Whether no row names the module at ``parts`` (its path inside the source root):
    a top-level module in a row's first cell (`trie`, `config.py`); a module in a
    folder in the folder's row (first cell `store/`), with every folder below and
    the file itself named in that row (`weight_sync/` and `base.py`, or one
    `openai_responses/tests.rs`)."""
    stem = parts[-1].rsplit(".", 1)[0]
    for row in rows:
        first = set(SPAN.findall(row.split("|")[1]))
        spans = set(SPAN.findall(row))
        if len(parts) == 1:
            if first & {parts[0], stem}:
                return False
            continue
        if f"{parts[0]}/" not in first:
            continue
        rest = parts[1:]
        if rest[-1] in PACKAGE_FILES:
            # A sub-package's own file: its folder named in the row stands for it.
            if all(f"{d}/" in spans for d in rest[:-1]):
                return False
            continue
        if "/".join(rest) in spans:
            return False
        dirs_named = all(f"{d}/" in spans for d in rest[:-1])
        if dirs_named and spans & {rest[-1], rest[-1].rsplit(".", 1)[0]}:
            return False
    return True


def test_the_code_map_names_every_module() -> None:
    sections = map_sections(ARCHITECTURE.read_text())
    missing = []
    for heading, (root, pattern) in CODE_MAPS.items():
        assert heading in sections, f"docs/architecture.md has no `### `{heading}`` section"
        for path in sorted(root.rglob(pattern)):
            parts = path.relative_to(root).parts
            if unmapped(sections[heading], parts):
                missing.append(str(path.relative_to(ROOT)))
    assert not missing, (
        f"modules docs/architecture.md does not name (add each to its table, with what it "
        f"holds): {missing}"
    )


def test_the_code_map_check_can_fail() -> None:
    rows = [
        "| `trie` | the merge |",
        "| `store/` | `mod` (the writer), `secret` |",
        "| `run/` | `loop.py`, `weight_sync/` (`base.py`) |",
        "| `protocol/` | `openai_responses/tests.rs` |",
    ]
    named = [("trie.rs",), ("store", "secret.rs"), ("store", "mod.rs"), ("run", "loop.py")]
    named += [("run", "weight_sync", "base.py"), ("protocol", "openai_responses", "tests.rs")]
    named += [("run", "weight_sync", "__init__.py"), ("run", "__init__.py")]
    assert not [p for p in named if unmapped(rows, p)]
    unnamed = [("drift.rs",), ("store", "reader.rs"), ("run", "weight_sync", "vllm.py")]
    unnamed += [("view", "data.py"), ("run", "sglang", "base.py"), ("run", "x", "__init__.py")]
    assert [p for p in unnamed if unmapped(rows, p)] == unnamed


def cited_docs(text: str) -> list[tuple[str, str | None]]:
    return [(m.group(1), m.group(2)) for m in CITED_DOC.finditer(text)] + [
        (m.group(1), None) for m in NOTES.finditer(text)
    ]


def broken_citations(path: Path, text: str) -> list[str]:
    """Files (and headings) that ``text`` cites but the repository lacks. A path
    with a folder resolves from the repository root (or, in a doc, beside it); a
    bare name (`README.md`) must exist somewhere in the tree."""
    broken = []
    for cited, anchor in cited_docs(text):
        if "/" in cited:
            candidates = [ROOT / cited, path.parent / cited]
        else:
            candidates = [path.parent / cited, *ROOT.glob(f"*/{cited}"), ROOT / cited]
        found = next((c for c in candidates if c.exists()), None)
        where = f"{path.relative_to(ROOT)}: {cited}"
        if found is None:
            broken.append(f"{where} (no such file in the repository)")
        elif anchor and found.suffix == ".md" and anchor not in anchors(found):
            broken.append(f"{where}#{anchor} (no such heading)")
    return broken


def test_cited_docs_exist() -> None:
    """Code and docs cite only files in the repository: `docs/design.md#merge` in a
    comment names a file and a heading that exist, and nothing points at notes that
    live outside the tree."""
    # This file is left out: its own check's examples cite what does not exist.
    files = [p for p in CITING if p.is_file() and p != Path(__file__).resolve()]
    broken = [b for p in files for b in broken_citations(p, p.read_text())]
    assert not broken, f"cited but not in the repository: {broken}"


def test_the_citation_check_can_fail() -> None:
    here = ROOT / "python" / "lightning" / "config.py"
    outside = "DESIGN" + ".md"
    text = f"see {outside} §5, docs/design.md#merge, docs/design.md#nowhere, notes/x/run4"
    assert broken_citations(here, text) == [
        f"python/lightning/config.py: {outside} (no such file in the repository)",
        "python/lightning/config.py: docs/design.md#nowhere (no such heading)",
        "python/lightning/config.py: notes/x/run4 (no such file in the repository)",
    ]
