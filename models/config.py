"""`ModelConfig`: the static description of a Llama-family decoder, read from GGUF metadata or HF `config.json`
(per-family fields and defaults: `models.families`)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from models.families import (GGUF_ARCHITECTURES, MOE_ARCHITECTURES, SUPPORTED_ARCHITECTURES, Activation,
                             hf_attention_bias, hf_family_fields, hf_head_dim)

__all__ = ["Activation", "GGUF_ARCHITECTURES", "MOE_ARCHITECTURES", "ModelConfig", "RopeScaling", "RopeType",
           "SUPPORTED_ARCHITECTURES", "options_from_value"]


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
    """Shape and numerics of a Llama-family decoder (Llama 2/3, Mistral, SmolLM2, Qwen2, Qwen3, Gemma, Mixtral,
    Qwen2-MoE).

    Attributes:
      architecture: one of `SUPPORTED_ARCHITECTURES`.
      vocab_size: V, number of token ids.
      hidden_size: D, model width.
      intermediate_size: F, gated-MLP hidden width.
      num_layers: number of decoder layers.
      num_heads: N, query heads.
      num_kv_heads: K, key/value heads; N must be a multiple of K (GQA, Ainslie et al. 2023).
      head_dim: H, per-head width (independent of D / N: Qwen3, Gemma).
      rope_theta: RoPE base (Su et al. 2021, RoFormer).
      rope_scaling: optional frequency schedule (`None` is the plain schedule).
      rms_norm_eps: epsilon inside RMSNorm (Zhang & Sennrich 2019).
      max_position_embeddings: context length in tokens.
      tie_word_embeddings: the LM head reuses the token embedding table.
      attention_bias: q/k/v projections carry a bias (Qwen2).
      mlp_bias: gate/up/down projections carry a bias.
      sliding_window: W, or None for full attention: a query at position p sees keys at positions > p - W
        (Mistral, Jiang et al. 2023; every layer).
      num_experts: E, routed experts of the sparse MoE MLP in every layer; 0 is a dense SwiGLU MLP (then the
        other MoE fields must be 0). Mixtral: Jiang et al. 2024; Qwen2-MoE: Qwen team 2024.
      num_experts_per_tok: k, experts each token is routed to (top-k of the router softmax), 1 <= k <= E.
      moe_intermediate_size: Fe, SwiGLU hidden width of each routed expert (Mixtral's HF config calls it
        `intermediate_size`).
      shared_expert_intermediate_size: Fs, hidden width of the always-on shared expert (Qwen2-MoE), gated by
        sigmoid(h @ shared_expert_gate); 0 means none.
      norm_topk_prob: renormalize the k selected softmax weights to sum to 1 (Mixtral: always; Qwen2-MoE: its
        `norm_topk_prob` key).
      qk_norm: RMSNorm over each query and key head (weights `q_norm`, `k_norm` of size H) after the projections,
        before RoPE (Qwen3).
      mlp_activation: the gated MLP's nonlinearity, act(h @ w_gate) * (h @ w_up): SiLU (SwiGLU) or GELU with the
        tanh approximation (GeGLU, Gemma). MoE experts are SwiGLU only.
      norm_weight_offset: every RMSNorm scales by (offset + w): 0 for Llama, 1 for Gemma (which stores w - 1).
      embed_scale: token embeddings are multiplied by this, cast to the activation dtype first (Gemma: sqrt(D)).
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
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    qk_norm: bool = False
    mlp_activation: Activation = Activation.SILU
    norm_weight_offset: float = 0.0
    embed_scale: float = 1.0
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
        if not isinstance(self.mlp_activation, Activation):
            raise ValueError(f"model config: mlp_activation={self.mlp_activation!r} must be one of "
                             f"{', '.join(str(a) for a in Activation)}")
        if not (isinstance(self.embed_scale, (int, float)) and 0 < self.embed_scale < float("inf")):
            raise ValueError(f"model config: embed_scale={self.embed_scale!r} must be a positive finite number")
        self._check_moe()

    def _check_moe(self) -> None:
        """Raises ValueError, naming the numbers, for inconsistent MoE fields."""
        for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                      "shared_expert_intermediate_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"model config: {field}={value!r} must be a non-negative integer")
        E, k = self.num_experts, self.num_experts_per_tok
        if self.architecture in MOE_ARCHITECTURES and E == 0:
            raise ValueError(f"model config: architecture {self.architecture!r} needs num_experts >= 1, got 0")
        if E == 0:
            extra = {f: getattr(self, f) for f in ("num_experts_per_tok", "moe_intermediate_size",
                                                    "shared_expert_intermediate_size") if getattr(self, f)}
            if extra:
                raise ValueError(f"model config: num_experts=0 (dense MLP) but {extra} set; MoE fields need "
                                 "num_experts >= 1")
            return
        if not 1 <= k <= E:
            raise ValueError(f"model config: num_experts_per_tok={k} must be in [1, num_experts={E}]")
        if self.moe_intermediate_size < 1:
            raise ValueError(f"model config: moe_intermediate_size={self.moe_intermediate_size} must be >= 1 "
                             f"with num_experts={E}")
        if self.mlp_bias:
            raise ValueError(f"model config: mlp_bias=True is not supported with num_experts={E} (MoE experts "
                             "have no biases)")
        if self.mlp_activation is not Activation.SILU:
            raise ValueError(f"model config: mlp_activation={self.mlp_activation} is not supported with "
                             f"num_experts={E} (MoE experts are SwiGLU)")

    @property
    def is_moe(self) -> bool:
        """True when every layer's MLP is a sparse mixture of experts (`models.moe.moe_block`)."""
        return self.num_experts > 0

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
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"GGUF general.architecture={arch!r} is not supported; supported: "
                             f"{', '.join(GGUF_ARCHITECTURES)} (other families: load the HF safetensors folder)")
        if meta.get(f"{arch}.expert_count"):
            raise ValueError(f"GGUF {arch}.expert_count={meta[f'{arch}.expert_count']}: MoE GGUF files are not "
                             "supported yet; load the HF safetensors folder instead")

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
        max_positions = int(hf.get("max_position_embeddings", 4096))
        window = hf.get("sliding_window")
        window_on = hf.get("use_sliding_window", model_type in ("mistral", "mixtral"))  # Mixtral: like Mistral
        if not (window and window_on and window < max_positions):
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


def options_from_value(cls: type, value: Any, what: str, required: tuple[str, ...] = ()) -> Any:
    """An options dataclass `cls` from an instance, a dict of its fields or a JSON object string; None stays None.

    Raises:
      ValueError: naming `what`, for JSON that does not parse or is not an object, unknown keys (named), missing
        `required` keys, or the dataclass's own value errors.
    """
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a JSON object / dict, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(repr(key) for key in set(value) - known)
    if unknown:
        raise ValueError(f"unknown {what} key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    missing = [key for key in required if key not in value]
    if missing:
        raise ValueError(f"{what} {dict(value)!r} needs the key(s) {', '.join(missing)}")
    return cls(**value)
