"""HF model folders (`config.json` + `model.safetensors` or sharded `*.safetensors` with an index) into
`models.llama.Weights`: `config.json` (which `models.config.ModelConfig.from_hf_config` parses into our config) and
the tensors, read as float32 and cast to the requested dtype. Tensor names and layouts come from
`jaxinfer.loading.tensor_names`. A folder whose `config.json` has a `quantization_config` (FP8, GPTQ, AWQ,
compressed-tensors) keeps its quantized projections as stored (`jaxinfer.loading.prequantized`).

Errors are `ValueError`s naming the folder, the shard or the tensor.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxinfer.loading import prequantized
from jaxinfer.loading.tensor_names import TensorName, assemble
from models.config import ModelConfig
from models.llama import Weights
from models.quant import QuantizationConfig


def read_hf_config(folder: Path) -> dict:
    """Reads `config.json` of an HF model folder.

    Raises:
      ValueError: if the file is missing or not JSON.
    """
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder} is not an HF model folder: config.json is missing (nor a `jaxinfer convert` "
                         "checkpoint: no jaxinfer_checkpoint.json)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


class SafetensorsFolder:
    """The tensors of an HF folder's safetensors files (one file, or shards with `model.safetensors.index.json`),
    by name, each read when asked for in its stored dtype.

    Raises (constructor):
      ValueError: no safetensors files, or a shard named in the index that is missing.
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        from safetensors import safe_open

        self.folder = Path(folder)
        index_path = self.folder / "model.safetensors.index.json"
        if index_path.is_file():
            weight_map = json.loads(index_path.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise ValueError(f"{self.folder} has no *.safetensors files")
        self._location: dict[str, str] = {}
        self._handles = {}
        self._headers: dict[str, tuple[int, dict]] = {}  # file -> (header size, header), for F8 tensors
        for name in files:
            if not (self.folder / name).is_file():
                raise ValueError(f"{self.folder}: safetensors shard {name!r} named in the index is missing")
            self._handles[name] = safe_open(self.folder / name, framework="numpy")
            for key in self._handles[name].keys():
                self._location[key] = name
        if weight_map is not None:
            self._location.update({k: v for k, v in weight_map.items() if v in self._handles})

    def keys(self) -> set[str]:
        return set(self._location)

    def __contains__(self, key: str) -> bool:
        return key in self._location

    def get(self, key: str) -> np.ndarray:
        """The tensor in its stored dtype (F8_E4M3 as `ml_dtypes.float8_e4m3fn`, which safetensors' numpy reader
        does not produce).

        Raises:
          KeyError: no such tensor.
        """
        handle = self._handles[self._location[key]]
        if handle.get_slice(key).get_dtype() != "F8_E4M3":
            return handle.get_tensor(key)
        # safetensors layout: u64 little-endian header size, the JSON header, then the data at its offsets
        file = self._location[key]
        with open(self.folder / file, "rb") as f:
            if file not in self._headers:
                (size,) = struct.unpack("<Q", f.read(8))
                self._headers[file] = size, json.loads(f.read(size))
            size, header = self._headers[file]
            entry = header[key]
            start, end = entry["data_offsets"]
            f.seek(8 + size + start)
            data = np.frombuffer(f.read(end - start), np.uint8)
        return data.view(ml_dtypes.float8_e4m3fn).reshape(entry["shape"])


def stored_hf_quantization(folder: str | os.PathLike) -> QuantizationConfig | None:
    """The `QuantizationConfig` (resolved) an HF folder's weights are stored quantized with, from its
    `quantization_config` and tensor names (`jaxinfer.loading.prequantized.stored_quantization`), or None.

    Raises:
      ValueError: an unsupported quantization option (named), or an unreadable folder.
    """
    hf = read_hf_config(Path(folder))
    if prequantized.read_scheme(hf) is None:
        return None
    return prequantized.stored_quantization(hf, SafetensorsFolder(folder).keys())


def load_hf_weights(folder: str | os.PathLike, dtype: np.dtype = np.float32) -> tuple[ModelConfig, Weights]:
    """Reads config and weights from an HF folder with `model.safetensors` or sharded `*.safetensors` + index.

    Weights a pre-quantized folder stores quantized come back as `models.quant.QuantizedWeight`s (values and f32
    scales as stored, in our layout; see `jaxinfer.loading.prequantized`); the others are cast to `dtype`.

    Raises:
      ValueError: unknown `model_type`, no safetensors files, a missing tensor, a shape mismatch, or an unsupported
        quantization option (named).
    """
    folder = Path(folder)
    hf = read_hf_config(folder)
    cfg = ModelConfig.from_hf_config(hf, name=folder.name)
    scheme = prequantized.read_scheme(hf)
    tensors = SafetensorsFolder(folder)

    def fetch(name: TensorName, layer: int | None, expert: int | None) -> np.ndarray | None:
        key = name.hf.format(i=layer, j=expert)
        if key not in tensors:
            return None
        x = tensors.get(key)
        if x.dtype == ml_dtypes.float8_e4m3fn:  # only `prequantized` reads fp8 values, with their scales
            raise ValueError(f"{folder}: tensor {key!r} is stored as float8_e4m3fn without the scales this "
                             f"config.json's quantization_config names{' (none)' if scheme is None else ''}")
        return np.asarray(x, dtype=np.float32)

    if cfg.tie_word_embeddings is False and "lm_head.weight" not in tensors and (
            scheme is None or not prequantized.is_stored_quantized(scheme, "lm_head", tensors.keys())):
        raise ValueError(f"{folder}: config.json says tie_word_embeddings=false but tensor 'lm_head.weight' is missing")
    quantized = None if scheme is None else prequantized.quantized_fetch(cfg, scheme, tensors.get, tensors.keys())
    return cfg, assemble(cfg, fetch, "hf", dtype, quantized=quantized)
