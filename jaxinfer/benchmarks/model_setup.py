"""The model a workload measures: its weights on the host, cast to a benchmark dtype, and their byte counts.

Shared by the workloads that build a `ModelRunner` themselves (step, attention, serving...). `--model` takes
what `jaxinfer.loading.load_model` takes; an HF folder needs no tokenizer here (the tiny test models have none).
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.loading import default_model_path, load_model
from jaxinfer.loading.hf import load_hf_weights
from models.config import ModelConfig
from models.llama import Weights

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def parse_dtypes(text: str) -> list[str]:
    """"float32,bfloat16" -> ["float32", "bfloat16"].

    Raises:
      ValueError: an empty list or a name other than float32 / bfloat16.
    """
    names = [d.strip() for d in text.split(",") if d.strip()]
    if not names:
        raise ValueError("--dtypes is empty: give float32 and/or bfloat16")
    for d in names:
        if d not in DTYPES:
            raise ValueError(f"unknown dtype {d!r} in --dtypes (known: {', '.join(DTYPES)})")
    return names


def model_path(model: str | os.PathLike | None) -> Path:
    """The path `--model` names, or the default SmolLM2-135M-Instruct GGUF file."""
    return default_model_path() if model is None else Path(model)


def load_host_weights(model: str | os.PathLike | None) -> tuple[ModelConfig, Weights]:
    """(config, f32 numpy weights) of a GGUF file, an HF folder (tokenizer not needed) or a checkpoint.

    Raises:
      ValueError: from `jaxinfer.loading.load_model` (missing path, unknown format...).
    """
    path = model_path(model)
    if path.is_dir() and (path / "config.json").is_file():
        return load_hf_weights(path, np.float32)
    cfg, weights, _ = load_model(path, np.float32)
    return cfg, weights


def cast_weights(weights: Weights, dtype: str) -> Weights:
    """Device copies of host weights in `dtype` ("float32" or "bfloat16")."""
    return jax.tree.map(lambda a: jnp.asarray(a, DTYPES[dtype]), weights)


def weight_bytes(weights: Weights) -> int:
    """Bytes of every weight array (a tied embedding table is a single array, so it counts once)."""
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(weights))


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
    """K and V bytes of one token over all layers: 2 x layers x KV heads x head dim x itemsize."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def describe(cfg: ModelConfig) -> str:
    """The shapes of a model for a report's prose: "30 layers, hidden 576, MLP 1536, 9 query / 3 KV heads of dim 64,
    vocab 49152, tied embeddings"."""
    return (f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, MLP {cfg.intermediate_size}, {cfg.num_heads} query / "
            f"{cfg.num_kv_heads} KV heads of dim {cfg.head_dim}, vocab {cfg.vocab_size}, "
            f"{'tied' if cfg.tie_word_embeddings else 'untied'} embeddings")


def config_data(cfg: ModelConfig) -> dict:
    """The config fields the byte counts and shapes of a report come from, as JSON."""
    return {"name": cfg.name, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_heads": cfg.num_heads,
            "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
            "tie_word_embeddings": cfg.tie_word_embeddings}
