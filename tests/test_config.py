"""`lightning train` configs: the bundled ones validate, bad ones fail early with
a message that says what to fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from lightning.config import RunConfig

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("name", ["demo.toml", "gpu_qwen.toml"])
def test_bundled_configs_validate(name: str) -> None:
    config = RunConfig.load(EXAMPLES / name)
    # Relative paths resolve against the config file, not the working directory.
    assert Path(config.tasks.train).is_absolute()
    assert config.harness.cwd == str(EXAMPLES.resolve())
    trainer = config.trainer_config("unused")
    assert trainer.batching == "tree" and trainer.model == "unused"
    assert trainer.estimator == config.algorithm.estimator and trainer.seed == config.seed
    # A saved run config (RUN_DIR/config.json) loads again as the same config.
    assert RunConfig.model_validate_json(config.model_dump_json()) == config


def test_loading_a_config_does_not_import_torch() -> None:
    code = (
        "import sys; from lightning.config import RunConfig; "
        f"RunConfig.load({str(EXAMPLES / 'demo.toml')!r}); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('[trainer]\nbatchng = "tree"\n', r"trainer\.batchng\n  Extra inputs are not permitted"),
        ('[trainer]\nbatching = "trees"\n', r"trainer\.batching\n  Input should be 'padded'"),
        ("[trainer]\nclip_low = -1\n", r"trainer\.clip_low\n  Input should be greater"),
        ('[trainer]\nlr_schedule = "cosine"\n', "lr_schedule 'cosine' needs total_steps"),
        ('[trainer]\nestimator = "rloo"\n', r"set it as \[algorithm\] estimator"),
        ("[trainer]\nseed = 3\n", "set it as the top-level seed"),
    ],
)
def test_trainer_typos_fail_at_load_naming_the_field(
    tmp_path: Path, extra: str, message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        RunConfig.load(write(tmp_path, BASE + extra))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


BASE = """
[model]
builtin = "tiny"
[harness]
command = ["true"]
[tasks]
train = "tasks.jsonl"
"""


def test_overrides_and_defaults(tmp_path: Path) -> None:
    config = RunConfig.load(write(tmp_path, BASE), {"steps": 3, "algorithm.group_size": 4})
    assert config.steps == 3 and config.algorithm.group_size == 4
    assert config.tasks.train == str(tmp_path / "tasks.jsonl")
    assert config.engine.kind == "embedded" and config.reward.source == "stdout"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('[engine]\nkind = "external"\n', "needs `urls`"),
        ('[reward]\nsource = "function"\n', "needs `function"),
        ("unknown_key = 1\n", "Extra inputs are not permitted"),
        ('[algorithm]\nestimator = "ppo"\n', "grpo"),
        ("[algorithm]\nmax_staleness = -1\n", "greater than or equal to 0"),
        ('[algorithm]\non_stale = "keep"\n', "'drop' or 'regenerate'"),
        ('[engine]\nweight_sync = "vllm-lora"\n', "vllm-nccl"),
        ('[tracking]\nbackends = ["tensorboard"]\n', "'wandb' or 'mlflow'"),
    ],
)
def test_bad_configs_name_the_problem(tmp_path: Path, extra: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RunConfig.load(write(tmp_path, extra + BASE))


def test_harness_needs_exactly_one_kind(tmp_path: Path) -> None:
    text = BASE.replace('command = ["true"]', 'command = ["true"]\ncallable = "m:f"')
    with pytest.raises(ValidationError, match="exactly one of `command` or `callable`"):
        RunConfig.load(write(tmp_path, text))


def test_a_callable_harness_file_is_relative_to_the_config(tmp_path: Path) -> None:
    text = BASE.replace('command = ["true"]', 'callable = "agent.py:run"')
    config = RunConfig.load(write(tmp_path, text))
    assert config.harness.callable == f"{tmp_path.resolve() / 'agent.py'}:run"
    dotted = RunConfig.load(write(tmp_path, BASE.replace('command = ["true"]', 'callable = "m:f"')))
    assert dotted.harness.callable == "m:f"  # a module name is imported as it is


def test_ray_backend_runs_a_command(tmp_path: Path) -> None:
    ray = BASE.replace(
        'command = ["true"]', 'command = ["true"]\nbackend = "ray"\nray_resources = { sandbox = 1 }'
    )
    config = RunConfig.load(write(tmp_path, ray))
    assert config.harness.backend == "ray" and config.harness.ray_resources == {"sandbox": 1.0}
    callable_ = BASE.replace('command = ["true"]', 'callable = "m:f"\nbackend = "ray"')
    with pytest.raises(ValidationError, match="runs a harness `command` on the cluster"):
        RunConfig.load(write(tmp_path, callable_))


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        RunConfig.load(tmp_path / "nope.toml")
    with pytest.raises(ValueError, match="not valid TOML"):
        RunConfig.load(write(tmp_path, "steps = = 3"))
