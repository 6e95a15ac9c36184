"""`lightning train` configs: the bundled ones validate, bad ones fail early with
a message that says what to fix."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel, Field, ValidationError

from lightning.config import RunConfig, TrainerConfig, TrainerSection, trainer_defaults
from lightning.gateway.server import GatewayConfig
from lightning.online.train import OnlineConfig

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("name", ["demo.toml", "gpu_qwen.toml", "bfcl/gpu_qwen.toml"])
def test_bundled_configs_validate(name: str) -> None:
    config = RunConfig.load(EXAMPLES / name)
    # Relative paths resolve against the config file, not the working directory.
    assert Path(config.tasks.train).is_absolute()
    assert config.harness.cwd == str((EXAMPLES / name).parent.resolve())
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
        ("[trainer]\ncpu_offload = true\n", "offloads FSDP2's shards to host memory: set parallel"),
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


ONLINE = '[model]\nbuiltin = "tiny"\n[source]\ndb = "lightning.db"\n'


def errors(e: pytest.ExceptionInfo[ValidationError]) -> list[tuple[object, ...]]:
    return [(err["loc"], err["type"], err["msg"]) for err in e.value.errors()]


@pytest.mark.parametrize(
    "trainer",
    [
        'batchng = "tree"',
        'batching = "trees"',
        "clip_low = -1",
        'lr_schedule = "cosine"',
        "lora = { rank = 4 }",
    ],
)
def test_online_trainer_section_refuses_what_a_run_refuses(tmp_path: Path, trainer: str) -> None:
    """``[trainer]`` of online.toml is the same class as a run's: the same
    errors, at the same place, with the same words."""
    table = f"[trainer]\n{trainer}\n"
    with pytest.raises(ValidationError) as run:
        RunConfig.load(write(tmp_path, BASE + table))
    online_toml = tmp_path / "online.toml"
    online_toml.write_text(ONLINE + table)
    with pytest.raises(ValidationError) as online:
        OnlineConfig.load(online_toml)
    assert errors(online) == errors(run)
    assert [loc[0] for loc, *_ in errors(run)] == ["trainer"]


@pytest.mark.parametrize(
    ("key", "place"),
    [("estimator", "estimator"), ("temperature", "temperature"), ("seed", "seed")],
)
def test_online_trainer_section_refuses_what_the_pass_sets(
    tmp_path: Path, key: str, place: str
) -> None:
    online_toml = tmp_path / "online.toml"
    online_toml.write_text(ONLINE + f"[trainer]\n{key} = 1\n")
    with pytest.raises(ValidationError, match=f"set it as the top-level {place}, not in"):
        OnlineConfig.load(online_toml)


def test_trainer_defaults_are_declared_once(tmp_path: Path) -> None:
    """An empty ``[trainer]`` gives the trainer TrainerConfig's own defaults,
    plus only the derived ones of ``trainer_defaults`` for the kind of run."""
    # Each trainer option is declared on TrainerSection; TrainerConfig adds only
    # what a run sets from its other sections.
    assert set(TrainerConfig.__annotations__) == {"model", "estimator", "temperature", "seed"}
    assert set(TrainerConfig.model_fields) - set(TrainerSection.model_fields) == {
        "model", "estimator", "temperature", "seed"
    }  # fmt: skip
    assert RunConfig.load(write(tmp_path, BASE)).trainer_config("m") == TrainerConfig(model="m")
    assert trainer_defaults(off_policy=False) == {}
    asynchronous = RunConfig.load(write(tmp_path, BASE), {"algorithm.max_staleness": 1})
    assert trainer_defaults(off_policy=True) == {"tis_cap": 2.0, "tis_level": "token"}
    assert asynchronous.trainer_config("m") == TrainerConfig(model="m", tis_cap=2.0)
    online = OnlineConfig.model_validate({"model": {"builtin": "tiny"}, "source": {"db": "x"}})
    want = TrainerConfig(model="m", tis_cap=2.0, batching="tree")
    assert online.trainer_config("m") == want
    # What [trainer] sets wins over a derived default.
    asynchronous = RunConfig.load(
        write(tmp_path, BASE + "[trainer]\ntis_cap = 3.0\ntis_level = 'sequence'\n"),
        {"algorithm.max_staleness": 1},
    )
    assert (asynchronous.trainer.tis_cap, asynchronous.trainer_config("m").tis_cap) == (3.0, 3.0)
    assert asynchronous.trainer_config("m").tis_level == "sequence"
    online = online.model_copy(update={"trainer": TrainerSection(batching="packed")})
    assert online.trainer_config("m").batching == "packed"
    assert online.trainer_config("m").tis_cap == 2.0


def test_run_values_are_validated_like_the_rest(tmp_path: Path) -> None:
    """The run fills in model, estimator, temperature and seed with a validated
    copy: a value the trainer cannot take fails, as it would in a TOML file."""
    section = TrainerSection(lr=1e-3)
    with pytest.raises(ValidationError, match=r"temperature\n  Input should be greater than 0"):
        TrainerConfig.for_run(
            section, model="m", estimator="grpo", temperature=0.0, seed=0, defaults={}
        )
    with pytest.raises(ValidationError, match="estimator"):
        TrainerConfig(model="m").with_values(estimator="ppo")
    with pytest.raises(ValidationError, match="needs max_len"):
        TrainerConfig(model="m").with_values(aggregation="seq-mean-token-sum-norm")
    # Greedy rollouts (train_temperature = 0) are scored at T = 1.
    greedy = RunConfig.load(write(tmp_path, BASE), {"algorithm.train_temperature": 0.0})
    config = greedy.trainer_config("m")
    assert (config.temperature, config.model) == (1.0, "m")


def _config_docs() -> typing.Any:
    path = Path(__file__).resolve().parent.parent / ".ci" / "config_docs.py"
    spec = importlib.util.spec_from_file_location("config_docs_gen", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("model", [RunConfig, TrainerConfig, GatewayConfig])
def test_every_field_says_what_it_means(model: type[BaseModel]) -> None:
    """Each field's meaning is its `description`, declared once on the model: a
    field added without one fails here (the comment above a field is not enough)."""
    missing = _config_docs().missing_descriptions(model)
    assert not missing, f"fields of {model.__name__} without description=...: {missing}"


def test_the_reference_in_docs_config_md_is_the_schema() -> None:
    """docs/config.md's reference is what the schema generates (run
    `python .ci/config_docs.py` after adding or changing a field)."""
    gen = _config_docs()
    text = gen.DOC.read_text()
    assert gen.current(text) == gen.render(RunConfig), "run: python .ci/config_docs.py"
    # Every field of every section is in it, with its description.
    for table, _, section in gen.sections(RunConfig):
        for name, field in section.model_fields.items():
            row = f"| `{name}` | "
            assert any(
                line.startswith(row) and line.rstrip().endswith(gen.cell(field.description) + " |")
                for line in text.splitlines()
            ), f"{table or 'top level'}.{name} is not in docs/config.md"


def test_the_missing_description_check_can_fail() -> None:
    class Section(BaseModel):
        described: int = Field(0, description="a count")
        bare: int = 0

    class Root(BaseModel):
        section: Section = Field(default_factory=Section, description="a section")
        items: list[Section] = Field(default_factory=list)

    assert _config_docs().missing_descriptions(Root) == ["items", "section.bare", "items.bare"]
