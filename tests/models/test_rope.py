"""RoPE (`models.rope`): every frequency schedule and attention factor against transformers' own initializers
(tests/data/rope_golden.json from `ROPE_INIT_FUNCTIONS`, scripts/make_golden.py), Llama 3's also against its
published formula written out here, GGUF's YaRN keys against the HF schedule they stand for, and the rotation
(partial, scaled) against NumPy."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig, RopeScaling, RopeType
from models.rope import (apply_rope, dynamic_ntk_theta, longrope_uses_long_factors, rope_attention_factor,
                         rope_frequencies)

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


# --- every rope type against transformers' own initializers (tests/data/rope_golden.json) ---------------------------

GOLDEN = json.loads((Path(__file__).resolve().parents[1] / "data" / "rope_golden.json").read_text())
CASES = {case["name"]: case for case in GOLDEN["cases"]}


def _hf_record_matches_ours(cfg: ModelConfig, record: dict) -> ModelConfig | None:
    """The config whose static schedule HF's `record` (frequencies at `seq_len`, None: at init) should equal, or
    None when our static form has no counterpart (dynamic beyond max_position_embeddings)."""
    seq_len = record["seq_len"]
    kind = cfg.rope_scaling.rope_type
    if kind is RopeType.LONGROPE:  # the short factors up to original_max, the long ones beyond: by our context
        original = cfg.rope_scaling.original_max_position_embeddings
        return dataclasses.replace(cfg, max_position_embeddings=max(seq_len or 0, original))
    if kind is RopeType.DYNAMIC and seq_len is not None and seq_len > cfg.max_position_embeddings:
        return None
    return cfg


@pytest.mark.parametrize("name", list(CASES))
def test_rope_frequencies_and_attention_factor_match_transformers(name):
    case = CASES[name]
    cfg = ModelConfig.from_hf_config(case["config"])
    assert cfg.rope_scaling.rope_type.value == case["hf"][0]["rope_type"]
    compared = 0
    for record in case["hf"]:
        ours = _hf_record_matches_ours(cfg, record)
        if ours is None:
            continue
        got = rope_frequencies(ours)
        assert got.shape == (cfg.rotary_dim // 2,) and got.dtype == np.float32
        np.testing.assert_allclose(got, np.array(record["inv_freq"]), rtol=2e-6, err_msg=f"seq_len={record['seq_len']}")
        assert rope_attention_factor(ours) == pytest.approx(record["attention_factor"], rel=1e-12)
        compared += 1
    assert compared >= 1


def test_dynamic_ntk_base_matches_transformers_beyond_max_position_embeddings():
    # HF recomputes the base when a sequence outgrows max_position_embeddings; we do not (the static form), but the
    # formula we apply is the same one: check it at every length HF was asked about, 512 included.
    case = CASES["dynamic"]
    cfg = ModelConfig.from_hf_config(case["config"])
    R = cfg.rotary_dim
    for record in case["hf"]:
        seq_len = record["seq_len"] or cfg.max_position_embeddings
        theta = dynamic_ntk_theta(cfg.rope_theta, cfg.rope_scaling.factor, R, cfg.max_position_embeddings, seq_len)
        expected = 1.0 / theta ** (np.arange(0, R, 2) / R)
        np.testing.assert_allclose(expected, np.array(record["inv_freq"]), rtol=2e-6)
    assert [r["seq_len"] for r in case["hf"]][-1] > cfg.max_position_embeddings  # the case reaches past it
    assert CASES["dynamic"]["hf"][-1]["inv_freq"] != CASES["dynamic"]["hf"][0]["inv_freq"]


def test_longrope_picks_its_factors_once_by_the_context():
    cfg = ModelConfig.from_hf_config(CASES["longrope_phi3"]["config"])  # context 256 > original 32
    short, long = (np.array(r["inv_freq"]) for r in CASES["longrope_phi3"]["hf"][::2])  # seq_len None, 33
    assert longrope_uses_long_factors(cfg)
    np.testing.assert_allclose(rope_frequencies(cfg), long, rtol=2e-6)
    four_k = ModelConfig.from_hf_config(CASES["longrope_phi3_su_legacy"]["config"])  # context = original 64
    assert not longrope_uses_long_factors(four_k)
    assert not np.allclose(short, long)


@pytest.mark.parametrize("rope, match", [
    ({"rope_type": "cubic", "factor": 2.0}, "rope type 'cubic' is not supported"),
    ({"rope_type": "proportional", "factor": 2.0}, "rope type 'proportional' is not supported"),
    ({"rope_type": "yarn"}, "missing key 'factor'"),
])
def test_unsupported_or_incomplete_rope_scaling_is_a_value_error(rope, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config({**CASES["linear"]["config"], "rope_scaling": rope})


def test_longrope_factors_must_cover_the_rotated_pairs():
    config = json.loads(json.dumps(CASES["longrope_phi3"]["config"]))
    config["rope_scaling"]["long_factor"] = config["rope_scaling"]["long_factor"][:-1]
    with pytest.raises(ValueError, match="short_factor has 6 entries but long_factor 5"):
        ModelConfig.from_hf_config(config)
    config["partial_rotary_factor"] = 1.0  # 8 pairs now, 6 factors each
    config["rope_scaling"]["long_factor"] = CASES["longrope_phi3"]["config"]["rope_scaling"]["long_factor"]
    with pytest.raises(ValueError, match="short_factor needs rotary_dim / 2 = 8 entries, got 6"):
        ModelConfig.from_hf_config(config)


def _gguf_meta(config: dict, **rope_keys) -> dict:
    """GGUF metadata of a golden case's config (llama.cpp key names), with `<arch>.rope.scaling.*` keys."""
    arch = config["model_type"]
    meta = {"general.architecture": arch, f"{arch}.embedding_length": config["hidden_size"],
            f"{arch}.attention.head_count": config["num_attention_heads"],
            f"{arch}.attention.head_count_kv": config["num_key_value_heads"],
            f"{arch}.feed_forward_length": config["intermediate_size"], f"{arch}.block_count": 1,
            f"{arch}.context_length": config["max_position_embeddings"], f"{arch}.rope.freq_base": config["rope_theta"],
            f"{arch}.vocab_size": config["vocab_size"]}
    return {**meta, **{f"{arch}.rope.scaling.{k}": v for k, v in rope_keys.items()}}


def test_gguf_yarn_matches_the_hf_schedule_it_was_converted_from():
    case = CASES["yarn"]
    scaling = case["config"]["rope_scaling"]
    original = scaling["original_max_position_embeddings"]
    cfg = ModelConfig.from_gguf_metadata(_gguf_meta(case["config"], type="yarn", factor=scaling["factor"],
                                                    original_context_length=original))
    np.testing.assert_allclose(rope_frequencies(cfg), np.array(case["hf"][0]["inv_freq"]), rtol=2e-6)
    assert rope_attention_factor(cfg) == pytest.approx(case["hf"][0]["attention_factor"], rel=1e-12)
    betas = _gguf_meta(case["config"], type="yarn", factor=4.0, yarn_beta_fast=16.0, yarn_beta_slow=2.0)
    assert (ModelConfig.from_gguf_metadata(betas).rope_scaling.beta_fast,
            ModelConfig.from_gguf_metadata(betas).rope_scaling.original_max_position_embeddings) == (16.0, 256)


@pytest.mark.parametrize("keys, match", [
    (dict(type="yarn", factor=4.0, yarn_log_multiplier=0.1), "yarn_log_multiplier=0.1 is not supported"),
    (dict(type="longrope", factor=4.0), "rope.scaling.type='longrope' is not supported"),
])
def test_gguf_rope_scaling_we_do_not_read_is_named(keys, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_gguf_metadata(_gguf_meta(CASES["yarn"]["config"], **keys))


# --- the rotation ---------------------------------------------------------------------------------------------------


def _rope_numpy(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, factor: float) -> np.ndarray:
    """HF's rotation written out: the first R channels become x_r * cos + rotate_half(x_r) * sin, with cos and sin
    of cat(angles, angles) times `factor`; the other channels pass."""
    R = 2 * len(inv_freq)
    angles = positions[:, None] * inv_freq[None, :]
    cos = np.cos(np.concatenate([angles, angles], -1))[:, None, :] * factor
    sin = np.sin(np.concatenate([angles, angles], -1))[:, None, :] * factor
    xr = x[..., :R]
    rotate_half = np.concatenate([-xr[..., R // 2:], xr[..., :R // 2]], -1)
    return np.concatenate([xr * cos + rotate_half * sin, x[..., R:]], -1)


@pytest.mark.parametrize("rotary_dim, factor", [(16, 1.0), (12, 1.0), (12, 1.2649)])
def test_apply_rope_rotates_the_first_rotary_dim_channels_only(rotary_dim, factor):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 3, 16)).astype(np.float32)
    positions = np.array([0, 1, 7, 31, 200])
    inv_freq = (10000.0 ** (-np.arange(0, rotary_dim, 2) / rotary_dim)).astype(np.float32)
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions), inv_freq, factor))
    np.testing.assert_allclose(got, _rope_numpy(x, positions, inv_freq.astype(np.float64), factor), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_array_equal(got[..., rotary_dim:], x[..., rotary_dim:])
    np.testing.assert_allclose(got[0], x[0] * np.where(np.arange(16) < rotary_dim, factor, 1.0), rtol=1e-6)
