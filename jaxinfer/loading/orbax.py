"""Saves and restores jaxinfer orbax checkpoints (layout and JSON: `jaxinfer.loading.orbax_format`).

Arrays are saved unsharded from host numpy by `jaxinfer.loading.convert` (orbax also accepts sharded `jax.Array`s,
see `save`), and `load` restores each one straight into the caller's target sharding: a process reads only the
slices its devices hold, so no full host copy is made, whatever mesh the checkpoint was written from. Stacked layer
arrays are written one storage chunk per layer (`orbax_format` module docstring), so a restore that places some
layers reads only those layers' bytes; within a chunk, tensorstore reads the whole chunk (a device holding part of a
layer, split over tp, reads that layer). Errors are `ValueError`s naming the folder and the problem (see `save` and
`load`).

Pipeline stages (`load(..., stages=...)`, `models.pipeline`): the engine runs the stacked layers padded to [pp * S,
...] in the stage layout, which for uneven splits is not the checkpoint's [L, ...]. Each stacked layer array is
restored end-padded to [pp * S, ...] (orbax's `global_shape` with `strict=False`, zeros past L) with its axis 0 split
over the stage axis: stage s's devices read the checkpoint's layers [s * S, (s + 1) * S) (the block layout,
`StageLayout.blocks`), and nothing else. For even splits and for pp = 2 that is already the stage layout; otherwise
`models.pipeline.stages_from_blocks` moves the few misplaced layers to their stage on device (a `ppermute` per
shift between the layouts: no device gathers the stack).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxinfer.loading.codec import config_to_dict
from jaxinfer.loading.orbax_format import (CHECKPOINT_JSON, FORMAT_VERSION, QUANTIZED_ARRAYS, TOKENIZER_DIR,
                                           WEIGHTS_DIR, CheckpointQuantization, checked_dtype, flat_keys,
                                           get_path, nest, quantization_record, quantized_leaves,
                                           read_checkpoint_json, weight_paths, weights_from_dict, weights_to_dict)
from jaxinfer.tokenizer import Tokenizer
from models.config import ModelConfig
from models.llama import Weights, check_weights
from models.pipeline import StageLayout, staged_config, stages_from_blocks
from models.quant import QuantizationConfig, QuantizedWeight, dtypes_of
from models.quant_sharding import quantized_sharding
from sharding.rules import LAYERS

logger = logging.getLogger(__name__)

_RESTORE_GROUP_BYTES = 256 << 20  # arrays are restored in groups of about this size, one progress step each


# --- save -----------------------------------------------------------------------------------------------------------


def check_output_dir(output_dir: Path) -> None:
    """Raises `ValueError` unless `output_dir` does not exist yet or is an empty folder."""
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
    check_output_dir(out)
    qcfg = QuantizationConfig.from_value(quantization)
    quantized = quantized_leaves(weights)
    if quantized and qcfg is None:
        raise ValueError(f"weights hold quantized weights ({', '.join('.'.join(p) for p in quantized)}); pass the "
                         f"quantization config that made them")
    if qcfg is not None and not quantized:
        raise ValueError(f"quantization={qcfg.format!r} given, but no weight is quantized")
    for path, q in quantized.items():
        try:
            fmt = q.format
        except ValueError:  # no format's pair of dtypes
            fmt = None
        if fmt != qcfg.format_of(path):
            want = ", ".join(f"{np.dtype(d).name} {k}" for d, k in zip(dtypes_of(qcfg.format_of(path)),
                                                                        ("values", "scales")))
            raise ValueError(f"weight {'.'.join(path)}: {np.dtype(q.values.dtype).name} values with "
                             f"{np.dtype(q.scale.dtype).name} scales do not fit quantization format "
                             f"{qcfg.format_of(path)!r} ({want})")
    separate_head = bool(quantized) and cfg.tie_word_embeddings and weights.lm_head is not None
    check_weights(weights, cfg, separate_head)
    tree = weights_to_dict(weights)
    plain = [x for x in jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, QuantizedWeight))
             if not isinstance(x, QuantizedWeight)]
    dtypes = {np.dtype(x.dtype) for x in plain}
    if len(dtypes) != 1:
        raise ValueError(f"weights mix dtypes {sorted(map(str, dtypes))}; convert them to one dtype first")
    dtype = checked_dtype(dtypes.pop())
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
                weights={p: jax.eval_shape(lambda q=q: q) for p, q in quantized.items()}).to_json()
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
    # one storage chunk per layer of a stacked array: a pipeline stage's restore reads only its layers
    save_args = jax.tree_util.tree_map_with_path(
        lambda p, _: ocp.SaveArgs(shard_axes=(0,) if p[0].key == "layers" else ()), tree)
    with ocp.StandardCheckpointer() as checkpointer:  # leaving the block waits for the asynchronous write
        checkpointer.save(path, tree, save_args=save_args)
    logger.info("saved in %.1f s", time.perf_counter() - t0)


# --- load -----------------------------------------------------------------------------------------------------------


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


def load(path: str | os.PathLike, dtype: Any, shardings: Weights | None = None, stages: StageLayout | None = None,
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
        `sharding.placement.replicated_where_indivisible(weight_specs(path), mesh)`. A quantized weight's values
        and scale take the sharding derived from its weight's (`models.quant_sharding.quantized_sharding`).
      stages: with `shardings`, the stage layout of a mesh with pipeline stages (`models.pipeline.check_pipeline`
        over the checkpoint's layers): `shardings` are then shaped like `weight_specs(path, stages)` (the padded
        stack, its layer axis split over the stage axis) and the stacked layer arrays come back in the stage
        layout, each stage's devices having read only a block of S layers (module docstring).

    Returns:
      (config, weights with the config's shapes in `dtype` (with `stages`: those of `staged_config(config,
      stages)`), tokenizer). Arrays are numpy without `shardings`,
      `jax.Array`s with them. A quantized checkpoint gives `models.quant.QuantizedWeight` leaves with the static
      fields it recorded (and, for a tied model quantized with only one of gather and head, an `lm_head`); see
      `checkpoint_quantization` for its config.

    Raises:
      ValueError: naming the folder and the problem: missing or malformed JSON (its quantization included), an
        unknown `format_version`, a missing weights folder, arrays missing, extra or of shapes (or quantized
        dtypes) that disagree with the config, unreadable or truncated array data, `shardings` not shaped like the
        weights, or a missing tokenizer; `stages` without `shardings` or over another number of layers.
    """
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    root = Path(path).resolve()
    dt = checked_dtype(dtype)
    cfg, stored_dtype, meta = read_checkpoint_json(root)
    qinfo = quantization_record(meta, cfg, root)
    separate_head = qinfo is not None and qinfo.separate_head
    quantized = {} if qinfo is None else qinfo.weights
    if stages is not None and (shardings is None or stages.num_layers != cfg.num_layers):
        raise ValueError(f"checkpoint {str(root)!r}: stages over {stages.num_layers} layers need shardings and a "
                         f"model of as many layers; it has {cfg.num_layers}")
    weights_dir = root / WEIGHTS_DIR
    stored = _stored_arrays(weights_dir, root)
    expected = weight_paths(cfg, separate_head)
    # Every array on disk: (path, ShapeDtypeStruct without sharding); a quantized weight's arrays keep their dtypes
    arrays: list[tuple[tuple[str, ...], jax.ShapeDtypeStruct]] = []
    for p, spec in expected:
        if p in quantized:
            arrays += [((*p, k), getattr(quantized[p], k)) for k in QUANTIZED_ARRAYS
                       if getattr(quantized[p], k) is not None]
        else:
            arrays.append((p, jax.ShapeDtypeStruct(spec.shape, dt)))
    extra = sorted(set(flat_keys(stored)) - {p for p, _ in arrays})
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
            got = get_path(stored, p)
            name = "." + ".".join(p)
            if got is None or isinstance(got, Mapping):
                raise ValueError(f"checkpoint {str(root)!r} disagrees with its config: weight {name}: expected "
                                 f"{want.shape}, got none")
            if tuple(got.shape) != want.shape:
                raise ValueError(f"checkpoint {str(root)!r} disagrees with its config: weight {name}: shape "
                                 f"{tuple(got.shape)} does not match config shape {want.shape}")
            if p[-1] in QUANTIZED_ARRAYS and p[:-1] in quantized and np.dtype(got.dtype) != want.dtype:
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
        for p, _ in expected:
            if p in quantized:
                q = quantized_sharding(sharding_of[p], quantized[p])
                sharding_of.update({(*p, k): getattr(q, k) for k in QUANTIZED_ARRAYS if getattr(q, k) is not None})
    # with stages, stacked layer arrays (a quantized weight's arrays too) are restored end-padded to [pp * S, ...]
    stacked = {p for p, spec in expected if stages is not None and spec.logical_axes[0] == LAYERS}
    padded = {p for p, _ in arrays if p in stacked or p[:-1] in stacked}
    targets = [(p, jax.ShapeDtypeStruct((stages.padded_layers, *a.shape[1:]) if p in padded else a.shape, a.dtype,
                                        sharding=sharding_of.get(p))) for p, a in arrays]

    try:  # before the (long) restore: a missing tokenizer fails at once
        tokenizer = Tokenizer.from_hf_dir(root / TOKENIZER_DIR)
    except (OSError, ValueError) as e:
        raise ValueError(f"checkpoint {str(root)!r}: the tokenizer in {TOKENIZER_DIR}/ cannot be loaded: {e}") from None

    t0 = time.perf_counter()
    stored_shape = dict(arrays)
    nbytes = lambda p, t: int(np.prod(stored_shape[p].shape)) * t.dtype.itemsize  # noqa: E731  (as stored)
    total = sum(nbytes(p, t) for p, t in targets)
    where = "host" if shardings is None else f"{len(jax.tree.leaves(shardings)[0].device_set)} devices"
    if stages is not None:
        where += f", layers into {stages.num_stages} pipeline stages of {stages.layers_per_stage} slots"
    what = "" if qinfo is None else f", {len(quantized)} weights quantized {qinfo.config.format}"
    logger.info("restoring %d arrays (%.1f MiB, %s stored, %s wanted%s) from %s onto %s", len(targets),
                total / 2**20, stored_dtype.name, dt.name, what, weights_dir, where)
    restored: list[tuple[tuple[str, ...], Any]] = []
    with ocp.PyTreeCheckpointer() as checkpointer, tqdm(total=total, unit="B", unit_scale=True, file=sys.stderr,
                                                        desc="restoring weights", leave=False) as bar:
        for group in _groups(targets, _RESTORE_GROUP_BYTES):
            item = nest(group)
            restore_args = nest([(p, dataclasses.replace(ocp.checkpoint_utils.construct_restore_args(t), strict=False)
                                  if p in padded else ocp.checkpoint_utils.construct_restore_args(t)) for p, t in group])
            try:
                out = checkpointer.restore(weights_dir, args=ocp.args.PyTreeRestore(
                    item=item, restore_args=restore_args, partial_restore=True))
            except Exception as e:  # orbax / tensorstore errors of many types: one clear line instead
                names = ", ".join(".".join(p) for p, _ in group)
                raise ValueError(f"checkpoint {str(root)!r}: cannot read {names} from {WEIGHTS_DIR}/ (corrupt or "
                                 f"truncated array data?): {_describe(e)}") from None
            restored += [(p, get_path(out, p)) for p, _ in group]
            bar.update(sum(nbytes(p, t) for p, t in group))
    cfg_restored = cfg if stages is None else staged_config(cfg, stages)
    if padded:  # the block layout into the stage layout, on device
        moved = iter(stages_from_blocks([x for p, x in restored if p in padded], stages))
        restored = [(p, next(moved) if p in padded else x) for p, x in restored]
    tree = nest(restored)
    for p, statics in quantized.items():  # {"values", "scale", ...} back into QuantizedWeights
        parent = get_path(tree, p[:-1]) if len(p) > 1 else tree
        parent[p[-1]] = statics.replace(**parent[p[-1]])
    weights = weights_from_dict(tree, cfg_restored, separate_head)
    try:
        check_weights(weights, cfg_restored, separate_head)
    except ValueError as e:
        raise ValueError(f"checkpoint {str(root)!r}: restored weights disagree with the config: {e}") from None
    logger.info("restored %.1f MiB in %.2f s", total / 2**20, time.perf_counter() - t0)
    return cfg, weights, tokenizer
