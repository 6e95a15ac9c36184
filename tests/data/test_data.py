"""lightning.data: every cleaning stage, the pipeline, the task files and the CLI."""

from __future__ import annotations

import asyncio
import json
import random
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning import cli, data
from lightning.data import DataConfig


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


ROWS = [
    {"id": "a", "question": "What is 2 + 2?", "solution": "4", "level": 1},
    {"id": "b", "question": "What is 3 + 5?", "solution": "8", "level": 2},
]


# ------------------------------------------------------------------ loading


def test_load_jsonl_parquet_and_datasets_disk(tmp_path: Path) -> None:
    jsonl = write_jsonl(tmp_path / "t.jsonl", ROWS)
    assert data.load_records(jsonl) == ROWS

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "t.parquet")
    assert data.load_records(tmp_path / "t.parquet") == ROWS

    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "flat"))
    assert data.load_records(tmp_path / "flat") == ROWS

    dd = datasets.DatasetDict({"train": ds, "test": ds.select([1])})
    dd.save_to_disk(str(tmp_path / "dict"))
    assert data.load_records(tmp_path / "dict") == ROWS  # "train" by default
    assert data.load_records(tmp_path / "dict", split="test") == ROWS[1:]
    with pytest.raises(ValueError, match="no split 'dev'"):
        data.load_records(tmp_path / "dict", split="dev")


def test_load_errors_name_the_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n\n{not json}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad.jsonl:3"):
        data.load_records(bad)
    (tmp_path / "t.csv").write_text("x", encoding="utf-8")
    with pytest.raises(ValueError, match="unknown task file type"):
        data.load_records(tmp_path / "t.csv")
    with pytest.raises(FileNotFoundError):
        data.load_records(tmp_path / "missing.jsonl")


# ------------------------------------------------------------------ normalize


def test_normalize_maps_fields_and_normalizes_text() -> None:
    cfg = DataConfig(prompt_field="question", answer_field="solution")
    records = [
        {"id": 7, "question": "  Ｗhat is\u00a02＋2?\r\nThink.  ", "solution": " 4 ", "level": 1},
        {"question": "   ", "solution": "x"},  # blank prompt: dropped
        {"solution": "y"},  # no prompt: dropped
        {"question": "No id here"},
        {"id": 7, "question": "same id again"},
    ]
    tasks, rep = data.normalize(records, cfg)
    assert rep.n_in == 5 and rep.n_out == 3 and rep.stage == "normalize"
    first = tasks[0]
    # NFKC folds full-width letters and the no-break space; CRLF becomes LF.
    assert first == {"id": "7", "prompt": "What is 2+2?\nThink.", "answer": "4", "level": 1}
    assert tasks[1]["answer"] is None
    assert len(tasks[1]["id"]) == 12  # content hash when no id
    assert tasks[2]["id"] == "7#2"  # ids stay unique
    assert "duplicate ids" in rep.detail


def test_normalize_can_drop_extra_fields() -> None:
    tasks, _ = data.normalize(ROWS, DataConfig(prompt_field="question", keep_extra=False))
    assert set(tasks[0]) == {"id", "prompt", "answer"}


# ------------------------------------------------------------------ dedupe


def test_dedupe_exact_and_normalized() -> None:
    tasks = [
        {"id": "1", "prompt": "What is 2+2?", "answer": "4"},
        {"id": "2", "prompt": "What is 2+2?", "answer": "4"},
        {"id": "3", "prompt": "what is 2 + 2", "answer": "5"},
        {"id": "4", "prompt": "What is 3+3?", "answer": "6"},
    ]
    out, rep = data.dedupe(tasks, mode="exact")
    assert [t["id"] for t in out] == ["1", "3", "4"]
    assert (rep.n_in, rep.n_out, rep.stage) == (4, 3, "dedupe_exact")
    out, rep = data.dedupe(tasks, mode="normalized")
    # "What is 2+2?" and "what is 2 + 2" share the key "what is 2 + 2".
    assert [t["id"] for t in out] == ["1", "4"]
    assert "1 with a different answer" in rep.detail
    with pytest.raises(ValueError, match="unknown dedupe mode"):
        data.dedupe(tasks, mode="fuzzy")  # type: ignore[arg-type]


# ------------------------------------------------------------------ length


class WordTokenizer:
    """Any object with encode() works; this one splits on spaces."""

    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]


def test_length_filter_with_plain_encode() -> None:
    tasks = [{"id": str(n), "prompt": " ".join(["w"] * n)} for n in (1, 3, 5, 9)]
    out, rep = data.length_filter(tasks, WordTokenizer(), min_tokens=2, max_tokens=5)
    assert [t["id"] for t in out] == ["3", "5"]
    assert (rep.n_in, rep.n_out) == (4, 2)
    assert "1 too short, 1 too long" in rep.detail


def test_length_filter_with_real_tokenizers() -> None:
    from transformers import AutoTokenizer

    from lightning.model_cache import smollm2_dir

    model_dir = smollm2_dir()
    fast = data.load_tokenizer(model_dir)  # tokenizers.Tokenizer
    hf = AutoTokenizer.from_pretrained(model_dir)
    text = "What is 17 + 25? Answer with just the number."
    n = data.count_tokens(fast, text)
    assert n == len(fast.encode(text, add_special_tokens=False).ids) > 5
    assert data.count_tokens(hf, text) == n
    tasks = [{"id": "s", "prompt": text}, {"id": "l", "prompt": text * 10}]
    for tok in (fast, hf):
        out, _ = data.length_filter(tasks, tok, max_tokens=n)
        assert [t["id"] for t in out] == ["s"]


# ------------------------------------------------------------------ split


@settings(max_examples=50, deadline=None)
@given(n=st.integers(0, 60), frac=st.floats(0.0, 0.9), seed=st.integers(0, 10))
def test_split_is_a_seeded_partition(n: int, frac: float, seed: int) -> None:
    tasks = [{"id": str(i), "prompt": f"p{i}"} for i in range(n)]
    train, held, rep = data.split(tasks, eval_fraction=frac, seed=seed)
    assert len(held) == round(frac * n)
    assert sorted(t["id"] for t in train + held) == sorted(t["id"] for t in tasks)
    assert {t["id"] for t in train}.isdisjoint(t["id"] for t in held)
    again = data.split(tasks, eval_fraction=frac, seed=seed)
    assert (train, held) == again[:2]
    assert rep.n_in == rep.n_out == n


def test_split_by_size_and_seed_changes_it() -> None:
    tasks = [{"id": str(i), "prompt": f"p{i}"} for i in range(40)]
    _, held0, _ = data.split(tasks, eval_size=10, seed=0)
    _, held1, _ = data.split(tasks, eval_size=10, seed=1)
    assert len(held0) == len(held1) == 10 and held0 != held1
    with pytest.raises(ValueError, match="exceeds"):
        data.split(tasks, eval_size=41)


# ------------------------------------------------------------------ decontaminate


def reference_decontaminate(train: list[dict], held: list[dict], n: int) -> list[dict]:
    """Slow, obvious twin: compare every pair of prompts window by window."""

    def windows(text: str) -> list[list[str]]:
        words = [w for w in text.casefold().split() if w.strip(".,;:!?")]
        words = [w.strip(".,;:!?") for w in words]
        if not words:
            return []
        if len(words) < n:
            return [words]
        return [words[i : i + n] for i in range(len(words) - n + 1)]

    kept = []
    for t in train:
        clash = any(
            a == b for e in held for a in windows(t["prompt"]) for b in windows(e["prompt"])
        )
        if not clash:
            kept.append(t)
    return kept


def test_text_keys_keep_operators() -> None:
    assert data.dedupe_key("What is 2+2?") == data.dedupe_key("what is  2 + 2") == "what is 2 + 2"
    assert data.dedupe_key("What is 17 + 25?") != data.dedupe_key("What is 17 * 25?")
    assert data.dedupe_key("“Ｈｉ”, she said…") == "hi she said"
    held = [{"id": "e", "prompt": "What is 17 + 25? Answer with just the number."}]
    train = [{"id": "t", "prompt": "What is 17 * 25? Answer with just the number."}]
    assert data.decontaminate(train, held, n=8)[0] == train


def test_decontaminate_drops_train_overlapping_eval() -> None:
    held = [{"id": "e", "prompt": "Alice has three apples and gives one to Bob. How many remain?"}]
    train = [
        {"id": "t1", "prompt": "Note: alice has THREE apples and gives one to bob today"},
        {"id": "t2", "prompt": "Carol has five pears and eats two of them. How many remain?"},
        {"id": "t3", "prompt": "short"},
    ]
    out, rep = data.decontaminate(train, held, n=6)
    assert [t["id"] for t in out] == ["t2", "t3"]
    assert (rep.n_in, rep.n_out) == (3, 2)
    # A prompt shorter than n is one gram: caught only when identical.
    out, _ = data.decontaminate([{"id": "x", "prompt": "Short!"}], [{"prompt": "short"}], n=6)
    assert out == []
    with pytest.raises(ValueError):
        data.decontaminate(train, held, n=0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.sampled_from("a b c d".split()), max_size=8), max_size=8),
    st.lists(st.lists(st.sampled_from("a b c d".split()), max_size=8), max_size=4),
    st.integers(1, 4),
)
def test_decontaminate_matches_reference(
    train_words: list[list[str]], held_words: list[list[str]], n: int
) -> None:
    train = [{"id": str(i), "prompt": " ".join(w)} for i, w in enumerate(train_words)]
    held = [{"id": f"e{i}", "prompt": " ".join(w)} for i, w in enumerate(held_words)]
    out, _ = data.decontaminate(train, held, n=n)
    assert out == reference_decontaminate(train, held, n)


# ------------------------------------------------------------------ pass rate

SOLVE = {"easy": 1.0, "hard": 0.0, "mid": 0.5}


def fake_sampler(task: dict, k: int) -> list[float]:
    # Reward 1 for a fraction SOLVE[kind] of the k samples, deterministically.
    p = SOLVE[task["kind"]]
    return [1.0 if i < round(p * k) else 0.0 for i in range(k)]


PASS_TASKS = [{"id": k, "prompt": k, "kind": k} for k in ("easy", "hard", "mid")]


def test_pass_rate_filter_drops_always_and_never_solved() -> None:
    out, rep = data.pass_rate_filter(PASS_TASKS, fake_sampler, k=4)
    assert [t["id"] for t in out] == ["mid"]
    assert out[0]["pass_rate"] == 0.5
    assert (rep.stage, rep.n_in, rep.n_out) == ("pass_rate", 3, 1)


def test_pass_rate_filter_threshold_and_bounds() -> None:
    # A retry reward of 0.5 counts as solved with threshold 0.5.
    out, _ = data.pass_rate_filter(
        [{"id": "r", "prompt": "r"}], lambda t, k: [0.5, 0.0], k=2, solve_threshold=0.5
    )
    assert out[0]["pass_rate"] == 0.5
    out, _ = data.pass_rate_filter(
        PASS_TASKS, fake_sampler, k=4, min_pass_rate=0.6, max_pass_rate=1.0
    )
    assert out == []
    with pytest.raises(ValueError, match="expected k=3"):
        data.pass_rate_filter(PASS_TASKS, lambda t, k: [1.0], k=3)


def test_pass_rate_filter_async_sampler() -> None:
    async def sample(task: dict, k: int) -> list[float]:
        await asyncio.sleep(0)
        return fake_sampler(task, k)

    out, rep = asyncio.run(data.pass_rate_filter_async(PASS_TASKS, sample, k=4, concurrency=2))
    assert [t["id"] for t in out] == ["mid"] and rep.n_out == 1
    # Plain functions are accepted too.
    out, _ = asyncio.run(data.pass_rate_filter_async(PASS_TASKS, fake_sampler, k=4))
    assert [t["id"] for t in out] == ["mid"]


# ------------------------------------------------------------------ pipeline and CLI


def arithmetic_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(1, 30), rng.randint(1, 30)
        rows.append({"id": f"t{i}", "prompt": f"What is {a} + {b}?", "answer": str(a + b)})
    return rows


def test_clean_chains_stage_counts() -> None:
    rows = arithmetic_rows(200)
    rows.append(dict(rows[0], id="dup"))
    cfg = DataConfig(eval_fraction=0.2, decontaminate_ngram=4, max_tokens=20, pass_rate_k=2)
    res = data.clean(rows, cfg, tokenizer=WordTokenizer(), sample=lambda t, k: [1.0, 0.0][:k])
    names = [r.stage for r in res.reports]
    assert names == [
        "normalize",
        "dedupe_exact",
        "dedupe_normalized",
        "length",
        "split",
        "decontaminate",
        "pass_rate",
    ]
    # Each stage's input is the previous stage's output (split passes all through).
    for prev, nxt in zip(res.reports, res.reports[1:], strict=False):
        assert nxt.n_in == (prev.n_out if prev.stage != "split" else len(res.train) + nxt.dropped)
    assert res.reports[1].dropped >= 1
    assert res.reports[-1].n_out == len(res.train)
    train_prompts = {t["prompt"] for t in res.train}
    assert train_prompts.isdisjoint(t["prompt"] for t in res.eval)


def test_clean_needs_tokenizer_for_length_bounds() -> None:
    with pytest.raises(ValueError, match="no tokenizer"):
        data.clean(arithmetic_rows(5), DataConfig(max_tokens=10))


def test_config_validation_and_toml(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        DataConfig(min_tokens=10, max_tokens=5)
    with pytest.raises(ValueError):
        DataConfig(dedupe="fuzzy")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        DataConfig(unknown_field=1)  # type: ignore[call-arg]
    toml = tmp_path / "c.toml"
    toml.write_text('[data]\nprompt_field = "question"\neval_size = 3\n', encoding="utf-8")
    cfg = DataConfig.from_toml(toml)
    assert cfg.prompt_field == "question" and cfg.eval_size == 3


def test_cli_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = arithmetic_rows(50)
    src = write_jsonl(tmp_path / "in.jsonl", rows + rows[:5])
    toml = tmp_path / "c.toml"
    toml.write_text("eval_size = 10\nseed = 3\n", encoding="utf-8")
    out = tmp_path / "out"
    code = cli.main(
        ["data", str(src), "--out", str(out), "--config", str(toml), "--decontaminate-ngram", "3"]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "dedupe_exact" in printed and "decontaminate" in printed
    train = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]
    held = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert len(held) == 10 and len(train) <= 40
    report = json.loads((out / "report.json").read_text())
    assert report[0] == {
        "stage": "normalize",
        "n_in": 55,
        "n_out": 55,
        "detail": report[0]["detail"],
    }
    assert report[1]["n_out"] == len({r["prompt"] for r in rows})


def test_cli_rejects_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", arithmetic_rows(3))
    code = cli.main(["data", str(src), "--out", str(tmp_path), "--dedupe", "fuzzy"])
    assert code == 2
    assert "dedupe" in capsys.readouterr().err


def test_data_module_imports_no_torch() -> None:
    import subprocess

    code = "import sys, lightning.data.cli, lightning.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
