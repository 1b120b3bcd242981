"""GGUF tensors kept quantized (`QuantizationConfig(format="gguf")`, vLLM's `--quantization gguf`): Q8_0, Q4_0
and Q4_1 blocks become `models.quant.QuantizedWeight`s instead of f32 arrays, without changing a single value.

Block layouts (llama.cpp's `ggml-common.h` / `ggml-quants.c`, and the `gguf` package's `gguf/quants.py`): each
block covers 32 consecutive elements of a row of the [out, in] matrix (along the input axis) and starts with its
f16 scale d:

| type | bytes | layout                            | element j of the block                               |
|------|-------|-----------------------------------|------------------------------------------------------|
| Q8_0 | 34    | d, int8 qs[32]                    | d * qs[j]                                            |
| Q4_0 | 18    | d, uint8 qs[16]                   | d * (q - 8); q = qs[j] & 15 for j < 16, else         |
|      |       |                                   | qs[j - 16] >> 4                                      |
| Q4_1 | 20    | d, f16 m, uint8 qs[16]            | d * q + m, q as for Q4_0                             |

Q8_0 becomes int8 values with one f32 scale per 32 input elements (`group_size` 32); Q4_0 / Q4_1 become the
packed int4 format of `models.quant4` (element 2j in the low nibble of byte j, 2j+1 in the high one; scales, and
Q4_1's mins, f32), the nibbles repacked once here. f16 converts to f32 exactly, and the products are the ones
`gguf.quants.dequantize` computes, so the dequantized weights equal its output bit for bit.

Which tensors stay quantized (`kept_quantized`): a projection in `models.quant.CONTRACT_AXES` whose tensor has
the same kept type in every layer (llama.cpp mixes types across layers, e.g. in Q4_K_M files; such a field is
dequantized as before), with an input width the blocks divide within its last contracted axis (a 32-block never
spans two heads); the embedding and an untied LM head when their type is kept and the embedding gather reads it
(`models.quant_matmul.lookup_supports`: Q8_0, not Q4). Row operations of the loader, the Q/K RoPE un-permutation and
the split of Phi-3's fused tensors, move whole rows, so they apply to the blocks unchanged; where a row lands is
read from the name table's own converter (`jaxinfer.loading.tensor_names`), applied to a matrix of row numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
from gguf import GGMLQuantizationType

from jaxinfer.loading.tensor_names import TOP_TENSORS, TensorName, layer_names
from models import quant4
from models.config import ModelConfig
from models.llama import Weights
from models.quant import CONTRACT_AXES, QuantizedWeight
from models.quant_matmul import lookup_supports

BLOCK = 32  # elements per block of every kept type
# type -> (bytes per block, bytes before the codes: d, and Q4_1's m)
KEPT_TYPES = {GGMLQuantizationType.Q8_0: (34, 2), GGMLQuantizationType.Q4_0: (18, 2),
              GGMLQuantizationType.Q4_1: (20, 4)}
_TOP_CONTRACT_AXES = {"embed": (-1,), "lm_head": (-2,)}


def decode_blocks(data: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Splits rows of GGUF blocks into our quantized parts (module docstring: the layouts).

    Args:
      data: uint8 [..., R, nb * bytes per block]: R rows of `nb` blocks each, as the `gguf` reader maps them.
      qtype: Q8_0, Q4_0 or Q4_1.

    Returns:
      (values, scale f32 [..., R, nb], min f32 [..., R, nb] or None): values int8 [..., R, 32 nb] for Q8_0,
      packed uint8 [..., R, 16 nb] for Q4_0 / Q4_1 (`models.quant4` nibble order).

    Raises:
      ValueError: another type, or rows that are not whole blocks.
    """
    if qtype not in KEPT_TYPES:
        raise ValueError(f"GGUF type {qtype.name} is not kept quantized (only {', '.join(t.name for t in KEPT_TYPES)})")
    size, head = KEPT_TYPES[qtype]
    if data.dtype != np.uint8 or data.shape[-1] % size:
        raise ValueError(f"GGUF {qtype.name} rows of {data.shape[-1]} bytes ({data.dtype}) are not whole "
                         f"{size}-byte blocks")
    blocks = data.reshape(*data.shape[:-1], -1, size)  # [..., R, nb, size]
    f16 = lambda b: np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)  # noqa: E731
    scale = f16(blocks[..., 0:2])  # [..., R, nb]
    mins = f16(blocks[..., 2:4]) if qtype == GGMLQuantizationType.Q4_1 else None
    qs = blocks[..., head:]
    if qtype == GGMLQuantizationType.Q8_0:
        return np.ascontiguousarray(qs).view(np.int8).reshape(*data.shape[:-1], -1), scale, mins
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # [..., R, nb, 32]: elements j < 16, then j + 16
    return quant4.pack(codes).reshape(*data.shape[:-1], -1), scale, mins


def _row_layout(name: TensorName, cfg: ModelConfig, rows: np.ndarray, in_cols: int,
                contract_axes: tuple[int, ...]) -> tuple[np.ndarray, tuple[int, ...], tuple[int, ...]] | None:
    """(checkpoint row of each kept position, own-layout shape, contracted shape) of one [out, in] matrix whose
    row r is checkpoint row rows[r], as `name.convert` lays it out; None when the converter refuses the shape or
    does not keep rows whole with the input axis in order (then the field is dequantized, as before).

    The converters only slice, transpose and reshape, so applying them to broadcast views whose entries are row
    (and column) numbers costs no memory and tells where every checkpoint row goes."""
    r = np.broadcast_to(rows[:, None], (rows.size, in_cols))
    c = np.broadcast_to(np.arange(in_cols)[None, :], (rows.size, in_cols))
    try:
        own_r, own_c = name.convert(r, cfg), name.convert(c, cfg)
    except ValueError:
        return None
    n = len(contract_axes)
    vr = np.moveaxis(own_r, contract_axes, range(-n, 0))  # the values layout: kept axes, then contracted ones
    vc = np.moveaxis(own_c, contract_axes, range(-n, 0))
    contracted = vr.shape[vr.ndim - n:]
    first = (0,) * (vr.ndim - n)
    if contracted[-1] % BLOCK or not np.array_equal(vc[first].ravel(), np.arange(in_cols)):
        return None
    return np.ascontiguousarray(vr[(..., *(0,) * n)]), own_r.shape, contracted


def _field(name: TensorName, cfg: ModelConfig, tensors: list, spec_shape: tuple[int, ...],
           contract_axes: tuple[int, ...], rows_of: Callable[[TensorName, int | None, int], np.ndarray],
           layers: list[int | None]) -> QuantizedWeight | None:
    """One field kept quantized, stacked over `layers` (its GGUF tensors `tensors`, one per layer, all of one
    kept type), or None when its layout does not allow it (`_row_layout`) or its shape does not fit the config."""
    qtype = tensors[0].tensor_type
    in_cols, out_rows = int(tensors[0].shape[0]), int(tensors[0].shape[1])
    experts = len(tensors[0].shape) == 3  # [E, out, in] (GGUF shapes list the input width first)
    parts = []
    for t, layer in zip(tensors, layers):
        if tuple(t.shape) != tuple(tensors[0].shape):
            return None
        layout = _row_layout(name, cfg, rows_of(name, layer, out_rows), in_cols, contract_axes)
        if layout is None:
            return None
        index, own_shape, contracted = layout
        lead = (int(t.shape[2]),) if experts else ()  # E
        if (*lead, *own_shape) != (spec_shape[1:] if layer is not None else spec_shape):
            return None
        data = np.asarray(t.data).reshape(*lead, out_rows, -1)  # [(E,) out, bytes]
        values, scale, mins = decode_blocks(data[..., index.ravel(), :], qtype)
        kept = (*lead, *index.shape)
        values = values.reshape(*kept, *contracted[:-1], -1)
        parts.append((values, scale.reshape(*kept, -1), None if mins is None else mins.reshape(*kept, -1)))
    stack = (lambda xs: np.stack(xs)) if layers != [None] else (lambda xs: xs[0])
    return QuantizedWeight(values=stack([p[0] for p in parts]), scale=stack([p[1] for p in parts]),
                           min=None if parts[0][2] is None else stack([p[2] for p in parts]),
                           contract_axes=contract_axes, group_size=BLOCK)


def kept_quantized(cfg: ModelConfig, tensors: Mapping,
                   rows_of: Callable[[TensorName, int | None, int], np.ndarray]) -> dict[str, QuantizedWeight]:
    """The fields of `models.llama.Weights` that stay quantized (module docstring: which), built from the file.

    Args:
      cfg: the model's config.
      tensors: GGUF tensor name -> the `gguf` reader's tensor (its `tensor_type`, `shape` and `data`).
      rows_of: (name, layer, rows) -> i64[rows], the checkpoint row each row of the loaded [out, in] matrix comes
        from (the Q/K RoPE un-permutation; arange otherwise).

    Returns:
      Field name -> `QuantizedWeight` (layer fields stacked over layers, [L, ...]); "embed" and "lm_head" for the
      top-level ones. Fields left out load dequantized, as without this mode.
    """
    specs = Weights.abstract(cfg)
    kept = {}
    for field, name in layer_names(cfg.architecture).items():
        spec = getattr(specs.layers, field)
        if spec is None or field not in CONTRACT_AXES:
            continue
        ts = [tensors.get(name.gguf.format(i=i)) for i in range(cfg.num_layers)]
        if any(t is None for t in ts) or len({t.tensor_type for t in ts}) != 1 or ts[0].tensor_type not in KEPT_TYPES:
            continue
        q = _field(name, cfg, ts, spec.shape, CONTRACT_AXES[field], rows_of, list(range(cfg.num_layers)))
        if q is not None:
            kept[field] = q
    for field in _TOP_CONTRACT_AXES:
        name = TOP_TENSORS[field]
        spec, t = getattr(specs, field), tensors.get(name.gguf)
        if spec is None or t is None or t.tensor_type not in KEPT_TYPES:
            continue
        q = _field(name, cfg, [t], spec.shape, _TOP_CONTRACT_AXES[field], rows_of, [None])
        if q is not None and (field == "lm_head" or lookup_supports(q)):  # the embedding: if the gather reads it
            kept[field] = q
    return kept
