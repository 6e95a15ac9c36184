"""Online mode, trainer side: train from production sessions in the store.

Selection and grouping are in ``lightning.online.select``, rewards in
``lightning.online.rewards``, export in ``lightning.online.export``; this module
runs the pass::

    lightning online train online.toml          # train from the store (or: lightning train --online)
    lightning online sessions --db lightning.db # list sessions and their signals
    lightning online export --db lightning.db --out sessions.jsonl

**Off-policy.** Sessions were sampled by whatever weights production served
(recorded per call as ``weight_version``, with the engine's logprobs). Tokens are
weighted by the truncated importance weight min(π_trainer / π_rollout, C)
(``[trainer] tis_cap``, default 2.0 here: ``lightning.config.trainer_defaults``;
``losses.policy_loss``), which corrects the gap to the policy being trained at
the cost of bias where the cap truncates.
``source.min_weight_version`` drops calls sampled by older weights outright.

**One data path with the main loop.** A step's sessions go to
``Trainer.step`` as one ``MergeResult`` (``merge_calls`` with the sessions as
``RolloutInfo``, each call tagged with its group), as ``Run.train_on`` passes
``Store.step``'s; ``batching = "tree"`` by default, so a group's shared first
prompt is computed once. ``sessions_per_step`` splits a pass into optimizer
steps that keep groups whole. A pass reports (``summary.json``,
``metrics.jsonl``, printed) sessions selected / trained / skipped by reason,
signals per name, reward mean, groups and singleton fallback, the truncated
importance weights (mean, fraction cut by the cap) and staleness in weight
versions (``policy_version`` minus each call's, by completion tokens).

Trained sessions get ``online_sessions.trained`` set and are skipped next time
unless ``source.include_trained``; feedback that arrives after is kept and
flagged. ``[weight_sync] policy = "none"`` (default) only exports the new
weights: a human decides when they serve.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from lightning import LightningError
from lightning.config import (
    ModelSection,
    TrainerConfig,
    TrainerSection,
    refuse_run_set,
    trainer_defaults,
)
from lightning.modes import Estimator
from lightning.online.rewards import OnlineRewardSection, session_rewards
from lightning.online.select import (
    GroupingSection,
    Selection,
    SourceSection,
    select,
    session_groups,
)
from lightning.online.sessions import Section, Session, dumps, mark_trained
from lightning.sync.kinds import DiskSyncKind


class WeightSyncSection(Section):
    policy: DiskSyncKind = "none"
    urls: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _urls(self) -> WeightSyncSection:
        if self.policy != "none" and not self.urls:
            raise ValueError(f"[weight_sync] policy = {self.policy!r} needs `urls`")
        return self


# Trainer values an online pass sets from its top-level keys.
_PASS_SETS = {
    "estimator": "the top-level estimator",
    "temperature": "the top-level temperature",
    "seed": "the top-level seed",
}


class OnlineConfig(Section):
    model: ModelSection
    source: SourceSection
    grouping: GroupingSection = Field(default_factory=GroupingSection)
    reward: OnlineRewardSection = Field(default_factory=OnlineRewardSection)
    weight_sync: WeightSyncSection = Field(default_factory=WeightSyncSection)
    estimator: Estimator = "grpo"
    temperature: float = Field(default=1.0, gt=0, description="production's sampling temperature")
    # The same [trainer] table as `lightning train`'s, validated by the same class.
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    sessions_per_step: int | None = Field(
        default=None, ge=1, description="default: all in one step"
    )
    mark_trained: bool = True
    policy_version: int | None = Field(
        default=None,
        ge=0,
        description="the weight version of [model] (for staleness); default: the newest "
        "version among the calls trained",
    )
    output_dir: str = "runs/online"
    seed: int = 0

    @model_validator(mode="before")
    @classmethod
    def _trainer_leaves_pass_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            refuse_run_set(data.get("trainer"), _PASS_SETS)
        return data

    def trainer_config(self, model: str | Path) -> TrainerConfig:
        """The trainer of this pass for the policy at ``model``: ``[trainer]``
        with the pass's estimator, temperature and seed, and online mode's
        defaults where ``[trainer]`` leaves them unset (``trainer_defaults``)."""
        return TrainerConfig.for_run(
            self.trainer,
            model=model,
            estimator=self.estimator,
            temperature=self.temperature,
            seed=self.seed,
            defaults=trainer_defaults(off_policy=True, online=True),
        )

    @classmethod
    def load(cls, path: str | Path) -> OnlineConfig:
        import tomllib

        path = Path(path)
        raw = tomllib.loads(path.read_text())
        cfg = cls.model_validate(raw)
        base = path.parent
        if not Path(cfg.source.db).is_absolute():
            cfg.source.db = str((base / cfg.source.db).resolve())
        if not Path(cfg.output_dir).is_absolute():
            cfg.output_dir = str((base / cfg.output_dir).resolve())
        if cfg.model.path is not None and not Path(cfg.model.path).is_absolute():
            cfg.model.path = str((base / cfg.model.path).resolve())
        return cfg


class PassStopped(LightningError):
    """An online pass stopped before it marked any session trained; the
    message says which sessions and values, and what to do."""


def _check_model_path(model: ModelSection) -> None:
    try:
        model.resolve()
    except FileNotFoundError as e:
        raise FileNotFoundError(f'{e}, or try `builtin = "tiny"` under [model]') from None


def _batch(
    store: Any,
    batch: Sequence[Session],
    rewards: dict[str, float],
    groups: dict[str, str],
    *,
    min_version: int | None,
    tokenizer: Any,
) -> tuple[Any, int]:
    """A step's ``MergeResult`` from the store, as the main loop builds one
    (``Store.step``): each session's trainable calls, tagged with its group so
    ``tree`` batching packs a group's shared prompt once, merged with the
    sessions as ``RolloutInfo`` (group, reward). Also the number of calls
    dropped as older than ``min_version``."""
    from lightning import Call, RolloutInfo, merge_calls

    calls, old = [], 0
    for s in batch:
        g = groups[s.rollout_id]
        for c in store.trace(s.rollout_id):
            if min_version is not None and int(c.weight_version) < min_version:
                old += 1
                continue
            calls.append(Call(c.rollout_id, c.prompt_ids, c.completion_ids, c.logprobs,
                              c.finish_reason, c.weight_version, g))  # fmt: skip
    infos = [
        RolloutInfo(s.rollout_id, group=groups[s.rollout_id], mode="train",
                    status="succeeded" if s.closed else "running", reward=rewards[s.rollout_id])
        for s in batch
    ]  # fmt: skip
    return merge_calls(calls, tokenizer=tokenizer, rollouts=infos), old


def step_batches(
    sessions: Sequence[Session], groups: dict[str, str], per_step: int
) -> list[list[Session]]:
    """Sessions in steps of about ``per_step``, whole groups together (a group's
    baseline is its members in one step): groups in order of their first
    session, each added to the current step until it holds ``per_step`` or more."""
    by_group: dict[str, list[Session]] = defaultdict(list)
    for s in sessions:
        by_group[groups[s.rollout_id]].append(s)
    steps: list[list[Session]] = [[]]
    for members in by_group.values():
        if len(steps[-1]) >= per_step:
            steps.append([])
        steps[-1].extend(members)
    return [b for b in steps if b]


def staleness(policy_version: int, calls: Sequence[Any]) -> dict[str, Any]:
    """Completion tokens by staleness ``policy_version - call.weight_version``
    (how many weight versions behind the policy being trained each token was
    sampled), with the token-weighted mean and the maximum."""
    from lightning.run.staleness import staleness_histogram

    hist = staleness_histogram(policy_version, calls)
    total = sum(hist.values())
    return {
        "staleness_tokens": {str(k): v for k, v in sorted(hist.items())},
        "staleness_mean": sum(k * v for k, v in hist.items()) / total if total else 0.0,
        "staleness_max": max(hist) if hist else 0,
    }


def selection_metrics(
    sel: Selection, rewards: dict[str, float], groups: dict[str, str]
) -> dict[str, Any]:
    """What a pass selected and why it left the rest out; the signals by name;
    how the groups came out (``singleton_fallback``: sessions whose group was too
    small and that share the ``__batch__`` baseline)."""
    no_reward = len(sel.sessions) - len(rewards)
    names: Counter[str] = Counter(x["name"] for s in sel.sessions for x in s.signals)
    late = sum(x["after_training"] for s in sel.sessions for x in s.signals)
    vals = list(rewards.values())
    mean = sum(vals) / len(vals) if vals else float("nan")
    return {
        "sessions_selected": len(rewards),
        "sessions_skipped": dict(sel.skipped + Counter({"no_reward": no_reward})),
        "feedback_signals": dict(sorted(names.items())),
        "feedback_after_training": late,
        "session_reward_mean": mean,
        "n_groups": len(set(groups.values())),
        "singleton_fallback": sum(g == "__batch__" for g in groups.values()),
    }


def check_can_mark(db: str, *, gateway: str | None, admin_key: str | None) -> None:
    """Marks nothing, the way ``mark_trained`` will mark: through the gateway's
    writer (its admin key checked) or by opening the store's own writer (which
    fails at once, naming the gateway's pid, while a gateway writes ``db``;
    the error says to set ``gateway = URL``). Without a gateway only the
    writer's lock is taken and given back: no database connection is opened."""
    if gateway is None:
        from lightning import _core

        _core.check_writable(str(db))
        return
    mark_trained(db, [], gateway=gateway, admin_key=admin_key)


def train_online(cfg: OnlineConfig, *, quiet: bool = False) -> dict[str, Any]:
    """Select, reward, group, train; returns the summary (also in
    OUTPUT_DIR/summary.json; one line per step in OUTPUT_DIR/metrics.jsonl)."""
    from lightning import Store, Tokenizer

    def say(msg: str) -> None:
        if not quiet:
            print(f"[lightning online] {msg}", flush=True)

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.model.path is not None:
        _check_model_path(cfg.model)
    sel = select(cfg.source)
    rewards, bad = session_rewards(sel, cfg.reward)
    sessions = [s for s in sel.sessions if s.rollout_id in rewards]
    groups = session_groups(cfg.source.db, sessions, cfg.grouping) if sessions else {}
    summary: dict[str, Any] = {"output_dir": str(out), "sessions": [], "steps": []}
    summary.update(selection_metrics(sel, rewards, groups))
    if bad and cfg.reward.on_bad_reward == "stop":
        _stop(summary, out, _bad_reward_message(bad, cfg.reward))
    if sessions and not math.isfinite(summary["session_reward_mean"]):
        _stop(summary, out, _stats_message("the session reward mean", sessions, rewards))
    say(
        f"{len(sessions)} sessions selected from {cfg.source.db}; skipped "
        f"{summary['sessions_skipped'] or 'none'}; signals {summary['feedback_signals']}"
    )
    if not sessions:
        summary["sessions_trained"] = 0
        (out / "summary.json").write_text(dumps(summary, indent=2))
        return summary
    if cfg.mark_trained:
        # Before a step is trained or a weight written: a pass that cannot mark
        # would train these sessions again next time.
        src = cfg.source
        admin_key = os.environ.get(src.admin_key_env) if src.gateway else None
        check_can_mark(src.db, gateway=src.gateway, admin_key=admin_key)
    # torch loads only now: a pass that cannot mark fails in a second, not after the import.
    from lightning.rl.trainer import Trainer

    model_dir = cfg.model.resolve()
    trainer = Trainer(cfg.trainer_config(model_dir), log_dir=str(out))
    tokenizer = Tokenizer.from_dir(str(model_dir))
    batches = step_batches(sessions, groups, cfg.sessions_per_step or len(sessions))
    trained: list[str] = []
    versions: Counter[int] = Counter()
    try:
        with Store(cfg.source.db) as store:
            for batch in batches:
                merged, old = _batch(
                    store, batch, rewards, groups,
                    min_version=cfg.source.min_weight_version, tokenizer=tokenizer,
                )  # fmt: skip
                ids = sorted({smp.rollout_id for smp in merged.samples})
                if not ids:
                    say(f"{len(batch)} sessions: nothing trainable")
                    continue
                before = _reward_stats([rewards[i] for i in ids])
                if not all(math.isfinite(v) for v in before.values()):
                    off = ", ".join(k for k, v in before.items() if not math.isfinite(v))
                    what = f"step {len(summary['steps']) + 1}'s {off}"
                    _stop(summary, out, _stats_message(what, batch, rewards))
                versions.update(int(c.weight_version) for c in merged.calls)
                metrics = _train_step(
                    trainer, merged, ids, rewards, groups,
                    policy_version=cfg.policy_version, steps_before=len(summary["steps"]),
                )  # fmt: skip
                metrics.update(
                    {"sessions_untrainable": len(batch) - len(ids), "calls_too_old": old}
                )
                summary["steps"].append(metrics)
                with open(out / "metrics.jsonl", "a") as f:
                    f.write(dumps(metrics) + "\n")
                not_finite = [k for k in _CHECKED if not _finite(metrics.get(k))]
                if not_finite:
                    what = f"step {len(summary['steps'])}'s {', '.join(not_finite)}"
                    _stop(summary, out, _stats_message(what, batch, rewards))
                trained.extend(ids)
                say(_step_line(len(summary["steps"]), metrics))
        if trained:
            summary["weights"] = str(_export(cfg, trainer, out, versions))
    finally:
        if hasattr(trainer, "close"):
            trainer.close()
    if cfg.mark_trained and trained:
        src = cfg.source
        admin_key = os.environ.get(src.admin_key_env) if src.gateway else None
        mark_trained(src.db, trained, gateway=src.gateway, admin_key=admin_key)
    summary["sessions"] = trained
    summary["sessions_trained"] = len(trained)
    summary["rewards"] = {rid: rewards[rid] for rid in trained}
    summary["groups"] = {rid: groups[rid] for rid in trained}
    summary["weight_versions"] = {str(k): v for k, v in sorted(versions.items())}
    (out / "summary.json").write_text(dumps(summary, indent=2))
    say(
        f"trained {len(trained)} sessions; skipped {summary['sessions_skipped'] or 'none'}; "
        f"weights in {summary.get('weights')}"
    )
    return summary


# Step statistics that must be finite for the step to mean anything: a reward
# of 1e308 gives reward_std = inf, all advantages 0 and no gradient.
_CHECKED = ("reward_mean", "reward_std", "adv_mean", "adv_std", "loss", "grad_norm")


def _reward_stats(values: Sequence[float]) -> dict[str, float]:
    """Mean and std of a step's rewards, checked before the step: a std that
    overflows leaves every advantage 0. Plain floats: x * x overflows to inf
    without raising or warning."""
    mean = sum(values) / len(values)
    var = sum((x - mean) * (x - mean) for x in values) / len(values)
    return {"reward_mean": mean, "reward_std": math.sqrt(var)}


def _finite(x: Any) -> bool:
    return not isinstance(x, float) or math.isfinite(x)


def _stop(summary: dict[str, Any], out: Path, why: str) -> None:
    """Ends the pass before anything is marked trained (or weights exported):
    the reason goes to summary.json and the raised ``PassStopped``."""
    summary["stopped"] = why
    summary["sessions_trained"] = 0
    (out / "summary.json").write_text(dumps(summary, indent=2))
    raise PassStopped(why)


_NOTHING_DONE = "Nothing was marked trained and no weights were written"


def _bad_reward_message(bad: dict[str, str], cfg: OnlineRewardSection) -> str:
    shown = "; ".join(f"{rid}: {why}" for rid, why in list(bad.items())[:5])
    more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
    return (
        f"online pass stopped: {len(bad)} session(s) have a reward that is not finite or "
        f"beyond ±{cfg.max_abs:g}: {shown}{more}. {_NOTHING_DONE}. Find the client that "
        "posts such feedback (`lightning online sessions --db DB`); then leave those "
        'sessions out (`[reward] on_bad_reward = "skip"`), or raise `[reward] max_abs` '
        "if such values are meant."
    )


def _stats_message(what: str, sessions: Sequence[Session], rewards: dict[str, float]) -> str:
    top = sorted((s.rollout_id for s in sessions if s.rollout_id in rewards),
                 key=lambda rid: -abs(rewards[rid]))[:5]  # fmt: skip
    shown = ", ".join(f"{rid} = {rewards[rid]:g}" for rid in top)
    return (
        f"online pass stopped: {what} is not finite, so this step would train nothing "
        f"sensible. {_NOTHING_DONE}. The largest rewards: {shown}. Lower `[reward] max_abs` "
        'to refuse such rewards, or set `[reward] on_bad_reward = "skip"` to leave them out.'
    )


def _train_step(
    trainer: Any,
    merged: Any,
    ids: Sequence[str],
    rewards: dict[str, float],
    groups: dict[str, str],
    *,
    policy_version: int | None,
    steps_before: int,
) -> dict[str, Any]:
    """One optimizer step on the sessions ``ids`` of ``merged``; the trainer's
    metrics plus the pass's own (groups, singleton fallback, staleness)."""
    policy = (
        policy_version
        if policy_version is not None
        else max(int(c.weight_version) for c in merged.calls)
    )
    metrics = dict(trainer.step(merged, {k: rewards[k] for k in ids}, {k: groups[k] for k in ids}))
    metrics.update(
        {
            "sessions_trained": len(ids),
            "groups": len({groups[i] for i in ids}),
            "singleton_fallback": sum(groups[i] == "__batch__" for i in ids),
            "calls": len(merged.calls),
            "divergences": dict(Counter(d.kind for d in merged.divergences)),
            "policy_version": policy,
            **staleness(policy, merged.calls),
            # Optimizer steps the policy took in this pass before this one:
            # every session here was sampled at least that far back.
            "steps_behind": steps_before,
        }
    )
    return metrics


def _step_line(k: int, m: dict[str, Any]) -> str:
    def f(x: Any) -> str:
        return "nan" if x is None or x != x else f"{x:.3g}"

    return (
        f"step {k}: {m['sessions_trained']} sessions in {m['groups']} groups "
        f"({m['singleton_fallback']} on the batch baseline), reward {f(m['reward_mean'])}, "
        f"loss {f(m['loss'])}, IS weight {f(m['tis_weight_mean'])} "
        f"(cap cut {f(m['tis_clip_frac'])}), staleness mean {f(m['staleness_mean'])} "
        f"max {m['staleness_max']}"
    )


def _export(cfg: OnlineConfig, trainer: Any, out: Path, versions: Counter[int]) -> Path:
    """Writes the new weights; pushes them to the engines only when configured."""
    from lightning.sync import WeightUpdate, make_weight_sync

    weights = out / "weights" / "latest"
    trainer.export_weights(str(weights))
    if cfg.weight_sync.policy != "none":
        version = 1 + max(versions) if versions else 1
        sync = make_weight_sync(cfg.weight_sync.policy, cfg.weight_sync.urls)
        try:
            sync.setup()
            sync.push(WeightUpdate(version=version, path=weights))
        finally:
            sync.close()
    return weights


def train_main(argv: list[str], prog: str = "lightning train --online") -> int:
    """``lightning online train`` (also spelled ``lightning train --online``)."""
    import argparse

    from pydantic import ValidationError

    p = argparse.ArgumentParser(
        prog=prog,
        description="one training pass on the production sessions of a gateway's store",
    )
    p.add_argument("config", help="online training configuration (TOML; see docs/online.md)")
    p.add_argument("--output-dir", metavar="DIR", help="where summary.json, metrics and weights go "
                   "(default: the config's output_dir)")  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="print only the final summary")
    args = p.parse_args(argv)

    def fail(msg: str) -> int:
        print(f"{prog}: {msg}", file=sys.stderr)
        return 1

    try:
        cfg = OnlineConfig.load(args.config)
    except ValidationError as e:
        return fail(f"{args.config}: {_config_errors(e)}")
    except (OSError, ValueError) as e:  # a missing file, bad TOML
        return fail(f"{args.config}: {e}")
    if args.output_dir:
        cfg.output_dir = args.output_dir
    try:
        summary = train_online(cfg, quiet=args.quiet)
    except (FileNotFoundError, LightningError) as e:  # PassStopped is one
        # LightningError: a store another writer holds (the fix is in the
        # message: `gateway = URL`), a gateway that refuses the admin key.
        return fail(str(e))
    print(json.dumps({k: summary[k] for k in ("output_dir", "sessions")}, indent=2))
    return 0


def _config_errors(e: Any) -> str:
    """A pydantic ``ValidationError`` as one line, with the fix for a missing model."""
    parts = []
    for err in e.errors():
        where = ".".join(str(x) for x in err["loc"]) or "config"
        parts.append(f"{where}: {err['msg']}")
    text = "; ".join(parts)
    if any(err["loc"][:1] == ("model",) for err in e.errors()):
        text += (
            ' (for a first try: [model] builtin = "tiny"; or path = "DIR" of a Hugging Face model)'
        )
    return text
