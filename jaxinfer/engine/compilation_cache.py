"""JAX's persistent compilation cache, the engine's and the tests' one switch.

This module imports only the standard library at import time (jax when the cache is turned on), so that the command
line can say where the cache is before jax loads, and processes with a bare jax (the kernel tests under the oldest
supported jax, `scripts/ci_kernels_min_jax.sh`) can turn the cache on too.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_VARIABLE = "JAXINFER_COMPILATION_CACHE"  # the cache folder; an empty value turns the cache off
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "jaxinfer" / "xla"


def cache_dir() -> Path | None:
    """The folder the cache uses (or would use): `$JAXINFER_COMPILATION_CACHE`, else `~/.cache/jaxinfer/xla`; None
    when the variable is set to the empty string (cache off). A folder the user already gave jax
    (`jax_compilation_cache_dir`) wins once jax is loaded."""
    path = os.environ.get(CACHE_VARIABLE, str(DEFAULT_CACHE_DIR))
    return Path(path) if path else None


def enable_compilation_cache() -> None:
    """Turns on JAX's persistent compilation cache, so that restarts skip XLA compiles.

    The folder is `cache_dir()`. A cache folder the user already gave jax (`jax_compilation_cache_dir`) wins and is
    left alone. Compiles shorter than 0.5 s are not stored.
    """
    import jax

    if jax.config.jax_compilation_cache_dir:
        return
    path = cache_dir()
    if path is not None:
        jax.config.update("jax_compilation_cache_dir", str(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
