"""Task files: JSONL, Parquet or a saved Hugging Face dataset in; JSONL out.

A task is a plain dict (``lightning.data.clean``); the loop reads its train and
eval tasks here, ``lightning data`` reads its inputs and writes its splits.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lightning.data.clean import SupportsEncode, Task


def load_records(path: str | Path, *, split: str | None = None) -> list[dict[str, Any]]:
    """Raw records from JSONL (``.jsonl``/``.json`` lines), Parquet, or a
    ``datasets`` dataset saved with ``save_to_disk`` (a directory)."""
    path = Path(path)
    if path.is_dir():
        return _load_hf_disk(path, split)
    if not path.exists():
        raise FileNotFoundError(f"no task file at {path}; pass a .jsonl, .parquet or a directory")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return [dict(row) for row in pq.read_table(path).to_pylist()]
    if suffix in (".jsonl", ".json", ".ndjson"):
        return _load_jsonl(path)
    raise ValueError(
        f"unknown task file type {path.suffix!r} for {path}; use .jsonl, .parquet, "
        "or a datasets directory written by save_to_disk"
    )


def _load_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); fix the line") from e
            if not isinstance(obj, dict):
                raise ValueError(
                    f"{path}:{lineno}: expected a JSON object per line, got {type(obj).__name__}"
                )
            records.append(obj)
    return records


def _load_hf_disk(path: Path, split: str | None) -> list[dict[str, Any]]:
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        names = list(ds.keys())
        if split is None:
            if len(names) == 1:
                split = names[0]
            elif "train" in ds:
                split = "train"
            else:
                raise ValueError(f"{path} holds splits {names}; choose one with split=...")
        if split not in ds:
            raise ValueError(f"{path} has no split {split!r}; it has {names}")
        ds = ds[split]
    return [dict(row) for row in ds]


def write_jsonl(path: str | Path, tasks: Iterable[Task]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for task in tasks:
            f.write(json.dumps(task, ensure_ascii=False, default=str) + "\n")


def load_tokenizer(path: str | Path) -> SupportsEncode:
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` file or a model
    directory that holds one."""
    from tokenizers import Tokenizer

    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.exists():
        raise FileNotFoundError(f"no tokenizer.json at {file}; pass a model dir or the file")
    return Tokenizer.from_file(str(file))
