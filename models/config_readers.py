"""Readers of the two config sources: GGUF metadata (llama.cpp's `gguf` key/values) and HF `config.json`, each
into the keyword arguments of a `models.config.ModelConfig`, and the RoPE scaling types both can name. Call them
through `ModelConfig.from_gguf_metadata` / `ModelConfig.from_hf_config`, which turn malformed content into a
`ValueError` naming the source."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Any

from models.families import (SUPPORTED_ARCHITECTURES, hf_attention_bias, hf_family_fields, hf_head_dim,
                             hf_rope_parameters)
from models.gguf_families import (GGUF_ARCHITECTURES, GGUF_LONGROPE_TENSORS, GGUF_ROPE_FREQS_TENSOR, gguf_family,
                                  gguf_head_dim)


class RopeType(enum.Enum):
    """Rotary-embedding frequency schedules we implement."""

    DEFAULT = "default"
    LINEAR = "linear"  # positions divided by `factor` (Chen et al. 2023, "position interpolation")
    LLAMA3 = "llama3"  # Llama 3.1 piecewise wavelength scaling (Meta, Llama 3 paper, 2024)
    DYNAMIC = "dynamic"  # dynamic NTK-aware base (bloc97 / emozilla 2023), in its static form (`models.rope`)
    YARN = "yarn"  # YaRN (Peng et al. 2023): NTK-by-parts frequencies and an attention factor
    LONGROPE = "longrope"  # LongRoPE (Ding et al. 2024; Phi-3's "su"): per-pair short / long factors


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Parameters of a non-default RoPE schedule; field names follow HF `rope_scaling` (how `models.rope` uses
    them: `rope_frequencies`).

    Attributes:
      rope_type: the schedule.
      factor: context extension factor (linear, dynamic, yarn, llama3).
      low_freq_factor, high_freq_factor: Llama 3's wavelength band edges, as fractions of the original context.
      original_max_position_embeddings: the pre-training context in tokens (llama3, yarn, longrope).
      attention_factor: multiplies cos and sin (yarn, longrope), resolved from the config's defaults when read.
      beta_fast, beta_slow: YaRN's ramp edges in rotations over the original context (32 and 1 by default).
      truncate: YaRN rounds the ramp edges to whole pairs (HF's `truncate`, default true).
      short_factor, long_factor: LongRoPE's per-pair frequency divisors, R / 2 each.
    """

    rope_type: RopeType
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None


def config_from_gguf_metadata(meta: Mapping[str, Any], name: str = "") -> dict[str, Any]:
    """The `ModelConfig` fields of GGUF key/values (llama.cpp `gguf` spec, keys `<arch>.block_count` etc.).

    Args:
      meta: GGUF metadata key -> Python value (strings, ints, floats, lists), with the values of the
        `models.gguf_families.GGUF_METADATA_TENSORS` the file holds (as the GGUF readers add them).
      name: fallback model name when `general.name` is absent.

    Raises:
      ValueError: unknown `general.architecture`, a missing required key, bad rope keys (`gguf_rope_scaling`) or
        family keys (named in the message; see `models.gguf_families.gguf_family`).
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
    context = int(need("context_length"))
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
        vocab = len(tokens)
    window = meta.get(f"{arch}.attention.sliding_window")
    fields = dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=gguf_head_dim(meta, arch, hidden, heads),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=gguf_rope_scaling(meta, arch, context),
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=context,
        tie_word_embeddings=False,  # decided by the loader from the presence of output.weight
        attention_bias=arch == "qwen2",
        # absent, 0 (Phi-3's converter: none) or as wide as the context: full attention, as `config_from_hf`
        sliding_window=int(window) if window and int(window) < context else None,
        name=str(meta.get("general.name", name)),
    )
    fields.update(gguf_family(meta, arch, fields))  # architecture, MoE and per-family fields
    return fields


def gguf_rope_scaling(meta: Mapping[str, Any], arch: str, context_length: int) -> RopeScaling | None:
    """The `RopeScaling` of GGUF `<arch>.rope.scaling.*` keys (llama.cpp's): `linear`, or `yarn` with
    `original_context_length` (default: the context) and `yarn_beta_fast` / `yarn_beta_slow`, read as the HF
    `rope_scaling` that `convert_hf_to_gguf.py` wrote them from; or LongRoPE (`gguf_longrope`) when the file holds
    `rope_factors_long` / `rope_factors_short`; or per-pair divisors (`gguf_rope_freqs`) when it holds `rope_freqs`.

    Raises:
      ValueError: another scaling type, or a YaRN key we do not read (`attn_factor`, `yarn_log_multiplier`,
        `yarn_ext_factor`, `yarn_attn_factor` other than their neutral values), naming it, or bad LongRoPE
        factors (`gguf_longrope`); KeyError for a missing `factor`.
    """
    prefix = f"{arch}.rope.scaling."
    scaling_type = meta.get(prefix + "type")
    if GGUF_ROPE_FREQS_TENSOR in meta:
        if scaling_type not in (None, "none") or any(name in meta for name in GGUF_LONGROPE_TENSORS):
            raise ValueError(f"GGUF tensor {GGUF_ROPE_FREQS_TENSOR!r} with {prefix}type={scaling_type!r} or "
                             "rope_factors tensors: a file takes one RoPE schedule")
        return gguf_rope_freqs(meta, arch, context_length)
    if any(name in meta for name in GGUF_LONGROPE_TENSORS):
        if scaling_type not in (None, "none"):
            raise ValueError(f"GGUF {prefix}type={scaling_type!r} with rope_factors tensors: only LongRoPE "
                             "(no scaling type) reads them")
        return gguf_longrope(meta, arch, context_length)
    if scaling_type in (None, "none"):
        return None
    if scaling_type == "linear":
        return RopeScaling(RopeType.LINEAR, factor=float(meta[prefix + "factor"]))
    if scaling_type != "yarn":
        raise ValueError(f"GGUF {prefix}type={scaling_type!r} is not supported (linear, yarn)")
    # neutral values; an ext factor of -1 is llama.cpp's "take it from the model" (1 for YaRN)
    neutral = {"attn_factor": (1.0,), "yarn_log_multiplier": (0.0,), "yarn_ext_factor": (-1.0, 1.0),
               "yarn_attn_factor": (1.0,)}
    for key, fine in neutral.items():
        if prefix + key in meta and meta[prefix + key] not in fine:
            raise ValueError(f"GGUF {prefix}{key}={meta[prefix + key]!r} is not supported with YaRN")
    rope = {"rope_type": "yarn", "factor": float(meta[prefix + "factor"]),
            "original_max_position_embeddings": int(meta.get(prefix + "original_context_length", context_length)),
            "beta_fast": meta.get(prefix + "yarn_beta_fast"), "beta_slow": meta.get(prefix + "yarn_beta_slow")}
    return rope_scaling_from_hf(rope, {"max_position_embeddings": context_length})


def _per_pair_factors(meta: Mapping[str, Any], arch: str, names: tuple[str, ...]) -> list[list[float]]:
    """The values of the factor tensors `names` in `meta`, checked to hold one value per rotated pair: half of
    `<arch>.rope.dimension_count`, else of the head (`attention.key_length`, else embedding_length / head_count).

    Raises:
      ValueError: a tensor missing, or lengths other than one per rotated pair, naming them.
    """
    values = [meta.get(name) for name in names]
    for name, got in zip(names, values):
        if got is None:
            raise ValueError(f"GGUF tensor {name!r} is missing: this RoPE schedule needs {' and '.join(names)}")
    rotary, source = meta.get(f"{arch}.rope.dimension_count"), f"{arch}.rope.dimension_count"
    if rotary is None:
        rotary, source = meta.get(f"{arch}.attention.key_length"), f"{arch}.attention.key_length"
    if rotary is None and meta.get(f"{arch}.attention.head_count"):
        rotary = int(meta.get(f"{arch}.embedding_length", 0)) // int(meta[f"{arch}.attention.head_count"])
        source = f"{arch}.embedding_length / head_count"
    want = len(values[0]) if not rotary else int(rotary) // 2
    if any(len(v) != want for v in values):
        raise ValueError(f"GGUF tensors {' and '.join(f'{n!r} ({len(v)} values)' for n, v in zip(names, values))} "
                         f"need one value per rotated pair, {source} / 2 = {want} each")
    return [list(v) for v in values]


def gguf_rope_freqs(meta: Mapping[str, Any], arch: str, context_length: int) -> RopeScaling:
    """Per-pair frequency divisors from the GGUF tensor `rope_freqs.weight`: pair i turns at
    theta ** (-2i / R) / rope_freqs[i]. llama.cpp's converter writes Llama 3.x's `llama3` RoPE schedule (Meta's
    `apply_scaling`: wavelengths past original / low_freq_factor divided by `factor`, a smooth ramp down to
    original / high_freq_factor) in this form and no `rope.scaling.*` keys, so the divisors are all a file says.
    They are read as the LongRoPE form with one set of factors for every context and attention factor 1, which
    gives exactly those frequencies (`models.rope.rope_frequencies`).

    Raises:
      ValueError: a length other than one value per rotated pair, or a divisor that is not finite and positive.
    """
    (freqs,) = _per_pair_factors(meta, arch, (GGUF_ROPE_FREQS_TENSOR,))
    if not all(math.isfinite(f) and f > 0 for f in freqs):
        raise ValueError(f"GGUF tensor {GGUF_ROPE_FREQS_TENSOR!r} holds a divisor that is not finite and positive")
    rope = {"rope_type": "longrope", "long_factor": freqs, "short_factor": freqs,
            "original_max_position_embeddings": context_length, "attention_factor": 1.0}
    return rope_scaling_from_hf(rope, {"max_position_embeddings": context_length})


def gguf_longrope(meta: Mapping[str, Any], arch: str, context_length: int) -> RopeScaling:
    """Phi-3's LongRoPE in a GGUF file, as llama.cpp's converter writes it: the per-pair factors as the tensors
    `rope_factors_long.weight` / `rope_factors_short.weight` (their values in `meta`, see
    `models.gguf_families.GGUF_LONGROPE_TENSORS`), `<arch>.rope.scaling.original_context_length` (default: the
    context), and the attention factor `<arch>.rope.scaling.attn_factor` (absent: HF's default from the factor
    context / original). Read as the HF `rope_scaling` it came from (`rope_scaling_from_hf`).

    Raises:
      ValueError: one of the two tensors missing, or factors not one per rotated pair
        (`<arch>.rope.dimension_count` / 2), naming them.
    """
    long, short = _per_pair_factors(meta, arch, GGUF_LONGROPE_TENSORS)
    prefix = f"{arch}.rope.scaling."
    rope = {"rope_type": "longrope", "long_factor": list(long), "short_factor": list(short),
            "original_max_position_embeddings": int(meta.get(prefix + "original_context_length", context_length)),
            "attention_factor": meta.get(prefix + "attn_factor")}
    return rope_scaling_from_hf(rope, {"max_position_embeddings": context_length})


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
    # Mixtral and Phi-3 (whose transformers classes mask by `sliding_window` alone): like Mistral
    window_on = hf.get("use_sliding_window", model_type in ("mistral", "mixtral", "phi3"))
    if not (window and window_on and window < max_positions):
        window = None  # absent, switched off, or wider than the context: full attention
    rope = hf_rope_parameters(hf, model_type)  # v5's `rope_parameters` (Gemma 3: its global layers' entry)
    if hf.get("rope_scaling"):
        rope.update(hf["rope_scaling"])
    rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))  # the rope dict first, as transformers v5
    scaling = rope_scaling_from_hf(rope, hf)
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


def rope_scaling_from_hf(rope: Mapping[str, Any], hf: Mapping[str, Any] | None = None) -> RopeScaling | None:
    """The `RopeScaling` of an HF `rope_scaling` / `rope_parameters` dict (`rope_type`, or the legacy `type`);
    None for the default schedule. Defaults are transformers' (`modeling_rope_utils`).

    Args:
      rope: the rope dict.
      hf: the whole `config.json` (for `max_position_embeddings`, `model_type` and a top-level
        `original_max_position_embeddings`, which transformers prefers over the rope dict's: Phi-3 writes it there;
        absent both, the original context is `max_position_embeddings`).

    Raises:
      ValueError: a rope type we do not implement, naming it, or LongRoPE factors of the wrong length; KeyError for
        a missing parameter (named by the caller).
    """
    hf = hf or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if hf.get("model_type") == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # Phi3Config reads its legacy "su" and "yarn" as LongRoPE
    if rope_type == "default":
        return None
    max_positions = int(hf.get("max_position_embeddings", 4096))
    original = rope.get("original_max_position_embeddings", max_positions)
    if hf.get("model_type") == "phi3":  # Phi3Config always has one (default 4096), which transformers prefers
        original = 4096
    original = int(hf.get("original_max_position_embeddings", original))
    if rope_type in ("linear", "dynamic"):
        return RopeScaling(RopeType(rope_type), factor=float(rope["factor"]))
    if rope_type == "llama3":
        return RopeScaling(RopeType.LLAMA3, factor=float(rope["factor"]),
                           low_freq_factor=float(rope["low_freq_factor"]),
                           high_freq_factor=float(rope["high_freq_factor"]), original_max_position_embeddings=original)
    if rope_type == "yarn":
        return _yarn_scaling(rope, max_positions, original)
    if rope_type == "longrope":
        return _longrope_scaling(rope, max_positions, original)
    raise ValueError(f"config.json rope type {rope_type!r} is not supported "
                     f"({', '.join(t.value for t in RopeType)})")


def _yarn_scaling(rope: Mapping[str, Any], max_positions: int, original: int) -> RopeScaling:
    """YaRN's parameters; the attention factor defaults to 0.1 ln(factor) + 1, or with `mscale` and
    `mscale_all_dim` to the ratio of those two mscales (Peng et al. 2023, eq. 21; DeepSeek's variant)."""
    factor = rope["factor"]  # required, as transformers has it; an explicit null: the context ratio
    factor = max_positions / original if factor is None else float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.get("attention_factor")
    if attention is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeScaling(RopeType.YARN, factor=factor, original_max_position_embeddings=original,
                       attention_factor=float(attention), beta_fast=float(rope.get("beta_fast") or 32),
                       beta_slow=float(rope.get("beta_slow") or 1), truncate=bool(rope.get("truncate", True)))


def _longrope_scaling(rope: Mapping[str, Any], max_positions: int, original: int) -> RopeScaling:
    """LongRoPE's factors; the attention factor defaults to sqrt(1 + ln(f) / ln(original)), f the `factor` or else
    max_position_embeddings / original (1 when f <= 1)."""
    short, long = (tuple(float(v) for v in rope[key]) for key in ("short_factor", "long_factor"))
    if len(short) != len(long):
        raise ValueError(f"config.json rope short_factor has {len(short)} entries but long_factor {len(long)}")
    factor = rope.get("factor")
    factor = max_positions / original if factor is None else float(factor)
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(RopeType.LONGROPE, factor=factor, original_max_position_embeddings=original,
                       attention_factor=float(attention), short_factor=short, long_factor=long)
