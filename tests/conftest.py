"""Shared fixtures: the real SmolLM2 model (loaded once per session) and the golden fixtures' folder; and the
persistent XLA compilation cache for every test process (`pytest_configure`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"

# The tests' own persistent compilation cache: it outlives clones on a machine (a clean CI machine starts cold and
# fills it). `$JAXINFER_COMPILATION_CACHE` set beforehand wins; an empty value turns the cache off.
TEST_COMPILATION_CACHE = Path.home() / ".cache" / "jaxinfer" / "xla-tests"
TEST_COMPILATION_CACHE_MAX_BYTES = 4 << 30  # jax evicts least recently used entries past this
# The tests' own prepared-model cache (`jaxinfer.loading.model_cache`): SmolLM2's GGUF dequantized once per machine.
TEST_MODEL_CACHE = Path.home() / ".cache" / "jaxinfer" / "models-tests"


def pytest_configure(config):
    """Turns on JAX's persistent compilation cache in this process, before any test compiles: every jitted
    function of every test (not only engines, which `jaxinfer.engine.compilation_cache.enable_compilation_cache` covers) is
    looked up there, so a rerun on the same machine compiles only what changed. The path goes into the
    environment too (`JAXINFER_COMPILATION_CACHE`, which `enable_compilation_cache` reads), so the child processes
    that tests start (CLI runs, servers, the 8-device and multi-host checks, which run this conftest again when
    they are pytest) share it."""
    # A crashed test process ends the run (its test failed, named) instead of being replaced, unless
    # --max-worker-restart says otherwise: pytest-xdist 3.8's `--dist loadfile` re-queues a crashed worker's
    # finished files as empty work and can then wait forever with every worker idle (pytest-xdist issue 1378;
    # seen here after a segfault). xdist reads the option in its own, later `pytest_configure`.
    if getattr(config.option, "maxworkerrestart", "") is None:
        config.option.maxworkerrestart = "0"
    os.environ.setdefault("JAXINFER_MODEL_CACHE", str(TEST_MODEL_CACHE))  # children inherit it too
    path = os.environ.setdefault("JAXINFER_COMPILATION_CACHE", str(TEST_COMPILATION_CACHE))
    if not path:
        return
    import jax

    from jaxinfer.engine.compilation_cache import enable_compilation_cache

    enable_compilation_cache()
    if jax.config.jax_compilation_cache_max_size < 0:
        jax.config.update("jax_compilation_cache_max_size", TEST_COMPILATION_CACHE_MAX_BYTES)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA


@pytest.fixture(scope="session")
def smollm2_golden() -> dict:
    return json.loads((DATA / "smollm2_golden.json").read_text())


@pytest.fixture(scope="session")
def smollm2_llm():
    """SmolLM2-135M-Instruct in float32 with a small KV budget (enough for a few 512-token requests)."""
    from jaxinfer import LLM

    return LLM(dtype="float32", kv_cache_memory_bytes=96 << 20, max_num_seqs=8, warmup=False)


def pytest_collection_modifyitems(config, items):
    """Tests marked `accelerator` need a GPU or TPU: skipped on CPU (scripts/gpu_check.sh runs them on a GPU)."""
    if not any(item.get_closest_marker("accelerator") for item in items):
        return
    import jax

    if jax.default_backend() == "cpu":
        skip = pytest.mark.skip(reason="needs a GPU or TPU (jax.default_backend() is cpu)")
        for item in items:
            if item.get_closest_marker("accelerator"):
                item.add_marker(skip)
