"""JAX's persistent compilation cache, the engine's and the tests' one switch, and its hit / miss counters.

Every compiled step shape is written to the cache (no minimum compile time), so a restart with the same model
config, dtype, mesh and jax version compiles nothing: it loads each shape (tens of milliseconds) after tracing and
lowering it (a few hundred milliseconds for a model step). The cache key is jax's: the lowered module (shapes,
dtypes, shardings, the model config as traced), the devices, the compile options and the jax / jaxlib versions.
Weights are arguments of the jitted step, not constants, so other weights of the same config reuse the entries.

This module imports only the standard library at import time (jax when the cache is turned on), so that the command
line can say where the cache is before jax loads, and processes with a bare jax (the kernel tests under the oldest
supported jax, `scripts/ci_kernels_min_jax.sh`) can turn the cache on too.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

from jaxinfer.cache_dirs import COMPILATION_CACHE_VARIABLE as CACHE_VARIABLE  # noqa: F401 - this cache's variable
from jaxinfer.cache_dirs import compilation_cache_dir, folder_problem

MAX_CACHE_BYTES = 8 << 30  # least recently used entries go beyond it
_HIT, _MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"  # jax.monitoring events

_lock = threading.Lock()
_counts = {_HIT: 0, _MISS: 0}
_listening = False


def cache_dir(configured: str | os.PathLike | None = None) -> Path | None:
    """The folder the cache uses (or would use): `jaxinfer.cache_dirs.compilation_cache_dir`. A folder the user
    already gave jax (`jax_compilation_cache_dir`) wins once jax is loaded."""
    return compilation_cache_dir(configured)


def _count(event: str, **_) -> None:
    if event in _counts:
        with _lock:
            _counts[event] += 1


def counts() -> tuple[int, int]:
    """(persistent cache hits, misses written) of this process so far: shapes loaded from the cache, and shapes
    compiled and written to it (jax's monitoring events; 0, 0 before `enable_compilation_cache`)."""
    with _lock:
        return _counts[_HIT], _counts[_MISS]


def enable_compilation_cache(configured: str | os.PathLike | None = None) -> Path | None:
    """Turns on JAX's persistent compilation cache in `cache_dir(configured)`, so that restarts skip XLA compiles;
    returns the folder in use (None: off).

    A cache folder already set in this process (by the user through `jax_compilation_cache_dir`, or by an earlier
    engine) wins: jax opens its cache once per process, so a different folder asked later is logged and ignored.
    Every compile is stored, however short (`jax_persistent_cache_min_compile_time_secs` = 0); with `filelock`
    installed the cache is bounded (`MAX_CACHE_BYTES`) and locked across processes. A folder from
    `$JAXINFER_COMPILATION_CACHE` or the default that cannot be used (a file, not writable) is logged and the cache
    stays off; a `configured` one was checked by `EngineConfig` (a `ValueError`).
    """
    import jax
    from jax import monitoring

    global _listening
    with _lock:
        if not _listening:
            monitoring.register_event_listener(_count)
            _listening = True
    current = jax.config.jax_compilation_cache_dir
    wanted = cache_dir(configured)
    if current:
        if configured is not None and (wanted is None or Path(current) != wanted):
            logger.warning("compilation cache: this process already uses %s; compilation_cache_dir=%r is ignored "
                           "(jax opens one cache per process)", current, os.fspath(configured))
        return Path(current)
    problem = None if wanted is None else folder_problem(wanted)
    if problem is not None:
        logger.warning("compilation cache: %s %s; compiling without the persistent cache (set %s or "
                       "--compilation-cache-dir to a writable folder, or '' to turn it off)", wanted, problem,
                       CACHE_VARIABLE)
        return None
    if wanted is not None:
        jax.config.update("jax_compilation_cache_dir", str(wanted))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        if importlib.util.find_spec("filelock") is not None:
            # A bounded cache reads and writes its entries under a file lock: unbounded, jax writes an entry in
            # place while another process (a test worker, a replica, a second server) may read it half written,
            # which crashed a deserialization (a segfault) when two processes compiled one step at once.
            jax.config.update("jax_compilation_cache_max_size", MAX_CACHE_BYTES)
    return wanted
