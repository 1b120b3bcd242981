"""JAX's persistent compilation cache, the engine's and the tests' one switch.

This module imports only jax and the standard library, so that processes with a bare jax (the kernel tests under the
oldest supported jax, `scripts/ci_kernels_min_jax.sh`) can turn the cache on too.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

CACHE_VARIABLE = "JAXINFER_COMPILATION_CACHE"  # the cache folder; an empty value turns the cache off
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "jaxinfer" / "xla"


def enable_compilation_cache() -> None:
    """Turns on JAX's persistent compilation cache, so that restarts skip XLA compiles.

    The folder is `$JAXINFER_COMPILATION_CACHE` (empty: no cache), else `~/.cache/jaxinfer/xla`. A cache folder the
    user already gave jax (`jax_compilation_cache_dir`) wins and is left alone. Compiles shorter than 0.5 s are not
    stored.
    """
    if jax.config.jax_compilation_cache_dir:
        return
    path = os.environ.get(CACHE_VARIABLE, str(DEFAULT_CACHE_DIR))
    if path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
