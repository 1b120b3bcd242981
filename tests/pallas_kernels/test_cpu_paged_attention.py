"""The native CPU paged decode attention (`pallas_kernels.cpu_gemv.paged_attention`) against a float64 numpy oracle
written here and against `paged_attention_reference`, and its routing (`pallas_kernels.dispatch`, the off switch,
the multi-device rule)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_gemv
from pallas_kernels.cpu_gemv import build
from pallas_kernels.cpu_gemv.paged_attention import (MAX_Q_LEN, paged_attention_cpu, paged_attention_native,
                                                     uses_native)
from pallas_kernels.dispatch import select_attention
from pallas_kernels.kv_quant import load_values, quantize, storage_dtype
from pallas_kernels.paged_attention import paged_attention_reference


@pytest.fixture(autouse=True)
def native_on(monkeypatch):
    assert build.supported_levels(), "this CPU runs no ISA level of the native kernels (AVX2 + FMA needed)"
    monkeypatch.delenv("JAXINFER_NATIVE_KERNELS", raising=False)
    assert cpu_gemv.active()


@dataclasses.dataclass(frozen=True)
class Case:
    kv_lens: tuple[int, ...]  # 0: a padding sequence (no query rows)
    q_len: int = 1  # rows per real sequence (every one of them <= kv_len)
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    page_size: int = 16
    dtype: str = "float32"  # pages: float32, bfloat16, int8, fp8 (uint8 bits)
    q_dtype: str = "float32"
    window: int | None = None
    cap: float | None = None
    layers: int = 2  # 0: a single layer's cache, no layer index
    extra_rows: int = 2  # padding query rows past cu_q_lens[-1]


CASES = {
    "one token, G=1": Case((1,), num_heads=2, num_kv_heads=2),
    "ragged batch of 5, page edges, bf16": Case((1, 16, 17, 0, 300), dtype="bfloat16", q_dtype="bfloat16"),
    "long contexts over several spans, G=4, H=96, window": Case((600, 513, 257), num_heads=8, num_kv_heads=2,
                                                                head_dim=96, window=100),
    "verify windows of 4, soft cap, H=80": Case((4, 40, 133), q_len=4, head_dim=80, cap=5.0, dtype="bfloat16"),
    "max verify window, window 7, pages of 8": Case((8, 9, 70), q_len=MAX_Q_LEN, page_size=8, window=7),
    "single layer cache, G=3, f32 q, bf16 pages": Case((5, 290), layers=0, dtype="bfloat16"),
    "int8 pages": Case((1, 64, 257), dtype="int8", q_len=2),
    "fp8 pages, bf16 q": Case((3, 0, 200), dtype="fp8", q_dtype="bfloat16", window=50),
    # the 512-bit code's row groups of at most 3 (G = 5: 3 + 2) and its masked lanes (H = 40: 16 + 16 + 8)
    "G=5, H=40, verify windows of 2, bf16": Case((2, 33, 150), q_len=2, num_heads=10, num_kv_heads=2, head_dim=40,
                                                 dtype="bfloat16", q_dtype="bfloat16"),
}


def _make(case: Case, seed: int = 0):
    """(args, kwargs for the ops, float64 dequantized pages [L?, P, K, ps, H] x2, q f64) for `case`."""
    rng = np.random.default_rng(seed)
    kv_lens = np.array(case.kv_lens, np.int32)
    q_lens = np.where(kv_lens > 0, np.minimum(case.q_len, kv_lens), 0)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    width = max(1, -(-int(kv_lens.max()) // case.page_size)) + 1  # one page spare
    num_pages = 1 + len(kv_lens) * width
    table = rng.permutation(np.arange(1, num_pages)).reshape(len(kv_lens), width).astype(np.int32)  # 0: null page
    layers = max(case.layers, 1)
    shape = (layers, num_pages, case.num_kv_heads, case.page_size, case.head_dim)
    q = jnp.asarray(rng.standard_normal((int(cu[-1]) + case.extra_rows, case.num_heads, case.head_dim)),
                    case.q_dtype)
    pages, scales, dequantized = [], [], []
    for _ in range(2):
        x = jnp.asarray(rng.standard_normal(shape) * 2, jnp.float32)
        if case.dtype in ("int8", "fp8"):
            values, scale = quantize(x, jnp.int8 if case.dtype == "int8" else storage_dtype(jnp.float8_e4m3fn))
            pages.append(values)
            scales.append(scale)
            dequantized.append(np.asarray(load_values(values, jnp.float32), np.float64) * np.asarray(scale)[..., None])
        else:
            pages.append(x.astype(case.dtype))
            dequantized.append(np.asarray(pages[-1], np.float64))
    if case.layers == 0:
        pages, scales, dequantized = [p[0] for p in pages], [s[0] for s in scales], [d[0] for d in dequantized]
    layer = None if case.layers == 0 else layers - 1
    kw = dict(max_q_len=case.q_len, sm_scale=case.head_dim ** -0.5, sliding_window=case.window, soft_cap=case.cap)
    if scales:
        kw.update(k_scale=scales[0], v_scale=scales[1])
    args = (q, *pages, jnp.asarray(kv_lens), jnp.asarray(table), jnp.asarray(cu), layer)
    return args, kw, dequantized, np.asarray(q, np.float64)


def _oracle(case: Case, args, kw, dequantized, q) -> np.ndarray:
    """Attention written out per row in float64: softmax over the visible positions, weighted values."""
    _, _, _, kv_lens, table, cu, layer = args
    k, v = (d if layer is None else d[layer] for d in dequantized)  # [P, K, ps, H]
    group = case.num_heads // case.num_kv_heads
    out = np.zeros(q.shape)
    for b, kv_len in enumerate(np.asarray(kv_lens)):
        start, q_len = int(cu[b]), int(cu[b + 1] - cu[b])
        pos = np.arange(kv_len)
        k_ctx = k[np.asarray(table)[b, pos // case.page_size], :, pos % case.page_size]  # [S, K, H]
        v_ctx = v[np.asarray(table)[b, pos // case.page_size], :, pos % case.page_size]
        for j in range(min(q_len, kw["max_q_len"])):
            p = kv_len - q_len + j
            seen = (pos <= p) & ((p - pos < case.window) if case.window else True)
            for n in range(case.num_heads):
                s = k_ctx[seen, n // group] @ q[start + j, n] * kw["sm_scale"]
                if case.cap:
                    s = case.cap * np.tanh(s / case.cap)
                w = np.exp(s - s.max())
                out[start + j, n] = w @ v_ctx[seen, n // group] / w.sum()
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_float64_oracle_and_reference(name, monkeypatch):
    """At every ISA level this CPU runs (the 256-bit code at avx2, the 512-bit one above it)."""
    case = CASES[name]
    args, kw, dequantized, q = _make(case)
    want = _oracle(case, args, kw, dequantized, q)
    ref = np.asarray(paged_attention_reference(*args, **kw), np.float64)
    # f32 throughout: f32 rounding. As the reference, the kernel rounds the probabilities to the values' dtype
    # (bf16 pages, or quantized ones with bf16 q: 2^-9 relative each); a bf16 output adds one rounding (2^-9).
    # (q rounded to bf16 is the oracle's input too.)
    rounded = case.dtype == "bfloat16" or case.q_dtype == "bfloat16"
    tol = 1e-2 if rounded else 1e-5
    scale = np.abs(want).max()
    for level in build.supported_levels():
        monkeypatch.setenv("JAXINFER_NATIVE_ISA", level)
        got = paged_attention_native(*args, **kw)  # the level is part of the jit key: traced under this one
        assert got.dtype == args[0].dtype and got.shape == args[0].shape
        got = np.asarray(got, np.float64)
        assert np.abs(got - want).max() <= tol * scale, (level, np.abs(got - want).max())
        assert np.abs(got - ref).max() <= tol * scale, (level, np.abs(got - ref).max())
        assert not got[int(args[5][-1]):].any()  # padding rows are 0


def test_each_level_set_later_names_its_own_kernel(monkeypatch):
    """A level set after another traced the same shapes (`bench quant --isa all`) calls its own kernel, inside an
    outer jit too: jit's trace of the first level must not be reused."""
    args, kw, _, _ = _make(CASES["one token, G=1"])
    for level in build.supported_levels():
        monkeypatch.setenv("JAXINFER_NATIVE_ISA", level)
        text = jax.jit(lambda *a: paged_attention_native(*a, **kw)).lower(*args).as_text()
        assert f"@{build.target_name('paged_attention', level)}" in text, level


def test_every_span_and_thread_gives_the_same_bits():
    case = CASES["long contexts over several spans, G=4, H=96, window"]
    args, kw, _, _ = _make(dataclasses.replace(case, window=None, kv_lens=(2000, 1, 700)))
    first = np.asarray(paged_attention_native(*args, **kw))
    for _ in range(3):  # the pool's threads take the spans in a different order each call
        assert np.array_equal(np.asarray(paged_attention_native(*args, **kw)), first)


def test_layer_index_reads_that_layer_in_place():
    args, kw, dequantized, q = _make(dataclasses.replace(CASES["one token, G=1"], kv_lens=(40, 3), layers=3))
    for layer in range(3):
        one = (*args[:6], layer)
        single = (args[0], args[1][layer], args[2][layer], *args[3:6], None)
        np.testing.assert_array_equal(np.asarray(paged_attention_native(*one, **kw)),
                                      np.asarray(paged_attention_native(*single, **kw)))

    def scan(q, k, v):  # the traced index of a jitted scan over layers
        def body(c, i):
            return c, paged_attention_native(q, k, v, *args[3:6], i, **kw)
        return jax.lax.scan(body, 0, jnp.arange(3))[1]
    stacked = jax.jit(scan)(*args[:3])
    for layer in range(3):
        np.testing.assert_array_equal(np.asarray(stacked[layer]),
                                      np.asarray(paged_attention_native(*args[:6], layer, **kw)))


def test_routing_decode_to_the_kernel_and_the_rest_to_the_reference(monkeypatch):
    ops = select_attention("auto", "cpu")
    assert ops.paged is paged_attention_cpu and ops.flash is None
    assert select_attention("reference", "cpu").paged is paged_attention_reference
    args, kw, _, _ = _make(CASES["ragged batch of 5, page edges, bf16"])

    def ffi_calls(**overrides) -> int:
        jaxpr = jax.make_jaxpr(lambda *a: paged_attention_cpu(*a, args[6], **{**kw, **overrides}))(*args[:6])
        return str(jaxpr).count("ffi_call")

    assert uses_native(args[0], args[1], max_q_len=1) and ffi_calls() == 1
    assert ffi_calls(max_q_len=MAX_Q_LEN + 1) == 0  # a prefill step: the reference
    assert not uses_native(args[0][..., :12], args[1][..., :12], max_q_len=1)  # head dim 12: not a multiple of 8
    assert not uses_native(args[0].astype(jnp.float16), args[1], max_q_len=1)
    with cpu_gemv.native_kernels(False):  # what `native_unless_sharded` sets on a multi-device mesh
        assert ffi_calls() == 0
    monkeypatch.setenv("JAXINFER_NATIVE_KERNELS", "0")
    assert not cpu_gemv.active() and ffi_calls() == 0
    np.testing.assert_array_equal(np.asarray(paged_attention_cpu(*args, **kw), np.float32),
                                  np.asarray(paged_attention_reference(*args, **kw), np.float32))


def test_bad_input_is_a_value_error():
    args, kw, _, _ = _make(CASES["one token, G=1"])
    with pytest.raises(ValueError, match="max_q_len"):
        paged_attention_native(*args, **{**kw, "max_q_len": MAX_Q_LEN + 1})
    with pytest.raises(ValueError, match="multiple of num kv heads"):
        paged_attention_native(args[0][:, :1].repeat(3, axis=1), *args[1:], **kw)
