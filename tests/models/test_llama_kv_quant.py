"""models.llama with an int8 / fp8 KV cache (`KVCache` with scales) on a tiny random model: every attention path
of `forward` reads the numbers the cache holds.

Oracles: the same model's logits computed another way (one prefill vs chunks, flash vs paged path, scanned vs
unrolled layers) must agree to float rounding (1e-4, as the f32 tests of test_llama.py; measured < 2e-6), and
the quantized cache must stay close to, but not equal, the f32 cache (measured max |logit difference| 0.023 for
int8 and 0.17 for fp8 at logit std ~1; bounds 0.1 and 0.5).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine.runner import ModelRunner
from jaxinfer.scheduler.chunk import ScheduledChunk
from models.config import ModelConfig
from models.llama import KVCache, Weights, WeightSpec
from pallas_kernels.dispatch import AttentionOps
from pallas_kernels.flash_attention import flash_attention_reference
from pallas_kernels.paged_attention import paged_attention_reference

CFG = ModelConfig(
    architecture="llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=8, rope_theta=10000.0, max_position_embeddings=128,
)
KV_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
VS_F32_BOUND = {"int8": 0.1, "fp8": 0.5}
# The reference ops plus a flash path for fresh prefills, as the TPU / GPU backends have.
WITH_FLASH = AttentionOps("reference-with-flash", paged_attention_reference, flash_attention_reference)


def random_weights(cfg: ModelConfig, seed: int = 0) -> Weights:
    """`init_weights`' distribution drawn with numpy: no per-shape compile of jax.random (seconds on 2 cores)."""
    rng = np.random.default_rng(seed)

    def draw(spec: WeightSpec) -> jax.Array:
        if spec.init_scale is None:
            return jnp.ones(spec.shape, jnp.float32)
        return jnp.asarray(rng.normal(0.0, spec.init_scale, spec.shape).astype(np.float32))

    return jax.tree.map(draw, Weights.abstract(cfg), is_leaf=lambda x: isinstance(x, WeightSpec))


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG)


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(1).integers(0, CFG.vocab_size, 40).tolist()


@pytest.fixture(scope="module")
def f32_logits(weights, prompt):
    runner = ModelRunner(CFG, weights, num_pages=24, page_size=16, kv_dtype=jnp.float32)
    return runner.compute_logits([ScheduledChunk(prompt, 0, [5, 2, 9])])


def test_zeros_and_bytes_per_page():
    smollm2 = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                          num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)
    # per token and KV head: 64 values + (quantized) one f32 scale, for K and V, over 30 layers and 3 KV heads
    assert KVCache.bytes_per_page(smollm2, 16, jnp.float32) == 30 * 2 * 3 * 16 * 64 * 4 == 737280
    assert KVCache.bytes_per_page(smollm2, 16, jnp.bfloat16) == 30 * 2 * 3 * 16 * 64 * 2
    for dtype in KV_DTYPES.values():
        assert KVCache.bytes_per_page(smollm2, 16, dtype) == 30 * 2 * 3 * 16 * (64 + 4) == 195840
    cache = KVCache.zeros(CFG, 6, 4, jnp.float8_e4m3fn)
    assert cache.quantized and cache.k.dtype == jnp.uint8  # fp8 stored as its bit patterns
    assert cache.k.shape == (2, 6, 2, 4, 8) and cache.k_scale.shape == cache.v_scale.shape == (2, 6, 2, 4)
    assert cache.k_scale.dtype == jnp.float32 and cache.k is not cache.v and cache.k_scale is not cache.v_scale
    assert KVCache.zeros(CFG, 6, 4, jnp.int8).k.dtype == jnp.int8
    plain = KVCache.zeros(CFG, 6, 4, jnp.bfloat16)
    assert not plain.quantized and plain.k_scale is None and plain.scale_args() == {}


def code_ranks(runner: ModelRunner, pages: list[int], num_tokens: int) -> np.ndarray:
    """The K and V codes of positions [0, num_tokens) on `pages`, as integers ordered like the numbers they encode
    (int8 as is; fp8 bits as sign * (exponent | mantissa), monotone in the value): [2, L, K, num_tokens, H]."""
    out = []
    for values in (runner.kv_cache.k, runner.kv_cache.v):
        v = np.asarray(values)[:, pages].astype(np.int32)  # [L, p, K, page_size, H]
        v = v.transpose(0, 2, 1, 3, 4).reshape(v.shape[0], v.shape[2], -1, v.shape[-1])[:, :, :num_tokens]
        out.append(v if values.dtype == jnp.int8 else np.where(v >= 0x80, -(v & 0x7F), v))
    return np.stack(out)


def assert_same_cached_numbers(got: np.ndarray, want: np.ndarray, got_codes: np.ndarray, want_codes: np.ndarray,
                               quantization_error: float) -> None:
    """Two paths that read the numbers the cache holds agree to f32 rounding (1e-4) when they wrote the same codes.

    They may not write the same codes: the K/V they quantize come from matmuls of other shapes (20 vs 40 rows,
    scanned vs unrolled layers), which may differ in the last f32 bit, and a value within that of a rounding
    boundary lands on the neighbouring code (seen for fp8 on an Intel Xeon: chunked vs one-shot logits 1.1e-2
    apart). One such flip moves one value by one step, twice its largest rounding error; flipping a random code by
    hand here moved the logits by up to 0.56x (int8) and 0.07x (fp8) of `quantization_error`, what all rounding
    errors together move them by (vs the f32 cache). So: codes equal except at most 4 one-step flips (reading or
    writing the wrong page, scale or layout changes many codes or many steps), and logits within 1e-4 with no flip,
    within `quantization_error` with some."""
    steps = np.abs(got_codes - want_codes)
    assert steps.max() <= 1 and (steps > 0).sum() <= 4, (steps.max(), (steps > 0).sum())
    tolerance = 1e-4 if not steps.any() else quantization_error
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("name", sorted(KV_DTYPES))
def test_quantized_cache_paths_agree(weights, prompt, f32_logits, name):
    """One prefill (scanned layers), the same prompt in two chunks on other pages (a prefix-cache hit reads the
    first chunk's pages), and the flash path of a fresh prefill (unrolled layers; it attends over fake-quantized
    K/V) all give the same logits, and so does a decode over either cache; and they differ from f32."""
    dtype = KV_DTYPES[name]
    runner = ModelRunner(CFG, weights, num_pages=24, page_size=16, kv_dtype=dtype, scan_layers=True)
    full = runner.compute_logits([ScheduledChunk(prompt, 0, [5, 2, 9])])
    error = np.abs(full - f32_logits).max()
    chunked = np.concatenate([runner.compute_logits([ScheduledChunk(prompt[:20], 0, [11, 3, 17])]),
                              runner.compute_logits([ScheduledChunk(prompt[20:], 20, [11, 3, 17])])])
    full_codes = code_ranks(runner, [5, 2, 9], len(prompt))
    assert_same_cached_numbers(chunked, full, code_ranks(runner, [11, 3, 17], len(prompt)), full_codes, error)
    flash = ModelRunner(CFG, weights, num_pages=24, page_size=16, kv_dtype=dtype, attention=WITH_FLASH)
    flash_full = flash.compute_logits([ScheduledChunk(prompt, 0, [5, 2, 9])])
    flash_codes = code_ranks(flash, [5, 2, 9], len(prompt))
    assert_same_cached_numbers(flash_full, full, flash_codes, full_codes, error)
    nxt = [ScheduledChunk([7], len(prompt), [5, 2, 9])]
    assert_same_cached_numbers(flash.compute_logits(nxt), runner.compute_logits(nxt), flash_codes, full_codes,
                               error)
    assert 1e-4 < error < VS_F32_BOUND[name], error
    assert runner.kv_cache.k.dtype == jnp.dtype(dtype if name == "int8" else jnp.uint8)
    # the scales of positions 0..40 (prompt and decode token) are written, those of the rest of page 9 not
    scales = np.asarray(runner.kv_cache.v_scale)[:, [5, 2, 9]].transpose(0, 2, 1, 3).reshape(2, 2, 48)  # [L, K, S]
    assert (scales[..., : len(prompt) + 1] > 0).all() and (scales[..., len(prompt) + 1:] == 0).all()
