"""The embedded inference engine: an OpenAI-compatible server with vLLM's wire format.

``Engine`` runs a transformers causal LM with a continuous-batching scheduler;
``lightning.engine.server`` puts vLLM's OpenAI-compatible HTTP API in front of
it (``lightning serve MODEL_DIR``). Importing this package imports torch.
"""

from __future__ import annotations

import os

# On a small shared CPU box the default OpenMP policy (threads spin at every
# barrier) collapses when another process holds a core: a decode step measured
# 10-30x slower with 2 spinning threads next to a busy neighbour. Passive waiting
# costs little when the machine is idle. Only effective if torch is not loaded
# yet; an explicit OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from lightning.engine.core import Engine, EngineError, Event, GenerationResult
from lightning.engine.sampling import SamplingParams

__all__ = ["Engine", "EngineError", "Event", "GenerationResult", "SamplingParams"]
