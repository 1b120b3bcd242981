"""Where jaxinfer's caches live, read without importing jax (the command line's `--version` says where they are).

- The XLA compilation cache (`jaxinfer.engine.compilation_cache`): `EngineConfig.compilation_cache_dir`, else
  `$JAXINFER_COMPILATION_CACHE`, else `~/.cache/jaxinfer/xla`.
- The prepared-model cache (`jaxinfer.loading.model_cache`): `$JAXINFER_MODEL_CACHE`, else
  `~/.cache/jaxinfer/models`.

An empty value turns a cache off. Clearing one is deleting its folder.
"""

from __future__ import annotations

import os
from pathlib import Path

COMPILATION_CACHE_VARIABLE = "JAXINFER_COMPILATION_CACHE"
MODEL_CACHE_VARIABLE = "JAXINFER_MODEL_CACHE"
CACHE_ROOT = Path.home() / ".cache" / "jaxinfer"


def _folder(configured: str | os.PathLike | None, variable: str, default: Path) -> Path | None:
    path = os.fspath(configured) if configured is not None else os.environ.get(variable, str(default))
    return Path(path).expanduser() if path else None


def compilation_cache_dir(configured: str | os.PathLike | None = None) -> Path | None:
    """The XLA compilation cache's folder: `configured` (`EngineConfig.compilation_cache_dir`) when given, else
    `$JAXINFER_COMPILATION_CACHE`, else `~/.cache/jaxinfer/xla`; None when the one that applies is empty (off)."""
    return _folder(configured, COMPILATION_CACHE_VARIABLE, CACHE_ROOT / "xla")


def model_cache_dir() -> Path | None:
    """The prepared-model cache's folder: `$JAXINFER_MODEL_CACHE`, else `~/.cache/jaxinfer/models`; None when the
    variable is empty (off)."""
    return _folder(None, MODEL_CACHE_VARIABLE, CACHE_ROOT / "models")


def folder_problem(path: Path) -> str | None:
    """Why `path` cannot serve as a cache folder (creating it if missing), or None when it can: "is a file", "cannot
    be created: ...", or "is not writable"."""
    if path.exists() and not path.is_dir():
        return "is a file, not a folder"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot be created ({e.strerror or e})"
    if not os.access(path, os.W_OK | os.X_OK):
        return "is not writable"
    return None
