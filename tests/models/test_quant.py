"""Weight quantization (`models.quant`, `models.quant_matmul`): round-trip error bounds, quantized matmuls against
references computed independently in numpy (float64), the model on quantized weights, and the compiled decode step's
buffers."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxinfer.benchmarks import hlo
from models import quant
from models.config import ModelConfig
from models.llama import AttentionMetadata, KVCache, forward, init_weights
from models.quant import QuantizationConfig, QuantizedWeight, quantize
from models.quant_matmul import embed_lookup, lookup_supports, native_matmuls, qeinsum
from pallas_kernels import cpu_gemv

TINY = ModelConfig(architecture="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True,
                   name="tiny-tied")


def _weight(shape, seed=0, outliers=True):
    w = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    if outliers:  # a few large entries, so channel scales differ a lot
        w.reshape(-1)[:: max(1, w.size // 7)] *= 20
    return w


def _np_channel_quant(w: np.ndarray, contract: tuple[int, ...], qmax: float, group: int = 0):
    """Reference quantizer in float64 numpy, in the weight's own layout: returns the dequantized weight and the
    scale broadcast to w's shape."""
    nd = w.ndim
    contract = tuple(a % nd for a in contract)
    kept = [a for a in range(nd) if a not in contract]
    wt = np.transpose(w.astype(np.float64), kept + list(contract))
    flat = wt.reshape(*wt.shape[: len(kept)], -1)
    g = flat.reshape(*flat.shape[:-1], -1, group) if group else flat[..., None, :]
    amax = np.abs(g).max(-1, keepdims=True)
    scale = np.where(amax > 0, amax / qmax, 1.0)
    scale_full = np.broadcast_to(scale, g.shape).reshape(wt.shape)
    return np.transpose(scale_full, np.argsort(kept + list(contract)))


# ---- round trip -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,contract", [((64, 4, 16), (-3,)), ((4, 16, 64), (-3, -2)), ((2, 64, 128), (-2,)),
                                            ((96, 64), (-1,))])
def test_int8_round_trip_error_is_at_most_half_a_step(shape, contract):
    w = _weight(shape)
    q = quantize(w, "int8", contract)
    assert q.values.dtype == jnp.int8 and q.shape == shape and q.scale.shape[-1] == 1
    back = np.asarray(q.dequantize())
    scale = _np_channel_quant(w, contract, 127.0)
    err = np.abs(back - w)
    assert np.all(err <= scale / 2 * (1 + 1e-5)), (err / scale).max()  # rounding to the nearest step
    assert np.abs(np.asarray(q.values)).max() == 127  # every channel's absmax lands on 127 (the whole range used)


@pytest.mark.parametrize("group", [0, 32])
def test_fp8_round_trip_error_is_within_e4m3_precision(group):
    """e4m3 has 3 mantissa bits: relative rounding error <= 2^-4 for normal values (|v| >= 2^-6 after scaling);
    subnormals are spaced 2^-9, so their absolute error is <= 2^-10 (times the scale)."""
    w = _weight((64, 4, 16) if not group else (2, 64, 96))
    contract = (-3,) if not group else (-2,)
    q = quantize(w, "fp8", contract, group_size=group)
    assert q.values.dtype == jnp.float8_e4m3fn
    back = np.asarray(q.dequantize())
    scale = _np_channel_quant(w, contract, 448.0, group)
    scaled = np.abs(w) / scale
    err = np.abs(back - w) / scale
    normal = scaled >= 2.0**-6
    assert np.all(err[normal] <= scaled[normal] * 2.0**-4 * (1 + 1e-5))
    assert np.all(err[~normal] <= 2.0**-10 * (1 + 1e-5))
    if group:
        assert q.scale.shape == (2, 96, 64 // group)


def test_zero_channels_and_bad_arguments():
    w = _weight((8, 6))
    w[:, 2] = 0
    q = quantize(w, "int8", (-2,))
    assert float(q.scale[2, 0]) == 1.0 and not np.any(np.asarray(q.dequantize())[:, 2])
    with pytest.raises(ValueError, match="format"):
        quantize(w, "int3", (-2,))
    with pytest.raises(ValueError, match="out of range"):
        quantize(w, "int8", (2,))
    with pytest.raises(ValueError, match="fp8"):
        quantize(w, "int8", (-2,), group_size=4)
    with pytest.raises(ValueError, match="does not divide"):
        quantize(w, "fp8", (-2,), group_size=5)
    with pytest.raises(ValueError, match="one scale per output channel"):
        quantize(w, "fp8", (-2,), group_size=4, quantize_activations=True)


# ---- matmuls --------------------------------------------------------------------------------------------------

EQUATIONS = [  # (einsum, x shape, w shape, contract axes): every projection of models/llama.py
    ("td,dnh->tnh", (5, 64), (64, 4, 16), (-3,)),
    ("tnh,nhd->td", (5, 4, 16), (4, 16, 64), (-3, -2)),
    ("td,df->tf", (5, 64), (64, 128), (-2,)),
    ("tf,fd->td", (5, 128), (128, 64), (-2,)),
    ("rd,vd->rv", (3, 64), (96, 64), (-1,)),
    ("rd,dv->rv", (3, 64), (64, 96), (-2,)),
]


def _np_rows_quant(x: np.ndarray, axes: tuple[int, ...], fmt: str, group: int = 0) -> np.ndarray:
    """Reference dynamic per-token quantization in numpy (one scale per token, or per token per `group` channels
    of the last of `axes`): the dequantized activation."""
    if group and x.shape[axes[-1]] > group:
        a = axes[-1]
        split = x.reshape(*x.shape[:a], -1, group, *x.shape[a + 1:])
        return _np_rows_quant(split, (a + 1,), fmt).reshape(x.shape)
    if group:
        axes = axes[-1:]
    qmax = 127.0 if fmt == "int8" else 448.0
    amax = np.abs(x.astype(np.float64)).max(axis=axes, keepdims=True)
    scale = np.where(amax > 0, amax / qmax, 1.0)
    v = x / scale
    v = np.clip(np.round(v), -127, 127) if fmt == "int8" else v.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return v * scale


@pytest.mark.parametrize("eq,xs,ws,contract", EQUATIONS)
@pytest.mark.parametrize("fmt,acts,group", [("int8", False, 0), ("int8", True, 0), ("fp8", False, 0), ("fp8", True, 0),
                                            ("int8", True, 16)])
def test_qeinsum_equals_the_dequantized_reference(eq, xs, ws, contract, fmt, acts, group):
    x = np.random.default_rng(1).normal(size=xs).astype(np.float32)
    w = _weight(ws, seed=2)
    q = quantize(w, fmt, contract, quantize_activations=acts, activation_group_size=group)
    w_deq = np.asarray(q.dequantize(), np.float64)  # the quantized weight, exactly
    lhs = eq.split(",")[0]
    contracted = [eq.split(",")[1].split("->")[0][a] for a in contract]
    x_ref = _np_rows_quant(x, tuple(lhs.index(c) for c in contracted), fmt, group) if acts else x.astype(np.float64)
    want = np.einsum(eq, x_ref, w_deq)
    got = np.asarray(qeinsum(eq, jnp.asarray(x), q), np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    # and close to the unquantized product (the quantization error itself, loosely)
    exact = np.einsum(eq, x.astype(np.float64), w.astype(np.float64))
    assert np.abs(got - exact).max() < 0.1 * np.abs(exact).max()


@pytest.mark.parametrize("rows", [2, 64])
def test_stacked_layer_slices_of_a_quantized_weight(rows):
    w = _weight((3, 64, 128))  # [L, D, F]
    q = quantize(w, "int8", (-2,))
    x = np.random.default_rng(3).normal(size=(rows, 64)).astype(np.float32)
    for layer in range(3):
        ql = jax.tree.map(lambda a, i=layer: a[i], q)  # how forward slices stacked layers
        want = x.astype(np.float64) @ np.asarray(q.dequantize(), np.float64)[layer]
        np.testing.assert_allclose(np.asarray(qeinsum("td,df->tf", jnp.asarray(x), ql)), want, rtol=1e-4,
                                   atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("eq, xs, ws", [("td,df->tf", (3, 64), (64, 40)), ("btd,ndh->btnh", (2, 5, 32), (4, 32, 8))])
def test_plain_bf16_qeinsum_is_the_bf16_einsum_rounded_once(eq, xs, ws):
    """On CPU the bf16 plain path asks XLA for an f32 output and rounds it (a faster kernel): the result must be
    bf16 and equal, element for element, to the f32 einsum of the same bf16 inputs rounded once to bf16."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=xs), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=ws), jnp.bfloat16)
    got = jax.jit(lambda x, w: qeinsum(eq, x, w))(x, w)
    assert got.dtype == jnp.bfloat16
    want = np.einsum(eq, np.asarray(x, np.float64), np.asarray(w, np.float64)).astype(np.float32)
    want_bf16 = np.asarray(want.astype(ml_dtypes.bfloat16), np.float32)
    # f32 accumulation order may differ from float64's by an ulp of f32: compare to the bf16 rounding within one
    # bf16 ulp where the float64 value sits next to a rounding boundary
    np.testing.assert_allclose(np.asarray(got, np.float32), want_bf16, rtol=2 ** -7, atol=1e-6)
    assert np.mean(np.asarray(got, np.float32) == want_bf16) > 0.99


def test_qeinsum_rejects_an_equation_that_keeps_a_contract_axis():
    q = quantize(_weight((64, 128)), "int8", (-2,))
    with pytest.raises(ValueError, match="contract"):
        qeinsum("td,df->tdf", jnp.ones((2, 64)), q)


def test_int8_activation_dot_accumulates_exactly_in_int32():
    x = np.random.default_rng(4).normal(size=(4, 64)).astype(np.float32)
    q = quantize(_weight((64, 32)), "int8", (-2,), quantize_activations=True)
    xq, xs = quant.quantize_rows(jnp.asarray(x), [1], "int8")
    acc = np.asarray(xq, np.int64) @ np.asarray(q.values, np.int64).T  # exact integer reference
    want = acc * np.asarray(xs, np.float64) * np.asarray(q.scale[:, 0], np.float64)[None]
    np.testing.assert_allclose(np.asarray(qeinsum("td,df->tf", jnp.asarray(x), q)), want, rtol=1e-6)


# ---- whole model ----------------------------------------------------------------------------------------------

def _decode_batch(num_tokens: int = 2):
    return jnp.arange(num_tokens, dtype=jnp.int32) * 5, AttentionMetadata(
        positions=jnp.zeros(num_tokens, jnp.int32), cu_q_lens=jnp.arange(num_tokens + 1, dtype=jnp.int32),
        kv_lens=jnp.ones(num_tokens, jnp.int32), page_table=jnp.arange(1, num_tokens + 1, dtype=jnp.int32)[:, None],
        kv_loc=jnp.arange(1, num_tokens + 1, dtype=jnp.int32) * 4, logits_indices=jnp.arange(num_tokens))


def _logits(weights, cfg=TINY, dtype=jnp.float32, num_tokens=2):
    tokens, meta = _decode_batch(num_tokens)
    logits, _ = jax.jit(lambda w: forward(w, tokens, meta, KVCache.zeros(cfg, 8, 4, dtype), cfg))(weights)
    return np.asarray(logits)


def _dequantized(weights):
    return jax.tree.map(lambda x: x.dequantize() if isinstance(x, QuantizedWeight) else x, weights,
                        is_leaf=lambda x: isinstance(x, QuantizedWeight))


@pytest.mark.parametrize("qcfg", [QuantizationConfig("int8", quantize_activations=False), QuantizationConfig("fp8"),
                                  QuantizationConfig("fp8", group_size=32), QuantizationConfig("int4")])
def test_weight_only_model_equals_the_model_on_dequantized_weights(qcfg):
    """XLA's weight-only path (the native int4 kernel also rounds activations: tests/pallas_kernels/test_cpu_gemv)."""
    weights = init_weights(TINY, jax.random.key(0))
    qw = quant.quantize_weights(weights, TINY, qcfg, jnp.float32)
    assert isinstance(qw.layers.wq, QuantizedWeight) and not isinstance(qw.layers.attn_norm, QuantizedWeight)
    with native_matmuls(False):
        np.testing.assert_allclose(_logits(qw), _logits(_dequantized(qw)), rtol=1e-4, atol=1e-4)


def test_int8_model_is_close_to_f32_and_keeps_greedy_choices():
    weights = init_weights(TINY, jax.random.key(1))
    full = _logits(weights, num_tokens=8)
    q = _logits(quant.quantize_weights(weights, TINY, QuantizationConfig("int8", quantize_activations=True),
                                       jnp.float32), num_tokens=8)
    assert np.abs(q - full).max() < 0.05 * np.abs(full).max()
    assert (q.argmax(-1) == full.argmax(-1)).mean() >= 0.75


def test_folding_norm_gains_into_projections_is_exact():
    weights = init_weights(TINY, jax.random.key(4))
    gains = jax.random.uniform(jax.random.key(5), weights.layers.attn_norm.shape, minval=0.2, maxval=3.0)
    weights = weights.replace(layers=weights.layers.replace(attn_norm=gains, mlp_norm=gains[:, ::-1]))
    folded = weights.replace(layers=quant.fold_norm_scales(weights.layers))
    assert np.all(np.asarray(folded.layers.attn_norm) == 1)
    np.testing.assert_allclose(_logits(folded, num_tokens=4), _logits(weights, num_tokens=4), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("embed,head", [(True, True), (True, False), (False, True), (False, False)])
def test_embedding_and_lm_head_options_with_tied_weights(embed, head):
    weights = init_weights(TINY, jax.random.key(2))
    qw = quant.quantize_weights(weights, TINY, QuantizationConfig("int8", quantize_embedding=embed,
                                                                  quantize_lm_head=head), jnp.float32)
    assert isinstance(qw.embed, QuantizedWeight) == embed
    if embed == head:
        assert qw.lm_head is None  # one table serves both
    else:
        assert isinstance(qw.lm_head, QuantizedWeight) == head and qw.lm_head.shape == (64, 96)
    # the gather reads the (de)quantized table, the head its own weight
    want = _logits(weights.replace(
        embed=_dequantized(qw).embed,
        lm_head=None if qw.lm_head is None else _dequantized(qw).lm_head), num_tokens=4)
    np.testing.assert_allclose(_logits(qw, num_tokens=4), want, rtol=0.05, atol=0.05 * np.abs(want).max())
    share = quant.weight_bytes(qw)["quantized_share"]
    assert 0 < share < 1


def test_config_from_value_and_errors():
    assert QuantizationConfig.from_value("fp8").format == "fp8"
    assert QuantizationConfig.from_value('{"format": "int8", "quantize_lm_head": false}').quantize_lm_head is False
    assert QuantizationConfig.from_value(None) is None
    assert not QuantizationConfig("int8").activations and not QuantizationConfig("fp8").activations  # weight-only
    assert QuantizationConfig("int8", quantize_activations=True).activations
    for bad, match in [("int3", "int3"), ({"format": "int8", "bits": 4}, "bits"), ("{", "JSON"), (3, "int"),
                       ("{}", "needs the key"), ({"format": None}, "format=None"),
                       ({"format": "int8", "quantize_activations": 1}, "quantize_activations"),
                       ({"format": "fp8", "quantize_embedding": 0.0}, "quantize_embedding"),
                       ({"format": "int8", "group_size": 128}, "group_size"),
                       ({"format": "fp8", "group_size": -1}, "group_size"),
                       ({"format": "int8", "quantize_lm_head": "yes"}, "quantize_lm_head")]:
        with pytest.raises(ValueError, match=match):
            QuantizationConfig.from_value(bad)


# ---- no full-precision copy -----------------------------------------------------------------------------------

def test_int8_decode_step_materializes_no_full_precision_weight_and_the_check_can_see_one():
    cfg = dataclasses.replace(TINY, vocab_size=1024, hidden_size=128, intermediate_size=384)
    weights = init_weights(cfg, jax.random.key(3))
    tokens, meta = _decode_batch(2)
    cache = KVCache.zeros(cfg, 8, 4, jnp.float32)

    def copies(qcfg, num_tokens=2):
        qw = quant.quantize_weights(weights, cfg, qcfg, jnp.float32)
        tokens, meta = _decode_batch(num_tokens)
        step = jax.jit(lambda w, c: forward(w, tokens, meta, c, cfg, scan_layers=True))
        return hlo.materialized_weight_copies(step.lower(qw, cache).compile().as_text(), qw)

    assert copies(QuantizationConfig("int8", quantize_activations=True)) == []  # w8a8: the int8 x int8 -> int32 dot reads the int8 values
    # weight-only int8 on XLA:CPU converts each weight for its dot (no fused convert-dot): the check must see it
    with native_matmuls(False):
        assert copies(QuantizationConfig("int8", quantize_activations=False))
    # the native kernel reads the int8 values in place (tests/pallas_kernels/test_cpu_gemv.py: it is built here)
    assert cpu_gemv.active()
    assert copies(QuantizationConfig("int8", quantize_activations=False)) == []


def test_embedding_lookup_of_a_grouped_int8_table():
    # GGUF Q8_0 embeddings: int8 values with one scale per 32 elements of a row (built directly, as the GGUF loader
    # does; `quantize` gives int8 per-row scales only). Each looked-up row is its values times its groups' scales.
    rng = np.random.default_rng(0)
    values = rng.integers(-127, 128, (10, 64), dtype=np.int8)
    scale = rng.uniform(0.01, 1.0, (10, 2)).astype(np.float32)
    table = QuantizedWeight(values=values, scale=scale, contract_axes=(-1,), group_size=32)
    assert lookup_supports(table) and not lookup_supports(quantize(jnp.ones((10, 64)), "int4", (-1,), group_size=32))
    tokens = np.array([3, 0, 9, 3])
    want = values[tokens].astype(np.float32) * np.repeat(scale[tokens], 32, axis=1)
    np.testing.assert_array_equal(np.asarray(embed_lookup(table, jnp.asarray(tokens), jnp.float32)), want)
    np.testing.assert_array_equal(np.asarray(table.dequantize())[tokens], want)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_qeinsum_runs_the_pallas_kernel_on_accelerators_when_enabled(fmt, monkeypatch):
    """On GPU / TPU with JAXINFER_PALLAS_QMATMUL=1, decode-shaped weight-only matmuls go to
    `pallas_kernels.quant_matmul` (here its GPU kernel in interpret mode, the platform faked)."""
    import models.quant_matmul as qm

    w = quantize(jax.random.normal(jax.random.key(0), (64, 4, 32)), fmt, (-3,), group_size=32 if fmt == "int4" else 0)
    x = jax.random.normal(jax.random.key(1), (3, 64))
    with native_matmuls(False):
        ref = qeinsum("td,dnh->tnh", x, w)
    monkeypatch.setattr(qm, "_PALLAS_INTERPRET", True)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    calls = []
    original = qm.quant_matmul.weight_only_matmul
    monkeypatch.setattr(qm.quant_matmul, "weight_only_matmul", lambda *a, **k: calls.append(k) or original(*a, **k))
    assert qm._native("td,dnh->tnh", x, w) is None and not calls  # off by default
    monkeypatch.setenv("JAXINFER_PALLAS_QMATMUL", "1")
    y = qeinsum("td,dnh->tnh", x, w)
    assert calls and calls[0]["backend"] == "gpu"
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-4, atol=1e-4)
