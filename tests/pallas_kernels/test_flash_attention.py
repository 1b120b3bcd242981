"""Tests for pallas_kernels.flash_attention: the reference, then the TPU (Mosaic) and GPU (Triton) kernels on CPU.

1. The reference against tiny cases worked out by hand in the comments, and against a dense attention written
   here in numpy (it slices each sequence's visible keys; no mask arithmetic) on random ragged packings.
2. Each kernel in generic interpret mode (`interpret=True`) against the reference over a fixed, sparse sample of
   the grid dtype x GQA group (1, 2, 3, 4, 8) x head dim (64, 128, once 256) x block sizes x sequence lengths
   (1, block - 1, block, block + 1, long, empty, several packed, padding rows), with sliding window and soft cap;
   the TPU kernel also once under `pltpu.InterpretParams` (TPU memory, DMA and race simulation, ~3 ms per grid
   step, so tiny). The per-tile KV schedule is checked by hand, and NaN-filled K/V in tiles a query tile must
   skip prove the kernels never read them.
3. Lowering for real TPU / GPU targets on CPU (an abstract device) checks what interpret mode does not: Mosaic's
   block-shape rules and Triton's power-of-two tiles, at T = 32768. One test per backend shows lowering rejects
   a bad tile, so those tests can fail. The values a program computes are the same at 1k and 32k tokens (one
   [block_kv, H] K/V tile per loop step, never a T-sized one).

Tolerances: f32 1e-5 (both sides accumulate in f32; only summation order differs). bf16 3e-2 absolute / 2e-2
relative: inputs are the same bf16 values on both sides, but the kernels round the probabilities of each KV tile
to bf16 before the PV product while the reference rounds the globally normalised ones; |v| ~ 1 and bf16 keeps 8
significant bits (2^-9 relative per rounding), summed over up to ~100 keys.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import AbstractDevice, AbstractMesh

from pallas_kernels.block_sizes import BlockSizes
from pallas_kernels.flash_attention import flash_attention_gpu, flash_attention_reference, flash_attention_tpu
from pallas_kernels.flash_attention import gpu as gpu_module
from pallas_kernels.flash_attention.reference import query_block_schedule

LN3 = math.log(3.0)
KERNELS = {"tpu": flash_attention_tpu, "gpu": flash_attention_gpu}
TOLERANCE = {"float32": dict(rtol=1e-5, atol=1e-5), "bfloat16": dict(rtol=2e-2, atol=3e-2)}


def _attend(fn, q, k, v, cu_q_lens, **kw) -> np.ndarray:
    out = fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(cu_q_lens, jnp.int32), **kw)
    assert out.shape == q.shape and out.dtype == jnp.asarray(q).dtype
    return np.asarray(out.astype(jnp.float32))


# --- (a) the reference, by hand ------------------------------------------------------------------------------------


def test_hand_computed_two_packed_sequences_and_padding_row():
    # 1 head, head dim 2, sm_scale 1. Sequence 0 = rows 0-1, sequence 1 = rows 2-3, row 4 is padding.
    #   seq 0: k0 = [0, 0], k1 = [1, 0]; v0 = [4, 0], v1 = [0, 8]
    #     row 0 sees only k0 -> v0 = [4, 0] (whatever q0 is)
    #     row 1, q = [ln 3, 0]: scores 0, ln 3 -> probs 1/4, 3/4 -> [1, 0] + [0, 6] = [1, 6]
    #   seq 1: k2 = [0, 0], k3 = [0, ln 3]; v2 = [2, 2], v3 = [6, -2]
    #     row 2 sees only k2 (not seq 0's keys) -> v2 = [2, 2]
    #     row 3, q = [0, 1]: scores q.k2 = 0, q.k3 = ln 3 -> 1/4 v2 + 3/4 v3 = [0.5 + 4.5, 0.5 - 1.5] = [5, -1]
    #     (were k0, k1 visible, their scores 0, 0 would add two more weights and change it)
    k = np.array([[0, 0], [1, 0], [0, 0], [0, LN3], [9, 9]], np.float32)[:, None]  # [T=5, K=1, H=2]
    v = np.array([[4, 0], [0, 8], [2, 2], [6, -2], [9, 9]], np.float32)[:, None]
    q = np.array([[7, -3], [LN3, 0], [5, 5], [0, 1], [1, 1]], np.float32)[:, None]
    out = _attend(flash_attention_reference, q, k, v, [0, 2, 4], sm_scale=1.0)
    np.testing.assert_allclose(out[:, 0], [[4, 0], [1, 6], [2, 2], [5, -1], [0, 0]], rtol=1e-6, atol=1e-6)


def test_hand_computed_sliding_window():
    # One sequence of 3 tokens, window 2: position p sees keys p - 1 and p. sm_scale 1.
    #   k = [5, 0], [0, 0], [ln 3, 0];  v = [0, 8], [4, 0], [0, 4]
    #   row 0 sees k0 -> [0, 8]
    #   row 1, q = [0, 0]: keys 0, 1 with equal scores -> (v0 + v1) / 2 = [2, 4]
    #   row 2, q = [1, 0]: keys 1, 2 (key 0, score 5, is outside) -> scores 0, ln 3 -> 1/4 v1 + 3/4 v2 = [1, 3]
    k = np.array([[5, 0], [0, 0], [LN3, 0]], np.float32)[:, None]
    v = np.array([[0, 8], [4, 0], [0, 4]], np.float32)[:, None]
    q = np.array([[3, 3], [0, 0], [1, 0]], np.float32)[:, None]
    out = _attend(flash_attention_reference, q, k, v, [0, 3], sm_scale=1.0, sliding_window=2)
    np.testing.assert_allclose(out[:, 0], [[0, 8], [2, 4], [1, 3]], rtol=1e-6, atol=1e-6)


def test_hand_computed_soft_cap_with_gqa():
    # One sequence of 2 tokens; 2 query heads share 1 kv head; sm_scale 0.5, soft_cap 1.
    #   k0 = [0, 0], k1 = [2000, 0];  v0 = [1, 0], v1 = [0, 1]
    #   row 1, head 0, q = [1, 0]: scaled scores 0, 1000 -> capped tanh(0) = 0, tanh(1000) = 1
    #     -> probs 1 / (1 + e), e / (1 + e) = 0.268941, 0.731059 (uncapped it would be [0, 1])
    #   row 1, head 1, q = [0, 0]: scores 0, 0 -> [0.5, 0.5]
    #   row 0 sees only k0 -> v0 = [1, 0] for both heads
    e = math.e
    k = np.array([[0, 0], [2000, 0]], np.float32)[:, None]
    v = np.array([[1, 0], [0, 1]], np.float32)[:, None]
    q = np.array([[[1, 0], [0, 0]], [[1, 0], [0, 0]]], np.float32)  # [T=2, N=2, H=2]
    out = _attend(flash_attention_reference, q, k, v, [0, 2], sm_scale=0.5, soft_cap=1.0)
    np.testing.assert_allclose(out, [[[1, 0], [1, 0]], [[1 / (1 + e), e / (1 + e)], [0.5, 0.5]]], rtol=1e-6,
                               atol=1e-6)


# --- (b) the reference against a numpy dense attention -------------------------------------------------------------


def _dense_oracle(q, k, v, lens, sm_scale, sliding_window=None, soft_cap=None) -> np.ndarray:
    """Per sequence, per token, per head: softmax over exactly the visible keys, in float64."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    group = q.shape[1] // k.shape[1]
    out = np.zeros(q.shape)
    begin = 0
    for n in lens:
        for j in range(n):
            lo = 0 if sliding_window is None else max(0, j - sliding_window + 1)
            for h in range(q.shape[1]):
                kk, vv = k[begin + lo: begin + j + 1, h // group], v[begin + lo: begin + j + 1, h // group]
                s = kk @ q[begin + j, h] * sm_scale
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                p = np.exp(s - s.max())
                out[begin + j, h] = (p / p.sum()) @ vv
        begin += n
    return out


def _packing(lens, pad, num_kv_heads, group, head_dim, dtype, seed):
    rng = np.random.default_rng(seed)
    t = sum(lens) + pad
    q = rng.normal(size=(t, num_kv_heads * group, head_dim)).astype(np.float32)
    k = rng.normal(size=(t, num_kv_heads, head_dim)).astype(np.float32)
    v = rng.normal(size=(t, num_kv_heads, head_dim)).astype(np.float32)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    cu_q_lens = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return (q.astype(np_dtype), k.astype(np_dtype), v.astype(np_dtype)), cu_q_lens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("group,window,cap", [(1, None, None), (3, None, None), (2, 4, None), (4, 3, 2.5)])
def test_reference_matches_dense_oracle_on_ragged_packing(group, window, cap, dtype):
    # Lengths 1, 7, an empty sequence, 12 and 3 packed back to back, then 4 padding rows.
    lens = [1, 7, 0, 12, 3]
    (q, k, v), cu_q_lens = _packing(lens, 4, 2, group, 16, dtype, seed=group)
    kw = dict(sm_scale=0.25, sliding_window=window, soft_cap=cap)
    out = _attend(flash_attention_reference, q, k, v, cu_q_lens, **kw)
    expected = _dense_oracle(q, k, v, lens, **kw)  # the same (bf16-rounded) inputs, exact arithmetic
    np.testing.assert_allclose(out, expected, **TOLERANCE[dtype])
    np.testing.assert_array_equal(out[sum(lens):], 0.0)


# --- (c) the kernels against the reference ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One sampled point of the grid: sequence lengths packed in order, then `pad` padding rows."""

    lens: tuple[int, ...]
    pad: int = 0
    group: int = 1
    num_kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "float32"
    block_sizes: BlockSizes | None = None
    sliding_window: int | None = None
    soft_cap: float | None = None


CASES = [
    Case(lens=(1, 15, 16, 17), block_sizes=BlockSizes(16, 16)),  # 1, block - 1, block, block + 1
    Case(lens=(5, 17, 1, 9), pad=3, group=3, block_sizes=BlockSizes(8, 16)),  # SmolLM2 heads, padding rows
    Case(lens=(70,), group=4, head_dim=128, block_sizes=BlockSizes(16, 32)),  # long, Llama-3 group
    Case(lens=(9, 0, 23), pad=1, group=8, num_kv_heads=1, dtype="bfloat16", block_sizes=BlockSizes(16, 16)),
    Case(lens=(40, 3), pad=2, group=2, sliding_window=7, block_sizes=BlockSizes(8, 16)),  # window skips tiles
    Case(lens=(30, 12), group=1, soft_cap=5.0, sliding_window=9, dtype="bfloat16"),  # Gemma 2 style, default tiles
    Case(lens=(20,), group=2, head_dim=256, block_sizes=BlockSizes(8, 16)),
    Case(lens=(33, 31), pad=5, group=3, soft_cap=30.0, dtype="bfloat16", block_sizes=BlockSizes(32, 64)),
    Case(lens=(1,), group=3),  # a single token, default tiles
]


@pytest.mark.parametrize("backend", sorted(KERNELS))
@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"case{i}" for i in range(len(CASES))])
def test_kernel_matches_reference(backend, index):
    case = CASES[index]
    (q, k, v), cu_q_lens = _packing(case.lens, case.pad, case.num_kv_heads, case.group, case.head_dim, case.dtype,
                                    seed=index)
    kw = dict(sm_scale=case.head_dim**-0.5, sliding_window=case.sliding_window, soft_cap=case.soft_cap)
    expected = _attend(flash_attention_reference, q, k, v, cu_q_lens, **kw)
    out = _attend(KERNELS[backend], q, k, v, cu_q_lens, **kw, block_sizes=case.block_sizes, interpret=True)
    np.testing.assert_allclose(out, expected, **TOLERANCE[case.dtype])
    np.testing.assert_array_equal(out[sum(case.lens):], 0.0)  # padding rows


def test_tpu_kernel_with_tiles_that_are_not_powers_of_two():
    # Mosaic needs block_q * G % 8 == 0, not powers of two: 12 tokens x 2 heads = 24 rows, 40-token KV tiles.
    (q, k, v), cu_q_lens = _packing((37, 11, 30), 6, 2, 2, 64, "float32", seed=11)
    kw = dict(sm_scale=0.125, sliding_window=50)
    expected = _attend(flash_attention_reference, q, k, v, cu_q_lens, **kw)
    out = _attend(flash_attention_tpu, q, k, v, cu_q_lens, **kw, block_sizes=BlockSizes(12, 40), interpret=True)
    np.testing.assert_allclose(out, expected, **TOLERANCE["float32"])


def test_tpu_kernel_under_tpu_interpret_mode():
    # Simulates TPU memory spaces and DMAs, and fails on data races between the double-buffered K/V copies.
    (q, k, v), cu_q_lens = _packing((5, 9), 2, 1, 3, 64, "float32", seed=5)
    kw = dict(sm_scale=0.125, sliding_window=6)
    expected = _attend(flash_attention_reference, q, k, v, cu_q_lens, **kw)
    out = _attend(flash_attention_tpu, q, k, v, cu_q_lens, **kw, block_sizes=BlockSizes(8, 4),
                  interpret=pltpu.InterpretParams(detect_races=True))
    np.testing.assert_allclose(out, expected, **TOLERANCE["float32"])


def test_query_block_schedule_by_hand():
    # Sequences rows 0-4 and 5-13, rows 14-15 padding; block_q = block_kv = 4.
    #   tile 0 rows 0-3:   seq 0 from row 0; last row 3  -> KV tiles [0, 1); no sequence starts inside
    #   tile 1 rows 4-7:   seq 0 from row 0; last row 7  -> [0, 2); seq 1 starts at row 5 inside: (0, 1]
    #   tile 2 rows 8-11:  seq 1 from row 5; last row 11 -> [5 // 4, 11 // 4 + 1) = [1, 3)
    #   tile 3 rows 12-15: seq 1 from row 5; last real row 13 -> [1, 4)
    #   With window 3, tile 2 starts at max(5, 8 - 3 + 1) = 6 -> tile 1; tile 3 at max(5, 10) = 10 -> tile 2.
    #   A tile of padding rows only (rows 16-19 of a 5th tile) gets an empty range.
    cu = jnp.asarray([0, 5, 14], jnp.int32)
    schedule = jax.jit(query_block_schedule, static_argnums=(1, 2, 3, 4))
    kv_lo, kv_hi, seq_lo, seq_hi = (np.asarray(a) for a in schedule(cu, 5, 4, 4, None))
    np.testing.assert_array_equal(kv_lo[:4], [0, 0, 1, 1])
    np.testing.assert_array_equal(kv_hi[:4], [1, 2, 3, 4])
    np.testing.assert_array_equal(seq_lo[:4], [0, 0, 1, 1])
    np.testing.assert_array_equal(seq_hi[:4], [0, 1, 1, 1])
    assert kv_lo[4] == kv_hi[4]
    kv_lo, kv_hi, _, _ = (np.asarray(a) for a in schedule(cu, 4, 4, 4, 3))
    np.testing.assert_array_equal(kv_lo, [0, 0, 1, 2])
    np.testing.assert_array_equal(kv_hi, [1, 2, 3, 4])


@pytest.mark.parametrize("backend", sorted(KERNELS))
def test_kernels_never_read_skipped_tiles(backend):
    # Sequences rows 0-15 and 16-55, window 8, 8-token tiles. NaN in rows 0-15 (a whole earlier sequence) and in
    # rows 24-39 of the second: its query tile at rows 48-55 starts at max(16, 48 - 8 + 1) = 41 -> KV tiles 5, 6
    # only, so its rows (and sequence 1's rows 16-23, whose KV tiles are 2 only) must come out finite and right.
    (q, k, v), cu_q_lens = _packing((16, 40), 0, 1, 2, 64, "float32", seed=3)
    kw = dict(sm_scale=0.125, sliding_window=8)
    expected = _attend(flash_attention_reference, q, k, v, cu_q_lens, **kw)
    for a in (k, v):
        a[0:16] = np.nan
        a[24:40] = np.nan
    out = _attend(KERNELS[backend], q, k, v, cu_q_lens, **kw, block_sizes=BlockSizes(8, 8), interpret=True)
    for rows in (slice(16, 24), slice(48, 56)):
        np.testing.assert_allclose(out[rows], expected[rows], **TOLERANCE["float32"])


@pytest.mark.parametrize("backend", sorted(KERNELS))
def test_bad_arguments_raise(backend):
    (q, k, v), cu_q_lens = _packing((4,), 0, 2, 2, 64, "float32", seed=0)
    fn = functools.partial(KERNELS[backend], sm_scale=0.1, interpret=True)
    for f in (fn, functools.partial(flash_attention_reference, sm_scale=0.1)):
        with pytest.raises(ValueError, match="multiple"):
            f(q[:, :3], k, v, cu_q_lens)  # 3 query heads over 2 kv heads
        with pytest.raises(ValueError, match="head dim"):
            f(q, k[..., :32], v[..., :32], cu_q_lens)
        with pytest.raises(ValueError, match="sliding_window"):
            f(q, k, v, cu_q_lens, sliding_window=0)
        with pytest.raises(ValueError, match="soft_cap"):
            f(q, k, v, cu_q_lens, soft_cap=-1.0)
    if backend == "gpu":
        with pytest.raises(ValueError, match="power"):
            fn(q, k, v, cu_q_lens, block_sizes=BlockSizes(12, 16))
        with pytest.raises(ValueError, match="block_kv"):
            flash_attention_gpu(q, k, v, cu_q_lens, sm_scale=0.1, block_sizes=BlockSizes(16, 8))


# --- (d) lowering for real targets (no hardware: an abstract device) -------------------------------------------------

TPU = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
GPU = AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
TARGETS = {"tpu": (flash_attention_tpu, TPU, "tpu", "tpu_custom_call"),
           "gpu": (flash_attention_gpu, GPU, "cuda", "__gpu$xla.gpu.triton")}


def _lower(backend: str, num_tokens, num_heads, num_kv_heads, head_dim, dtype, **kw) -> str:
    kernel, device, platform, _ = TARGETS[backend]
    s = jax.ShapeDtypeStruct
    kv = s((num_tokens, num_kv_heads, head_dim), dtype)
    args = (s((num_tokens, num_heads, head_dim), dtype), kv, kv, s((9,), jnp.int32))
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=device)):
        return jax.jit(functools.partial(kernel, **kw)).trace(*args).lower(lowering_platforms=(platform,)).as_text()


# (N, K, H, dtype, sliding_window, soft_cap) at T = 32768 with default tiles: SmolLM2 (head dim 64, where jax's own
# TPU paged attention does not lower), Llama-3-8B heads, and head dim 256 with Gemma 2's window and soft cap.
LOWERING = [(9, 3, 64, jnp.bfloat16, None, None), (32, 8, 128, jnp.bfloat16, None, None),
            (16, 8, 256, jnp.bfloat16, 4096, 50.0)]


@pytest.mark.parametrize("backend", sorted(TARGETS))
@pytest.mark.parametrize("shape", LOWERING, ids=["smollm2", "llama3_8b", "h256_window_cap"])
def test_kernel_lowers_for_its_target_at_32k_tokens(backend, shape):
    n, k, h, dtype, window, cap = shape
    text = _lower(backend, 32768, n, k, h, dtype, sm_scale=h**-0.5, sliding_window=window, soft_cap=cap)
    assert TARGETS[backend][3] in text


def test_tpu_lowering_rejects_a_tile_that_breaks_mosaic_rules():
    # 2 tokens x 3 heads = 6 rows per query tile: neither a multiple of 8 nor the whole (96-row) array. Interpret
    # mode runs it; lowering must refuse it, which is what makes the TPU lowering tests above able to fail.
    with pytest.raises(ValueError, match="divisible by 8"):
        _lower("tpu", 32, 9, 3, 64, jnp.float32, sm_scale=0.1, block_sizes=BlockSizes(2, 16))


def test_gpu_lowering_rejects_a_tile_that_is_not_a_power_of_two(monkeypatch):
    # Without G_pad (G = 3 kept as is) a query tile has 16 x 3 = 48 rows; Triton lowering must refuse it, which is
    # what makes the GPU lowering tests above able to fail. (A shape no other test traces, so no cached trace.)
    monkeypatch.setattr(gpu_module, "next_pow2", lambda n: n)
    with pytest.raises(ValueError, match="power of 2"):
        _lower("gpu", 48, 9, 3, 64, jnp.float32, sm_scale=0.1, block_sizes=BlockSizes(16, 16))


def _sub_jaxprs(eqn):
    for param in eqn.params.values():
        for sub in param if isinstance(param, tuple) else (param,):
            sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
            if hasattr(sub, "eqns"):
                yield sub


def _kernel_value_shapes(backend: str, num_tokens: int) -> set[tuple[int, ...]]:
    """Shapes of every value (not ref) one program computes, from the pallas_call in the traced wrapper."""
    def find(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                return eqn.params["jaxpr"]
            for sub in _sub_jaxprs(eqn):
                if (found := find(sub)) is not None:
                    return found
        return None

    def shapes(jaxpr):
        out = set()
        for eqn in jaxpr.eqns:
            out |= {tuple(v.aval.shape) for v in eqn.outvars if isinstance(v.aval, jax.core.ShapedArray)}
            for sub in _sub_jaxprs(eqn):
                out |= shapes(sub)
        return out

    s = jax.ShapeDtypeStruct
    kv = s((num_tokens, 3, 64), jnp.bfloat16)
    args = (s((num_tokens, 9, 64), jnp.bfloat16), kv, kv, s((5,), jnp.int32))
    kernel = find(jax.make_jaxpr(functools.partial(TARGETS[backend][0], sm_scale=0.1))(*args).jaxpr)
    assert kernel is not None
    return shapes(kernel)


@pytest.mark.parametrize("backend", sorted(TARGETS))
def test_kernel_tiles_do_not_grow_with_tokens(backend):
    # No kernel is one big block in disguise: what a program computes (query tile, one [block_kv, H] K/V tile per
    # loop step, [rows, block_kv] scores) is the same at 1k and 32k tokens; the largest is the score tile.
    small, large = _kernel_value_shapes(backend, 1024), _kernel_value_shapes(backend, 32768)
    assert small and small == large
    block_kv = 512 if backend == "tpu" else 64  # the table's prefill tiles
    rows = 128 * 3 if backend == "tpu" else 64  # TPU: 128 tokens x G = 3; GPU: 16 tokens x G_pad = 4
    assert (block_kv, 64) in large and max(math.prod(shape) for shape in large) == rows * block_kv
