"""Weight-only int8 / packed int4 matmul at decode shapes (<= MAX_ROWS activation rows): the `jnp` reference and the
TPU (Mosaic) and GPU (Triton) kernels, which read the quantized weights once and dequantize inside the kernel.

Formats (plain arrays, `models.quant`'s layout with one kept and one contracted axis): `reference`'s docstring.

| backend       | TPU          | GPU          | CPU          |
|---------------|--------------|--------------|--------------|
| `"auto"`      | TPU kernel   | GPU kernel   | reference    |
| `"tpu"`       | TPU kernel (on CPU: `interpret=pltpu.InterpretParams()` or True)         |
| `"gpu"`       | GPU kernel (on CPU: `interpret=True`)                                     |
| `"reference"` | reference    | reference    | reference    |
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from pallas_kernels.lazy import lazy_exports
from pallas_kernels.quant_matmul.reference import MAX_ROWS, check_args, dequantize, weight_only_matmul_reference

if TYPE_CHECKING:
    from jax.experimental.pallas import tpu as pltpu

__getattr__ = lazy_exports(__name__, {"GpuBlocks": "pallas_kernels.quant_matmul.gpu",
                                      "weight_only_matmul_gpu": "pallas_kernels.quant_matmul.gpu",
                                      "TpuBlocks": "pallas_kernels.quant_matmul.tpu",
                                      "weight_only_matmul_tpu": "pallas_kernels.quant_matmul.tpu"})

BACKENDS = ("auto", "tpu", "gpu", "reference")


def weight_only_matmul(x: jax.Array, values: jax.Array, scale: jax.Array, min: jax.Array | None = None, *,
                       group_size: int, backend: str = "auto",
                       interpret: bool | pltpu.InterpretParams = False) -> jax.Array:
    """x @ w.T for a weight-only quantized w: int8 [N, K] or packed int4 uint8 [N, K/2] (`reference` docstring).

    Args:
      x: f32 or bf16 [M, K], 1 <= M <= MAX_ROWS.
      values: int8 [N, K], or packed int4 uint8 [N, K/2] (the dtype picks the format).
      scale: f32 [N, G], G = K / group_size (group_size 0: G = 1, one scale per row).
      min: f32 [N, G] for asymmetric int4 (w = scale * q + min); None: symmetric (int4: w = scale * (q - 8)).
      group_size: input elements per scale (0: the whole row).
      backend: "auto" (the platform's kernel; the reference on CPU), "tpu", "gpu" or "reference".
      interpret: passed to the kernel (CPU runs: `pltpu.InterpretParams()` or True for TPU, True for GPU).

    Returns:
      f32 [M, N].

    Raises:
      ValueError: an unknown backend, or the problems `reference.check_args` names (x not f32 / bf16 [M, K],
        M above MAX_ROWS, values neither int8 nor uint8, K mismatched or odd for int4, group_size not dividing K,
        scale / min shapes or dtypes), and the kernels' tiling limits (`tpu.choose_block_k`; on GPU a group
        size that is not a power of two).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {', '.join(map(repr, BACKENDS))}")
    check_args(x, values, scale, min, group_size, max_rows=MAX_ROWS)
    if backend == "auto":
        platform = jax.default_backend()
        backend = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}.get(platform, "reference")
    if backend == "tpu":
        from pallas_kernels.quant_matmul.tpu import weight_only_matmul_tpu

        return weight_only_matmul_tpu(x, values, scale, min, group_size=group_size, interpret=interpret)
    if backend == "gpu":
        from pallas_kernels.quant_matmul.gpu import weight_only_matmul_gpu

        return weight_only_matmul_gpu(x, values, scale, min, group_size=group_size, interpret=bool(interpret))
    return weight_only_matmul_reference(x, values, scale, min, group_size=group_size)


__all__ = ["BACKENDS", "MAX_ROWS", "GpuBlocks", "TpuBlocks", "check_args", "dequantize", "weight_only_matmul",
           "weight_only_matmul_gpu", "weight_only_matmul_reference", "weight_only_matmul_tpu"]
