"""lightning.view.show: ``lightning show`` prints one rollout's merged trace,
from a run's ``traces.jsonl`` or straight from a gateway store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning import cli
from lightning.traces import ANSI_GENERATED


def write_traces(run_dir: Path) -> Path:
    """A run directory with the loop's ``traces.jsonl`` (one divergent trace)."""
    run_dir.mkdir(parents=True)
    rows = [
        {
            "step": 0,
            "rollout_id": f"r0-{k}",
            "reward": k / 2,
            "pieces": ["<s>", "Q: 3 < 5?", "\n", " yes"],
            "weights": [0.0, 0.0, 0.0, 1.0],
            "divergences": [{"position": 2, "kind": "template"}] if k == 1 else [],
            "task": {"id": "t1"},
        }
        for k in range(3)
    ]
    (run_dir / "traces.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_cli_show_from_run_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_traces(tmp_path / "run")
    assert cli.main(["show", "r0-1", "--run", str(run), "--color", "always"]) == 0
    out = capsys.readouterr().out
    assert "rollout r0-1" in out and ANSI_GENERATED in out and "[↪ template]" in out
    assert cli.main(["show", "nope", "--run", str(run)]) == 1
    assert cli.main(["show", "r0-1", "--db", str(tmp_path / "x.db")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_show_standalone_store_without_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A standalone gateway's store has no run config beside it: `show` still
    merges the rollout and prints it, tokens as ids, and says how to decode."""
    import openai

    from fake_vllm import FakeEngine
    from gateways import start_gateway

    engine = FakeEngine("S")
    db = tmp_path / "gw.db"
    try:
        with start_gateway(engine.url, db) as gw, gw.client() as client:
            r = client.create_rollout({"task": "t"})
            with openai.OpenAI(base_url=r.base_url, api_key=r.token) as sdk:
                answer = sdk.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi [[len:3]]"}]
                )
            client.reward(r.id, 1.0)
            calls = client.trace(r.id)
    finally:
        engine.stop()
    assert answer.choices[0].message.content
    assert cli.main(["show", r.id, "--db", str(db), "--color", "never"]) == 0
    captured = capsys.readouterr()
    assert f"rollout {r.id}" in captured.out and "reward 1" in captured.out
    # Every prompt and generated id of the one call appears, in order.
    ids = [*calls[0].prompt_ids.tolist(), *calls[0].completion_ids.tolist()]
    assert "".join(f"⟨{i}⟩" for i in ids) in captured.out.replace("«", "").replace("»", "")
    assert "pass --model DIR" in captured.err
