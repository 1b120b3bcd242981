"""Builds and loads the native CPU kernels (`gemv.cc`: matmuls; `paged_attention.cc`: decode attention; `logits.cc`:
the sampling step's row reductions) once per ISA level, into one library in a cache folder.

The C++ sources ship with the package and are compiled at first use with the machine's C++ compiler (`$CXX`, else
`g++`, else `c++`) against jaxlib's FFI headers (`jax.ffi.include_dir()`), then registered with
`jax.ffi.register_ffi_target` for the CPU platform. The library lands in `$JAXINFER_NATIVE_CACHE` (default
`~/.cache/jaxinfer/native`) under a name that hashes the sources, the flags, the compiler and the headers (their
contents, not their paths: checkouts that share the folder share the build; `build_key`), so a changed source or
jaxlib builds anew and concurrent processes never load a half-written file (each compiles to a
temporary name and renames it into place). Without a compiler, or when the build fails, `load` logs one line and
returns None: the callers fall back to XLA's dot. Each use marks its library as used (its modification time);
after a build the folder keeps the `KEEP_BUILDS` most recently used libraries of that level and deletes the
older ones (other checkouts or jaxlib versions sharing the folder rebuild theirs when they need them).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax

from pallas_kernels.cpu_features import ISA_LEVELS, cpu_flags, supported_levels  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(f) for f in ("gemv.cc", "paged_attention.cc", "logits.cc"))
KEEP_BUILDS = 4  # libraries kept a level in the cache folder, the newest used first (`_prune`)
HEADERS = tuple(Path(__file__).with_name(h) for h in ("threads.h", "common.h", "float.h", "int4.h", "int8.h",
                                                   "amx.h"))  # part of the cache key
TARGETS = ("float_matmul", "weight_only_matmul", "i8i8_matmul", "paged_attention", "logit_rows",
           "truncation_threshold")
_lock = threading.Lock()
_loaded: dict[str, bool] = {}  # ISA level -> registered (False: the build failed, do not retry)


def target_name(kernel: str, level: str) -> str:
    """The FFI target name of `kernel` built for `level` (one registration per level, so tests can switch)."""
    return f"jaxinfer_{kernel}_{level}"


def cache_dir() -> Path:
    return Path(os.environ.get("JAXINFER_NATIVE_CACHE") or Path.home() / ".cache" / "jaxinfer" / "native")


def _compiler() -> str | None:
    wanted = os.environ.get("CXX")
    if wanted and not shutil.which(wanted):
        logger.warning("CXX=%r is not an executable; trying g++ and c++", wanted)
    for name in (wanted, "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _command(cxx: str, level: str, output: Path, include_dir: str | None = None,
             sources: tuple[str, ...] | None = None) -> list[str]:
    """The compiler's command line (`include_dir`, `sources`: jaxlib's FFI headers and the source paths by default)."""
    include_dir = jax.ffi.include_dir() if include_dir is None else include_dir
    sources = tuple(map(str, SOURCES)) if sources is None else sources
    return [cxx, "-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-Wno-attributes", "-Wno-return-type",
            *ISA_LEVELS[level][0], "-I", include_dir, *sources, "-o", str(output)]


def build_key(cxx: str, level: str) -> str:
    """16 hex digits of a hash of what the library is built from: the sources' and headers' contents, the flags,
    the compiler's version and jaxlib's FFI header; not their places, so checkouts and venvs with the same ones
    share a build."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    header = Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "ffi.h"
    command = _command("cxx", level, Path("o"), include_dir="", sources=tuple(s.name for s in SOURCES))
    return hashlib.sha256("\0".join([*(s.read_text() for s in SOURCES), *(h.read_text() for h in HEADERS),
                                      " ".join(command), version,
                                      header.read_text() if header.exists() else ""]).encode()).hexdigest()[:16]


def library_path(level: str) -> Path | None:
    """Where the library for `level` is (built now if missing); None without a compiler or when the build fails."""
    cxx = _compiler()
    if cxx is None:
        logger.warning("no C++ compiler found (g++ or $CXX): matmuls run on XLA's dot")
        return None
    path = cache_dir() / f"jaxinfer_gemv_{level}_{build_key(cxx, level)}.so"
    if path.exists():
        _mark_used(path)
        return path
    logger.warning("compiling the native CPU matmul kernels (%s) into %s; once, about 10 s", level, path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            partial = Path(tmp) / path.name
            result = subprocess.run(_command(cxx, level, partial), capture_output=True, text=True)
            if result.returncode != 0:
                logger.warning("building the native CPU matmul kernels failed (matmuls run on XLA's dot):\n%s",
                               result.stderr[-2000:])
                return None
            os.replace(partial, path)
        _prune(path)
    except OSError as e:  # an unwritable or missing cache folder (JAXINFER_NATIVE_CACHE)
        logger.warning("cannot build the native CPU matmul kernels into %s (%s): matmuls run on XLA's dot; set "
                       "JAXINFER_NATIVE_CACHE to a writable folder", path.parent, e)
        return None
    return path


def _mark_used(path: Path) -> None:
    """Sets `path`'s modification time to now (what `_prune` keeps by); a read-only cache is left as it is."""
    try:
        os.utime(path)
    except OSError:
        pass


def _prune(built: Path) -> None:
    """Deletes the libraries of `built`'s level in its folder beyond the KEEP_BUILDS most recently used (`built`
    always stays). A file that vanishes or cannot be deleted meanwhile is skipped."""
    level = built.name[len("jaxinfer_gemv_"):].rsplit("_", 1)[0]
    others = []
    for p in built.parent.glob(f"jaxinfer_gemv_{level}_*.so"):
        if p != built and p.name[len("jaxinfer_gemv_"):].rsplit("_", 1)[0] == level:
            try:
                others.append((p.stat().st_mtime, p))
            except OSError:
                continue
    old = [p for _, p in sorted(others, reverse=True)[KEEP_BUILDS - 1:]]
    for p in old:
        try:
            p.unlink()
        except OSError:
            continue
    if old:
        logger.info("native kernels cache: removed %d older %s build(s) from %s", len(old), level, built.parent)


def load(level: str) -> bool:
    """Builds (if needed), loads and registers the kernels for ISA `level`; whether they are usable.

    Raises:
      ValueError: an unknown level.
    """
    if level not in ISA_LEVELS:
        raise ValueError(f"unknown ISA level {level!r}; known: {', '.join(ISA_LEVELS)}")
    with _lock:
        if level not in _loaded:
            path = library_path(level)
            if path is not None:
                lib = ctypes.cdll.LoadLibrary(str(path))
                for kernel in TARGETS:
                    jax.ffi.register_ffi_target(target_name(kernel, level),
                                                jax.ffi.pycapsule(getattr(lib, f"jaxinfer_{kernel}")),
                                                platform="cpu")
            _loaded[level] = path is not None
            if path is not None:
                logger.info("native CPU kernels: ISA level %s (%s)", level, path.name)
        return _loaded[level]
