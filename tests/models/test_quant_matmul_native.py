"""`models.quant_matmul.qeinsum` routes decode-shaped matmuls to the native CPU kernels (`pallas_kernels.cpu_gemv`)
and matches its XLA path; a stacked weight is read in place through `LayerRef`; the off switches fall back;
`qeinsums` runs weights sharing their activations as one kernel call with the same numbers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.quant import quantize
from models.quant_matmul import LayerRef, native_matmuls, qeinsum, qeinsums
from pallas_kernels import cpu_gemv


def _rel_err(y, ref) -> float:
    return float(np.abs(np.asarray(y, np.float64) - np.asarray(ref, np.float64)).max() / np.abs(ref).max())


def _routed(eq, x, w):
    f = jax.jit(lambda a, b: qeinsum(eq, a, b, preferred_element_type=jnp.float32))
    return f(x, w), "custom_call" in f.lower(x, w).as_text()


@pytest.mark.parametrize("fmt", ["bf16", "int8", "w8a8", "int4"])
def test_qeinsum_routes_decode_shapes_and_matches_xla(fmt):
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((128, 4, 64)), jnp.bfloat16)  # [D, N, H] as wq
    wq = {"bf16": w, "int8": quantize(w, "int8", (-3,)), "w8a8": quantize(w, "int8", (-3,), quantize_activations=True),
          "int4": quantize(w, "int4", (-3,), group_size=32)}[fmt]
    limit = cpu_gemv.row_limit(fmt)
    assert 8 <= limit <= cpu_gemv.MAX_ROWS
    for rows in sorted({1, 8, 9, limit, limit + 1}):
        x = jnp.asarray(rng.standard_normal((rows, 128)), jnp.bfloat16)
        y, native = _routed("td,dnh->tnh", x, wq)
        with native_matmuls(False):
            ref, xla_native = _routed("td,dnh->tnh", x, wq)
        assert native == (rows <= limit) and not xla_native
        # w8a8 exact (the same int32 sums); int8 weight-only and int4 round activation rows to int16
        tolerance = {"w8a8": 0.0, "int8": 1e-4, "int4": 1e-2}.get(fmt, 1e-5)  # int4: XLA rounds its weight to bf16
        assert _rel_err(y, np.asarray(ref, np.float64)) <= tolerance


def test_stacked_weight_is_read_in_place_without_a_slice():
    rng = np.random.default_rng(2)
    stack = jnp.asarray(rng.standard_normal((3, 128, 4, 64)), jnp.bfloat16)  # [L, D, N, H]
    qstack = quantize(stack, "int4", (-3,), group_size=32, stacked_axes=1)
    x = jnp.asarray(rng.standard_normal((2, 128)), jnp.bfloat16)
    for w in (stack, qstack):
        f = jax.jit(lambda x, w, i: qeinsum("td,dnh->tnh", x, LayerRef(w, i), preferred_element_type=jnp.float32))
        for i in range(3):
            ref = qeinsum("td,dnh->tnh", x, LayerRef(w, jnp.int32(i)).get(), preferred_element_type=jnp.float32)
            assert _rel_err(f(x, w, jnp.int32(i)), ref) < 1e-5
        hlo = f.lower(x, w, jnp.int32(0)).as_text()
        assert "custom_call" in hlo and "dynamic_slice" not in hlo  # the kernel gets the stack and the index


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("JAXINFER_NATIVE_KERNELS", "0")
    assert not cpu_gemv.active()
    _, native = _routed("td,df->tf", jnp.ones((1, 64)), jnp.ones((64, 32)))
    assert not native


_QKV = ("td,dnh->tnh", "td,dkh->tkh", "td,dkh->tkh")


def _qkv(rng, layers: int | None = None):
    lead = () if layers is None else (layers,)
    return [jnp.asarray(rng.standard_normal((*lead, 128, n, 64)), jnp.bfloat16) for n in (4, 2, 2)]


@pytest.mark.parametrize("fmt", ["int8", "int4", "int4 asym", "w4a8", "w8a8", "mixed", "bf16"])
def test_qeinsums_is_one_call_with_the_numbers_of_separate_qeinsums(fmt):
    rng = np.random.default_rng(3)
    ws = _qkv(rng)
    make = {"int8": lambda w: quantize(w, "int8", (-3,)),
            "int4": lambda w: quantize(w, "int4", (-3,), group_size=32),
            "int4 asym": lambda w: quantize(w, "int4", (-3,), group_size=64, asymmetric=True),
            "w4a8": lambda w: quantize(w, "int4", (-3,), group_size=32, quantize_activations=True),
            "w8a8": lambda w: quantize(w, "int8", (-3,), quantize_activations=True),
            "bf16": lambda w: w}
    if fmt == "mixed":  # int4 q, int8 k and v: no shared call, each its own kernel (f32 x: the float kernel)
        ws = [make["int4"](ws[0]), make["int8"](ws[1]), make["int8"](ws[2])]
    else:
        ws = [make[fmt](w) for w in ws]
    x = jnp.asarray(rng.standard_normal((3, 128)), jnp.bfloat16)
    f = jax.jit(lambda x, ws: qeinsums(_QKV, x, ws, preferred_element_type=jnp.float32))
    ys = f(x, ws)
    for eq, w, y in zip(_QKV, ws, ys):
        ref = jax.jit(lambda x, w, eq=eq: qeinsum(eq, x, w, preferred_element_type=jnp.float32))(x, w)
        assert y.shape == ref.shape and y.dtype == ref.dtype
        np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))  # the same kernel arithmetic, bit for bit
    hlo = f.lower(x, ws).as_text()
    shared = fmt != "mixed"
    assert hlo.count("weight_only_matmul") == (0 if fmt in ("w8a8", "bf16") else 1 if shared else 3)
    assert hlo.count("custom_call") == (1 if shared else 3)


def test_qeinsums_reads_stacked_layers_in_place():
    rng = np.random.default_rng(4)
    stacks = [quantize(w, "int4", (-3,), group_size=32, stacked_axes=1) for w in _qkv(rng, layers=3)]
    x = jnp.asarray(rng.standard_normal((1, 128)), jnp.float32)
    f = jax.jit(lambda x, ws, i: qeinsums(_QKV, x, [LayerRef(w, i) for w in ws]))
    for i in range(3):
        refs = [qeinsum(eq, x, LayerRef(w, jnp.int32(i)).get()) for eq, w in zip(_QKV, stacks)]
        for y, ref in zip(f(x, stacks, jnp.int32(i)), refs):
            np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))
    hlo = f.lower(x, stacks, jnp.int32(0)).as_text()
    assert hlo.count("custom_call") == 1 and "dynamic_slice" not in hlo


def test_qeinsums_without_the_kernels_and_bad_input():
    rng = np.random.default_rng(5)
    ws = [quantize(w, "int4", (-3,), group_size=32) for w in _qkv(rng)]
    x = jnp.asarray(rng.standard_normal((cpu_gemv.MAX_ROWS + 1, 128)), jnp.float32)  # more rows than any kernel takes
    for y, eq, w in zip(qeinsums(_QKV, x, ws), _QKV, ws):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(qeinsum(eq, x, w)))
    with native_matmuls(False):
        ys = qeinsums(_QKV, x[:1], ws)
    with native_matmuls(False):
        for y, eq, w in zip(ys, _QKV, ws):
            np.testing.assert_array_equal(np.asarray(y), np.asarray(qeinsum(eq, x[:1], w)))
    with pytest.raises(ValueError, match="2 equations for 3 weights"):
        qeinsums(_QKV[:2], x, ws)
