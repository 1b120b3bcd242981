"""jaxinfer: an LLM inference engine on JAX/XLA.

`from jaxinfer import LLM, SamplingParams` is the offline API. Names load lazily, so that host-only subpackages
(`jaxinfer.scheduler`) import without jax.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "LLM": "jaxinfer.llm",
    "SamplingParams": "jaxinfer.sampling_params",
    "Prompt": "jaxinfer.prompt",
    "RequestOutput": "jaxinfer.outputs",
    "CompletionOutput": "jaxinfer.outputs",
    "Logprob": "jaxinfer.outputs",
}
__all__ = list(_LAZY)


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")
