"""`ModelConfig`: the static description of a Llama-family decoder, read from GGUF metadata or HF `config.json`
(per-family fields and defaults: `models.families`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from models.config_readers import RopeScaling, RopeType, config_from_gguf_metadata, config_from_hf
from models.families import MOE_ARCHITECTURES, SUPPORTED_ARCHITECTURES, Activation
from models.gguf_families import GGUF_ARCHITECTURES

__all__ = ["Activation", "GGUF_ARCHITECTURES", "MOE_ARCHITECTURES", "ModelConfig", "RopeScaling", "RopeType",
           "SUPPORTED_ARCHITECTURES", "options_from_value"]


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
    """Shape and numerics of a Llama-family decoder (Llama 2/3, Mistral, SmolLM2, Qwen2, Qwen3, Gemma 1 / 2 / 3,
    Mixtral, Qwen2-MoE, Qwen3-MoE, Phi-3).

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
      rope_scaling: optional frequency schedule and attention factor (`None` is the plain schedule; `models.rope`).
      rms_norm_eps: epsilon inside RMSNorm (Zhang & Sennrich 2019).
      max_position_embeddings: context length in tokens.
      tie_word_embeddings: the LM head reuses the token embedding table.
      attention_bias: q/k/v projections carry a bias (Qwen2).
      mlp_bias: gate/up/down projections carry a bias.
      sliding_window: W, or None for full attention: a query at position p sees keys at positions > p - W
        (Mistral, Jiang et al. 2023; every layer unless `layer_sliding_windows` is set).
      layer_sliding_windows: one W (or None: full attention) per layer, overriding `sliding_window` (Gemma 2's
        alternating local / global layers, Gemma team 2024b); None: every layer uses `sliding_window`.
      attn_logit_softcapping: c, or None: attention scores become c * tanh(s / c) after scaling (Gemma 2).
      final_logit_softcapping: c, or None: the LM head's logits become c * tanh(logits / c) (Gemma 2).
      query_pre_attn_scalar: attention scores are scaled by this ** -0.5 instead of H ** -0.5 (Gemma 2); None: H.
      post_norms: RMSNorms on the attention output and on the MLP output before each residual add (weights
        `post_attn_norm`, `post_mlp_norm`; Gemma 2's "sandwich" norms).
      rope_local_theta: RoPE base of the layers with a sliding window, which rotate by the plain schedule, while
        the others keep `rope_theta` and `rope_scaling` (Gemma 3's local layers: `rope_local_base_freq`, 1e4);
        None: every layer uses `rope_theta` and `rope_scaling` (`layer_rope`).
      num_experts: E, routed experts of the sparse MoE MLP in every layer; 0 is a dense SwiGLU MLP (then the
        other MoE fields must be 0). Mixtral: Jiang et al. 2024; Qwen2-MoE: Qwen team 2024.
      num_experts_per_tok: k, experts each token is routed to (top-k of the router softmax), 1 <= k <= E.
      moe_intermediate_size: Fe, SwiGLU hidden width of each routed expert (Mixtral's HF config calls it
        `intermediate_size`).
      shared_expert_intermediate_size: Fs, hidden width of the always-on shared expert (Qwen2-MoE), gated by
        sigmoid(h @ shared_expert_gate); 0 means none.
      norm_topk_prob: renormalize the k selected softmax weights to sum to 1 (Mixtral and GGUF files: always;
        Qwen2-MoE, Qwen3-MoE: their `norm_topk_prob` key).
      qk_norm: RMSNorm over each query and key head (weights `q_norm`, `k_norm` of size H) after the projections,
        before RoPE (Qwen3, Qwen3-MoE).
      mlp_activation: the gated MLP's nonlinearity, act(h @ w_gate) * (h @ w_up): SiLU (SwiGLU) or GELU with the
        tanh approximation (GeGLU, Gemma). MoE experts are SwiGLU only.
      norm_weight_offset: every RMSNorm scales by (offset + w): 0 for Llama, 1 for Gemma (which stores w - 1).
      embed_scale: token embeddings are multiplied by this, cast to the activation dtype first (Gemma: sqrt(D)).
      partial_rotary_factor: RoPE rotates the first `rotary_dim` = int(H * this) channels of each head, the rest
        pass unchanged (Phi-3 family's `partial_rotary_factor`, e.g. Phi-4-mini's 0.75); in (0, 1].
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
    layer_sliding_windows: tuple[int | None, ...] | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    post_norms: bool = False
    rope_local_theta: float | None = None
    partial_rotary_factor: float = 1.0
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
        self._check_gemma2()
        self._check_rope()

    def _check_gemma2(self) -> None:
        """Raises ValueError, naming the field, for bad per-layer windows, soft caps or attention scalar."""
        windows = self.layer_sliding_windows
        if windows is not None:
            if not isinstance(windows, tuple) or len(windows) != self.num_layers:
                raise ValueError(f"model config: layer_sliding_windows={windows!r} must be a tuple of "
                                 f"num_layers={self.num_layers} entries")
            if any(w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1) for w in windows):
                raise ValueError(f"model config: layer_sliding_windows={windows!r} entries must be None or "
                                 "positive integers")
        for field in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
                      "rope_local_theta"):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise ValueError(f"model config: {field}={value!r} must be None or a positive finite number")

    def layer_window(self, layer: int | Any) -> int | None:
        """W of decoder layer `layer` (None: full attention). A traced index is fine only while every layer has
        the same window (`uniform_windows`); differing windows run unrolled, or scanned through `window_kinds`."""
        if self.uniform_windows:
            return self.sliding_window if self.layer_sliding_windows is None else self.layer_sliding_windows[0]
        return self.layer_sliding_windows[int(layer)]

    def layer_rope(self, window: int | None) -> ModelConfig:
        """The config whose RoPE fields (`rope_theta`, `rope_scaling`) a layer attending with `window` rotates by:
        with `rope_local_theta` set, a windowed (local) layer's are that base and the plain schedule (Gemma 3);
        otherwise this config's own."""
        if window is None or self.rope_local_theta is None:
            return self
        return dataclasses.replace(self, rope_theta=self.rope_local_theta, rope_scaling=None)

    @property
    def uniform_windows(self) -> bool:
        """True when every layer attends with the same window (so a `lax.scan` over layers can run them)."""
        return self.layer_sliding_windows is None or len(set(self.layer_sliding_windows)) == 1

    def window_kinds(self) -> tuple[tuple[int | None, ...], tuple[int, ...]]:
        """(the distinct windows W, in order of first use; each layer's index into them): a scan over layers whose
        windows differ runs layer i through the branch of its window (`models.llama.run_layers`)."""
        windows = self.layer_sliding_windows or (self.sliding_window,) * self.num_layers
        choices = tuple(dict.fromkeys(windows))
        return choices, tuple(choices.index(w) for w in windows)

    def first_layers(self, n: int) -> ModelConfig:
        """This config cut to its first `n` layers (self-drafting), their per-layer windows included."""
        windows = None if self.layer_sliding_windows is None else self.layer_sliding_windows[:n]
        return dataclasses.replace(self, num_layers=n, layer_sliding_windows=windows)

    @property
    def attention_scale(self) -> float:
        """The attention score scale: `query_pre_attn_scalar` ** -0.5 (Gemma 2), else H ** -0.5."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def _check_rope(self) -> None:
        """Raises ValueError for a rotary width that is not a positive even part of H, or LongRoPE factors that are
        not one per rotated pair."""
        if not (isinstance(self.partial_rotary_factor, (int, float)) and 0 < self.partial_rotary_factor <= 1):
            raise ValueError(f"model config: partial_rotary_factor={self.partial_rotary_factor!r} must be in (0, 1]")
        R = self.rotary_dim
        if R < 2 or R % 2:
            raise ValueError(f"model config: rotary_dim={R} (head_dim={self.head_dim} x partial_rotary_factor="
                             f"{self.partial_rotary_factor}) must be even and >= 2")
        scaling = self.rope_scaling
        if scaling is not None and scaling.rope_type is RopeType.LONGROPE:
            for key in ("short_factor", "long_factor"):
                factors = getattr(scaling, key)
                if factors is None or len(factors) != R // 2:
                    raise ValueError(f"model config: rope_scaling.{key} needs rotary_dim / 2 = {R // 2} entries, got "
                                     f"{None if factors is None else len(factors)}")

    @property
    def rotary_dim(self) -> int:
        """R, the channels of each head RoPE rotates: int(H * partial_rotary_factor), as transformers."""
        return int(self.head_dim * self.partial_rotary_factor)

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
        """Builds a config from GGUF key/values; see `models.config_readers.config_from_gguf_metadata`.

        Raises:
          ValueError: for any malformed or unsupported metadata, naming the key where it can.
        """
        return _parse("GGUF metadata", lambda m, n: cls(**config_from_gguf_metadata(m, n)), meta, name)

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], name: str = "") -> ModelConfig:
        """Builds a config from an HF `config.json` dict; see `models.config_readers.config_from_hf`.

        Raises:
          ValueError: for any malformed or unsupported content, naming the key where it can.
        """
        if not isinstance(hf, Mapping):
            raise ValueError(f"config.json must hold a JSON object, got {type(hf).__name__}")
        return _parse("config.json", lambda h, n: cls(**config_from_hf(h, n)), hf, name)

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
