"""One realistic check on SmolLM2-135M-Instruct: batched sampling with exact logprobs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning.engine import Engine, SamplingParams
from lightning.model_cache import smollm2_dir

QUESTIONS = ("What is 2 + 3?", "Name a color.", "Say hello.", "What is the capital of France?")


@pytest.mark.slow
def test_smollm2_batched_logprobs_match_forward() -> None:
    model_dir = smollm2_dir()
    with Engine(model_dir, max_batch=8) as engine:
        prompts = [engine.chat_prompt_ids([{"role": "user", "content": q}]) for q in QUESTIONS]
        sampled = engine.generate_many(prompts, SamplingParams(max_tokens=24, seed=0))
        greedy = SamplingParams(max_tokens=16, temperature=0.0)
        batched = engine.generate_many(prompts[:2], greedy)
        alone = [engine.generate(p, greedy) for p in prompts[:2]]
        paris = engine.generate(prompts[3], greedy)
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    assert "Paris" in paris.text  # a real model, answering
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for prompt, result in zip(prompts, sampled, strict=True):
        assert result.token_ids and result.finish_reason in ("stop", "length")
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + result.token_ids])).logits[0]  # [L, V]
        lp = torch.log_softmax(logits.float(), dim=-1)
        want = [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(result.token_ids)]
        assert max(abs(a - b) for a, b in zip(want, result.logprobs, strict=True)) < 1e-4
