"""Rotary position embeddings (RoPE, Su et al. 2021): the inverse-frequency schedule and attention factor a config
asks for (default, linear, dynamic NTK, YaRN, Llama 3, LongRoPE, each as HF transformers' `ROPE_INIT_FUNCTIONS`
defines it), over the first `cfg.rotary_dim` channels of a head, and the rotation of query and key heads."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig, RopeType


def _plain(theta: float, rotary_dim: int) -> np.ndarray:
    """f64[R/2]: theta ** (-2i / R), the RoFormer frequencies."""
    return 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))


def dynamic_ntk_theta(theta: float, factor: float, rotary_dim: int, max_positions: int, seq_len: int) -> float:
    """The RoPE base of dynamic NTK scaling for a sequence of `seq_len` tokens (bloc97 / emozilla 2023, as HF's
    `_compute_dynamic_ntk_parameters`): theta * (factor * L / max_positions - (factor - 1)) ** (R / (R - 2)) with
    L = max(seq_len, max_positions), so it is the plain base for every L <= max_positions."""
    length = max(seq_len, max_positions)
    return theta * (factor * length / max_positions - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))


def _yarn(theta: float, rotary_dim: int, factor: float, original_max: int, beta_fast: float, beta_slow: float,
          truncate: bool) -> np.ndarray:
    """YaRN's frequencies (Peng et al. 2023, "YaRN", eq. 17-19): pairs that turn more than `beta_fast` times over
    the original context keep their frequency, those under `beta_slow` turns are divided by `factor`, with a linear
    ramp over the pair index between."""
    def pair_index(turns: float) -> float:  # the pair whose wavelength fits `turns` times into original_max
        return rotary_dim * math.log(original_max / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_index(beta_fast), pair_index(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as HF: avoid a zero-width ramp
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    plain = _plain(theta, rotary_dim)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    return plain / factor * (1 - keep) + plain * keep


def _llama3(inv_freq: np.ndarray, factor: float, low_freq_factor: float, high_freq_factor: float,
            original_max: int) -> np.ndarray:
    """Llama 3 schedule: wavelengths longer than `original_max / low_freq_factor` are divided by `factor`, shorter
    than `original_max / high_freq_factor` kept, and the band between interpolated smoothly (Llama 3 paper, 2024)."""
    low_wavelen, high_wavelen = original_max / low_freq_factor, original_max / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = np.where(wavelen > low_wavelen, inv_freq / factor, interpolated)
    return np.where(wavelen < high_wavelen, inv_freq, out)


def longrope_uses_long_factors(cfg: ModelConfig) -> bool:
    """Whether a LongRoPE model runs its long factors: when its context (`cfg.max_position_embeddings`) is longer
    than `original_max_position_embeddings`. One schedule for every sequence, so cached keys and prefix-cache pages
    stay valid; see `rope_frequencies`."""
    scaling = cfg.rope_scaling
    return scaling is not None and cfg.max_position_embeddings > scaling.original_max_position_embeddings


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies f32[R/2] (R = `cfg.rotary_dim`) of RoPE with the configured scaling, as HF transformers'
    `ROPE_INIT_FUNCTIONS` computes them.

    - default: theta ** (-2i / R). linear: divided by `factor` (Chen et al. 2023, position interpolation).
    - dynamic (NTK-aware, `dynamic_ntk_theta`): computed once, for `max_position_embeddings` tokens, the static
      form vLLM also uses instead of HF's per-forward recomputation. Within `max_position_embeddings` (the
      longest sequence the engine runs) HF leaves the plain base, and so do we: it equals HF there and only there.
      (vLLM computes its cache for `factor * max_position_embeddings` and extends the context by `factor`; we
      keep the context, so that short sequences match HF.)
    - yarn: `_yarn`; its attention factor is `rope_attention_factor`.
    - llama3: `_llama3`.
    - longrope (Phi-3 "su"; Ding et al. 2024, "LongRoPE"): theta ** (-2i / R) / ext_i with ext the long factors
      when `longrope_uses_long_factors(cfg)` (the context exceeds `original_max_position_embeddings`), else the
      short ones. HF picks per forward by the sequence's length (short up to original_max, long beyond), which
      would change the rotation of keys already in the cache; we pick once per model, as vLLM does by
      `max_model_len`. So a long-context Phi-3 equals HF on sequences longer than original_max, and a model whose
      context is original_max (Phi-3 4k) equals it everywhere.
    """
    inv_freq = _plain(cfg.rope_theta, cfg.rotary_dim)
    scaling = cfg.rope_scaling
    kind = RopeType.DEFAULT if scaling is None else scaling.rope_type
    if kind is RopeType.LINEAR:
        inv_freq = inv_freq / scaling.factor
    elif kind is RopeType.DYNAMIC:
        theta = dynamic_ntk_theta(cfg.rope_theta, scaling.factor, cfg.rotary_dim, cfg.max_position_embeddings,
                                  cfg.max_position_embeddings)
        inv_freq = _plain(theta, cfg.rotary_dim)
    elif kind is RopeType.YARN:
        inv_freq = _yarn(cfg.rope_theta, cfg.rotary_dim, scaling.factor, scaling.original_max_position_embeddings,
                         scaling.beta_fast, scaling.beta_slow, scaling.truncate)
    elif kind is RopeType.LLAMA3:
        inv_freq = _llama3(inv_freq, scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor,
                           scaling.original_max_position_embeddings)
    elif kind is RopeType.LONGROPE:
        ext = scaling.long_factor if longrope_uses_long_factors(cfg) else scaling.short_factor
        inv_freq = inv_freq / np.asarray(ext, np.float64)
    return inv_freq.astype(np.float32)


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor HF multiplies cos and sin by (so q.k scales by its square): YaRN's 0.1 ln(factor) + 1 (or its
    mscale ratio) and LongRoPE's sqrt(1 + ln(factor) / ln(original_max)), resolved from `config.json` when it is
    read (`models.config_readers.rope_scaling_from_hf`); 1 for the other types."""
    return 1.0 if cfg.rope_scaling is None else cfg.rope_scaling.attention_factor


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, attention_factor: float = 1.0) -> jax.Array:
    """Rotates the first R = 2 * len(inv_freq) channels of x[T, heads, H] by position (half-split "rotate_half"
    convention within them, as HF Llama / Phi-3), scaled by `attention_factor`; channels R: pass unchanged."""
    rotary_dim = 2 * inv_freq.shape[0]
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, R/2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]  # [T, 1, R/2]
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32[..., :rotary_dim], 2, axis=-1)
    parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if rotary_dim < x.shape[-1]:
        parts.append(x32[..., rotary_dim:])
    return jnp.concatenate(parts, axis=-1).astype(x.dtype)
