"""Qwen3, Gemma, Gemma 2, Gemma 3 and Phi-3 at tp=2 on fake CPU devices against the HF transformers goldens
(tests/data/tiny_qwen3, tiny_gemma, tiny_gemma2, tiny_gemma3, tiny_phi3; scripts/make_golden.py): run by
`test_sharding.py` in a child process with 8 fake CPU devices.

Gemma's single KV head is replicated into two slots (`models.partition.tp_layout`); Qwen3's and Gemma 3's q/k norm
gains have no TP-split axis and stay whole on every rank.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxinfer.llm import LLM
from jaxinfer.loading import default_model_path
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler.chunk import ScheduledChunk
from jaxinfer.tokenizer import Tokenizer

DATA = Path(__file__).resolve().parents[1] / "data"
TP = 2


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    Tokenizer.from_gguf(default_model_path()).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("name", ["tiny_qwen3", "tiny_gemma", "tiny_gemma2", "tiny_gemma3", "tiny_phi3"])
def test_tp2_logits_and_greedy_tokens_match_transformers(name, tokenizer_dir, tmp_path):
    folder = tmp_path / name
    shutil.copytree(DATA / name, folder)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    golden = json.loads((DATA / name / "golden.json").read_text())
    llm = LLM(folder, dtype="float32", tensor_parallel_size=TP, warmup=False, max_num_seqs=4,
              max_num_batched_tokens=16, kv_cache_memory_bytes=8 << 20)
    w, cfg = llm.runner.weights.layers, llm.runner.cfg
    assert len(w.wq.sharding.device_set) == TP
    assert w.wq.addressable_shards[0].data.shape[2] == cfg.num_heads // TP
    assert llm.runner.kv_cache.k.addressable_shards[0].data.shape[2] == cfg.num_kv_heads // TP
    if cfg.qk_norm:
        assert w.q_norm.addressable_shards[0].data.shape == w.q_norm.shape == (cfg.num_layers, cfg.head_dim)
    ids = golden["token_ids"]
    pages = llm.page_allocator.allocate(-(-len(ids) // llm.page_size))
    logits = llm.runner.compute_logits([ScheduledChunk(ids, 0, pages)])
    llm.page_allocator.free(pages)
    np.testing.assert_allclose(logits, np.array(golden["logits"], np.float32), rtol=1e-4, atol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=len(golden["greedy_token_ids"]), ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": ids}], [params], use_tqdm=False)  # 3 prefill chunks of <= 16
    assert out[0].outputs[0].token_ids == golden["greedy_token_ids"]
