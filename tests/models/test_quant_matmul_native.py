"""`models.quant_matmul.qeinsum` routes decode-shaped matmuls to the native CPU kernels (`pallas_kernels.cpu_gemv`)
and matches its XLA path; a stacked weight is read in place through `LayerRef`; the off switches fall back."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.quant import quantize
from models.quant_matmul import LayerRef, native_matmuls, qeinsum
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
    for rows in (1, 8, 9):
        x = jnp.asarray(rng.standard_normal((rows, 128)), jnp.bfloat16)
        y, native = _routed("td,dnh->tnh", x, wq)
        with native_matmuls(False):
            ref, xla_native = _routed("td,dnh->tnh", x, wq)
        assert native == (rows <= cpu_gemv.MAX_ROWS) and not xla_native
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
