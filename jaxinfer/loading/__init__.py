"""Checkpoint loading: GGUF files (`gguf`; Q8_0 / Q4 tensors kept as stored: `gguf_quant`), HF safetensors folders
(`hf`) and jaxinfer's own orbax checkpoints (`orbax_format`, `orbax`), one table of checkpoint tensor names
(`tensor_names`), the config codec (`codec`), the entry point `load_model` (`loader`) and `convert` (`convert`).

Imports only `models`, `sharding` and `jaxinfer.tokenizer` (never the engine, serving or CLI).
"""

from jaxinfer.loading.convert import convert
from jaxinfer.loading.loader import (default_model_path, is_gguf, load_model, not_a_gguf_error, read_model_config,
                                     stored_dtype, stored_quantization)

__all__ = ["convert", "default_model_path", "is_gguf", "load_model", "not_a_gguf_error", "read_model_config",
           "stored_dtype", "stored_quantization"]
