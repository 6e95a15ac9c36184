from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from lightning.model_cache import smollm2_dir, tiny_model_dir
from lightning.rl.trainer import METRIC_KEYS, Trainer, TrainerConfig
from samples import grpo_batch, make_sample


def tiny_trainer(**kw: Any) -> Trainer:
    return Trainer(TrainerConfig(model=str(tiny_model_dir()), **{"lr": 1e-3, **kw}))


def test_config_from_toml(tmp_path: Path) -> None:
    f = tmp_path / "t.toml"
    f.write_text(
        '[trainer]\nmodel = "m"\naggregation = "rollout-mean"\nbatching = "tree"\n'
        "micro_batch_tokens = 512\n[trainer.lora]\nr = 4\n"
    )
    cfg = TrainerConfig.from_toml(f)
    assert cfg.aggregation == "rollout-mean" and cfg.batching == "tree"
    assert cfg.lora is not None and cfg.lora.r == 4
    with pytest.raises(ValidationError):
        TrainerConfig(model="m", aggregation="sum")
    with pytest.raises(ValidationError, match="max_len"):
        TrainerConfig(model="m", aggregation="seq-mean-token-sum-norm")
    with pytest.raises(ValidationError):
        TrainerConfig(model="m", estimator="ppo")


def test_step_metrics_and_logs(tmp_path: Path) -> None:
    samples, rewards, groups = grpo_batch()
    tr = tiny_trainer(log_dir=str(tmp_path / "logs"))
    m = tr.step(samples, rewards, groups)
    assert set(METRIC_KEYS) <= set(m)
    assert m["step"] == 1 and m["samples"] == len(samples)
    assert m["tokens"] == sum(len(s.tokens) for s in samples)
    for k in ("loss", "entropy", "grad_norm", "tokens_per_s", "gap_abs_logprob", "gap_kl"):
        assert math.isfinite(m[k]), k
    assert m["clip_frac"] == 0.0 and m["approx_kl"] == pytest.approx(0.0, abs=1e-7)
    assert m["gap_kl"] >= 0
    tr.close()
    lines = (tmp_path / "logs" / "trainer_metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["step"] == 1
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "logs").iterdir())


def test_trainer_takes_the_typed_config(tmp_path: Path) -> None:
    """The trainer receives the validated model, not a dict to validate again."""
    with pytest.raises(TypeError, match="Trainer takes a TrainerConfig, not dict"):
        Trainer({"model": str(tiny_model_dir())})  # type: ignore[arg-type]
    cfg = TrainerConfig(model=str(tiny_model_dir()), lr=1e-3)
    assert Trainer(cfg).config is cfg
    logged = Trainer(cfg, log_dir=str(tmp_path))
    logged.close()
    assert logged.config == cfg.with_values(log_dir=str(tmp_path)) and cfg.log_dir is None


def test_missing_reward() -> None:
    samples, rewards, groups = grpo_batch(n_groups=1, group_size=2)
    rewards.pop("g0r0")
    tr = tiny_trainer()
    with pytest.raises(ValueError, match="no reward"):
        tr.step(samples, rewards, groups)
    m = Trainer(TrainerConfig(model=str(tiny_model_dir()), missing_reward=0.0)).step(
        samples, rewards, groups
    )
    assert m["samples"] == 2


def test_filter_zero_advantage_groups() -> None:
    samples, rewards, groups = grpo_batch(n_groups=2, group_size=2)
    rewards.update({"g0r0": 1.0, "g0r1": 1.0, "g1r0": 0.0, "g1r1": 1.0})
    m = tiny_trainer(filter_zero_adv_groups=True).step(samples, rewards, groups)
    assert m["zero_adv_group_frac"] == 0.5 and m["samples"] == 2


def test_recompute_old_logprobs_makes_later_epochs_off_policy() -> None:
    samples, rewards, groups = grpo_batch()
    m = tiny_trainer(ppo_epochs=3, lr=3e-2, clip_low=0.01, clip_high=0.01).step(
        samples, rewards, groups
    )
    assert m["approx_kl"] > 0 and m["clip_frac"] > 0


def test_kl_and_entropy_terms() -> None:
    samples, rewards, groups = grpo_batch(n_groups=1)
    m = tiny_trainer(kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0).step(samples, rewards, groups)
    assert math.isfinite(m["loss"])


def test_export_and_checkpoint_roundtrip(tmp_path: Path) -> None:
    samples, rewards, groups = grpo_batch()
    tr = tiny_trainer()
    tr.step(samples, rewards, groups)
    out = tr.export_weights(tmp_path / "export")
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[1, 200, 300, 400]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, tr.model(ids).logits)
    tr.export_weights(tmp_path / "export")  # replacing an existing export works

    tr.save_checkpoint(tmp_path / "ckpt")
    tr2 = tiny_trainer()
    tr2.load_checkpoint(tmp_path / "ckpt")
    assert tr2.step_count == 1
    for a, b in zip(tr.model.parameters(), tr2.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    # Both continue identically (optimizer state restored too).
    m1, m2 = tr.step(samples, rewards, groups), tr2.step(samples, rewards, groups)
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)
    for a, b in zip(tr.model.parameters(), tr2.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_lora_step_and_merged_export(tmp_path: Path) -> None:
    samples, rewards, groups = grpo_batch(n_groups=1)
    tr = tiny_trainer(lora={"r": 4, "alpha": 8}, gradient_checkpointing=True, kl_coef=0.05)
    m = tr.step(samples, rewards, groups)
    assert math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
    out = tr.export_weights(tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[1, 200, 300]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, tr.model(ids).logits, atol=1e-5, rtol=1e-4)
    tr.save_checkpoint(tmp_path / "ckpt")
    tr2 = tiny_trainer(lora={"r": 4, "alpha": 8})
    tr2.load_checkpoint(tmp_path / "ckpt")
    with torch.no_grad():
        torch.testing.assert_close(tr2.model(ids).logits, tr.model(ids).logits)


def _completion_logprob(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> float:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    return sum(float(lp[len(prompt) + i - 1, t]) for i, t in enumerate(completion))


@pytest.mark.slow
def test_smollm2_step_moves_towards_positive_advantage() -> None:
    tr = Trainer(TrainerConfig(model=str(smollm2_dir()), lr=2e-5, batching="tree"))
    tok = tr.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt = tok.encode(text, add_special_tokens=False)
    good = tok.encode("The capital of France is Paris.<|im_end|>", add_special_tokens=False)
    bad = tok.encode("I like turtles very much.<|im_end|>", add_special_tokens=False)
    samples = [
        make_sample("good", "q", [(prompt, -1), (good, 0)]),
        make_sample("bad", "q", [(prompt, -1), (bad, 0)]),
    ]
    before = [_completion_logprob(tr.model, prompt, c) for c in (good, bad)]
    m = tr.step(samples, {"good": 1.0, "bad": 0.0}, {"good": "q", "bad": "q"})
    after = [_completion_logprob(tr.model, prompt, c) for c in (good, bad)]
    assert m["forward_tokens"] < m["tokens"]  # the shared prompt ran once
    assert after[0] > before[0]
    assert after[1] < before[1]
    assert np.isfinite(m["grad_norm"])


def test_old_precision_keys() -> None:
    model = str(tiny_model_dir())
    # autocast was the compute dtype's old name; old configs still load.
    assert TrainerConfig(model=model, autocast="none").compute_dtype == "float32"
    assert TrainerConfig(model=model, autocast="bfloat16").compute_dtype == "bfloat16"
    assert TrainerConfig(model=model, param_dtype="float32").compute_dtype == "auto"
    # bf16 storage without a master copy is refused, naming the fix.
    with pytest.raises(ValidationError, match="compute_dtype = 'bfloat16'"):
        TrainerConfig(model=model, param_dtype="bfloat16")
    with pytest.raises(ValidationError, match="float16 needs loss scaling"):
        TrainerConfig(model=model, autocast="float16")
    with pytest.raises(ValidationError, match="disagree"):
        TrainerConfig(model=model, autocast="none", compute_dtype="bfloat16")


def test_bf16_compute_steps_like_float32() -> None:
    from precision_case import bf16_storage_changed, moved, one_step_delta

    kw = {"lr": 1e-6, "max_grad_norm": None, "max_len": 64}
    ref_tr = tiny_trainer(compute_dtype="float32", **kw)
    ref = one_step_delta(ref_tr)
    tr = tiny_trainer(compute_dtype="bfloat16", **kw)
    assert tr._amp_dtype == torch.bfloat16  # the math really ran in bf16
    m = moved(one_step_delta(tr), ref)
    # Measured: changed 1.0000 vs 1.0000, cosine 0.9996. The plain reference of
    # the old bf16 storage changes 0.019 of the weights from the same gradients.
    assert m["ref_changed"] > 0.9
    assert abs(m["changed"] - m["ref_changed"]) < 0.01, m
    assert m["cosine"] > 0.99, m
    assert bf16_storage_changed(ref_tr) < 0.2


def test_bf16_compute_short_run_learns() -> None:
    from precision_case import objective
    from split_case import batch

    samples, rewards, groups = batch()
    gains = {}
    for dtype in ("float32", "bfloat16"):
        tr = tiny_trainer(compute_dtype=dtype, lr=1e-3, max_len=64)
        before = objective(tr.model)
        for _ in range(3):
            tr.step(samples, rewards, groups)
        gains[dtype] = objective(tr.model) - before
    # Measured: the objective rose from -2.98 to 12.65 in both (gains within 3e-4).
    assert gains["bfloat16"] > 5, gains
    assert 0.9 < gains["bfloat16"] / gains["float32"] < 1.1, gains


def test_export_draws_no_progress_bar(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A run exports weights after every step: transformers' "Writing model shards"
    bar would print once per step. The export is silent, and the caller's setting
    of transformers' bars is left as it was."""
    from transformers.utils import logging as hf_logging

    tr = tiny_trainer()
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # as on a terminal, whatever this machine's env says
    try:
        capfd.readouterr()
        tr.export_weights(tmp_path / "export")
        tr.save_checkpoint(tmp_path / "ckpt")
        out, err = capfd.readouterr()
        assert "Writing model shards" not in out + err, err
        assert hf_logging.is_progress_bar_enabled()
        # The bar this guards against is transformers' own: it prints when enabled.
        tr.model.save_pretrained(tmp_path / "plain", safe_serialization=True)
        assert "Writing model shards" in "".join(capfd.readouterr())
    finally:
        if not was:
            hf_logging.disable_progress_bar()
