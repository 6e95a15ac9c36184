"""The supervised stage: conversations → exact-token samples, rejection sampling
from a real store, the bad-data errors, and a tiny model that learns an answer
format through `lightning sft`."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from fake_vllm import FakeEngine
from gateways import gateway_client
from lightning import Tokenizer
from lightning.config import SftConfig, SftSection
from lightning.model_cache import tiny_model_dir
from lightning.rl.sft import (
    SftDataError,
    keep_best,
    load_conversations,
    select_rollouts,
    split_validation,
    store_samples,
)
from lightning.run.loop import sft_main
from lightning.run.sft import prepare_data

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
# A ChatML template that renders tools and tool calls (SmolLM2's own ignores them).
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}"
    "</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(str(tiny_model_dir()))


def _write(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _conv(q: str, a: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def test_assistant_tokens_are_exactly_what_the_model_would_generate(
    tok: Tokenizer, tmp_path: Path
) -> None:
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "and?"},
        {"role": "assistant", "content": "done"},
    ]
    (s,) = load_conversations(_write(tmp_path / "d.jsonl", [{"messages": msgs}]), tok)
    assert s.source.endswith("d.jsonl:1")
    full = tok.encode_chat(msgs)
    # One sample: the second turn's prompt extends the first turn's answer.
    assert list(s.tokens) == list(full[: len(s.tokens)])
    trained = [tok.decode(s.tokens[i : i + 1]) for i in np.nonzero(s.weights)[0]]
    # Each answer and its end-of-turn token; not the header, not the newline after.
    expected = [*tok.encode("hello there").tolist(), 2, *tok.encode("done").tolist(), 2]
    assert [int(t) for t in s.tokens[s.weights > 0]] == expected
    assert "".join(trained) == "hello there<|im_end|>done<|im_end|>"
    # The prompt the engine would render for turn 2 is the context before it.
    prompt2 = tok.encode_chat(msgs[:4], add_generation_prompt=True)
    assert list(s.tokens[: len(prompt2)]) == list(prompt2)
    assert s.weights[: len(prompt2)].sum() == len(tok.encode("hello there")) + 1


def test_tool_calls_render_through_the_given_template(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(str(tiny_model_dir()), chat_template=TOOL_TEMPLATE)
    call = {
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    row = {
        "messages": [
            {"role": "user", "content": "weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "rain"},
            {"role": "assistant", "content": "It rains."},
        ],
        "tools": TOOLS,
    }
    (s,) = load_conversations(_write(tmp_path / "t.jsonl", [row]), tok)
    text = tok.decode(s.tokens[s.weights > 0])
    assert text == (
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}'
        "</tool_call><|im_end|>It rains.<|im_end|>"
    )
    assert "rain<|im_end|>" not in text  # the tool's answer is context


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ('{"messages": [', "d.jsonl:2: not JSON"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "d.jsonl:2: no assistant message"),
        ({"prompt": "hi"}, 'd.jsonl:2: expected an object with "messages"'),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "tool_calls": [{"type": "function", "function": {"name": "rm_rf"}}],
                    },
                ],
                "tools": TOOLS,
            },
            "d.jsonl:2: message 1 calls the tool 'rm_rf', which the conversation's `tools` do "
            "not declare \\(declared: get_weather\\)",
        ),
        (_conv("long " * 80, "ok"), "d.jsonl:2: 113 tokens, longer than the context \\(64\\)"),
    ],
)
def test_bad_data_names_the_line(tok: Tokenizer, tmp_path: Path, row: Any, message: str) -> None:
    path = _write(tmp_path / "d.jsonl", [_conv("fine", "yes"), row])
    with pytest.raises(SftDataError, match=message):
        load_conversations(path, tok, max_len=64)


def test_bad_data_is_a_clear_cli_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _write(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    cfg = tmp_path / "sft.toml"
    cfg.write_text(f'[model]\nbuiltin = "tiny"\n[sft]\ndataset = "{data.name}"\n')
    assert sft_main([str(cfg), "--output-dir", str(tmp_path / "out"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("lightning sft: ") and "d.jsonl:1: no assistant message" in err
    assert "Traceback" not in err


def test_config_sections_describe_every_field() -> None:
    for name, f in SftSection.model_fields.items():
        assert f.description, f"[sft] {name} has no description"
    with pytest.raises(ValueError, match="needs `dataset`"):
        SftSection(source="dataset")
    with pytest.raises(ValueError, match="only with source = 'dataset'"):
        SftSection(source="store", dataset="x.jsonl")


def test_validation_split_is_seeded_and_whole(tok: Tokenizer, tmp_path: Path) -> None:
    rows = [_conv(f"q{i}", f"a{i}") for i in range(20)]
    samples = load_conversations(_write(tmp_path / "d.jsonl", rows), tok)
    train, val = split_validation(samples, 0.25, seed=3)
    assert len(val) == 5 and len(train) == 15
    assert {s.source for s in train}.isdisjoint(s.source for s in val)
    again = split_validation(samples, 0.25, seed=3)[1]
    assert [s.source for s in again] == [s.source for s in val]


# --------------------------------------------------------------- rejection sampling


def test_keep_best_is_the_filter_it_names() -> None:
    rows = [
        ("a1", "A", 1.0), ("a2", "A", 0.0), ("a3", "A", 0.5), ("a4", "A", 1.0),
        ("b1", "B", 0.2), ("b2", "B", None), ("b3", "B", 0.9),
        ("c1", None, 0.7),
    ]  # fmt: skip
    assert keep_best(rows, min_reward=None, top_fraction=None).ids == [
        "a1", "a2", "a3", "a4", "b1", "b3", "c1"
    ]  # fmt: skip
    half = keep_best(rows, min_reward=None, top_fraction=0.5)
    # A: best 2 of 4 (the two 1.0s); B: best 1 of 2 rewarded; c1 alone: ceil(0.5) = 1.
    assert half.ids == ["a1", "a4", "b3", "c1"]
    assert half.dropped == {"no_reward": 1, "below_min_reward": 0, "not_top_fraction": 3}
    both = keep_best(rows, min_reward=0.5, top_fraction=0.5)
    # After the threshold A has a1, a3, a4 → ceil(1.5) = 2 best: a1, a4 (ties: earlier first).
    assert both.ids == ["a1", "a4", "b3", "c1"]
    assert both.dropped["below_min_reward"] == 2
    assert keep_best(rows, min_reward=0.8, top_fraction=None).ids == ["a1", "a4", "b3"]


def _chat(base_url: str, token: str, text: str) -> None:
    r = httpx.post(
        base_url + "/chat/completions",
        headers={"Authorization": f"Bearer {token}"},
        json={"model": "m", "messages": [{"role": "user", "content": text}]},
        timeout=30,
    )
    r.raise_for_status()


def test_rejection_sampling_from_a_store_keeps_exactly_the_filtered_rollouts(
    engine: FakeEngine, tmp_path: Path
) -> None:
    db = tmp_path / "lightning.db"
    rewards = {"g0": [1.0, 0.0, 0.5, 1.0], "g1": [0.0, 0.25, 0.0, 0.0]}
    made: dict[str, float] = {}
    with gateway_client(engine.url, db) as client:
        for group, values in rewards.items():
            for k, value in enumerate(values):
                ro = client.create_rollout({"q": k}, group=group)
                _chat(ro.base_url, ro.token, f"{group} sample {k} [[len:{3 + k}]]")
                client.reward(ro.id, value)
                client.set_status(ro.id, "succeeded")
                made[ro.id] = value
        held = client.create_rollout({"q": "held"}, group="g0", mode="eval")
        _chat(held.base_url, held.token, "held out")
        client.reward(held.id, 1.0)
        client.set_status(held.id, "succeeded")
        failed = client.create_rollout({"q": "f"}, group="g1")
        _chat(failed.base_url, failed.token, "failed one")
        client.reward(failed.id, 1.0)
        client.set_status(failed.id, "failed")
    ids = list(made)
    sel = select_rollouts(db, min_reward=0.1, top_fraction=0.5)
    # g0 above 0.1: 1.0, 0.5, 1.0 → best ceil(1.5) = 2: the two 1.0s; g1: only 0.25.
    assert sel.ids == [ids[0], ids[3], ids[5]]
    assert sel.dropped == {
        "eval_mode": 1, "not_succeeded": 1, "no_reward": 0, "below_min_reward": 4,
        "not_top_fraction": 1,
    }  # fmt: skip
    samples = store_samples(db, sel, max_len=None)
    assert sorted(s.rollout_id for s in samples) == sorted(sel.ids)
    from lightning import Store

    with Store(db) as store:
        for s in samples:
            (call,) = store.trace(s.rollout_id)
            # Exactly the recorded tokens: the prompt as context, the completion trained.
            assert list(s.tokens) == list(call.prompt_ids) + list(call.completion_ids)
            assert list(s.weights) == [0.0] * len(call.prompt_ids) + [1.0] * len(
                call.completion_ids
            )
    # The [sft] store source runs the same filter.
    section = SftSection(source="store", db=str(db), min_reward=0.1, top_fraction=0.5)
    train, val, info = prepare_data(section, tiny_model_dir(), seed=0)
    assert info["kept_ids"] == sel.ids and len(train) + len(val) == 3


# ------------------------------------------------------------ a model that learns


def _greedy(model_dir: Path, tok: Tokenizer, question: str, n: int = 6) -> str:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tok.encode_chat([{"role": "user", "content": question}], add_generation_prompt=True)
    out = model.generate(
        torch.from_numpy(ids.astype(np.int64))[None],
        max_new_tokens=n,
        do_sample=False,
        pad_token_id=2,
    )
    return tok.decode(out[0, len(ids) :].numpy().astype(np.uint32))


def test_tiny_model_learns_an_answer_format_from_jsonl(tok: Tokenizer, tmp_path: Path) -> None:
    rng = random.Random(0)
    rows = []
    for _ in range(24):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append(_conv(f"What is {a} plus {b}?", f"ANSWER: {a + b}"))
    data = _write(tmp_path / "train.jsonl", rows)
    before = _greedy(tiny_model_dir(), tok, "What is 3 plus 4?")
    assert not before.startswith("ANSWER:")
    cfg = tmp_path / "sft.toml"
    cfg.write_text(
        '[model]\nbuiltin = "tiny"\n[trainer]\nlr = 2e-2\nbatching = "tree"\n'
        f'[sft]\ndataset = "{data.name}"\nepochs = 6\nbatch_size = 8\nval_fraction = 0.25\n'
        'metric = "val_loss"\npatience = 3\n'
    )
    out = tmp_path / "out"
    assert sft_main([str(cfg), "--output-dir", str(out), "--quiet"]) == 0
    rows_out = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [r["sft_val_loss"] for r in rows_out if "sft_val_loss" in r]
    assert val[-1] < 0.5 * val[0], val
    assert all("sft_entropy" in r for r in rows_out if "sft_loss" in r)
    assert {r["phase"] for r in rows_out} == {"sft"}
    after = _greedy(out / "model", tok, "What is 3 plus 4?")
    assert after.startswith("ANSWER:"), after
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data"]["train_samples"] == 18 and summary["data"]["val_samples"] == 6
    assert SftConfig.load(cfg).sft.dataset == str(data)


# ------------------------------------------------- inside `lightning train`

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _demo_config(tmp_path: Path, sft: dict[str, Any]) -> Any:
    import sys

    from lightning.config import RunConfig

    sys.path.insert(0, str(EXAMPLES))
    try:
        import arith_tasks
    finally:
        sys.path.remove(str(EXAMPLES))
    tasks = tmp_path / "tasks"
    assert (
        arith_tasks.main(["--n", "20", "--eval-size", "2", "--seed", "3", "--out", str(tasks)]) == 0
    )
    return RunConfig.load(
        EXAMPLES / "demo.toml",
        {
            "model.builtin": "tiny",
            "steps": 0,
            "output_dir": str(tmp_path / "run"),
            "tasks.train": str(tasks / "train.jsonl"),
            "tasks.eval": str(tasks / "eval.jsonl"),
            "algorithm.group_size": 3,
            "algorithm.tasks_per_step": 2,
            "harness.concurrency": 6,
            "sft": sft,
        },
    )


@pytest.mark.slow
def test_train_warm_starts_from_sft_then_serves_those_weights(tmp_path: Path) -> None:
    from lightning.run.loop import Run

    data = _write(tmp_path / "d.jsonl", [_conv(f"q{i}", f"A{i}") for i in range(6)])
    cfg = _demo_config(tmp_path, {"dataset": str(data), "epochs": 1, "batch_size": 4})
    with Run(cfg, quiet=True) as run:
        assert run.trainer.step_count == 2  # ceil(5 train samples / 4) steps
        rows = [json.loads(x) for x in (run.out / "sft" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [0, 1, 2] and "sft_val_loss" in rows[-1]
        # The engine was started on the fine-tuned weights, not the base model.
        assert str(run.out / "weights" / "sft") in " ".join(run.engine.proc.args)  # type: ignore[union-attr]


@pytest.mark.slow
def test_expert_iteration_keeps_the_best_of_each_group_and_pushes(tmp_path: Path) -> None:
    from lightning.run.loop import train

    cfg = _demo_config(
        tmp_path,
        {"source": "expert_iteration", "iterations": 1, "top_fraction": 0.5, "batch_size": 2},
    )
    summary = train(cfg, quiet=True)
    (it,) = summary["expert_iteration"]["iterations"]
    assert it["rollouts"] == 6
    # ceil(0.5 x 3) = 2 of each group of 3 succeeded, rewarded rollouts.
    assert it["selection"]["kept"] == 4, it
    assert it["samples"] >= 4  # a multi-call rollout may merge into several samples
    assert it["fit"]["steps"] == -(-it["samples"] // 2)
    from lightning import Store

    with Store(tmp_path / "run" / "lightning.db") as store:
        versions = {
            c.weight_version
            for r in store.rollouts(status=None)
            for c in store.trace(r["rollout_id"])
            if r["mode"] == "eval"
        }
    # The held-out eval after expert iteration ran on the pushed weights (version 1).
    assert 1 in versions
