"""Shared fixtures: the real SmolLM2 model (loaded once per session) and the golden fixtures' folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"

os.environ.setdefault("JAXINFER_COMPILATION_CACHE", str(Path.home() / ".cache" / "jaxinfer" / "xla-tests"))


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
