"""The sampler's filters against a plain reference, and the reported-logprob modes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning.engine.sampling import SamplingParams, filtered_logits, sample_row, sample_rows


def reference_filter(logits: list[float], temperature: float, top_k: int, top_p: float) -> set[int]:
    """Which tokens survive temperature -> top-k -> top-p, by sorting in plain Python."""
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = set(order)
    if 0 < top_k < len(scaled):
        kth = scaled[order[top_k - 1]]
        keep = {i for i in keep if scaled[i] >= kth}
    if top_p < 1.0:
        live = [i for i in order if i in keep]
        z = sum(math.exp(scaled[i] - scaled[live[0]]) for i in live)
        mass, kept = 0.0, set()
        for i in live:
            if mass < top_p:
                kept.add(i)
            mass += math.exp(scaled[i] - scaled[live[0]]) / z
        keep = kept
    return keep


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(
        st.integers(min_value=-40, max_value=40).map(lambda x: x / 8), min_size=2, max_size=12
    ),
    temperature=st.sampled_from([0.3, 1.0, 1.7]),
    top_k=st.integers(min_value=0, max_value=6),
    top_p=st.sampled_from([0.2, 0.5, 0.9, 1.0]),
)
def test_filter_matches_reference(
    logits: list[float], temperature: float, top_k: int, top_p: float
) -> None:
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    out = filtered_logits(torch.tensor(logits, dtype=torch.float64), params)
    kept = {i for i, x in enumerate(out.tolist()) if x != float("-inf")}
    want = reference_filter(logits, temperature, top_k, top_p)
    assert kept
    if len(set(logits)) == len(logits):
        assert kept == want
    else:
        # Tied logits may sit on either side of the top-p boundary depending on sort order.
        assert {logits[i] for i in kept ^ want} <= {x for x in logits if logits.count(x) > 1}


def test_sampled_tokens_respect_top_k_and_seed() -> None:
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    raw = torch.log_softmax(logits, -1)
    top5 = set(torch.topk(logits, 5).indices.tolist())
    params = SamplingParams(temperature=1.0, top_k=5, logprobs=2)
    draws = []
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        draws.append([sample_row(logits, raw, params, g, "raw_logprobs").token for _ in range(50)])
    assert all(t in top5 for d in draws for t in d)
    g = torch.Generator().manual_seed(0)
    assert [sample_row(logits, raw, params, g, "raw_logprobs").token for _ in range(50)] == draws[0]


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_reported_logprob_modes(mode: str) -> None:
    logits = torch.randn(500, generator=torch.Generator().manual_seed(1))
    raw = torch.log_softmax(logits, -1)
    params = SamplingParams(temperature=0.5, top_k=20, logprobs=3)
    choice = sample_row(logits, raw, params, torch.Generator().manual_seed(2), mode)  # type: ignore[arg-type]
    if mode == "raw_logprobs":
        assert choice.logprob == pytest.approx(float(raw[choice.token]))
    else:
        want = torch.log_softmax(filtered_logits(logits, params), -1)[choice.token]
        assert choice.logprob == pytest.approx(float(want))
    assert choice.top is not None and len(choice.top) == 3
    assert choice.top[0][1] >= choice.logprob - 1e-6


def test_bad_params_name_the_field() -> None:
    for kwargs, field in (
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": ("",)}, "stop"),
    ):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_batched_rows_draw_what_each_row_draws_alone(mode: str) -> None:
    # The scheduler samples a whole decode step at once; a row must draw the same
    # token and report the same logprobs as it would alone (seeds reproduce
    # whatever the batch).
    logits = torch.randn(7, 3000, generator=torch.Generator().manual_seed(3)) * 3
    raw = torch.log_softmax(logits, -1)
    params = [
        SamplingParams(temperature=0.7, logprobs=2),
        SamplingParams(temperature=0.0, logprobs=1),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.9, top_k=4),
        SamplingParams(temperature=1.3, top_p=0.5, logprobs=3),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=2.0, logprobs=0),
    ]

    def generators() -> list[torch.Generator | None]:
        return [torch.Generator().manual_seed(10 + i) for i in range(len(params))]

    gens = generators()
    batch = sample_rows(logits, raw, params, gens, mode)  # type: ignore[arg-type]
    alone_gens = generators()
    alone = [
        sample_row(logits[i], raw[i], params[i], alone_gens[i], mode)  # type: ignore[arg-type]
        for i in range(len(params))
    ]
    assert [c.token for c in batch] == [c.token for c in alone]
    assert [c.logprob for c in batch] == [c.logprob for c in alone]
    assert [c.top for c in batch] == [c.top for c in alone]
    assert batch[1].token == int(logits[1].argmax())
    assert batch[3].token in set(torch.topk(logits[3], 4).indices.tolist())
