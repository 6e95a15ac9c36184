"""The engine's prefix KV cache (lightning.engine.prefix) and chunked prefill.

The radix tree is checked against a brute-force reference (tests/reference.py);
the engine with the cache on is checked against the same engine with it off and
against a plain transformers forward (the trainer's recomputation), on the tiny
random model and on SmolLM2-135M.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from lightning.engine import Engine, Event, SamplingParams
from lightning.engine.prefix import PrefixCache
from lightning.engine.server import RunningServer, _byte_size
from lightning.model_cache import smollm2_dir, tiny_model_dir
from reference import longest_cached_prefix

LAYERS = 2


def kv_of(ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fake keys/values [H=1, n, D=2] that say which token sat at which position."""
    tok = torch.tensor(ids, dtype=torch.float32)
    pos = torch.arange(len(ids), dtype=torch.float32)
    keys = torch.stack([tok, pos], dim=-1)[None]  # [1, n, 2]
    return [(keys + layer, -keys - layer) for layer in range(LAYERS)]


def read_match(cache: PrefixCache, ids: list[int], version: int = 0) -> tuple[int, list]:
    match = cache.match(ids, version, limit=len(ids))
    buffers = [
        (torch.full((1, len(ids), 2), -7.0), torch.full((1, len(ids), 2), -7.0))
        for _ in range(LAYERS)
    ]
    match.copy_into(buffers)
    return match.length, [(k[:, : match.length], v[:, : match.length]) for k, v in buffers]


def assert_kv_is(got: list, ids: list[int]) -> None:
    for (gk, gv), (wk, wv) in zip(got, kv_of(ids), strict=True):
        assert torch.equal(gk, wk) and torch.equal(gv, wv)


seqs = st.lists(st.integers(0, 3), min_size=1, max_size=12)


@given(stored=st.lists(seqs, max_size=8), queries=st.lists(seqs, min_size=1, max_size=6))
def test_match_is_the_longest_stored_prefix(stored: list[list[int]], queries: list) -> None:
    cache = PrefixCache(1 << 30)
    for ids in stored:
        cache.insert(ids, kv_of(ids), version=0)
    for ids in [*queries, *stored]:
        length, got = read_match(cache, ids)
        assert length == longest_cached_prefix(stored, ids, len(ids))
        assert_kv_is(got, ids[:length])  # the right tokens' keys, in order, across splits
    assert cache.bytes == sum(k.nbytes + v.nbytes for k, v in _all_kv(cache))


def _all_kv(cache: PrefixCache) -> list:
    out, stack = [], list(cache.root.children.values())
    while stack:
        node = stack.pop()
        out.extend(node.kv)
        stack.extend(node.children.values())
    return out


@given(stored=st.lists(seqs, min_size=1, max_size=12), budget=st.integers(0, 800))
def test_eviction_keeps_the_budget_and_never_serves_wrong_keys(
    stored: list[list[int]], budget: int
) -> None:
    cache = PrefixCache(budget)
    for ids in stored:
        cache.insert(ids, kv_of(ids), version=0)
        assert cache.bytes <= budget
        assert cache.bytes == sum(k.nbytes + v.nbytes for k, v in _all_kv(cache))
    for ids in stored:
        length, got = read_match(cache, ids)
        assert length <= longest_cached_prefix(stored, ids, len(ids))
        assert_kv_is(got, ids[:length])


def test_lru_evicts_the_least_recently_used_leaf() -> None:
    per_token = sum(k.nbytes + v.nbytes for k, v in kv_of([0]))
    cache = PrefixCache(10 * per_token)
    a, b, c = [1, 2, 3, 4], [1, 2, 5, 6], [7, 8, 9, 9]
    cache.insert(a, kv_of(a), 0)
    cache.insert(b, kv_of(b), 0)  # splits a's edge after [1, 2]
    assert cache.bytes == 6 * per_token
    cache.match(a, 0)  # a's leaf is now newer than b's
    cache.insert(c, kv_of(c), 0)  # 10 tokens fit exactly
    assert cache.evictions == 0
    cache.insert([7, 8, 0], kv_of([7, 8, 0]), 0)  # one more token: evict b's [5, 6]
    assert cache.evictions == 1 and cache.bytes == 9 * per_token
    assert read_match(cache, b)[0] == 2 and read_match(cache, a)[0] == 4
    assert cache.stats()["kv_cache_evicted_bytes"] == 2 * per_token


def test_other_weight_versions_are_never_served_or_stored() -> None:
    cache = PrefixCache(1 << 20)
    ids = [1, 2, 3]
    cache.insert(ids, kv_of(ids), version=0)
    assert cache.match(ids, 1).length == 0  # computed under 0, asked at 1
    cache.invalidate(1)
    assert cache.bytes == 0 and cache.match(ids, 0).length == 0
    assert cache.insert(ids, kv_of(ids), version=0) == 0  # a late v0 insert is refused
    assert cache.match(ids, 1).length == 0
    assert cache.insert(ids, kv_of(ids), version=1) == 3
    assert cache.match(ids, 1).length == 3
    assert cache.stats()["kv_cache_invalidations"] == 1


def test_a_zero_budget_is_off_and_a_negative_one_is_refused() -> None:
    cache = PrefixCache(0)
    assert cache.insert([1, 2], kv_of([1, 2]), 0) == 0 and cache.match([1, 2], 0).length == 0
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        PrefixCache(-1)
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        Engine(tiny_model_dir(), kv_cache_bytes=-1)


# ---------------------------------------------------------------- the engine


def reference_logprobs(model_dir: Path, prompt: list[int], completion: list[int]) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()  # [L, V]
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(completion)]


def max_gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


def group(engine: Engine, prompt: list[int], n: int, tokens: int) -> list:
    """n concurrent requests (own threads, own seeds) sharing one prompt."""
    out: list = [None] * n

    def one(i: int) -> None:
        params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=100 + i)
        out[i] = engine.generate(prompt, params)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir()


def test_a_group_shares_one_prefill_and_matches_the_uncached_engine(model_dir: Path) -> None:
    prompt = [(7 * i) % 4000 + 10 for i in range(600)]
    with (
        Engine(model_dir, max_batch=8, kv_cache_bytes=0) as off,
        Engine(model_dir, max_batch=8, prefill_chunk=128) as on,
    ):
        want = group(off, prompt, 8, 10)
        got = group(on, prompt, 8, 10)
        first = on.status()["prefill_tokens"]
        again = group(on, prompt, 8, 10)  # the prompt is cached now
        status = on.status()
    for w, g, a in zip(want, got, again, strict=True):
        assert g.token_ids == w.token_ids == a.token_ids
        assert max_gap(g.logprobs, w.logprobs) <= 1e-4
        assert max_gap(a.logprobs, w.logprobs) <= 1e-4
    ref = reference_logprobs(model_dir, prompt, got[0].token_ids)
    assert max_gap(ref, got[0].logprobs) < 1e-4
    # One 600-token prefill for the first group: requests that arrive while it
    # runs join it, later ones take 599 tokens from the cache and compute the
    # last. The second group computes only last tokens.
    assert first <= 600 + 7
    assert status["prefill_tokens"] - first <= 8
    assert status["kv_cache_hit_tokens"] >= 599
    assert 0 < status["kv_cache_hit_rate"] <= 1 and status["kv_cache_bytes"] > 0


def test_each_turn_prefills_only_its_new_tokens(model_dir: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5)
    with (
        Engine(model_dir, max_batch=4, kv_cache_bytes=0) as off,
        Engine(model_dir, max_batch=4, prefill_chunk=64) as on,
    ):
        prompt = list(range(20, 120))
        for turn in range(5):
            before = on.status()["prefill_tokens"]
            got = on.generate(prompt, params)
            computed = on.status()["prefill_tokens"] - before
            want = off.generate(prompt, params)
            assert got.token_ids == want.token_ids
            assert max_gap(got.logprobs, want.logprobs) <= 1e-4
            new = [300 + 17 * turn + i for i in range(30)]
            if turn:
                # Reused: the previous prompt and every completion token the
                # previous turn fed back; computed: its last sampled token + new.
                assert computed == 1 + 30
            prompt = prompt + got.token_ids + new
        ref = reference_logprobs(model_dir, got.prompt_ids, got.token_ids)
        assert max_gap(ref, got.logprobs) < 1e-4


def test_a_weight_reload_drops_every_cached_prefix(model_dir: Path, tmp_path: Path) -> None:
    new = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    new.save_pretrained(tmp_path / "v1")
    prompt = list(range(50, 250))
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=2)
    with Engine(model_dir, max_batch=4) as engine:
        old = engine.generate(prompt, params)
        assert engine.generate(prompt, params).token_ids == old.token_ids
        cached = engine.status()["prefill_cached_tokens"]
        assert cached == 199  # the second request reused the first's prompt
        assert engine.load_weights(tmp_path / "v1", 1) == 1
        status = engine.status()
        assert status["kv_cache_bytes"] == 0 and status["kv_cache_invalidations"] == 1
        after = engine.generate(prompt, params)
        # Nothing from version 0 was used at version 1: all 200 tokens recomputed.
        assert engine.status()["prefill_cached_tokens"] == cached
        assert after.weight_version == 1
        assert (
            max_gap(reference_logprobs(tmp_path / "v1", prompt, after.token_ids), after.logprobs)
            < 1e-4
        )
        # The new version's prefixes are cached again.
        engine.generate(prompt, params)
        assert engine.status()["prefill_cached_tokens"] == cached + 199


def test_chunked_prefill_keeps_running_rows_decoding(model_dir: Path) -> None:
    """A long prompt admitted in chunks of 64: the running row decodes between chunks."""
    with Engine(model_dir, max_batch=4, prefill_chunk=64) as engine:
        seen: list[int] = []  # prefill_tokens at each decode event of the running row
        done = threading.Event()

        def sink(ev: Event) -> None:
            seen.append(engine.stats["prefill_tokens"])
            if ev.finish_reason is not None or ev.error is not None:
                done.set()

        short = list(range(10, 20))
        engine.submit(short, SamplingParams(max_tokens=60, ignore_eos=True, seed=0), sink)
        while not seen:
            done.wait(0.005)
        start = engine.stats["prefill_tokens"]
        long_prompt = [(3 * i) % 3000 + 5 for i in range(1500)]
        result = engine.generate(long_prompt, SamplingParams(max_tokens=2, temperature=0.0))
        done.wait(60)
        alone = Engine(model_dir, max_batch=1, kv_cache_bytes=0, prefill_chunk=4096)
        with alone:
            whole = alone.generate(long_prompt, SamplingParams(max_tokens=2, temperature=0.0))
    during = [p for p in seen if start < p < start + 1500]
    assert len(during) >= 1500 // 64 - 2, seen  # a decode step between (nearly) every chunk
    assert result.token_ids == whole.token_ids
    assert max_gap(result.logprobs, whole.logprobs) <= 1e-4


def test_a_tight_budget_evicts_and_stays_exact(model_dir: Path) -> None:
    # The tiny model keeps 2 layers x 4 heads x 16 x 2 x 4 bytes = 1 KiB per token.
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=9)
    prompts = [[1000 + 40 * j + i for i in range(120)] for j in range(4)]
    with (
        Engine(model_dir, max_batch=4, kv_cache_bytes=300 * 1024) as on,
        Engine(model_dir, max_batch=4, kv_cache_bytes=0) as off,
    ):
        for _ in range(2):
            for p in prompts:
                a, b = on.generate(p, params), off.generate(p, params)
                assert a.token_ids == b.token_ids and max_gap(a.logprobs, b.logprobs) <= 1e-4
                assert on.status()["kv_cache_bytes"] <= 300 * 1024
        status = on.status()
    assert status["kv_cache_evictions"] > 0 and status["kv_cache_evicted_bytes"] > 0


def test_metrics_show_the_cache_and_the_flag_reads_sizes(model_dir: Path) -> None:
    engine = Engine(model_dir, max_batch=2, kv_cache_bytes=_byte_size("4M")).start()
    try:
        with RunningServer(engine) as running:
            body = {"prompt": list(range(5, 60)), "max_tokens": 3}
            for _ in range(2):
                httpx.post(running.url + "/v1/completions", json=body).raise_for_status()
            text = httpx.get(running.url + "/metrics").text
            health = httpx.get(running.url + "/health").json()
    finally:
        engine.close()
    metrics = dict(line.split(" ") for line in text.strip().splitlines())
    assert int(metrics["lightning_engine_kv_cache_capacity_bytes"]) == 4 << 20
    assert int(metrics["lightning_engine_kv_cache_hit_tokens"]) >= 54
    assert 0 < float(metrics["lightning_engine_kv_cache_hit_rate"]) < 1
    assert int(metrics["lightning_engine_kv_cache_bytes"]) == health["kv_cache_bytes"] > 0
    assert "lightning_engine_kv_cache_evictions" in metrics
    assert _byte_size("512M") == 512 << 20 and _byte_size("1.5GiB") == 3 << 29
    assert _byte_size("0") == 0 and _byte_size("2048") == 2048
    for bad in ("lots", "-1G"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"0 turns|byte size"):
            _byte_size(bad)


@pytest.mark.slow
def test_smollm2_cached_turns_and_group_match_the_uncached_engine() -> None:
    model_dir = smollm2_dir()
    with (
        Engine(model_dir, max_batch=4, kv_cache_bytes=0) as off,
        Engine(model_dir, max_batch=4, prefill_chunk=128) as on,
    ):
        messages = [{"role": "user", "content": "List three facts about the Moon. " * 8}]
        prompt = on.chat_prompt_ids(messages)
        want = group(off, prompt, 4, 12)
        got = group(on, prompt, 4, 12)
        for w, g in zip(want, got, strict=True):
            assert g.token_ids == w.token_ids and max_gap(g.logprobs, w.logprobs) <= 1e-4
        messages += [
            {"role": "assistant", "content": got[0].text},
            {"role": "user", "content": "And two about Mars?"},
        ]
        turn2 = on.chat_prompt_ids(messages)
        before = on.status()["prefill_tokens"]
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=1)
        a, b = on.generate(turn2, params), off.generate(turn2, params)
        computed = on.status()["prefill_tokens"] - before
    assert a.token_ids == b.token_ids and max_gap(a.logprobs, b.logprobs) <= 1e-4
    assert computed < len(turn2) - len(prompt) + 12  # only the new turn's tokens
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = reference(torch.tensor([turn2 + a.token_ids])).logits[0]
    lp = torch.log_softmax(logits.float(), dim=-1)
    want_lp = [float(lp[len(turn2) - 1 + i, t]) for i, t in enumerate(a.token_ids)]
    assert max_gap(want_lp, a.logprobs) < 1e-4


def test_the_run_config_reaches_the_embedded_engine(model_dir: Path, tmp_path: Path) -> None:
    """`[engine] kv_cache_bytes` / `prefill_chunk` become `lightning serve` flags."""
    from lightning.config import EngineSection
    from lightning.run.loop import EmbeddedEngine

    section = EngineSection(kv_cache_bytes=3 << 20, prefill_chunk=32)
    engine = EmbeddedEngine(
        model_dir,
        host="127.0.0.1",
        port=0,
        max_batch=2,
        dtype="float32",
        threads=1,
        log_path=tmp_path / "engine.log",
        kv_cache_bytes=section.kv_cache_bytes,
        prefill_chunk=section.prefill_chunk,
    )
    try:
        health = engine.wait_ready(120)
    finally:
        engine.stop()
    assert health["kv_cache_capacity_bytes"] == 3 << 20 and health["prefill_chunk"] == 32
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        EngineSection(kv_cache_bytes=-1)


def test_serve_refuses_a_bad_cache_size(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning.engine.server import serve

    with pytest.raises(SystemExit) as exit_:
        serve([str(tiny_model_dir()), "--kv-cache-bytes", "lots"])
    assert exit_.value.code == 2
    assert "'lots' is not a byte size" in capsys.readouterr().err


def test_requests_racing_a_reload_use_only_their_own_versions_prefixes(
    model_dir: Path, tmp_path: Path
) -> None:
    """Requests sharing a cached prefix, submitted from threads while a reload lands:
    each one's logprobs are those of the weight version it reports, so none used a
    prefix of the other version."""
    new = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in new.parameters():
            p.mul_(1.3)
    new.save_pretrained(tmp_path / "v1")
    prompt = list(range(30, 330))
    results: dict[int, Any] = {}
    with Engine(model_dir, max_batch=3, prefill_chunk=64) as engine:
        engine.generate(prompt, SamplingParams(max_tokens=4, seed=0))  # cached at v0

        def one(i: int) -> None:
            params = SamplingParams(max_tokens=120, seed=i, ignore_eos=True)
            results[i] = engine.generate([*prompt, 400 + i], params)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads[:3]:  # admitted before the reload: they finish on v0
            t.start()
        while engine.status()["running"] + engine.status()["prefilling"] < 3 and len(results) < 3:
            time.sleep(0.001)
        for t in threads[3:6]:  # racing the reload
            t.start()
        assert engine.load_weights(tmp_path / "v1", 1) == 1
        for t in threads[6:]:  # after it: v1, from a cache that held v0's prompt
            t.start()
        for t in threads:
            t.join()
    assert [results[i].weight_version for i in (0, 1, 2, 6, 7)] == [0, 0, 0, 1, 1]
    for r in results.values():
        weights = model_dir if r.weight_version == 0 else tmp_path / "v1"
        want = reference_logprobs(weights, r.prompt_ids, r.token_ids)
        assert max_gap(want, r.logprobs) < 1e-4, r.weight_version
