"""The lean fused forward (lightning.engine.fused) against transformers' own forward.

Checked on a random Llama with grouped-query attention (2 query heads per
key/value head, as SmolLM2 has 3) and a non-default RoPE base, directly on
logits: a chunked prefill over a cached prefix, a batched decode step over
right-aligned rows of different lengths, and prefill of several prompts in
one forward. Then the engine end to end: fused vs ``fuse=False`` (transformers'
modules) on the tiny model, tokens equal and logprobs within 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning.engine import Engine, SamplingParams, fused, kv, linear
from lightning.model_cache import tiny_model_dir

pytestmark = pytest.mark.skipif(
    not linear.available(torch.device("cpu"), torch.float32),
    reason="the fused forward needs PyTorch's oneDNN linear ops",
)


@pytest.fixture(scope="module")
def gqa_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rope_theta=5000.0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger than the init's 0.02 std, so errors would show
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def reference_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # [L, V]


def empty_cache(model: LlamaForCausalLM, rows: int, capacity: int) -> kv.SlabCache:
    cfg = model.config
    shape = (rows, cfg.num_key_value_heads, capacity, cfg.head_dim)
    return kv.SlabCache(
        [kv.SlabLayer(torch.zeros(shape), torch.zeros(shape), 0) for _ in model.model.layers]
    )


def prefill(runner: fused.FusedLlama, cache: kv.SlabCache, ids: list[int], start: int):
    """Run ids[start:] over a one-row cache already holding ids[:start]."""
    return runner.prefill([(ids[start:], start, cache)])


def test_chunked_prefill_matches_transformers(gqa_model: LlamaForCausalLM) -> None:
    runner = fused.FusedLlama(gqa_model, batch_hint=4)
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    want = reference_logits(gqa_model, ids)
    cache = empty_cache(gqa_model, 1, 64)
    with torch.inference_mode():
        first = prefill(runner, cache, ids[:25], 0)  # a first chunk...
        second = prefill(runner, cache, ids, 25)  # ...then the rest over its keys/values
    assert (first[0] - want[24]).abs().max() < 1e-4
    assert (second[0] - want[39]).abs().max() < 1e-4
    assert cache.length == 40


# 1 and 2 rows multiply through F.linear, 3 through oneDNN (fused.SMALL_ROWS).
@pytest.mark.parametrize("lengths", [(7,), (7, 19), (7, 19, 12)])
def test_batched_decode_over_padded_rows_matches_transformers(
    gqa_model: LlamaForCausalLM, lengths: tuple[int, ...]
) -> None:
    runner = fused.FusedLlama(gqa_model, batch_hint=4)
    gen = torch.Generator().manual_seed(2)
    rows = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in lengths]
    with torch.inference_mode():
        # Each row prefilled alone, then right-aligned into one slab (as the engine does).
        singles = []
        for ids in rows:
            cache = empty_cache(gqa_model, 1, len(ids) + 4)
            prefill(runner, cache, ids[:-1], 0)
            singles.append(kv.row_from_cache(cache, 0, len(ids) - 1))
        lens = [len(ids) - 1 for ids in rows]
        slab = kv.build_slab(singles, lens, headroom=4)
        length = slab.length
        mask = torch.arange(length + 1)[None, :] >= (length - torch.tensor(lens))[:, None]
        logits = runner.decode(
            torch.tensor([[ids[-1]] for ids in rows]),
            torch.tensor(lens).view(len(rows), 1),
            mask.view(len(rows), 1, 1, length + 1),
            slab,
        )
    for i, ids in enumerate(rows):
        assert (logits[i] - reference_logits(gqa_model, ids)[-1]).abs().max() < 1e-4


def test_prompts_prefilled_together_match_each_alone(gqa_model: LlamaForCausalLM) -> None:
    """Three prompts' chunks in one forward: one continues a cached prefix."""
    runner = fused.FusedLlama(gqa_model, batch_hint=4)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (9, 30, 1)]
    caches = [empty_cache(gqa_model, 1, len(ids)) for ids in prompts]
    with torch.inference_mode():
        prefill(runner, caches[1], prompts[1][:12], 0)  # the second has 12 tokens cached
        logits = runner.prefill(
            [
                (prompts[0], 0, caches[0]),
                (prompts[1][12:], 12, caches[1]),
                (prompts[2], 0, caches[2]),
            ]
        )
    assert logits.shape == (3, 97)
    for i, ids in enumerate(prompts):
        assert (logits[i] - reference_logits(gqa_model, ids)[-1]).abs().max() < 1e-4
        assert caches[i].length == len(ids)


def test_refresh_follows_weights_changed_in_place(gqa_model: LlamaForCausalLM) -> None:
    model = LlamaForCausalLM(gqa_model.config).eval()
    model.load_state_dict(gqa_model.state_dict())
    runner = fused.FusedLlama(model, batch_hint=2)
    ids = list(range(10, 30))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9)
    runner.refresh()
    with torch.inference_mode():
        got = prefill(runner, empty_cache(model, 1, 32), ids, 0)
    assert (got[0] - reference_logits(model, ids)[-1]).abs().max() < 1e-4


def test_only_plain_llama_is_fused(gqa_model: LlamaForCausalLM) -> None:
    cpu = torch.device("cpu")
    assert fused.supports(gqa_model, cpu, torch.float32)
    assert not fused.supports(gqa_model, cpu, torch.bfloat16)
    biased = LlamaForCausalLM(LlamaConfig(**{**gqa_model.config.to_dict(), "attention_bias": True}))
    assert not fused.supports(biased, cpu, torch.float32)


def test_fused_engine_equals_transformers_engine() -> None:
    model_dir: Path = tiny_model_dir()
    with Engine(model_dir, max_batch=8) as a, Engine(model_dir, max_batch=8, fuse=False) as b:
        assert a.status()["forward"] == "fused" and b.status()["forward"] == "prepacked"
        prompts = [a.chat_prompt_ids([{"role": "user", "content": "y" * i}]) for i in range(1, 7)]
        for params in (
            SamplingParams(max_tokens=16, temperature=0.0),
            SamplingParams(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True),
        ):
            got, want = a.generate_many(prompts, params), b.generate_many(prompts, params)
            for x, y in zip(got, want, strict=True):
                assert x.token_ids == y.token_ids
                gap = max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True))
                assert gap < 1e-4
