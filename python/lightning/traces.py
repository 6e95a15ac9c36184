"""A merged rollout as a person reads it.

One home for what the loop writes to ``traces.jsonl``, what ``lightning show``
prints, what the report renders and what ``lightning view`` serves:

- :func:`decode_pieces` / :func:`token_pieces`: per-token text whose
  concatenation is the decoded sequence (``⟨id⟩`` per token without a tokenizer);
- :func:`sample_row` and :func:`divergence_rows`: a merged sample and the
  divergences of one rollout as plain JSON-ready rows;
- :func:`trace_record`: the ``traces.jsonl`` record of one sample;
- :func:`render_trace_terminal` / :func:`render_trace_html`: the token runs
  drawn for a terminal (ANSI) and for HTML, generated tokens set apart from
  context and each divergence marked where the later call left the path.

Torch-free and import-light: it reads ``lightning._core`` values it is handed.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from lightning._core import MergeResult, Sample


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


# ----------------------------------------------------------------- tokens as text


def decode_pieces(ids: Sequence[int], decode: Callable[[list[int]], str]) -> list[str]:
    """Per-token text whose concatenation is ``decode(ids)``, for traces.

    A token that ends inside a multi-byte character gets ``""`` and the character
    goes to the token that completes it. Each token is decoded together with a few
    tokens before it, so tokenizers that drop a leading space on a lone token
    (SentencePiece) still get their spaces right; cost is O(n), not O(n²)."""
    ids = [int(i) for i in ids]
    pieces: list[str] = []
    base = 0  # window start
    committed = ""  # text of ids[base:i] already handed out
    for i in range(len(ids)):
        text = decode(ids[base : i + 1])
        if text.endswith("\ufffd"):
            pieces.append("")  # incomplete character: wait for the next token
            continue
        pieces.append(text[len(committed) :] if text.startswith(committed) else text)
        committed = text
        if i + 1 - base > 8:
            new_base = i + 1 - 4
            window = decode(ids[new_base : i + 1])
            if not window.startswith("\ufffd"):
                base, committed = new_base, window
    return pieces


def token_pieces(ids: Sequence[int], tokenizer: Decoder | None) -> list[str]:
    """Per-token text, or each token as its id (``⟨id⟩``) when there is no
    tokenizer (a standalone gateway's store names no model)."""
    ids = [int(i) for i in ids]
    if tokenizer is None:
        return [f"⟨{i}⟩" for i in ids]
    return decode_pieces(ids, tokenizer.decode)


def finite(x: Any) -> float | None:
    """A float, or None for a missing or non-finite one (JSON has no NaN)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def fmt_value(value: Any) -> str:
    """A metric or reward as a person reads it: four significant digits
    (scientific when very large or small), ``–`` for a missing or non-number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "–"
    v = float(value)
    if not math.isfinite(v):
        return "–"
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.3g}"
    return f"{v:.4g}"


# ----------------------------------------------------------------- rows


def sample_row(sample: Sample, tokenizer: Decoder | None) -> dict[str, Any]:
    """One merged sample: per token its id, text, loss weight (0 = context),
    rollout logprob (None where unknown), generating call (-1 = context) and
    the weight version that produced it."""
    tokens = [int(t) for t in sample.tokens]
    return {
        "tokens": tokens,
        "pieces": token_pieces(tokens, tokenizer),
        "weights": [float(w) for w in sample.weights],
        "logprobs": [finite(x) for x in sample.logprobs],
        "call_index": [int(c) for c in sample.call_index],
        "weight_version": [int(v) for v in sample.weight_version],
    }


def divergence_rows(merged: MergeResult, rollout_id: str) -> list[dict[str, Any]]:
    """Where a later call of the rollout left the path an earlier one generated,
    and why (``kind``)."""
    return [
        {
            "call_index": int(d.call_index),
            "left_call_index": int(d.left_call_index),
            "position": int(d.position),
            "kind": d.kind,
        }
        for d in merged.divergences
        if d.rollout_id == rollout_id
    ]


def trace_record(
    row: Mapping[str, Any], divergences: Iterable[Mapping[str, Any]], **meta: Any
) -> dict[str, Any]:
    """The ``traces.jsonl`` record of a sample row: ``meta`` (step, rollout id,
    reward, task, harness...), its pieces and weights, and ``divergences`` as
    ``{"position", "kind"}``."""
    return {
        **meta,
        "pieces": row["pieces"],
        "weights": row["weights"],
        "divergences": [{"position": int(d["position"]), "kind": d["kind"]} for d in divergences],
    }


# ----------------------------------------------------------------- drawing


def _check_trace(pieces: Sequence[str], weights: Sequence[float]) -> None:
    if len(pieces) != len(weights):
        raise ValueError(
            f"trace has {len(pieces)} pieces but {len(weights)} weights; they must be per token"
        )


def _marks(divergences: Iterable[Mapping[str, Any]]) -> dict[int, list[str]]:
    marks: dict[int, list[str]] = {}
    for d in divergences:
        pos = d.get("position")
        if isinstance(pos, int) and not isinstance(pos, bool):
            marks.setdefault(pos, []).append(str(d.get("kind", "unclassified")))
    return marks


def _runs(
    pieces: Sequence[str], weights: Sequence[float], marks: Mapping[int, list[str]]
) -> Iterable[tuple[str, Any]]:
    """Yield ("mark", kinds) at divergence positions and ("text", (generated,
    text, weight)) for maximal runs of tokens with the same weight."""
    run: list[str] = []
    run_w: float | None = None
    for i, (piece, w) in enumerate(zip(pieces, weights, strict=True)):
        w = float(w)
        if i in marks or (run_w is not None and w != run_w):
            if run:
                yield "text", (run_w is not None and run_w > 0, "".join(run), run_w)
            run, run_w = [], None
        if i in marks:
            yield "mark", marks[i]
        run.append(piece)
        run_w = w
    if run:
        yield "text", (run_w is not None and run_w > 0, "".join(run), run_w)
    tail = [k for pos, kinds in sorted(marks.items()) if pos >= len(pieces) for k in kinds]
    if tail:
        yield "mark", tail


ANSI_RESET = "\x1b[0m"
ANSI_GENERATED = "\x1b[1;32m"  # bold green: trained tokens
ANSI_CONTEXT = "\x1b[2m"  # dim: prompt, tool output, template
ANSI_DIVERGENCE = "\x1b[1;37;41m"  # white on red: a later call left this path here


def render_trace_terminal(
    pieces: Sequence[str],
    weights: Sequence[float],
    divergences: Iterable[Mapping[str, Any]] = (),
    *,
    color: bool = True,
) -> str:
    """A merged trace for the terminal: generated tokens (weight > 0) bold green,
    context dim, and a ``[↪ kind]`` marker before each divergence position.

    With ``color=False`` generated runs are wrapped in ``«…»`` instead."""
    _check_trace(pieces, weights)
    out: list[str] = []
    for what, value in _runs(pieces, weights, _marks(divergences)):
        if what == "mark":
            label = f"[↪ {', '.join(value)}]"
            out.append(f"{ANSI_DIVERGENCE}{label}{ANSI_RESET}" if color else label)
            continue
        generated, text, _ = value
        if color:
            style = ANSI_GENERATED if generated else ANSI_CONTEXT
            # Re-open the style after each newline so pagers that reset per line keep it.
            text = text.replace("\n", f"{ANSI_RESET}\n{style}")
            out.append(f"{style}{text}{ANSI_RESET}")
        else:
            out.append(f"«{text}»" if generated else text)
    return "".join(out)


def render_trace_html(
    pieces: Sequence[str], weights: Sequence[float], divergences: Iterable[Mapping[str, Any]] = ()
) -> str:
    """The trace body as HTML (every piece escaped)."""
    _check_trace(pieces, weights)
    out: list[str] = []
    for what, value in _runs(pieces, weights, _marks(divergences)):
        if what == "mark":
            kinds = html.escape(", ".join(value))
            out.append(f'<span class="div" title="divergence: {kinds}">↪ {kinds}</span>')
            continue
        generated, text, w = value
        if generated:
            title = f"generated (weight {w:g})"
            out.append(f'<span class="gen" title="{title}">{html.escape(text)}</span>')
        else:
            out.append(f'<span class="ctx">{html.escape(text)}</span>')
    return "".join(out)
