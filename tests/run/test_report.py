"""lightning.run.report: the offline HTML run report."""

from __future__ import annotations

import base64
import io
import json
import math
import random
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from lightning import cli
from lightning.run import report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(run_dir: Path, *, steps: int = 30, keys_missing: tuple[str, ...] = ()) -> Path:
    """A synthetic run directory shaped like the loop's output."""
    rng = random.Random(0)
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for step in range(steps):
        r = min(1.0, 0.2 + step / steps * 0.6 + rng.uniform(-0.1, 0.1))
        row: dict[str, Any] = {
            "step": step,
            "reward_mean": r,
            "reward_std": 0.3,
            "adv_mean": 0.0,
            "loss": rng.uniform(-0.1, 0.1),
            "clip_frac": rng.uniform(0, 0.2),
            "approx_kl": rng.uniform(0, 0.02),
            "entropy": 1.5 - step / steps,
            "grad_norm": rng.uniform(0.5, 2.0),
            "lr": 1e-6,
            "tokens_per_s": rng.uniform(50, 60),
            "gap_abs_logprob": rng.uniform(0, 0.05),
            "gap_kl": rng.uniform(0, 0.01),
            "response_len_mean": rng.uniform(3, 12),
            "samples_per_rollout": rng.choice([1.0, 1.0, 1.25]),
            "divergences": {"retokenization": rng.randint(0, 2), "template": rng.randint(0, 1)},
            "step_time_s": rng.uniform(9, 11),
            "engine_idle_frac": rng.uniform(0.05, 0.2),
            "trainer_idle_frac": rng.uniform(0.3, 0.5),
            "e2e_tokens_per_s": rng.uniform(20, 30),
        }
        if step % 10 == 0 or step == steps - 1:
            row["eval_reward"] = 0.25 + step / steps * 0.5
        for key in keys_missing:
            row.pop(key, None)
        rows.append(row)
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 99, "rew', encoding="utf-8"
    )
    traces = []
    for step in (0, steps - 1):
        for k in range(3):
            pieces = ["<|im_start|>", "user", "\n", "What", " is", " 3", " <", " 5", "?",
                      "<|im_end|>", "\n", "<|im_start|>", "assistant", "\n",
                      "<script>alert(1)</script>", " 8", "<|im_end|>"]  # fmt: skip
            weights = [0.0] * 14 + [1.0, 1.0, 1.0]
            traces.append(
                {
                    "step": step,
                    "rollout_id": f"r{step}-{k}",
                    "reward": k / 2,
                    "pieces": pieces,
                    "weights": weights,
                    "divergences": [{"position": 11, "kind": "template"}] if k == 1 else [],
                    "task": {"id": "t1", "prompt": "What is 3 < 5?", "answer": "8 & more"},
                }
            )
    (run_dir / "traces.jsonl").write_text(
        "".join(json.dumps(t) + "\n" for t in traces), encoding="utf-8"
    )
    return run_dir


class PageParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.imgs: list[dict[str, str | None]] = []
        self.refs: list[str] = []
        self.tags: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        a = dict(attrs)
        if tag == "img":
            self.imgs.append(a)
        for name in ("src", "href", "srcset", "action", "poster", "data"):
            if a.get(name):
                self.refs.append(str(a[name]))


def decode_png(uri: str) -> bytes:
    prefix = "data:image/png;base64,"
    assert uri.startswith(prefix), uri[:40]
    png = base64.b64decode(uri[len(prefix) :], validate=True)
    assert png.startswith(PNG_MAGIC)
    return png


def assert_valid_png(png: bytes) -> tuple[int, int]:
    from PIL import Image

    with Image.open(io.BytesIO(png)) as im:
        im.verify()
    with Image.open(io.BytesIO(png)) as im:
        im.load()
        w, h = im.size
        # Not blank: a plot has more than one colour.
        assert len(im.convert("RGB").getcolors(maxcolors=1 << 20) or [None, None]) > 1
    assert w > 100 and h > 100
    return w, h


def test_report_is_self_contained_and_plots_are_embedded(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    result = report.write_report(run)
    page = (run / "report.html").read_text(encoding="utf-8")

    parser = PageParser()
    parser.feed(page)
    parser.close()
    assert len(parser.imgs) == len(report.PLOTS) == len(result.png_paths)
    for img in parser.imgs:
        assert img.get("alt")
        assert_valid_png(decode_png(str(img["src"])))
    # PNGs alongside, identical to the embedded ones.
    embedded = {decode_png(str(i["src"])) for i in parser.imgs}
    assert {p.read_bytes() for p in (run / "report").glob("*.png")} == embedded

    # Needs no network: no remote URLs, no protocol-relative refs, no scripts or links.
    assert "http://" not in page and "https://" not in page
    assert not any(r.startswith("//") for r in parser.refs)
    assert all(r.startswith("data:image/png;base64,") for r in parser.refs)
    assert "script" not in parser.tags and "link" not in parser.tags
    assert "url(" not in page and "@import" not in page

    # Traces are escaped, generated tokens highlighted, divergences marked.
    assert "<script>alert" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert '<span class="gen"' in page and '<span class="div"' in page
    assert "8 &amp; more" in page and "&lt;|im_start|&gt;" in page
    assert "Not plotted" not in page


def test_report_skips_missing_plots_and_says_so(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", keys_missing=("gap_abs_logprob", "gap_kl", "divergences"))
    result = report.write_report(run)
    page = result.html_path.read_text(encoding="utf-8")
    assert len(result.png_paths) == len(report.PLOTS) - 2
    assert "Not plotted" in page and "<code>gap_kl</code>" in page
    assert "<code>divergences</code> never appears" in page
    assert not (run / "report" / "logprob_gap.png").exists()


def test_report_of_an_empty_run(tmp_path: Path) -> None:
    run = tmp_path / "empty"
    run.mkdir()
    result = report.write_report(run)
    page = result.html_path.read_text(encoding="utf-8")
    assert result.png_paths == []
    assert "No <code>metrics.jsonl</code> rows" in page and "No traces recorded" in page
    with pytest.raises(FileNotFoundError, match="does not exist"):
        report.write_report(tmp_path / "nope")


def test_cli_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run(tmp_path / "run", steps=5)
    assert cli.main(["report", str(run), "--traces", "2"]) == 0
    assert "report.html" in capsys.readouterr().out
    page = (run / "report.html").read_text(encoding="utf-8")
    assert page.count("class='trace'") == 2
    assert cli.main(["report", str(tmp_path / "missing")]) == 2


def test_series_skips_non_numbers() -> None:
    rows = [{"step": 0, "x": 1}, {"step": 1, "x": None}, {"step": 2, "x": math.nan},
            {"step": 3, "x": True}, {"step": 4, "x": 2.5}, {"x": 3}]  # fmt: skip
    assert report.series(rows, "x") == ([0.0, 4.0, 5.0], [1.0, 2.5, 3.0])


def test_pick_traces_prefers_divergences_and_extremes() -> None:
    traces = [{"step": s, "reward": r, "divergences": []} for s in range(5) for r in (0, 1)]
    traces[3]["divergences"] = [{"position": 0, "kind": "other"}]
    picked = report.pick_traces(traces, 3)
    assert traces[3] in picked
    assert {"step": 4, "reward": 1, "divergences": []} in picked
    assert [t["step"] for t in picked] == sorted(t["step"] for t in picked)
    assert report.pick_traces(traces, 0) == []
    assert len(report.pick_traces(traces, 100)) == len(traces)


def test_report_module_imports_fast_without_torch_or_matplotlib() -> None:
    code = "import sys, lightning.run.report; print('torch' in sys.modules, 'matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"


def test_eval_points_carry_their_interval() -> None:
    from matplotlib.container import ErrorbarContainer
    from matplotlib.figure import Figure

    from lightning.run.report import _draw_reward

    rows = [
        {"step": -1, "eval_reward": 0.3, "eval_ci_low": 0.2, "eval_ci_high": 0.4},
        {"step": 0, "reward_mean": 0.5},
        {"step": 1, "reward_mean": 0.7, "eval_reward": 0.8},  # an eval without an interval
        {"step": 2, "eval_reward": 0.9, "eval_ci_low": 0.85, "eval_ci_high": 0.95},
    ]
    ax = Figure().add_subplot()
    _draw_reward(ax, rows)
    (bars,) = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    (segments,) = bars.lines[2]
    spans = sorted((float(s[0][1]), float(s[1][1])) for s in segments.get_segments())
    assert spans == [(0.2, 0.4), (0.85, 0.95)]
