"""Task cleaning (``lightning data``): normalize → dedupe → length filter → split → decontaminate → pass rate.

A *task* is a plain dict ``{"id": str, "prompt": str, "answer": ..., **extra}``: the
runner hands it to the harness as ``LIGHTNING_TASK`` JSON, so it must stay
JSON-serializable and carry whatever the harness needs (extra fields pass through).

Every stage is a pure function that returns its output and a :class:`StageReport`
(counts in and out, plus why items were dropped), and :func:`clean` chains them.
Choices where the issue was silent:

1. Text normalization is NFKC, CRLF → LF and stripping the ends. Interior
   whitespace is kept (prompts may hold code); it is collapsed only inside the
   dedupe/decontamination keys.
2. The dedupe and decontamination keys are case-folded words *and symbols*
   (:func:`text_tokens`): sentence punctuation is ignored, but operators are
   not, so "What is 2+2?" equals "what is 2 + 2" while "17 + 25" differs from
   "17 * 25". Dedupe is on the prompt only: two tasks with the same prompt but different
   answers are a conflict, not two tasks; the first one wins and the report
   counts the conflicts.
3. Decontamination compares n-grams of those tokens in prompts. A prompt with
   fewer than ``n`` words contributes its whole word sequence as one gram, so
   short templated prompts are caught only when they are identical. Every train
   task that shares a gram with any eval task is dropped (eval is never touched:
   it is the yardstick).
4. The pass-rate filter runs on train tasks only (filtering eval with the model
   being evaluated would bias the yardstick) and is the last stage because it
   is the only expensive one. A sample is *solved* when its reward is at least
   ``solve_threshold``; a task is kept when ``min_pass_rate < pass rate <
   max_pass_rate`` (defaults drop exactly the always- and never-solved tasks).
   Kept tasks carry their measured ``pass_rate``.

This module imports no torch and no tokenizer library at import time.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import random
import re
import tomllib
import unicodedata
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

Task = dict[str, Any]
# sample(task, k) -> k rewards; the loop passes one that samples the current
# model k times through the engine. It may be async.
Sampler = Callable[[Task, int], "Sequence[float] | Awaitable[Sequence[float]]"]


class SupportsEncode(Protocol):
    def encode(self, text: str, /, *args: Any, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class StageReport:
    """Counts of one stage: ``n_in`` items went in, ``n_out`` came out."""

    stage: str
    n_in: int
    n_out: int
    detail: str = ""

    @property
    def dropped(self) -> int:
        return self.n_in - self.n_out

    def __str__(self) -> str:
        tail = f"  ({self.detail})" if self.detail else ""
        return f"{self.stage:<16} {self.n_in:>8} → {self.n_out:<8} -{self.dropped}{tail}"


class DataConfig(BaseModel):
    """How tasks are cleaned. Read from TOML (top level or a ``[data]`` table)."""

    model_config = ConfigDict(extra="forbid")

    prompt_field: str = "prompt"
    answer_field: str | None = "answer"
    id_field: str | None = "id"
    # Keep fields other than id/prompt/answer (the harness may need them).
    keep_extra: bool = True
    # Load this split when the input is a datasets.DatasetDict saved to disk.
    split: str | None = None

    dedupe: Literal["none", "exact", "normalized"] = "normalized"

    # Token bounds on the prompt (inclusive); need a tokenizer.
    min_tokens: int = Field(default=0, ge=0)
    max_tokens: int | None = Field(default=None, ge=1)

    # Held-out eval split: a fixed size wins over a fraction.
    eval_fraction: float = Field(default=0.1, ge=0.0, lt=1.0)
    eval_size: int | None = Field(default=None, ge=0)
    seed: int = 0

    # Word n-gram size for decontamination; 0 turns it off.
    decontaminate_ngram: int = Field(default=8, ge=0)

    # Pass-rate filter (needs a sampler); k = 0 turns it off.
    pass_rate_k: int = Field(default=0, ge=0)
    solve_threshold: float = 1.0
    min_pass_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    max_pass_rate: float = Field(default=1.0, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.max_tokens is not None and self.max_tokens < self.min_tokens:
            raise ValueError(
                f"max_tokens={self.max_tokens} is below min_tokens={self.min_tokens}; "
                "raise max_tokens or lower min_tokens"
            )
        if self.min_pass_rate >= self.max_pass_rate:
            raise ValueError(
                f"min_pass_rate={self.min_pass_rate} must be below "
                f"max_pass_rate={self.max_pass_rate}"
            )
        return self

    @classmethod
    def from_toml(cls, path: str | Path) -> DataConfig:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
        return cls.model_validate(raw.get("data", raw))


@dataclass
class CleanResult:
    train: list[Task]
    eval: list[Task]
    reports: list[StageReport]


# ---------------------------------------------------------------- text keys


# Words, plus every other non-space character as its own token, minus sentence
# punctuation: "17 + 25" and "17 * 25" must not collide (operators matter), while
# "What is 2+2?" and "what is 2 + 2" should.
_TOKEN = re.compile(r"\w+|[^\w\s]")
_IGNORED = frozenset(".,;:!?\"'`“”‘’«»…")


def text_tokens(text: str) -> list[str]:
    """Case-folded words and symbols of ``text``, sentence punctuation dropped."""
    folded = unicodedata.normalize("NFKC", text).casefold()
    return [t for t in _TOKEN.findall(folded) if t not in _IGNORED]


def normalize_text(text: str) -> str:
    """NFKC, CRLF → LF, ends stripped; interior whitespace kept."""
    return unicodedata.normalize("NFKC", text).replace("\r\n", "\n").replace("\r", "\n").strip()


def dedupe_key(text: str) -> str:
    """Key under which near-identical prompts collide: case, whitespace and
    sentence-punctuation differences vanish (see :func:`text_tokens`)."""
    return " ".join(text_tokens(text))


def word_ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    """n-grams of :func:`text_tokens`; a shorter text is one gram."""
    words = text_tokens(text)
    if not words:
        return set()
    if len(words) < n:
        return {tuple(words)}
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


# ---------------------------------------------------------------- stages


def normalize(
    records: Iterable[dict[str, Any]], config: DataConfig | None = None
) -> tuple[list[Task], StageReport]:
    """Map configured field names onto ``id``/``prompt``/``answer``, normalize text,
    drop records without a prompt, and make ids unique."""
    cfg = config or DataConfig()
    out: list[Task] = []
    n_in = missing = renamed = 0
    seen_ids: set[str] = set()
    for rec in records:
        n_in += 1
        prompt = rec.get(cfg.prompt_field)
        if not isinstance(prompt, str) or not normalize_text(prompt):
            missing += 1
            continue
        prompt = normalize_text(prompt)
        mapped = {cfg.prompt_field}
        answer: Any = None
        if cfg.answer_field is not None:
            mapped.add(cfg.answer_field)
            answer = rec.get(cfg.answer_field)
            if isinstance(answer, str):
                answer = normalize_text(answer)
        raw_id = rec.get(cfg.id_field) if cfg.id_field is not None else None
        if cfg.id_field is not None:
            mapped.add(cfg.id_field)
        task_id = str(raw_id) if raw_id is not None and str(raw_id) else _content_id(prompt)
        if task_id in seen_ids:
            renamed += 1
            base, i = task_id, 2
            while f"{base}#{i}" in seen_ids:
                i += 1
            task_id = f"{base}#{i}"
        seen_ids.add(task_id)
        task: Task = {"id": task_id, "prompt": prompt, "answer": answer}
        if cfg.keep_extra:
            for key, value in rec.items():
                if key not in mapped and key not in task:
                    task[key] = value
        out.append(task)
    detail = f"{missing} without a {cfg.prompt_field!r} string"
    if renamed:
        detail += f"; {renamed} duplicate ids suffixed"
    return out, StageReport("normalize", n_in, len(out), detail)


def _content_id(prompt: str) -> str:
    return hashlib.sha1(prompt.encode("utf-8")).hexdigest()[:12]


def dedupe(
    tasks: Sequence[Task], *, mode: Literal["exact", "normalized"] = "normalized"
) -> tuple[list[Task], StageReport]:
    """Keep the first task of each prompt (exact text, or :func:`dedupe_key`)."""
    if mode not in ("exact", "normalized"):
        raise ValueError(f"unknown dedupe mode {mode!r}; use 'exact' or 'normalized'")
    key_of = (lambda t: t["prompt"]) if mode == "exact" else (lambda t: dedupe_key(t["prompt"]))
    first: dict[str, Task] = {}
    conflicts = 0
    for task in tasks:
        key = key_of(task)
        kept = first.get(key)
        if kept is None:
            first[key] = task
        elif kept.get("answer") != task.get("answer"):
            conflicts += 1
    out = list(first.values())
    detail = f"{conflicts} with a different answer" if conflicts else ""
    return out, StageReport(f"dedupe_{mode}", len(tasks), len(out), detail)


def count_tokens(tokenizer: SupportsEncode, text: str) -> int:
    """Token count with any tokenizer that has ``encode``: a transformers tokenizer
    (returns ids), a ``tokenizers.Tokenizer`` (returns an Encoding) or a plain
    callable-like object. Special tokens are left out where the tokenizer allows."""
    try:
        encoded = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        encoded = tokenizer.encode(text)
    ids = getattr(encoded, "ids", encoded)
    return len(ids)


def length_filter(
    tasks: Sequence[Task],
    tokenizer: SupportsEncode,
    *,
    min_tokens: int = 0,
    max_tokens: int | None = None,
) -> tuple[list[Task], StageReport]:
    """Keep tasks whose prompt has ``min_tokens <= n <= max_tokens`` tokens."""
    out = []
    short = long = 0
    for task in tasks:
        n = count_tokens(tokenizer, task["prompt"])
        if n < min_tokens:
            short += 1
        elif max_tokens is not None and n > max_tokens:
            long += 1
        else:
            out.append(task)
    bounds = f"[{min_tokens}, {max_tokens if max_tokens is not None else '∞'}]"
    detail = f"tokens in {bounds}: {short} too short, {long} too long"
    return out, StageReport("length", len(tasks), len(out), detail)


def split(
    tasks: Sequence[Task],
    *,
    eval_fraction: float = 0.1,
    eval_size: int | None = None,
    seed: int = 0,
) -> tuple[list[Task], list[Task], StageReport]:
    """Seeded shuffle, then the first ``eval_size`` (or ``round(fraction·n)``) go to
    eval. Both halves keep the input order so outputs diff cleanly."""
    n = len(tasks)
    n_eval = eval_size if eval_size is not None else round(eval_fraction * n)
    if n_eval > n:
        raise ValueError(f"eval_size={n_eval} exceeds the {n} tasks left; lower eval_size")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    eval_idx = set(order[:n_eval])
    train = [t for i, t in enumerate(tasks) if i not in eval_idx]
    held = [t for i, t in enumerate(tasks) if i in eval_idx]
    report = StageReport("split", n, n, f"train={len(train)} eval={len(held)} seed={seed}")
    return train, held, report


def decontaminate(
    train: Sequence[Task], eval: Sequence[Task], *, n: int = 8
) -> tuple[list[Task], StageReport]:
    """Drop train tasks that share a word ``n``-gram with any eval task."""
    if n < 1:
        raise ValueError(f"n-gram size must be at least 1, got {n}")
    eval_grams: set[tuple[str, ...]] = set()
    for task in eval:
        eval_grams |= word_ngrams(task["prompt"], n)
    out = [t for t in train if eval_grams.isdisjoint(word_ngrams(t["prompt"], n))]
    detail = f"{n}-gram overlap with {len(eval)} eval tasks"
    return out, StageReport("decontaminate", len(train), len(out), detail)


def _judge(
    task: Task, rewards: Sequence[float], k: int, threshold: float, lo: float, hi: float
) -> float | None:
    rewards = list(rewards)
    if len(rewards) != k:
        raise ValueError(
            f"sampler returned {len(rewards)} rewards for task {task['id']!r}; expected k={k}"
        )
    rate = sum(1 for r in rewards if float(r) >= threshold) / k
    return rate if lo < rate < hi else None


def pass_rate_filter(
    tasks: Sequence[Task],
    sample: Callable[[Task, int], Sequence[float]],
    *,
    k: int,
    solve_threshold: float = 1.0,
    min_pass_rate: float = 0.0,
    max_pass_rate: float = 1.0,
) -> tuple[list[Task], StageReport]:
    """Sample each task ``k`` times; keep tasks with ``min < pass rate < max``."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    out = []
    for task in tasks:
        rate = _judge(task, sample(task, k), k, solve_threshold, min_pass_rate, max_pass_rate)
        if rate is not None:
            out.append({**task, "pass_rate": rate})
    return out, _pass_report(len(tasks), out, k)


async def pass_rate_filter_async(
    tasks: Sequence[Task],
    sample: Sampler,
    *,
    k: int,
    solve_threshold: float = 1.0,
    min_pass_rate: float = 0.0,
    max_pass_rate: float = 1.0,
    concurrency: int = 8,
) -> tuple[list[Task], StageReport]:
    """:func:`pass_rate_filter` for samplers that are coroutines (or return
    awaitables), running up to ``concurrency`` tasks at a time."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(task: Task) -> float | None:
        async with gate:
            result = sample(task, k)
            if inspect.isawaitable(result):
                result = await result
        return _judge(task, result, k, solve_threshold, min_pass_rate, max_pass_rate)

    rates = await asyncio.gather(*(one(t) for t in tasks))
    out = [{**t, "pass_rate": r} for t, r in zip(tasks, rates, strict=True) if r is not None]
    return out, _pass_report(len(tasks), out, k)


def _pass_report(n_in: int, out: list[Task], k: int) -> StageReport:
    return StageReport("pass_rate", n_in, len(out), f"k={k}; always- and never-solved dropped")


# ---------------------------------------------------------------- pipeline


def clean(
    records: Iterable[dict[str, Any]],
    config: DataConfig | None = None,
    *,
    tokenizer: SupportsEncode | None = None,
    sample: Callable[[Task, int], Sequence[float]] | None = None,
) -> CleanResult:
    """Run every configured stage in order and collect their reports.

    The length filter runs only when ``tokenizer`` is given and bounds are set;
    the pass-rate filter only when ``sample`` is given and ``pass_rate_k > 0``.
    Use :func:`pass_rate_filter_async` yourself for an async sampler.
    """
    cfg = config or DataConfig()
    reports: list[StageReport] = []
    tasks, rep = normalize(records, cfg)
    reports.append(rep)
    if cfg.dedupe != "none":
        tasks, rep = dedupe(tasks, mode="exact")
        reports.append(rep)
        if cfg.dedupe == "normalized":
            tasks, rep = dedupe(tasks, mode="normalized")
            reports.append(rep)
    if cfg.min_tokens > 0 or cfg.max_tokens is not None:
        if tokenizer is None:
            raise ValueError(
                "min_tokens/max_tokens are set but no tokenizer was given; pass tokenizer= "
                "(or --tokenizer PATH on the command line)"
            )
        tasks, rep = length_filter(
            tasks, tokenizer, min_tokens=cfg.min_tokens, max_tokens=cfg.max_tokens
        )
        reports.append(rep)
    train, held, rep = split(
        tasks, eval_fraction=cfg.eval_fraction, eval_size=cfg.eval_size, seed=cfg.seed
    )
    reports.append(rep)
    if cfg.decontaminate_ngram > 0 and held:
        train, rep = decontaminate(train, held, n=cfg.decontaminate_ngram)
        reports.append(rep)
    if sample is not None and cfg.pass_rate_k > 0:
        train, rep = pass_rate_filter(
            train,
            sample,
            k=cfg.pass_rate_k,
            solve_threshold=cfg.solve_threshold,
            min_pass_rate=cfg.min_pass_rate,
            max_pass_rate=cfg.max_pass_rate,
        )
        reports.append(rep)
    return CleanResult(train=train, eval=held, reports=reports)


def format_reports(reports: Sequence[StageReport]) -> str:
    head = f"{'stage':<16} {'in':>8} → {'out':<8} dropped"
    return "\n".join([head, *(str(r) for r in reports)])
