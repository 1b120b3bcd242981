"""The supported model families and what sets each apart: the HF `model_type`s we read, the `ModelConfig` fields
a family's `config.json` decides beyond the shared Llama ones (MoE layout, q/k norms, MLP activation, Gemma's
norm and embedding scaling), and each family's defaults for keys its `config.json` may omit.

Families: Llama (Touvron et al. 2023), Mistral (Jiang et al. 2023), Qwen2 and Qwen2-MoE (Qwen team 2024), Qwen3
and Qwen3-MoE (Qwen team 2025: RMSNorm over each q / k head; Qwen3-MoE without a shared expert), Mixtral (Jiang et
al. 2024), Gemma (Gemma team 2024: GeGLU MLP, RMSNorm scaled by 1 + w, embeddings times sqrt(D), tied head),
Gemma 2 (Gemma team 2024b, "Gemma 2: Improving Open Language Models at a Practical Size": Gemma plus attention and
final-logit soft-capping, alternating sliding-window / global layers, post-attention and post-MLP norms and a
`query_pre_attn_scalar` attention scale), Gemma 3's text model (Gemma team 2025, "Gemma 3 Technical Report":
Gemma 2's layer without soft caps, with Gemma-style q / k norms, five local layers to one global, and RoPE of base
1e4 on the local layers, 1e6 with scaling on the global ones), Phi-3
(Abdin et al. 2024: fused qkv / gate_up projections split at load, LongRoPE, optionally partial rotary, a
sliding window whenever `sliding_window` is set).

GGUF files name a family by `general.architecture`; `models.gguf_families` maps it and its metadata to ours.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any


class Activation(enum.Enum):
    """The gate nonlinearity of the gated MLP: act(h @ w_gate) * (h @ w_up)."""

    SILU = "silu"  # SwiGLU (Shazeer 2020)
    GELU_TANH = "gelu_tanh"  # GeGLU with the tanh approximation of GELU (Hendrycks & Gimpel 2016)


SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "mixtral", "qwen2_moe",
                           "qwen3_moe", "gemma3_text", "phi3")
# GeGLU, 1 + w norms, sqrt(D)-scaled embeddings, tied head by default
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3_text")
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe")  # sparse MoE MLP in every layer (`models.moe`)
QK_NORM_ARCHITECTURES = ("qwen3", "qwen3_moe", "gemma3_text")  # RMSNorm over each q / k head before RoPE

# HF activation names -> ours. transformers' GemmaConfig reads the legacy "gelu" of the official Gemma releases as
# the tanh approximation (its `__post_init__`), so only Gemma maps it; elsewhere "gelu" is the exact erf GELU.
_HF_ACTIVATIONS = {"silu": Activation.SILU, "swish": Activation.SILU, "gelu_pytorch_tanh": Activation.GELU_TANH,
                   "gelu_new": Activation.GELU_TANH}
# head_dim when config.json omits it: the transformers config class's default (Qwen3Config 128, GemmaConfig 256);
# other families use hidden_size / num_attention_heads.
_HEAD_DIM_DEFAULTS = {"qwen3": 128, "gemma": 256, "gemma2": 256, "gemma3_text": 256}


def hf_activation(hf: Mapping[str, Any], model_type: str) -> Activation:
    """The MLP activation of an HF `config.json` (`hidden_act`; Gemma's transformers-v4 `hidden_activation` first;
    Gemma 2 and Gemma 3 read only `hidden_activation`, as `Gemma2MLP` / `Gemma3MLP` do).

    Raises:
      ValueError: an activation we do not implement, naming it.
    """
    if model_type in ("gemma2", "gemma3_text"):
        act = hf.get("hidden_activation") or "gelu_pytorch_tanh"
        if act not in _HF_ACTIVATIONS:
            raise ValueError(f"config.json hidden_activation={act!r} is not supported for model_type={model_type!r} "
                             f"(supported: {', '.join(_HF_ACTIVATIONS)})")
        return _HF_ACTIVATIONS[act]
    default = "gelu_pytorch_tanh" if model_type == "gemma" else "silu"
    act = (hf.get("hidden_activation") if model_type == "gemma" else None) or hf.get("hidden_act", default)
    if model_type == "gemma" and act == "gelu":
        act = "gelu_pytorch_tanh"
    if act not in _HF_ACTIVATIONS:
        raise ValueError(f"config.json hidden_act={act!r} is not supported for model_type={model_type!r} "
                         f"(supported: {', '.join(_HF_ACTIVATIONS)})")
    return _HF_ACTIVATIONS[act]


def hf_head_dim(hf: Mapping[str, Any], model_type: str, hidden: int, heads: int) -> int:
    """H from an HF `config.json`: its `head_dim`, else the family's default, else hidden / heads."""
    return int(hf.get("head_dim") or _HEAD_DIM_DEFAULTS.get(model_type, hidden // heads))


def hf_attention_bias(hf: Mapping[str, Any], model_type: str) -> bool:
    """Whether q/k/v carry biases: Qwen2 by default, Qwen2-MoE unless v5's `qkv_bias` says otherwise, others only
    with `attention_bias` true."""
    if model_type == "qwen2_moe":
        return bool(hf.get("qkv_bias", True))
    return bool(hf.get("attention_bias", model_type == "qwen2"))


def hf_family_fields(hf: Mapping[str, Any], model_type: str, hidden: int) -> dict[str, Any]:
    """The `ModelConfig` fields a family sets beyond the shared Llama ones, from an HF `config.json`.

    Every family: `mlp_activation`, `tie_word_embeddings` (default false; Gemma 1 / 2 / 3: true, as their config
    classes). Qwen3, Gemma 3: `qk_norm`. Gemma 1 / 2 / 3: norm scales 1 + w (`norm_weight_offset` 1), embeddings
    times sqrt(hidden) (`embed_scale`). Gemma 2: see `hf_gemma2_fields`; Gemma 3: `hf_gemma3_fields`. MoE
    families: see `hf_moe_fields`.

    Raises:
      ValueError: an unsupported activation, a bidirectional Gemma (`use_bidirectional_attention` true: an
        encoder, not a decoder), a Gemma 2 / 3 error from `hf_gemma2_fields` / `hf_gemma3_fields`, or an MoE
        config error from `hf_moe_fields`.
    """
    gemma = model_type in GEMMA_ARCHITECTURES
    fields: dict[str, Any] = dict(mlp_activation=hf_activation(hf, model_type),
                                  tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
                                  **hf_moe_fields(hf, model_type))
    if model_type in QK_NORM_ARCHITECTURES:
        fields["qk_norm"] = True
    if model_type == "phi3":
        fields["partial_rotary_factor"] = hf_partial_rotary_factor(hf)
    if gemma:
        if hf.get("use_bidirectional_attention"):
            raise ValueError("config.json use_bidirectional_attention=true: bidirectional (encoder) Gemma is not "
                             "supported, only causal decoders")
        fields.update(norm_weight_offset=1.0, embed_scale=float(hidden) ** 0.5)
    if model_type == "gemma2":
        fields.update(hf_gemma2_fields(hf))
    if model_type == "gemma3_text":
        fields.update(hf_gemma3_fields(hf))
    return fields


def hf_gemma3_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 3's (text model, `Gemma3ForCausalLM`) fields beyond Gemma's, read as transformers'
    `Gemma3TextConfig` does (Gemma team 2025, "Gemma 3 Technical Report").

    `layer_types`, absent: every `sliding_window_pattern`-th layer (default 6: layers 5, 11, ...) global, the rest
    sliding, with `sliding_window` (default 4096) as `layer_sliding_windows`; q/k norms (`QK_NORM_ARCHITECTURES`);
    post-attention / post-MLP norms; `query_pre_attn_scalar` (default 256); soft caps only when set (default off).
    RoPE: global layers `rope_theta` (default 1e6) with `rope_scaling` (`hf_rope_parameters`), local layers the
    plain schedule of base `rope_local_theta`: transformers v5's `rope_parameters["sliding_attention"]`, else v4's
    `rope_local_base_freq`, else 1e4.

    Raises:
      ValueError: bad `layer_types` (`hf_layer_windows`), `sliding_window` null (the local layers need one) or a
        local rope type other than default, naming the key.
    """
    layers = int(hf["num_hidden_layers"])
    pattern = int(hf.get("sliding_window_pattern", 6))
    if pattern < 1:
        raise ValueError(f"config.json sliding_window_pattern={pattern} must be >= 1")
    window = hf.get("sliding_window", 4096)
    if window is None:
        raise ValueError("config.json sliding_window=null: Gemma 3's sliding_attention layers need a window")
    rope = hf.get("rope_parameters") or {}
    local = dict(rope.get("sliding_attention") or {}) if _per_layer_type(rope) else {}
    local_type = local.get("rope_type", local.get("type", "default"))
    if local_type != "default":
        raise ValueError(f"config.json rope_parameters.sliding_attention rope_type={local_type!r}: only 'default' "
                         "is supported on Gemma 3's local layers")
    caps = {key: None if hf.get(key) is None else float(hf[key])
            for key in ("attn_logit_softcapping", "final_logit_softcapping")}
    default_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    return dict(layer_sliding_windows=hf_layer_windows(hf, default_types, int(window)),
                query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)), post_norms=True,
                rope_local_theta=float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0))), **caps)


def _per_layer_type(rope: Mapping[str, Any]) -> bool:
    """Whether a v5 `rope_parameters` holds one rope dict per layer type (Gemma 3) rather than one dict."""
    return "full_attention" in rope or "sliding_attention" in rope


def hf_rope_parameters(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The rope dict `rope_theta` and `rope_scaling` are read from before a v4 `rope_scaling` updates it: v5's
    `rope_parameters`; for Gemma 3 its `full_attention` entry (the global layers; the local ones:
    `hf_gemma3_fields`), with Gemma 3's global base 1e6 when neither it nor the top level names a `rope_theta`."""
    rope = dict(hf.get("rope_parameters") or {})
    if model_type != "gemma3_text":
        return rope
    rope = dict(rope.get("full_attention") or {}) if _per_layer_type(rope) else rope
    rope.setdefault("rope_theta", hf.get("rope_theta", 1e6))
    return rope


def hf_layer_windows(hf: Mapping[str, Any], default_types: list[str], window: int | None) -> tuple[int | None, ...]:
    """`layer_sliding_windows` from `layer_types` ("sliding_attention" / "full_attention" per layer; absent:
    `default_types`): `window` on the sliding layers, None on the full ones.

    Raises:
      ValueError: `layer_types` of the wrong length or with another type, naming it.
    """
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types") or default_types
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"config.json layer_types={types!r} must give 'sliding_attention' or 'full_attention' "
                         f"for each of the num_hidden_layers={layers} layers")
    return tuple(window if t == "sliding_attention" else None for t in types)


def hf_gemma2_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 2's fields beyond Gemma's, read as transformers' `Gemma2Config` / `Gemma2ForCausalLM` do.

    `layer_types` ("sliding_attention" / "full_attention" per layer; absent: layers 0, 2, 4, ... sliding) with
    `sliding_window` (default 4096; None: every layer full) give `layer_sliding_windows`; `attn_logit_softcapping`
    (default 50) and `final_logit_softcapping` (default 30), either null for off; `query_pre_attn_scalar`
    (default 256); post-attention / post-MLP norms always.

    Raises:
      ValueError: `layer_types` of the wrong length or with a type other than those two, naming it
        (`hf_layer_windows`).
    """
    layers = int(hf["num_hidden_layers"])
    window = hf.get("sliding_window", 4096)
    window = None if window is None else int(window)
    caps = {key: (None if hf.get(key, default) is None else float(hf.get(key, default)))
            for key, default in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0))}
    default_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return dict(layer_sliding_windows=hf_layer_windows(hf, default_types, window),
                query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)), post_norms=True, **caps)


def hf_moe_fields(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The MoE fields of `ModelConfig` from an HF Mixtral, Qwen2-MoE or Qwen3-MoE `config.json`; {} for dense models.

    Mixtral (`MixtralConfig`): `num_local_experts`, `num_experts_per_tok`, and `intermediate_size` is the expert
    width; the top-k weights are always renormalized. Qwen2-MoE (`Qwen2MoeConfig`) and Qwen3-MoE
    (`Qwen3MoeConfig`): `num_experts` (transformers 5.25 saves Qwen3-MoE's as `num_local_experts`; either is read),
    `num_experts_per_tok`, `moe_intermediate_size`, `norm_topk_prob` (default False, as both config classes);
    Qwen2-MoE also `shared_expert_intermediate_size` (Qwen3-MoE has no shared expert).

    Raises:
      ValueError: a missing key, or a Qwen2-MoE / Qwen3-MoE layout with dense layers in between (`mlp_only_layers`
        non-empty or `decoder_sparse_step` != 1; the message names the key), which is not supported yet.
    """
    def need(key: str, alias: str | None = None) -> Any:
        if key not in hf and alias in hf:
            return hf[alias]
        if key not in hf:
            raise ValueError(f"config.json ({model_type}) is missing required key {key!r}")
        return hf[key]

    if model_type == "mixtral":
        return dict(num_experts=need("num_local_experts"), num_experts_per_tok=need("num_experts_per_tok"),
                    moe_intermediate_size=need("intermediate_size"), norm_topk_prob=True)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        family = {"qwen2_moe": "Qwen2-MoE", "qwen3_moe": "Qwen3-MoE"}[model_type]
        if hf.get("mlp_only_layers"):
            raise ValueError(f"config.json mlp_only_layers={hf['mlp_only_layers']!r}: {family} with dense MLP "
                             "layers is not supported yet (every layer must be sparse)")
        if hf.get("decoder_sparse_step", 1) != 1:
            raise ValueError(f"config.json decoder_sparse_step={hf['decoder_sparse_step']!r}: only 1 (every layer "
                             f"sparse) is supported yet for {family}")
        shared = int(hf.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
        return dict(num_experts=need("num_experts", "num_local_experts"),
                    num_experts_per_tok=need("num_experts_per_tok"),
                    moe_intermediate_size=need("moe_intermediate_size"), shared_expert_intermediate_size=shared,
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    return {}


def hf_partial_rotary_factor(hf: Mapping[str, Any]) -> float:
    """Phi-3's share of each head that RoPE rotates: `partial_rotary_factor` of the rope dict, else of the config,
    else 1 (as `Phi3Config`, which moves the top-level key into `rope_parameters`)."""
    rope = {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}
    return float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))

