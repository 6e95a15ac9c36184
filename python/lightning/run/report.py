"""Run report: ``lightning report RUN_DIR``.

Inputs (written by the training loop):

- ``RUN_DIR/metrics.jsonl``: one JSON object per step (keys in the brief's
  contract: ``reward_mean``, ``eval_reward``, ``approx_kl``, ``clip_frac``,
  ``response_len_mean``, ``gap_abs_logprob``, ``gap_kl``, ``samples_per_rollout``,
  ``divergences`` = {kind: count}, ...).
- ``RUN_DIR/traces.jsonl``: one object per rendered trace: ``{"step",
  "rollout_id", "reward", "pieces": [decoded text per token], "weights": [float per
  token, 0 = context], "divergences": [{"position", "kind"}], "task": {...}}``.

A run through several harnesses (lightning.run.harnesses) adds a section: the
held-out matrix harness × (before, mid, final) with 95% intervals, drawn as
points with error bars, the transfer to each ``eval_only`` harness as its
headline, and each harness's costs (calls, prompt tokens, samples per rollout
and their drift causes, wall clock), flagging one whose history rewriting
splits every rollout.

Output: ``RUN_DIR/report.html``, one self-contained file (PNGs inlined as base64
data URIs, inline CSS, no scripts, nothing fetched from the network) and the same
PNGs in ``RUN_DIR/report/``. A plot whose keys never appear is skipped and the page
says so. Both inputs are read tolerantly: a half-written last line (the run is
still going) is ignored.

Plots use matplotlib's Agg canvas through ``matplotlib.figure.Figure`` (no pyplot
global state); matplotlib is imported only when a report is written, so this
module imports fast.
"""

from __future__ import annotations

import argparse
import base64
import datetime as _dt
import html
import io
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.traces import fmt_value, render_trace_html

# ----------------------------------------------------------------- reading


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Objects from a JSONL file; a missing file is empty and undecodable lines
    (a run still writing its last line) are skipped."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                rows.append(obj)
    return rows


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) for the rows where ``key`` is a finite number."""
    xs, ys = [], []
    for i, row in enumerate(rows):
        y = _num(row.get(key))
        if y is None:
            continue
        x = _num(row.get("step"))
        xs.append(x if x is not None else float(i))
        ys.append(y)
    return xs, ys


# ----------------------------------------------------------------- plots


@dataclass(frozen=True)
class PlotSpec:
    name: str  # file stem
    title: str
    keys: tuple[str, ...]  # any one present makes the plot
    ylabel: str
    draw: Callable[[Any, Sequence[Mapping[str, Any]]], None]


def _ema(ys: Sequence[float], alpha: float) -> list[float]:
    out, acc = [], ys[0]
    for y in ys:
        acc = alpha * y + (1 - alpha) * acc
        out.append(acc)
    return out


def _draw_reward(ax: Any, rows: Sequence[Mapping[str, Any]]) -> None:
    xs, ys = series(rows, "reward_mean")
    if xs:
        sx, sd = series(rows, "reward_std")
        std = dict(zip(sx, sd, strict=True))
        if len(std) == len(xs):
            lo = [y - std[x] for x, y in zip(xs, ys, strict=True)]
            hi = [y + std[x] for x, y in zip(xs, ys, strict=True)]
            ax.fill_between(xs, lo, hi, color="#4c78a8", alpha=0.15, linewidth=0, label="± std")
        ax.plot(xs, ys, color="#4c78a8", alpha=0.45 if len(xs) >= 10 else 1.0, label="train")
        if len(xs) >= 10:
            ax.plot(xs, _ema(ys, 0.2), color="#4c78a8", linewidth=2, label="train (EMA)")
    ex, ey = series(rows, "eval_reward")
    if ex:
        ax.plot(ex, ey, color="#e45756", marker="o", linewidth=2, label="eval (held out)")
        # The eval's 95% interval (bootstrap over tasks, lightning.run.stats), where recorded.
        bars = [
            (x, y, lo, hi)
            for x, y, lo, hi in zip(
                ex,
                ey,
                (
                    _num(r.get("eval_ci_low"))
                    for r in rows
                    if _num(r.get("eval_reward")) is not None
                ),
                (
                    _num(r.get("eval_ci_high"))
                    for r in rows
                    if _num(r.get("eval_reward")) is not None
                ),
                strict=True,
            )
            if lo is not None and hi is not None
        ]
        if bars:
            bx, by, blo, bhi = zip(*bars, strict=True)
            yerr = [
                [y - lo for y, lo in zip(by, blo, strict=True)],
                [hi - y for y, hi in zip(by, bhi, strict=True)],
            ]
            ax.errorbar(
                bx, by, yerr=yerr, fmt="none", ecolor="#e45756", capsize=4, label="eval 95% CI"
            )
    ax.legend(loc="best", fontsize=8)


def _lines(*keys_labels: tuple[str, str]) -> Callable[[Any, Sequence[Mapping[str, Any]]], None]:
    def draw(ax: Any, rows: Sequence[Mapping[str, Any]]) -> None:
        drawn = 0
        for key, label in keys_labels:
            xs, ys = series(rows, key)
            if xs:
                ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=label)
                drawn += 1
        if drawn > 1:
            ax.legend(loc="best", fontsize=8)

    return draw


def _divergence_counts(rows: Sequence[Mapping[str, Any]]) -> tuple[list[float], dict[str, list]]:
    steps: list[float] = []
    per_kind: dict[str, dict[float, float]] = {}
    for i, row in enumerate(rows):
        div = row.get("divergences")
        if not isinstance(div, Mapping):
            continue
        x = _num(row.get("step"))
        x = x if x is not None else float(i)
        steps.append(x)
        for kind, count in div.items():
            c = _num(count)
            if c is not None:
                per_kind.setdefault(str(kind), {})[x] = c
    return steps, {k: [v.get(x, 0.0) for x in steps] for k, v in sorted(per_kind.items())}


def _draw_divergences(ax: Any, rows: Sequence[Mapping[str, Any]]) -> None:
    steps, kinds = _divergence_counts(rows)
    bottom = [0.0] * len(steps)
    for kind, counts in kinds.items():
        ax.bar(steps, counts, bottom=bottom, label=kind, width=0.8)
        bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
    if not kinds or not any(bottom):
        ax.text(
            0.5,
            0.5,
            "no divergences recorded",
            ha="center",
            va="center",
            transform=ax.transAxes,
            color="#666",
        )
    if kinds:
        # Headroom so the legend (top) never hides the tallest bars.
        ax.set_ylim(0, max(1.0, *bottom) * 1.35)
        ax.legend(loc="upper left", fontsize=8, ncols=min(4, len(kinds)))


# fmt: off
PLOTS: tuple[PlotSpec, ...] = (
    PlotSpec("reward", "Reward per step", ("reward_mean", "eval_reward"), "reward", _draw_reward),
    PlotSpec("approx_kl", "Approx. KL (policy vs. rollout)", ("approx_kl",), "KL",
             _lines(("approx_kl", "approx KL"))),
    PlotSpec("clip_frac", "Clip fraction", ("clip_frac",), "fraction",
             _lines(("clip_frac", "clip fraction"))),
    PlotSpec("response_len", "Response length", ("response_len_mean",), "tokens",
             _lines(("response_len_mean", "mean response tokens"))),
    PlotSpec("logprob_gap", "Train–serve logprob gap", ("gap_abs_logprob", "gap_kl"), "nats",
             _lines(("gap_abs_logprob", "mean |Δ logprob|"), ("gap_kl", "KL estimate"))),
    PlotSpec("samples_per_rollout", "Samples per rollout (merge)", ("samples_per_rollout",),
             "samples", _lines(("samples_per_rollout", "samples / rollout"))),
    PlotSpec("divergences", "Divergences by kind", ("divergences",), "count", _draw_divergences),
    PlotSpec("entropy", "Entropy", ("entropy",), "nats", _lines(("entropy", "entropy"))),
    PlotSpec("grad_norm", "Gradient norm", ("grad_norm",), "norm",
             _lines(("grad_norm", "grad norm"))),
    PlotSpec("throughput", "Training throughput", ("tokens_per_s",), "tokens/s",
             _lines(("tokens_per_s", "tokens/s"))),
    # lightning.run.staleness: max_staleness = 0 (sync) vs > 0 (async); benches/async_loop.py
    # draws both modes of one machine side by side.
    PlotSpec("idle", "Idle fractions (engine, trainer)", ("engine_idle_frac", "trainer_idle_frac"),
             "fraction of wall time", _lines(("engine_idle_frac", "engine idle"),
                                             ("trainer_idle_frac", "trainer idle"))),
    PlotSpec("e2e_throughput", "End-to-end throughput", ("e2e_tokens_per_s",),
             "trained tokens/s", _lines(("e2e_tokens_per_s", "trained tokens per wall second"))),
)
# fmt: on


def _has_key(rows: Sequence[Mapping[str, Any]], key: str) -> bool:
    if key == "divergences":
        return any(isinstance(r.get(key), Mapping) for r in rows)
    return any(_num(r.get(key)) is not None for r in rows)


def render_plot(spec: PlotSpec, rows: Sequence[Mapping[str, Any]]) -> bytes:
    """One plot as PNG bytes."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0, 3.2), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    spec.draw(ax, rows)
    ax.set_title(spec.title, fontsize=11)
    ax.set_xlabel("step")
    ax.set_ylabel(spec.ylabel)
    ax.grid(True, alpha=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


# ----------------------------------------------------------------- harnesses

_EVAL_COLORS = ("#9aa3b5", "#f58518", "#4c78a8", "#54a24b", "#b279a2", "#e45756")


def render_matrix_plot(matrix: Mapping[str, Sequence[Mapping[str, Any]]]) -> bytes:
    """The eval matrix as PNG: per harness, one point per eval with its 95% interval."""
    from matplotlib.figure import Figure

    names = list(matrix)
    labels: list[str] = []
    for cells in matrix.values():
        for c in cells:
            if c["label"] not in labels:
                labels.append(c["label"])
    fig = Figure(figsize=(max(6.0, 1.6 * len(names) + 2), 3.4), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(labels))
    for li, label in enumerate(labels):
        xs, ys, lo, hi = [], [], [], []
        for ni, name in enumerate(names):
            cell = next((c for c in matrix[name] if c["label"] == label), None)
            if cell is None or _num(cell.get("reward")) is None:
                continue
            y = float(cell["reward"])
            xs.append(ni - 0.4 + width * (li + 0.5))
            ys.append(y)
            lo.append(y - float(cell.get("low", y)))
            hi.append(float(cell.get("high", y)) - y)
        color = _EVAL_COLORS[li % len(_EVAL_COLORS)]
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", color=color, capsize=4, label=label)
    ticks = [
        f"{n}\n(eval only)" if matrix[n] and matrix[n][-1].get("eval_only") else n for n in names
    ]
    ax.set_xticks(range(len(names)), ticks, fontsize=8)
    ax.set_ylabel("held-out reward (95% CI)")
    ax.set_title("Held-out reward per harness", fontsize=11)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


_COST_COLUMNS = (
    ("rollouts", "rollouts"),
    ("reward_mean", "train reward"),
    ("calls_per_rollout", "calls / rollout"),
    ("prompt_tokens_per_call", "prompt tokens / call"),
    ("first_prompt_tokens", "first prompt tokens"),
    ("task_tokens", "task tokens"),
    ("samples_per_rollout", "samples / rollout"),
    ("split_frac", "split (multi-call)"),
    ("wall_s_per_rollout", "wall s / rollout"),
)


def _costs_table(costs: Mapping[str, Mapping[str, Any]]) -> str:
    head = "".join(f"<th>{html.escape(t)}</th>" for _, t in _COST_COLUMNS)
    body = []
    for name, c in costs.items():
        cells = "".join(f"<td>{fmt_value(c.get(k))}</td>" for k, _ in _COST_COLUMNS)
        kinds = c.get("divergences") or {}
        drift = ", ".join(f"{k} ×{n}" for k, n in kinds.items()) or "none"
        body.append(f"<tr><td>{html.escape(name)}</td>{cells}<td>{html.escape(drift)}</td></tr>")
    return (
        f"<table><tr><th>harness</th>{head}<th>drift (divergences)</th></tr>{''.join(body)}</table>"
    )


def _harness_section(rows: Sequence[Mapping[str, Any]], png_dir: Path) -> tuple[str, Path | None]:
    """The report's harness section (empty for a run with one harness)."""
    from lightning.run.harnesses import (
        eval_matrix,
        matrix_table,
        merge_costs,
        split_flags,
        transfer_lines,
    )

    matrix = eval_matrix(rows)
    train_costs = merge_costs(rows, "harnesses")
    if len(matrix) < 2 and len(train_costs) < 2:
        return "", None
    parts = ["<h2>Harnesses</h2>"]
    png_path = None
    if matrix:
        for line in transfer_lines(matrix):
            parts.append(f"<p class='headline'><b>{html.escape(line)}</b></p>")
        png = render_matrix_plot(matrix)
        png_path = png_dir / "harness_matrix.png"
        png_path.write_bytes(png)
        uri = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
        parts.append(
            f'<figure><img src="{uri}" alt="Held-out reward per harness"></figure>'
            "<p class='note'>Held-out reward, harness × eval (mean, 95% interval by "
            "bootstrap over tasks):</p>"
        )
        table = matrix_table(matrix).splitlines()
        head = [c.strip() for c in table[0].strip("|").split("|")]
        rows_html = [
            "<tr>"
            + "".join(f"<td>{html.escape(c.strip())}</td>" for c in line.strip("|").split("|"))
            + "</tr>"
            for line in table[2:]
        ]
        parts.append(
            "<table><tr>"
            + "".join(f"<th>{html.escape(h)}</th>" for h in head)
            + "</tr>"
            + "".join(rows_html)
            + "</table>"
        )
    if train_costs:
        parts.append(
            "<p class='note'>What each harness cost per training step (averaged over steps):</p>"
        )
        parts.append(_costs_table(train_costs))
        for name, why in split_flags(train_costs).items():
            parts.append(
                f"<p class='flag'><b>{html.escape(name)}</b> rewrites its history: "
                f"{html.escape(why)}</p>"
            )
    eval_costs = {
        name: cells[-1]["costs"]
        for name, cells in matrix.items()
        if cells and isinstance(cells[-1].get("costs"), Mapping)
    }
    if eval_costs:
        parts.append(
            "<p class='note'>At the last eval (every harness, eval-only ones included):</p>"
        )
        parts.append(_costs_table(eval_costs))
    return "".join(parts), png_path


# ----------------------------------------------------------------- traces


def pick_traces(traces: Sequence[Mapping[str, Any]], limit: int) -> list[Mapping[str, Any]]:
    """A few informative traces: ones with divergences, then the best and worst
    of the last step, then the first step's, then the rest by step (latest first)."""
    if limit <= 0 or not traces:
        return []

    def step(t: Mapping[str, Any]) -> float:
        return _num(t.get("step")) or 0.0

    def reward(t: Mapping[str, Any]) -> float:
        r = _num(t.get("reward"))
        return r if r is not None else -math.inf

    last = max(step(t) for t in traces)
    first = min(step(t) for t in traces)
    at_last = sorted((t for t in traces if step(t) == last), key=reward)
    ordered = [
        *[t for t in traces if t.get("divergences")][:2],
        *at_last[-1:],
        *at_last[:1],
        *[t for t in traces if step(t) == first][:1],
        *sorted(traces, key=step, reverse=True),
    ]
    chosen: list[Mapping[str, Any]] = []
    seen: set[int] = set()
    for t in ordered:
        if id(t) not in seen:
            seen.add(id(t))
            chosen.append(t)
        if len(chosen) == limit:
            break
    return sorted(chosen, key=step)


# ----------------------------------------------------------------- page

CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0;
       color: #1d2330; background: #f5f6f8; }
main { max-width: 1240px; margin: 0 auto; padding: 24px 28px 48px; }
h1 { font-size: 24px; margin: 0 0 4px; }
h2 { font-size: 18px; margin: 32px 0 12px; border-bottom: 1px solid #d9dce3; padding-bottom: 4px; }
.sub { color: #5b6475; margin: 0 0 18px; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; }
.card { background: #fff; border: 1px solid #dfe2e8; border-radius: 8px; padding: 10px 14px;
        min-width: 150px; }
.card .k { color: #5b6475; font-size: 12px; text-transform: uppercase; letter-spacing: .04em; }
.card .v { font-size: 20px; font-weight: 600; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(540px, 1fr)); gap: 16px; }
figure { margin: 0; background: #fff; border: 1px solid #dfe2e8; border-radius: 8px; padding: 8px; }
figure img { width: 100%; height: auto; display: block; }
.note { color: #5b6475; }
.skipped li code, td code { background: #eceef2; padding: 0 4px; border-radius: 3px; }
table { border-collapse: collapse; background: #fff; font-size: 13px; }
td, th { border: 1px solid #dfe2e8; padding: 3px 8px; text-align: right; }
th { background: #eceef2; }
td:first-child, th:first-child { text-align: left; }
.trace { background: #fff; border: 1px solid #dfe2e8; border-radius: 8px; margin: 0 0 16px;
         padding: 10px 14px; }
.trace .meta { color: #5b6475; font-size: 13px; margin-bottom: 6px; }
.trace .meta b { color: #1d2330; }
.tokens { font: 13px/1.55 ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace;
          white-space: pre-wrap; word-break: break-word; background: #fafbfc;
          border-radius: 6px; padding: 8px 10px; max-height: 420px; overflow: auto; }
.ctx { color: #7a8190; }
.gen { background: #d4f5dc; color: #0b4a1e; border-radius: 2px; }
.div { background: #d62839; color: #fff; font-weight: 600; border-radius: 3px; padding: 0 4px;
       margin: 0 2px; font-size: 11px; }
.legend span { margin-right: 14px; }
.headline { font-size: 16px; }
.flag { background: #fde8ea; border: 1px solid #d62839; border-radius: 6px; padding: 6px 10px; }
"""


def _summary_cards(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    _, rewards = series(rows, "reward_mean")
    # Eval-only rows (before/after training) are not training steps.
    cards = [("training steps", str(len(rewards) if rewards else len(rows)))]
    if rewards:
        cards.append(
            ("train reward first → last", f"{fmt_value(rewards[0])} → {fmt_value(rewards[-1])}")
        )
    _, evals = series(rows, "eval_reward")
    if evals:
        cards.append(
            ("eval reward first → last", f"{fmt_value(evals[0])} → {fmt_value(evals[-1])}")
        )
        cards.append(("best eval reward", fmt_value(max(evals))))
    _, times = series(rows, "step_time_s")
    if times:
        cards.append(("time in steps", f"{sum(times) / 60:.1f} min"))
    _, tps = series(rows, "tokens_per_s")
    if tps:
        cards.append(("mean tokens/s", fmt_value(sum(tps) / len(tps))))
    return cards


def _last_values_table(rows: Sequence[Mapping[str, Any]]) -> str:
    if not rows:
        return ""
    keys: list[str] = []
    for row in rows:
        for k, v in row.items():
            if k not in keys and k != "step" and _num(v) is not None:
                keys.append(k)
    body = []
    for k in keys:
        _, ys = series(rows, k)
        if not ys:
            continue
        cells = "".join(f"<td>{fmt_value(v)}</td>" for v in (ys[0], ys[-1], min(ys), max(ys)))
        body.append(f"<tr><td><code>{html.escape(k)}</code></td>{cells}</tr>")
    head = "<tr><th>metric</th><th>first</th><th>last</th><th>min</th><th>max</th></tr>"
    return f"<table>{head}{''.join(body)}</table>"


def _trace_block(t: Mapping[str, Any]) -> str:
    pieces = [str(p) for p in t.get("pieces") or []]
    weights = [float(w) for w in t.get("weights") or []]
    divergences = [d for d in t.get("divergences") or [] if isinstance(d, Mapping)]
    try:
        body = render_trace_html(pieces, weights, divergences)
    except ValueError as e:
        body = f'<span class="div">unreadable trace: {html.escape(str(e))}</span>'
    task = t.get("task")
    prompt = task.get("prompt") if isinstance(task, Mapping) else None
    answer = task.get("answer") if isinstance(task, Mapping) else None
    n_gen = sum(1 for w in weights if w > 0)
    meta = [
        f"step <b>{html.escape(str(t.get('step', '?')))}</b>",
        *([f"harness <b>{html.escape(str(t['harness']))}</b>"] if t.get("harness") else []),
        f"rollout <code>{html.escape(str(t.get('rollout_id', '?')))}</code>",
        f"reward <b>{fmt_value(t.get('reward'))}</b>",
        f"{len(pieces)} tokens, {n_gen} generated",
        f"{len(divergences)} divergence{'s' if len(divergences) != 1 else ''}",
    ]
    task_line = ""
    if prompt is not None:
        task_line = f"<div class='meta'>task: {html.escape(str(prompt))}"
        if answer is not None:
            task_line += f" — expected <b>{html.escape(str(answer))}</b>"
        task_line += "</div>"
    return (
        f"<div class='trace'><div class='meta'>{' · '.join(meta)}</div>{task_line}"
        f"<div class='tokens'>{body}</div></div>"
    )


@dataclass
class ReportResult:
    html_path: Path
    png_paths: list[Path]
    skipped: list[str]  # plot titles with no data


def write_report(run_dir: str | Path, *, max_traces: int = 6) -> ReportResult:
    """Write ``RUN_DIR/report.html`` and ``RUN_DIR/report/*.png``."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist; pass a run's output dir")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    traces = read_jsonl(run_dir / "traces.jsonl")
    png_dir = run_dir / "report"
    png_dir.mkdir(exist_ok=True)

    figures, skipped, pngs = [], [], []
    for spec in PLOTS:
        if not any(_has_key(rows, k) for k in spec.keys):
            keys = " / ".join(f"<code>{k}</code>" for k in spec.keys)
            skipped.append(f"<li>{html.escape(spec.title)}: {keys} never appears</li>")
            continue
        png = render_plot(spec, rows)
        path = png_dir / f"{spec.name}.png"
        path.write_bytes(png)
        pngs.append(path)
        uri = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
        alt = html.escape(spec.title)
        figures.append(f'<figure><img src="{uri}" alt="{alt}"></figure>')

    cards = "".join(
        f"<div class='card'><div class='k'>{html.escape(k)}</div>"
        f"<div class='v'>{html.escape(v)}</div></div>"
        for k, v in _summary_cards(rows)
    )
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>lightning report — {html.escape(run_dir.resolve().name)}</title>",
        f"<style>{CSS}</style></head><body><main>",
        "<h1>lightning run report</h1>",
        f"<p class='sub'>{html.escape(str(run_dir.resolve()))} · generated "
        f"{_dt.datetime.now(_dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}</p>",
        f"<div class='cards'>{cards}</div>",
        "<h2>Training curves</h2>",
    ]
    if not rows:
        parts.append("<p class='note'>No <code>metrics.jsonl</code> rows in this run yet.</p>")
    parts.append(f"<div class='plots'>{''.join(figures)}</div>")
    if skipped:
        parts.append(
            "<p class='note'>Not plotted (no data in <code>metrics.jsonl</code>):</p>"
            f"<ul class='note skipped'>{''.join(skipped)}</ul>"
        )
    harness_html, matrix_png = _harness_section(rows, png_dir)
    if matrix_png is not None:
        pngs.append(matrix_png)
    parts.append(harness_html)
    if rows:
        parts += ["<h2>Metrics summary</h2>", _last_values_table(rows)]
    parts.append("<h2>Traces</h2>")
    chosen = pick_traces(traces, max_traces)
    if chosen:
        parts.append(
            "<p class='legend note'><span class='gen'>generated (trained)</span>"
            "<span class='ctx'>context (prompt, tool output, template)</span>"
            "<span class='div'>↪ kind</span> a later call left this path here "
            f"— showing {len(chosen)} of {len(traces)} recorded traces</p>"
        )
        parts += [_trace_block(t) for t in chosen]
    else:
        parts.append("<p class='note'>No traces recorded (<code>traces.jsonl</code>).</p>")
    parts.append("</main></body></html>\n")

    html_path = run_dir / "report.html"
    html_path.write_text("".join(parts), encoding="utf-8")
    return ReportResult(html_path=html_path, png_paths=pngs, skipped=skipped)


# ----------------------------------------------------------------- CLI


def main(argv: list[str]) -> int:
    """``lightning report RUN_DIR``."""
    p = argparse.ArgumentParser(prog="lightning report", description="Write RUN_DIR/report.html.")
    p.add_argument("run_dir")
    p.add_argument("--traces", type=int, default=6, help="how many traces to render (default 6)")
    args = p.parse_args(argv)
    try:
        result = write_report(args.run_dir, max_traces=args.traces)
    except FileNotFoundError as e:
        print(f"lightning report: {e}", file=sys.stderr)
        return 2
    print(f"wrote {result.html_path} ({len(result.png_paths)} plots)")
    return 0
