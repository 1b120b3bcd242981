"""The native CPU row reductions of the logits (`pallas_kernels.cpu_gemv.logits`) against numpy: `logit_rows`' 
greedy argmax among the allowed ids exactly (`np.argmax` of the logits with -inf at banned ids), the row max exactly
and the log-sum-exp to f32 rounding of a float64 sum, the rows' finiteness; NaN, -inf, ties across the kernel's spans of 8,192 logits,
vocab limits and bans; `truncation_threshold`'s kept set against the sampler's sort path (`sampling._truncate`).
The sampler's use of them: tests/jaxinfer/engine/test_sampling_fast.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pallas_kernels import cpu_gemv
from pallas_kernels.cpu_gemv import build
from jaxinfer.engine import sampling
from pallas_kernels.cpu_gemv.logits import logit_rows, truncation_threshold

_rows = jax.jit(logit_rows)


@pytest.fixture(autouse=True)
def native_on(monkeypatch):
    assert build.supported_levels(), "this CPU runs no ISA level of the native kernels (AVX2 + FMA needed)"
    monkeypatch.delenv("JAXINFER_NATIVE_KERNELS", raising=False)
    assert cpu_gemv.active()


def _allowed(bitmask: np.ndarray, suppress: np.ndarray, v: int, limit: int) -> np.ndarray:
    ids = np.arange(v)
    allowed = ((bitmask[:, ids // 32].astype(np.int64) >> (ids % 32)) & 1).astype(bool)
    allowed[:, limit:] = False
    for b, row in enumerate(suppress):
        allowed[b, row[row >= 0]] = False
    return allowed


def _check(x: np.ndarray, suppress: np.ndarray, bitmask: np.ndarray, limit: int) -> None:
    argmax, row_max, lse, finite = map(np.asarray, _rows(x, suppress, bitmask, np.int32(limit)))
    v = x.shape[1]
    np.testing.assert_array_equal(finite, np.isfinite(x).all(-1))  # the whole row, past the limit too
    banned = np.where(_allowed(bitmask, suppress, v, limit), x, -np.inf)
    np.testing.assert_array_equal(argmax, np.argmax(banned, axis=-1))  # np.argmax: first max, NaN counts as max
    raw = np.where(np.arange(v) < limit, x, -np.inf).astype(np.float64)
    top = raw.max(-1)  # NaN if one is NaN
    with np.errstate(invalid="ignore"):
        ref = np.log(np.exp(raw - top[:, None]).sum(-1))
    np.testing.assert_array_equal(row_max, np.where(np.isinf(top), np.nan, top).astype(np.float32))
    # NaN where the reference is NaN. The kernel sums each 8-lane vector's exps in f32, ~V / 8 terms a lane, and
    # with integer logits (many equal terms) their roundings need not cancel: up to (V / 8) * 2^-24 of the sum
    # (hypothesis found 3.7e-6 at V = 4395 and 1.0e-5 at V = 5834, relative to sums of ~2.2)
    np.testing.assert_allclose(lse, ref, rtol=2e-6, atol=2e-6 + (v / 8) * 2.0**-24)


def _case(rng: np.random.Generator, b: int, v: int, dense: float = 0.9, s: int = 3):
    x = (rng.standard_normal((b, v)) * 4).astype(np.float32)
    bits = rng.random((b, -(-v // 32) * 32)) < dense
    bitmask = np.packbits(bits.reshape(b, -1, 32)[..., ::-1], axis=-1).view(">u4")[..., 0].astype(np.uint32)
    suppress = np.full((b, s), -1, np.int32)
    suppress[:, : s - 1] = rng.integers(0, v, (b, s - 1))
    return x, suppress, bitmask.view(np.int32)


@pytest.mark.parametrize("b", [1, 3, 8])
@pytest.mark.parametrize("v", [1, 7, 77, 1000, 8192, 8193, 20000, 49152])
def test_matches_numpy(b: int, v: int) -> None:
    rng = np.random.default_rng(v * 10 + b)
    x, suppress, bitmask = _case(rng, b, v)
    for limit in sorted({v, max(1, v - 37), max(1, v // 3)}):
        _check(x, suppress, bitmask, limit)


def test_ties_nan_inf_and_bans() -> None:
    rng = np.random.default_rng(1)
    v = 20000  # three spans
    x, suppress, bitmask = _case(rng, 8, v, dense=1.0)
    x[0, [30, 38, 41, 9000, 17000]] = 50.0  # ties in one lane, across lanes and across spans: the first index
    x[1, 12] = 60.0
    suppress[1, 0] = 12  # the largest logit suppressed: the next one
    x[2, 9100], x[2, 300] = np.nan, 70.0  # an allowed NaN is the argmax; the row's max and sum are NaN
    x[3, 9100] = np.nan
    bitmask[3, 9100 // 32] &= ~np.int32(1 << (9100 % 32))  # a banned NaN: not the argmax, the sum still NaN
    x[4] = -np.inf  # every logit -inf: argmax 0, max and log-sum-exp NaN (as jnp's exp(-inf - -inf))
    x[5, :] = -np.inf
    x[5, 15000] = 3.0  # one finite logit
    x[6, 100] = np.inf  # +inf: the argmax; max and sum NaN (jnp's exp(inf - inf))
    bitmask[7] = 0
    bitmask[7, 5] = 1  # a single allowed id: 160
    _check(x, suppress, bitmask, v)
    _check(x, suppress, bitmask, 9050)  # the limit inside a span: the NaN at 9100 no longer counts
    x[7, 19999] = -np.inf  # past the limit: the row is not finite, its sums unchanged
    _check(x, suppress, bitmask, 9050)


def test_every_id_banned_gives_zero() -> None:
    x = np.random.default_rng(2).standard_normal((2, 100)).astype(np.float32)
    argmax, *_ = _rows(x, np.full((2, 1), -1, np.int32), np.zeros((2, 4), np.int32), np.int32(100))
    np.testing.assert_array_equal(np.asarray(argmax), [0, 0])


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 4), v=st.integers(1, 9000), dense=st.sampled_from([0.01, 0.5, 1.0]),
       limit_frac=st.floats(0.01, 1.0), seed=st.integers(0, 2**31))
@example(b=2, v=4395, dense=0.01, limit_frac=1.0, seed=518)  # sums 3.7e-6 and 1.0e-5 off in f32 (2026-12-06)
@example(b=2, v=5834, dense=0.01, limit_frac=1.0, seed=518)
def test_property_random_rows(b: int, v: int, dense: float, limit_frac: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x, suppress, bitmask = _case(rng, b, v, dense)
    x = np.round(x)  # many ties
    _check(x, suppress, bitmask, max(1, int(v * limit_frac)))


def test_bad_shapes_are_refused() -> None:
    x = np.zeros((2, 64), np.float32)
    with pytest.raises(ValueError, match=r"bitmask must be \[B, ceil\(V / 32\)\]"):
        logit_rows(x, np.full((2, 1), -1, np.int32), np.zeros((2, 3), np.int32), 64)
    with pytest.raises(ValueError, match=r"logits must be \[B, V\] and suppress \[B, S\]"):
        logit_rows(x, np.full((3, 1), -1, np.int32), np.zeros((2, 2), np.int32), 64)


def _check_truncation(scaled: np.ndarray, top_k: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """The rows as the native threshold truncates them equal the sort path's (`sampling._truncate`); the
    thresholds."""
    s = type("S", (), {"top_k": jnp.asarray(top_k), "top_p": jnp.asarray(top_p)})()
    threshold = np.asarray(jax.jit(truncation_threshold)(scaled, top_k, top_p))
    with np.errstate(invalid="ignore"):
        ours = np.where(scaled >= threshold[:, None], scaled, -np.inf)
    np.testing.assert_array_equal(ours, np.asarray(jax.jit(lambda x: sampling._truncate(x, s))(scaled)))
    return threshold


@pytest.mark.parametrize("v", [7, 1000, 49152])
def test_truncation_keeps_what_the_sort_path_keeps(v: int) -> None:
    rng = np.random.default_rng(v)
    b = 12
    scaled = (rng.standard_normal((b, v)) * rng.uniform(0.5, 6, (b, 1))).astype(np.float32)
    scaled[0, :5] += 30  # a peaked row: the first window holds the mass
    scaled[1] = np.round(scaled[1])  # ties at the boundaries
    scaled[2, rng.integers(0, v, v // 2)] = -np.inf  # banned ids
    scaled[3, : v - 2] = -np.inf  # two live ids
    top_k = rng.choice([1, 2, 5, 40, v // 2, v], b).astype(np.int32)
    top_k[3] = 5  # more than the live ids: the k-th entry is -inf
    top_p = rng.choice([0.05, 0.5, 0.9, 0.99, 1.0], b).astype(np.float32)
    top_p[0] = 0.999
    _check_truncation(scaled, top_k, top_p)


def test_truncation_degenerate_rows() -> None:
    scaled = np.full((3, 64), -np.inf, np.float32)
    scaled[1, :60] = np.nan
    scaled[1, 60:] = [1.0, 2.0, -np.inf, 0.5]  # four non-NaN values, top_k 5: the sort path's 5th entry is a NaN
    scaled[2] = np.arange(64, dtype=np.float32)
    scaled[2, 7] = np.nan  # a NaN counts below every value
    top_k, top_p = np.array([3, 5, 60], np.int32), np.array([0.5, 1.0, 0.9999], np.float32)
    threshold = _check_truncation(scaled, top_k, top_p)
    assert threshold[0] == -np.inf and np.isnan(threshold[1])


def test_truncation_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"scaled must be \[B, V\], top_k and top_p \[B\]"):
        truncation_threshold(np.zeros((2, 8), np.float32), np.ones(3, np.int32), np.ones(2, np.float32))
