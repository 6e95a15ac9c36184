"""``lightning train --online``: sessions recorded through a real gateway, feedback
on some of them, one trainer step on the tiny model trains exactly those."""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_online_protocols import PREFIX, PROTOCOLS, sdk_clients, turn_for

from fake_vllm import FakeEngine
from lightning.online.rewards import OnlineRewardSection, latest_per_target, session_reward
from lightning.online.select import pool_small_groups
from online_gateway import ADMIN, Gw, db_rows, new_key


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


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_train_online_trains_exactly_the_sessions_with_feedback(
    engine: FakeEngine,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    protocol: str,
) -> None:
    """Sessions recorded over ``protocol`` (half of them before production's
    weights moved to version 1), feedback on five of six: one ``lightning train
    --online`` step on the tiny model trains exactly those five, through the
    packed tree, and reports what it selected, skipped and weighted."""
    from lightning.cli import main as cli
    from lightning.model_cache import tiny_model_dir
    from lightning.view.show import main as show_main

    db = tmp_path / "train.db"
    gw = Gw(db, engine.url, "idle_timeout_s = 600\nsweep_interval_s = 3600")
    try:
        key = new_key(gw, "bot", tags=["arith"])
        answers = {}
        with sdk_clients(gw.url, key) as (oa, an):
            turn = turn_for(protocol, oa, an, stream=False)
            for i in range(6):
                if i == 3:  # production now serves weight version 1
                    gw.api.set_upstreams([{"url": engine.url, "weight_version": 1}])
                # Sessions 0-3 share a task (one group); 4 and 5 are singletons.
                task = "what is 2+2?" if i < 4 else f"what is {i}+{i}?"
                msg = {"role": "user", "content": f"{task} [[len:{8 if i < 4 else 6 + i}]]"}
                answers[i], _ = turn([msg], f"s{i}")
        assert all(a.startswith(PREFIX[protocol]) for a in answers.values())
        rated = {0: 1.0, 1: 0.0, 2: 1.0, 4: 1.0, 5: 0.0}  # session 3 never gets feedback
        for i, v in rated.items():
            gw.api.feedback(key, f"f{i}", name="thumbs", value=v, response_id=answers[i])
        gw.api.feedback(key, "s0", name="task_success", value=True, session_id="s0")
        assert gw.api.sweep(idle_timeout_s=0)["closed"] == 6
        owner = dict(db_rows(db, "SELECT response_id, rollout_id FROM calls"))
        cfg = tmp_path / "online.toml"
        cfg.write_text(
            f'output_dir = "{tmp_path / "run"}"\n[model]\nbuiltin = "tiny"\n'
            f'[source]\ndb = "{db}"\ntags = ["arith"]\n'
            # The gateway still writes the store: the pass marks through it.
            f'gateway = "{gw.url}"\nadmin_key_env = "TEST_ONLINE_ADMIN_KEY"\n'
            "[trainer]\nlr = 1e-4\n"
        )
        monkeypatch.setenv("TEST_ONLINE_ADMIN_KEY", ADMIN)
        capsys.readouterr()
        assert cli(["train", "--online", str(cfg)]) == 0
        printed = capsys.readouterr().out
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert set(summary["sessions"]) == {owner[answers[i]] for i in rated}
        groups = summary["groups"]
        (shared,) = {groups[owner[answers[i]]] for i in (0, 1, 2)}
        assert shared.startswith("p:")
        assert groups[owner[answers[4]]] == groups[owner[answers[5]]] == "__batch__"
        # The pass's own account: selected, skipped and why, signals, groups.
        assert summary["sessions_selected"] == summary["sessions_trained"] == 5
        assert summary["sessions_skipped"] == {"no_feedback": 1}
        assert summary["feedback_signals"] == {"task_success": 1, "thumbs": 5}
        assert (summary["n_groups"], summary["singleton_fallback"]) == (2, 2)
        # Session 0: mean of thumbs 1 and task_success 1; the others their thumbs.
        assert summary["session_reward_mean"] == pytest.approx(3 / 5)
        (step,) = summary["steps"]
        lines = [
            json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        ]
        assert lines == [json.loads(json.dumps(step))]
        assert step["sessions_trained"] == 5 and step["loss"] == step["loss"]  # trained, finite
        assert step["reward_mean"] == pytest.approx(3 / 5)
        assert (step["groups"], step["singleton_fallback"]) == (2, 2)
        # Off-policy: truncated importance weights against the engine's logprobs.
        assert 0 < step["tis_weight_mean"] <= 2.0 and 0 <= step["tis_clip_frac"] <= 1
        # Staleness against the newest version trained (1): sessions 0-2 were
        # sampled one version behind, 4-5 by it; counted in completion tokens.
        comp = dict(db_rows(db, "SELECT response_id, LENGTH(completion_ids) / 4 FROM calls"))
        assert step["policy_version"] == 1 and step["staleness_max"] == 1
        assert step["steps_behind"] == 0
        assert step["staleness_tokens"] == {
            "0": comp[answers[4]] + comp[answers[5]],
            "1": sum(comp[answers[i]] for i in (0, 1, 2)),
        }
        # One path with the main loop: the packed tree computes the group's
        # shared prompt prefix once.
        assert step["forward_tokens"] < step["tokens"]
        assert "5 sessions in 2 groups (2 on the batch baseline)" in printed
        assert "skipped {'no_feedback': 1}" in printed
        assert (tmp_path / "run" / "weights" / "latest" / "config.json").exists()
        trained = {
            r[0]
            for r in db_rows(db, "SELECT rollout_id FROM online_sessions WHERE trained IS NOT NULL")
        }
        assert trained == set(summary["sessions"])
        # A session is a rollout: `lightning show` reads it from the store unchanged.
        assert show_main([owner[answers[0]], "--db", str(db), "--model", str(tiny_model_dir()),
                          "--color", "never"]) == 0  # fmt: skip
        assert "«" in capsys.readouterr().out
        # Late feedback for a trained session is kept and flagged.
        late = gw.api.feedback(key, "late", name="thumbs", value=0, response_id=answers[0])
        assert late.after_training
        # Not trained twice unless asked; the second pass says why.
        run2 = tmp_path / "run2"
        assert cli(["train", "--online", str(cfg), "--quiet", "--output-dir", str(run2)]) == 0
        again = json.loads((run2 / "summary.json").read_text())
        assert again["sessions"] == [] and again["sessions_trained"] == 0
        assert again["sessions_skipped"] == {"already_trained": 5, "no_feedback": 1}
        short = tmp_path / "short.toml"
        short.write_text(cfg.read_text().replace("[source]\n", "[source]\nmin_calls = 2\n"))
        run3 = tmp_path / "run3"
        # `lightning online train` is the same pass as `lightning train --online`.
        assert cli(["online", "train", str(short), "--quiet", "--output-dir", str(run3)]) == 0
        assert json.loads((run3 / "summary.json").read_text())["sessions_skipped"] == {
            "already_trained": 5,
            "too_short": 1,
        }
    finally:
        gw.stop()


def strict_json(text: str) -> object:
    """JSON, refusing ``Infinity``/``NaN`` (which Python writes but JSON has not)."""

    def refuse(c: str) -> None:
        raise AssertionError(f"{c} in what should be JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_huge_reward_stops_the_pass_before_anything_is_marked(
    engine: FakeEngine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A feedback value of 1e308 made ``reward_std`` infinite, every advantage
    0, and the pass still marked every session trained (their real feedback used
    up) and wrote ``Infinity`` into metrics.jsonl. Now the pass refuses the
    reward and stops before it trains or marks anything, naming the session and
    the fix; with the bound raised, the step's statistics stop it instead; with
    ``on_bad_reward = "skip"`` it trains the others and leaves that one untrained."""
    from lightning.cli import main as cli

    db = tmp_path / "huge.db"
    gw = Gw(db, engine.url, "idle_timeout_s = 600\nsweep_interval_s = 3600")
    try:
        key = new_key(gw, "bot")
        answers = {}
        with sdk_clients(gw.url, key) as (oa, an):
            turn = turn_for("chat", oa, an, stream=False)
            for i in range(4):
                msg = {"role": "user", "content": f"what is 2+2? [[len:{8 + i}]]"}
                answers[i], _ = turn([msg], f"s{i}")
        for i, v in enumerate((1.0, 0.0, 1.0, 0.0)):
            gw.api.feedback(key, f"f{i}", name="thumbs", value=v, response_id=answers[i])
        assert gw.api.sweep(idle_timeout_s=0)["closed"] == 4
    finally:
        gw.stop()
    # The value a client could post before the gateway checked the range; set
    # here directly so the test holds whatever the gateway accepts at the door.
    with sqlite3.connect(db) as c:
        c.execute("UPDATE feedback SET value = 1e308 WHERE feedback_id = 'f0'")
    owner = dict(db_rows(db, "SELECT response_id, rollout_id FROM calls"))
    huge = owner[answers[0]]

    def run(name: str, reward: str) -> tuple[int, str, Path]:
        cfg = tmp_path / f"{name}.toml"
        cfg.write_text(
            f'output_dir = "{tmp_path / name}"\n[model]\nbuiltin = "tiny"\n'
            f'[source]\ndb = "{db}"\n[trainer]\nlr = 1e-4\n[reward]\n{reward}\n'
        )
        capsys.readouterr()
        rc = cli(["train", "--online", str(cfg), "--quiet"])
        return rc, capsys.readouterr().err, tmp_path / name

    def trained() -> set[str]:
        sql = "SELECT rollout_id FROM online_sessions WHERE trained IS NOT NULL"
        return {r[0] for r in db_rows(db, sql)}

    # Refused at the reward: before the model is even loaded.
    rc, err, out = run("refused", "")
    assert rc == 1 and "Traceback" not in err
    assert f"1 session(s) have a reward that is not finite or beyond ±1e+06: {huge}" in err
    assert "signal 'thumbs' = 1e+308 (feedback_id 'f0')" in err
    assert "Nothing was marked trained" in err and 'on_bad_reward = "skip"' in err
    summary = strict_json((out / "summary.json").read_text())
    assert isinstance(summary, dict) and summary["sessions_trained"] == 0
    assert "stopped" in summary and not (out / "metrics.jsonl").exists()
    assert trained() == set() and not (out / "weights").exists()

    # Accepted as a reward, the step's statistics are not finite: stop before the step.
    rc, err, out = run("inf", "max_abs = 1e308")
    assert rc == 1 and "Traceback" not in err
    assert "online pass stopped: step 1's reward_std is not finite" in err
    assert f"The largest rewards: {huge} = 1e+308" in err
    assert "stopped" in strict_json((out / "summary.json").read_text())  # type: ignore[operator]
    assert trained() == set() and not (out / "weights").exists()

    # A step that comes out with a non-finite loss: its metrics line says null
    # (never NaN), and the pass stops before it marks anything.
    from lightning.rl.trainer import Trainer

    step = Trainer.step

    def nan_loss(self: Trainer, *a: object, **kw: object) -> dict[str, object]:
        return {**step(self, *a, **kw), "loss": float("nan")}  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Trainer, "step", nan_loss)
        rc, err, out = run("nan", 'on_bad_reward = "skip"')
    assert rc == 1 and "online pass stopped: step 1's loss is not finite" in err
    (line,) = [strict_json(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert isinstance(line, dict) and line["loss"] is None and line["sessions_trained"] == 3
    assert trained() == set() and not (out / "weights").exists()

    # Skipped: the other three train; the refused session stays untrained.
    rc, err, out = run("skip", 'on_bad_reward = "skip"')
    assert rc == 0, err
    summary = strict_json((out / "summary.json").read_text())
    assert isinstance(summary, dict)
    assert summary["sessions_skipped"] == {"bad_reward": 1}
    assert set(summary["sessions"]) == {owner[answers[i]] for i in (1, 2, 3)}
    assert trained() == set(summary["sessions"]) and huge not in trained()


@pytest.mark.parametrize("command", [["train", "--online"], ["online", "train"]])
def test_a_missing_model_is_one_line_naming_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    """The documented ``online.toml`` named only a model path; a user without
    one got a traceback. Now one line, naming ``builtin = "tiny"`` (under either
    spelling of the command, each naming itself)."""
    from lightning.cli import main as cli

    db = tmp_path / "none.db"
    db.write_bytes(b"")
    cfg = tmp_path / "online.toml"
    cfg.write_text(f'[model]\npath = "/models/policy"\n[source]\ndb = "{db}"\n')
    assert cli([*command, str(cfg)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'builtin = "tiny"' in err and "/models/policy" in err
    assert err.startswith(f"lightning {' '.join(command)}: ")
    cfg.write_text(f'[source]\ndb = "{db}"\n')
    assert cli([*command, str(cfg)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model: Field required" in err and 'builtin = "tiny"' in err


@pytest.mark.parametrize(
    "argv",
    [["online", "export"], ["online", "sessions"], ["train", "--online"], ["online", "train"]],
)
def test_every_online_argument_has_help(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``lightning online export --help`` listed its options with no word on any."""
    from lightning.cli import main as cli

    with pytest.raises(SystemExit) as done:
        cli([*argv, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    options = text.split("options:")[1].splitlines()
    # Each option line (`  --db PATH   the gateway's store ...`) carries its
    # description, or the next line does (a long option name wraps).
    flags = [i for i, line in enumerate(options) if line.startswith("  -")]
    bare = [
        options[i]
        for i in flags
        if not re.search(r"\S\s{2,}\S", options[i].strip())
        and not (i + 1 < len(options) and re.match(r"\s{8,}\S", options[i + 1]))
    ]
    assert len(flags) >= 2 and bare == [], text


def test_train_online_checks_it_can_mark_before_it_trains(
    engine: FakeEngine,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 39: without ``gateway = URL`` on a store a gateway is writing, the
    pass fails before a step is trained or a weight written (it used to train,
    write weights, then die at marking, leaving the sessions to train again);
    with a wrong admin key for the gateway, the same."""
    from lightning import LightningError
    from lightning.online.train import OnlineConfig, train_online

    db = tmp_path / "mark.db"
    gw = Gw(db, engine.url, "idle_timeout_s = 600\nsweep_interval_s = 3600")
    try:
        key = new_key(gw, "bot")
        with sdk_clients(gw.url, key) as (oa, an):
            turn = turn_for("chat", oa, an, stream=False)
            answer, _ = turn([{"role": "user", "content": "2+2? [[len:6]]"}], "s0")
        gw.api.feedback(key, "f0", name="thumbs", value=1.0, response_id=answer)
        assert gw.api.sweep(idle_timeout_s=0)["closed"] == 1
        out = tmp_path / "run"
        base = {"output_dir": str(out), "model": {"builtin": "tiny"}}
        cfg = OnlineConfig.model_validate({**base, "source": {"db": str(db)}})
        with pytest.raises(LightningError, match="gateway = URL") as err:
            train_online(cfg, quiet=True)
        assert f"pid {gw.proc.pid}" in str(err.value)
        assert not (out / "metrics.jsonl").exists() and not (out / "weights").exists()
        # The command says so in one line (no traceback) and exits 1.
        from lightning.online.train import train_main

        toml = tmp_path / "online.toml"
        toml.write_text(f'output_dir = "{out}"\n[model]\nbuiltin = "tiny"\n[source]\ndb = "{db}"\n')
        assert train_main([str(toml), "--quiet"]) == 1
        said = capsys.readouterr().err.strip().splitlines()
        assert len(said) == 1 and "gateway = URL" in said[0], said
        monkeypatch.setenv("WRONG_KEY", "not-the-admin-key")
        through = {"db": str(db), "gateway": gw.url, "admin_key_env": "WRONG_KEY"}
        cfg = OnlineConfig.model_validate({**base, "source": through})
        with pytest.raises(LightningError):
            train_online(cfg, quiet=True)
        assert not (out / "metrics.jsonl").exists()
        assert db_rows(db, "SELECT COUNT(*) FROM online_sessions WHERE trained IS NOT NULL") == [
            (0,)
        ]
    finally:
        gw.stop()
