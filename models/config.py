"""`ModelConfig`: the static description of a Llama-family decoder, read from GGUF metadata or HF `config.json`."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any


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


SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


def _parse(source: str, parse: Any, data: Mapping[str, Any], name: str) -> ModelConfig:
    """Runs a config parser, turning malformed-content errors into a `ValueError` that names `source`."""
    try:
        return parse(data, name)
    except KeyError as e:
        raise ValueError(f"{source} is missing key {e.args[0]!r}") from None
    except (TypeError, ZeroDivisionError, AttributeError) as e:
        raise ValueError(f"{source} has a malformed value: {type(e).__name__}: {e}") from None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama 2/3, Mistral, SmolLM2, Qwen2).

    Attributes:
      architecture: one of `SUPPORTED_ARCHITECTURES`.
      vocab_size: V, number of token ids.
      hidden_size: D, model width.
      intermediate_size: F, SwiGLU hidden width.
      num_layers: number of decoder layers.
      num_heads: N, query heads.
      num_kv_heads: K, key/value heads; N must be a multiple of K (GQA, Ainslie et al. 2023).
      head_dim: H, per-head width.
      rope_theta: RoPE base (Su et al. 2021, RoFormer).
      rope_scaling: optional frequency schedule (`None` is the plain schedule).
      rms_norm_eps: epsilon inside RMSNorm (Zhang & Sennrich 2019).
      max_position_embeddings: context length in tokens.
      tie_word_embeddings: the LM head reuses the token embedding table.
      attention_bias: q/k/v projections carry a bias (Qwen2).
      mlp_bias: gate/up/down projections carry a bias.
      sliding_window: W, or None for full attention: a query at position p sees keys at positions > p - W
        (Mistral, Jiang et al. 2023; every layer).
      name: human-readable model name, for logs and `ModelInfo`.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                      "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model config: {field}={value!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim={self.head_dim} must be even for RoPE")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"model config: sliding_window={self.sliding_window!r} must be None or a positive integer")

    @property
    def num_queries_per_kv(self) -> int:
        """G = N / K."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], name: str = "") -> ModelConfig:
        """Builds a config from GGUF key/values; see `_from_gguf_metadata`.

        Raises:
          ValueError: for any malformed or unsupported metadata, naming the key where it can.
        """
        return _parse("GGUF metadata", cls._from_gguf_metadata, meta, name)

    @classmethod
    def _from_gguf_metadata(cls, meta: Mapping[str, Any], name: str = "") -> ModelConfig:
        """Builds a config from GGUF key/values (llama.cpp `gguf` spec, keys `<arch>.block_count` etc.).

        Args:
          meta: GGUF metadata key -> Python value (strings, ints, floats, lists).
          name: fallback model name when `general.name` is absent.

        Raises:
          ValueError: unknown `general.architecture` or a missing required key (named in the message).
        """
        arch = meta.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"GGUF general.architecture={arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

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
        return cls(
            architecture=arch,
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
        )

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], name: str = "") -> ModelConfig:
        """Builds a config from an HF `config.json` dict; see `_from_hf_config`.

        Raises:
          ValueError: for any malformed or unsupported content, naming the key where it can.
        """
        if not isinstance(hf, Mapping):
            raise ValueError(f"config.json must hold a JSON object, got {type(hf).__name__}")
        return _parse("config.json", cls._from_hf_config, hf, name)

    @classmethod
    def _from_hf_config(cls, hf: Mapping[str, Any], name: str = "") -> ModelConfig:
        """Builds a config from an HF `config.json` dict (classic `rope_theta`/`rope_scaling` or v5 `rope_parameters`).

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
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"config.json hidden_act={act!r} is not supported (SwiGLU needs silu)")
        max_positions = int(hf.get("max_position_embeddings", 4096))
        window = hf.get("sliding_window")
        if not (window and hf.get("use_sliding_window", model_type == "mistral") and window < max_positions):
            window = None  # absent, switched off, or wider than the context: full attention
        rope = dict(hf.get("rope_parameters") or {})
        if hf.get("rope_scaling"):
            rope.update(hf["rope_scaling"])
        rope_theta = float(hf.get("rope_theta", rope.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type == "linear":
            scaling = RopeScaling(RopeType.LINEAR, factor=float(rope["factor"]))
        elif rope_type == "llama3":
            scaling = RopeScaling(
                RopeType.LLAMA3,
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type != "default":
            raise ValueError(f"config.json rope type {rope_type!r} is not supported (default, linear, llama3)")
        return cls(
            architecture=model_type,
            vocab_size=positive("vocab_size"),
            hidden_size=hidden,
            intermediate_size=positive("intermediate_size"),
            num_layers=positive("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_window=None if window is None else int(window),
            name=name,
        )
