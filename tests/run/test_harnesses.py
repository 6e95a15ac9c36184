"""Several harnesses in one run (lightning.run.harnesses and the run config).

The fast tests cover the config, routing, the costs and the eval matrix on
plain data; the slow one trains the tiny model through the demo's four harnesses
(chat, Responses, Messages, and an unseen eval-only one) end to end.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from lightning.config import DEFAULT_HARNESS, RunConfig
from lightning.run.harnesses import (
    HarnessRunner,
    eval_intervals,
    eval_label,
    eval_matrix,
    harness_costs,
    harness_of,
    matrix_table,
    merge_costs,
    split_flags,
    transfer_lines,
)
from lightning.run.report import write_report
from lightning.run.runner import RolloutResult

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

BASE: dict[str, Any] = {
    "model": {"builtin": "tiny"},
    "tasks": {"train": "train.jsonl"},
}


def config(harnesses: list[dict[str, Any]], **algorithm: Any) -> RunConfig:
    return RunConfig.model_validate({**BASE, "harnesses": harnesses, "algorithm": algorithm})


def h(name: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "callable": "agent.py:run", **kw}


# ------------------------------------------------------------------ config


def test_a_single_harness_is_a_list_of_one_named_default(tmp_path: Path) -> None:
    cfg = RunConfig.model_validate({**BASE, "harness": {"command": ["agent"]}})
    [only] = cfg.all_harnesses()
    assert only.name == DEFAULT_HARNESS == "default" and not only.eval_only
    assert cfg.harness_groups(0) == {"default": cfg.algorithm.tasks_per_step}
    # The shipped single-harness demo config still loads, its callable resolved.
    demo = RunConfig.load(EXAMPLES / "demo.toml")
    assert [x.name for x in demo.all_harnesses()] == ["default"]
    assert demo.all_harnesses()[0].callable == f"{EXAMPLES / 'arith_agent.py'}:run"


def test_the_demo_harness_family_config() -> None:
    cfg = RunConfig.load(EXAMPLES / "demo_harnesses.toml")
    names = [x.name for x in cfg.all_harnesses()]
    assert names == [
        "openai-chat",
        "agents-sdk-responses",
        "anthropic-messages",
        "terse-chat-unseen",
    ]
    assert [x.name for x in cfg.trained_harnesses()] == names[:3]
    for x in cfg.all_harnesses():  # every path next to the config file
        assert x.callable is not None and x.callable.startswith(str(EXAMPLES))
        assert Path(x.callable.rpartition(":")[0]).exists()
        assert x.cwd == str(EXAMPLES)
    # One group per trained harness each step.
    assert all(cfg.harness_groups(s) == dict.fromkeys(names[:3], 1) for s in range(4))


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"harnesses": [h("a")], "harness": {"command": ["x"]}}, "not both"),
        ({}, "not neither"),
        ({"harnesses": [h("a"), h("a")]}, "repeated: \\['a'\\]"),
        ({"harnesses": [h("a", eval_only=True)]}, "at least one must train"),
        ({"harnesses": [h("a", share=1.0, per_step=2)]}, "not both"),
        ({"harnesses": [h("a"), h("b", eval_only=True, share=2.0)]}, "eval_only"),
        ({"harnesses": [h("bad name")]}, "pattern"),
        ({"harnesses": [h("a", per_step=2), h("b")]}, "leaving none for \\['b'\\]"),
    ],
)
def test_bad_harness_lists_fail_at_load(raw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        RunConfig.model_validate({**BASE, **raw})


def test_groups_split_by_share_and_per_step() -> None:
    cfg = config([h("a"), h("b"), h("c"), h("u", eval_only=True)], tasks_per_step=4)
    per_step = [cfg.harness_groups(s) for s in range(6)]
    assert all(sum(g.values()) == 4 and set(g) == {"a", "b", "c"} for g in per_step)
    # The one left over rotates, so over steps every harness gets its share.
    totals = {n: sum(g[n] for g in per_step) for n in "abc"}
    assert totals == {"a": 8, "b": 8, "c": 8}
    weighted = config([h("a", share=3.0), h("b", share=1.0)], tasks_per_step=4)
    assert weighted.harness_groups(0) == {"a": 3, "b": 1}
    fixed = config([h("a", per_step=2), h("b")], tasks_per_step=3)
    assert fixed.harness_groups(5) == {"a": 2, "b": 1}
    # All fixed: tasks_per_step does not apply.
    assert config([h("a", per_step=2), h("b", per_step=1)]).harness_groups(0) == {"a": 2, "b": 1}


# ------------------------------------------------------------------ routing


class StubRunner:
    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: list[tuple[Any, str | None, str]] = []

    async def run_async(self, jobs: list[tuple[Any, str | None]], *, mode: str) -> list[Any]:
        self.seen += [(t, g, mode) for t, g in jobs]
        await asyncio.sleep(0)
        return [f"{self.name}:{t['id']}" for t, _ in jobs]


def test_jobs_go_to_the_runner_of_their_harness_results_in_job_order() -> None:
    a, b = StubRunner("a"), StubRunner("b")
    runner = HarnessRunner({"a": a, "b": b})  # type: ignore[dict-item]
    jobs = [
        ({"id": 1, "harness": "b"}, "g1"),
        ({"id": 2, "harness": "a"}, "g2"),
        ({"id": 3}, None),  # names none: the first harness
        ({"id": 4, "harness": "b"}, "g1"),
    ]
    assert runner.run(jobs, mode="eval") == ["b:1", "a:2", "a:3", "b:4"]
    assert [t["id"] for t, _, _ in a.seen] == [2, 3] and {m for *_, m in a.seen} == {"eval"}
    assert [g for _, g, _ in b.seen] == ["g1", "g1"]
    with pytest.raises(ValueError, match="names harness 'zzz'; this run has \\['a', 'b'\\]"):
        runner.run([({"id": 5, "harness": "zzz"}, None)])
    assert harness_of({"harness": "x"}) == "x" and harness_of({}) == harness_of(None) == "default"


# ------------------------------------------------------------------ costs


def result(rid: str, harness: str, duration: float) -> RolloutResult:
    return RolloutResult(
        rollout_id=rid,
        group=None,
        task={"prompt": "What is 2 + 2?", "harness": harness},
        status="succeeded",
        reward=1.0,
        exit_code=0,
        duration_s=duration,
    )


def call(rid: str, prompt_len: int) -> SimpleNamespace:
    return SimpleNamespace(rollout_id=rid, prompt_ids=[0] * prompt_len)


def test_costs_per_harness_and_the_split_flag() -> None:
    results = [
        result("a1", "chat", 1.0),
        result("a2", "chat", 3.0),
        result("b1", "rewriter", 2.0),
        result("b2", "rewriter", 2.0),
    ]
    merged = SimpleNamespace(
        # chat: two turns that extend each other (one sample each); rewriter: every
        # second prompt rewrites the first (two samples each).
        calls=[
            call(rid, n)
            for rid, first in (("a1", 10), ("a2", 10), ("b1", 30), ("b2", 30))
            for n in (first, first + 10)
        ],
        samples=[SimpleNamespace(rollout_id=r) for r in ("a1", "a2", "b1", "b1", "b2", "b2")],
        divergences=[
            SimpleNamespace(rollout_id="b1", kind="template"),
            SimpleNamespace(rollout_id="b2", kind="template"),
        ],
    )
    tok = SimpleNamespace(encode=lambda text: text.split())
    costs = harness_costs(results, merged, tokenizer=tok, rewards={"a1": 1.0, "a2": 0.0})
    chat, rw = costs["chat"], costs["rewriter"]
    assert chat["rollouts"] == 2 and chat["calls_per_rollout"] == 2.0
    assert chat["prompt_tokens_per_call"] == 15.0 and chat["first_prompt_tokens"] == 10.0
    assert chat["task_tokens"] == 5.0  # "What is 2 + 2?" in words
    assert chat["samples_per_rollout"] == 1.0 and chat["split_frac"] == 0.0
    assert chat["wall_s_per_rollout"] == 2.0 and chat["reward_mean"] == 0.5
    assert rw["samples_per_rollout"] == 2.0 and rw["split_frac"] == 1.0
    assert rw["divergences"] == {"template": 2}
    flags = split_flags(costs)
    assert list(flags) == ["rewriter"] and "template ×2" in flags["rewriter"]
    # Averaged over steps, weighted by rollouts; divergences summed.
    merged_costs = merge_costs([{"harnesses": costs}, {"harnesses": costs}, {"step": 3}])
    assert merged_costs["rewriter"]["divergences"] == {"template": 4}
    assert merged_costs["chat"]["rollouts"] == 4
    assert merged_costs["chat"]["calls_per_rollout"] == 2.0
    assert list(split_flags(merged_costs)) == ["rewriter"]


# ------------------------------------------------------------------ matrix


def test_eval_intervals_pool_the_trained_harnesses_by_task() -> None:
    # 2 tasks × k=2 through a, b (trained) and u (eval only), in job order.
    rewards = {"a": [1, 1, 0, 0], "b": [1, 0, 0, None], "u": [0, 0, 0, 0]}
    results = [
        result(f"{n}{i}", n, 1.0) for n, values in rewards.items() for i in range(len(values))
    ]
    for r, v in zip(results, [v for vs in rewards.values() for v in vs], strict=True):
        r.reward = None if v is None else float(v)
    pooled, cells = eval_intervals(results, [("a", False), ("b", False), ("u", True)], k=2, seed=0)
    assert cells["a"]["reward"] == 0.5 and cells["b"]["reward"] == 0.25  # None counts 0
    assert cells["u"] == {"reward": 0.0, "low": 0.0, "high": 0.0, "n": 4, "eval_only": True}
    # Pooled over a and b only: 2 tasks, 4 samples each.
    assert pooled.mean == 0.375 and (pooled.tasks, pooled.samples) == (2, 4)


def cell(reward: float, eval_only: bool = False) -> dict[str, Any]:
    return {
        "reward": reward,
        "low": reward - 0.1,
        "high": reward + 0.1,
        "n": 8,
        "eval_only": eval_only,
    }


ROWS: list[dict[str, Any]] = [
    {"step": -1, "eval_reward": 0.2, "eval_harnesses": {"a": cell(0.2), "u": cell(0.1, True)}},
    {"step": 0, "reward_mean": 0.3, "harnesses": {"a": {"rollouts": 4, "calls_per_rollout": 1}}},
    {
        "step": 1,
        "reward_mean": 0.4,
        "eval_reward": 0.4,
        "eval_harnesses": {"a": cell(0.4), "u": cell(0.2, True)},
        "harnesses": {"b": {"rollouts": 4, "calls_per_rollout": 2}},
    },
    {"step": 2, "eval_reward": 0.5, "eval_harnesses": {"a": cell(0.5), "u": cell(0.35, True)}},
]


def test_the_eval_matrix_table_and_headline() -> None:
    assert [eval_label(r) for r in ROWS] == ["before", "step 1", "step 2", "final"]
    matrix = eval_matrix(ROWS)
    assert [c["label"] for c in matrix["u"]] == ["before", "step 2", "final"]
    lines = matrix_table(matrix).splitlines()
    assert lines[0] == "| harness | before | step 2 | final |"
    assert lines[2] == "| a | 0.200 (0.100–0.300) | 0.400 (0.300–0.500) | 0.500 (0.400–0.600) |"
    assert lines[3].startswith("| u (eval only) | 0.100 (0.000–0.200) |")
    [headline] = transfer_lines(matrix)
    assert headline.startswith("unseen harness 'u' (eval_only, never trained on): before 0.100")
    assert headline.endswith("(Δ +0.250)")


def test_the_report_has_a_harness_section(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    result = write_report(tmp_path)
    page = result.html_path.read_text()
    assert "<h2>Harnesses</h2>" in page and "unseen harness &#x27;u&#x27;" in page
    assert (tmp_path / "report" / "harness_matrix.png") in result.png_paths
    assert "calls / rollout" in page and "<td>b</td>" in page
    # A run of one harness has no such section.
    one = tmp_path / "one"
    one.mkdir()
    (one / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward_mean": 0.1}) + "\n")
    assert "<h2>Harnesses</h2>" not in write_report(one).html_path.read_text()


# ------------------------------------------------------------------ end to end


def _tasks(tmp_path: Path) -> tuple[Path, Path]:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import arith_tasks
    finally:
        sys.path.remove(str(EXAMPLES))
    out = tmp_path / "tasks"
    assert (
        arith_tasks.main(["--n", "40", "--eval-size", "3", "--seed", "5", "--out", str(out)]) == 0
    )
    return out / "train.jsonl", out / "eval.jsonl"


@pytest.mark.slow
def test_a_mixed_run_over_three_protocols_on_the_tiny_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning import Store, cli
    from lightning.run.loop import Run

    train, eval_ = _tasks(tmp_path)
    out = tmp_path / "run"
    cfg = RunConfig.load(
        EXAMPLES / "demo_harnesses.toml",
        {
            "model.builtin": "tiny",
            "steps": 2,
            "eval_every": 1,
            "output_dir": str(out),
            "tasks.train": str(train),
            "tasks.eval": str(eval_),
            "algorithm.group_size": 2,
            "algorithm.eval_samples": 1,
            "trainer.total_steps": 2,
        },
    )
    names = [x.name for x in cfg.all_harnesses()]
    trained, unseen = names[:3], names[3]
    with Run(cfg) as run:
        summary = run.run()
    printed = capsys.readouterr().out
    assert "held-out reward per harness" in printed and f"unseen harness '{unseen}'" in printed
    assert list(summary["eval_matrix"]) == names

    # The store: every rollout names its harness; train groups never span harnesses.
    with Store(out / "lightning.db") as store:
        rollouts = store.rollouts()
    train_rows = [r for r in rollouts if r["mode"] == "train"]
    eval_rows = [r for r in rollouts if r["mode"] == "eval"]
    assert {r["task"]["harness"] for r in train_rows} == set(trained)
    assert {r["task"]["harness"] for r in eval_rows} == set(names)
    assert len(eval_rows) == 3 * 4 * 3  # 3 evals × 4 harnesses × 3 tasks
    groups: dict[str, set[str]] = {}
    for r in train_rows:
        groups.setdefault(r["group"], set()).add(r["task"]["harness"])
    assert len(groups) == 2 * 3 and all(len(v) == 1 for v in groups.values())
    # Each protocol was spoken by its harness.
    db = sqlite3.connect(out / "lightning.db")
    protocols = {
        json.loads(task)["harness"]: proto
        for task, proto in db.execute(
            "SELECT r.task, c.protocol FROM rollouts r JOIN calls c ON c.rollout_id = r.id"
        )
    }
    assert len(set(protocols[n] for n in trained)) == 3, protocols

    # metrics.jsonl: per-harness train rewards and costs, and the eval matrix.
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert set(r["harnesses"]) == set(trained)
        for c in r["harnesses"].values():
            assert c["rollouts"] == 2 and c["calls_per_rollout"] >= 1
            assert c["prompt_tokens_per_call"] > 0 and c["samples_per_rollout"] >= 1
            assert c["wall_s_per_rollout"] > 0 and "reward_mean" in c
    matrix = eval_matrix(rows)
    assert [c["label"] for c in matrix[unseen]] == ["before", "step 1", "final"]
    for name, cells in matrix.items():
        assert all(c["low"] <= c["reward"] <= c["high"] and c["n"] == 3 for c in cells)
        assert cells[-1]["eval_only"] is (name == unseen)
        assert cells[-1]["costs"]["rollouts"] == 3  # the unseen harness's costs, too
    # Traces and the report name the harness.
    traces = [json.loads(line) for line in (out / "traces.jsonl").read_text().splitlines()]
    assert {t["harness"] for t in traces if t["step"] == 0} == set(trained)
    assert "<h2>Harnesses</h2>" in (out / "report.html").read_text()
    # `lightning show` prints a rollout's harness.
    rid = train_rows[0]["rollout_id"]
    assert cli.main(["show", rid, "--db", str(out / "lightning.db"), "--color", "never"]) == 0
    assert f"harness {train_rows[0]['task']['harness']}" in capsys.readouterr().out
