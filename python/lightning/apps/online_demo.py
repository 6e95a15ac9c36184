"""`lightning demo --online`: online mode end to end on a laptop CPU.

The arithmetic agent (``examples/arith_agent.py``, unmodified) is served "in
production": SmolLM2-135M-Instruct on the embedded engine, behind the gateway,
reached through one application key. Simulated users ask it arithmetic
questions (a popular question is asked by several users, as in real traffic);
each user later rates the answers it was given — thumbs up (1) for a correct
one, thumbs down (0) for a wrong one — after a random delay, out of order, some
twice, and some users never rate at all. Then one ``lightning train --online``
pass trains from the store (sessions with feedback, grouped by their first
prompt, weighted off-policy) and pushes the new weights to the engine. The
held-out reward (the harness's own reward on tasks production never saw,
sampled like production) is measured before and after, with the bootstrap
interval of ``lightning.run.stats``; the draws are paired (same sampling seeds).

    lightning demo --online                  # SmolLM2, the numbers in README
    lightning demo --online --model tiny --questions 2 --users 2 --eval-tasks 2   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from lightning.run.stats import Interval

# The environment variable the online pass reads the running gateway's admin key from.
_ADMIN_ENV = "LIGHTNING_ONLINE_DEMO_ADMIN_KEY"


class _Recording:
    """An ``AsyncOpenAI`` stand-in for the agent that remembers the id of every
    answer it was given (what a product keeps to attach a user's rating)."""

    def __init__(self, client: Any, headers: dict[str, str]) -> None:
        self._client = client
        self._headers = headers
        self.ids: list[str] = []
        self.chat = self
        self.completions = self

    async def create(self, **kw: Any) -> Any:
        reply = await self._client.chat.completions.create(**kw, extra_headers=self._headers)
        self.ids.append(reply.id)
        return reply


async def _solve_all(
    agent: Any, url: str, key: str, jobs: list[dict[str, Any]], concurrency: int
) -> list[tuple[Any, list[str]]]:
    """Runs the agent on every job concurrently; ``(result, answer ids)`` each."""
    from openai import AsyncOpenAI

    sem = asyncio.Semaphore(concurrency)
    async with AsyncOpenAI(base_url=url, api_key=key, max_retries=2, timeout=300) as client:

        async def one(j: int, task: dict[str, Any]) -> tuple[Any, list[str]]:
            async with sem:
                # The product's plumbing names the conversation; the agent is unchanged.
                rec = _Recording(client, {"x-session-id": f"conv-{j}"})
                result = await agent.solve(task, rec)
                return result, rec.ids

        return list(await asyncio.gather(*(one(j, t) for j, t in enumerate(jobs))))


def evaluate(
    agent: Any, engine_url: str, engine_key: str, tasks: list[dict[str, Any]], *, samples: int,
    temperature: float,
    seed: int, model: str,
) -> Interval:  # fmt: skip
    """The held-out reward: every task ``samples`` times straight on the engine
    (not production traffic, so not recorded), job j with the same sampling
    seed in every eval, so before and after differ by the weights only."""
    from lightning.run.loop import sampling_seed
    from lightning.run.stats import reward_interval

    jobs = [
        {**t, "temperature": temperature, "model": model,
         "sampling_seed": sampling_seed(seed, -1, j)}
        for j, t in enumerate(t for t in tasks for _ in range(samples))
    ]  # fmt: skip
    results = asyncio.run(_solve_all(agent, engine_url, engine_key, jobs, 32))
    by_task: dict[str, list[float]] = {}
    for j, (r, _) in enumerate(results):
        by_task.setdefault(str(j // samples), []).append(r.reward)
    return reward_interval(by_task, seed=seed)


def rate(
    client: Any, key: str, served: list[tuple[Any, list[str]]], *, rng: random.Random,
    silent_frac: float, max_delay_s: float,
) -> dict[str, int]:  # fmt: skip
    """The users' ratings, posted from a background thread after random delays
    and out of order (some twice): per answer, 1 if the checker found it
    correct, else 0; a ``silent_frac`` of users never rate."""
    posts = []
    for u, (result, ids) in enumerate(served):
        if rng.random() < silent_frac:
            continue
        for t, rid in enumerate(ids):
            right = result.correct and t == len(ids) - 1
            posts.append({"feedback_id": f"u{u}-t{t}", "response_id": rid, "value": int(right)})
    rng.shuffle(posts)
    posts += rng.sample(posts, len(posts) // 10)  # a flaky client resends some
    delays = sorted(rng.uniform(0, max_delay_s) for _ in posts)
    counts = {"posted": 0, "duplicate": 0}

    def user() -> None:
        t0 = time.monotonic()
        for p, d in zip(posts, delays, strict=True):
            time.sleep(max(0.0, t0 + d - time.monotonic()))
            r = client.feedback(key, p["feedback_id"], name="thumbs", value=p["value"],
                                response_id=p["response_id"])  # fmt: skip
            counts["posted"] += 1
            counts["duplicate"] += r.duplicate

    thread = threading.Thread(target=user, name="users")
    thread.start()
    thread.join()
    return counts


def main(argv: list[str]) -> int:
    from lightning import Gateway, GatewayClient, GatewayConfig, UpstreamConfig
    from lightning.apps.examples import examples_dir, load_example
    from lightning.config import ModelSection, TrainerSection
    from lightning.online.select import GroupingSection, SourceSection
    from lightning.online.train import OnlineConfig, WeightSyncSection, train_online
    from lightning.run.loop import (
        ENGINE_KEY_ENV,
        SERVED_MODEL_NAME,
        EmbeddedEngine,
        read_tasks,
        sampling_seed,
    )

    p = argparse.ArgumentParser(prog="lightning demo --online", description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="smollm2-135m-instruct",
                   choices=["smollm2-135m-instruct", "tiny"])  # fmt: skip
    p.add_argument("--questions", type=int, default=20, help="distinct production questions")
    p.add_argument("--users", type=int, default=8, help="users asking each question")
    p.add_argument("--eval-tasks", type=int, default=48)
    p.add_argument("--eval-samples", type=int, default=3)
    p.add_argument("--sessions-per-step", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--temperature", type=float, default=0.7, help="production's sampling")
    p.add_argument("--max-delay-s", type=float, default=5.0, help="users rate within this")
    p.add_argument("--output-dir", help="default: runs/online-demo-seed<SEED>-<timestamp>")
    args = p.parse_args(argv)
    started = time.monotonic()
    rng = random.Random(args.seed)
    out = Path(
        args.output_dir or f"runs/online-demo-seed{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    out.mkdir(parents=True, exist_ok=True)

    def say(msg: str) -> None:
        print(f"[lightning online demo] {msg}", flush=True)

    examples = examples_dir()
    agent = _module(examples / "arith_agent.py")
    gen = load_example(examples / "arith_tasks.py")
    if gen.main(["--seed", str(args.seed), "--out", str(out / "tasks"), *gen.DEMO_FLAGS]):
        return 1
    questions = read_tasks(out / "tasks" / "train.jsonl")[: args.questions]
    held_out = read_tasks(out / "tasks" / "eval.jsonl")[: args.eval_tasks]
    model_dir = ModelSection(builtin=args.model).resolve()
    # The engine takes only requests with its key; the weight sync of `train
    # --online` (EmbeddedSync) reads it from the same variable.
    os.environ.setdefault(ENGINE_KEY_ENV, secrets.token_urlsafe(24))
    engine = EmbeddedEngine(model_dir, host="127.0.0.1", port=0, max_batch=32, dtype="float32",
                            threads=None, log_path=out / "engine.log")  # fmt: skip
    admin = secrets.token_urlsafe(24)
    db = out / "prod.db"
    gw = None
    try:
        engine.wait_ready(600)
        say(f"engine {engine.url} serving {args.model}")

        def held_out_reward(label: str) -> Interval:
            t0 = time.monotonic()
            iv = evaluate(agent, engine.url, engine.key, held_out, samples=args.eval_samples,
                          temperature=args.temperature, seed=args.seed, model=SERVED_MODEL_NAME)  # fmt: skip
            say(f"held-out reward {label}: {iv} ({time.monotonic() - t0:.0f} s)")
            return iv

        before = held_out_reward("before")
        gw_cfg = GatewayConfig(
            listen="127.0.0.1:0",
            db=str(db),
            admin_key=admin,
            upstreams=[UpstreamConfig(url=engine.url)],
            upstream_api_key=engine.key,
        )
        gw = Gateway(gw_cfg).start()
        with GatewayClient(gw.url, admin) as client:
            key = client.create_app_key("arith-prod", tags=["arith"])
            assert key.key is not None
            jobs = [
                {**q, "temperature": args.temperature, "model": SERVED_MODEL_NAME,
                 "sampling_seed": sampling_seed(args.seed, 0, j)}
                for j, q in enumerate(q for q in questions for _ in range(args.users))
            ]  # fmt: skip
            rng.shuffle(jobs)  # users arrive in any order
            t0 = time.monotonic()
            served = asyncio.run(_solve_all(agent, gw.url + "/v1", key.key, jobs, 32))
            correct = sum(r.correct for r, _ in served) / len(served)
            say(f"served {len(served)} conversations ({sum(len(i) for _, i in served)} calls, "
                f"{correct:.0%} correct) in {time.monotonic() - t0:.0f} s")  # fmt: skip
            fb = rate(client, key.key, served, rng=rng, silent_frac=0.15,
                      max_delay_s=args.max_delay_s)  # fmt: skip
            say(f"users posted {fb['posted']} ratings ({fb['duplicate']} resent)")
            client.sweep(idle_timeout_s=0)  # close every session: all are done
        cfg = OnlineConfig(
            model=ModelSection(builtin=args.model),
            # The gateway still writes prod.db: mark sessions trained through it.
            source=SourceSection(
                db=str(db), tags=["arith"], gateway=gw.url, admin_key_env=_ADMIN_ENV
            ),
            grouping=GroupingSection(key="first_prompt", min_group=2),
            weight_sync=WeightSyncSection(policy="embedded", urls=[engine.url]),
            temperature=args.temperature,
            sessions_per_step=args.sessions_per_step,
            trainer=TrainerSection(lr=args.lr, compute_dtype="float32"),
            output_dir=str(out / "online"),
            seed=args.seed,
        )
        t0 = time.monotonic()
        os.environ[_ADMIN_ENV] = admin
        summary = train_online(cfg)
        train_s = time.monotonic() - t0
        serving = httpx.get(engine.root + "/health", timeout=30).json().get("weight_version")
        say(f"engine now serves weight version {serving}")
        after = held_out_reward("after")
    finally:
        os.environ.pop(_ADMIN_ENV, None)
        if gw is not None:
            gw.stop()
        engine.stop()
    record = {
        "seed": args.seed,
        "model": args.model,
        "conversations": len(served),
        "production_correct": correct,
        "ratings": fb,
        "sessions_trained": summary["sessions_trained"],
        "sessions_skipped": summary["sessions_skipped"],
        "steps": len(summary["steps"]),
        "train_s": train_s,
        "engine_weight_version": serving,
        "before": _iv(before),
        "after": _iv(after),
        "wall_s": time.monotonic() - started,
    }
    (out / "demo.json").write_text(json.dumps(record, indent=2))
    say(f"held-out reward before {before}, after one online pass {after}; "
        f"{record['wall_s']:.0f} s wall clock; {out / 'demo.json'}")  # fmt: skip
    return 0


def _module(path: Path) -> Any:
    """The agent as a module (registered, so its dataclasses resolve)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(f"_lightning_demo_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _iv(iv: Interval) -> dict[str, Any]:
    return {"mean": iv.mean, "low": iv.low, "high": iv.high, "tasks": iv.tasks,
            "samples": iv.samples}  # fmt: skip
