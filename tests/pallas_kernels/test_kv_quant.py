"""Quantized KV pages (`pallas_kernels.kv_quant`): the round trip, `write_kv`, and paged attention over int8 and fp8
pages in the reference, the TPU kernel and the GPU kernel (interpret mode on CPU, lowering for real targets).

Formats: "int8"; "fp8", float8_e4m3fn stored as uint8 bit patterns (the engine's storage); "fp8-native", the same
numbers as a float8_e4m3fn array (accepted by every op, checked on the reference).

Tolerances and why:
- Round trip, per element: int8 |err| <= scale / 2 (round to nearest multiple of the scale); e4m3 |err| <=
  2^-4 |x| + 2^-10 scale (3 mantissa bits: half an ulp is at most 2^-4 of a normal value; subnormals, below
  2^-6 in scaled units, are spaced 2^-9 apart). Both plus 2^-22 |x| for the f32 division and product.
- Quantized attention vs f32 attention over the dequantized cache: 1e-5 (the same numbers; only where the scale
  is multiplied in and the summation order differ).
- Quantized vs the original f32 cache, on unit-normal K/V (|x| <= ~3.5, so int8 steps of ~0.03 and e4m3 steps of
  up to 2^-3 relative): atol 0.05 (int8) and 0.2 (fp8); measured maxima on these cases were 0.019 and 0.086.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.block_sizes import BlockSizes
from pallas_kernels.kv_quant import FP8, FP8_BITS, QMAX, load_values
from pallas_kernels.paged_attention import (dequantize, paged_attention_gpu, paged_attention_reference,
                                            paged_attention_tpu, quantize, storage_dtype, write_kv)
from tests.pallas_kernels.test_paged_attention_kernels import GPU, TPU, Case, _abstract_args, _lower, build

FORMATS = {"int8": jnp.int8, "fp8": FP8_BITS, "fp8-native": FP8}
KERNELS = {"tpu": paged_attention_tpu, "gpu": paged_attention_gpu}
VS_FLOAT_ATOL = {"int8": 0.05, "fp8": 0.2, "fp8-native": 0.2}


def _vectors(seed: int = 0) -> np.ndarray:
    """[40, 3, 64] vectors over many magnitudes, an all-zero one and ones with a single large entry."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(40, 3, 64)) * 10.0 ** rng.uniform(-6, 4, size=(40, 3, 1))
    x[0, 0] = 0.0
    x[1, 1] = 0.0
    x[1, 1, 7] = -5.0  # one entry carries the scale: the rest quantize to 0
    x[2, 2, :] = 2.0 ** -12 * np.arange(64)  # a ramp through e4m3's subnormal range once scaled
    return x.astype(np.float32)


# --- quantize / dequantize --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_round_trip_error_bound(fmt):
    x = _vectors()
    values, scale = quantize(jnp.asarray(x), FORMATS[fmt])
    assert values.dtype == FORMATS[fmt] and scale.dtype == jnp.float32 and scale.shape == x.shape[:-1]
    x_back = np.asarray(dequantize(values, scale))
    scale = np.asarray(scale)[..., None]
    err = np.abs(x_back - x)
    if fmt == "int8":
        bound = scale / 2 + 2.0**-22 * np.abs(x)
    else:
        bound = 2.0**-4 * np.abs(x) + 2.0**-10 * scale + 2.0**-22 * np.abs(x)
    assert np.all(err <= bound), float(np.max(err - bound))
    assert np.isfinite(x_back).all()
    np.testing.assert_array_equal(x_back[0, 0], 0.0)  # all-zero vector: scale 0, no 0 / 0
    assert scale[0, 0] == 0.0
    # The absmax maps onto the format's largest magnitude, and the round trip really loses something (the bound
    # above is not met by returning x).
    qmax = np.max(np.abs(np.asarray(load_values(values, jnp.float32))), axis=-1)
    np.testing.assert_array_equal(qmax[scale[..., 0] > 0], QMAX[jnp.dtype(FORMATS[fmt])])
    assert np.max(err / np.maximum(bound, 1e-30)) > 0.3


def test_fp8_bit_patterns_decode_like_float8_e4m3fn():
    bits = np.arange(256, dtype=np.uint8)
    want = bits.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = ~np.isnan(want)  # 0x7f and 0xff: NaN, written only for NaN inputs (whose scale is NaN too)
    for dtype in (jnp.float32, jnp.bfloat16):
        got = np.asarray(load_values(jnp.asarray(bits), dtype).astype(jnp.float32))
        np.testing.assert_array_equal(got[finite], want[finite])
    x = jnp.asarray(_vectors(1))
    values_bits, scale_bits = quantize(x, FP8_BITS)
    values, scale = quantize(x, FP8)
    np.testing.assert_array_equal(np.asarray(values_bits), np.asarray(values).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scale_bits), np.asarray(scale))
    assert storage_dtype(FP8) == FP8_BITS and storage_dtype(jnp.int8) == jnp.int8


def test_quantize_refuses_a_float_dtype():
    with pytest.raises(ValueError, match="bfloat16 is not a quantized KV dtype"):
        quantize(jnp.ones((2, 4)), jnp.bfloat16)


# --- write_kv ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_write_kv_quantizes_values_and_scales_into_addressed_slots(fmt):
    rng = np.random.default_rng(3)
    layers, pages, heads, ps, hd = 2, 5, 2, 4, 8
    dtype = FORMATS[fmt]
    k_pages = jnp.asarray(rng.integers(0, 100, (layers, pages, heads, ps, hd)), dtype)
    k_scale = jnp.asarray(rng.uniform(1, 2, (layers, pages, heads, ps)), jnp.float32)
    loc = np.array([3 * ps + 1, 1 * ps + 0, 4 * ps + 3])
    new = rng.normal(size=(3, heads, hd)).astype(np.float32)
    out = write_kv(k_pages, k_pages, jnp.asarray(new), jnp.asarray(new), jnp.asarray(loc, jnp.int32), layer=1,
                   k_scale=k_scale, v_scale=k_scale)
    assert len(out) == 4 and out[0].dtype == dtype and out[2].dtype == jnp.float32
    want_values, want_scale = (np.asarray(a) for a in quantize(jnp.asarray(new), dtype))
    exp_pages, exp_scale = np.array(k_pages), np.array(k_scale)
    for t, p in enumerate(loc):
        exp_pages[1, p // ps, :, p % ps] = want_values[t]
        exp_scale[1, p // ps, :, p % ps] = want_scale[t]
    for got_pages, got_scale in ((out[0], out[2]), (out[1], out[3])):
        np.testing.assert_array_equal(np.asarray(got_pages), exp_pages)
        np.testing.assert_array_equal(np.asarray(got_scale), exp_scale)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("cuts", [(5,), (1, 2, 3), (7, 8), (3, 11)])
def test_a_pages_contents_do_not_depend_on_how_its_tokens_were_chunked(fmt, cuts):
    """The exact part of the quantized-cache guarantee (README, "KV cache quantization"): the same K/V vectors
    written in one call or in chunks (boundaries `cuts`, inside and across pages) give bit-identical values and
    scales, since every token is quantized with its own scale."""
    rng = np.random.default_rng(11)
    layers, pages, heads, ps, hd, n = 2, 6, 2, 4, 8, 13
    dtype = FORMATS[fmt]
    k_pages = jnp.zeros((layers, pages, heads, ps, hd), dtype)
    scale = jnp.zeros((layers, pages, heads, ps), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(n, heads, hd)) * 3, jnp.float32) for _ in range(2))
    loc = jnp.asarray(ps + np.arange(n), jnp.int32)  # pages 1.. of the sequence
    whole = write_kv(k_pages, k_pages, k, v, loc, layer=1, k_scale=scale, v_scale=scale)
    parts = (k_pages, k_pages, scale, scale)
    for lo, hi in zip((0, *cuts), (*cuts, n)):
        parts = write_kv(parts[0], parts[1], k[lo:hi], v[lo:hi], loc[lo:hi], layer=1, k_scale=parts[2],
                         v_scale=parts[3])
    for a, b in zip(whole, parts):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    written = np.asarray(whole[2])[1, np.asarray(loc) // ps, :, np.asarray(loc) % ps]  # [n, heads]
    assert written.min() > 0  # every written slot got its scale


def test_write_kv_needs_scales_exactly_for_quantized_pages():
    k = jnp.zeros((3, 2, 4, 8), jnp.int8)
    s = jnp.zeros((3, 2, 4), jnp.float32)
    new, loc = jnp.ones((1, 2, 8)), jnp.asarray([5], jnp.int32)
    with pytest.raises(ValueError, match="int8 pages need k_scale and v_scale"):
        write_kv(k, k, new, new, loc)
    with pytest.raises(ValueError, match="these pages are float32"):
        write_kv(k.astype(jnp.float32), k.astype(jnp.float32), new, new, loc, k_scale=s, v_scale=s)
    with pytest.raises(ValueError, match=r"v_scale must be f32\[3, 2, 4\]"):
        write_kv(k, k, new, new, loc, k_scale=s, v_scale=s[:, :1])
    assert len(write_kv(k.astype(jnp.bfloat16), k.astype(jnp.bfloat16), new, new, loc)) == 2  # float call unchanged


# --- paged attention over quantized pages -----------------------------------------------------------------------


def _quantized(case: Case, fmt: str, seed: int):
    """`build(case)` with its cache quantized: (float args, quantized args, scales dict, kw, real token rows)."""
    args, kw, num_tokens = build(case, seed)
    q, k, v, *rest = args
    (kq, ks), (vq, vs) = quantize(k, FORMATS[fmt]), quantize(v, FORMATS[fmt])
    return args, (q, kq, vq, *rest), dict(k_scale=ks, v_scale=vs), kw, num_tokens


def _dequantized(qargs, scales):
    q, kq, vq, *rest = qargs
    return (q, dequantize(kq, scales["k_scale"]), dequantize(vq, scales["v_scale"]), *rest)


# Small (the TPU kernel's per-page loop costs interpret time); lengths around pages, decodes beside prefills.
CASES = [
    Case(seqs=((1, 33), (5, 0), (9, 16)), group=3, block_sizes=BlockSizes(8, 32)),  # SmolLM2 heads, 2 pages/block
    Case(seqs=((1, 70), (3, 30)), group=2, block_sizes=BlockSizes(4, 16, 2), num_layers=2),  # stacked, split-K
    Case(seqs=((1, 40), (6, 9)), group=1, soft_cap=5.0, sliding_window=9, block_sizes=BlockSizes(8, 32)),
]


@pytest.mark.parametrize("fmt,case", [("int8", 0), ("fp8", 1), ("fp8-native", 2), ("int8", 2)])
def test_reference_equals_attention_over_the_dequantized_cache(fmt, case):
    args, qargs, scales, kw, n = _quantized(CASES[case], fmt, seed=case)
    got = np.asarray(paged_attention_reference(*qargs, **kw, **scales))
    want = np.asarray(paged_attention_reference(*_dequantized(qargs, scales), **kw))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[n:], 0.0)
    original = np.asarray(paged_attention_reference(*args, **kw))
    np.testing.assert_allclose(got, original, rtol=0, atol=VS_FLOAT_ATOL[fmt])
    assert np.abs(got - original).max() > 1e-4  # quantization does change the numbers


@pytest.mark.parametrize("backend", sorted(KERNELS) + ["reference"])
def test_both_scales_are_applied(backend):
    """Doubling every value scale doubles the output (attention is linear in V); doubling every key scale equals
    attention over doubled dequantized keys, which differs from the undoubled output: an op that ignored either
    scale fails."""
    case = CASES[0]
    _, qargs, scales, kw, _ = _quantized(case, "int8", seed=7)
    fn = paged_attention_reference if backend == "reference" else functools.partial(
        KERNELS[backend], block_sizes=case.block_sizes, interpret=True)
    base = np.asarray(fn(*qargs, **kw, **scales))
    doubled_v = np.asarray(fn(*qargs, **kw, k_scale=scales["k_scale"], v_scale=2 * scales["v_scale"]))
    np.testing.assert_allclose(doubled_v, 2 * base, rtol=1e-5, atol=1e-5)
    doubled_k = np.asarray(fn(*qargs, **kw, k_scale=2 * scales["k_scale"], v_scale=scales["v_scale"]))
    q, k, v, *rest = _dequantized(qargs, scales)
    want = np.asarray(paged_attention_reference(q, 2 * k, v, *rest, **kw))
    np.testing.assert_allclose(doubled_k, want, rtol=1e-5, atol=1e-5)
    assert np.abs(doubled_k - base).max() > 0.1


@pytest.mark.parametrize("backend,fmt,case", [("tpu", "fp8", 2), ("gpu", "fp8", 1)])  # int8: the test above
def test_kernel_matches_reference_on_quantized_pages(backend, fmt, case):
    _, qargs, scales, kw, n = _quantized(CASES[case], fmt, seed=10 + case)
    want = np.asarray(paged_attention_reference(*qargs, **kw, **scales))
    got = KERNELS[backend](*qargs, **kw, **scales, block_sizes=CASES[case].block_sizes, interpret=True)
    assert got.shape == qargs[0].shape and got.dtype == qargs[0].dtype
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_tpu_kernel_on_quantized_pages_under_tpu_interpret_mode():
    # TPU memory spaces and DMAs simulated (~3 ms a grid step: tiny), incl. the scale-row copies and their races.
    case = Case(seqs=((1, 20), (3, 5)), group=3, num_kv_heads=1, page_size=8, head_dim=64,
                block_sizes=BlockSizes(4, 16, 2))
    _, qargs, scales, kw, _ = _quantized(case, "int8", seed=5)
    want = np.asarray(paged_attention_reference(*qargs, **kw, **scales))
    got = paged_attention_tpu(*qargs, **kw, **scales, block_sizes=case.block_sizes,
                              interpret=pltpu.InterpretParams(detect_races=True))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", sorted(KERNELS) + ["reference"])
def test_misshapen_or_missing_scales_raise(backend):
    fn = paged_attention_reference if backend == "reference" else functools.partial(KERNELS[backend], interpret=True)
    _, qargs, scales, kw, _ = _quantized(Case(seqs=((1, 5),), group=2), "int8", seed=0)
    with pytest.raises(ValueError, match="need k_scale and v_scale"):
        fn(*qargs, **kw)
    with pytest.raises(ValueError, match="k_scale must be f32"):
        fn(*qargs, **kw, k_scale=scales["k_scale"][:, :1], v_scale=scales["v_scale"])
    with pytest.raises(ValueError, match="k_scale must be f32"):
        fn(*qargs, **kw, k_scale=scales["k_scale"].astype(jnp.bfloat16), v_scale=scales["v_scale"])


# --- lowering for real targets (no hardware: an abstract device) -------------------------------------------------


@pytest.mark.parametrize("fmt,shape", [("int8", (8, 1, 9, 3, 64, 16)), ("fp8", (2, 64, 32, 8, 128, 64))],
                         ids=["int8-smollm2-decode", "fp8-llama3-prefill"])
@pytest.mark.parametrize("backend", sorted(KERNELS))
def test_kernels_lower_with_quantized_pages_at_32k_context(backend, fmt, shape):
    b, tq, n, k, h, ps = shape
    args = list(_abstract_args(b, tq, n, k, h, ps, 32768, jnp.bfloat16))
    args[1] = args[2] = jax.ShapeDtypeStruct(args[1].shape, FORMATS[fmt])
    scale = jax.ShapeDtypeStruct(args[1].shape[:-1], jnp.float32)
    device, platform, marker = (TPU, "tpu", "tpu_custom_call") if backend == "tpu" else \
        (GPU, "cuda", "__gpu$xla.gpu.triton")

    def kernel(*a, **kw):  # the scales as traced positional arguments after the usual seven
        return KERNELS[backend](*a[:7], k_scale=a[7], v_scale=a[8], **kw)

    assert marker in _lower(kernel, device, platform, (*args, scale, scale), max_q_len=tq, sm_scale=0.1)
