"""Splice: prompts that reuse earlier generations' exact ids."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenizer_fixtures import load_pair


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
    tok, _ = load_pair("qwen2", "Qwen-Qwen3-0.6B.jinja")
    end = tok.token_to_id("<|im_end|>")
    gen = [int(x) for x in tok.encode("<think>\nhmm\n</think>\n\nFour.")] + [end]
    msgs = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": tok.decode(gen[:-1])},
        {"role": "user", "content": "3+3?"},
    ]
    r = tok.splice(msgs, [gen])
    # Qwen3 strips the earlier reasoning: the generation is not in the render.
    assert r.unmatched == [0]
    assert tok.decode(r.ids) == tok.render_chat(msgs, add_generation_prompt=True)


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
    for i in range(1, len(prompts)):
        n = len(prompts[i - 1]) + len(gens[i - 1])
        if len(r.spliced) == len(gens):
            assert prompts[i][:n] == prompts[i - 1] + gens[i - 1]
