"""kvledger's in-pod engine. Rooms: ``planner`` (the torch-free memory plan), ``core`` (the
engine loop), ``kv`` (the ledger and block pool), ``model``, ``sampling``, ``server``; at
the root the public ``LLM``/``SamplingParams`` API, the CLI dispatcher, config and errors.

Importing this package must stay torch-free: the planner runs in a light init
container. ``LLM``, ``SamplingParams``, ``StructuredOutputsParams`` and ``LoRARequest`` are resolved
lazily on first access.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvledger.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvledger.engine.sampling.params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":  # torch-free
        from kvledger.engine.sampling.structured_params import StructuredOutputsParams

        return StructuredOutputsParams
    if name == "LoRARequest":  # torch-free
        from kvledger.engine.settings.lora_config import LoRARequest

        return LoRARequest
    raise AttributeError(f"module 'kvledger.engine' has no attribute {name!r}")
