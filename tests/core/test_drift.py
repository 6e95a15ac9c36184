"""Drift classification: one regression test per class, each built from a real
template and tokenizer (SmolLM2, Qwen2.5, Qwen3, Llama 3.1)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lightning
from tokenizer_fixtures import load_pair


def ids(tok, text):
    return [int(x) for x in tok.encode(text)]


def prompt(tok, msgs, **kw):
    return [int(x) for x in tok.encode_chat(msgs, add_generation_prompt=True, **kw)]


def test_match_when_next_extends(smol):
    m1 = [{"role": "user", "content": "Hi"}]
    prev = prompt(smol, m1) + ids(smol, "Hello!") + [smol.token_to_id("<|im_end|>")]
    m2 = [*m1, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    d = lightning.classify_drift(np.array(prev, dtype=np.uint32), prompt(smol, m2), smol)
    assert d.kind == "match"


def test_retokenization_japanese(smol):
    # A sampled, non-canonical split (J + apan + ese) that re-encodes as one token.
    sampled = [smol.token_to_id(t) for t in ("J", "apan", "ese")]
    assert None not in sampled and smol.decode(sampled) == "Japanese"
    assert ids(smol, "Japanese") != sampled
    m1 = [{"role": "user", "content": "Which language?"}]
    prev = prompt(smol, m1) + sampled + [smol.token_to_id("<|im_end|>")]
    m2 = [*m1, {"role": "assistant", "content": "Japanese"}, {"role": "user", "content": "ok"}]
    d = lightning.classify_drift(prev, prompt(smol, m2), smol)
    assert d.kind == "retokenization"
    assert d.position == len(prompt(smol, m1))


def test_retokenization_a_ma(smol):
    # `Ġa, ma` sampled where the tokenizer prefers `Ġam, a`.
    sampled = [smol.token_to_id("Ġa"), smol.token_to_id("ma")]
    assert None not in sampled and smol.decode(sampled) == " ama"
    m1 = [{"role": "user", "content": "Say it"}]
    text = "I" + smol.decode(sampled)
    completion = ids(smol, "I") + sampled + [smol.token_to_id("<|im_end|>")]
    m2 = [*m1, {"role": "assistant", "content": text}, {"role": "user", "content": "again"}]
    nxt = prompt(smol, m2)
    if nxt[len(prompt(smol, m1)) :][: len(completion) - 1] == completion[:-1]:
        pytest.skip("this vocab encodes ' ama' as sampled")
    d = lightning.classify_drift(prompt(smol, m1) + completion, nxt, smol)
    assert d.kind == "retokenization"


def test_reasoning_stripped_qwen3():
    tok, _ = load_pair("qwen2", "Qwen-Qwen3-0.6B.jinja")
    m1 = [{"role": "user", "content": "What is 2+2?"}]
    gen = "<think>\nAdd them.\n</think>\n\nIt is 4."
    prev = prompt(tok, m1) + ids(tok, gen) + [tok.token_to_id("<|im_end|>")]
    m2 = [*m1, {"role": "assistant", "content": gen}, {"role": "user", "content": "And 3+3?"}]
    assert "Add them" not in tok.render_chat(m2, add_generation_prompt=True)
    d = lightning.classify_drift(prev, prompt(tok, m2), tok)
    assert d.kind == "reasoning_stripped", d.detail


def test_tool_call_reserialized_qwen25():
    tok, _ = load_pair("qwen2", "Qwen-Qwen2.5-7B-Instruct.jinja")
    m1 = [{"role": "user", "content": "Weather in Paris?"}]
    # The model wrote compact JSON; the template re-serializes with tojson.
    gen = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    prev = prompt(tok, m1) + ids(tok, gen) + [tok.token_to_id("<|im_end|>")]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    m2 = [
        *m1,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "21C"},
    ]
    d = lightning.classify_drift(prev, prompt(tok, m2), tok)
    assert d.kind == "tool_call_reserialized", d.detail


def test_separator_llama31_trims_content():
    tok, _ = load_pair("llama-bpe", "meta-llama-Llama-3.1-8B-Instruct.jinja")
    kw = {"date_string": "26 Jul 2024"}
    m1 = [{"role": "user", "content": "Hi"}]
    gen = "Hello there \n"
    prev = prompt(tok, m1, **kw) + ids(tok, gen) + [tok.token_to_id("<|eot_id|>")]
    m2 = [*m1, {"role": "assistant", "content": gen}, {"role": "user", "content": "Bye"}]
    d = lightning.classify_drift(prev, prompt(tok, m2, **kw), tok)
    assert d.kind == "separator", d.detail


def test_truncated_llama31_cut_completion():
    tok, _ = load_pair("llama-bpe", "meta-llama-Llama-3.1-8B-Instruct.jinja")
    kw = {"date_string": "26 Jul 2024"}
    m1 = [{"role": "user", "content": "Count"}]
    gen = "one, two, three, "  # max_tokens hit: no <|eot_id|>
    prev = prompt(tok, m1, **kw) + ids(tok, gen)
    m2 = [*m1, {"role": "assistant", "content": gen}, {"role": "user", "content": "go on"}]
    d = lightning.classify_drift(prev, prompt(tok, m2, **kw), tok)
    assert d.kind == "truncated", d.detail


def test_compacted_smollm2_summary(smol):
    m1 = [
        {"role": "user", "content": "Tell me about the history of Rome in detail."},
        {"role": "assistant", "content": "Rome was founded, grew into an empire and fell."},
        {"role": "user", "content": "And Carthage?"},
    ]
    prev = (
        prompt(smol, m1) + ids(smol, "Carthage was its rival.") + [smol.token_to_id("<|im_end|>")]
    )
    m2 = [
        {"role": "system", "content": "Summary so far: the user asked about ancient cities."},
        {"role": "user", "content": "Now Athens?"},
    ]
    d = lightning.classify_drift(prev, prompt(smol, m2), smol)
    assert d.kind == "compacted", d.detail


def test_other_edited_history(smol):
    m1 = [{"role": "user", "content": "What is 2+2?"}]
    prev = prompt(smol, m1) + ids(smol, "4") + [smol.token_to_id("<|im_end|>")]
    m2 = [
        {"role": "user", "content": "What is 3+1?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Sure?"},
    ]
    d = lightning.classify_drift(prev, prompt(smol, m2), smol)
    assert d.kind == "other", d.detail


def test_streamed_tool_argument_split(qwen_tok=None):
    # A streamed argument that arrived as "Par" + "is": the sampled ids differ
    # from the canonical encoding of "Paris", the text does not.
    tok, _ = load_pair("qwen2", "Qwen-Qwen2.5-7B-Instruct.jinja")
    m1 = [{"role": "user", "content": "Weather?"}]
    head = ids(tok, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "')
    split = ids(tok, "Par") + ids(tok, "is")
    tail = ids(tok, '"}}\n</tool_call>')
    gen = head + split + tail
    text = tok.decode(gen)
    m2 = [*m1, {"role": "assistant", "content": text}, {"role": "user", "content": "thanks"}]
    prev = prompt(tok, m1) + gen + [tok.token_to_id("<|im_end|>")]
    d = lightning.classify_drift(prev, prompt(tok, m2), tok)
    assert d.kind == "retokenization", d.detail


def test_merge_calls_fills_divergence_kind(smol):
    sampled = [smol.token_to_id(t) for t in ("J", "apan", "ese")] + [smol.token_to_id("<|im_end|>")]
    m1 = [{"role": "user", "content": "Which language?"}]
    m2 = [*m1, {"role": "assistant", "content": "Japanese"}, {"role": "user", "content": "ok"}]
    u32 = lambda x: np.asarray(x, dtype=np.uint32)  # noqa: E731
    calls = [
        lightning.Call("r", u32(prompt(smol, m1)), u32(sampled)),
        lightning.Call("r", u32(prompt(smol, m2)), u32(ids(smol, "Bye") + sampled[-1:])),
    ]
    plain = lightning.merge_calls(calls)
    assert [d.kind for d in plain.divergences] == ["unclassified"]
    classified = lightning.merge_calls(calls, tokenizer=smol)
    assert [d.kind for d in classified.divergences] == ["retokenization"]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    user=st.text(min_size=1, max_size=20),
    pieces=st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=4),
    follow=st.text(min_size=1, max_size=20),
)
def test_kept_history_is_match_or_retokenization(smol, user, pieces, follow):
    """SmolLM2's template keeps history verbatim, so a next prompt can only
    extend the context (`match`) or re-encode the same text (`retokenization`,
    e.g. a sample split as "J" + "apan" + "ese"); the verdict says where."""
    sampled = [i for p in pieces for i in ids(smol, p)]  # a non-canonical split
    end = smol.token_to_id("<|im_end|>")
    m1 = [{"role": "user", "content": user}]
    prev = prompt(smol, m1) + sampled + [end]
    text = smol.decode(sampled)
    m2 = [*m1, {"role": "assistant", "content": text}, {"role": "user", "content": follow}]
    nxt = prompt(smol, m2)
    d = lightning.classify_drift(prev, nxt, smol)
    first = next((k for k, (a, b) in enumerate(zip(prev, nxt, strict=False)) if a != b), len(prev))
    if nxt[: len(prev)] == prev:
        assert d.kind == "match"
    else:
        assert d.kind == "retokenization", (d.kind, d.detail)
        assert d.position == first
        assert smol.decode(nxt).startswith(smol.decode(prev))
