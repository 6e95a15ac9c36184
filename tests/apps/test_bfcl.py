"""BFCL v4 through its own harness and checker (lightning.apps.bfcl, examples/bfcl/).

The environment is created from PyPI once into ``$LIGHTNING_CACHE/bfcl-venv``
(about a minute); after that one test case runs through BFCL's generation code,
a real gateway and the fake engine, and BFCL's checker scores it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fake_vllm import FakeEngine
from gateways import gateway_client
from lightning.apps import bfcl
from lightning.gateway.store import Store
from lightning.run.runner import Runner

HARNESS = Path(__file__).resolve().parents[2] / "examples" / "bfcl" / "harness.sh"
RIGHT = "[calculate_triangle_area(base=10, height=5)]"  # BFCL's answer for simple_python_0


@pytest.fixture(scope="module")
def bfcl_env() -> Path:
    try:
        return bfcl.bfcl_python(quiet=True)
    except RuntimeError as e:  # no PyPI here: say so rather than fail on the network
        pytest.skip(f"BFCL's environment cannot be created here: {str(e)[:300]}")


# (answer, BFCL's score, its checker's error type (a prefix), the shaped reward):
# a right call, prose, the right function with a wrong value, the wrong function.
CASES = [
    (RIGHT, 1.0, None, 1.0),
    ("The area is 25.", 0.0, "ast_decoder:", 0.0),
    ("[calculate_triangle_area(base=10, height=7)]", 0.0, "value_error:", 0.5),
    ("[triangle_area(base=10, height=5)]", 0.0, "simple_function_checker:wrong_func_name", 0.25),
]


@pytest.mark.parametrize(("answer", "score", "error_type", "shaped"), CASES)
def test_one_case_through_bfcl_and_the_gateway(
    bfcl_env: Path, tmp_path: Path, answer: str, score: float, error_type: str, shaped: float
) -> None:
    engine = FakeEngine(script=[{"content": answer}])
    try:
        with gateway_client(engine.url, tmp_path / "lightning.db") as client:
            runner = Runner(client, ["sh", str(HARNESS)], reward_source="stdout", timeout_s=120)
            task = {
                "id": "simple_python_0",
                "category": "simple_python",
                "results_dir": str(tmp_path / "kept"),
                "max_tokens": 64,
                "shaped": True,
            }
            (result,) = runner.run([(task, None)], mode="eval")
    finally:
        engine.stop()
    assert result.status == "succeeded", result.stderr_tail
    # Trained on the shaped reward; BFCL's own verdict rides beside it unchanged.
    assert result.reward == shaped
    final = json.loads(result.stdout_tail.strip().splitlines()[-1])
    got_error = final["bfcl"].pop("error_type")
    assert final["bfcl"] == {
        "id": "simple_python_0",
        "category": "simple_python",
        "accuracy": score,
        "correct_count": int(score),
        "total_count": 1,
    }
    assert got_error == error_type if error_type is None else got_error.startswith(error_type)
    # BFCL's one call is in the store with exact ids, the reward beside it.
    with Store(tmp_path / "lightning.db") as store:
        (rollout,) = store.rollouts()
        (call,) = store.records(rollout["rollout_id"])
    assert rollout["reward"] == shaped
    assert call.prompt_ids is not None and call.completion_ids is not None
    assert bytes(int(t) - 10 for t in call.completion_ids).decode() == answer
    # BFCL's own `bfcl evaluate` over the kept result line writes the same
    # per-category score file a leaderboard run would, with the same verdict.
    harness_py = HARNESS.parent / "bfcl_harness.py"
    official = bfcl.official_scores(
        tmp_path / "kept", [rollout["rollout_id"]], tmp_path / "official", harness_py
    )
    assert official["simple_python"]["accuracy"] == score
    assert official["simple_python"]["total_count"] == 1
    md = bfcl.report_md(
        {
            "before": {},
            "official": {"before": official},
            "decontamination": None,
        },
        tmp_path,
        seed=0,
        steps=0,
    )
    assert "official/score/" in md and "BFCL_v4_simple_python_score.json" in md
    # BFCL wrote the function docs into the system prompt (its prompt mode); the
    # fake engine's tokenizer is byte-level (id = byte + 10).
    prompt = bytes(int(t) - 10 for t in call.prompt_ids).decode()
    assert '"name": "calculate_triangle_area"' in prompt


def test_cases_through_a_worker_pool_match_one_process_per_case(
    bfcl_env: Path, tmp_path: Path
) -> None:
    """One worker imports BFCL once and runs every case after it in the same
    project root: each case's verdict is the one a fresh process gives (CASES),
    each rollout records its own call, and a case BFCL cannot run fails only its
    rollout, with BFCL's reason, not the worker."""
    engine = FakeEngine(script=[{"content": RIGHT}])
    harness_py = HARNESS.parent / "bfcl_harness.py"
    try:
        with (
            bfcl.workers(1, harness_py) as path,
            gateway_client(engine.url, tmp_path / "lightning.db") as client,
        ):
            runner = Runner(client, ["sh", str(HARNESS)], reward_source="stdout", timeout_s=120)
            got = []
            for answer, *_ in CASES:
                engine.script([{"content": answer}])
                task = {"id": "simple_python_0", "category": "simple_python", "shaped": True}
                (result,) = runner.run([(task, None)], mode="eval")
                assert result.status == "succeeded", result.stderr_tail
                got.append(json.loads(result.stdout_tail.strip().splitlines()[-1]))
            unknown = {"id": "simple_python_99999", "category": "simple_python"}
            (bad,) = runner.run([(unknown, None)], mode="eval")
            engine.script([{"content": RIGHT}])
            (again,) = runner.run([({"id": "simple_python_0"}, None)], mode="eval")
            assert Path(path).exists()
        assert not Path(path).exists()  # the pool cleans up after itself
    finally:
        engine.stop()
    for final, (_, score, error_type, shaped) in zip(got, CASES, strict=True):
        assert final["reward"] == shaped
        assert final["bfcl"]["accuracy"] == score
        assert final["bfcl"]["total_count"] == 1  # the last case's files were cleared
        got_error = final["bfcl"]["error_type"]
        assert got_error == error_type if error_type is None else got_error.startswith(error_type)
    assert bad.status == "failed" and "BFCL worker" in bad.stderr_tail
    assert again.status == "succeeded" and again.reward == 1.0
    with Store(tmp_path / "lightning.db") as store:
        rollouts = store.rollouts()
        calls = {r["rollout_id"]: store.records(r["rollout_id"]) for r in rollouts}
    answered = [r for r in rollouts if calls[r["rollout_id"]]]
    # Every case that reached the model is its own rollout with its one call.
    assert len(answered) == len(CASES) + 1
    assert all(len(calls[r["rollout_id"]]) == 1 for r in answered)


def test_score_model_scores_cases_on_the_embedded_engine(bfcl_env: Path, tmp_path: Path) -> None:
    """An arm is scored end to end: the embedded engine serving SmolLM2 (which
    takes only requests carrying its key), the recording gateway, the worker
    pool and BFCL's checker. Every case runs (a harness failure would be
    reported, never counted as a wrong answer) and each gets BFCL's verdict."""
    from lightning.model_cache import smollm2_dir

    tasks = [
        {"id": f"simple_python_{i}", "category": "simple_python", "temperature": 0.0,
         "max_tokens": 8}
        for i in (0, 1)
    ]  # fmt: skip
    scored = bfcl.score_model(
        smollm2_dir(), tasks, tmp_path / "arm", harness=HARNESS, samples=2, concurrency=2
    )
    assert scored["harness_failed"] == 0
    assert sorted(scored["per_id"]) == ["simple_python_0", "simple_python_1"]
    for row in scored["per_id"].values():
        assert len(row["rewards"]) == 2
        # Eight tokens of the base model are never a call BFCL can decode.
        assert all(v is not None and v.startswith("ast_decoder:") for v in row["verdicts"])
    with Store(tmp_path / "arm" / "lightning.db") as store:
        rollouts = store.rollouts()
    assert len(rollouts) == 4 and all(r["status"] == "succeeded" for r in rollouts)


def test_tasks_split_by_category(bfcl_env: Path, tmp_path: Path) -> None:
    counts = bfcl.write_tasks(
        tmp_path, train=["live_simple"], held_out=["simple_python"], per_category=3, seed=0
    )
    assert counts["eval"] == 3
    assert counts["train"] == 3 - counts["decontaminated"]
    report = json.loads((tmp_path / "decontaminate.json").read_text())
    assert report["train_in"] == 3 and report["train_out"] == counts["train"]
    rows = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert {r["category"] for r in rows} == {"simple_python"}
    assert not any("shaped" in r for r in rows)
    bfcl.write_tasks(
        tmp_path,
        train=["live_simple"],
        held_out=["simple_python"],
        per_category=3,
        seed=0,
        train_extra={"shaped": True},
    )
    train_rows = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    eval_rows = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    # Only training is shaped: what is measured stays BFCL's 0/1.
    assert train_rows and all(r["shaped"] is True for r in train_rows)
    assert not any("shaped" in r for r in eval_rows)
    with pytest.raises(ValueError, match="both trained and held out"):
        bfcl.write_tasks(
            tmp_path, train=["multiple"], held_out=["multiple"], per_category=1, seed=0
        )


def _case(cid: str, question: str, name: str, description: str) -> dict[str, object]:
    return {
        "id": cid,
        "question": [[{"role": "user", "content": question}]],
        "function": [
            {
                "name": name,
                "description": description,
                "parameters": {"type": "dict", "properties": {"x": {"type": "integer"}}},
            }
        ],
    }


def test_decontamination_drops_train_cases_near_held_out_ones() -> None:
    weather = "Get the current weather forecast for a city given by its name, in degrees Celsius."
    held = [
        _case("h0", "What is the weather like in Paris today?", "get_weather", weather),
        _case(
            "h1",
            "Find the area of a triangle whose base is 10 units and height is 5 units.",
            "triangle_area",
            "Area of a triangle.",
        ),
    ]
    train = [
        # the held-out function, another question: its description's n-grams match
        _case("t0", "Is it raining in Rome?", "get_weather", weather),
        # a near-duplicate question (case and punctuation differ), another function
        _case(
            "t1",
            "find the area of a triangle whose base is 10 units and height is 7 units!",
            "geometry_area",
            "Computes areas.",
        ),
        _case("t2", "Convert 3 miles to kilometers.", "convert_units", "Unit conversion."),
    ]
    kept, report = bfcl.decontaminate_cases(train, held, n=8)
    assert [c["id"] for c in kept] == ["t2"]
    assert (report["train_in"], report["train_out"], report["held_out"]) == (3, 1, 2)
    assert {r["id"]: r["held_out"] for r in report["removed"]} == {"t0": ["h0"], "t1": ["h1"]}
    assert report["removed"][0]["shared"] in weather.lower().replace(",", "")  # 8 words of it
    # n above the 14 words the questions share keeps the paraphrase (not the function)
    kept, _ = bfcl.decontaminate_cases(train, held, n=15)
    assert [c["id"] for c in kept] == ["t1", "t2"]


# ------------------------------------------------------------------ recipe v2


def _held(n: int) -> list[dict[str, object]]:
    return [
        _case(f"simple_python_{i}", f"Compute thing number {i}.", f"fn_{i}", "d") for i in range(n)
    ]


def test_split_drops_by_name_question_and_ngram_and_hashes_the_ids() -> None:
    held = {"simple_python": _held(100), "irrelevance": [_case("irrelevance_0", "Hi?", "x", "y")]}
    weather = "Get the current weather forecast for a city given by its name, in degrees Celsius."
    held["simple_python"][0] = _case("simple_python_0", "Weather in Paris?", "get_weather", weather)
    train = {
        "live_simple": [
            _case("ls_0", "Is it raining in Rome?", "get_weather", "other words entirely"),
            _case("ls_1", "  COMPUTE thing   number 5. ", "other_fn", "o"),
            _case("ls_2", "Tell me", "new_fn", weather),
            _case("ls_3", "Convert 3 miles to kilometers.", "convert_units", "Unit conversion."),
        ]
    }
    m = bfcl.split_cases(held, train, ngram=8)
    assert m["train_pool"] == {"live_simple": ["ls_3"]}
    assert {d["id"]: d["reason"] for d in m["dropped"]} == {
        "ls_0": "function_name",
        "ls_1": "question_text",
        "ls_2": "ngram",
    }
    assert m["overlap"] == {
        "function_name": 1, "question_text": 1, "ngram": 1, "dropped": 3, "train_in": 4
    }  # fmt: skip
    assert m["held_out"]["simple_python"][:2] == ["simple_python_0", "simple_python_1"]
    assert m["never_trained"] == [bfcl.NEVER_TRAIN] and "8-gram" in m["rule"]
    # The hash is over the ids: the same split hashes the same, another one differently.
    assert bfcl.split_cases(held, train, ngram=8)["sha256"] == m["sha256"]
    train["live_simple"].pop()
    assert bfcl.split_cases(held, train, ngram=8)["sha256"] != m["sha256"]


def test_split_refuses_too_few_held_out_cases_and_the_chatable_file() -> None:
    with pytest.raises(ValueError, match="99 held-out simple_python cases; the recipe needs"):
        bfcl.split_cases({"simple_python": _held(99)}, {"live_simple": []})
    with pytest.raises(ValueError, match="never train on unused_datasets"):
        bfcl.split_cases({"simple_python": _held(100)}, {"chatable": []})


def test_paired_difference_and_mcnemar() -> None:
    # 10 cases: a right on 3, b right on 7; b wins 5 discordant pairs, a wins 1.
    a = [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    b = [1, 1, 0, 1, 1, 1, 1, 1, 0, 0]
    d = bfcl.paired_difference(a, b, seed=1)
    assert d["diff"] == pytest.approx(0.4) and d["n"] == 10
    assert (d["a_wins"], d["b_wins"]) == (1, 5)
    # Exact two-sided binomial: 2 * P(X <= 1 | n=6, p=1/2) = 2 * 7/64.
    assert d["p_value"] == pytest.approx(14 / 64)
    assert d["low"] <= 0.4 <= d["high"] and d["low"] > -0.2
    same = bfcl.paired_difference(a, a)
    assert (same["diff"], same["low"], same["high"], same["p_value"]) == (0.0, 0.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="equal lengths"):
        bfcl.mcnemar([1], [1, 0])


def test_sft_examples_are_bfcl_prompts_with_gold_answers_it_accepts(
    bfcl_env: Path, tmp_path: Path
) -> None:
    script = HARNESS.parent / "sft_data.py"
    ids = {
        "simple_python": ["simple_python_0", "simple_python_2"],
        "live_simple": ["live_simple_0-0-0"],
    }
    info = bfcl.sft_examples(ids, tmp_path / "sft.jsonl", script)
    assert info == {"examples": 3, "gold_rejected": []}
    rows = [json.loads(x) for x in (tmp_path / "sft.jsonl").read_text().splitlines()]
    by_id = {r["id"]: r["messages"] for r in rows}
    # BFCL's prompt-mode system prompt (its own text, with the function docs), the
    # question as BFCL ships it, and the gold answer in the format the prompt asks for.
    system, user, answer = by_id["simple_python_0"]
    assert (
        system["role"] == "system" and "[func_name1(params_name1=params_value1" in system["content"]
    )
    assert '"name": "calculate_triangle_area"' in system["content"]
    assert user == {
        "role": "user",
        "content": bfcl.category_cases("simple_python")[0]["question"][0][0]["content"],
    }
    assert answer == {
        "role": "assistant",
        "content": "[calculate_triangle_area(base=10, height=5, unit='units')]",
    }
    # An optional parameter BFCL lets the answer omit ("" or 0) gets its value.
    assert by_id["simple_python_2"][-1]["content"] == "[math.hypot(x=4, y=5, z=0)]"


def _scored(rewards: dict[str, tuple[str, float, str | None]]) -> dict[str, object]:
    return {
        "per_id": {
            t: {
                "category": cat,
                "rewards": [r],
                "calls": [bfcl.made_call(cat, v, r)],
                "verdicts": [v],
            }
            for t, (cat, r, v) in rewards.items()
        }
    }


def test_arms_table_paired_rows_and_report() -> None:
    assert bfcl.made_call("simple_python", None, 1.0)
    assert bfcl.made_call("simple_python", "value_error:others", 0.0)
    assert not bfcl.made_call("simple_python", "ast_decoder:decoder_failed", 0.0)
    assert not bfcl.made_call("simple_python", None, 0.0)  # a harness failure: no verdict
    assert bfcl.made_call("irrelevance", "irrelevance_error:decoder_success", 0.0)
    assert not bfcl.made_call("irrelevance", None, 1.0)
    sp = "simple_python"
    sft = _scored({"a": (sp, 1.0, None), "b": (sp, 0.0, "value_error:x"), "c": (sp, 0.0, "ast_decoder:d"),
                   "i": ("irrelevance", 1.0, None)})  # fmt: skip
    rl = _scored({"a": (sp, 1.0, None), "b": (sp, 1.0, None), "c": (sp, 1.0, None),
                  "i": ("irrelevance", 0.0, "irrelevance_error:decoder_success")})  # fmt: skip
    arms = {"sft": sft, "sft+rl": rl}
    table = bfcl.arm_table(arms)
    assert table["sft"][sp]["n"] == 3 and table["sft"][sp]["accuracy"] == pytest.approx(1 / 3)
    assert table["sft"][sp]["call_rate"] == pytest.approx(2 / 3)
    assert table["sft+rl"]["irrelevance"]["call_rate"] == 1.0
    paired = bfcl.paired_rows(arms, [("sft", "sft+rl"), ("control", "sft+rl")], sp)
    assert list(paired) == ["sft+rl - sft"]  # no control arm: no control row
    assert paired["sft+rl - sft"]["diff"] == pytest.approx(2 / 3)
    md = bfcl.report_v2(
        {"seed": 0, "max_tokens": 96, "table": table, "paired": paired, "phases": {"sft": 1.5},
         "learnability": {"prompts": 10, "kept": 4, "samples": 8}}
    )  # fmt: skip
    assert bfcl.HELD_OUT_SENTENCE in md
    assert "| sft+rl | irrelevance | 1 | 0.000" in md
    assert "sft+rl - sft: +0.667" in md and "4 of 10 training prompts" in md


def test_seeds_report_pools_per_case_differences(tmp_path: Path) -> None:
    """Two seeds share the SFT arm; both RL arms win case b, seed 1's loses case
    a: per case the mean over seeds of (sft+rl − sft) is −0.5, +1, 0, so the
    pooled difference is +1/6, and with 3 cases its interval spans 0."""
    sp = "simple_python"
    sft = _scored({"a": (sp, 1.0, None), "b": (sp, 0.0, "value_error:x"), "c": (sp, 0.0, "x")})
    rl0 = _scored({"a": (sp, 1.0, None), "b": (sp, 1.0, None), "c": (sp, 0.0, "x")})
    rl1 = _scored({"a": (sp, 0.0, "x"), "b": (sp, 1.0, None), "c": (sp, 0.0, "x")})
    dirs = []
    for seed, rl in ((0, rl0), (1, rl1)):
        d = tmp_path / f"s{seed}"
        d.mkdir()
        run = {"seed": seed, "arms": {"sft": sft, "sft+rl": rl}, "phases": {"rl": 10.0 + seed}}
        (d / "bfcl.json").write_text(json.dumps(run))
        dirs.append(d)
    md = bfcl.seeds_report(dirs)
    assert "seed 0, sft+rl - sft: +0.333" in md and "seed 1, sft+rl - sft: +0.000" in md
    assert "pooled over 2 seeds, sft+rl - sft: +0.167" in md
    assert "(interval includes 0)" in md
    assert "| 1 | rl | 11.0 |" in md and bfcl.HELD_OUT_SENTENCE in md


def test_each_phase_runs_in_its_own_process_with_the_same_arguments() -> None:
    given = ["recipe", "--seed", "1", "--phases", "filter,rl", "--arms=sft+rl"]
    assert bfcl.phase_argv(given, "rl") == [
        "recipe", "--seed", "1", "--arms=sft+rl", "--phases", "rl"
    ]  # fmt: skip
    assert bfcl.phase_argv(["recipe", "--phases=a,b"], "a") == ["recipe", "--phases", "a"]


def test_recipe_configs_load() -> None:
    from lightning.config import RunConfig, SftConfig

    here = HARNESS.parent
    for name in ("sft.toml", "gpu_sft.toml"):
        cfg = SftConfig.load(here / name)
        assert cfg.sft.source == "dataset" and cfg.sft.epochs == 1.0
    assert RunConfig.load(here / "recipe.toml").algorithm.estimator == "grpo"
