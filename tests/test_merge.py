"""lightning.merge_calls: the radix-trie merge seen from Python."""

from __future__ import annotations

import numpy as np
import pytest

import lightning
from lightning import Call, merge_calls


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
