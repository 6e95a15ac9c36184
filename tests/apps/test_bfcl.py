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
