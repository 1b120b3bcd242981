"""The prepared-model cache: a GGUF file's weights, dequantized once, kept as a jaxinfer orbax checkpoint.

Reading a GGUF file is slow where the file is small: the `gguf` package parses every metadata field when it opens a
file (seconds for a 49k-token vocabulary), and every tensor is dequantized and stacked in numpy (SmolLM2-135M: 8 s
of a 16 s start). `load_model` keeps the result of the first load of a GGUF file in this cache and restores it on
later loads: an entry is a folder with `weights.safetensors` (every weight, flattened by its path in the layout of
`jaxinfer.loading.orbax_format`, uncompressed, and restored as read-only views of a memory map of it: no copy), `config.json` (the
`ModelConfig`, `jaxinfer.loading.codec`) and `tokenizer/` (`Tokenizer.save_pretrained`). Orbax checkpoints
(`jaxinfer convert`) compress their arrays and restore several times slower, which a cache has no use for.

The folder is `$JAXINFER_MODEL_CACHE`, else `~/.cache/jaxinfer/models`; an empty value turns the cache off. An
entry's key hashes the file's content (SHA-256: 0.06 s for SmolLM2's 94 MiB), the dtype, and the source of the code
that reads GGUF files and tokenizers, so a changed file or a changed loader never reuses an entry, and copies of one
file (each checkout's virtual environment holds one) share one entry; storing an entry removes older entries of a
file of the same name and dtype. `checksums.json` holds a checksum of every array (a position-weighted sum of its
64-bit words, `checksum`: 0.15 s for 513 MiB) and the SHA-256 of the config and tokenizer files, checked on restore:
a damaged or edited entry is logged, deleted and the file loaded again. GGUF tensors kept quantized
(`--quantization gguf`) are not
cached (checkpoints do not store that format). Entries are written to a temporary folder and renamed into place,
so processes loading the same file at once never see half an entry.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxinfer.cache_dirs import MODEL_CACHE_VARIABLE as CACHE_VARIABLE  # noqa: F401 - this cache's variable
from jaxinfer.cache_dirs import model_cache_dir

logger = logging.getLogger(__name__)

_WEIGHTS, _CONFIG, _TOKENIZER, _CHECKSUMS = "weights.safetensors", "config.json", "tokenizer", "checksums.json"
_FILES = "__files__"  # the key of `checksums.json` that holds the config's and tokenizer's digests
_PACKAGE = Path(__file__).resolve().parents[1]
# The code whose output an entry holds: a change to any of it makes new keys.
_LOADER_SOURCES = ("loading/gguf.py", "loading/tensor_names.py", "loading/codec.py", "loading/orbax_format.py",
                   "loading/model_cache.py", "tokenizer")


def cache_dir() -> Path | None:
    """The cache folder (`jaxinfer.cache_dirs.model_cache_dir`), None when turned off."""
    return model_cache_dir()


def _loader_digest() -> bytes:
    h = hashlib.sha256()
    for name in _LOADER_SOURCES:
        path = _PACKAGE / name
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            h.update(f.name.encode() + f.read_bytes())
    h.update((_PACKAGE.parent / "models" / "config.py").read_bytes())
    return h.digest()


def _entry_prefix(path: Path, dtype: np.dtype) -> str:
    return f"{path.stem}-{np.dtype(dtype).name}-"


@functools.lru_cache(maxsize=8)
def _content_digest(path: str, size: int, mtime_ns: int) -> str:
    """SHA-256 of the file's content (hashed once per process for a given path, size and time)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def entry_path(path: str | os.PathLike, dtype: np.dtype) -> Path | None:
    """Where the entry of GGUF file `path` loaded in `dtype` lives (whether or not it exists); None with the cache
    off."""
    root = cache_dir()
    if root is None:
        return None
    path = Path(path)
    st = os.stat(path)
    h = hashlib.sha256(f"{_content_digest(os.path.realpath(path), st.st_size, st.st_mtime_ns)}|"
                       f"{np.dtype(dtype).name}".encode())
    h.update(_loader_digest())
    return root / (_entry_prefix(path, dtype) + h.hexdigest()[:16])


_CHUNK = 1 << 20  # words a step of `checksum`


@functools.cache
def _positions() -> np.ndarray:
    return np.arange(1, _CHUNK + 1, dtype=np.uint64)


def checksum(array: np.ndarray) -> int:
    """A position-weighted sum of a C-contiguous array's 64-bit words (bytes when its size is not a multiple of 8),
    mod 2**64: sum over i of word_i * (i + 1). A changed word changes it, and so do words moved or swapped (a plain
    sum misses those); it is not a cryptographic hash. About 0.15 s for 513 MiB."""
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    words = flat.view(np.uint64) if flat.size % 8 == 0 else flat.astype(np.uint64)
    total, mask = 0, (1 << 64) - 1
    for start in range(0, words.size, _CHUNK):  # chunk c: sum_j w_j (start + j + 1) = start * sum w + sum w_j (j+1)
        chunk = words[start : start + _CHUNK]
        total += start * int(np.sum(chunk, dtype=np.uint64)) + int(np.dot(chunk, _positions()[: chunk.size]))
        total &= mask
    return total


def _file_digests(entry: Path) -> dict[str, str]:
    """SHA-256 of the entry's config and tokenizer files, by their path in the entry (a few hundred KiB)."""
    files = [entry / _CONFIG, *sorted(p for p in (entry / _TOKENIZER).rglob("*") if p.is_file())]
    return {str(p.relative_to(entry)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def lookup(path: str | os.PathLike, dtype: np.dtype) -> Path | None:
    """The entry of GGUF file `path` in `dtype` when the cache holds it, else None."""
    entry = entry_path(path, dtype)
    return entry if entry is not None and (entry / _CONFIG).is_file() else None


def restore(entry: Path) -> tuple | None:
    """(config, numpy weights, tokenizer) of a cache entry, or None for an entry that cannot be read or does not
    fit its config (a truncated file, another writer): it is logged and deleted, and the caller loads the model
    file again (which stores a new entry)."""
    try:
        result = _restore(entry)
    except Exception as e:  # noqa: BLE001 - any damage (safetensors, JSON, tokenizer errors) means: load afresh
        logger.warning("model cache: entry %s is damaged (%s: %s); deleting it and loading the model file", entry,
                       type(e).__name__, e)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    logger.info("model cache: restored %s", entry)
    return result


def _safetensors_dtypes() -> dict[str, np.dtype]:
    import ml_dtypes

    return {"BOOL": np.dtype(bool), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8), "U16": np.dtype(np.uint16),
            "I16": np.dtype(np.int16), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
            "U32": np.dtype(np.uint32), "I32": np.dtype(np.int32), "F32": np.dtype(np.float32),
            "U64": np.dtype(np.uint64), "I64": np.dtype(np.int64), "F64": np.dtype(np.float64),
            "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2)}


def read_mapped(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as a read-only numpy view of a memory map of the file, so a restore costs
    no copy into fresh memory (about 0.3 s of 513 MiB on this VM; `safetensors.numpy.load_file` copies each tensor).

    The format (https://huggingface.co/docs/safetensors): a little-endian u64 N, N bytes of JSON mapping each name
    to its dtype, shape and [begin, end) byte offsets into the data that follows.

    Raises:
      ValueError: a truncated or malformed file, or an unknown dtype.
    """
    import mmap
    import struct

    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # stays mapped while a view refers to it
    if len(data) < 8:
        raise ValueError(f"{path} is shorter than a safetensors header")
    (n,) = struct.unpack("<Q", data[:8])
    header, start = json.loads(data[8 : 8 + n]), 8 + n
    dtypes, arrays = _safetensors_dtypes(), {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in dtypes:
            raise ValueError(f"{name} has the unknown dtype {info['dtype']!r}")
        dtype, (begin, end) = dtypes[info["dtype"]], info["data_offsets"]
        count = int(np.prod(info["shape"], dtype=np.int64))
        if end - begin != count * dtype.itemsize or start + end > len(data):
            raise ValueError(f"{name}: its bytes [{begin}, {end}) do not hold {info['shape']} {dtype.name}")
        arrays[name] = np.frombuffer(data, dtype, count, start + begin).reshape(info["shape"])
    return arrays


def _restore(entry: Path) -> tuple:
    from jaxinfer.loading.codec import config_from_dict
    from jaxinfer.loading.orbax_format import nest, weights_from_dict
    from jaxinfer.tokenizer import Tokenizer
    from models.llama import check_weights

    cfg = config_from_dict(json.loads((entry / _CONFIG).read_text()), where=str(entry / _CONFIG))
    arrays = read_mapped(entry / _WEIGHTS)
    want = json.loads((entry / _CHECKSUMS).read_text())
    if want.pop(_FILES, None) != _file_digests(entry):
        raise ValueError(f"its config or tokenizer files differ from those {_CHECKSUMS} names")
    if sorted(want) != sorted(arrays):
        raise ValueError(f"its arrays are not those of {_CHECKSUMS}")
    for name, array in arrays.items():
        if checksum(array) != want[name]:
            raise ValueError(f"the checksum of {name} differs from the stored one")
    try:
        weights = weights_from_dict(nest([(tuple(k.split("/")), v) for k, v in arrays.items()]), cfg)
        check_weights(weights, cfg)
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"it does not fit its config ({e})") from None
    return cfg, weights, Tokenizer.from_hf_dir(entry / _TOKENIZER)


def store(path: str | os.PathLike, dtype: np.dtype, cfg, weights, tokenizer) -> Path | None:
    """Writes the entry of GGUF file `path` loaded in `dtype` (config, numpy weights, tokenizer) and removes older
    entries of the same file and dtype; returns the entry, or None with the cache off or when writing failed (a
    full disk, a read-only folder: logged, never raised, as the load itself succeeded)."""
    from safetensors.numpy import save_file

    from jaxinfer.loading.codec import config_to_dict
    from jaxinfer.loading.orbax_format import flat_keys, get_path, weights_to_dict

    entry = entry_path(path, dtype)
    if entry is None:
        return None
    t0 = time.perf_counter()
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".writing-", dir=entry.parent))
        try:
            tree = weights_to_dict(weights)
            arrays = {"/".join(k): np.ascontiguousarray(get_path(tree, k)) for k in flat_keys(tree)}
            save_file(arrays, tmp / _WEIGHTS, metadata={"source": os.path.realpath(path)})
            tokenizer.save_pretrained(tmp / _TOKENIZER)
            (tmp / _CONFIG).write_text(json.dumps(config_to_dict(cfg)))
            sums = {name: checksum(a) for name, a in arrays.items()}
            (tmp / _CHECKSUMS).write_text(json.dumps({**sums, _FILES: _file_digests(tmp)}))
            os.rename(tmp, entry)
        except OSError:
            if not entry.exists():  # another process's entry won the rename: keep it
                raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    except (OSError, ValueError) as e:
        logger.warning("model cache: could not store %s in %s: %s", path, entry.parent, e)
        return None
    # Older entries of a file of this name and dtype (and those of the earlier path-keyed names "STEM-PATH-DTYPE-")
    for old in entry.parent.glob(f"{Path(path).stem}-*{np.dtype(dtype).name}-*"):
        if old != entry:
            shutil.rmtree(old, ignore_errors=True)
    logger.info("model cache: stored %s (%s) in %s in %.1f s; later loads restore it from there", Path(path).name,
                np.dtype(dtype).name, entry, time.perf_counter() - t0)
    return entry
