"""jaxinfer's own checkpoint format: weights saved with orbax-checkpoint, our config as JSON, the tokenizer.

This module is the format (layout, JSON, the weights tree); `jaxinfer.loading.orbax` saves and restores it.

A converted model is a folder:

    DIR/jaxinfer_checkpoint.json   format_version, the ModelConfig fields, dtype, source, and for a quantized
                                   checkpoint its quantization (below) (written last: the folder is complete once it
                                   exists)
    DIR/weights/                   an orbax-checkpoint PyTree checkpoint of a plain nested dict of arrays, keyed by
                                   the field names of `models.llama.Weights` / `LayerWeights` (None fields omitted):
                                   {"embed": [V, D], "final_norm": [D], "lm_head": [D, V] (untied only),
                                    "layers": {"attn_norm": [L, D], "wq": [L, D, N, H], ...}}; the stacked
                                   "layers" arrays stored one chunk per layer (zarr chunk [1, ...]; checkpoints
                                   written before this hold every array as one chunk, read whole by any restore)
    DIR/tokenizer/                 an HF tokenizer folder (`Tokenizer.save_pretrained`)

Quantized checkpoints (`convert(..., quantization=...)`, `models.quant`): each quantized weight is a dict of its
arrays in their own dtypes (`models.quant.dtypes_of`), {"values": [*kept, *contracted] (int4, mxfp4, nvfp4: uint8
with the last axis packed, halved), "scale": [*kept, G], and where the weight has them "min": float32 [*kept, G]
(asymmetric int4) and "tensor_scale": float32 (nvfp4)}. orbax / tensorstore store float8_e4m3fn and
float8_e8m0fnu natively and round-trip every bit pattern, so no uint8 view is needed. "dtype" in the JSON is then
the dtype of the weights left unquantized (norms, biases, routers). The JSON's "quantization" object records what
`load` needs to rebuild the `QuantizedWeight`s without re-deriving anything:

    "quantization": {"config": {"format": "int8", "group_size": 0, "quantize_activations": true,
                                "quantize_embedding": true, "quantize_lm_head": true},   (resolved: no null)
                     "separate_lm_head": false,   (a tied model whose head is its own [D, V] weight)
                     "weights": {"embed": {"contract_axes": [-1], "group_size": 0, "quantize_activations": true},
                                 "layers.wq": {"contract_axes": [-3], "group_size": 0, "quantize_activations": true},
                                 ...}}   (every quantized weight by its dotted path, with its static fields,
                                              and "asymmetric": true for an int4 weight with mins, "stacked_axes":
                                              n for an nvfp4 weight: `models.quant.quantize`'s arguments)

The on-disk tree is a dict, not the pytree dataclass, so the format does not depend on pytree registration.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.loading.codec import config_from_dict, dataclass_to_dict
from models import quant
from models.config import ModelConfig
from models.llama import Weights, WeightSpec
from models.pipeline import StageLayout, staged_config
from models.quant import QuantizationConfig, QuantizedWeight

FORMAT_VERSION = 1
CHECKPOINT_JSON = "jaxinfer_checkpoint.json"
WEIGHTS_DIR = "weights"
TOKENIZER_DIR = "tokenizer"
DTYPES: dict[str, Any] = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(jnp.bfloat16)}
QUANTIZED_ARRAYS = ("values", "scale", "min", "tensor_scale")  # a QuantizedWeight's arrays, keys on disk


def checked_dtype(dtype: Any) -> np.dtype:
    """float32 or bfloat16 as a numpy dtype, from a name or a dtype.

    Raises:
      ValueError: any other dtype.
    """
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt not in DTYPES.values():
        raise ValueError(f"dtype={dtype!r} must be one of {', '.join(DTYPES)}")
    return dt


# --- the JSON -------------------------------------------------------------------------------------------------------


def is_orbax_checkpoint(path: str | os.PathLike) -> bool:
    """True when `path` is a folder holding `jaxinfer_checkpoint.json`."""
    return (Path(path) / CHECKPOINT_JSON).is_file()


def looks_like_partial_checkpoint(path: str | os.PathLike) -> bool:
    """True for a folder with our `weights/` or `tokenizer/` subfolders but no JSON (an interrupted conversion)."""
    p = Path(path)
    return p.is_dir() and not (p / "config.json").exists() and (
        (p / WEIGHTS_DIR).is_dir() or (p / TOKENIZER_DIR).is_dir())


def read_checkpoint_json(path: str | os.PathLike) -> tuple[ModelConfig, np.dtype, dict[str, Any]]:
    """Reads and checks `jaxinfer_checkpoint.json`: (config, stored dtype, the whole JSON object).

    Raises:
      ValueError: naming the folder: the file is missing or not JSON, `format_version` is not this build's
        (both versions named), or the config or dtype is malformed.
    """
    root = Path(path)
    file = root / CHECKPOINT_JSON
    if not root.is_dir():
        raise ValueError(f"checkpoint folder {str(root)!r} does not exist")
    if not file.is_file():
        raise ValueError(f"{str(root)!r} is not a complete jaxinfer checkpoint: {CHECKPOINT_JSON} is missing")
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"checkpoint {str(root)!r}: {CHECKPOINT_JSON} is not valid JSON: {e}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"checkpoint {str(root)!r}: {CHECKPOINT_JSON} must hold a JSON object")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(f"checkpoint {str(root)!r} has format_version {version!r}; this jaxinfer reads version "
                         f"{FORMAT_VERSION} (convert the model again with this version)")
    if not isinstance(meta.get("config"), dict):
        raise ValueError(f"checkpoint {str(root)!r}: {CHECKPOINT_JSON} has no 'config' object")
    try:
        cfg = config_from_dict(meta["config"], where=f"checkpoint {str(root)!r}: config")
        dtype = checked_dtype(meta.get("dtype"))
    except ValueError as e:
        raise ValueError(f"checkpoint {str(root)!r}: {e}" if str(root) not in str(e) else str(e)) from None
    return cfg, dtype, meta


# --- weights <-> nested dict --------------------------------------------------------------------------------------


def _is_spec(x: Any) -> bool:
    return isinstance(x, WeightSpec)


def weight_paths(cfg: ModelConfig, separate_head: bool = False) -> list[tuple[tuple[str, ...], WeightSpec]]:
    """(field path such as ("layers", "wq"), spec) of every weight the config has, in pytree order."""
    flat = jax.tree_util.tree_flatten_with_path(Weights.abstract(cfg, separate_head), is_leaf=_is_spec)[0]
    return [(tuple(k.name for k in path), spec) for path, spec in flat]


def weights_to_dict(weights: Weights) -> dict[str, Any]:
    """The weights as a nested dict of arrays keyed by field names; None fields are left out; a `QuantizedWeight`
    becomes {"values": ..., "scale": ...} and its "min" and "tensor_scale" where it has them (its static fields go
    to the JSON, see the module docstring)."""
    def one(x: Any) -> Any:
        if isinstance(x, QuantizedWeight):
            return {k: getattr(x, k) for k in QUANTIZED_ARRAYS if getattr(x, k) is not None}
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return {f.name: one(getattr(x, f.name)) for f in dataclasses.fields(x) if getattr(x, f.name) is not None}
        return x

    return one(weights)


def get_path(tree: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(tree, Mapping) or key not in tree:
            return None
        tree = tree[key]
    return tree


def flat_keys(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out += flat_keys(value, (*prefix, key))
        else:
            out.append((*prefix, key))
    return out


def weights_from_dict(tree: Mapping[str, Any], cfg: ModelConfig, separate_head: bool = False) -> Weights:
    """`Weights` shaped by `Weights.abstract(cfg, separate_head)`, its leaves taken from the nested dict by field
    path (absent paths become None, which `check_weights` then reports)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: get_path(tree, tuple(k.name for k in path)), Weights.abstract(cfg, separate_head),
        is_leaf=_is_spec)


def nest(items: list[tuple[tuple[str, ...], Any]]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in items:
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


# --- quantized checkpoints --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """The quantization a checkpoint records (module docstring: the JSON).

    Attributes:
      config: the `QuantizationConfig` the weights were quantized with, resolved (`quantize_activations` a bool).
      separate_head: a tied model (`tie_word_embeddings`) whose head is stored as its own [D, V] `lm_head`.
      weights: every quantized weight by field path, as a `QuantizedWeight` of `jax.ShapeDtypeStruct`s: its static
        fields and the shapes and dtypes of its arrays.
    """

    config: QuantizationConfig
    separate_head: bool
    weights: dict[tuple[str, ...], QuantizedWeight]

    def to_json(self) -> dict[str, Any]:
        def statics(q: QuantizedWeight) -> dict[str, Any]:
            out = {"contract_axes": list(q.contract_axes), "group_size": q.group_size,
                   "quantize_activations": q.quantize_activations, "activation_group_size": q.activation_group_size}
            if q.min is not None:
                out["asymmetric"] = True
            if q.tensor_scale is not None:
                out["stacked_axes"] = quant.stacked_axes_of(q)
            return out

        return {"config": dataclass_to_dict(self.config), "separate_lm_head": self.separate_head,
                "weights": {".".join(path): statics(q) for path, q in self.weights.items()}}

    @staticmethod
    def from_json(data: Any, cfg: ModelConfig, where: str) -> CheckpointQuantization:
        """Parses and checks the JSON's "quantization" object against the config.

        Raises:
          ValueError: starting with `where`: not an object, a bad config, an unknown weight path, or static fields
            that do not fit the weight (whatever `models.quant.quantize` refuses: contract axes out of range, a
            group size that does not divide the last contracted axis or with int8, activation quantization with
            groups, ...).
        """
        if not isinstance(data, Mapping) or set(data) != {"config", "separate_lm_head", "weights"}:
            raise ValueError(f"{where}: expected an object with keys config, separate_lm_head, weights")
        try:
            qcfg = QuantizationConfig.from_value(data["config"])
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}.config: {e}") from None
        if not isinstance(qcfg, QuantizationConfig) or qcfg.quantize_activations is None:
            raise ValueError(f"{where}.config: expected a resolved quantization config (quantize_activations true or "
                             f"false), got {data['config']!r}")
        separate = data["separate_lm_head"]
        if not isinstance(separate, bool) or (separate and not cfg.tie_word_embeddings):
            raise ValueError(f"{where}.separate_lm_head: {separate!r} (true only for tied embeddings)")
        specs = dict(weight_paths(cfg, separate))
        if not isinstance(data["weights"], Mapping) or not data["weights"]:
            raise ValueError(f"{where}.weights: expected a non-empty object")
        weights = {}
        for name, statics in data["weights"].items():
            path = tuple(name.split("."))
            if path not in specs:
                raise ValueError(f"{where}.weights: {name!r} is not a weight of this model")
            weights[path] = abstract_quantized(specs[path].shape, qcfg.format_of(path), statics,
                                               f"{where}.weights.{name}")
        return CheckpointQuantization(config=qcfg, separate_head=separate, weights=weights)


_STATICS = {"contract_axes": list, "group_size": int, "quantize_activations": bool, "activation_group_size": int,
            "asymmetric": bool, "stacked_axes": int}  # the JSON keys of a quantized weight and their types
_REQUIRED_STATICS = {"contract_axes", "group_size", "quantize_activations"}


def abstract_quantized(shape: tuple[int, ...], fmt: str, statics: Any, where: str) -> QuantizedWeight:
    """The `QuantizedWeight` of `jax.ShapeDtypeStruct`s that quantizing a weight of `shape` to `fmt` with the
    recorded static fields gives (`jax.eval_shape` of `models.quant.quantize`, so the checks are its checks).

    Raises:
      ValueError: starting with `where`, for keys missing, unknown or of the wrong type, or fields `quantize`
        refuses, or a record whose fields `quantize` would not reproduce.
    """
    ok = isinstance(statics, Mapping) and _REQUIRED_STATICS <= set(statics) <= set(_STATICS) and all(
        isinstance(v, _STATICS[k]) and (_STATICS[k] is bool or not isinstance(v, bool)) for k, v in statics.items())
    if not ok:
        raise ValueError(f"{where}: expected contract_axes, group_size, quantize_activations (and optionally "
                         f"activation_group_size, asymmetric, stacked_axes), got {statics!r}")
    axes = statics["contract_axes"]
    try:
        if not axes or axes != sorted(set(axes)) or any(not isinstance(a, int) or not -len(shape) <= a < 0
                                                        for a in axes):
            raise ValueError("contract_axes must be sorted distinct negative axes")
        q = jax.eval_shape(lambda w: quant.quantize(
            w, fmt, tuple(axes), group_size=statics["group_size"],
            quantize_activations=statics["quantize_activations"],
            activation_group_size=statics.get("activation_group_size", 0),
            asymmetric=statics.get("asymmetric", False), stacked_axes=statics.get("stacked_axes", 0)),
            jax.ShapeDtypeStruct(shape, np.float32))
        if q.group_size != statics["group_size"] or q.activation_group_size != statics.get(
                "activation_group_size", q.activation_group_size):
            raise ValueError("quantize would record other static fields")
    except ValueError as e:
        raise ValueError(f"{where}: {dict(statics)!r} does not fit a {fmt} weight of shape {shape} ({e})") from None
    return q


def quantized_leaves(weights: Weights) -> dict[tuple[str, ...], QuantizedWeight]:
    flat = jax.tree_util.tree_flatten_with_path(weights, is_leaf=lambda x: isinstance(x, QuantizedWeight))[0]
    return {tuple(k.name for k in path): q for path, q in flat if isinstance(q, QuantizedWeight)}


def checkpoint_quantization(path: str | os.PathLike) -> QuantizationConfig | None:
    """The `QuantizationConfig` a checkpoint's weights are stored quantized with (resolved), or None.

    Raises:
      ValueError: from `read_checkpoint_json`, or a malformed "quantization" object (naming the folder).
    """
    root = Path(path).resolve()
    cfg, _, meta = read_checkpoint_json(root)
    q = quantization_record(meta, cfg, root)
    return None if q is None else q.config


def quantization_record(meta: Mapping[str, Any], cfg: ModelConfig, root: Path) -> CheckpointQuantization | None:
    """The parsed "quantization" object of a checkpoint JSON, or None for a plain checkpoint (errors name `root`)."""
    if meta.get("quantization") is None:
        return None
    return CheckpointQuantization.from_json(meta["quantization"], cfg,
                                            f"checkpoint {str(root)!r}: {CHECKPOINT_JSON} quantization")


def weight_specs(path: str | os.PathLike, stages: StageLayout | None = None) -> Weights:
    """`Weights.abstract` of the weights a checkpoint holds (with the separate head a quantized tied model may
    store): the tree to build `load`'s `shardings` from. With `stages` (a `models.pipeline.StageLayout` over the
    checkpoint's layers), those of the padded stack, `staged_config`: [pp * S, ...] layer axes."""
    root = Path(path).resolve()
    cfg, _, meta = read_checkpoint_json(root)
    q = quantization_record(meta, cfg, root)
    return Weights.abstract(cfg if stages is None else staged_config(cfg, stages), q is not None and q.separate_head)

