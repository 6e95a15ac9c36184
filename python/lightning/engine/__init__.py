"""The embedded inference engine: an OpenAI-compatible server with vLLM's wire format.

``Engine`` runs a transformers causal LM with a continuous-batching scheduler;
``lightning.engine.server`` puts vLLM's OpenAI-compatible HTTP API in front of
it (``lightning serve MODEL_DIR``). Importing this package imports torch.
"""

from __future__ import annotations

from lightning.engine.core import Engine, EngineError, Event, GenerationResult
from lightning.engine.sampling import SamplingParams

__all__ = ["Engine", "EngineError", "Event", "GenerationResult", "SamplingParams"]
