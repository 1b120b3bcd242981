"""RoPE frequency schedules (`models.rope`): the default and linear ones, and Llama 3's against its published formula
written out here."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from models.config import ModelConfig, RopeScaling, RopeType
from models.rope import rope_frequencies

CFG = ModelConfig(
    architecture="llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=8, rope_theta=10000.0, max_position_embeddings=128,
)


def _llama31_inv_freq(head_dim: int, theta: float, factor: float, low_freq_factor: float, high_freq_factor: float,
                      original_max: int) -> tuple[np.ndarray, list[str]]:
    """The Llama 3.1 schedule, one frequency at a time, from its published description.

    Base RoPE frequency of pair i: theta ** (-2i / head_dim); wavelength 2 pi / freq.
      wavelength < original_max / high_freq_factor (high frequencies): unchanged;
      wavelength > original_max / low_freq_factor (low frequencies): divided by `factor`;
      otherwise: smooth = (original_max / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor),
                 freq = (1 - smooth) * freq / factor + smooth * freq.
    Returns the frequencies and which band each fell in.
    """
    freqs, bands = [], []
    for i in range(head_dim // 2):
        freq = theta ** (-2.0 * i / head_dim)
        wavelength = 2.0 * math.pi / freq
        if wavelength < original_max / high_freq_factor:
            freqs.append(freq)
            bands.append("high")
        elif wavelength > original_max / low_freq_factor:
            freqs.append(freq / factor)
            bands.append("low")
        else:
            smooth = (original_max / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
            freqs.append((1.0 - smooth) * freq / factor + smooth * freq)
            bands.append("mid")
    return np.array(freqs), bands


@pytest.mark.parametrize("head_dim, theta, factor, low, high, original_max", [
    (128, 500000.0, 8.0, 1.0, 4.0, 8192),  # Llama 3.1 8B
    (64, 500000.0, 32.0, 1.0, 4.0, 8192),  # Llama 3.2 1B
    (16, 10000.0, 8.0, 1.0, 4.0, 32),  # tests/data/tiny_llama3
])
def test_rope_frequencies_llama3_matches_published_formula(head_dim, theta, factor, low, high, original_max):
    cfg = dataclasses.replace(
        CFG, head_dim=head_dim, num_heads=2, num_kv_heads=1, rope_theta=theta,
        rope_scaling=RopeScaling(RopeType.LLAMA3, factor=factor, low_freq_factor=low, high_freq_factor=high,
                                 original_max_position_embeddings=original_max))
    expected, bands = _llama31_inv_freq(head_dim, theta, factor, low, high, original_max)
    if head_dim >= 64:
        assert set(bands) == {"high", "mid", "low"}  # the case exercises all three branches
    got = rope_frequencies(cfg)
    assert got.shape == (head_dim // 2,) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_rope_frequencies_default_and_linear():
    expected = np.array([10000.0 ** (-2.0 * i / CFG.head_dim) for i in range(CFG.head_dim // 2)])
    np.testing.assert_allclose(rope_frequencies(CFG), expected, rtol=1e-6)
    linear = dataclasses.replace(CFG, rope_scaling=RopeScaling(RopeType.LINEAR, factor=4.0))
    np.testing.assert_allclose(rope_frequencies(linear), expected / 4.0, rtol=1e-6)
