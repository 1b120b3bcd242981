"""HF model folders (`config.json` + `model.safetensors` or sharded `*.safetensors` with an index) into
`models.llama.Weights`: `config.json` (which `models.config.ModelConfig.from_hf_config` parses into our config) and
the tensors, read as float32 and cast to the requested dtype. Tensor names and layouts come from
`jaxinfer.loading.tensor_names`.

Errors are `ValueError`s naming the folder, the shard or the tensor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from jaxinfer.loading.tensor_names import TensorName, assemble
from models.config import ModelConfig
from models.llama import Weights

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


def load_hf_weights(folder: str | os.PathLike, dtype: np.dtype = np.float32) -> tuple[ModelConfig, Weights]:
    """Reads config and weights from an HF folder with `model.safetensors` or sharded `*.safetensors` + index.

    Raises:
      ValueError: unknown `model_type`, no safetensors files, a missing tensor, or a shape mismatch (named).
    """
    from safetensors import safe_open

    folder = Path(folder)
    cfg = ModelConfig.from_hf_config(read_hf_config(folder), name=folder.name)
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        weight_map = None
    if not files:
        raise ValueError(f"{folder} has no *.safetensors files")
    location: dict[str, str] = {}
    handles = {}
    for name in files:
        if not (folder / name).is_file():
            raise ValueError(f"{folder}: safetensors shard {name!r} named in the index is missing")
        handles[name] = safe_open(folder / name, framework="numpy")
        for key in handles[name].keys():
            location[key] = name
    if weight_map is not None:
        location.update({k: v for k, v in weight_map.items() if v in handles})

    def fetch(name: TensorName, layer: int | None, expert: int | None) -> np.ndarray | None:
        key = name.hf.format(i=layer, j=expert)
        if key not in location:
            return None
        return np.asarray(handles[location[key]].get_tensor(key), dtype=np.float32)

    if cfg.tie_word_embeddings is False and "lm_head.weight" not in location:
        raise ValueError(f"{folder}: config.json says tie_word_embeddings=false but tensor 'lm_head.weight' is missing")
    return cfg, assemble(cfg, fetch, "hf", dtype)
