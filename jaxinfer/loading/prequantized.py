"""Pre-quantized HF checkpoints kept as they are stored: FP8 (`fp8`, compressed-tensors `float-quantized`), GPTQ
and AWQ int4, and compressed-tensors `pack-quantized` int4, each moved exactly into `models.quant.QuantizedWeight`s
(never dequantized and quantized again).

1. `read_scheme` reads config.json's `quantization_config` into a `Scheme`; an option we cannot load exactly or do
   not run is a `ValueError` naming it (`stored_quantization`: the `QuantizationConfig` the engine reports).
2. `_rows` reads one projection's stored tensors into a row form: values [out, in] (float8_e4m3fn, or 4-bit codes
   in uint8) and f32 scales [out, G] (and mins, or None) with w[o, i] = scale[o, i // g] * v[o, i] (+ min[o, i // g];
   int4 without mins: scale * (q - 8)), g = in / G (per-channel: G = 1). Block scales are repeated over their rows,
   and groups that do not divide `in` are split into gcd(g, in)-wide ones with the same scale: both exact.
3. `to_layout` moves the row form into our output-major layout with the tensor-name table's own converter.

Stored layouts (w: torch's [out, in] Linear weight; nibble k of an int32 word: bits 4k..4k+3; g: group size):

| method | tensors of a module `m` | w[o, i] |
|---|---|---|
| fp8, block | m.weight f8e4m3 [out, in], m.weight_scale_inv f32 [ceil(out/bo), ceil(in/bi)] | weight * s[o//bo, i//bi] |
| fp8 | m.weight, m.weight_scale f32 (one value) | weight * s |
| compressed-tensors float | m.weight, m.weight_scale: [1] tensor, [out, 1] channel, [out, in/g] group, block | weight * s |
| gptq | m.qweight i32 [in/8, out] (nibble k of row r: input 8r+k), m.qzeros i32 [in/g, out/8] (nibble k of column c: | s * (q - z) |
|      | output 8c+k), m.scales f16 [in/g, out], m.g_idx [in] = i // g; z = stored + 1 ("gptq" v1), stored ("gptq_v2") | |
| awq (GEMM) | m.qweight i32 [in, out/8], nibble k of column c: output 8c + (0, 2, 4, 6, 1, 3, 5, 7)[k]; m.qzeros | s * (q - z) |
|      | i32 [in/g, out/8] packed alike; m.scales f16 [in/g, out] | |
| compressed-tensors pack | m.weight_packed i32 [out, in/8] (nibble k of column c: input 8c+k, code q + 8), | s * q |
|      | m.weight_scale [out, in/g], m.weight_shape [2] = (out, in) | |

Sources: DeepSeek-V3's `weight_dequant` and transformers' FineGrainedFP8 (block scales, multiplied); vLLM's
`Fp8Config` (per-tensor `weight_scale`); compressed-tensors' `QuantizationArgs` and `pack_to_int32`; GPTQ's format
as AutoGPTQ writes it, v1's stored zero - 1 and GPTQModel's `gptq_v2` (danieldk.eu "GPTQ checkpoint format");
AutoAWQ's `AWQ_ORDER` packing. f16 / bf16 scales times 4-bit integers are exact in f32, so int4 weights equal the
formulas above computed in f32; fp8 ones are weight times scale rounded once to f32, as computed in numpy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from jaxinfer.loading.tensor_names import TensorName
from models import quant4
from models.config import ModelConfig
from models.quant import CONTRACT_AXES, INT4_GROUP_SIZES, QuantizationConfig, QuantizedWeight, _order

_AXES = {**CONTRACT_AXES, "lm_head": (-2,)}  # fields that may be stored quantized: their contracted axes
_AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # nibble k of an AWQ word holds output column 8c + _AWQ_ORDER[k]
_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


@dataclasses.dataclass(frozen=True)
class Scheme:
    """How a checkpoint stores its quantized projections (from `quantization_config`).

    Attributes:
      method: "fp8", "compressed-tensors", "gptq" or "awq".
      fmt: our format, "fp8" or "int4".
      strategy: "tensor", "channel", "group" or "block" (fp8); "group" (int4).
      group_size: input channels per scale (group and block strategies), else 0.
      block_rows: output rows per block scale (block strategy), else 0.
      symmetric: int4 without zero points (w = scale * (q - 8)).
      zero_offset: added to stored GPTQ zero points (1 for the v1 format).
    """

    method: str
    fmt: str
    strategy: str
    group_size: int = 0
    block_rows: int = 0
    symmetric: bool = True
    zero_offset: int = 0

    @property
    def marker(self) -> str:
        """The suffix of the tensor whose presence beside a module marks it as stored quantized."""
        if self.method in ("gptq", "awq"):
            return ".qweight"
        if self.fmt == "int4":
            return ".weight_packed"
        return ".weight_scale_inv" if self.method == "fp8" and self.strategy == "block" else ".weight_scale"


def _option(qc: Mapping[str, Any], key: str, allowed: Collection, default: Any = None, *aliases: str) -> Any:
    value = next((qc[k] for k in (key, *aliases) if k in qc), default)
    norm = value.lower() if isinstance(value, str) else value
    if norm not in allowed:
        raise ValueError(f"quantization_config {key}={value!r} is not supported (supported: "
                         f"{', '.join(map(repr, allowed))})")
    return norm


def _positive_ints(value: Any, n: int, what: str) -> list[int]:
    if (not isinstance(value, list) or len(value) != n or
            not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ValueError(f"quantization_config {what}={value!r} must be {n} positive integers")
    return value


def read_scheme(hf_config: Mapping[str, Any]) -> Scheme | None:
    """The `Scheme` of an HF config.json's `quantization_config`, or None without one.

    Raises:
      ValueError: naming the option we do not support: an unknown `quant_method`; fp8 other than e4m3 or with a
        static activation scheme; GPTQ with `desc_act`, `dynamic`, bits other than 4, a group size other than
        32 / 64 / 128 or a `checkpoint_format` other than gptq / gptq_v2; AWQ other than 4-bit GEMM with zero points;
        compressed-tensors other than fp8 weights (dynamic or no activation quantization) or symmetric 4-bit group
        weights, more than one scheme, sparsity, a KV cache scheme or `actorder`.
    """
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise ValueError(f"config.json quantization_config must be an object, got {type(qc).__name__}")
    method = _option(qc, "quant_method", ("fp8", "gptq", "awq", "compressed-tensors"))
    if method == "fp8":
        _option(qc, "fmt", ("e4m3",), "e4m3")
        _option(qc, "activation_scheme", ("dynamic",), "dynamic")  # run weight-only: activations stay unquantized
        block = qc.get("weight_block_size")
        if block is None:
            return Scheme("fp8", "fp8", "tensor")
        rows, cols = _positive_ints(block, 2, "weight_block_size")
        return Scheme("fp8", "fp8", "block", group_size=cols, block_rows=rows)
    if method in ("gptq", "awq"):
        _option(qc, "bits", (4,), None, "w_bit")
        group = _option(qc, "group_size", INT4_GROUP_SIZES, None, "q_group_size")
        if method == "awq":
            _option(qc, "version", ("gemm",), "gemm")
            _option(qc, "zero_point", (True,), True)
            return Scheme("awq", "int4", "group", group_size=group, symmetric=False)
        _option(qc, "desc_act", (False,), False)
        _option(qc, "dynamic", (None, {}), None)
        _option(qc, "pack_dtype", ("int32",), "int32")
        fmt = _option(qc, "checkpoint_format", ("gptq", "gptq_v2"), "gptq", "format")
        sym = _option(qc, "sym", (True, False), True)
        return Scheme("gptq", "int4", "group", group_size=group, symmetric=sym, zero_offset=int(fmt == "gptq"))
    return _compressed_tensors_scheme(qc)


def _compressed_tensors_scheme(qc: Mapping[str, Any]) -> Scheme:
    fmt = _option(qc, "format", ("float-quantized", "pack-quantized"))
    _option(qc, "quantization_status", ("compressed", None), None)
    _option(qc, "sparsity_config", (None, {}), None)
    _option(qc, "kv_cache_scheme", (None,), None)
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError(f"quantization_config config_groups={groups!r} must be a non-empty object")
    schemes = {}
    for name, group in groups.items():
        w = group.get("weights") or {}
        if group.get("format") not in (None, fmt):
            raise ValueError(f"quantization_config config_groups.{name}.format={group['format']!r} differs from "
                             f"format={fmt!r}")
        acts = group.get("input_activations")
        if acts is not None and not acts.get("dynamic"):
            raise ValueError(f"quantization_config config_groups.{name}.input_activations={acts!r}: static "
                             "activation quantization is not supported (dynamic runs weight-only)")
        _option(group, "output_activations", (None,), None)
        _option(w, "actorder", (None,), None)
        _option(w, "dynamic", (False,), False)
        _option(w, "symmetric", (True,), True)
        if fmt == "float-quantized":
            _option(w, "type", ("float",))
            _option(w, "num_bits", (8,))
            strategy = _option(w, "strategy", ("tensor", "channel", "group", "block"))
        else:
            _option(w, "type", ("int",))
            _option(w, "num_bits", (4,))
            strategy = _option(w, "strategy", ("group",))
        rows, cols = 0, 0
        if strategy == "group":
            cols = _option(w, "group_size", INT4_GROUP_SIZES) if fmt == "pack-quantized" else \
                _positive_ints([w.get("group_size")], 1, "group_size")[0]
        elif strategy == "block":
            rows, cols = _positive_ints(w.get("block_structure"), 2, "block_structure")
        schemes[name] = Scheme("compressed-tensors", "fp8" if fmt == "float-quantized" else "int4", strategy,
                               group_size=cols, block_rows=rows)
    if len(set(schemes.values())) > 1:
        raise ValueError(f"quantization_config config_groups {sorted(schemes)} quantize differently; one scheme "
                         "for every layer is supported")
    return next(iter(schemes.values()))


def is_stored_quantized(scheme: Scheme, module: str, keys: Collection[str]) -> bool:
    """Whether module `module` (an HF name without ".weight", e.g. "lm_head") is stored quantized."""
    return module + scheme.marker in keys


def stored_quantization(hf_config: Mapping[str, Any], keys: Collection[str]) -> QuantizationConfig | None:
    """The `QuantizationConfig` (resolved) a pre-quantized folder's weights load with: its format and group size,
    weight-only, embedding unquantized, the LM head quantized when the checkpoint stores it so. None without a
    `quantization_config`.

    Args:
      hf_config: the folder's config.json.
      keys: the names of the folder's tensors.

    Raises:
      ValueError: from `read_scheme`.
    """
    scheme = read_scheme(hf_config)
    if scheme is None:
        return None
    return QuantizationConfig(format=scheme.fmt, group_size=scheme.group_size, quantize_activations=False,
                              quantize_embedding=False, asymmetric=scheme.fmt == "int4" and not scheme.symmetric,
                              quantize_lm_head=is_stored_quantized(scheme, "lm_head", keys)).resolved()


# --- stored tensors -> row form ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rows:
    """One projection in row form (module docstring): values [out, in], scale f32 [out, G], min f32 [out, G] or
    None; `group_size` = in / G, or 0 for G = 1."""

    values: np.ndarray
    scale: np.ndarray
    min: np.ndarray | None
    group_size: int


def nibbles(words: np.ndarray, axis: int) -> np.ndarray:
    """uint8 4-bit codes of int32 words, 8 per word along `axis`: nibble k of word j becomes element 8j + k."""
    w = np.moveaxis(np.ascontiguousarray(words).view(np.uint32), axis, -1)
    codes = (w[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF  # [..., n, 8]
    return np.moveaxis(codes.reshape(*w.shape[:-1], -1).astype(np.uint8), -1, axis)


def _uniform_groups(scale: np.ndarray, mn: np.ndarray | None, group: int, size_in: int) -> Rows:
    """Scales of `group`-wide input groups (the last one possibly partial) as gcd(group, in)-wide ones."""
    g = math.gcd(group, size_in)
    scale = np.repeat(scale, group // g, axis=1)[:, :size_in // g]
    mn = None if mn is None else np.repeat(mn, group // g, axis=1)[:, :size_in // g]
    return Rows(values=None, scale=scale, min=mn, group_size=0 if g == size_in else g)


def _rows(scheme: Scheme, module: str, read: Callable[[str], np.ndarray], keys: Collection[str]) -> Rows:
    """`module`'s stored tensors in row form (module docstring's table).

    Raises:
      ValueError: a tensor of the wrong dtype or shape, a missing companion tensor, GPTQ zero points that are not
        8 in a symmetric checkpoint, or a `g_idx` that reorders groups (all named).
    """
    def get(suffix: str, shape: tuple[int, ...] | None = None, dtypes: tuple = ()) -> np.ndarray:
        try:
            x = read(module + suffix)
        except KeyError:
            raise ValueError(f"tensor {module + suffix!r} is missing") from None
        if (shape is not None and x.shape != shape) or (dtypes and x.dtype not in dtypes):
            raise ValueError(f"tensor {module + suffix!r} is {x.dtype} {x.shape}; expected "
                             f"{'/'.join(map(str, dtypes)) or 'any dtype'} {shape or ''}")
        return x

    if scheme.fmt == "fp8":
        w = get(".weight", None, (_FP8,))
        if w.ndim != 2:
            raise ValueError(f"tensor {module + '.weight'!r} has shape {w.shape}; expected [out, in]")
        out, size_in = w.shape
        if scheme.strategy == "tensor":
            s = get(".weight_scale").astype(np.float32)
            if s.size != 1:
                raise ValueError(f"tensor {module + '.weight_scale'!r} has shape {s.shape}; a "
                                 "per-tensor scale holds one value")
            return Rows(w, np.full((out, 1), s.reshape(()), np.float32), None, 0)
        if scheme.strategy == "channel":
            return Rows(w, get(".weight_scale", (out, 1)).astype(np.float32), None, 0)
        rows, cols = scheme.block_rows or 1, scheme.group_size
        suffix = ".weight_scale_inv" if scheme.method == "fp8" else ".weight_scale"
        s = get(suffix, (-(-out // rows), -(-size_in // cols))).astype(np.float32)
        return dataclasses.replace(_uniform_groups(np.repeat(s, rows, axis=0)[:out], None, cols, size_in), values=w)

    group = scheme.group_size
    if scheme.method == "compressed-tensors":
        out, size_in = (int(v) for v in get(".weight_shape", (2,)))
        packed = get(".weight_packed", (out, -(-size_in // 8)), (np.dtype(np.int32),))
        codes = nibbles(packed, 1)[:, :size_in]  # [out, in], code = q + 8
        scale = get(".weight_scale", (out, -(-size_in // group))).astype(np.float32)
        return dataclasses.replace(_uniform_groups(scale, None, group, size_in), values=codes)
    qweight = get(".qweight", None, (np.dtype(np.int32),))
    if scheme.method == "gptq":  # [in/8, out]
        codes = nibbles(qweight, 0).T  # [out, in]
        zeros = nibbles
    else:  # awq: [in, out/8], columns interleaved
        codes = _awq_columns(qweight).T
        zeros = lambda words, axis: _awq_columns(words)  # noqa: E731
    out, size_in = codes.shape
    num_groups = -(-size_in // group)
    scale = get(".scales", (num_groups, out)).astype(np.float32).T  # [out, G]
    qzeros = get(".qzeros", (num_groups, -(-out // 8)), (np.dtype(np.int32),))
    z = zeros(qzeros, 1)[:, :out].T.astype(np.float32) + scheme.zero_offset  # [out, G]
    if scheme.method == "gptq" and module + ".g_idx" in keys:
        g_idx = get(".g_idx", (size_in,))
        if not np.array_equal(g_idx, np.arange(size_in) // group):
            raise ValueError(f"tensor {module + '.g_idx'!r} reorders the input channels' groups (act-order / "
                             "desc_act); only g_idx = i // group_size is supported")
    if scheme.symmetric:
        if not np.all(z == quant4.SYMMETRIC_ZERO):
            raise ValueError(f"tensor {module + '.qzeros'!r} holds zero points other than "
                             f"{quant4.SYMMETRIC_ZERO} although quantization_config says sym=true")
        return dataclasses.replace(_uniform_groups(scale, None, group, size_in), values=codes)
    return dataclasses.replace(_uniform_groups(scale, -scale * z, group, size_in), values=codes)


def _awq_columns(words: np.ndarray) -> np.ndarray:
    """AWQ's int32 words [rows, n/8] as codes [rows, n] in column order (undoing `_AWQ_ORDER`)."""
    codes = nibbles(words, 1).reshape(words.shape[0], -1, 8)
    cols = np.empty_like(codes)
    cols[:, :, _AWQ_ORDER] = codes
    return cols.reshape(words.shape[0], -1)


# --- row form -> our layout -------------------------------------------------------------------------------------


def to_layout(rows: Rows, name: TensorName, cfg: ModelConfig, contract_axes: tuple[int, ...], fmt: str
              ) -> QuantizedWeight:
    """A row-form projection as a `QuantizedWeight` of the field `name` converts to: values laid out by the
    table's own converter (`name.convert`), then output-major (`models.quant`); each kept position takes its
    checkpoint row's scales. int4 codes are packed (`models.quant4.pack`).

    Raises:
      ValueError: from `name.convert` (a shape that does not fit the config), or a converter that does not keep
        the input axis whole and in order (groups would then not be contiguous).
    """
    out, size_in = rows.values.shape
    own = name.convert(rows.values, cfg)
    order = _order(own.ndim, contract_axes)
    num_kept = own.ndim - len(contract_axes)
    # Where each output-major position comes from, by converting index arrays (zero-stride views, not copies)
    where = [np.transpose(name.convert(np.broadcast_to(idx, (out, size_in)), cfg), order)
             for idx in (np.arange(out, dtype=np.int32)[:, None], np.arange(size_in, dtype=np.int32)[None, :])]
    kept_rows = where[0][(...,) + (0,) * len(contract_axes)]  # [*kept]: each kept position's checkpoint row
    for corner in ((0,) * num_kept, tuple(n - 1 for n in kept_rows.shape)):
        if not np.array_equal(where[1][corner].reshape(-1), np.arange(size_in)):
            raise ValueError(f"tensor {name.hf!r}: its layout does not keep the input axis whole and in order, so "
                             "it cannot stay quantized in groups")
    values = np.ascontiguousarray(np.transpose(own, order))  # [*kept, *contracted]
    neg = tuple(sorted(a % own.ndim - own.ndim for a in contract_axes))
    return QuantizedWeight(values=quant4.pack(values) if fmt == "int4" else values,
                           scale=np.ascontiguousarray(rows.scale[kept_rows], np.float32),
                           min=None if rows.min is None else np.ascontiguousarray(rows.min[kept_rows], np.float32),
                           contract_axes=neg, group_size=rows.group_size)


def quantized_fetch(cfg: ModelConfig, scheme: Scheme, read: Callable[[str], np.ndarray], keys: Collection[str]
                    ) -> Callable[[str, TensorName, int | None, int | None], QuantizedWeight | None]:
    """The `quantized` hook of `jaxinfer.loading.tensor_names.assemble`: the `QuantizedWeight` of a tensor the
    checkpoint stores quantized, None for one stored plain.

    Args:
      cfg: the model's config.
      scheme: from `read_scheme`.
      read: tensor name -> numpy array in its stored dtype (KeyError when absent).
      keys: every tensor name of the checkpoint.

    Raises (from the hook):
      ValueError: a stored-quantized tensor of a field we keep unquantized (the embedding, a router), and the
        errors of `_rows` and `to_layout`, naming the tensor.
    """
    def fetch(field: str, name: TensorName, layer: int | None, expert: int | None) -> QuantizedWeight | None:
        key = name.hf.format(i=layer, j=expert)
        module = key.removesuffix(".weight")
        if module == key or not is_stored_quantized(scheme, module, keys):
            return None
        if field not in _AXES:
            raise ValueError(f"{scheme.method} checkpoint stores {key!r} quantized; {field} is only loaded "
                             "unquantized")
        try:
            return to_layout(_rows(scheme, module, read, keys), name, cfg, _AXES[field], scheme.fmt)
        except ValueError as e:
            raise ValueError(f"{scheme.method} checkpoint, module {module!r}: {e}") from None

    return fetch
