"""The native CPU matmul kernels (`pallas_kernels.cpu_gemv`) against float64 numpy references written from their
documented math, at every ISA level this CPU runs; their build, switches and fallback. Routing from `qeinsum`:
tests/models/test_quant_matmul_native.py."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import cpu_gemv
from pallas_kernels.cpu_gemv import build

LEVELS = build.supported_levels()
# (K, N): SmolLM2's, odd and tiny N; 200: K not a multiple of 32 (the amx level's [N, K] bf16 kernel leaves it to
# the 256-bit one)
SHAPES = [(576, 1536), (1536, 576), (64, 13), (128, 1), (192, 100), (200, 40)]
ROWS = [1, 2, 3, 4, 5, 6, 8, 17, 32]  # 6: the amx level's bf16 and w8a8 tiles start; 17: two tile blocks (9 + 8)


_traced_at: list[str] = []  # the level the previous test traced under


@pytest.fixture(params=LEVELS or ["none"], autouse=True)
def level(request, monkeypatch):
    """Every test runs at each ISA level this CPU supports (JAXINFER_NATIVE_ISA). jit keeps a function's trace for
    the same argument shapes whatever the variable says, and the trace names its level's kernels: so jax's caches are
    cleared whenever the level changes, or a `jax.jit(cpu_gemv.int8_matmul)` of a shape another level traced first
    would run that level's kernel (found in session 28: a wrong 512-bit kernel passed the whole file)."""
    assert LEVELS, "this CPU runs no ISA level of the native kernels (AVX2 + FMA needed)"
    monkeypatch.setenv("JAXINFER_NATIVE_ISA", request.param)
    if _traced_at[-1:] != [request.param]:
        jax.clear_caches()
        _traced_at[:] = [request.param]
    assert cpu_gemv.active()
    return request.param


def _rel_err(y, ref) -> float:
    return float(np.abs(np.asarray(y, np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))


def _assert_sums_close(y, x: np.ndarray, w: np.ndarray) -> None:
    """y equals x @ w.T up to f32 summation: within 2e-6 of the sum of the terms' magnitudes, per output."""
    err = np.abs(np.asarray(y, np.float64) - x @ w.T)
    assert (err <= 2e-6 * (np.abs(x) @ np.abs(w).T) + 1e-30).all(), err.max()


def _int16_rows(x: np.ndarray) -> np.ndarray:
    """The int8 kernel's activation rounding: each row to int16 at absmax / 32767, nearest even, as float64."""
    x = x.astype(np.float32)
    amax = np.abs(x).max(-1, keepdims=True)
    inverse = np.where(amax > 0, np.float32(32767) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.round(x * inverse), -32767, 32767)
    return q.astype(np.float64) * (amax / np.float32(32767)).astype(np.float32).astype(np.float64)


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_float_kernels_both_layouts(k, n, m):
    rng = np.random.default_rng(k * 31 + n + m)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    for dtype in (jnp.float32, jnp.bfloat16):
        wd = jnp.asarray(w, dtype)
        ref = x.astype(np.float64) @ np.asarray(wd.astype(jnp.float32), np.float64)
        for xin in (x, jnp.asarray(x, jnp.bfloat16)):
            r = ref if xin is x else np.asarray(xin.astype(jnp.float32), np.float64) @ np.asarray(
                wd.astype(jnp.float32), np.float64)
            assert _rel_err(jax.jit(lambda a, b: cpu_gemv.float_matmul(a, b, input_major=True))(xin, wd), r) < 1e-5
            assert _rel_err(jax.jit(lambda a, b: cpu_gemv.float_matmul(a, b, input_major=False))(xin, wd.T),
                            r) < 1e-5


# 4160: past 2048 a sum; 96: a half step; 16448: past the amx level's 16,384 inputs a sum
@pytest.mark.parametrize("k,n", [s for s in SHAPES if s[0] % 32 == 0] + [(4160, 3), (96, 5), (16448, 17)])
@pytest.mark.parametrize("m", ROWS)
def test_int8_weight_only_and_w8a8(k, n, m):
    rng = np.random.default_rng(k + n * 7 + m)
    x = rng.standard_normal((m, k)).astype(np.float32)
    q = rng.integers(-127, 128, (n, k)).astype(np.int8)
    # groups of the whole row, 32 and 16 inputs, and 96 or 64 (512-bit steps: 32 inputs, so 16 takes the 256-bit path)
    for groups in (1, k // 32, k // 16, k // 96 if k % 96 == 0 else k // 64):
        scale = rng.uniform(0.01, 1.0, (n, groups)).astype(np.float32)
        w = (q.reshape(n, groups, -1) * scale[..., None].astype(np.float64)).reshape(n, k)
        y = jax.jit(cpu_gemv.int8_matmul)(x, q, scale)
        xr = _int16_rows(x)
        _assert_sums_close(y, xr, w)  # the documented math: int16-rounded rows, exact int8 weights
        exact = x.astype(np.float64) @ w.T  # and the unrounded product, within that rounding's bound
        bound = np.abs(xr - x) @ np.abs(w).T
        assert (np.abs(np.asarray(y, np.float64) - exact) <= bound * 1.001 + 1e-6 * np.abs(exact).max()).all()
    xq = rng.integers(-127, 128, (m, k)).astype(np.int8)
    exact = xq.astype(np.int64) @ q.T.astype(np.int64)
    np.testing.assert_array_equal(np.asarray(jax.jit(cpu_gemv.i8i8_matmul)(xq, q)), exact)


def _int4_case(rng, m, k, n, group, asymmetric):
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)  # models.quant4's order, written out here
    g = k // group
    scale = rng.uniform(0.01, 0.1, (n, g)).astype(np.float32)
    mins = rng.standard_normal((n, g)).astype(np.float32) * 0.3 if asymmetric else None
    offset = mins[..., None] if asymmetric else -8.0 * scale[..., None]
    w = (codes.reshape(n, g, group) * scale[..., None].astype(np.float64) + offset).reshape(n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    return x, packed, scale, mins, w


INT4_CASES = [(k, n, group, asym) for k, n in [(576, 1536), (1536, 576), (1152, 7), (128, 13), (64, 1)]
              for group, asym in [(32, False), (32, True), (64, False), (96, True), (128, True)] if k % group == 0]


@pytest.mark.parametrize("k,n,group,asymmetric", INT4_CASES)
@pytest.mark.parametrize("m", [1, 3, 8, 17, 32])
def test_int4_equals_the_weight_on_int16_rounded_activations(k, n, m, group, asymmetric):
    rng = np.random.default_rng(k + n + m + group)
    x, packed, scale, mins, w = _int4_case(rng, m, k, n, group, asymmetric)
    y = jax.jit(cpu_gemv.int4_matmul)(x, packed, scale, mins)
    xr = _int16_rows(x)
    _assert_sums_close(y, xr, w)  # the documented math: int16-rounded activation rows, exact codes
    # and the unrounded product within the rounding's bound sum_k |x^_k - x_k| |w_k|
    exact = x.astype(np.float64) @ w.T
    bound = np.abs(xr - x) @ np.abs(w).T
    assert (np.abs(np.asarray(y, np.float64) - exact) <= bound * 1.001 + 1e-5 * np.abs(exact).max()).all()


@pytest.mark.parametrize("m,ns,asymmetric", [(1, (13, 40, 7), False), (3, (300, 8), True), (8, (1, 64, 17, 5), False)])
def test_weight_only_matmuls_of_several_weights_equal_one_call_each(m, ns, asymmetric):
    rng = np.random.default_rng(m)
    cases = [_int4_case(rng, m, 128, n, 32, asymmetric) for n in ns]
    x = cases[0][0]
    ys = cpu_gemv.weight_only_matmuls(x, [(packed, scale, mins) for _, packed, scale, mins, _ in cases])
    for y, (_, packed, scale, mins, w) in zip(ys, cases):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(cpu_gemv.int4_matmul(x, packed, scale, mins)))
        _assert_sums_close(y, _int16_rows(x), w)
    q8 = [rng.integers(-127, 128, (n, 128)).astype(np.int8) for n in ns]
    s8 = [rng.random((n, 1)).astype(np.float32) for n in ns]
    for y, q, s in zip(cpu_gemv.weight_only_matmuls(x, [(q, s, None) for q, s in zip(q8, s8)]), q8, s8):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(cpu_gemv.int8_matmul(x, q, s)))
    xq = rng.integers(-127, 128, (m, 128)).astype(np.int8)
    for y, q in zip(cpu_gemv.i8i8_matmuls(xq, q8), q8):  # w8a8: exact int32 sums
        np.testing.assert_array_equal(np.asarray(y), xq.astype(np.int64) @ q.T.astype(np.int64))
    for input_major in (True, False):  # bf16 and f32 weights mixed in one call, both layouts
        ws = [jnp.asarray(rng.standard_normal((128, n) if input_major else (n, 128)), dt)
              for n, dt in zip(ns, [jnp.bfloat16, jnp.float32] * 2)]
        for y, w in zip(cpu_gemv.float_matmuls(x, ws, input_major=input_major), ws):
            np.testing.assert_array_equal(np.asarray(y), np.asarray(cpu_gemv.float_matmul(x, w, input_major=input_major)))


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 8), chunks=st.integers(1, 6), n=st.integers(1, 40), seed=st.integers(0, 2**16),
       asymmetric=st.booleans())
def test_int4_packing_property(m, chunks, n, seed, asymmetric):
    rng = np.random.default_rng(seed)
    x, packed, scale, mins, w = _int4_case(rng, m, 64 * chunks, n, 32, asymmetric)
    _assert_sums_close(jax.jit(cpu_gemv.int4_matmul)(x, packed, scale, mins), _int16_rows(x), w)


@pytest.mark.parametrize("asymmetric", [False, True])
def test_int4_activation_bytes_at_their_extremes(asymmetric):
    """The int4 kernel splits each int16-rounded input into its signed high and unsigned low byte (x = 256 h + l):
    inputs whose bytes sit at the ends of their ranges (±32767, ±256, ±255, ±1, 0, -128 x 256) give the exact
    sums, in every lane position of a 128-input span and its 64-input tail."""
    rng = np.random.default_rng(11)
    m, k, n = 3, 192, 24  # one 128-input span and a 64-input tail
    x, packed, scale, mins, w = _int4_case(rng, m, k, n, 32, asymmetric)
    levels = np.array([32767, -32767, 256, -256, 255, -255, 1, -1, 0, -32768 + 256, 32512, -129, 128, -128])
    q = rng.choice(levels, (m, k))
    q[:, 0] = 32767  # each row's absmax is 1: the rounded inputs are the levels themselves
    x = (q / 32767.0).astype(np.float32)
    np.testing.assert_array_equal(np.round(x * np.float32(32767)), q)  # (the kernel's x * 32767 / absmax, in f32)
    _assert_sums_close(jax.jit(cpu_gemv.int4_matmul)(x, packed, scale, mins), _int16_rows(x), w)


def _int8_blocks(x: np.ndarray) -> np.ndarray:
    """w4a8's activations: each block of 32 inputs to int8 at absmax / 127 (1 for an all-zero block), x / scale
    rounded to nearest even, as float64 (GGUF Q8_0's rounding)."""
    b = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(b).max(-1, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    q = np.clip(np.round(b / scale), -127, 127)
    return (q.astype(np.float64) * scale.astype(np.float64)).reshape(x.shape)


@pytest.mark.parametrize("m,k,n", [(1, 576, 1536), (1, 1536, 576), (3, 64, 13), (8, 576, 7), (5, 128, 1), (32, 576, 70)])
def test_int4_with_int8_activation_blocks_w4a8(m, k, n):
    rng = np.random.default_rng(m + k + n)
    x, packed, scale, mins, w = _int4_case(rng, m, k, n, 32, False)
    x[0, : k // 2] *= 50.0  # blocks of very different ranges: one scale per block, not per row
    x[-1, 32:64] = 0.0  # an all-zero block
    y = cpu_gemv.weight_only_matmuls(x, [(packed, scale, None)], int8_activations=True)[0]
    _assert_sums_close(y, _int8_blocks(x), w)
    assert _rel_err(y, x.astype(np.float64) @ w.T) > 1e-5  # it is not the int16 rounding (teeth)


def test_w4a8_refuses_what_it_cannot_compute():
    rng = np.random.default_rng(4)
    x, packed, scale, mins, _ = _int4_case(rng, 1, 128, 4, 64, True)
    for weights in ([(packed, scale, mins)], [(packed, scale, None)],
                    [(rng.integers(-127, 128, (4, 128)).astype(np.int8), np.ones((4, 1), np.float32), None)]):
        with pytest.raises(ValueError, match="symmetric int4 weights with one scale a 32-input block"):
            cpu_gemv.weight_only_matmuls(x, weights, int8_activations=True)


def test_rows_holding_nan_or_inf_give_nan_and_leave_the_other_rows_alone():
    """The weight-only kernels round activation rows to int16: a non-finite row cannot be rounded, so its outputs
    are NaN (as its float products would not be finite), never made-up finite numbers."""
    rng = np.random.default_rng(3)
    x, packed, scale, mins, w4 = _int4_case(rng, 3, 128, 5, 32, False)
    x[0, 7], x[2, 100] = np.nan, np.inf
    q = rng.integers(-127, 128, (5, 128)).astype(np.int8)
    s8 = rng.uniform(0.01, 1.0, (5, 1)).astype(np.float32)
    for y, w in ((cpu_gemv.int8_matmul(x, q, s8), q * s8.astype(np.float64)),
                 (cpu_gemv.int4_matmul(x, packed, scale, mins), w4)):
        y = np.asarray(y)
        assert np.isnan(y[0]).all() and np.isnan(y[2]).all()
        _assert_sums_close(y[1:2], _int16_rows(x[1:2]), w)
    y = np.asarray(cpu_gemv.weight_only_matmuls(x, [(packed, scale, None)], int8_activations=True)[0])  # w4a8
    assert np.isnan(y[0]).all() and np.isnan(y[2]).all()
    _assert_sums_close(y[1:2], _int8_blocks(x[1:2]), w4)


def test_all_zero_activation_blocks():
    rng = np.random.default_rng(0)
    x, packed, scale, mins, w = _int4_case(rng, 2, 128, 5, 32, False)
    x[:, :64] = 0.0
    _assert_sums_close(jax.jit(cpu_gemv.int4_matmul)(x, packed, scale, mins), _int16_rows(x), w)


@pytest.mark.parametrize("call,message", [
    (lambda: cpu_gemv.float_matmul(jnp.ones((1, 8)), jnp.ones((6, 4)), input_major=True), "K=8"),
    (lambda: cpu_gemv.float_matmul(jnp.ones((1, 6)), jnp.ones((6, 4)), input_major=True), "multiple of 4"),
    (lambda: cpu_gemv.float_matmul(jnp.ones((1, 8)), jnp.ones((8, 4), jnp.int8), input_major=True), "bf16 or f32"),
    (lambda: cpu_gemv.int8_matmul(jnp.ones((1, 32)), jnp.ones((4, 32), jnp.int8), jnp.ones((4, 3))), "scale"),
    (lambda: cpu_gemv.int8_matmul(jnp.ones((1, 32)), jnp.ones((4, 32), jnp.int8), jnp.ones((4, 4))), "multiple of 16"),
    (lambda: cpu_gemv.i8i8_matmul(jnp.ones((1, 48), jnp.int8), jnp.ones((4, 48), jnp.int8)), "multiple of 32"),
    (lambda: cpu_gemv.int4_matmul(jnp.ones((1, 96)), jnp.ones((4, 48), jnp.uint8), jnp.ones((4, 3))),
     "multiple of 64"),
    (lambda: cpu_gemv.float_matmul(jnp.ones((1, 8), jnp.complex64), jnp.ones((8, 4)), input_major=True),
     "floating point"),
    (lambda: cpu_gemv.int8_matmul(jnp.ones((1, 32)), jnp.ones((3, 4, 32), jnp.int8), jnp.ones((1, 4, 1)), layer=2),
     "different layer counts"),
    (lambda: cpu_gemv.int8_matmul(jnp.ones((1, 32)), jnp.ones((3, 4, 32), jnp.int8), jnp.ones((3, 4, 1)),
                                  layer=2**40), "outside int32"),
    (lambda: cpu_gemv.float_matmul(jnp.ones((1, 8)), jnp.ones((3, 8, 4)), input_major=True, layer=jnp.array([0, 1])),
     "integer scalar"),
    (lambda: cpu_gemv.weight_only_matmuls(jnp.ones((1, 64)), []), "at least one weight"),
    (lambda: cpu_gemv.i8i8_matmuls(jnp.ones((1, 64), jnp.int8), []), "at least one weight"),
    (lambda: cpu_gemv.float_matmuls(jnp.ones((1, 64)), [], input_major=True), "at least one weight"),
    (lambda: cpu_gemv.weight_only_matmuls(jnp.ones((1, 64)), [(jnp.ones((4, 64), jnp.int8), jnp.ones((4, 1)), None),
                                                             (jnp.ones((4, 32), jnp.uint8), jnp.ones((4, 2)), None)]),
     "one format"),
    (lambda: cpu_gemv.weight_only_matmuls(jnp.ones((1, 64)), [(jnp.ones((4, 32), jnp.uint8), jnp.ones((4, 2)),
                                                               jnp.ones((4, 2))),
                                                              (jnp.ones((4, 32), jnp.uint8), jnp.ones((4, 1)),
                                                               jnp.ones((4, 1)))]), "same group count"),
    (lambda: cpu_gemv.weight_only_matmuls(jnp.ones((1, 64)), [(jnp.ones((4, 64), jnp.int8), jnp.ones((4, 1)), None),
                                                             (jnp.ones((4, 32), jnp.int8), jnp.ones((4, 1)), None)]),
     "K=64, the weight 32"),
    (lambda: cpu_gemv.float_matmul(jnp.ones((33, 8)), jnp.ones((8, 4)), input_major=True), "1 <= M <= 32"),
    (lambda: cpu_gemv.row_limit("int2"), "unknown kernel kind 'int2'"),
])
def test_bad_arguments_name_the_problem(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---- switches, build and fallback ------------------------------------------------------------------------------

def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("JAXINFER_NATIVE_KERNELS", "0")
    assert not cpu_gemv.active() and cpu_gemv.isa_level() is None
    with pytest.raises(RuntimeError, match="not available"):
        cpu_gemv.float_matmul(jnp.ones((1, 64)), jnp.ones((64, 32)), input_major=True)


def test_thread_count_must_be_a_positive_integer(monkeypatch):
    for bad in ("abc", "0", "-2", "1.5"):
        monkeypatch.setenv("JAXINFER_NATIVE_THREADS", bad)
        with pytest.raises(ValueError, match="JAXINFER_NATIVE_THREADS"):
            cpu_gemv.check_environment()
    monkeypatch.setenv("JAXINFER_NATIVE_THREADS", "2")
    cpu_gemv.check_environment()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the kernels' worker threads need two CPUs")
def test_worker_threads_keep_off_the_calling_threads_cpu(level):
    """A worker woken from its sleep must not share the calling thread's CPU: in a VM Linux put it there (a halted
    vCPU looks busy) and it waited a scheduler tick while the other CPU idled. The calling thread here is pinned to
    one CPU; each call comes after the workers fell asleep (they spin 300 us after a job)."""
    lib = ctypes.CDLL(str(build.library_path(level)))
    probe = lib.jaxinfer_threads_probe
    probe.restype = ctypes.c_int64
    count = 400  # 50 us each: 20 ms of work a call, long enough for a woken worker to join on another CPU
    cpu, tid = (ctypes.c_int32 * count)(), (ctypes.c_int64 * count)()
    assert probe(count, 50, cpu, tid) >= 2  # the pool starts unpinned, with this process's CPUs
    allowed = os.sched_getaffinity(0)
    here = min(allowed)
    caller, workers = threading.get_native_id(), {}
    os.sched_setaffinity(0, {here})  # this thread only
    try:
        for _ in range(3):
            time.sleep(0.02)
            probe(count, 50, cpu, tid)
            for c, t in zip(cpu, tid):
                if t != caller:
                    workers.setdefault(t, set()).add(c)
    finally:
        os.sched_setaffinity(0, allowed)
    assert workers, "no worker took a chunk"
    for t, cpus in workers.items():
        assert here not in cpus, f"worker {t} ran chunks on the caller's CPU {here}"
        assert here not in os.sched_getaffinity(t)


def test_isa_level_choice_is_checked(monkeypatch):
    monkeypatch.setenv("JAXINFER_NATIVE_ISA", "sse9")
    with pytest.raises(ValueError, match="not a level"):
        cpu_gemv.isa_level()
    monkeypatch.setitem(build.ISA_LEVELS, "future", (("-mfuture",), ("no_such_cpu_flag",)))
    monkeypatch.setenv("JAXINFER_NATIVE_ISA", "future")
    with pytest.raises(ValueError, match="cannot run it"):
        cpu_gemv.isa_level()


def test_amx_level_needs_the_flags_and_the_kernels_grant(monkeypatch):
    """`amx` is a level only where the CPU lists the AMX flags and Linux grants the tile state; else forcing it is
    refused by name, like any level the CPU cannot run."""
    from pallas_kernels import cpu_features

    needs = set(build.ISA_LEVELS["amx"][1])
    with_flags = frozenset(build.ISA_LEVELS["avx512_vnni"][1]) | needs
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: with_flags)
    monkeypatch.setattr(cpu_features, "amx_permitted", lambda: True)
    assert cpu_features.supported_levels() == ["avx2", "avx512_vnni", "amx"]
    monkeypatch.setattr(cpu_features, "amx_permitted", lambda: False)  # a kernel before 5.16, or a refusal
    assert cpu_features.supported_levels() == ["avx2", "avx512_vnni"]
    monkeypatch.setenv("JAXINFER_NATIVE_ISA", "amx")
    with pytest.raises(ValueError, match="cannot run it"):
        cpu_gemv.isa_level()
    monkeypatch.setattr(cpu_features, "amx_permitted", lambda: True)
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: with_flags - {"amx_int8"})
    assert cpu_features.supported_levels() == ["avx2", "avx512_vnni"]


def test_build_into_a_fresh_cache_and_fallbacks(tmp_path, monkeypatch, caplog, level):
    monkeypatch.setenv("JAXINFER_NATIVE_CACHE", str(tmp_path))
    other = next(name for name in build.ISA_LEVELS if name != level)
    older = [tmp_path / f"jaxinfer_gemv_{level}_{i:016x}.so" for i in range(6)]  # earlier builds, used in turn
    for i, p in enumerate([*older, tmp_path / f"jaxinfer_gemv_{other}_{0:016x}.so"]):
        p.write_bytes(b"")
        os.utime(p, (1e9 + i, 1e9 + i))
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        path = build.library_path(level)
    assert path is not None and path.parent == tmp_path and path.exists()
    assert "compiling the native CPU matmul kernels" in caplog.text
    kept = sorted(p.name for p in tmp_path.glob("jaxinfer_gemv_*.so"))
    assert kept == sorted([path.name, *(p.name for p in older[-(build.KEEP_BUILDS - 1):]),
                           f"jaxinfer_gemv_{other}_{0:016x}.so"])  # the newest used of this level, the other level's
    caplog.clear()
    os.utime(path, (1e9, 1e9))
    assert build.library_path(level) == path and "compiling" not in caplog.text  # cached: no second build
    assert path.stat().st_mtime > time.time() - 60  # marked as used
    monkeypatch.setenv("CXX", "false")  # a compiler that fails: logged, no library, the callers use XLA
    monkeypatch.setattr(build, "SOURCES", (tmp_path / "changed.cc",))
    (tmp_path / "changed.cc").write_text("int broken(")
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build.library_path(level) is None
    assert "failed" in caplog.text
    monkeypatch.setattr(build, "_compiler", lambda: None)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build.library_path(level) is None
    assert "no C++ compiler" in caplog.text


def test_the_build_key_is_the_sources_contents_not_their_place(tmp_path, monkeypatch, level):
    """Another checkout of the same sources finds the same library (its key once held the source paths, so each
    clone built its own and pushed other checkouts' builds out of the shared cache folder)."""
    here, cxx = build.library_path(level), build._compiler()
    key = build.build_key(cxx, level)
    for f in (*build.SOURCES, *build.HEADERS):
        shutil.copy(f, tmp_path / f.name)
    monkeypatch.setattr(build, "SOURCES", tuple(tmp_path / f.name for f in build.SOURCES))
    monkeypatch.setattr(build, "HEADERS", tuple(tmp_path / f.name for f in build.HEADERS))
    assert build.build_key(cxx, level) == key and build.library_path(level) == here
    (tmp_path / "amx.h").write_text((tmp_path / "amx.h").read_text() + "\n")  # a changed header: another key
    assert build.build_key(cxx, level) != key


def test_an_unusable_cache_folder_or_compiler_is_a_warning_not_an_error(tmp_path, monkeypatch, caplog, level):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("JAXINFER_NATIVE_CACHE", str(tmp_path / "a_file" / "cache"))  # below a file: mkdir fails
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build.library_path(level) is None
    assert "JAXINFER_NATIVE_CACHE" in caplog.text
    caplog.clear()
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build._compiler() is not None  # g++ or c++ instead, said so
    assert "is not an executable" in caplog.text
