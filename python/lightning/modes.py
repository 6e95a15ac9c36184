"""The closed sets of modes the trainer dispatches on, torch-free.

Configuration (``lightning.config``) validates against these when a TOML file
loads; the torch modules that implement each mode (``advantages``, ``losses``,
``batching``) import them from here, so the set a config accepts is the set the
code dispatches on.
"""

from __future__ import annotations

from typing import Literal, get_args

Estimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"]
AggregationMode = Literal[
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "rollout-mean",
]
AGGREGATION_MODES: tuple[str, ...] = get_args(AggregationMode)
RatioLevel = Literal["token", "sequence"]
KLEstimator = Literal["k1", "k3"]
BatchMode = Literal["padded", "packed", "tree"]
Device = Literal["auto", "cpu", "cuda"]
ComputeDtype = Literal["auto", "float32", "bfloat16"]
LrSchedule = Literal["constant", "linear", "cosine"]
OldLogprobs = Literal["auto", "recompute", "rollout"]

__all__ = [
    "AGGREGATION_MODES",
    "AggregationMode",
    "BatchMode",
    "ComputeDtype",
    "Device",
    "Estimator",
    "KLEstimator",
    "LrSchedule",
    "OldLogprobs",
    "RatioLevel",
]
