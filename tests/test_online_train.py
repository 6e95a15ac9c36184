"""``lightning train --online``: sessions recorded through a real gateway, feedback
on some of them, one trainer step on the tiny model trains exactly those."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from fake_vllm import FakeEngine
from lightning.online import (
    OnlineRewardSection,
    latest_per_target,
    pool_small_groups,
    session_reward,
)
from test_online import Gw, db_rows, feedback, new_key


def sig(name: str, value: float, ts: float, resp: str | None = None) -> dict[str, object]:
    return {"name": name, "value": value, "ts": ts, "response_id": resp}


def test_default_reward_is_mean_of_latest_per_name_and_target() -> None:
    sigs = [sig("thumbs", 0.0, 1, "a"), sig("thumbs", 1.0, 5, "a"), sig("thumbs", 0.0, 3, "b"),
            sig("task_success", 1.0, 2)]  # fmt: skip
    assert len(latest_per_target(sigs)) == 3
    assert session_reward(sigs, OnlineRewardSection()) == pytest.approx(2 / 3)
    assert session_reward(sigs, OnlineRewardSection(kind="last")) == 1.0
    assert session_reward(sigs, OnlineRewardSection(kind="sum")) == 2.0
    w = OnlineRewardSection(kind="weighted", weights={"task_success": 2.0})
    assert session_reward(sigs, w) == 2.0
    assert session_reward([], OnlineRewardSection()) is None


def test_small_groups_pool_into_the_batch_baseline() -> None:
    g = pool_small_groups({"a": "x", "b": "x", "c": "y", "d": "z"}, 2)
    assert g == {"a": "x", "b": "x", "c": "__batch__", "d": "__batch__"}


@pytest.fixture(scope="module")
def engine() -> Iterator[FakeEngine]:
    e = FakeEngine("T", unique_ids=True)
    yield e
    e.stop()


def test_train_online_trains_exactly_the_sessions_with_feedback(
    engine: FakeEngine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning.loop import train_main
    from lightning.models import tiny_model_dir
    from lightning.report import show_main

    db = tmp_path / "train.db"
    gw = Gw(db, engine.url, "idle_timeout_s = 600\nsweep_interval_s = 3600")
    try:
        key = new_key(gw, "bot", tags=["arith"])
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        answers = {}
        for i in range(6):
            # Sessions 0-3 share a task (one group); 4 and 5 are singletons.
            task = "what is 2+2?" if i < 4 else f"what is {i}+{i}?"
            out = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"{task} [[len:{6 + i}]]"}],
                extra_headers={"x-session-id": f"s{i}"},
            )  # fmt: skip
            answers[i] = out.id
        rated = {0: 1.0, 1: 0.0, 2: 1.0, 4: 1.0, 5: 0.0}  # session 3 never gets feedback
        for i, v in rated.items():
            r = feedback(
                gw, key, feedback_id=f"f{i}", response_id=answers[i], name="thumbs", value=v
            )
            assert r.status_code == 200
        assert gw.admin("POST", "/admin/online/sweep", {"idle_timeout_s": 0}).json()["closed"] == 6
        owner = dict(db_rows(db, "SELECT response_id, rollout_id FROM calls"))
        cfg = tmp_path / "online.toml"
        cfg.write_text(
            f'output_dir = "{tmp_path / "run"}"\n[model]\nbuiltin = "tiny"\n'
            f'[source]\ndb = "{db}"\ntags = ["arith"]\n[trainer]\nlr = 1e-4\n'
        )
        assert train_main(["--online", str(cfg), "--quiet"]) == 0
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert set(summary["sessions"]) == {owner[answers[i]] for i in rated}
        groups = summary["groups"]
        assert len({groups[owner[answers[i]]] for i in (0, 1, 2)}) == 1
        assert groups[owner[answers[4]]] == groups[owner[answers[5]]] == "__batch__"
        step = summary["steps"][0]
        assert step["sessions"] == 5 and step["loss"] == step["loss"]  # trained, finite
        assert (tmp_path / "run" / "weights" / "latest" / "config.json").exists()
        trained = {
            r[0]
            for r in db_rows(db, "SELECT rollout_id FROM online_sessions WHERE trained IS NOT NULL")
        }
        assert trained == set(summary["sessions"])
        # A session is a rollout: `lightning show` reads it from the store unchanged.
        capsys.readouterr()
        assert show_main([owner[answers[0]], "--db", str(db), "--model", str(tiny_model_dir()),
                          "--color", "never"]) == 0  # fmt: skip
        assert "«" in capsys.readouterr().out
        # Late feedback for a trained session is kept and flagged.
        late = feedback(gw, key, feedback_id="late", response_id=answers[0], name="thumbs", value=0)
        assert late.status_code == 200 and late.json()["after_training"] is True
        # Not trained twice unless asked.
        assert (
            train_main(["--online", str(cfg), "--quiet", "--output-dir", str(tmp_path / "run2")])
            == 0
        )
        assert json.loads((tmp_path / "run2" / "summary.json").read_text())["sessions"] == []
    finally:
        gw.stop()
