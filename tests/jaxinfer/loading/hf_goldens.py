"""Shared by tests/jaxinfer/loading/test_hf.py and test_gguf.py: the tiny HF golden folders, a runner over loaded
weights, its prefill logits, and writing an HF folder from tensors."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxinfer.engine.runner import ModelRunner
from jaxinfer.scheduler.chunk import ScheduledChunk

DATA = Path(__file__).resolve().parents[2] / "data"
LLAMA3 = DATA / "tiny_llama3"
QWEN2 = DATA / "tiny_qwen2"
MISTRAL = DATA / "tiny_mistral"  # sliding window 8 over 40 tokens
PAGE_SIZE = 16
NUM_PAGES = 8


def _golden(folder: Path) -> dict:
    return json.loads((folder / "golden.json").read_text())


def _runner(cfg, weights) -> ModelRunner:
    return ModelRunner(cfg, weights, num_pages=NUM_PAGES, page_size=PAGE_SIZE, kv_dtype=jnp.float32)


def _logits(runner: ModelRunner, token_ids: list[int], weights=None) -> np.ndarray:
    """All-position logits of one prefill; `weights` swaps in other weights of the same shapes (same compile)."""
    if weights is not None:
        runner.weights = weights
    return runner.compute_logits([ScheduledChunk(token_ids, 0, [3, 1, 2])])


@pytest.fixture(scope="module")
def llama_src():
    """tiny_llama3's HF tensors and config."""
    return load_file(LLAMA3 / "model.safetensors"), json.loads((LLAMA3 / "config.json").read_text())


def _hf_copy(dst: Path, tensors: dict[str, np.ndarray], hf_cfg: dict) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(hf_cfg))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, dst / "model.safetensors")
    return dst
