"""`lightning sft`: the supervised stage, on the trainer the RL loop uses.

Three sources (``[sft] source``, :class:`lightning.config.SftSection`):

- ``dataset``: OpenAI-format conversations from JSONL (:func:`lightning.rl.sft.load_conversations`);
- ``store``: rollouts or online sessions of a gateway store kept by reward
  (rejection sampling, :func:`lightning.rl.sft.select_rollouts`), trained on the
  exact tokens recorded;
- ``expert_iteration``: ``iterations`` rounds of sample (the run's ``[tasks]``
  through its harness, ``[algorithm] group_size`` rollouts each) → keep the best
  (``min_reward``, ``top_fraction``) → fine-tune → push the weights to the engine.

:func:`fit` is the loop all three share: shuffled batches of ``batch_size``
samples, one :meth:`~lightning.rl.trainer.Trainer.supervised_step` each, a
validation pass every ``eval_every`` steps (and at the end), early stopping on
``metric`` with ``patience`` (the best weights are restored), one metrics row per
step in ``metrics.jsonl`` (``phase = "sft"``; ``lightning view`` charts the
``sft_*`` keys). ``lightning train`` runs the same stage first when its config
has ``[sft]`` (its rows land in ``RUN_DIR/sft/metrics.jsonl``).

Choices where the issue is silent:

1. One optimizer step per batch, whatever the batch's token count (the loss is
   a per-token mean over the batch), as TRL's SFTTrainer does per batch.
2. ``epochs`` may be fractional: training stops after ``ceil(epochs × batches)``
   steps, so an SFT stage can stop "while the model still explores".
3. The learning-rate schedule is ``[trainer]``'s; with ``lr_schedule`` other than
   constant and no ``total_steps``, the config refuses it as for RL.
"""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lightning.config import SftConfig, SftSection
from lightning.rl.sft import (
    SftDataError,
    SftSample,
    load_conversations,
    select_rollouts,
    select_sessions,
    split_validation,
    store_samples,
)

log = logging.getLogger("lightning.run.sft")

__all__ = ["expert_iteration", "fit", "prepare_data", "run_standalone"]


def _max_len(section: SftSection, model_dir: Path) -> int | None:
    if section.max_len is not None:
        return section.max_len
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    n = cfg.get("max_position_embeddings")
    return int(n) if n else None


def _tokenizer(model_dir: Path, chat_template: str | None) -> Any:
    from lightning import Tokenizer

    template = Path(chat_template).read_text() if chat_template else None
    return Tokenizer.from_dir(str(model_dir), chat_template=template)


def prepare_data(
    section: SftSection,
    model_dir: Path,
    *,
    seed: int,
    db: str | Path | None = None,
    chat_template: str | None = None,
) -> tuple[list[SftSample], list[SftSample], dict[str, Any]]:
    """(train, validation, what was selected) for a dataset or store source."""
    max_len = _max_len(section, model_dir)
    info: dict[str, Any] = {"source": section.source, "max_len": max_len}
    if section.source == "dataset":
        assert section.dataset is not None
        tok = _tokenizer(model_dir, section.chat_template or chat_template)
        samples = load_conversations(section.dataset, tok, max_len=max_len)
        if section.validation is not None:
            val = load_conversations(section.validation, tok, max_len=max_len)
            train = samples
        else:
            train, val = split_validation(samples, section.val_fraction, seed)
        info["dataset"] = section.dataset
    elif section.source == "store":
        path = section.db or db
        if path is None:
            raise ValueError("[sft] source = 'store' needs `db` (a gateway store file)")
        if section.select == "sessions":
            sel = select_sessions(
                path,
                min_reward=section.min_reward,
                top_fraction=section.top_fraction,
                rated_only=section.rated_only,
            )
        else:
            sel = select_rollouts(
                path, min_reward=section.min_reward, top_fraction=section.top_fraction
            )
        samples = store_samples(path, sel, max_len=max_len)
        if not samples:
            raise SftDataError(
                f"{path}: the filter kept no {section.select} with trainable calls "
                f"({sel.summary()}); lower min_reward / raise top_fraction"
            )
        train, val = split_validation(samples, section.val_fraction, seed)
        info.update(db=str(path), selection=sel.summary(), kept_ids=sel.ids)
    else:
        raise ValueError("expert_iteration data comes from sampling: use expert_iteration()")
    info.update(
        train_samples=len(train),
        val_samples=len(val),
        train_tokens=sum(s.trained_tokens for s in train),
    )
    return train, val, info


def _callback(target: str | None) -> Callable[..., dict[str, float]] | None:
    if target is None:
        return None
    from lightning.run.runner import load_callable

    return load_callable(target)  # type: ignore[no-any-return]


def _better(a: float, b: float | None, mode: str) -> bool:
    if b is None or not math.isfinite(b):
        return math.isfinite(a)
    return a < b if mode == "min" else a > b


def validate(
    trainer: Any, val: Sequence[SftSample], section: SftSection, step: int
) -> dict[str, Any]:
    """Validation metrics: ``val_loss`` (the weighted NLL on ``val``),
    ``val_entropy``, and whatever ``callback`` returns."""
    out: dict[str, Any] = {}
    if val:
        m = trainer.supervised_step(list(val), train=False)
        out.update(
            {
                "val_loss": m["sft_val_loss"],
                "val_entropy": m["sft_val_entropy"],
                "val_tokens": m["sft_val_tokens"],
            }
        )
    cb = _callback(section.callback)
    if cb is not None:
        out.update({str(k): v for k, v in cb(trainer, step).items()})
    return out


def fit(
    trainer: Any,
    train: Sequence[SftSample],
    val: Sequence[SftSample],
    section: SftSection,
    out_dir: Path,
    *,
    seed: int,
    say: Callable[[str], None] = lambda _: None,
    first_step: int = 0,
    tracking: Any = None,
) -> dict[str, Any]:
    """Fine-tune ``trainer`` on ``train``; returns a summary (steps, best metric,
    whether it stopped early). See the module docstring."""
    if not train:
        raise SftDataError("no training samples")
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    per_epoch = math.ceil(len(train) / section.batch_size)
    total = max(1, math.ceil(section.epochs * per_epoch))
    eval_every = section.eval_every or per_epoch
    metric = section.metric
    best: float | None = None
    best_step = -1
    bad = 0
    stopped = False
    best_dir = out_dir / "checkpoints" / "sft-best"
    t0 = time.monotonic()
    order: list[SftSample] = []
    step = 0
    rows_path = out_dir / "metrics.jsonl"
    with open(rows_path, "a") as rows:

        def write(row: dict[str, Any]) -> None:
            clean = {
                k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                for k, v in row.items()
            }
            rows.write(json.dumps(clean) + "\n")
            rows.flush()
            if tracking is not None:
                tracking.metrics(row)

        first = validate(trainer, val, section, first_step)
        if first:
            write({"phase": "sft", "step": first_step, **{f"sft_{k}": v for k, v in first.items()}})
            say(f"sft: before training {_fmt(first)}")
        while step < total:
            if not order:
                order = list(train)
                rng.shuffle(order)
            batch, order = order[: section.batch_size], order[section.batch_size :]
            m = trainer.supervised_step(batch)
            step += 1
            out_of_time = (
                section.max_wall_s is not None and time.monotonic() - t0 >= section.max_wall_s
            )
            row: dict[str, Any] = {
                "phase": "sft",
                "step": first_step + step,
                "epoch": step / per_epoch,
                **m,
            }
            if step % eval_every == 0 or step == total or out_of_time:
                v = validate(trainer, val, section, first_step + step)
                row.update({f"sft_{k}": x for k, x in v.items()})
                if metric not in v and v:
                    raise ValueError(
                        f"[sft] metric {metric!r} is not a validation metric; have "
                        f"{sorted(v)} (val_loss needs validation data)"
                    )
                if metric in v:
                    value = float(v[metric])
                    if _better(value, best, section.metric_mode):
                        best, best_step, bad = value, first_step + step, 0
                        if section.patience is not None:
                            shutil.rmtree(best_dir, ignore_errors=True)
                            trainer.save_checkpoint(str(best_dir))
                    else:
                        bad += 1
                say(f"sft step {first_step + step}/{first_step + total}: {_fmt(row)}")
                if (section.patience is not None and bad >= section.patience) or out_of_time:
                    stopped = True
                    write(row)
                    break
            write(row)
    restored = False
    if section.patience is not None and best_dir.exists() and best_step != first_step + step:
        # The stage ends on its best validation, not on its last step.
        trainer.load_checkpoint(str(best_dir))
        restored = True
    return {
        "steps": step,
        "planned_steps": total,
        "stopped_early": stopped,
        "best_metric": {metric: best, "step": best_step},
        "restored_best": restored,
        "wall_clock_s": round(time.monotonic() - t0, 1),
    }


def _fmt(row: dict[str, Any]) -> str:
    keys = [k for k in row if "loss" in k or "entropy" in k or k.endswith("rate")]
    return "  ".join(
        f"{k} {row[k]:.4f}" for k in keys if isinstance(row[k], int | float) and row[k] is not None
    )


# -------------------------------------------------------- expert iteration


def expert_iteration(run: Any, section: SftSection) -> dict[str, Any]:
    """``iterations`` rounds on a set-up :class:`lightning.run.loop.Run`: sample
    its training tasks (``tasks_per_step`` × ``group_size`` rollouts, train mode,
    at the train temperature) → keep the best by reward → :func:`fit` on their
    recorded tokens → push the weights to the engine. Rows go to ``RUN_DIR/sft``."""
    out = Path(run.out) / "sft"
    summary: dict[str, Any] = {"iterations": []}
    step = 0
    for it in range(section.iterations):
        t0 = time.monotonic()
        results = run.generate(10_000 + it)  # a step number RL never uses: its own seeds
        ids = [r.rollout_id for r in results]
        sel = select_rollouts(
            run.gateway_db,
            min_reward=section.min_reward,
            top_fraction=section.top_fraction,
            rollout_ids=ids,
        )
        rewards = [r.reward for r in results if r.reward is not None]
        info: dict[str, Any] = {
            "iteration": it,
            "rollouts": len(ids),
            "reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
            "selection": sel.summary(),
        }
        run._say(f"expert iteration {it}: {info['selection']}")
        samples = store_samples(run.gateway_db, sel, max_len=_max_len(section, run.model_dir))
        info["samples"] = len(samples)
        if samples:
            result = fit(
                run.trainer,
                samples,
                [],
                section.model_copy(update={"patience": None}),
                out,
                seed=run.config.seed + it,
                say=run._say,
                first_step=step,
            )
            step += result["steps"]
            info["fit"] = result
            run._sync_weights(version=int(run.state["weight_version"]) + 1)
            run.state["weight_version"] = int(run.state["weight_version"]) + 1
        info["wall_clock_s"] = round(time.monotonic() - t0, 1)
        with open(out / "iterations.jsonl", "a") as f:
            f.write(json.dumps(info, default=float) + "\n")
        summary["iterations"].append(info)
    return summary


# --------------------------------------------------------------------- CLI


def run_standalone(cfg: SftConfig, *, quiet: bool = False) -> dict[str, Any]:
    """A dataset or store stage on its own: trainer, :func:`fit`, the final
    weights in ``OUT/model`` (a plain HF directory) and a checkpoint."""
    from lightning.rl.trainer import Trainer

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(cfg.model_dump_json(indent=2))

    def say(msg: str) -> None:
        if not quiet:
            print(f"[lightning] {msg}", flush=True)

    model_dir = cfg.model.resolve()
    train, val, info = prepare_data(cfg.sft, model_dir, seed=cfg.seed)
    say(
        f"sft data: {info['train_samples']} train / {info['val_samples']} validation samples, "
        f"{info['train_tokens']} trained tokens"
    )
    trainer = Trainer(cfg.trainer_config(model_dir), log_dir=None)
    try:
        result = fit(trainer, train, val, cfg.sft, out, seed=cfg.seed, say=say)
        trainer.export_weights(out / "model")
        trainer.save_checkpoint(out / "checkpoints" / "latest")
    finally:
        trainer.close()
    summary = {"output_dir": str(out), "data": info, **result, "model": str(out / "model")}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    return summary
