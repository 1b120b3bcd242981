"""Rotary position embeddings (RoPE, Su et al. 2021): the inverse-frequency schedule a config asks for (default,
linear, Llama 3) and the rotation of query and key heads by position."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig, RopeType


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies f32[H/2] of RoPE, with the configured scaling.

    Llama 3 schedule: wavelengths longer than `original_max / low_freq_factor` are divided by `factor`, shorter
    than `original_max / high_freq_factor` kept, and the band between interpolated smoothly (Llama 3 paper, 2024).
    """
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(half, dtype=np.float64) * 2.0 / cfg.head_dim))
    scaling = cfg.rope_scaling
    if scaling is None or scaling.rope_type is RopeType.DEFAULT:
        return inv_freq.astype(np.float32)
    if scaling.rope_type is RopeType.LINEAR:
        return (inv_freq / scaling.factor).astype(np.float32)
    old = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    out = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, interpolated)
    out = np.where(wavelen < high_wavelen, inv_freq, out)
    return out.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates x[T, heads, H] by position (half-split "rotate_half" convention, as HF Llama)."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]  # [T, 1, H/2]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
