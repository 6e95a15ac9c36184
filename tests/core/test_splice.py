"""Splice: prompts that reuse earlier generations' exact ids."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import lightning
from tokenizer_fixtures import hf_ids, load_pair


def _turns(tok, user_texts, gens_text_ids):
    """A rollout: each call's prompt (spliced) and its sampled completion ids."""
    msgs, gens, prompts = [], [], []
    for user, completion in zip(user_texts, gens_text_ids, strict=True):
        msgs.append({"role": "user", "content": user})
        r = tok.splice(msgs, gens)
        prompts.append([int(x) for x in r.ids])
        gens.append(completion)
        msgs.append({"role": "assistant", "content": tok.decode(completion[:-1])})
    return msgs, gens, prompts


def test_splice_reuses_sampled_ids_and_extends_previous(smol):
    end = smol.token_to_id("<|im_end|>")
    sampled = [smol.token_to_id(t) for t in ("J", "apan", "ese")] + [end]
    other = [int(x) for x in smol.encode("Sure thing")] + [end]
    msgs, gens, prompts = _turns(smol, ["Language?", "Again?", "Bye"], [sampled, other, other])
    # Each prompt starts with the previous prompt + completion: one trie path.
    for i in range(1, len(prompts)):
        assert prompts[i][: len(prompts[i - 1]) + len(gens[i - 1])] == prompts[i - 1] + gens[i - 1]
    r = smol.splice(msgs, gens)
    assert smol.decode(r.ids) == smol.render_chat(msgs, add_generation_prompt=True)
    assert [s.generation for s in r.spliced] == [0, 1, 2] and r.unmatched == []
    for s in r.spliced:
        assert [int(x) for x in r.ids[s.token_start : s.token_end]] == gens[s.generation]
    # Plain tokenization would have re-merged "Japanese": the drift splice prevented.
    assert [s.plain_differs for s in r.spliced] == [True, False, False]
    assert r.prevented == 1


def test_splice_reports_rewritten_generations():
    tok, hf = load_pair("qwen2", "Qwen-Qwen3-0.6B.jinja")
    end = tok.token_to_id("<|im_end|>")
    gen = [int(x) for x in tok.encode("<think>\nhmm\n</think>\n\nFour.")] + [end]
    msgs = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": tok.decode(gen[:-1])},
        {"role": "user", "content": "3+3?"},
    ]
    r = tok.splice(msgs, [gen], protect_content=False)
    # Qwen3 strips the earlier reasoning: the generation is not in the render.
    assert r.unmatched == [0]
    assert tok.decode(r.ids) == tok.render_chat(msgs, add_generation_prompt=True)
    # Protected, `</think>` in the content is text, so Qwen3's split on it no
    # longer finds the tag and keeps the blank lines after it: transformers'
    # sanitize_control_tokens=True renders (and encodes) exactly the same.
    p = tok.splice(msgs, [gen])
    assert p.unmatched == [0] and "\n\n\nFour." in p.text
    want = hf_ids(hf, msgs, sanitize_control_tokens=True, add_generation_prompt=True)
    assert list(p.ids) == want


def test_splice_protects_content(smol):
    msgs = [{"role": "user", "content": "x <|im_end|> y"}]
    r = smol.splice(msgs, [])
    assert list(r.ids).count(smol.token_to_id("<|im_end|>")) == 2  # system + user, not the literal
    parity = smol.splice(msgs, [], protect_content=False)
    assert list(parity.ids) == list(smol.encode_chat(msgs, add_generation_prompt=True))


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    texts=st.lists(st.text(min_size=1, max_size=30), min_size=1, max_size=3),
    splits=st.lists(st.integers(1, 4), min_size=3, max_size=3),
)
# Found by CI: the assistant content "|" was located inside the `<|im_end|>`
# after "q0", so protect_content turned that control token into text.
@example(texts=["|", "0"], splits=[1, 1, 1])
@example(texts=["<|im_end|>", "im_end"], splits=[1, 1, 1])
def test_splice_property(smol, texts, splits):
    end = smol.token_to_id("<|im_end|>")
    gens = []
    for t, k in zip(texts, splits, strict=False):
        # Sample-like ids: encode pieces of the text separately (non-canonical).
        cut = max(1, len(t) // k)
        ids = [int(x) for i in range(0, len(t), cut) for x in smol.encode(t[i : i + cut])]
        gens.append([*ids, end])
    users = [f"q{i}" for i in range(len(gens))]
    msgs, gens, prompts = _turns(smol, users, gens)
    r = smol.splice(msgs, gens, protect_content=False)
    assert smol.decode(r.ids) == smol.render_chat(msgs, add_generation_prompt=True)
    for s in r.spliced:
        assert [int(x) for x in r.ids[s.token_start : s.token_end]] == gens[s.generation]
    # SmolLM2's template keeps history verbatim: every generation is found,
    # and each protected prompt extends the previous prompt + completion.
    assert r.unmatched == []
    for i in range(1, len(prompts)):
        n = len(prompts[i - 1]) + len(gens[i - 1])
        assert prompts[i][:n] == prompts[i - 1] + gens[i - 1]


def test_generation_matches_only_inside_assistant_turns(smol):
    end = smol.token_to_id("<|im_end|>")
    gen = [int(x) for x in smol.encode("lo")] + [end]
    msgs = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "lo"},
        {"role": "user", "content": "again"},
    ]
    r = smol.splice(msgs, [gen])
    # "lo<|im_end|>" also ends the user's "hello"; splicing there would put
    # sampled ids into the user's text. Only the assistant turn may take it.
    (s,) = r.spliced
    assert r.text[: s.byte_start].endswith("<|im_start|>assistant\n")
    assert list(r.ids) == list(smol.encode_chat(msgs, add_generation_prompt=True))


def test_literal_control_text_as_whole_content_is_protected(smol):
    start, end = smol.token_to_id("<|im_start|>"), smol.token_to_id("<|im_end|>")
    for content in ["<|im_end|>", "|", "user", "<|im_start|>assistant\n"]:
        msgs = [{"role": "user", "content": content}, {"role": "assistant", "content": content}]
        ids = list(smol.encode_chat(msgs, protect_content=True))
        # Only the template's own markup is control tokens: system, user, assistant.
        assert (ids.count(start), ids.count(end)) == (3, 3), content
        assert smol.decode(ids) == smol.render_chat(msgs)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    contents=st.lists(
        st.lists(
            st.sampled_from(["<|im_end|>", "<|im_start|>", "|", "<", ">", "im", "\n", "a", " "])
        ).map("".join),
        min_size=1,
        max_size=4,
    )
)
def test_protect_content_keeps_exactly_the_template_markup(smol, contents):
    """With protect_content, the control tokens are those of the same
    conversation with harmless content, whatever the content spells."""
    roles = ["user", "assistant"]
    msgs = [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]
    plain = [{"role": m["role"], "content": "x" if m["content"] else ""} for m in msgs]
    specials = {smol.token_to_id("<|im_start|>"), smol.token_to_id("<|im_end|>")}
    ids = list(smol.encode_chat(msgs, protect_content=True))
    ref = list(smol.encode_chat(plain, protect_content=False))
    assert [i for i in ids if i in specials] == [i for i in ref if i in specials]
    assert smol.decode(ids) == smol.render_chat(msgs)


def _control_ids(tok, ids):
    return [i for i in ids if tok.id_to_token(i) in CONTROL_TEXT]


CONTROL_TEXT = [
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]


@pytest.mark.parametrize(
    "stem,template",
    [
        ("llama-bpe", "meta-llama-Llama-3.1-8B-Instruct.jinja"),
        ("qwen2", "Qwen-Qwen2.5-7B-Instruct.jinja"),
    ],
)
@settings(max_examples=30, deadline=None)
@given(
    contents=st.lists(
        st.lists(
            st.sampled_from([*CONTROL_TEXT, "|", "<", "\n", " ", "a", "user"]), min_size=1
        ).map("".join),
        min_size=1,
        max_size=3,
    )
)
def test_protect_content_real_templates(stem, template, contents):
    """Llama 3.1 trims content (located through the trimmed marker walk);
    Qwen2.5 copies it. Either way content cannot add or cut a control token."""
    tok, _ = load_pair(stem, template)
    roles = ["user", "assistant"]
    msgs = [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]
    plain = [{"role": m["role"], "content": "x"} for m in msgs]
    ids = list(tok.encode_chat(msgs, protect_content=True))
    ref = list(tok.encode_chat(plain, protect_content=False))
    assert _control_ids(tok, ids) == _control_ids(tok, ref)
    assert tok.decode(ids) == tok.render_chat(msgs)


def test_protect_content_when_template_rewrites_content():
    """Qwen3 cuts earlier reasoning out of assistant content with
    `split('</think>')`. Protected, the `</think>` in the content is text, so
    the cut keeps the blank lines after it (as transformers' sanitize mode
    does); a "|" user message still cannot break `<|im_end|>`."""
    tok, hf = load_pair("qwen2", "Qwen-Qwen3-0.6B.jinja")
    end = tok.token_to_id("<|im_end|>")
    msgs = [
        {"role": "user", "content": "a <|im_end|> b"},
        {"role": "assistant", "content": "<think>\nr\n</think>\n\nok"},
        {"role": "user", "content": "|"},
    ]
    text = tok.render_chat(msgs)
    assert "<think>" not in text  # the template did rewrite the content
    ids = list(tok.encode_chat(msgs, protect_content=True))
    assert ids.count(end) == 3 and tok.decode(ids) == text.replace("\nok", "\n\n\nok")
    assert ids == hf_ids(hf, msgs, sanitize_control_tokens=True)
    assert list(tok.encode_chat(msgs, protect_content=False)).count(end) == 4


PROTECT_PAIRS = [
    ("qwen2", "Qwen-Qwen2.5-7B-Instruct.jinja"),
    ("qwen2", "Qwen-Qwen3-0.6B.jinja"),
    ("llama-bpe", "meta-llama-Llama-3.1-8B-Instruct.jinja"),
    ("phi-3", "microsoft-Phi-3.5-mini-instruct.jinja"),
]
_piece = st.sampled_from(
    [
        *CONTROL_TEXT,
        "<|endoftext|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "<|end|>",
        "<|user|>",
        "\U000f0000",  # the markers themselves cannot forge a protected token
        "\U000f0001",
        "|",
        "<",
        "\n",
        " ",
        "a",
        "user",
    ]
)
_content = st.lists(_piece, max_size=6).map("".join)


@pytest.mark.parametrize(("stem", "template"), PROTECT_PAIRS)
@settings(max_examples=25, deadline=None)
@given(contents=st.lists(_content, min_size=1, max_size=4), arg=_content, desc=_content)
def test_protect_content_equals_transformers_sanitize(stem, template, contents, arg, desc):
    """protect_content=True gives the ids of transformers'
    `apply_chat_template(..., sanitize_control_tokens=True)`: control tokens
    in any input string (contents, tool-call arguments, tool descriptions)
    stay text, the template's markup stays control tokens."""
    tok, hf = load_pair(stem, template)
    roles = ["user", "assistant"]
    msgs = [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]
    call = {"type": "function", "function": {"name": "f", "arguments": {"q": arg}}}
    msgs += [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": arg},
    ]
    tools = [
        {
            "type": "function",
            "function": {"name": "f", "description": desc, "parameters": {"type": "object"}},
        }
    ]
    kw = {"add_generation_prompt": True, "date_string": "26 Jul 2024"}
    try:
        want = hf_ids(hf, msgs, sanitize_control_tokens=True, tools=tools, **kw)
    except Exception:  # the template rejects the conversation
        with pytest.raises(lightning.LightningError):
            tok.encode_chat(msgs, tools=tools, protect_content=True, **kw)
        return
    assert list(tok.encode_chat(msgs, tools=tools, protect_content=True, **kw)) == want
    r = tok.splice(msgs, [], tools=tools, **kw)
    assert list(r.ids) == want


def test_protect_normalized_added_token(tmp_path):
    """A control token added with normalized=True (transformers' default for
    non-special tokens) is matched after normalization; protected text must
    still encode it as text, as transformers' sanitize mode does."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from lightning.model_cache import smollm2_dir

    hf = AutoTokenizer.from_pretrained(smollm2_dir())
    hf.add_tokens([AddedToken("<tool>", normalized=True, special=False)])
    hf.chat_template = "{% for m in messages %}<tool>{{ m.content }}\n{% endfor %}"
    hf.save_pretrained(tmp_path)
    tok = lightning.Tokenizer.from_dir(tmp_path)
    assert not tok.word_path  # normalized added tokens span the words it would cut
    tool = tok.token_to_id("<tool>")
    msgs = [{"role": "user", "content": "a <tool> b<tool>"}]
    assert list(tok.encode_chat(msgs)) == hf_ids(hf, msgs)
    protected = list(tok.encode_chat(msgs, protect_content=True))
    assert protected.count(tool) == 1  # the template's own
    assert protected == hf_ids(hf, msgs, sanitize_control_tokens=True)
