"""lightning/__init__.py: the public names, and a front door to training that
costs nothing until it is used (``import lightning`` never imports torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import lightning


def run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_import_lightning_does_not_import_torch() -> None:
    code = "import sys, lightning; lightning.Store; print('torch' in sys.modules)"
    assert run(code) == "False"


def test_training_names_load_on_first_use() -> None:
    code = (
        "import sys; from lightning import RunConfig, TrainerConfig; "
        "print('torch' in sys.modules); "
        "from lightning import Trainer, train; print('torch' in sys.modules)"
    )
    # The config is torch-free; the trainer brings torch with it.
    assert run(code).split() == ["False", "True"]


def test_front_door_names_are_the_modules_own() -> None:
    from lightning import RunConfig, Trainer, TrainerConfig, train
    from lightning.config import RunConfig as deep_config
    from lightning.config import TrainerConfig as deep_trainer_config
    from lightning.rl.trainer import Trainer as deep_trainer
    from lightning.run.loop import train as deep_train

    assert (RunConfig, TrainerConfig, Trainer, train) == (
        deep_config,
        deep_trainer_config,
        deep_trainer,
        deep_train,
    )
    assert {"RunConfig", "Trainer", "TrainerConfig", "train"} <= set(dir(lightning))


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Trainr'"):
        lightning.Trainr  # noqa: B018
    with pytest.raises(ImportError):
        exec("from lightning import Trainr", {})


def test_every_public_name_resolves() -> None:
    for name in lightning.__all__:
        assert getattr(lightning, name) is not None
