"""The supported model families and what sets each apart: the HF `model_type`s we read, the `ModelConfig` fields
a family's `config.json` decides beyond the shared Llama ones (MoE layout, q/k norms, MLP activation, Gemma's
norm and embedding scaling), and each family's defaults for keys its `config.json` may omit.

Families: Llama (Touvron et al. 2023), Mistral (Jiang et al. 2023), Qwen2 and Qwen2-MoE (Qwen team 2024), Qwen3
(Qwen team 2025: RMSNorm over each q / k head), Mixtral (Jiang et al. 2024), Gemma (Gemma team 2024: GeGLU MLP,
RMSNorm scaled by 1 + w, embeddings times sqrt(D), tied head).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any


class Activation(enum.Enum):
    """The gate nonlinearity of the gated MLP: act(h @ w_gate) * (h @ w_up)."""

    SILU = "silu"  # SwiGLU (Shazeer 2020)
    GELU_TANH = "gelu_tanh"  # GeGLU with the tanh approximation of GELU (Hendrycks & Gimpel 2016)


SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "mixtral", "qwen2_moe")
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe")  # sparse MoE MLP in every layer (`models.moe`); HF folders only
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2")  # `general.architecture` values `jaxinfer.loading.gguf` reads

# HF activation names -> ours. transformers' GemmaConfig reads the legacy "gelu" of the official Gemma releases as
# the tanh approximation (its `__post_init__`), so only Gemma maps it; elsewhere "gelu" is the exact erf GELU.
_HF_ACTIVATIONS = {"silu": Activation.SILU, "swish": Activation.SILU, "gelu_pytorch_tanh": Activation.GELU_TANH,
                   "gelu_new": Activation.GELU_TANH}
# head_dim when config.json omits it: the transformers config class's default (Qwen3Config 128, GemmaConfig 256);
# other families use hidden_size / num_attention_heads.
_HEAD_DIM_DEFAULTS = {"qwen3": 128, "gemma": 256}


def hf_activation(hf: Mapping[str, Any], model_type: str) -> Activation:
    """The MLP activation of an HF `config.json` (`hidden_act`; Gemma's transformers-v4 `hidden_activation` first).

    Raises:
      ValueError: an activation we do not implement, naming it.
    """
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

    Every family: `mlp_activation`, `tie_word_embeddings` (default false; Gemma: true, as `GemmaConfig`). Qwen3:
    `qk_norm`. Gemma: norm scales 1 + w (`norm_weight_offset` 1), embeddings times sqrt(hidden) (`embed_scale`).
    MoE families: see `hf_moe_fields`.

    Raises:
      ValueError: an unsupported activation, a bidirectional Gemma (`use_bidirectional_attention` true: an
        encoder, not a decoder), or an MoE config error from `hf_moe_fields`.
    """
    fields: dict[str, Any] = dict(mlp_activation=hf_activation(hf, model_type),
                                  tie_word_embeddings=bool(hf.get("tie_word_embeddings", model_type == "gemma")),
                                  **hf_moe_fields(hf, model_type))
    if model_type == "qwen3":
        fields["qk_norm"] = True
    if model_type == "gemma":
        if hf.get("use_bidirectional_attention"):
            raise ValueError("config.json use_bidirectional_attention=true: bidirectional (encoder) Gemma is not "
                             "supported, only causal decoders")
        fields.update(norm_weight_offset=1.0, embed_scale=float(hidden) ** 0.5)
    return fields


def hf_moe_fields(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The MoE fields of `ModelConfig` from an HF Mixtral or Qwen2-MoE `config.json`; {} for dense models.

    Mixtral (`MixtralConfig`): `num_local_experts`, `num_experts_per_tok`, and `intermediate_size` is the expert
    width; the top-k weights are always renormalized. Qwen2-MoE (`Qwen2MoeConfig`): `num_experts`,
    `num_experts_per_tok`, `moe_intermediate_size`, `shared_expert_intermediate_size`, `norm_topk_prob` (default
    False).

    Raises:
      ValueError: a missing key, or a Qwen2-MoE layout with dense layers in between (`mlp_only_layers` non-empty
        or `decoder_sparse_step` != 1), which is not supported yet.
    """
    def need(key: str) -> Any:
        if key not in hf:
            raise ValueError(f"config.json ({model_type}) is missing required key {key!r}")
        return hf[key]

    if model_type == "mixtral":
        return dict(num_experts=need("num_local_experts"), num_experts_per_tok=need("num_experts_per_tok"),
                    moe_intermediate_size=need("intermediate_size"), norm_topk_prob=True)
    if model_type == "qwen2_moe":
        if hf.get("mlp_only_layers"):
            raise ValueError(f"config.json mlp_only_layers={hf['mlp_only_layers']!r}: Qwen2-MoE with dense MLP "
                             "layers is not supported yet (every layer must be sparse)")
        if hf.get("decoder_sparse_step", 1) != 1:
            raise ValueError(f"config.json decoder_sparse_step={hf['decoder_sparse_step']!r}: only 1 (every layer "
                             "sparse) is supported yet")
        return dict(num_experts=need("num_experts"), num_experts_per_tok=need("num_experts_per_tok"),
                    moe_intermediate_size=need("moe_intermediate_size"),
                    shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    return {}
