"""benches/gpu_check.py's CPU path (``--device cpu --quick``): every check runs
and passes on the tiny model, and a wrong number makes it fail."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benches" / "gpu_check.py"


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    module.FAILURES.clear()
    return module


@pytest.mark.slow
def test_cpu_quick_path_passes(capsys: pytest.CaptureFixture[str]) -> None:
    gpu_check = _load()
    assert gpu_check.main(["--device", "cpu", "--quick"]) == 0
    out = capsys.readouterr().out
    for name in (
        "fp32 tree+fused",
        "bf16 autocast",
        "trainer step",
        "engine decode",
        "lightning train",
        "sync: IPC push opened by SGLang",
        "sync: embedded engine decodes with the pushed weights",
    ):
        assert f"ok   {name}" in out, out


def test_weight_sync_section_runs_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    """The weight-sync section's CPU path: a push opened in another process by
    SGLang 0.5.23's own deserializer and FlattenedTensorBucket (the cached engine
    environment), bitwise; the embedded engine decoding with pushed weights."""
    gpu_check = _load()
    assert gpu_check.main(["--device", "cpu", "--quick", "--only", "sync"]) == 0
    out = capsys.readouterr().out
    assert "ok   sync: IPC push opened by SGLang (CPU shared memory)" in out, out
    assert "bitwise: True" in out and "receiver on ['cpu']" in out
    assert "ok   sync: embedded engine decodes with the pushed weights: version 7" in out, out


def test_a_byte_changed_in_the_push_fails_loudly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The receiver's hashes are compared with the sender's: one tensor whose bytes
    differ (here the sender's record of one) fails the check and exits 1."""
    gpu_check = _load()
    real = gpu_check._sha
    seen: list[int] = []

    def off_for_one(t: torch.Tensor) -> str:
        seen.append(1)
        return real(t) if len(seen) != 3 else "0" * 64

    monkeypatch.setattr(gpu_check, "_sha", off_for_one)
    monkeypatch.setattr(gpu_check, "sync_embedded", lambda *a: None)
    assert gpu_check.main(["--device", "cpu", "--quick", "--only", "sync"]) == 1
    out = capsys.readouterr().out
    assert "FAIL sync: IPC push opened by SGLang (CPU shared memory)" in out, out
    assert "bitwise: False" in out


def test_wrong_gradients_fail_loudly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu_check = _load()
    real = gpu_check.logprobs_and_grads

    def off_by_a_bit(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        lp, g = real(*args)
        if args[2] == "tree":  # the layouts under test, not the reference
            g = g * 1.01
        return lp, g

    monkeypatch.setattr(gpu_check, "logprobs_and_grads", off_by_a_bit)
    assert gpu_check.main(["--device", "cpu", "--quick", "--only", "gradients"]) == 1
    assert "FAIL fp32 tree+fused vs padded+model head" in capsys.readouterr().out
