"""GGUF checkpoints (through the `gguf` package) into `models.llama.Weights`: the file, its metadata (which
`models.config.ModelConfig.from_gguf_metadata` parses into our config) and its tensors, dequantized to float32 and
cast to the requested dtype. Tensor names and layouts come from `jaxinfer.loading.tensor_names`.

Errors are `ValueError`s naming the file or the tensor.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import struct
import threading
from pathlib import Path

import numpy as np

from jaxinfer.loading.gguf_quant import kept_quantized
from jaxinfer.loading.tensor_names import TensorName, assemble
from models.config import ModelConfig
from models.gguf_families import GGUF_METADATA_TENSORS
from models.llama import Weights

_PERMUTED_GGUF_ARCHITECTURES = ("llama", "mistral")
# GGUF value types (llama.cpp's gguf spec): struct formats of the scalars; 8 is a string, 9 an array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_VERSIONS = (2, 3)  # those the gguf package reads
_GGUF_DEFAULT_ALIGNMENT = 32  # of the tensor data, unless general.alignment says otherwise
_GGUF_TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                          "tokenizer.ggml.token_type")
_GGUF_LONG_ARRAY = 1024  # entries past which the header reader skips an array (tokens, merges, scores)
_READER_CACHE_SIZE = 2  # parsed readers kept (least recently used dropped): each holds a file map and its fields
_READER_CACHE: collections.OrderedDict = collections.OrderedDict()
_READER_CACHE_LOCK = threading.Lock()


class _EndOfFile(Exception):
    """A read past the end of the file: it is truncated."""


class _BadHeader(Exception):
    """A GGUF header that does not parse: the message says where."""


class _HeaderReader:
    """Reads GGUF header values from `f` (a file of `size` bytes) in the byte order `order` ("<" or ">"); a read
    past the end raises `_EndOfFile` before anything is allocated."""

    def __init__(self, f, size: int) -> None:
        self.f, self.size, self.order = f, size, "<"

    def read(self, n: int) -> bytes:
        if n > self.size - self.f.tell():
            raise _EndOfFile
        return self.f.read(n)

    def unpack(self, fmt: str):
        fmt = self.order + fmt
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> bytes:
        return self.read(self.unpack("Q"))

    def skip_strings(self, count: int) -> None:
        """Moves past `count` length-prefixed strings without decoding them (a vocabulary: ~50k strings in
        milliseconds, where reading each costs half a second)."""
        pos, length = 0, self.order + "Q"
        buf = b""
        for _ in range(count):
            if pos + 8 > len(buf):
                buf, pos = buf[pos:] + self.f.read(1 << 20), 0
                if pos + 8 > len(buf):
                    raise _EndOfFile
            pos += 8 + struct.unpack_from(length, buf, pos)[0]
            while pos > len(buf):  # a string longer than what is buffered
                more = self.f.read(max(1 << 20, pos - len(buf)))
                if not more:
                    raise _EndOfFile
                buf += more
        consumed = self.f.tell() - len(buf) + pos
        if consumed > self.size:
            raise _EndOfFile
        self.f.seek(consumed)

    def value(self, vtype: int):
        """The next value; for an array, (its entries or None when skipped, its length)."""
        if vtype == _GGUF_STRING:
            return self.string().decode("utf-8", "replace")
        if vtype not in _GGUF_SCALARS and vtype != _GGUF_ARRAY:
            raise _BadHeader(f"value type {vtype} is not a GGUF type")
        if vtype != _GGUF_ARRAY:
            return self.unpack(_GGUF_SCALARS[vtype])
        etype, count = self.unpack("I"), self.unpack("Q")
        if etype == _GGUF_STRING and count > _GGUF_LONG_ARRAY:
            self.skip_strings(count)
            return None, count
        if etype in _GGUF_SCALARS and count > _GGUF_LONG_ARRAY:
            skip = count * struct.calcsize(_GGUF_SCALARS[etype])
            if skip > self.size - self.f.tell():
                raise _EndOfFile
            self.f.seek(skip, os.SEEK_CUR)
            return None, count
        items = [self.value(etype) for _ in range(count)]
        return (items if count <= _GGUF_LONG_ARRAY else None), count


def _tensor_end(name: str, dims: list[int], ggml_type: int, offset: int) -> int:
    """Where the data of a tensor at `offset` (from the start of the data section) ends, in bytes."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise _BadHeader(f"tensor {name!r} has the unknown GGML type {ggml_type}") from None
    return offset + int(np.prod(dims, dtype=object)) // block * type_size


def read_gguf_header(path: str | os.PathLike) -> dict:
    """The metadata key/values of a GGUF file read from its header alone (milliseconds; the `gguf` package's
    reader parses every tokenizer array first), after checking that the file holds all the tensor data its
    header lists. Arrays of more than _GGUF_LONG_ARRAY entries are left out, and `tokenizer.ggml.tokens.count`
    is set, as in `gguf_metadata`; the values of the tensors named in `GGUF_METADATA_TENSORS` (Phi-3's LongRoPE
    factors, a few floats) are read from the data section and added under their names, as in `gguf_metadata`.

    Raises:
      ValueError: naming the file: empty, not a GGUF file (no magic bytes), a GGUF version other than 2 or 3,
        truncated (it ends inside its header or before the end of its last tensor's data: an interrupted download
        or copy), a header that does not parse, one that lists no tensors (a vocabulary-only file), or a
        `GGUF_METADATA_TENSORS` tensor that is neither F32 nor F16.
    """
    name = repr(os.fspath(path))
    truncated = f"{name} is truncated: it ends inside its GGUF header, at {{}} bytes (an interrupted download or copy?)"
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        r = _HeaderReader(f, size)
        if size == 0:
            raise ValueError(f"{name} is empty (0 bytes), not a GGUF file")
        if f.read(4) != b"GGUF":
            raise ValueError(f"{name} is not a GGUF file: it does not start with the GGUF magic bytes")
        try:
            version = r.unpack("I")
            if version & 0xFFFF == 0:  # written on a big-endian machine, as the gguf package reads it
                r.order, version = ">", struct.unpack(">I", struct.pack("<I", version))[0]
            if version not in _GGUF_VERSIONS:
                raise ValueError(f"{name} is GGUF version {version}; versions {' and '.join(map(str, _GGUF_VERSIONS))} "
                                 "are supported")
            meta, header_end, data_end, last, config_tensors = _scan_header(r)
        except _EndOfFile:
            raise ValueError(truncated.format(size)) from None
        except _BadHeader as e:
            raise ValueError(f"{name} is not a valid GGUF file: {e}") from None
    if last is None:
        raise ValueError(f"{name} holds no tensors: its GGUF header lists no weights (a vocabulary-only GGUF?)")
    alignment = meta.get("general.alignment", _GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"{name} is not a valid GGUF file: general.alignment={alignment!r} is not a power of two")
    need = -(-header_end // alignment) * alignment + data_end  # the tensor data starts aligned after the header
    if need > size:
        raise ValueError(f"{name} is truncated: {size} bytes, but its last tensor ({last!r}) ends at byte {need} "
                         "(an interrupted download or copy?)")
    meta.update(_read_config_tensors(path, r.order, need - data_end, config_tensors))
    return meta


def _read_config_tensors(path: str | os.PathLike, order: str, start: int,
                         found: dict[str, tuple[list[int], int, int]]) -> dict[str, list[float]]:
    """The values (flattened, as floats) of the tensors `found` lists (name -> dims, GGML type, offset past the
    data section's start at byte `start`), in byte order `order`.

    Raises:
      ValueError: a tensor neither F32 nor F16 (how llama.cpp's converters write these), naming it.
    """
    values = {}
    with open(path, "rb") as f:
        for tensor, (dims, ggml_type, offset) in found.items():
            if ggml_type not in (0, 1):  # GGML_TYPE_F32, GGML_TYPE_F16
                raise ValueError(f"{os.fspath(path)!r}: GGUF tensor {tensor!r} has GGML type {ggml_type}; it is read "
                                 "as config only in F32 or F16")
            dtype = np.dtype(order + ("f4" if ggml_type == 0 else "f2"))
            count = int(np.prod(dims, dtype=np.int64))
            f.seek(start + offset)
            values[tensor] = np.frombuffer(f.read(count * dtype.itemsize), dtype).astype(np.float32).tolist()
    return values


def _scan_header(r: _HeaderReader) -> tuple[dict, int, int, str | None, dict]:
    """(metadata, where the header ends, where the last tensor's data ends past the data section's start, that
    tensor's name, None when the header lists no tensors, and name -> (dims, GGML type, offset) of the tensors
    named in `GGUF_METADATA_TENSORS`) of the header after the version.

    Raises:
      _EndOfFile: the file ends inside the header.
      _BadHeader: a value or tensor type that GGUF does not have.
    """
    num_tensors, num_values = r.unpack("Q"), r.unpack("Q")
    meta: dict = {}
    for _ in range(num_values):
        key = r.string().decode("utf-8", "replace")
        vtype = r.unpack("I")
        got = r.value(vtype)
        if vtype == _GGUF_ARRAY:
            got, count = got
            if key == "tokenizer.ggml.tokens":
                meta["tokenizer.ggml.tokens.count"] = count
            if got is None or key in _GGUF_TOKENIZER_ARRAYS:
                continue
        meta[key] = got
    data_end, last, config_tensors = 0, None, {}
    for _ in range(num_tensors):
        tensor = r.string().decode("utf-8", "replace")
        dims = [r.unpack("Q") for _ in range(r.unpack("I"))]
        ggml_type, offset = r.unpack("I"), r.unpack("Q")
        end = _tensor_end(tensor, dims, ggml_type, offset)
        if tensor in GGUF_METADATA_TENSORS:
            config_tensors[tensor] = (dims, ggml_type, offset)
        if last is None or end > data_end:
            data_end, last = end, tensor
    return meta, r.f.tell(), data_end, last, config_tensors


def _unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes the GGUF converters' Q/K row permutation (interleaved -> half-split rotary pairs), rows first."""
    rows = w.shape[0]
    rest = w.shape[1:]
    # Row (head, pair j, member m) holds what HF stores at row (head, m, j).
    return w.reshape(num_heads, rows // num_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str | os.PathLike) -> "gguf.GGUFReader":  # noqa: F821
    """Opens a GGUF file (memory-mapped, read-only).

    The `gguf` package parses every metadata field when it opens a file (seconds for a 49k-token vocabulary, most
    of a small model's load), so the parsed readers of the last `_READER_CACHE_SIZE` (2) files are kept and
    shared: a file opened again with the same resolved path, device, inode, size and modification time (ns) gets
    the same reader; a rewritten or replaced file is parsed afresh. Callers only read a reader (its fields and
    tensor maps); it must not be changed.

    Raises:
      ValueError: naming the file: as `read_gguf_header`, or a file the gguf package cannot read.
    """
    import gguf

    read_gguf_header(path)  # names an empty, foreign or truncated file, which the gguf package fails on obscurely
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _READER_CACHE_LOCK:
        reader = _READER_CACHE.get(key)
        if reader is not None:
            _READER_CACHE.move_to_end(key)
            return reader
    try:
        reader = gguf.GGUFReader(os.fspath(path))
    except (ValueError, OSError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from None
    with _READER_CACHE_LOCK:
        _READER_CACHE[key] = reader
        while len(_READER_CACHE) > _READER_CACHE_SIZE:
            _READER_CACHE.popitem(last=False)
    return reader


def gguf_metadata(reader: "gguf.GGUFReader") -> dict:  # noqa: F821
    """GGUF key/values as Python values, skipping the large tokenizer arrays, plus the values (flattened floats)
    of the tensors named in `GGUF_METADATA_TENSORS` (Phi-3's LongRoPE factors: config kept as tensors) under
    their names."""
    from gguf.quants import dequantize

    meta = {}
    for key, field in reader.fields.items():
        if key in _GGUF_TOKENIZER_ARRAYS:
            continue
        meta[key] = field.contents()
    if "tokenizer.ggml.tokens" in reader.fields:
        meta["tokenizer.ggml.tokens.count"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    for t in reader.tensors:
        if t.name in GGUF_METADATA_TENSORS:
            meta[t.name] = np.asarray(dequantize(t.data, t.tensor_type), np.float32).ravel().tolist()
    return meta


def load_gguf_weights(reader: "gguf.GGUFReader", dtype: np.dtype = np.float32,  # noqa: F821
                      keep_quantized: bool = False) -> tuple[ModelConfig, Weights]:
    """Reads config and weights from a GGUF file, dequantizing every type the `gguf` package supports; with
    `keep_quantized`, Q8_0 / Q4_0 / Q4_1 projections (and a Q8_0 embedding or LM head) stay quantized as stored,
    `models.quant.QuantizedWeight`s exactly equal to their dequantized values (`jaxinfer.loading.gguf_quant`).

    Q/K rows of llama/mistral files (Mixtral's too: a `llama` file with experts) are un-permuted back to the
    half-split rotary layout that `models.llama` uses (GGUF converters interleave them for llama.cpp; qwen2, qwen3,
    qwen3moe, gemma, gemma2, gemma3 and phi3 files keep HF's order). Norm gains of a family whose norms scale by
    offset + w (Gemma 1 / 2 / 3, q/k norms included) are stored as the sum by llama.cpp's converter, which its
    plain RMSNorm multiplies by; the offset is subtracted back, so the config and weights equal the HF folder's. A
    per-expert field is one [E, out, in] tensor per layer (`ffn_gate_exps` etc.); Phi-3's fused `attn_qkv` and
    `ffn_up` (gate rows, then up) are split as the HF loader splits them (`jaxinfer.loading.tensor_names`).

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
    permute = meta["general.architecture"] in _PERMUTED_GGUF_ARCHITECTURES

    def rope_rows(name: TensorName, layer: int | None, rows: int) -> np.ndarray:
        """The file's row each of `rows` loaded rows comes from: the Q/K un-permutation, else in order."""
        order = np.arange(rows)
        if not (permute and name.rope_heads is not None):
            return order
        heads = getattr(cfg, name.rope_heads)
        if rows != heads * cfg.head_dim:
            raise ValueError(f"GGUF tensor {name.gguf.format(i=layer)!r} has {rows} rows; the config needs "
                             f"{heads * cfg.head_dim} ({heads} heads x {cfg.head_dim})")
        return _unpermute_rope_rows(order, heads)

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
            arr = arr[rope_rows(name, layer, arr.shape[0])]
        if cfg.norm_weight_offset and key.endswith("norm.weight"):
            arr = arr - np.float32(cfg.norm_weight_offset)
        return arr

    kept = kept_quantized(cfg, tensors, rope_rows) if keep_quantized else {}
    return cfg, assemble(cfg, fetch, "gguf", dtype, given=kept)
