"""lightning.traces: a merged rollout as a person reads it (rows, per-token
text, and its drawing for a terminal and for HTML)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning import Call, merge_calls, traces

PIECES = ["<s>", "Q", ":", " 2+2", "\n", "A", ":", " 4"]
WEIGHTS = [0, 0, 0, 0, 0, 0, 0, 1.0]


def test_render_trace_terminal_colours_generated_and_marks_divergences() -> None:
    out = traces.render_trace_terminal(PIECES, WEIGHTS, [{"position": 5, "kind": "template"}])
    assert f"{traces.ANSI_GENERATED} 4{traces.ANSI_RESET}" in out
    assert f"{traces.ANSI_CONTEXT}<s>Q: 2+2" in out
    assert f"{traces.ANSI_DIVERGENCE}[↪ template]{traces.ANSI_RESET}" in out
    # The marker sits right before the divergent position.
    assert out.index("[↪ template]") < out.index("A:")
    # Stripping the escapes gives the text back, plus the marker.
    import re

    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    assert plain == "<s>Q: 2+2\n[↪ template]A: 4"


def test_render_trace_terminal_plain_and_errors() -> None:
    out = traces.render_trace_terminal(PIECES, WEIGHTS, [], color=False)
    assert out == "<s>Q: 2+2\nA:« 4»" and "\x1b" not in out
    # Divergence at the very end (a call that only extended the path) still shows.
    out = traces.render_trace_terminal(
        ["a"], [1.0], [{"position": 1, "kind": "other"}], color=False
    )
    assert out == "«a»[↪ other]"
    with pytest.raises(ValueError, match="2 pieces but 1 weights"):
        traces.render_trace_terminal(["a", "b"], [0.0])


def test_decode_pieces_round_trips_with_real_tokenizer() -> None:
    from lightning import model_cache as models
    from lightning.data.files import load_tokenizer

    # The built model dir, without paying for smollm2_dir()'s torch import when it exists.
    built = models.cache_dir() / "models" / "smollm2-135m-instruct"
    tok = load_tokenizer(built if (built / "tokenizer.json").exists() else models.smollm2_dir())
    text = "Héllo wörld — 17 + 25 = 42 ✅ 你好世界 🙂 the end, with  double  spaces."
    ids = tok.encode(text, add_special_tokens=False).ids
    pieces = traces.decode_pieces(ids, tok.decode)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert "" in pieces  # the emoji/CJK bytes span several tokens


class Chars:
    """A decoder that maps id i to chr(i) (concatenation is exact)."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def test_rows_of_a_branched_rollout() -> None:
    """A later call that rewrote history: two samples, one divergence, each row
    carrying what the merge says per token."""
    c0 = Call("r", [104, 105], [33, 63], logprobs=[-0.5, -1.0], weight_version=2)
    c1 = Call("r", [104, 105, 33, 120], [46], weight_version=3)
    other = Call("x", [1], [2])
    merged = merge_calls([c0, c1, other])
    rows = [traces.sample_row(s, Chars()) for s in merged.samples if s.rollout_id == "r"]
    assert [r["tokens"] for r in rows] == [[104, 105, 33, 63], [104, 105, 33, 120, 46]]
    assert [r["pieces"] for r in rows] == [list("hi!?"), list("hi!x.")]
    assert rows[0]["weights"] == [0.0, 0.0, 1.0, 1.0] and rows[1]["weights"][-1] == 1.0
    assert rows[0]["logprobs"] == [None, None, -0.5, -1.0]  # NaN (unknown) is None
    assert rows[1]["logprobs"][-1] is None  # the second call recorded none
    assert rows[0]["call_index"] == [-1, -1, 0, 0] and rows[1]["call_index"][-1] == 1
    assert rows[1]["weight_version"][-1] == 3
    divs = traces.divergence_rows(merged, "r")
    assert divs == [{"call_index": 1, "left_call_index": 0, "position": 3, "kind": "unclassified"}]
    assert traces.divergence_rows(merged, "x") == []
    record = traces.trace_record(rows[1], divs, step=4, rollout_id="r")
    assert record == {
        "step": 4,
        "rollout_id": "r",
        "pieces": list("hi!x."),
        "weights": rows[1]["weights"],
        "divergences": [{"position": 3, "kind": "unclassified"}],
    }
    # What the report draws from the record: the generated token set apart.
    assert (
        traces.render_trace_terminal(
            record["pieces"], record["weights"], record["divergences"], color=False
        )
        == "hi![↪ unclassified]x«.»"
    )


def test_token_pieces_without_a_tokenizer_are_ids() -> None:
    assert traces.token_pieces(np.array([7, 300], np.uint32), None) == ["⟨7⟩", "⟨300⟩"]
    assert traces.token_pieces([104, 105], Chars()) == ["h", "i"]


@pytest.mark.parametrize(
    "value, text",
    [(0.5, "0.5"), (2 / 3, "0.6667"), (123456.0, "1.23e+05"), (0.0001234, "0.000123"),
     (0, "0"), (None, "–"), (math.nan, "–"), (True, "–"), ("1", "–")],
)  # fmt: skip
def test_fmt_value(value: object, text: str) -> None:
    assert traces.fmt_value(value) == text
