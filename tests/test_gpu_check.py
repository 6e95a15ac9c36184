"""benches/gpu_check.py's CPU path (``--device cpu --quick``): every check runs
and passes on the tiny model, and a wrong number makes it fail."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benches" / "gpu_check.py"


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
    ):
        assert f"ok   {name}" in out, out


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
