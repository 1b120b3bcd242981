"""GGUF checkpoints (through the `gguf` package) into `models.llama.Weights`: the file, its metadata (which
`models.config.ModelConfig.from_gguf_metadata` parses into our config) and its tensors, dequantized to float32 and
cast to the requested dtype. Tensor names and layouts come from `jaxinfer.loading.tensor_names`.

Errors are `ValueError`s naming the file or the tensor.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from pathlib import Path

import numpy as np

from jaxinfer.loading.tensor_names import TensorName, assemble
from models.config import ModelConfig
from models.llama import Weights

_PERMUTED_GGUF_ARCHITECTURES = ("llama", "mistral")
# GGUF value types (llama.cpp's gguf spec): struct formats of the scalars; 8 is a string, 9 an array.
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                          "tokenizer.ggml.token_type")
_GGUF_LONG_ARRAY = 1024  # entries past which the header reader skips an array (tokens, merges, scores)


def read_gguf_header(path: str | os.PathLike) -> dict:
    """The metadata key/values of a GGUF file read from its header alone (milliseconds; the `gguf` package's
    reader parses every tokenizer array first). Arrays of more than _GGUF_LONG_ARRAY entries are left out, and
    `tokenizer.ggml.tokens.count` is set, as in `gguf_metadata`.

    Raises:
      ValueError: if the file is not a GGUF file of version >= 2 or its header is cut short.
    """
    with open(path, "rb") as f:
        def unpack(fmt: str):
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        def value(vtype: int):
            """The next value; for an array, (its entries or None when skipped, its length)."""
            if vtype == _GGUF_STRING:
                return f.read(unpack("<Q")).decode("utf-8", "replace")
            if vtype != _GGUF_ARRAY:
                return unpack(_GGUF_SCALARS[vtype])
            etype, count = unpack("<I"), unpack("<Q")
            if etype in _GGUF_SCALARS and count > _GGUF_LONG_ARRAY:
                f.seek(count * struct.calcsize(_GGUF_SCALARS[etype]), os.SEEK_CUR)
                return None, count
            items = [value(etype) for _ in range(count)]
            return (items if count <= _GGUF_LONG_ARRAY else None), count

        try:
            if f.read(4) != b"GGUF" or unpack("<I") < 2:
                raise ValueError("not a GGUF file of version >= 2")
            _, num_values = unpack("<Q"), unpack("<Q")
            meta: dict = {}
            for _ in range(num_values):
                key = f.read(unpack("<Q")).decode("utf-8")
                vtype = unpack("<I")
                got = value(vtype)
                if vtype == _GGUF_ARRAY:
                    got, count = got
                    if key == "tokenizer.ggml.tokens":
                        meta["tokenizer.ggml.tokens.count"] = count
                    if got is None or key in _GGUF_TOKENIZER_ARRAYS:
                        continue
                meta[key] = got
        except (struct.error, KeyError, UnicodeDecodeError, OverflowError) as e:
            raise ValueError(f"{path} is not a readable GGUF file: {e}") from None
    return meta


def _unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes the GGUF converters' Q/K row permutation (interleaved -> half-split rotary pairs), rows first."""
    rows = w.shape[0]
    rest = w.shape[1:]
    # Row (head, pair j, member m) holds what HF stores at row (head, m, j).
    return w.reshape(num_heads, rows // num_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


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
        if key in _GGUF_TOKENIZER_ARRAYS:
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

    def fetch(name: TensorName, layer: int | None, expert: int | None) -> np.ndarray | None:
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

    return cfg, assemble(cfg, fetch, "gguf", dtype)
