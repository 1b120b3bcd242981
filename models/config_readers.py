"""Readers of the two config sources: GGUF metadata (llama.cpp's `gguf` key/values) and HF `config.json`, each
into the keyword arguments of a `models.config.ModelConfig`, and the RoPE scaling types both can name. Call them
through `ModelConfig.from_gguf_metadata` / `ModelConfig.from_hf_config`, which turn malformed content into a
`ValueError` naming the source."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from models.families import (GGUF_ARCHITECTURES, SUPPORTED_ARCHITECTURES, gguf_family, hf_attention_bias,
                             hf_family_fields, hf_head_dim, hf_rope_parameters)


class RopeType(enum.Enum):
    """Rotary-embedding frequency schedules we implement."""

    DEFAULT = "default"
    LINEAR = "linear"  # positions divided by `factor` (Chen et al. 2023, "position interpolation")
    LLAMA3 = "llama3"  # Llama 3.1 piecewise wavelength scaling (Meta, Llama 3 paper, 2024)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Parameters of a non-default RoPE schedule; field names follow HF `rope_scaling`."""

    rope_type: RopeType
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def config_from_gguf_metadata(meta: Mapping[str, Any], name: str = "") -> dict[str, Any]:
    """The `ModelConfig` fields of GGUF key/values (llama.cpp `gguf` spec, keys `<arch>.block_count` etc.).

    Args:
      meta: GGUF metadata key -> Python value (strings, ints, floats, lists).
      name: fallback model name when `general.name` is absent.

    Raises:
      ValueError: unknown `general.architecture`, a missing required key, or unsupported MoE keys (named in the
        message; see `models.families.gguf_family`).
    """
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF general.architecture={arch!r} is not supported; supported: "
                         f"{', '.join(GGUF_ARCHITECTURES)} (other families: load the HF safetensors folder)")

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in meta:
            raise ValueError(f"GGUF metadata is missing required key {full!r}")
        return meta[full]

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", meta.get(f"{arch}.rope.dimension_count", hidden // heads)))
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
        vocab = len(tokens)
    scaling = None
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        scaling = RopeScaling(RopeType.LINEAR, factor=float(meta[f"{arch}.rope.scaling.factor"]))
    elif scaling_type not in (None, "none"):
        raise ValueError(f"GGUF {arch}.rope.scaling.type={scaling_type!r} is not supported")
    return dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings=False,  # decided by the loader from the presence of output.weight
        attention_bias=arch == "qwen2",
        sliding_window=int(meta[f"{arch}.attention.sliding_window"]) if meta.get(
            f"{arch}.attention.sliding_window") else None,
        name=str(meta.get("general.name", name)),
        **gguf_family(meta, arch, hidden),  # architecture, MoE and per-family fields
    )


def config_from_hf(hf: Mapping[str, Any], name: str = "") -> dict[str, Any]:
    """The `ModelConfig` fields of an HF `config.json` dict (classic `rope_theta`/`rope_scaling` or v5 `rope_parameters`).

    Raises:
      ValueError: unknown `model_type`, a missing required key, or an unsupported rope type.
    """
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"config.json model_type={model_type!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def need(key: str) -> Any:
        if key not in hf:
            raise ValueError(f"config.json is missing required key {key!r}")
        return hf[key]

    def positive(key: str) -> int:
        value = need(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"config.json {key}={value!r} must be a positive integer")
        return value

    hidden = positive("hidden_size")
    heads = positive("num_attention_heads")
    max_positions = int(hf.get("max_position_embeddings", 4096))
    window = hf.get("sliding_window")
    window_on = hf.get("use_sliding_window", model_type in ("mistral", "mixtral"))  # Mixtral: like Mistral
    if not (window and window_on and window < max_positions):
        window = None  # absent, switched off, or wider than the context: full attention
    rope = hf_rope_parameters(hf, model_type)  # v5's `rope_parameters` (Gemma 3: its global layers' entry)
    if hf.get("rope_scaling"):
        rope.update(hf["rope_scaling"])
    rope_theta = float(hf.get("rope_theta", rope.get("rope_theta", 10000.0)))
    scaling = rope_scaling_from_hf(rope)
    return dict(
        architecture=model_type,
        vocab_size=positive("vocab_size"),
        hidden_size=hidden,
        intermediate_size=positive("intermediate_size"),
        num_layers=positive("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=hf_head_dim(hf, model_type, hidden, heads),
        rope_theta=rope_theta,
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_positions,
        attention_bias=hf_attention_bias(hf, model_type),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        sliding_window=None if window is None else int(window),
        name=name,
        **hf_family_fields(hf, model_type, hidden),
    )


def rope_scaling_from_hf(rope: Mapping[str, Any]) -> RopeScaling | None:
    """The `RopeScaling` of an HF `rope_scaling` / `rope_parameters` dict (`rope_type`, or the legacy `type`);
    None for the default schedule.

    Raises:
      ValueError: a rope type we do not implement, naming it; KeyError for a missing parameter (named by the caller).
    """
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return RopeScaling(RopeType.LINEAR, factor=float(rope["factor"]))
    if rope_type == "llama3":
        return RopeScaling(
            RopeType.LLAMA3,
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    raise ValueError(f"config.json rope type {rope_type!r} is not supported (default, linear, llama3)")
