"""lightning: harnessed reinforcement learning for LLM agents.

The harness talks to the gateway exactly as it talks to its model in production;
every call becomes exact training data (prompt ids, completion ids, logprobs),
merged into training samples by a radix trie and trained on with PPO-family
losses. This module never imports torch: trainer modules do that themselves,
and the training names (``Trainer``, ``TrainerConfig``, ``RunConfig``,
``train``) load on first use.

Note: the import name ``lightning`` is also used by Lightning AI's package; the
two cannot be installed in one environment.
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning import _core
from lightning._core import (
    Call,
    Divergence,
    Drift,
    GatewayBindError,
    GatewayConfigError,
    GatewayError,
    InvalidCallError,
    LightningError,
    MergeResult,
    MergeStats,
    MessageSpan,
    PackedTree,
    RolloutInfo,
    Sample,
    SplicedSpan,
    SpliceResult,
    StoreError,
    TemplateError,
    Tokenizer,
    TokenizerError,
    classify_drift,
    merge_calls,
    pack_sequences,
    release_merge_buffers,
)
from lightning.gateway.client import GatewayClient, GatewayRequestError
from lightning.gateway.records import AppKey, CallRecord, FeedbackReceipt, OnlineSession, Rollout
from lightning.gateway.server import Gateway, GatewayConfig, GatewayHandle, UpstreamConfig
from lightning.gateway.store import Store
from lightning.gateway.store_guard import install as _install_store_guard

__version__: str = _core.__version__

# Python's sqlite3 on a store this process has open in Rust loses commits
# (lightning/gateway/store_guard.py): refused from the first import on.
_install_store_guard()

# The training side's front door, loaded on first use (PEP 562) so that
# `import lightning` stays torch-free: `from lightning import Trainer` imports
# torch then, and only then. Names here, modules by their dotted path.
_LAZY = {
    "RunConfig": "lightning.config",
    "Trainer": "lightning.rl.trainer",
    "TrainerConfig": "lightning.config",
    "train": "lightning.run.loop",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "AppKey",
    "Call",
    "CallRecord",
    "Divergence",
    "Drift",
    "FeedbackReceipt",
    "Gateway",
    "GatewayBindError",
    "GatewayClient",
    "GatewayConfig",
    "GatewayConfigError",
    "GatewayError",
    "GatewayHandle",
    "GatewayRequestError",
    "InvalidCallError",
    "LightningError",
    "MergeResult",
    "MergeStats",
    "MessageSpan",
    "OnlineSession",
    "PackedTree",
    "Rollout",
    "RolloutInfo",
    "Sample",
    "SpliceResult",
    "SplicedSpan",
    "Store",
    "StoreError",
    "TemplateError",
    "Tokenizer",
    "TokenizerError",
    "UpstreamConfig",
    "__version__",
    "classify_drift",
    "merge_calls",
    "pack_sequences",
    "release_merge_buffers",
]
