"""The families of GGUF files: llama.cpp's `general.architecture` names mapped to ours, and the `ModelConfig`
fields each family's metadata decides beyond the shared keys `models.config_readers.config_from_gguf_metadata`
reads. The keys are those llama.cpp's `convert_hf_to_gguf.py` writes; where it writes none, we assume what
llama.cpp's model loader assumes, and say so below.

- `llama` with `llama.expert_count` is Mixtral; `qwen3moe` is Qwen3-MoE (`gguf_moe_fields`).
- `qwen3`, `qwen3moe`, `gemma3`: q/k norms.
- `gemma`, `gemma2`, `gemma3`: GeGLU, norm gains 1 + w (the converter stores the sum, which
  `jaxinfer.loading.gguf` turns back into w), embeddings times sqrt(hidden), a tied head (no `output.weight`).
- `gemma2`, `gemma3`: per-layer windows, soft caps, post-norms, the attention scale and Gemma 3's local RoPE base
  (`gguf_gemma_fields`).
- `phi3`: `rope.dimension_count` is the rotated width of a head (partial rotary); LongRoPE comes from the
  `rope_factors_long` / `rope_factors_short` tensors (`models.config_readers.gguf_rope_scaling`); q/k/v and
  gate/up are fused tensors (`jaxinfer.loading.tensor_names.FUSED_LAYER_TENSORS`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from models.families import GEMMA_ARCHITECTURES, MOE_ARCHITECTURES, QK_NORM_ARCHITECTURES, Activation

# `general.architecture` values we read -> our architecture (a `llama` file with experts is Mixtral).
_GGUF_FAMILIES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma",
                  "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3", "qwen3moe": "qwen3_moe"}
GGUF_ARCHITECTURES = tuple(_GGUF_FAMILIES)
# Tensors whose values are config, not weights: the GGUF readers (`jaxinfer.loading.gguf`) put their values
# (lists of floats) into the metadata under these names, one value per rotated pair: Phi-3's LongRoPE factors,
# and `rope_freqs` (Llama 3.x: llama.cpp's converter writes the llama3 RoPE schedule as per-pair divisors).
GGUF_LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
GGUF_ROPE_FREQS_TENSOR = "rope_freqs.weight"
GGUF_METADATA_TENSORS = GGUF_LONGROPE_TENSORS + (GGUF_ROPE_FREQS_TENSOR,)

# What llama.cpp's loader assumes for Gemma 2 / 3, as no converter writes it: the local / global period (layer i
# is local unless i % n == n - 1: llama.cpp's `set_swa_pattern(n)`), the window and soft caps of a file that names
# none (Gemma 2's are also `Gemma2Config`'s defaults), and the layer counts of the 27B models, whose attention
# scale is (hidden / heads) ** -0.5 rather than head_dim ** -0.5 (llama.cpp's reading of gemma_pytorch's configs).
_GEMMA_PATTERN = {"gemma2": 2, "gemma3_text": 6}
_GEMMA_DEFAULT_WINDOW = {"gemma2": 4096, "gemma3_text": None}
_GEMMA_DEFAULT_CAPS = {"gemma2": {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
                       "gemma3_text": {"attn_logit_softcapping": None, "final_logit_softcapping": None}}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}
_GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's `rope_freq_base_train_swa` for gemma3


def gguf_head_dim(meta: Mapping[str, Any], arch: str, hidden: int, heads: int) -> int:
    """H of a GGUF file: `{arch}.attention.key_length`, else `{arch}.rope.dimension_count` (which llama.cpp's
    converters write as the head width), else hidden / heads. A `phi3` file's `rope.dimension_count` is the rotated
    width (partial rotary) and its converter writes no `key_length`: H is hidden / heads, as llama.cpp takes it."""
    if f"{arch}.attention.key_length" in meta:
        return int(meta[f"{arch}.attention.key_length"])
    if arch != "phi3" and f"{arch}.rope.dimension_count" in meta:
        return int(meta[f"{arch}.rope.dimension_count"])
    return hidden // heads


def gguf_family(meta: Mapping[str, Any], arch: str, base: Mapping[str, Any]) -> dict[str, Any]:
    """Our `architecture` and the family's `ModelConfig` fields from GGUF metadata of `general.architecture` arch.

    Args:
      meta: the GGUF key/values (with `GGUF_METADATA_TENSORS` values where the file has them).
      arch: `general.architecture`, one of `GGUF_ARCHITECTURES`.
      base: the shared fields already read (`num_layers`, `hidden_size`, `num_heads`, `head_dim`).

    Returns:
      Fields that update `base` (Gemma 2 / 3 set `sliding_window` None: their windows are per layer).

    Raises:
      ValueError: experts on a dense architecture or bad MoE keys (`gguf_moe_fields`), bad Gemma 2 / 3 keys
        (`gguf_gemma_fields`), or a Phi-3 `rope.dimension_count` that is not an even width of at most H; each
        names the key.
    """
    family = "mixtral" if arch == "llama" and meta.get("llama.expert_count") else _GGUF_FAMILIES[arch]
    fields: dict[str, Any] = dict(architecture=family)
    if family in QK_NORM_ARCHITECTURES:
        fields["qk_norm"] = True
    if family in GEMMA_ARCHITECTURES:
        fields.update(mlp_activation=Activation.GELU_TANH, norm_weight_offset=1.0,
                      embed_scale=float(base["hidden_size"]) ** 0.5)
    if family in _GEMMA_PATTERN:
        fields.update(gguf_gemma_fields(meta, arch, family, base))
    if family == "phi3":
        fields["partial_rotary_factor"] = _rotary_factor(meta, arch, base["head_dim"])
    fields.update(gguf_moe_fields(meta, arch, family))
    return fields


def gguf_gemma_fields(meta: Mapping[str, Any], arch: str, family: str, base: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 2's (`gemma2`) and Gemma 3's (`gemma3`, our `gemma3_text`) fields beyond Gemma's, as llama.cpp reads
    such a file.

    - Windows: `{arch}.attention.sliding_window` (Gemma 2 default 4096; Gemma 3: absent or 0, every layer global,
      as llama.cpp) on the local layers. Which layers are local, no converter writes: llama.cpp hard-codes every
      other layer from layer 0 for Gemma 2 and five local to one global for Gemma 3 (layers 5, 11, ... global), the
      defaults of transformers' configs too; an `{arch}.attention.sliding_window_pattern` (a period n, or one bool
      per layer, true = local), which llama.cpp writes for other families, is read when present.
    - Soft caps: `{arch}.attn_logit_softcapping`, `{arch}.final_logit_softcapping` (Gemma 2 defaults 50 / 30, as
      llama.cpp and `Gemma2Config`; Gemma 3's converter writes only a final cap, when set); 0 is off.
    - Attention scale: no converter writes `query_pre_attn_scalar`. `{arch}.attention.scale` (gguf's key of the
      score scale s, so the scalar is s ** -2) when present, which llama.cpp does not read for Gemma; else
      llama.cpp's rule: hidden / heads for the 27B models (46 layers for Gemma 2, 62 for Gemma 3), else H.
    - Gemma 3's local layers rotate by `{arch}.rope.freq_base_swa`, else 1e4 (llama.cpp hard-codes it), with the
      plain schedule; the global ones by `rope.freq_base` and `rope.scaling.*`.
    - Post-attention and post-MLP norms always.

    Raises:
      ValueError: a window, cap, scale or base that is not a positive number (or 0 where it means off), or a
        pattern that is not a period >= 1 or one bool per layer, naming the key.
    """
    layers = base["num_layers"]
    window = _positive(meta, f"{arch}.attention.sliding_window", _GEMMA_DEFAULT_WINDOW[family], integer=True)
    local = _local_layers(meta, f"{arch}.attention.sliding_window_pattern", _GEMMA_PATTERN[family], layers)
    caps = {key: _positive(meta, f"{arch}.{key}", default) for key, default in _GEMMA_DEFAULT_CAPS[family].items()}
    scale = _positive(meta, f"{arch}.attention.scale", None)
    if scale is not None:
        scalar = scale ** -2.0
    elif layers == _GEMMA_27B_LAYERS[family]:
        scalar = float(base["hidden_size"] // base["num_heads"])
    else:
        scalar = float(base["head_dim"])
    fields = dict(sliding_window=None, layer_sliding_windows=tuple(window if is_local else None for is_local in local),
                  query_pre_attn_scalar=scalar, post_norms=True, **caps)
    if family == "gemma3_text":
        fields["rope_local_theta"] = _positive(meta, f"{arch}.rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE)
    return fields


def _positive(meta: Mapping[str, Any], key: str, default: float | None, integer: bool = False) -> Any:
    """`meta[key]` (else `default`) as a positive float (an int with `integer`); None for None or 0 (off).

    Raises:
      ValueError: a value that is not a number, negative, not finite, or (with `integer`) not whole, naming `key`.
    """
    value = meta.get(key, default)
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf or \
            (integer and value != int(value)):
        raise ValueError(f"GGUF {key}={value!r} must be a positive {'integer' if integer else 'number'} (0: none)")
    return int(value) if integer else float(value)


def _local_layers(meta: Mapping[str, Any], key: str, default: int, layers: int) -> tuple[bool, ...]:
    """Which of `layers` layers are local, from `meta[key]` (else `default`): a period n (layer i local unless
    i % n == n - 1) or one bool per layer.

    Raises:
      ValueError: anything else, naming `key`.
    """
    pattern = meta.get(key, default)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != layers or not all(isinstance(p, bool) for p in pattern):
            raise ValueError(f"GGUF {key}={pattern!r} must be a period >= 1 or one bool per layer "
                             f"({layers} layers)")
        return tuple(pattern)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ValueError(f"GGUF {key}={pattern!r} must be a period >= 1 or one bool per layer ({layers} layers)")
    return tuple(i % pattern != pattern - 1 for i in range(layers))


def _rotary_factor(meta: Mapping[str, Any], arch: str, head_dim: int) -> float:
    """`partial_rotary_factor` of a Phi-3 file: `{arch}.rope.dimension_count` (default H) over H, nudged up where
    float rounding would make `int(H * factor)` one short of it.

    Raises:
      ValueError: a `rope.dimension_count` that is not an even integer in [2, H], naming the key.
    """
    key = f"{arch}.rope.dimension_count"
    rotary = meta.get(key, head_dim)
    if isinstance(rotary, bool) or not isinstance(rotary, int) or rotary % 2 or not 2 <= rotary <= head_dim:
        raise ValueError(f"GGUF {key}={rotary!r} must be an even number of channels in [2, head_dim={head_dim}]")
    factor = rotary / head_dim
    return factor if int(head_dim * factor) == rotary else math.nextafter(factor, 2.0)


def gguf_moe_fields(meta: Mapping[str, Any], arch: str, family: str) -> dict[str, Any]:
    """The MoE fields of a GGUF file of our `family`; {} for dense ones.

    - `llama` with `llama.expert_count` > 0 (Mixtral): `expert_used_count` experts per token, renormalized (as
      llama.cpp's llama graph does), of width `expert_feed_forward_length` (else `feed_forward_length`).
    - `qwen3moe` (Qwen3-MoE): the same keys. llama.cpp's graph renormalizes its top-k weights too, whatever the HF
      checkpoint's `norm_topk_prob` was (the converter drops it), so we do as llama.cpp does.

    Raises:
      ValueError: experts on an architecture we read as dense, a missing expert key, or shared experts, a gating
        function other than softmax or a weight scale other than 1, each naming the key.
    """
    experts = meta.get(f"{arch}.expert_count")
    if family not in MOE_ARCHITECTURES:
        if experts:
            raise ValueError(f"GGUF {arch}.expert_count={experts}: experts are read only for llama (Mixtral) and "
                             "qwen3moe files")
        return {}
    for key in ("expert_count", "expert_used_count"):
        if not meta.get(f"{arch}.{key}"):
            raise ValueError(f"GGUF metadata of a {family} file needs {arch}.{key} >= 1")
    unsupported = {f"{arch}.expert_shared_count": lambda v: not v,  # shared experts (Qwen2-MoE's) are not read
                   f"{arch}.expert_gating_func": lambda v: v == 1,  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_SOFTMAX
                   f"{arch}.expert_weights_scale": lambda v: v == 1}
    for key, fine in unsupported.items():
        if key in meta and not fine(meta[key]):
            raise ValueError(f"GGUF {key}={meta[key]!r} is not supported (softmax top-k routing without shared "
                             "experts or a weight scale only)")
    width = meta.get(f"{arch}.expert_feed_forward_length", meta.get(f"{arch}.feed_forward_length"))
    return dict(num_experts=int(experts), num_experts_per_tok=int(meta[f"{arch}.expert_used_count"]),
                moe_intermediate_size=int(width), norm_topk_prob=True)
