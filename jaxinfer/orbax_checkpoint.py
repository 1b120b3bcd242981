"""jaxinfer's own checkpoint format: weights saved with orbax-checkpoint, our config as JSON, the tokenizer.

A converted model is a folder:

    DIR/jaxinfer_checkpoint.json   format_version, the ModelConfig fields, dtype, source, and for a quantized
                                   checkpoint its quantization (below) (written last: the folder is complete once it
                                   exists)
    DIR/weights/                   an orbax-checkpoint PyTree checkpoint of a plain nested dict of arrays, keyed by
                                   the field names of `models.llama.Weights` / `LayerWeights` (None fields omitted):
                                   {"embed": [V, D], "final_norm": [D], "lm_head": [D, V] (untied only),
                                    "layers": {"attn_norm": [L, D], "wq": [L, D, N, H], ...}}
    DIR/tokenizer/                 an HF tokenizer folder (`Tokenizer.save_pretrained`)

Quantized checkpoints (`convert(..., quantization=...)`, `models.quant`): each quantized weight is a dict of its two
arrays in their own dtypes, {"values": int8 or float8_e4m3fn [*kept, *contracted], "scale": float32 [*kept, G]}
(orbax / tensorstore store float8_e4m3fn natively and round-trip every bit pattern, so no uint8 view is needed);
"dtype" in the JSON is then the dtype of the weights left unquantized (norms, biases, routers). The JSON's
"quantization" object records what `load` needs to rebuild the `QuantizedWeight`s without re-deriving anything:

    "quantization": {"config": {"format": "int8", "group_size": 0, "quantize_activations": true,
                                "quantize_embedding": true, "quantize_lm_head": true},   (resolved: no null)
                     "separate_lm_head": false,   (a tied model whose head is its own [D, V] weight)
                     "weights": {"embed": {"contract_axes": [-1], "group_size": 0, "quantize_activations": true},
                                 "layers.wq": {"contract_axes": [-3], "group_size": 0, "quantize_activations": true},
                                 ...}}   (every quantized weight by its dotted path, with its static fields)

The on-disk tree is a dict, not the flax dataclass, so the format does not depend on pytree registration. Arrays
are saved unsharded from host numpy by `convert` (orbax also accepts sharded `jax.Array`s, see `save`), and `load`
restores each one straight into the caller's target sharding: orbax reads only the slices every device holds, so
no full host copy is made, whatever mesh the checkpoint was written from.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import logging
import os
import shutil
import sys
import time
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.tokenizer import Tokenizer
from models import quant
from models.config import ModelConfig
from models.llama import Weights, WeightSpec, check_weights
from models.quant import QuantizationConfig, QuantizedWeight

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
CHECKPOINT_JSON = "jaxinfer_checkpoint.json"
WEIGHTS_DIR = "weights"
TOKENIZER_DIR = "tokenizer"
DTYPES: dict[str, Any] = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(jnp.bfloat16)}
_RESTORE_GROUP_BYTES = 256 << 20  # arrays are restored in groups of about this size, one progress step each


# --- config <-> JSON --------------------------------------------------------------------------------------------


def _to_json(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    return value


def _from_json(hint: Any, value: Any, where: str) -> Any:
    """Rebuilds a value of type `hint` (dataclass, enum, tuple, union, scalar) from its JSON form."""
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        for option in options:  # the member that fits the JSON shape of the value
            if isinstance(value, dict) and dataclasses.is_dataclass(option):
                return _from_json(option, value, where)
            if isinstance(option, type) and issubclass(option, enum.Enum):
                return _from_json(option, value, where)
        return _from_json(options[0], value, where) if len(options) == 1 else value
    if origin is tuple:
        args = typing.get_args(hint)
        item = args[0] if args else Any
        return tuple(_from_json(item, v, where) for v in value)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object for {hint.__name__}, got {value!r}")
        return dataclass_from_dict(hint, value, where)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            raise ValueError(f"{where}: {value!r} is not a {hint.__name__} "
                             f"({', '.join(repr(m.value) for m in hint)})") from None
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    """Every `ModelConfig` field as JSON-ready values (enums by value, nested dataclasses as dicts, tuples as lists).

    Generic over `dataclasses.fields`, so fields added to `ModelConfig` are saved without changes here.
    """
    return _to_json(cfg)


def dataclass_from_dict(cls: type, data: Mapping[str, Any], where: str = "config") -> Any:
    """Inverse of `config_to_dict` for `cls` (e.g. `ModelConfig`), typed by the class's annotations.

    Fields missing from `data` take their defaults (a checkpoint written before a field existed).

    Raises:
      ValueError: a key that is not a field of `cls`, a required field that is missing, or a value that the
        class refuses; the message starts with `where`.
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(f"{where}: unknown {cls.__name__} field(s) {', '.join(unknown)}")
    kwargs = {k: _from_json(hints[k], v, f"{where}.{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"{where}: {e}") from None


def config_from_dict(data: Mapping[str, Any], where: str = "config") -> ModelConfig:
    """`ModelConfig` from `config_to_dict`'s output; see `dataclass_from_dict`."""
    return dataclass_from_dict(ModelConfig, data, where)


# --- weights <-> nested dict --------------------------------------------------------------------------------------


def _is_spec(x: Any) -> bool:
    return isinstance(x, WeightSpec)


def _paths(cfg: ModelConfig, separate_head: bool = False) -> list[tuple[tuple[str, ...], WeightSpec]]:
    """(field path such as ("layers", "wq"), spec) of every weight the config has, in pytree order."""
    flat = jax.tree_util.tree_flatten_with_path(Weights.abstract(cfg, separate_head), is_leaf=_is_spec)[0]
    return [(tuple(k.name for k in path), spec) for path, spec in flat]


def weights_to_dict(weights: Weights) -> dict[str, Any]:
    """The weights as a nested dict of arrays keyed by field names; None fields are left out; a `QuantizedWeight`
    becomes {"values": ..., "scale": ...} (its static fields go to the JSON, see the module docstring)."""
    def one(x: Any) -> Any:
        if isinstance(x, QuantizedWeight):
            return {"values": x.values, "scale": x.scale}
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return {f.name: one(getattr(x, f.name)) for f in dataclasses.fields(x) if getattr(x, f.name) is not None}
        return x

    return one(weights)


def _get(tree: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(tree, Mapping) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _flat_keys(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out += _flat_keys(value, (*prefix, key))
        else:
            out.append((*prefix, key))
    return out


def weights_from_dict(tree: Mapping[str, Any], cfg: ModelConfig, separate_head: bool = False) -> Weights:
    """`Weights` shaped by `Weights.abstract(cfg, separate_head)`, its leaves taken from the nested dict by field
    path (absent paths become None, which `check_weights` then reports)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: _get(tree, tuple(k.name for k in path)), Weights.abstract(cfg, separate_head),
        is_leaf=_is_spec)


# --- quantized checkpoints --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """The quantization a checkpoint records (module docstring: the JSON).

    Attributes:
      config: the `QuantizationConfig` the weights were quantized with, resolved (`quantize_activations` a bool).
      separate_head: a tied model (`tie_word_embeddings`) whose head is stored as its own [D, V] `lm_head`.
      weights: the static fields of every quantized weight by field path, as `QuantizedWeight`s whose `values`
        and `scale` are None.
    """

    config: QuantizationConfig
    separate_head: bool
    weights: dict[tuple[str, ...], QuantizedWeight]

    def to_json(self) -> dict[str, Any]:
        return {"config": _to_json(self.config), "separate_lm_head": self.separate_head,
                "weights": {".".join(path): {"contract_axes": list(q.contract_axes), "group_size": q.group_size,
                                             "quantize_activations": q.quantize_activations,
                                             "activation_group_size": q.activation_group_size}
                            for path, q in self.weights.items()}}

    @staticmethod
    def from_json(data: Any, cfg: ModelConfig, where: str) -> CheckpointQuantization:
        """Parses and checks the JSON's "quantization" object against the config.

        Raises:
          ValueError: starting with `where`: not an object, a bad config, an unknown weight path, or static fields
            that do not fit the weight (contract axes out of range, a group size that does not divide the last
            contracted axis or with int8, activation quantization with groups).
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
        specs = dict(_paths(cfg, separate))
        if not isinstance(data["weights"], Mapping) or not data["weights"]:
            raise ValueError(f"{where}.weights: expected a non-empty object")
        weights = {}
        for name, statics in data["weights"].items():
            path = tuple(name.split("."))
            if path not in specs:
                raise ValueError(f"{where}.weights: {name!r} is not a weight of this model")
            required = {"contract_axes", "group_size", "quantize_activations"}
            if not isinstance(statics, Mapping) or not required <= set(statics) <= required | {"activation_group_size"}:
                raise ValueError(f"{where}.weights.{name}: expected contract_axes, group_size, quantize_activations "
                                 f"(and optionally activation_group_size)")
            shape = specs[path].shape
            axes, group, act = statics["contract_axes"], statics["group_size"], statics["quantize_activations"]
            act_group = statics.get("activation_group_size", 0)
            if not isinstance(act_group, int) or isinstance(act_group, bool) or act_group < 0:
                raise ValueError(f"{where}.weights.{name}: activation_group_size {act_group!r} must be an integer >= 0")
            ok = (isinstance(axes, list) and axes and all(isinstance(a, int) and -len(shape) <= a < 0 for a in axes)
                  and axes == sorted(set(axes)) and isinstance(group, int) and not isinstance(group, bool)
                  and group >= 0 and isinstance(act, bool) and not (group and (act or qcfg.format != "fp8"
                                                                                or shape[axes[-1]] % group)))
            if not ok:
                raise ValueError(f"{where}.weights.{name}: {dict(statics)!r} does not fit a {qcfg.format} weight of "
                                 f"shape {shape}")
            weights[path] = QuantizedWeight(values=None, scale=None, contract_axes=tuple(axes), group_size=group,
                                            quantize_activations=act, activation_group_size=act_group if act else 0)
        return CheckpointQuantization(config=qcfg, separate_head=separate, weights=weights)


def _abstract_quantized(spec: WeightSpec, statics: QuantizedWeight, fmt: str) -> QuantizedWeight:
    """A `QuantizedWeight` of `jax.ShapeDtypeStruct`s: the arrays that quantize a weight of `spec.shape`."""
    nd = len(spec.shape)
    order = quant._order(nd, statics.contract_axes)
    num_kept = nd - len(statics.contract_axes)
    contracted = int(np.prod([spec.shape[a] for a in order[num_kept:]]))
    groups = contracted // statics.group_size if statics.group_size else 1
    return statics.replace(
        values=jax.ShapeDtypeStruct(tuple(spec.shape[a] for a in order), np.dtype(quant._DTYPES[fmt])),
        scale=jax.ShapeDtypeStruct((*(spec.shape[a] for a in order[:num_kept]), groups), np.dtype(np.float32)))


def _quantized_leaves(weights: Weights) -> dict[tuple[str, ...], QuantizedWeight]:
    flat = jax.tree_util.tree_flatten_with_path(weights, is_leaf=lambda x: isinstance(x, QuantizedWeight))[0]
    return {tuple(k.name for k in path): q for path, q in flat if isinstance(q, QuantizedWeight)}


def checkpoint_quantization(path: str | os.PathLike) -> QuantizationConfig | None:
    """The `QuantizationConfig` a checkpoint's weights are stored quantized with (resolved), or None.

    Raises:
      ValueError: from `read_checkpoint_json`, or a malformed "quantization" object (naming the folder).
    """
    root = Path(path).resolve()
    cfg, _, meta = read_checkpoint_json(root)
    q = _checkpoint_quantization(meta, cfg, root)
    return None if q is None else q.config


def _checkpoint_quantization(meta: Mapping[str, Any], cfg: ModelConfig, root: Path) -> CheckpointQuantization | None:
    if meta.get("quantization") is None:
        return None
    return CheckpointQuantization.from_json(meta["quantization"], cfg,
                                            f"checkpoint {str(root)!r}: {CHECKPOINT_JSON} quantization")


def weight_specs(path: str | os.PathLike) -> Weights:
    """`Weights.abstract` of the weights a checkpoint holds (with the separate head a quantized tied model may
    store): the tree to build `load`'s `shardings` from."""
    root = Path(path).resolve()
    cfg, _, meta = read_checkpoint_json(root)
    q = _checkpoint_quantization(meta, cfg, root)
    return Weights.abstract(cfg, q is not None and q.separate_head)


# --- convert / save ---------------------------------------------------------------------------------------------


def _dtype(dtype: Any) -> np.dtype:
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


def _check_output_dir(output_dir: Path) -> None:
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())):
        raise ValueError(f"output {str(output_dir)!r} exists and is not an empty folder; choose a new one")


def save(output_dir: str | os.PathLike, cfg: ModelConfig, weights: Weights, tokenizer: Tokenizer, *,
         source: str = "", quantization: QuantizationConfig | Mapping[str, Any] | str | None = None) -> Path:
    """Writes a checkpoint folder (layout in the module docstring) from weights in memory.

    Args:
      output_dir: a folder that does not exist yet or is empty.
      cfg: the model config; it must match the weights' shapes (a quantized weight by its own-layout shape).
      weights: host numpy arrays, or `jax.Array`s (sharded ones are written shard by shard), unpadded. All arrays
        that are not quantized share one dtype, float32 or bfloat16, which the JSON records. Quantized weights
        (`models.quant.QuantizedWeight`, from `models.quant.quantize_weights`) are stored in their own dtypes.
      tokenizer: saved with `Tokenizer.save_pretrained`.
      source: recorded as where the checkpoint came from.
      quantization: for quantized `weights`, the `QuantizationConfig` (or its name / dict / JSON) that made them;
        recorded resolved. None for plain weights.

    Returns:
      `output_dir` as an absolute `Path`.

    Raises:
      ValueError: `output_dir` exists and is not an empty folder, shapes disagree with `cfg` (from
        `check_weights`), the plain arrays are not all float32 or all bfloat16, quantized weights without
        `quantization` (or `quantization` without quantized weights), or a quantized weight whose format or scale
        dtype disagrees with it.
    """
    out = Path(output_dir).resolve()
    _check_output_dir(out)
    qcfg = QuantizationConfig.from_value(quantization)
    quantized = _quantized_leaves(weights)
    if quantized and qcfg is None:
        raise ValueError(f"weights hold quantized weights ({', '.join('.'.join(p) for p in quantized)}); pass the "
                         f"quantization config that made them")
    if qcfg is not None and not quantized:
        raise ValueError(f"quantization={qcfg.format!r} given, but no weight is quantized")
    for path, q in quantized.items():
        if q.format != qcfg.format or np.dtype(q.scale.dtype) != np.float32:
            raise ValueError(f"weight {'.'.join(path)}: {q.format} values with {q.scale.dtype} scales do not fit "
                             f"quantization format {qcfg.format!r} (float32 scales)")
    separate_head = bool(quantized) and cfg.tie_word_embeddings and weights.lm_head is not None
    check_weights(weights, cfg, separate_head)
    tree = weights_to_dict(weights)
    plain = [x for x in jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, QuantizedWeight))
             if not isinstance(x, QuantizedWeight)]
    dtypes = {np.dtype(x.dtype) for x in plain}
    if len(dtypes) != 1:
        raise ValueError(f"weights mix dtypes {sorted(map(str, dtypes))}; convert them to one dtype first")
    dtype = _dtype(dtypes.pop())
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        _save_arrays(out / WEIGHTS_DIR, tree)
        tokenizer.save_pretrained(out / TOKENIZER_DIR)
        meta = {"format_version": FORMAT_VERSION, "config": config_to_dict(cfg), "dtype": dtype.name,
                "source": source}
        if quantized:
            meta["quantization"] = CheckpointQuantization(
                config=qcfg.resolved(), separate_head=separate_head,
                weights={p: q.replace(values=None, scale=None) for p, q in quantized.items()}).to_json()
        tmp = out / (CHECKPOINT_JSON + ".tmp")
        tmp.write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        tmp.rename(out / CHECKPOINT_JSON)  # last: a folder without it is not a checkpoint
    except BaseException:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        else:  # it was empty: leave it empty
            for child in out.iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        raise
    return out


def _save_arrays(path: Path, tree: dict[str, Any]) -> None:
    import orbax.checkpoint as ocp

    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    logger.info("saving %d arrays (%.1f MiB) with orbax to %s", len(jax.tree.leaves(tree)), nbytes / 2**20, path)
    t0 = time.perf_counter()
    with ocp.StandardCheckpointer() as checkpointer:  # leaving the block waits for the asynchronous write
        checkpointer.save(path, tree)
    logger.info("saved in %.1f s", time.perf_counter() - t0)


def convert(src: str | os.PathLike | None, output_dir: str | os.PathLike, dtype: str = "float32",
            quantization: QuantizationConfig | Mapping[str, Any] | str | None = None) -> Path:
    """Converts a GGUF file or HF folder (or another jaxinfer checkpoint) into a jaxinfer orbax checkpoint.

    Args:
      src: a `.gguf` file, an HF folder, an unquantized checkpoint folder, or None for the default SmolLM2 GGUF.
      output_dir: a folder that does not exist yet or is empty.
      dtype: "float32" or "bfloat16": the dtype the weights are stored in (with `quantization`: the weights left
        unquantized, which is also the activation dtype `models.quant.quantize_weights` casts them to).
      quantization: None, a format name ("int8", "fp8"), or a `models.quant.QuantizationConfig` / dict / JSON
        object of its fields: the weights are read in float32 and quantized as `EngineConfig.quantization` would
        quantize them at load (the same computation, so the same values and scales), then stored quantized.

    Returns:
      The checkpoint folder as an absolute `Path`.

    Raises:
      ValueError: a bad dtype or quantization, an output folder that exists and is not empty, a source that is
        already quantized, or any `load_model` error (missing source, not a model, a tensor that does not fit the
        config).
    """
    from jaxinfer.checkpoint import default_model_path
    from jaxinfer.model_loader import load_model

    dt = _dtype(dtype)
    qcfg = QuantizationConfig.from_value(quantization)
    out = Path(output_dir).resolve()
    _check_output_dir(out)  # before the slow load
    source = default_model_path() if src is None else Path(src)
    if is_orbax_checkpoint(source) and checkpoint_quantization(source) is not None:
        raise ValueError(f"{str(source)!r} is a quantized checkpoint already; convert from the original model")
    logger.info("loading %s as %s", source, dt.name if qcfg is None else "float32, to quantize")
    t0 = time.perf_counter()
    cfg, weights, tokenizer = load_model(source, dt if qcfg is None else np.dtype(np.float32))
    logger.info("loaded %s in %.1f s", cfg.name or source, time.perf_counter() - t0)
    if qcfg is not None:
        t0 = time.perf_counter()
        weights = jax.device_get(jax.jit(functools.partial(quant.quantize_weights, cfg=cfg, qcfg=qcfg,
                                                           dtype=dt))(weights))
        share = quant.weight_bytes(weights)["quantized_share"]
        logger.info("quantized to %s (%.0f%% of parameters) in %.1f s: %s", qcfg.format, 100 * share,
                    time.perf_counter() - t0, qcfg.resolved())
    return save(out, cfg, weights, tokenizer, source=str(source.resolve()) if source.exists() else str(source),
                quantization=qcfg)


# --- load -----------------------------------------------------------------------------------------------------------


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
        dtype = _dtype(meta.get("dtype"))
    except ValueError as e:
        raise ValueError(f"checkpoint {str(root)!r}: {e}" if str(root) not in str(e) else str(e)) from None
    return cfg, dtype, meta


def _describe(e: BaseException) -> str:
    """The root cause of an orbax / tensorstore error in one short line (wrappers such as "Encountered error while
    reading array index ..." are skipped for the exception they were raised from)."""
    chain, seen = [e], {id(e)}
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and id(nxt) not in seen:
        chain.append(nxt)
        seen.add(id(nxt))
    messages = [(x, str(x).strip()) for x in chain if str(x).strip()]
    x, text = messages[-1] if messages else (e, type(e).__name__)
    text = text.splitlines()[0].split(" See full TensorStore details")[0]
    return f"{type(x).__name__}: {text[:300]}"


def _stored_arrays(weights_dir: Path, root: Path) -> dict[str, Any]:
    """The orbax metadata tree (nested dict of objects with .shape and .dtype) of the saved arrays."""
    import orbax.checkpoint as ocp

    if not weights_dir.is_dir():
        raise ValueError(f"checkpoint {str(root)!r}: the weights folder {WEIGHTS_DIR}/ is missing")
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            meta = checkpointer.metadata(weights_dir)
        tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta.tree
    except Exception as e:  # orbax raises many types (FileNotFoundError, ValueError, tensorstore errors)
        raise ValueError(f"checkpoint {str(root)!r}: cannot read the orbax metadata of {WEIGHTS_DIR}/ "
                         f"({_describe(e)})") from None
    if not isinstance(tree, Mapping):
        raise ValueError(f"checkpoint {str(root)!r}: {WEIGHTS_DIR}/ does not hold a dict of arrays")
    return tree


def _groups(items: list[tuple[tuple[str, ...], Any]], limit: int) -> list[list[tuple[tuple[str, ...], Any]]]:
    """Consecutive runs of (path, target) whose bytes add up to about `limit` each."""
    groups: list[list] = [[]]
    size = 0
    for path, target in items:
        nbytes = int(np.prod(target.shape)) * target.dtype.itemsize
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append((path, target))
        size += nbytes
    return groups


def _nest(items: list[tuple[tuple[str, ...], Any]]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in items:
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def load(path: str | os.PathLike, dtype: Any, shardings: Weights | None = None,
         ) -> tuple[ModelConfig, Weights, Tokenizer]:
    """Restores a checkpoint written by `convert` / `save`.

    Args:
      path: the checkpoint folder.
      dtype: float32 or bfloat16 (name or dtype) of the returned weights (of a quantized checkpoint: of the
        weights left unquantized; quantized values and scales keep their stored dtypes); orbax casts while
        reading when the stored dtype differs.
      shardings: None for host numpy arrays, or a pytree shaped like `weight_specs(path)` (`Weights.abstract`) of
        `jax.sharding.NamedSharding`, each for a weight in its own layout: each array is then read directly into
        its sharding (only the slices each device holds), on any mesh, e.g.
        `sharding.partition.replicated_where_indivisible(weight_specs(path), mesh)`. A quantized weight's values
        and scale take the sharding derived from its weight's (`models.quant.quantized_sharding`).

    Returns:
      (config, weights with the config's shapes in `dtype`, tokenizer). Arrays are numpy without `shardings`,
      `jax.Array`s with them. A quantized checkpoint gives `models.quant.QuantizedWeight` leaves with the static
      fields it recorded (and, for a tied model quantized with only one of gather and head, an `lm_head`); see
      `checkpoint_quantization` for its config.

    Raises:
      ValueError: naming the folder and the problem: missing or malformed JSON (its quantization included), an
        unknown `format_version`, a missing weights folder, arrays missing, extra or of shapes (or quantized
        dtypes) that disagree with the config, unreadable or truncated array data, `shardings` not shaped like the
        weights, or a missing tokenizer.
    """
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    root = Path(path).resolve()
    dt = _dtype(dtype)
    cfg, stored_dtype, meta = read_checkpoint_json(root)
    qinfo = _checkpoint_quantization(meta, cfg, root)
    separate_head = qinfo is not None and qinfo.separate_head
    quantized = {} if qinfo is None else qinfo.weights
    weights_dir = root / WEIGHTS_DIR
    stored = _stored_arrays(weights_dir, root)
    expected = _paths(cfg, separate_head)
    # Every array on disk: (path, ShapeDtypeStruct without sharding); a quantized weight's two arrays keep their dtypes
    arrays: list[tuple[tuple[str, ...], jax.ShapeDtypeStruct]] = []
    for p, spec in expected:
        if p in quantized:
            q = _abstract_quantized(spec, quantized[p], qinfo.config.format)
            arrays += [((*p, "values"), q.values), ((*p, "scale"), q.scale)]
        else:
            arrays.append((p, jax.ShapeDtypeStruct(spec.shape, dt)))
    extra = sorted(set(_flat_keys(stored)) - {p for p, _ in arrays})
    if extra:
        raise ValueError(f"checkpoint {str(root)!r}: {WEIGHTS_DIR}/ holds arrays the config has no place for: "
                         f"{', '.join('.'.join(p) for p in extra)}")
    if qinfo is None:
        try:
            check_weights(weights_from_dict(stored, cfg), cfg)
        except ValueError as e:
            raise ValueError(f"checkpoint {str(root)!r} disagrees with its config: {e}") from None
    else:
        for p, want in arrays:
            got = _get(stored, p)
            name = "." + ".".join(p)
            if got is None or isinstance(got, Mapping):
                raise ValueError(f"checkpoint {str(root)!r} disagrees with its config: weight {name}: expected "
                                 f"{want.shape}, got none")
            if tuple(got.shape) != want.shape:
                raise ValueError(f"checkpoint {str(root)!r} disagrees with its config: weight {name}: shape "
                                 f"{tuple(got.shape)} does not match config shape {want.shape}")
            if p[-1] in ("values", "scale") and p[:-1] in quantized and np.dtype(got.dtype) != want.dtype:
                raise ValueError(f"checkpoint {str(root)!r} disagrees with its quantization: weight {name} is stored "
                                 f"as {np.dtype(got.dtype).name}, expected {want.dtype.name}")

    if shardings is None:
        sharding_of = {p: None for p, _ in expected}
    else:
        flat = jax.tree_util.tree_flatten_with_path(shardings, is_leaf=lambda x: x is None)[0]
        sharding_of = {tuple(k.name for k in p): s for p, s in flat}
        missing = [p for p, _ in expected if sharding_of.get(p) is None]
        if missing:
            raise ValueError(f"shardings has no sharding for {', '.join('.'.join(p) for p in missing)}")
        for p, spec in expected:
            if p in quantized:
                q = quant.quantized_sharding(sharding_of[p],
                                             _abstract_quantized(spec, quantized[p], qinfo.config.format))
                sharding_of[(*p, "values")], sharding_of[(*p, "scale")] = q.values, q.scale
    targets = [(p, jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding_of.get(p))) for p, a in arrays]

    try:  # before the (long) restore: a missing tokenizer fails at once
        tokenizer = Tokenizer.from_hf_dir(root / TOKENIZER_DIR)
    except (OSError, ValueError) as e:
        raise ValueError(f"checkpoint {str(root)!r}: the tokenizer in {TOKENIZER_DIR}/ cannot be loaded: {e}") from None

    t0 = time.perf_counter()
    nbytes = lambda t: int(np.prod(t.shape)) * t.dtype.itemsize  # noqa: E731
    total = sum(nbytes(t) for _, t in targets)
    where = "host" if shardings is None else f"{len(jax.tree.leaves(shardings)[0].device_set)} devices"
    what = "" if qinfo is None else f", {len(quantized)} weights quantized {qinfo.config.format}"
    logger.info("restoring %d arrays (%.1f MiB, %s stored, %s wanted%s) from %s onto %s", len(targets),
                total / 2**20, stored_dtype.name, dt.name, what, weights_dir, where)
    restored: list[tuple[tuple[str, ...], Any]] = []
    with ocp.PyTreeCheckpointer() as checkpointer, tqdm(total=total, unit="B", unit_scale=True, file=sys.stderr,
                                                        desc="restoring weights", leave=False) as bar:
        for group in _groups(targets, _RESTORE_GROUP_BYTES):
            item = _nest(group)
            try:
                out = checkpointer.restore(weights_dir, args=ocp.args.PyTreeRestore(
                    item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                    partial_restore=True))
            except Exception as e:  # orbax / tensorstore errors of many types: one clear line instead
                names = ", ".join(".".join(p) for p, _ in group)
                raise ValueError(f"checkpoint {str(root)!r}: cannot read {names} from {WEIGHTS_DIR}/ (corrupt or "
                                 f"truncated array data?): {_describe(e)}") from None
            restored += [(p, _get(out, p)) for p, _ in group]
            bar.update(sum(nbytes(t) for _, t in group))
    tree = _nest(restored)
    for p, statics in quantized.items():  # {"values", "scale"} back into QuantizedWeights
        parent = _get(tree, p[:-1]) if len(p) > 1 else tree
        parent[p[-1]] = statics.replace(**parent[p[-1]])
    weights = weights_from_dict(tree, cfg, separate_head)
    try:
        check_weights(weights, cfg, separate_head)
    except ValueError as e:
        raise ValueError(f"checkpoint {str(root)!r}: restored weights disagree with the config: {e}") from None
    logger.info("restored %.1f MiB in %.2f s", total / 2**20, time.perf_counter() - t0)
    return cfg, weights, tokenizer
