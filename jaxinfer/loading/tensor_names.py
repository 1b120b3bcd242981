"""The one table of checkpoint tensor names: GGUF and HF names of every `models.llama.Weights` field, the
conversion of each [out, in] checkpoint matrix into our layout, and `assemble`, which builds `Weights` from any
per-tensor fetch function (used by `jaxinfer.loading.gguf` and `jaxinfer.loading.hf`).

The tables `LAYER_TENSORS`, `MOE_LAYER_TENSORS`, `FAMILY_LAYER_TENSORS` (per-family renames),
`FUSED_LAYER_TENSORS` (Phi-3's fused q/k/v and gate/up, split at load) and `TOP_TENSORS` are the one place that
maps checkpoint tensor names to our pytree fields. Shapes in the comments: D hidden size, N query heads, H head
dim, E experts, Fe / Fs expert / shared-expert MLP width. A converter that gets a matrix of the wrong shape raises
`ValueError`, which `assemble` turns into one naming the tensor, its shape and the shape the config needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from models.config import ModelConfig
from models.llama import LayerWeights, Weights
from models.quant import QuantizedWeight


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
class TensorName:
    gguf: str
    hf: str
    convert: Callable[[np.ndarray, ModelConfig], np.ndarray]
    rope_heads: str | None = None  # GGUF converters permute these rows for llama.cpp's rotary layout
    # One HF tensor per expert `{j}`, stacked on axis 0 of the field (after L); GGUF files hold them stacked already,
    # as one [E, out, in] tensor (see `assemble`).
    per_expert: bool = False


LAYER_TENSORS: dict[str, TensorName] = {
    "attn_norm": TensorName("blk.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight", _identity),
    "wq": TensorName("blk.{i}.attn_q.weight", "model.layers.{i}.self_attn.q_proj.weight", _linear_heads("num_heads"),
                     rope_heads="num_heads"),
    "wk": TensorName("blk.{i}.attn_k.weight", "model.layers.{i}.self_attn.k_proj.weight",
                     _linear_heads("num_kv_heads"), rope_heads="num_kv_heads"),
    "wv": TensorName("blk.{i}.attn_v.weight", "model.layers.{i}.self_attn.v_proj.weight",
                     _linear_heads("num_kv_heads")),
    "wo": TensorName("blk.{i}.attn_output.weight", "model.layers.{i}.self_attn.o_proj.weight", _out_proj),
    "mlp_norm": TensorName("blk.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight", _identity),
    "w_gate": TensorName("blk.{i}.ffn_gate.weight", "model.layers.{i}.mlp.gate_proj.weight", _transpose),
    "w_up": TensorName("blk.{i}.ffn_up.weight", "model.layers.{i}.mlp.up_proj.weight", _transpose),
    "w_down": TensorName("blk.{i}.ffn_down.weight", "model.layers.{i}.mlp.down_proj.weight", _transpose),
    "bq": TensorName("blk.{i}.attn_q.bias", "model.layers.{i}.self_attn.q_proj.bias", _bias_heads("num_heads"),
                     rope_heads="num_heads"),
    "bk": TensorName("blk.{i}.attn_k.bias", "model.layers.{i}.self_attn.k_proj.bias", _bias_heads("num_kv_heads"),
                     rope_heads="num_kv_heads"),
    "bv": TensorName("blk.{i}.attn_v.bias", "model.layers.{i}.self_attn.v_proj.bias", _bias_heads("num_kv_heads")),
    "q_norm": TensorName("blk.{i}.attn_q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight", _identity),  # [H]
    "k_norm": TensorName("blk.{i}.attn_k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight", _identity),  # [H]
    "b_gate": TensorName("blk.{i}.ffn_gate.bias", "model.layers.{i}.mlp.gate_proj.bias", _identity),
    "b_up": TensorName("blk.{i}.ffn_up.bias", "model.layers.{i}.mlp.up_proj.bias", _identity),
    "b_down": TensorName("blk.{i}.ffn_down.bias", "model.layers.{i}.mlp.down_proj.bias", _identity),
}


def _moe_names(router: str, expert: str, gate: str, up: str, down: str, shared: str | None) -> dict[str, TensorName]:
    """HF per-expert names of one MoE architecture, and llama.cpp's names of the same tensors (every expert of a
    layer in one [E, out, in] tensor; no GGUF names for the shared expert, which GGUF files are not read with)."""
    prefix = "model.layers.{i}."
    names = {
        "router": TensorName("blk.{i}.ffn_gate_inp.weight", prefix + router, _transpose),  # [E, D] -> [D, E]
        "e_gate": TensorName("blk.{i}.ffn_gate_exps.weight", prefix + f"{expert}.{gate}.weight", _transpose,
                             per_expert=True),  # [Fe, D]
        "e_up": TensorName("blk.{i}.ffn_up_exps.weight", prefix + f"{expert}.{up}.weight", _transpose,
                           per_expert=True),  # [Fe, D]
        "e_down": TensorName("blk.{i}.ffn_down_exps.weight", prefix + f"{expert}.{down}.weight", _transpose,
                             per_expert=True),  # [D, Fe]
    }
    if shared is not None:
        names.update({
            "s_gate": TensorName("", prefix + f"{shared}.gate_proj.weight", _transpose),  # [Fs, D] -> [D, Fs]
            "s_up": TensorName("", prefix + f"{shared}.up_proj.weight", _transpose),
            "s_down": TensorName("", prefix + f"{shared}.down_proj.weight", _transpose),  # [D, Fs] -> [Fs, D]
            "s_router": TensorName("", prefix + f"{shared}_gate.weight", _transpose),  # [1, D] -> [D, 1]
        })
    return names


# Hub layouts, which transformers 5.24's `save_pretrained` also writes (it un-fuses its in-memory
# `experts.gate_up_proj` [E, 2 Fe, D] / `experts.down_proj` [E, D, Fe] on save, checked by scripts/make_golden.py).
MOE_LAYER_TENSORS: dict[str, dict[str, TensorName]] = {
    "mixtral": _moe_names("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{j}", "w1", "w3", "w2", None),
    "qwen2_moe": _moe_names("mlp.gate.weight", "mlp.experts.{j}", "gate_proj", "up_proj", "down_proj",
                            "mlp.shared_expert"),
    "qwen3_moe": _moe_names("mlp.gate.weight", "mlp.experts.{j}", "gate_proj", "up_proj", "down_proj", None),
}
# Per-family renames over `LAYER_TENSORS`. Gemma 2's (and Gemma 3's) HF `post_attention_layernorm` normalizes the
# attention output (our `post_attn_norm`), not the MLP input, which is `pre_feedforward_layernorm`; llama.cpp's names
# as its converter writes them for `gemma2` / `gemma3` files.
_SANDWICH_NORMS = {
    "post_attn_norm": TensorName("blk.{i}.post_attention_norm.weight",
                                 "model.layers.{i}.post_attention_layernorm.weight", _identity),
    "mlp_norm": TensorName("blk.{i}.ffn_norm.weight", "model.layers.{i}.pre_feedforward_layernorm.weight",
                           _identity),
    "post_mlp_norm": TensorName("blk.{i}.post_ffw_norm.weight",
                                "model.layers.{i}.post_feedforward_layernorm.weight", _identity),
}
FAMILY_LAYER_TENSORS: dict[str, dict[str, TensorName]] = {"gemma2": _SANDWICH_NORMS, "gemma3_text": _SANDWICH_NORMS}


def _qkv_part(part: int) -> Callable[[np.ndarray, ModelConfig], np.ndarray]:
    """Rows of a fused [(N + 2K) H, D] q/k/v matrix (q rows, then k, then v), as `_linear_heads` of part 0 (q),
    1 (k) or 2 (v)."""
    to_heads = _linear_heads(("num_heads", "num_kv_heads", "num_kv_heads")[part])

    def convert(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
        sizes = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
        if w.shape != (sum(sizes), cfg.hidden_size):
            raise ValueError(f"expected shape {(sum(sizes), cfg.hidden_size)}")
        start = sum(sizes[:part])
        return to_heads(w[start:start + sizes[part]], cfg)
    return convert


def _gate_up_part(part: int) -> Callable[[np.ndarray, ModelConfig], np.ndarray]:
    """Rows of a fused [2F, D] gate/up matrix (gate rows first: transformers' Phi3MLP chunks its output in two),
    transposed: part 0 is w_gate [D, F], part 1 w_up."""
    def convert(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
        F = cfg.intermediate_size
        if w.shape != (2 * F, cfg.hidden_size):
            raise ValueError(f"expected shape {(2 * F, cfg.hidden_size)}")
        return w[part * F:(part + 1) * F].T
    return convert


def _fused_names(qkv: str, gate_up: str, gguf_qkv: str, gguf_gate_up: str) -> dict[str, TensorName]:
    """HF and GGUF names of an architecture whose q/k/v and gate/up projections are each one fused tensor, split
    at load (llama.cpp's converter keeps them fused, in HF's row order, under the GGUF names)."""
    prefix = "model.layers.{i}."
    return {
        "wq": TensorName(gguf_qkv, prefix + qkv, _qkv_part(0)),
        "wk": TensorName(gguf_qkv, prefix + qkv, _qkv_part(1)),
        "wv": TensorName(gguf_qkv, prefix + qkv, _qkv_part(2)),
        "w_gate": TensorName(gguf_gate_up, prefix + gate_up, _gate_up_part(0)),
        "w_up": TensorName(gguf_gate_up, prefix + gate_up, _gate_up_part(1)),
    }


# Per architecture, the fields that replace `LAYER_TENSORS` entries with slices of a fused tensor.
FUSED_LAYER_TENSORS: dict[str, dict[str, TensorName]] = {
    "phi3": _fused_names("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight", "blk.{i}.attn_qkv.weight",
                         "blk.{i}.ffn_up.weight"),
}
TOP_TENSORS: dict[str, TensorName] = {
    "embed": TensorName("token_embd.weight", "model.embed_tokens.weight", _identity),
    "final_norm": TensorName("output_norm.weight", "model.norm.weight", _identity),
    "lm_head": TensorName("output.weight", "lm_head.weight", _transpose),
}


def layer_names(architecture: str) -> dict[str, TensorName]:
    """Layer field -> its `TensorName` for one architecture: `LAYER_TENSORS` with the architecture's MoE, family
    and fused entries over it."""
    return {**LAYER_TENSORS, **MOE_LAYER_TENSORS.get(architecture, {}), **FAMILY_LAYER_TENSORS.get(architecture, {}),
            **FUSED_LAYER_TENSORS.get(architecture, {})}


def assemble(
    cfg: ModelConfig,
    fetch: Callable[[TensorName, int | None, int | None], np.ndarray | None],
    source: str,
    dtype: np.dtype,
    quantized: Callable[[str, TensorName, int | None, int | None], QuantizedWeight | None] | None = None,
    given: Mapping[str, Any] | None = None,
) -> Weights:
    """Builds `Weights` from a per-tensor fetch function (name, layer, expert); checks presence and shapes.

    `source` "gguf" fetches a per-expert field once per layer (expert None), as one [E, out, in] tensor whose
    slices each convert like an HF expert's [out, in] matrix; other sources fetch it expert by expert.
    Stored-quantized tensors come in one of two ways: `quantized` (field, name, layer, expert), if given, is asked
    first per tensor: a `models.quant.QuantizedWeight` in our layout for a tensor the checkpoint stores quantized
    (kept as it is, not cast), None to fetch it as usual (pre-quantized HF folders); `given` maps whole fields
    (layer fields stacked over layers, or "embed" / "lm_head") to values built already, taken as they are
    (`jaxinfer.loading.gguf_quant`, which decides per field).

    Raises:
      ValueError: a missing tensor, a shape that does not fit the config, or a field stored quantized in some
        layers (or experts) and not in others, or with different static fields (all named).
    """
    given = given or {}
    specs = Weights.abstract(cfg)
    stacked_experts = source == "gguf"

    def stack(field: str, items: list) -> np.ndarray | QuantizedWeight:
        if not any(isinstance(x, QuantizedWeight) for x in items):
            return np.stack(items)
        first = items[0]
        if not all(isinstance(x, QuantizedWeight) and x.replace(values=None, scale=None, min=None)
                   == first.replace(values=None, scale=None, min=None) and (x.min is None) == (first.min is None)
                   for x in items):
            raise ValueError(f"{source} checkpoint stores {field} quantized in some layers or experts and not in "
                             f"others (or with different groups); they must all be stored alike")
        return first.replace(values=np.stack([x.values for x in items]), scale=np.stack([x.scale for x in items]),
                             min=None if first.min is None else np.stack([x.min for x in items]))

    def convert(name: TensorName, raw: np.ndarray, stacked: bool) -> np.ndarray:
        if not stacked:
            return name.convert(raw, cfg)
        if raw.ndim != 3 or raw.shape[0] != cfg.num_experts:  # [E, out, in]
            raise ValueError(f"expected {cfg.num_experts} experts on axis 0")
        return np.stack([name.convert(w, cfg) for w in raw])

    def get(field: str, name: TensorName, spec, layer: int | None, expert: int | None = None) -> np.ndarray:
        if name.per_expert and expert is None and not stacked_experts:
            return stack(field, [get(field, name, spec, layer, j) for j in range(cfg.num_experts)])
        label = (name.gguf if source == "gguf" else name.hf).format(i=layer, j=expert)
        expected = spec.shape[1:] if layer is not None else spec.shape
        expected = expected[1:] if expert is not None else expected
        q = None if quantized is None else quantized(field, name, layer, expert)
        if q is not None:
            if q.shape != expected:
                raise ValueError(f"{source} tensor {label!r} is stored quantized as a {q.shape} weight; the config "
                                 f"needs {expected}")
            return q
        raw = fetch(name, layer, expert)
        if raw is None:
            raise ValueError(f"{source} checkpoint is missing tensor {label!r}")
        try:
            arr = convert(name, raw, stacked=name.per_expert and expert is None)
        except ValueError:
            raise ValueError(f"{source} tensor {label!r} has shape {raw.shape}, which does not fit the config "
                             f"(expected {expected})") from None
        if arr.shape != expected:
            raise ValueError(f"{source} tensor {label!r} has shape {raw.shape}; the config needs {expected}")
        return arr.astype(dtype)

    layer_fields = {}
    for field, name in layer_names(cfg.architecture).items():
        spec = getattr(specs.layers, field)
        if spec is None:
            continue
        if field in given:
            layer_fields[field] = given[field]
            continue
        layer_fields[field] = stack(field, [get(field, name, spec, i) for i in range(cfg.num_layers)])
    top = {field: given[field] if field in given else get(field, name, getattr(specs, field), None)
           for field, name in TOP_TENSORS.items() if getattr(specs, field) is not None}
    return Weights(layers=LayerWeights(**layer_fields), **top)
