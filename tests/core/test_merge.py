"""lightning.merge_calls: the radix-trie merge seen from Python."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lightning
import reference
from lightning import Call, merge_calls
from reference import RefCall


def test_linear_conversation_is_one_sample() -> None:
    system = [1, 2, 3]
    c0 = Call("r", system, [10, 11], logprobs=[-0.5, -0.25])
    c1 = Call("r", [*system, 10, 11, 20, 21], [30, 31, 32], logprobs=[-1.0, -2.0, -3.0])
    res = merge_calls([c0, c1])
    assert len(res.samples) == 1
    s = res.samples[0]
    assert s.rollout_id == "r"
    assert s.tokens.dtype == np.uint32
    assert s.tokens.tolist() == [1, 2, 3, 10, 11, 20, 21, 30, 31, 32]
    assert s.weights.tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    assert s.call_index.tolist() == [-1, -1, -1, 0, 0, -1, -1, 1, 1, 1]
    lp = s.logprobs
    assert np.isnan(lp[:3]).all() and np.isnan(lp[5:7]).all()
    assert lp[[3, 4, 7, 8, 9]].tolist() == [-0.5, -0.25, -1.0, -2.0, -3.0]
    assert res.divergences == []
    assert res.stats.samples == 1 and res.stats.generated_tokens == 5


def test_branch_reports_divergence_and_trains_each_token_once() -> None:
    c0 = Call("r", [1, 2], [3, 4])
    c1 = Call("r", [1, 2, 3, 9], [5])  # the history token 4 was rewritten to 9
    res = merge_calls([c0, c1])
    assert [s.tokens.tolist() for s in res.samples] == [[1, 2, 3, 4], [1, 2, 3, 9, 5]]
    assert [s.weights.tolist() for s in res.samples] == [[0, 0, 1, 1], [0, 0, 0, 0, 1]]
    (d,) = res.divergences
    assert (d.rollout_id, d.call_index, d.position, d.left_call_index, d.kind) == (
        "r",
        1,
        3,
        0,
        "unclassified",
    )


def test_rollouts_grouped_in_first_appearance_order() -> None:
    calls = [Call("b", [1], [2]), Call("a", [1], [3]), Call("b", [1, 2, 4], [5])]
    res = merge_calls(calls)
    assert [s.rollout_id for s in res.samples] == ["b", "a"]
    assert res.samples[0].call_index.tolist() == [-1, 0, -1, 2]
    assert res.samples[1].call_index.tolist() == [-1, 1]


def test_duplicate_calls_weigh_twice() -> None:
    res = merge_calls([Call("r", [1], [2, 3]), Call("r", [1], [2, 3])])
    assert len(res.samples) == 1
    assert res.samples[0].weights.tolist() == [0, 2, 2]
    assert res.stats.duplicates == 1


def test_numpy_uint32_input_is_not_copied() -> None:
    ids = np.array([5, 6, 7], dtype=np.uint32)
    c = Call("r", ids, np.array([8], dtype=np.int64))
    assert c.prompt_ids is ids
    assert c.completion_ids.dtype == np.uint32
    assert not c.completion_ids.flags.writeable


def test_max_tokens_reports_what_it_cut() -> None:
    res = merge_calls([Call("r", [1, 2], [3, 4, 5])], max_tokens=3)
    (s,) = res.samples
    assert s.tokens.tolist() == [1, 2, 3]
    assert s.truncated == 2
    assert res.stats.truncated_tokens == 2


def test_packed_across_rollouts_shares_group_prompt() -> None:
    calls = [
        Call("r1", [1, 2, 3], [4], group="g"),
        Call("r2", [1, 2, 3], [5], group="g"),
        Call("r3", [1, 2, 3], [6]),
    ]
    res = merge_calls(calls)
    assert [s.group for s in res.samples] == ["g", "g", None]
    per = res.packed()
    assert len(per) == 12 and per.tree_keys == ["r1", "r2", "r3"]
    tree = res.packed(across_rollouts=True)
    assert tree.tree_keys == ["g", "r3"]
    assert tree.tokens.tolist() == [1, 2, 3, 4, 5, 1, 2, 3, 6]
    assert tree.parent.tolist() == [-1, 0, 1, 2, 2, -1, 5, 6, 7]
    assert tree.depth.tolist() == [0, 1, 2, 3, 3, 0, 1, 2, 3]
    assert tree.weights.tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 1]
    assert tree.gen_offsets.tolist() == [0, 0, 0, 0, 1, 2, 2, 2, 2, 3]
    assert tree.gen_call.tolist() == [0, 1, 2]
    assert tree.tree_offsets.tolist() == [0, 5, 9]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: Call("r", [1], [2], logprobs=[0.0, 1.0]), "call 0: .*logprobs has 2 entries"),
        (lambda: Call("r", [1], []), "call 0: .*empty completion"),
    ],
)
def test_bad_calls_name_the_index(call, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        merge_calls([call()])


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([1, 2**32], r"completion_ids\[1\] = 4294967296 is outside the uint32"),
        ([1, -1], r"completion_ids\[1\] = -1 is outside"),
        ([1.5], r"completion_ids\[0\] = 1.5 \(float\) is not an integer"),
        (np.array([1.0]), "dtype float64; token ids must be integers"),
        (np.array([3, -2], dtype=np.int64), r"completion_ids\[1\] = -2 is outside"),
    ],
)
def test_bad_ids_raise_value_error(ids, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(lightning.InvalidCallError, match=match):
        Call("r", [1], ids)


def test_invalid_call_error_is_value_and_lightning_error() -> None:
    assert issubclass(lightning.InvalidCallError, ValueError)
    assert issubclass(lightning.InvalidCallError, lightning.LightningError)


def test_non_call_input_is_type_error() -> None:
    with pytest.raises(TypeError, match=r"calls\[0\] is a dict"):
        merge_calls([{}])  # type: ignore[list-item]


# --- properties against tests/support/reference.py -------------------------------------------

TOK = st.integers(0, 4)  # a tiny alphabet, so paths collide and branch often
LOGPROB = st.floats(-8.0, 0.0, width=32)
OPS = ("linear", "observe", "edit", "strip", "branch", "duplicate", "subagent")


@st.composite
def rollout(draw: st.DrawFn, rollout_id: str, group: str | None, ops: tuple[str, ...] = OPS):
    """Calls of one multi-turn rollout: every prompt carries the history so far,
    with observations between turns, edited or stripped histories, branches back
    to an earlier point, sub-agents with their own prompt, and exact repeats."""
    history = draw(st.lists(TOK, max_size=6))
    calls: list[RefCall] = []
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(ops))
        if op == "duplicate" and calls:
            calls.append(draw(st.sampled_from(calls)))
            continue
        prompt = list(history)
        if op == "observe":
            prompt += draw(st.lists(TOK, min_size=1, max_size=4))
        elif op == "edit" and prompt:
            prompt[draw(st.integers(0, len(prompt) - 1))] = draw(TOK)
        elif op == "strip" and prompt:
            i = draw(st.integers(0, len(prompt) - 1))
            del prompt[i : draw(st.integers(i + 1, len(prompt)))]
        elif op == "branch":
            prompt = prompt[: draw(st.integers(0, len(prompt)))]
        elif op == "subagent":
            prompt = draw(st.lists(TOK, max_size=6))
        completion = draw(st.lists(TOK, min_size=1, max_size=5))
        logprobs = draw(
            st.none() | st.lists(LOGPROB, min_size=len(completion), max_size=len(completion))
        )
        calls.append(RefCall(rollout_id, prompt, completion, logprobs, group))
        if op != "subagent":
            history = prompt + completion
    return calls


@st.composite
def traces(draw: st.DrawFn, ops: tuple[str, ...] = OPS) -> list[RefCall]:
    """Several rollouts, some sharing a GRPO group, interleaved in input order."""
    n = draw(st.integers(1, 4))
    groups = [draw(st.sampled_from([None, "g0", "g1"])) for _ in range(n)]
    per = [draw(rollout(f"r{i}", groups[i], ops)) for i in range(n)]
    # Interleave while keeping each rollout's own order.
    order = draw(st.permutations([i for i, calls in enumerate(per) for _ in calls]))
    cursors = [0] * n
    out = []
    for i in order:
        out.append(per[i][cursors[i]])
        cursors[i] += 1
    return out


def to_calls(ref: list[RefCall], as_numpy: bool) -> list[Call]:
    def ids(x: list[int]) -> Any:
        return np.array(x, dtype=np.uint32) if as_numpy else x

    return [
        Call(c.rollout_id, ids(c.prompt), ids(c.completion), logprobs=c.logprobs, group=c.group)
        for c in ref
    ]


def same_floats(a: np.ndarray, b: list[float]) -> bool:
    return np.array_equal(a, np.array(b, dtype=np.float32), equal_nan=True)


def assert_samples_equal(got: Sequence[lightning.Sample], want: Sequence[Any]) -> None:
    """Samples against `reference.merge`'s, field by field."""
    assert len(got) == len(want)
    for s, w in zip(got, want, strict=True):
        assert (s.rollout_id, s.group, s.truncated) == (w.rollout_id, w.group, w.truncated)
        assert s.tokens.tolist() == w.tokens
        assert s.weights.tolist() == w.weights
        assert s.call_index.tolist() == w.call_index
        assert same_floats(s.logprobs, w.logprobs)


@settings(max_examples=200, deadline=None)
@given(traces(), st.none() | st.integers(1, 20), st.booleans())
def test_merge_matches_reference(
    ref: list[RefCall], max_tokens: int | None, as_numpy: bool
) -> None:
    got = merge_calls(to_calls(ref, as_numpy), max_tokens)
    want = reference.merge(ref, max_tokens)
    assert_samples_equal(got.samples, want.samples)
    divs = [(d.rollout_id, d.call_index, d.position, d.left_call_index) for d in got.divergences]
    assert divs == want.divergences
    assert all(d.kind == "unclassified" for d in got.divergences)
    assert got.stats.as_dict() == {**want.stats, "skipped_calls": 0}


def assert_packed_equal(got: lightning.PackedTree, want: Any) -> None:
    """A packed tree against `reference.pack`'s, array by array."""
    assert got.tokens.tolist() == want.tokens
    assert got.parent.tolist() == want.parent
    assert got.depth.tolist() == want.depth
    assert got.weights.tolist() == want.weights
    assert same_floats(got.logprobs, want.logprobs)
    offsets = got.gen_offsets.tolist()
    gens = [got.gen_call[a:b].tolist() for a, b in itertools.pairwise(offsets)]
    assert gens == want.gens
    assert got.tree_keys == want.tree_keys
    assert got.tree_offsets.tolist() == want.tree_offsets


@settings(max_examples=150, deadline=None)
@given(traces(), st.none() | st.integers(1, 20), st.booleans())
def test_packed_matches_reference(ref: list[RefCall], max_tokens: int | None, across: bool) -> None:
    got = merge_calls(to_calls(ref, True), max_tokens).packed(across_rollouts=across)
    assert_packed_equal(got, reference.pack(ref, max_tokens, across))


def spoil(res: lightning.MergeResult, tree: lightning.PackedTree) -> None:
    """Overwrite every output array of a result with junk, so a later result written
    into the same (pooled) memory would show any element it failed to write."""
    for s in res.samples:
        s.tokens[:] = 0xFFFF_FFFF
        s.weights[:] = -3.0
        s.logprobs[:] = 7.0
        s.call_index[:] = -9
    for name in ("tokens", "parent", "depth", "weights", "logprobs", "gen_offsets", "gen_call"):
        getattr(tree, name)[:] = 0x7777
    for name in ("rollout", "group", "weight_version"):
        getattr(tree, name)[:] = 0x7777


@settings(max_examples=100, deadline=None)
@given(traces(), traces(), st.booleans(), st.none() | st.integers(1, 20), st.booleans())
def test_reused_arrays_never_show_an_earlier_result(
    other: list[RefCall], ref: list[RefCall], same: bool, max_tokens: int | None, across: bool
) -> None:
    # The first result's arrays, spoiled, go back to the pool when it is dropped;
    # the second result is written into them and must still equal the reference.
    # With the same calls first every array is reused at its exact size; with
    # other calls, those of up to twice the size asked for.
    lightning.release_merge_buffers()
    old = merge_calls(to_calls(ref if same else other, True))
    spoil(old, old.packed(across_rollouts=across))
    del old
    res = merge_calls(to_calls(ref, True), max_tokens)
    tree = res.packed(across_rollouts=across)
    assert_packed_equal(tree, reference.pack(ref, max_tokens, across))
    context = tree.weights == 0
    assert (tree.rollout[context] == -1).all() and (tree.weight_version[context] == -1).all()
    assert set(tree.rollout[~context].tolist()) <= set(range(len(tree.rollout_ids)))
    assert set(tree.group.tolist()) <= set(range(-1, len(tree.groups)))
    assert_samples_equal(res.samples, reference.merge(ref, max_tokens).samples)


def test_dropped_results_leave_their_arrays_for_the_next() -> None:
    calls = [Call("r", list(range(1000)), [5, 6], logprobs=[-0.1, -0.2])]
    lightning.release_merge_buffers()
    res = merge_calls(calls)
    tree, samples = res.packed(), res.samples
    assert lightning.release_merge_buffers() == 0  # all still in use
    del res, samples
    # The samples' four arrays of 1,002 elements (4 bytes each) are free now.
    assert lightning.release_merge_buffers() == 4 * 1002 * 4
    view = tree.tokens[:10]
    del tree
    # The tree's other token-length arrays are free; `view` keeps `tokens`:
    # parent, depth and weight_version (8 bytes a token), weights, logprobs, rollout
    # and group (4), gen_offsets (1,003 x 8) and gen_call (2 generated tokens x 4).
    assert lightning.release_merge_buffers() == 1002 * (3 * 8 + 4 * 4) + 1003 * 8 + 2 * 4
    assert view.tolist() == list(range(10))
    del view
    assert lightning.release_merge_buffers() == 1002 * 4
    assert lightning.release_merge_buffers() == 0


# The invariants, checked directly (without the reference).


@settings(max_examples=150, deadline=None)
@given(traces())
def test_invariants(ref: list[RefCall]) -> None:
    res = merge_calls(to_calls(ref, False))
    samples = [(s.rollout_id, tuple(s.tokens.tolist())) for s in res.samples]
    # Every call's full sequence is a prefix of some sample of its rollout...
    for c in ref:
        assert any(r == c.rollout_id and t[: len(c.seq)] == c.seq for r, t in samples)
    # ...and every sample is a path some call produced.
    for r, t in samples:
        assert any(c.rollout_id == r and c.seq == t for c in ref)
    # The weighted multiset of generated (rollout, position, token) over all samples
    # is exactly what the calls generated.
    trained: Counter[tuple[str, int, int]] = Counter()
    for s in res.samples:
        for pos in np.flatnonzero(s.weights):
            trained[(s.rollout_id, int(pos), int(s.tokens[pos]))] += int(s.weights[pos])
    generated = Counter(
        (c.rollout_id, len(c.prompt) + i, t) for c in ref for i, t in enumerate(c.completion)
    )
    assert trained == generated
    # Trained tokens name a call that generated that token there, with that
    # prefix, and carry its logprob when it has them.
    for s in res.samples:
        toks = s.tokens.tolist()
        for pos in np.flatnonzero(s.weights):
            c = ref[int(s.call_index[pos])]
            assert c.rollout_id == s.rollout_id
            assert len(c.prompt) <= pos < len(c.seq) and c.seq[: pos + 1] == tuple(toks[: pos + 1])
            if c.logprobs is not None:
                assert s.logprobs[pos] == np.float32(c.logprobs[pos - len(c.prompt)])
        assert (s.call_index[s.weights == 0] == -1).all()
    # Packed-tree paths reproduce the samples, and its weights are theirs summed.
    tree = res.packed()
    paths = {}
    for i in range(len(tree)):
        path, j = [], i
        while j >= 0:
            path.append(int(tree.tokens[j]))
            j = int(tree.parent[j])
        paths[tuple(reversed(path))] = i
    for _, t in samples:
        assert t in paths
    assert tree.weights.sum() == sum(s.weights.sum() for s in res.samples)


@settings(max_examples=100, deadline=None)
@given(traces(ops=("linear", "observe")))
def test_linear_rollout_is_one_sample(ref: list[RefCall]) -> None:
    res = merge_calls(to_calls(ref, True))
    last = {c.rollout_id: c for c in ref}
    assert [s.rollout_id for s in res.samples] == list(last)
    for s in res.samples:
        assert tuple(s.tokens.tolist()) == last[s.rollout_id].seq
    assert res.divergences == []
