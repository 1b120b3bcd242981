"""Weight-only int8 / int4 matmul: the `jnp` reference and the TPU / GPU kernels against a float64 numpy oracle.

The oracle works from the codes before packing (the format's spec, `pallas_kernels.quant_matmul.reference`): the
test packs them itself (element 2j in the low nibble of byte j, 2j + 1 in the high one), so a kernel that reads the
nibbles in the wrong order, misplaces a group's scale or min, or drops an N edge tile fails. The GPU kernel runs in
generic interpret mode over the shape grid; the TPU kernel under `pltpu.InterpretParams` (TPU memory semantics,
~3 ms per grid step) on fewer, small-grid cases. Lowering for an abstract TPU v5 lite and H200 checks what
interpret mode does not: Mosaic's block-shape rules and Triton's power-of-two tiles, at Llama-3-8B shapes.

Tolerance, elementwise: |out - oracle| <= rtol * (|x| @ |w|.T) + 1e-6, the bound of the rounding errors of a sum of
products. f32 x: rtol 1e-5 (f32 sums of <= 14336 terms). bf16 x: rtol 2^-8: the GPU kernel rounds each dequantized
weight to bf16 (relative error <= 2^-9, as XLA's path does); the TPU kernel applies the f32 scales after an exact
bf16 x integer-code dot, so it is f32-accurate, but is held to the same bound.
"""

from __future__ import annotations

import dataclasses
import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import AbstractDevice, AbstractMesh

from models import quant4
from pallas_kernels.quant_matmul import (GpuBlocks, TpuBlocks, weight_only_matmul, weight_only_matmul_gpu,
                                         weight_only_matmul_reference, weight_only_matmul_tpu)
from pallas_kernels.quant_matmul import gpu as gpu_module
from pallas_kernels.quant_matmul import tpu as tpu_module

RTOL = {"float32": 1e-5, "bfloat16": 2.0**-8}


@dataclasses.dataclass(frozen=True)
class Case:
    """rows x K activations, N x K weights; fmt "int8", "int4" (symmetric) or "int4_asym"; group 0: per row."""

    rows: int
    k: int
    n: int
    fmt: str
    group: int
    dtype: str = "float32"


def oracle_pack(codes: np.ndarray) -> np.ndarray:
    """uint8 [N, K/2] from codes [N, K] in [0, 15]: byte j = codes[2j] | codes[2j + 1] << 4."""
    out = np.zeros((codes.shape[0], codes.shape[1] // 2), np.uint8)
    for j in range(out.shape[1]):
        out[:, j] = codes[:, 2 * j] + 16 * codes[:, 2 * j + 1]
    return out


def build(case: Case, seed: int):
    """(args for the kernels, float64 oracle output, float64 error bound |x| @ |w|.T)."""
    rng = np.random.default_rng(seed)
    groups = case.k // case.group if case.group else 1
    x = rng.normal(size=(case.rows, case.k)).astype(np.float32)
    if case.dtype == "bfloat16":
        x = x.astype(ml_dtypes.bfloat16)
    scale = rng.uniform(0.5, 2.0, (case.n, groups)).astype(np.float32) * 10.0 ** rng.integers(-3, 1, (case.n, 1))
    scale = scale.astype(np.float32)
    mins = None
    if case.fmt == "int8":
        codes = rng.integers(-127, 128, (case.n, case.k))
        values = codes.astype(np.int8)
        w = codes.astype(np.float64)
    else:
        codes = rng.integers(0, 16, (case.n, case.k))
        values = oracle_pack(codes)
        if case.fmt == "int4_asym":
            mins = rng.normal(size=(case.n, groups)).astype(np.float32)
            w = codes.astype(np.float64)
        else:
            w = codes.astype(np.float64) - 8.0
    col_group = np.arange(case.k) // (case.k // groups)  # the group of each input column
    w = w * scale.astype(np.float64)[:, col_group]
    if mins is not None:
        w = w + mins.astype(np.float64)[:, col_group]
    x64 = x.astype(np.float64)
    args = (jnp.asarray(x), jnp.asarray(values), jnp.asarray(scale), None if mins is None else jnp.asarray(mins))
    return args, x64 @ w.T, np.abs(x64) @ np.abs(w).T


def check(case: Case, out, expected, bound):
    assert out.shape == (case.rows, case.n) and out.dtype == jnp.float32
    err = np.abs(np.asarray(out, np.float64) - expected)
    limit = RTOL[case.dtype] * bound + 1e-6
    assert np.all(err <= limit), f"max error {err.max():.3g}, worst ratio {np.max(err / limit):.3g}"


# SmolLM2's projections (K=576 -> N=1536 and back), odd N (an N edge tile), rows 1-8, every format and group.
CASES = [
    Case(1, 576, 1536, "int8", 0),
    Case(8, 1536, 576, "int8", 0, "bfloat16"),
    Case(3, 576, 1536, "int8", 32, "bfloat16"),
    Case(5, 1536, 577, "int8", 128),
    Case(2, 576, 1536, "int4", 32, "bfloat16"),
    Case(7, 1536, 576, "int4", 64),
    Case(4, 1536, 576, "int4", 128, "bfloat16"),
    Case(6, 576, 1536, "int4_asym", 32),
    Case(1, 1536, 576, "int4_asym", 64, "bfloat16"),
    Case(8, 1024, 1001, "int4_asym", 128, "bfloat16"),
    Case(4, 512, 301, "int4", 0),
    Case(3, 256, 96, "int4_asym", 32),
    Case(2, 256, 40, "int4_asym", 0),  # one min per row
]
# Small grids for the TPU interpret mode (~3 ms per grid step); the block_n of 128 makes N edge tiles.
TPU_CASES = [
    (Case(1, 576, 1536, "int4_asym", 32), None),  # SmolLM2: whole-K tile of 18 groups, 3 N tiles
    (Case(8, 1536, 576, "int8", 0, "bfloat16"), None),
    (Case(3, 512, 300, "int8", 32, "bfloat16"), TpuBlocks(block_n=128)),  # 16 groups per K tile, N edge tile
    (Case(5, 1024, 200, "int4", 64), TpuBlocks(block_n=128)),  # 2 K tiles of 16 groups
    (Case(2, 2048, 130, "int4_asym", 128, "bfloat16"), TpuBlocks(block_n=128)),
    (Case(7, 384, 136, "int4_asym", 0), None),  # one scale and min per row; packed K of 192 lanes: one K tile
]


def _id(case: Case) -> str:
    return f"m{case.rows}-k{case.k}-n{case.n}-{case.fmt}-g{case.group}-{case.dtype}"


def test_oracle_by_hand():
    # K = 4, one group: codes (1, 15, 8, 0) pack to bytes (1 | 15 << 4, 8 | 0 << 4) = (241, 8); symmetric int4
    # weights 2 * (q - 8) = (-14, 14, 0, -16); x = (1, 2, 3, 0.5): -14 + 28 + 0 - 8 = 6.
    values = oracle_pack(np.array([[1, 15, 8, 0]]))
    assert values.tolist() == [[241, 8]]
    x = jnp.array([[1.0, 2.0, 3.0, 0.5]])
    out = weight_only_matmul_reference(x, jnp.asarray(values), jnp.array([[2.0]]), group_size=0)
    assert float(out[0, 0]) == 6.0
    # Asymmetric, 2 groups of 2: w = (0.5 * 1 + 1, 0.5 * 15 + 1, 1 * 8 - 1, 1 * 0 - 1) = (1.5, 8.5, 7, -1);
    # x . w = 1.5 + 17 + 21 - 0.5 = 39.
    out = weight_only_matmul_reference(x, jnp.asarray(values), jnp.array([[0.5, 1.0]]), jnp.array([[1.0, -1.0]]),
                                       group_size=2)
    assert float(out[0, 0]) == 39.0


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(codes=st.lists(st.integers(0, 15), min_size=2, max_size=64).filter(lambda c: len(c) % 2 == 0))
def test_nibble_order_is_models_quant4s(codes):
    # The kernels' packed format is models.quant4's: its packing gives the oracle's bytes, and the reference reads
    # the codes back from them (a one-hot x picks each weight).
    codes = np.array([codes])
    packed = np.asarray(quant4.pack(codes))
    np.testing.assert_array_equal(packed, oracle_pack(codes))
    k = codes.shape[1]
    w = weight_only_matmul_reference(jnp.eye(k)[:8], jnp.asarray(packed), jnp.ones((1, 1)), group_size=0)
    np.testing.assert_array_equal(np.asarray(w[:, 0]), codes[0, :8] - 8.0)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_reference_matches_oracle(case):
    args, expected, bound = build(case, seed=1)
    check(case, weight_only_matmul_reference(*args, group_size=case.group), expected, bound)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_gpu_kernel_matches_oracle(case):
    args, expected, bound = build(case, seed=2)
    check(case, weight_only_matmul_gpu(*args, group_size=case.group, interpret=True), expected, bound)


def test_gpu_kernel_split_k_and_small_tiles():
    # Partial sums over 4 K splits, 16-row tiles with an N edge tile, one group spanning several K steps.
    case = Case(3, 1024, 40, "int4_asym", 128)
    args, expected, bound = build(case, seed=3)
    out = weight_only_matmul_gpu(*args, group_size=128, blocks=GpuBlocks(block_n=16, block_k=32, split_k=4),
                                 interpret=True)
    check(case, out, expected, bound)


@pytest.mark.parametrize("case,blocks", TPU_CASES, ids=[_id(c) for c, _ in TPU_CASES])
def test_tpu_kernel_matches_oracle(case, blocks):
    args, expected, bound = build(case, seed=4)
    out = weight_only_matmul_tpu(*args, group_size=case.group, blocks=blocks or TpuBlocks(),
                                 interpret=pltpu.InterpretParams())
    check(case, out, expected, bound)


def test_dispatch_picks_by_backend():
    case = Case(2, 256, 72, "int4", 32)
    args, expected, bound = build(case, seed=5)
    for backend, interpret in (("auto", False), ("reference", False), ("gpu", True), ("tpu", True)):
        check(case, weight_only_matmul(*args, group_size=32, backend=backend, interpret=interpret), expected, bound)


def _bad(**changes):
    x, v, s = jnp.zeros((2, 64)), jnp.zeros((16, 32), jnp.uint8), jnp.ones((16, 2))
    kw = dict(x=x, values=v, scale=s, min=None, group_size=32, backend="reference") | changes
    return weight_only_matmul(kw.pop("x"), kw.pop("values"), kw.pop("scale"), kw.pop("min"), **kw)


@pytest.mark.parametrize("changes,match", [
    (dict(x=jnp.zeros((9, 64))), "9 rows"),
    (dict(x=jnp.zeros((2, 63)), values=jnp.zeros((16, 31), jnp.uint8)), "even K"),
    (dict(x=jnp.zeros((2, 63)), values=jnp.zeros((16, 63), jnp.int8)), "group_size=32"),
    (dict(group_size=24), "group_size=24"),
    (dict(scale=jnp.ones((16, 4))), r"scale must be f32\[16, 2\]"),
    (dict(min=jnp.ones((16, 2)), values=jnp.zeros((16, 64), jnp.int8)), "only for packed int4"),
    (dict(min=jnp.ones((16, 1))), "min must be"),
    (dict(values=jnp.zeros((16, 64), jnp.int16)), "values must be int8"),
    (dict(x=jnp.zeros((2, 64), jnp.int32)), "x must be f32 or bf16"),
    (dict(backend="cuda"), "backend='cuda'"),
])
def test_bad_input_is_a_value_error(changes, match):
    with pytest.raises(ValueError, match=match):
        _bad(**changes)


def test_gpu_refuses_a_group_that_does_not_tile():
    # K = 96: block_k 32 columns; a group of 48 neither divides 32 nor is a multiple of it.
    with pytest.raises(ValueError, match="power of two or a multiple of block_k=32"):
        weight_only_matmul_gpu(jnp.zeros((1, 96)), jnp.zeros((16, 96), jnp.int8), jnp.ones((16, 2)), group_size=48,
                               interpret=True)


# --- lowering for real targets (no hardware: an abstract device) -----------------------------------------------------

TPU = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
GPU = AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")


def _abstract(rows, k, n, fmt, group, dtype):
    s = jax.ShapeDtypeStruct
    groups = k // group if group else 1
    values = s((n, k), jnp.int8) if fmt == "int8" else s((n, k // 2), jnp.uint8)
    scale = s((n, groups), jnp.float32)
    return s((rows, k), dtype), values, scale, scale if fmt == "int4_asym" else None


def _lower(kernel, device: AbstractDevice, platform: str, args, **kw) -> str:
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=device)):
        return jax.jit(functools.partial(kernel, **kw)).trace(*args).lower(lowering_platforms=(platform,)).as_text()


# Llama-3-8B decode (q/o 4096 -> 4096, gate/up 4096 -> 14336, down 14336 -> 4096) and SmolLM2's projections.
LOWERING = [
    (1, 4096, 14336, "int8", 0, jnp.bfloat16),
    (8, 14336, 4096, "int4", 32, jnp.bfloat16),
    (4, 4096, 4096, "int4_asym", 128, jnp.bfloat16),
    (2, 4096, 14336, "int8", 64, jnp.float32),
    (1, 576, 1536, "int4_asym", 32, jnp.bfloat16),
    (8, 1536, 576, "int4", 64, jnp.float32),
]


@pytest.mark.parametrize("shape", LOWERING, ids=[f"lower{i}" for i in range(len(LOWERING))])
def test_tpu_kernel_lowers_for_tpu(shape):
    *dims, group, dtype = shape
    text = _lower(weight_only_matmul_tpu, TPU, "tpu", _abstract(*dims, group, dtype), group_size=group)
    assert "tpu_custom_call" in text


@pytest.mark.parametrize("shape", LOWERING, ids=[f"lower{i}" for i in range(len(LOWERING))])
def test_gpu_kernel_lowers_for_gpu(shape):
    *dims, group, dtype = shape
    text = _lower(weight_only_matmul_gpu, GPU, "cuda", _abstract(*dims, group, dtype), group_size=group)
    assert "__gpu$xla.gpu.triton" in text  # the Triton custom call


def test_tpu_lowering_rejects_a_tile_that_breaks_mosaic_rules(monkeypatch):
    # A 64-wide N tile (the wrapper's lane check loosened to 64) is neither a multiple of 128 nor the whole N:
    # interpret mode would run it; lowering must refuse it, which is what makes the lowering tests able to fail.
    monkeypatch.setattr(tpu_module, "LANES", 64)
    args = _abstract(1, 256, 320, "int8", 0, jnp.float32)
    with pytest.raises(ValueError, match="divisible by 8 and 128"):
        _lower(weight_only_matmul_tpu, TPU, "tpu", args, group_size=0, blocks=TpuBlocks(block_n=64))


def test_gpu_lowering_rejects_a_tile_that_is_not_a_power_of_two(monkeypatch):
    # A 48-row N tile, with the wrapper's power-of-two check switched off: Triton lowering must refuse its loads,
    # which is what makes the GPU lowering tests above able to fail.
    monkeypatch.setattr(gpu_module, "is_pow2", lambda n: True)
    args = _abstract(1, 256, 96, "int8", 0, jnp.float32)
    with pytest.raises(ValueError, match="power of 2"):
        _lower(weight_only_matmul_gpu, GPU, "cuda", args, group_size=0, blocks=GpuBlocks(block_n=48))
