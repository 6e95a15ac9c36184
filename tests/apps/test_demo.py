"""`lightning demo`'s record of a run and README's table built from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning.apps import demo


def _run(tmp_path: Path, seed: int, rows: list[dict[str, object]]) -> Path:
    out = tmp_path / f"demo-seed{seed}"
    (out / "run").mkdir(parents=True)
    (out / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = {
        "seed": seed,
        "steps": 12,
        "evals": demo.evals(out / "run" / "metrics.jsonl", 12),
        "wall_s": 540.0,
    }
    (out / "demo.json").write_text(json.dumps(record))
    return out


def test_evals_and_table(tmp_path: Path) -> None:
    rows: list[dict[str, object]] = [
        {"step": -1, "eval_reward": 0.4, "eval_ci_low": 0.3, "eval_ci_high": 0.5},
        {"step": 0, "reward_mean": 0.2},
        {
            "step": 5,
            "reward_mean": 0.9,
            "eval_reward": 0.8,
            "eval_ci_low": 0.7,
            "eval_ci_high": 0.9,
        },
        {"step": 12, "eval_reward": 0.85, "eval_ci_low": 0.75, "eval_ci_high": 0.95},
    ]
    first = _run(tmp_path, 0, rows)
    assert [e["label"] for e in demo.evals(first / "run" / "metrics.jsonl", 12)] == [
        "before",
        "step 6",
        "final",
    ]
    second = _run(tmp_path, 1, rows[:2] + rows[3:])  # a run without its mid-run eval
    lines = demo.table([str(first), str(second)]).splitlines()
    assert lines[0] == "| seed | before | after step 6 | final | wall clock |"
    assert (
        lines[2]
        == "| 0 | 0.400 (0.300–0.500) | 0.800 (0.700–0.900) | 0.850 (0.750–0.950) | 9.0 min |"
    )
    assert lines[3] == "| 1 | 0.400 (0.300–0.500) | – | 0.850 (0.750–0.950) | 9.0 min |"


def test_the_table_of_harness_runs(tmp_path: Path) -> None:
    rows: list[dict[str, object]] = [
        {"step": -1, "eval_reward": 0.4, "eval_ci_low": 0.3, "eval_ci_high": 0.5},
        {"step": 12, "eval_reward": 0.8, "eval_ci_low": 0.7, "eval_ci_high": 0.9},
    ]
    out = _run(tmp_path, 0, rows)
    record = json.loads((out / "demo.json").read_text())
    cell = {"low": 0.1, "high": 0.3, "n": 4}
    record["eval_matrix"] = {
        "chat": [
            {"label": "before", "reward": 0.2, **cell, "eval_only": False},
            {"label": "final", "reward": 0.7, **cell, "eval_only": False},
        ],
        "unseen": [
            {"label": "before", "reward": 0.25, **cell, "eval_only": True},
            {"label": "final", "reward": 0.5, **cell, "eval_only": True},
        ],
    }
    (out / "demo.json").write_text(json.dumps(record))
    lines = demo.table([str(out)]).splitlines()
    start = lines.index("| seed | harness | before | final | Δ |")
    assert lines[start + 2] == "| 0 | chat | 0.200 (0.100–0.300) | 0.700 (0.100–0.300) | +0.500 |"
    assert lines[start + 3].startswith("| 0 | unseen (eval only) | 0.250")
    assert lines[start + 3].endswith("| +0.250 |")


def test_the_demo_ends_on_the_table_and_where_to_look(tmp_path: Path) -> None:
    """The last lines of `lightning demo`: before/mid/final with intervals, the gain,
    and the report, the view and the record, not a dump of the run's summary."""
    rows: list[dict[str, object]] = [
        {"step": -1, "eval_reward": 0.4, "eval_ci_low": 0.3, "eval_ci_high": 0.5},
        {"step": 4, "eval_reward": 0.62, "eval_ci_low": 0.5, "eval_ci_high": 0.7},
        {"step": 12, "eval_reward": 0.85},
    ]
    out = _run(tmp_path, 0, rows)
    record = json.loads((out / "demo.json").read_text())
    lines = demo.ending(record, out, out / "run", str(out / "run" / "report.html"))
    assert lines == [
        "held-out reward  mean   95% interval",
        "before           0.400  0.300–0.500",
        "step 5           0.620  0.500–0.700",
        "final            0.850  –             +0.450 vs before",
        "ended on the final weights (after step 12) in 9.0 min",
        f"report: {out / 'run' / 'report.html'}",
        f"view:   lightning view {out / 'run'}",
        f"record: {out / 'demo.json'}",
    ]
    # Without a report (it failed; the run says how to redo it) the rest stands.
    assert not any(
        line.startswith("report:") for line in demo.ending(record, out, out / "run", None)
    )


@pytest.mark.slow
def test_the_demo_prints_progress_and_results_only(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """`lightning demo` end to end on the tiny model, with a small eval: no progress
    bar per weight sync, no JSON dump, and it ends on the before/after table and
    where the report, the view and the record are."""
    examples = Path(demo.examples_dir())
    text = (examples / "demo.toml").read_text()
    for old, new in [
        ("eval_limit = 48", "eval_limit = 4"),
        ("eval_samples = 3", "eval_samples = 1"),
        ("group_size = 8", "group_size = 2"),
        ("tasks_per_step = 4", "tasks_per_step = 1"),
        ('callable = "arith_agent.py:run"', f'callable = "{examples / "arith_agent.py"}:run"'),
    ]:
        assert old in text, old
        text = text.replace(old, new)
    config = tmp_path / "demo.toml"
    config.write_text(text)
    out = tmp_path / "demo"
    argv = ["--model", "tiny", "--steps", "2", "--config", str(config), "--output-dir", str(out)]
    assert demo.main(argv) == 0
    printed, errors = capfd.readouterr()
    everything = printed + errors
    assert "Writing model shards" not in everything
    assert '"output_dir"' not in everything and not any(
        line.startswith("{") for line in printed.splitlines()
    ), "the run's summary was dumped"
    # One harness: its per-harness matrix would repeat the eval lines.
    assert "held-out reward per harness" not in printed
    tail = printed.strip().splitlines()[-7:]
    assert tail[0].split() == ["[lightning]", "held-out", "reward", "mean", "95%", "interval"]
    assert tail[1].startswith("[lightning] before ") and tail[2].startswith("[lightning] final ")
    assert tail[2].endswith("vs before")
    assert tail[3].startswith("[lightning] ended on the final weights (after step 2)")
    assert tail[4] == f"[lightning] report: {out / 'run' / 'report.html'}"
    assert tail[5] == f"[lightning] view:   lightning view {out / 'run'}"
    assert tail[6] == f"[lightning] record: {out / 'demo.json'}"
    assert json.loads((out / "demo.json").read_text())["steps"] == 2


def test_kv_cache_bytes_reaches_the_engine_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`lightning demo --kv-cache-bytes 0` (benches/demo_wall.py's cache-off run) sets
    `[engine] kv_cache_bytes`; without the flag the config's own budget stands."""
    import lightning.run.loop
    from lightning.config import RunConfig

    seen: list[RunConfig] = []

    def fake_train(config: RunConfig) -> dict[str, object]:
        seen.append(config)
        Path(config.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(config.output_dir) / "metrics.jsonl").write_text("")
        return {}

    monkeypatch.setattr(lightning.run.loop, "train", fake_train)
    for flags in (["--kv-cache-bytes", "0"], []):
        out = tmp_path / f"demo{len(seen)}"
        assert demo.main(["--model", "tiny", "--steps", "1", "--output-dir", str(out), *flags]) == 0
    off, default = seen
    assert off.engine.kv_cache_bytes == 0
    shipped = RunConfig.load(Path(demo.examples_dir()) / "demo.toml")
    assert default.engine.kv_cache_bytes == shipped.engine.kv_cache_bytes > 0
