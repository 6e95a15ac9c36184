"""Asynchronous training (``[algorithm] max_staleness``): the staleness bound at
dispatch and at use, the off-policy weighting of stale tokens, the idle-fraction
bookkeeping (each against a plain reference), and a real asynchronous run."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning.config import AlgorithmSection, TrainerConfig, TrainerSection, trainer_defaults
from lightning.run.staleness import (
    PhaseLog,
    RolloutPipeline,
    SynchronousSchedule,
    enforce_at_use,
    may_dispatch,
    rollout_staleness,
    schedule,
    split_stale,
    staleness_histogram,
)
from reference import advantages, decoupled_ppo_token_loss

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


# -- the bound ---------------------------------------------------------------------


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    k=st.integers(0, 3),
    steps=st.integers(1, 8),
    data=st.data(),
)
def test_dispatch_bound_implies_bound_at_use(k: int, steps: int, data: st.DataObject) -> None:
    """Simulate a pipeline: the engines' version after step s trains is s + 1. A
    step's rollouts dispatch at some live version allowed by may_dispatch; each of
    their calls is served by any version between dispatch and training. However
    the schedule falls, no trained token is staler than k."""
    for step in range(steps):
        allowed = [v for v in range(step + 1) if may_dispatch(step, v, k)]
        assert allowed == list(range(max(0, step - k), step + 1))  # plain reading of the rule
        dispatched_at = data.draw(st.sampled_from(allowed))
        versions = data.draw(
            st.lists(st.integers(dispatched_at, step), min_size=1, max_size=5).map(sorted)
        )
        assert rollout_staleness(step, versions) <= k
        fresh, stale = split_stale(step, k, {"r": versions})
        assert (fresh, stale) == (["r"], [])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    step=st.integers(0, 10),
    k=st.integers(0, 3),
    versions=st.dictionaries(
        st.text("abc", min_size=1, max_size=3), st.lists(st.integers(0, 10), max_size=4)
    ),
)
def test_split_stale_matches_reference(step: int, k: int, versions: dict[str, list[int]]) -> None:
    fresh, stale = split_stale(step, k, versions)
    ref_stale = [r for r, vs in versions.items() if any(step - v > k for v in vs)]
    assert stale == ref_stale
    assert fresh == [r for r in versions if r not in ref_stale]


def test_staleness_histogram_counts_completion_tokens() -> None:
    calls = [
        SimpleNamespace(weight_version=3, completion_ids=[1, 2, 3]),
        SimpleNamespace(weight_version=2, completion_ids=[1]),
        SimpleNamespace(weight_version=3, completion_ids=[4, 5]),
    ]
    assert staleness_histogram(3, calls) == {0: 5, 1: 1}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spans=st.lists(
        st.tuples(st.sampled_from(["generate", "train"]), st.integers(0, 30), st.integers(0, 30)),
        max_size=8,
    ),
    window=st.tuples(st.integers(0, 30), st.integers(0, 30)),
)
def test_phase_busy_time_matches_unit_cells(
    spans: list[tuple[str, int, int]], window: tuple[int, int]
) -> None:
    log = PhaseLog()
    for kind, a, b in spans:
        log.record(kind, float(min(a, b)), float(max(a, b)))
    lo, hi = min(window), max(window)
    for kind in ("generate", "train"):
        cells = {
            t for k, a, b in spans if k == kind for t in range(min(a, b), max(a, b)) if lo <= t < hi
        }
        assert log.busy(kind, float(lo), float(hi)) == pytest.approx(len(cells))


# -- the schedule ------------------------------------------------------------------


def _schedule(k: int, generate: Any, steps: int = 4) -> Any:
    return schedule(
        AlgorithmSection(max_staleness=k),
        generate,
        PhaseLog(),
        start=0,
        steps=steps,
        version=0,
        timeout_s=5.0,
    )


def test_the_algorithm_section_alone_decides_sync_or_async() -> None:
    assert not AlgorithmSection(max_staleness=0).asynchronous
    assert AlgorithmSection(max_staleness=2).asynchronous
    assert isinstance(_schedule(0, lambda s: []), SynchronousSchedule)
    assert isinstance(_schedule(2, lambda s: []), RolloutPipeline)


def test_synchronous_schedule_generates_each_step_when_it_is_due() -> None:
    trained: list[int] = []
    seen: list[tuple[int, list[int]]] = []

    def generate(step: int) -> list[Any]:
        seen.append((step, list(trained)))
        return [step]

    with _schedule(0, generate) as sched:
        for batch in sched.batches():
            assert batch.results == [batch.step]
            trained.append(batch.step)
            sched.published(batch.step + 1)
    # Step s was generated only after steps 0..s-1 had trained.
    assert seen == [(s, list(range(s))) for s in range(4)]


def test_pipeline_overlaps_within_the_bound_and_never_beyond() -> None:
    """k = 1: step s + 1 is generated while step s trains (the trainer waits for
    it before publishing), and no step is dispatched on weights older than s - k."""
    dispatched: dict[int, int] = {}
    started = {s: threading.Event() for s in range(4)}
    sched = _schedule(1, lambda s: [])

    def generate(step: int) -> list[Any]:
        dispatched[step] = sched.version
        started[step].set()
        return [step]

    sched.generate = generate
    with sched:
        for batch in sched.batches():
            if batch.step + 1 in started:
                assert started[batch.step + 1].wait(timeout=5), "no overlap"
            sched.published(batch.step + 1)
    assert dispatched == {0: 0, 1: 0, 2: 1, 3: 2}
    assert all(may_dispatch(s, v, 1) for s, v in dispatched.items())


def test_pipeline_raises_a_failed_generation_in_the_training_loop() -> None:
    def generate(step: int) -> list[Any]:
        if step == 1:
            raise RuntimeError("harness broke")
        return []

    got = []
    with pytest.raises(RuntimeError, match="harness broke"), _schedule(2, generate) as sched:
        for batch in sched.batches():
            got.append(batch.step)
            sched.published(batch.step + 1)
    assert got == [0]


# -- enforcement at use --------------------------------------------------------------


class _Client:
    """Records events; `read_step` re-reads a batch from the 'store' (the calls below)."""

    def __init__(self, store: dict[str, list[int]]) -> None:
        self.events: list[tuple[str, str, Any]] = []
        self.store = store

    def event(self, rid: str, type: str, data: Any) -> None:
        self.events.append((rid, type, data))

    def read_step(self, ids: list[str], tokenizer: Any = None) -> Any:
        return _merged(ids, self.store)


def _merged(ids: list[str], store: dict[str, list[int]]) -> Any:
    """A MergeResult as the loop reads it: rollouts in the order asked, their calls."""
    return SimpleNamespace(
        rollouts=[SimpleNamespace(rollout_id=r) for r in ids],
        calls=[SimpleNamespace(rollout_id=r, weight_version=v) for r in ids for v in store[r]],
    )


def _run(k: int, on_stale: str) -> Any:
    alg = AlgorithmSection(max_staleness=k, on_stale=on_stale, drop_failed_rollouts=True)
    again: list[Any] = []
    # Calls as recorded, by rollout: trained at step 5; "new*" are regenerated on 5.
    store = {"a": [5, 5], "b": [3, 5], "c": [4], "new0": [5]}

    def rerun(jobs: list[Any], mode: str) -> list[Any]:
        again.extend(jobs)
        return [
            SimpleNamespace(rollout_id=f"new{i}", status="succeeded", task=t, group=g)
            for i, (t, g) in enumerate(jobs)
        ]

    return SimpleNamespace(
        config=SimpleNamespace(algorithm=alg),
        client=_Client(store),
        runner=SimpleNamespace(run=rerun),
        tokenizer=None,
        again=again,
        store=store,
    )


def _batch(run: Any) -> tuple[Any, list[Any]]:
    results = [
        SimpleNamespace(rollout_id=r, status="succeeded", task={"t": r}, group="g")
        for r in ("a", "b", "c")
    ]
    return _merged(["a", "b", "c"], run.store), results


def _ids(merged: Any) -> list[str]:
    return [r.rollout_id for r in merged.rollouts]


def test_stale_rollouts_are_dropped_and_counted() -> None:
    run = _run(k=1, on_stale="drop")
    merged, results = _batch(run)
    kept, counts = enforce_at_use(run, 5, merged, results)
    assert _ids(kept) == ["a", "c"]
    assert {c.rollout_id for c in kept.calls} == {"a", "c"}
    assert counts == {"dropped_stale": 1, "regenerated_stale": 0}
    assert run.client.events == [("b", "stale", {"step": 5, "versions": [3, 5]})]


def test_stale_rollouts_are_regenerated_on_current_weights() -> None:
    run = _run(k=1, on_stale="regenerate")
    merged, results = _batch(run)
    kept, counts = enforce_at_use(run, 5, merged, results)
    assert _ids(kept) == ["a", "c", "new0"]
    assert run.again == [({"t": "b"}, "g")]
    assert counts == {"dropped_stale": 0, "regenerated_stale": 1}
    assert [c.weight_version for c in kept.calls if c.rollout_id == "new0"] == [5]


def test_synchronous_runs_check_nothing() -> None:
    run = _run(k=0, on_stale="drop")
    merged, results = _batch(run)
    kept, counts = enforce_at_use(run, 5, merged, results)
    assert kept is merged and counts == {"dropped_stale": 0, "regenerated_stale": 0}


# -- off-policy weighting ----------------------------------------------------------------


def test_stale_tokens_get_the_decoupled_ppo_gradient() -> None:
    """One trainer step (async defaults: TIS at C = 2) on tokens whose recorded
    log-probs come from an older policy equals the gradient of the plain
    per-token decoupled PPO loss (tests/support/reference.py), token-mean."""
    from transformers import AutoModelForCausalLM

    from lightning.model_cache import tiny_model_dir
    from lightning.rl.trainer import Trainer
    from samples import grpo_batch

    model_dir = tiny_model_dir()
    section = TrainerSection(
        lr=1e-12, max_grad_norm=None, batching="padded", aggregation="token-mean"
    )
    cfg = TrainerConfig.for_run(
        section, model=model_dir, estimator="grpo", temperature=1.0, seed=0,
        defaults=trainer_defaults(off_policy=True),
    )  # fmt: skip
    assert (cfg.tis_cap, cfg.tis_level) == (2.0, "token")
    tr = Trainer(cfg)
    old = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():  # the stale policy: the same model, perturbed
        g = torch.Generator().manual_seed(0)
        for p in old.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    samples, rewards, groups = grpo_batch(n_groups=2, group_size=3, seed=4)
    for s in samples:
        with torch.no_grad():
            lp = torch.log_softmax(
                old(torch.from_numpy(s.tokens.astype(np.int64))[None]).logits[0], -1
            )
        behav = np.full(len(s.tokens), np.nan, np.float32)
        for t in range(1, len(s.tokens)):
            if s.weights[t] > 0:
                behav[t] = float(lp[t - 1, int(s.tokens[t])])
        s.logprobs = behav

    tr.step(samples, rewards, groups)
    got = torch.cat([p.grad.reshape(-1) for p in tr.params])

    # Plain reference: one sequence at a time through the same weights.
    ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref_model.load_state_dict(tr.model.state_dict())
    ids = list(dict.fromkeys(s.rollout_id for s in samples))
    adv = dict(
        zip(
            ids,
            advantages([rewards[r] for r in ids], [groups[r] for r in ids], "grpo"),
            strict=True,
        )
    )
    total_w = sum(float(s.weights[1:].sum()) for s in samples)
    loss = torch.zeros(())
    is_weights: list[float] = []
    for s in samples:
        logits = ref_model(torch.from_numpy(s.tokens.astype(np.int64))[None]).logits[0]
        lp = torch.log_softmax(logits.float(), -1)
        for t in range(1, len(s.tokens)):
            if s.weights[t] > 0:
                logp = lp[t - 1, int(s.tokens[t])]
                is_weights.append(min(float(np.exp(float(logp.detach()) - s.logprobs[t])), 2.0))
                token = decoupled_ppo_token_loss(
                    logp,
                    prox=float(logp.detach()),
                    behav=float(s.logprobs[t]),
                    adv=adv[s.rollout_id],
                    clip_low=0.2,
                    clip_high=0.2,
                    cap=2.0,
                )
                loss = loss + float(s.weights[t]) * token / total_w
    loss.backward()
    want = torch.cat([p.grad.reshape(-1) for p in ref_model.parameters() if p.requires_grad])
    # The importance weights really matter: some are capped, some well below 1.
    assert max(is_weights) == 2.0 and min(is_weights) < 0.5, sorted(is_weights)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


# -- a real asynchronous run ----------------------------------------------------------------


@pytest.mark.slow
def test_asynchronous_run_on_the_tiny_model(tmp_path: Path) -> None:
    from lightning.config import RunConfig
    from lightning.run.loop import Run

    sys.path.insert(0, str(EXAMPLES))
    try:
        import arith_tasks
    finally:
        sys.path.remove(str(EXAMPLES))
    tasks = tmp_path / "tasks"
    assert (
        arith_tasks.main(["--n", "60", "--eval-size", "2", "--seed", "3", "--out", str(tasks)]) == 0
    )
    out = tmp_path / "run"
    config = RunConfig.load(
        EXAMPLES / "demo.toml",
        {
            "model.builtin": "tiny",
            "steps": 3,
            "eval_every": 0,
            "checkpoint_every": 0,
            "output_dir": str(out),
            "tasks.train": str(tasks / "train.jsonl"),
            "tasks.eval": str(tasks / "eval.jsonl"),
            "algorithm.group_size": 3,
            "algorithm.tasks_per_step": 2,
            "algorithm.max_staleness": 1,
            "harness.concurrency": 6,
            "trainer.lr": 1e-3,
        },
    )
    with Run(config, quiet=True) as run:
        assert run.trainer.config.tis_cap == 2.0
        assert run.engine is not None
        root = run.engine.root
        # Whether a step's rollouts race ahead of the previous update is up to the
        # scheduler; hold each update until the next step's batch is generated, so
        # the overlap the bound allows (k = 1) always happens and is what we check.
        generated = {s: threading.Event() for s in range(3)}
        rollouts, train_on = run.generate, run.train_on

        def rollouts_then_signal(step: int) -> Any:
            results = rollouts(step)
            generated[step].set()
            return results

        def train_after_next_batch(step: int, results: Any, *, t0: float) -> Any:
            if step + 1 in generated:
                assert generated[step + 1].wait(timeout=300), f"step {step + 1} never generated"
            return train_on(step, results, t0=t0)

        run.generate = rollouts_then_signal  # type: ignore[method-assign]
        run.train_on = train_after_next_batch  # type: ignore[method-assign]
        run.run()
        health = httpx.get(root + "/health").json()
    assert health["weight_version"] == 3
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if 0 <= m["step"] < 3]
    assert [m["step"] for m in steps] == [0, 1, 2]
    seen: set[int] = set()
    for m in steps:
        hist = {int(k): v for k, v in m["staleness_tokens"].items()}
        assert hist and max(hist) <= 1 and min(hist) >= 0, hist
        seen |= {k for k, v in hist.items() if v > 0}
        assert m["dropped_stale"] == 0 and m["regenerated_stale"] == 0
        for key in ("engine_idle_frac", "trainer_idle_frac"):
            assert 0.0 <= m[key] <= 1.0
        assert m["e2e_tokens_per_s"] > 0
    # Generation overlapped training: steps 1 and 2 were generated entirely before
    # the previous update landed, so they trained one-step-old tokens only.
    assert seen == {0, 1}, [m["staleness_tokens"] for m in steps]
    assert set(steps[0]["staleness_tokens"]) == {"0"}
    assert set(steps[1]["staleness_tokens"]) == {"1"} and set(steps[2]["staleness_tokens"]) == {"1"}
