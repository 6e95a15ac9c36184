"""Task data: task files in and out (``files``), cleaning them (``clean``:
normalize, dedupe, length filter, split, decontaminate, pass rate) and the
``lightning data`` command (``cli``). Torch-free."""

from __future__ import annotations

from lightning.data.clean import (
    CleanResult,
    DataConfig,
    Sampler,
    StageReport,
    SupportsEncode,
    Task,
    clean,
    count_tokens,
    decontaminate,
    dedupe,
    dedupe_key,
    format_reports,
    length_filter,
    normalize,
    normalize_text,
    pass_rate_filter,
    pass_rate_filter_async,
    split,
    text_tokens,
    word_ngrams,
)
from lightning.data.files import load_records, load_tokenizer, write_jsonl

__all__ = [
    "CleanResult",
    "DataConfig",
    "Sampler",
    "StageReport",
    "SupportsEncode",
    "Task",
    "clean",
    "count_tokens",
    "decontaminate",
    "dedupe",
    "dedupe_key",
    "format_reports",
    "length_filter",
    "load_records",
    "load_tokenizer",
    "normalize",
    "normalize_text",
    "pass_rate_filter",
    "pass_rate_filter_async",
    "split",
    "text_tokens",
    "word_ngrams",
    "write_jsonl",
]
