"""Tests for jaxinfer.loading.hf: HF folders against HF transformers goldens, errors.

Oracle: tests/data/tiny_llama3, tiny_qwen2, tiny_mistral, tiny_qwen3 and tiny_gemma hold golden logits and greedy
tokens computed by HF transformers (PyTorch, f32; see scripts/make_golden.py), independent of this code base.
"""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine.runner import ModelRunner
from jaxinfer.scheduler.chunk import ScheduledChunk
from jaxinfer.engine.sampling import SamplingRow
from jaxinfer.loading.hf import load_hf_weights
from jaxinfer.sampling_params import SamplingParams
from tests.jaxinfer.loading.hf_goldens import (DATA, LLAMA3, MISTRAL, NUM_PAGES, PAGE_SIZE, QWEN2, _golden, _hf_copy,
                                              _logits, _runner, llama_src)

__all__ = ["llama_src"]  # a fixture, used by name


# --- (a) HF folders against the transformers goldens -----------------------------------------------------------------


@pytest.fixture(scope="module", params=["tiny_llama3", "tiny_qwen2", "tiny_mistral", "tiny_qwen3", "tiny_gemma"])
def hf_model(request):
    folder = DATA / request.param
    cfg, weights = load_hf_weights(folder)
    return folder, cfg, _runner(cfg, weights)


def test_hf_config_fields(hf_model):
    folder, cfg, _ = hf_model
    hf = json.loads((folder / "config.json").read_text())
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.num_layers) == (
        hf["model_type"], hf["vocab_size"], hf["hidden_size"], hf["num_hidden_layers"])
    assert (cfg.num_heads, cfg.num_kv_heads) == (hf["num_attention_heads"], hf["num_key_value_heads"])
    assert cfg.head_dim == hf.get("head_dim", cfg.hidden_size // cfg.num_heads)  # Qwen3 / Gemma: 32, not D / N
    assert cfg.tie_word_embeddings == hf["tie_word_embeddings"]
    if folder == LLAMA3:  # v4 keys: rope_theta + rope_scaling
        assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type.value == "llama3"
        assert cfg.rope_scaling.original_max_position_embeddings == hf["rope_scaling"]["original_max_position_embeddings"]
        assert cfg.rope_theta == hf["rope_theta"]
    else:  # v5 keys: rope_parameters
        assert cfg.rope_scaling is None and cfg.rope_theta == hf["rope_parameters"]["rope_theta"]
        assert cfg.attention_bias == (folder == QWEN2)
    # Mistral's window is attention over the last W positions, not a context cap.
    assert cfg.sliding_window == (hf["sliding_window"] if folder == MISTRAL else None)
    assert cfg.max_position_embeddings == hf["max_position_embeddings"]


def test_hf_logits_match_transformers(hf_model):
    folder, _, runner = hf_model
    golden = _golden(folder)
    expected = np.array(golden["logits"], np.float32)
    out = _logits(runner, golden["token_ids"])
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


def test_sliding_window_through_the_kernels_matches_transformers():
    # The Pallas kernels (TPU kernels in interpret mode on CPU) apply Mistral's window too: a fresh prompt goes
    # through flash attention, a continuation in two chunks through the paged kernel with cached context.
    from pallas_kernels.dispatch import select_attention

    cfg, weights = load_hf_weights(MISTRAL)
    runner = ModelRunner(cfg, weights, num_pages=NUM_PAGES, page_size=PAGE_SIZE, kv_dtype=jnp.float32,
                         attention=select_attention("pallas", "cpu"))
    golden = _golden(MISTRAL)
    ids, expected = golden["token_ids"], np.array(golden["logits"], np.float32)
    np.testing.assert_allclose(_logits(runner, ids), expected, rtol=1e-4, atol=1e-4)
    runner.compute_logits([ScheduledChunk(ids[:17], 0, [3, 1, 2])])
    rest = runner.compute_logits([ScheduledChunk(ids[17:], 17, [3, 1, 2])])
    np.testing.assert_allclose(rest, expected[17:], rtol=1e-4, atol=1e-4)


def test_hf_greedy_continuation_matches_transformers(hf_model):
    folder, _, runner = hf_model
    golden = _golden(folder)
    prompt, want = golden["token_ids"], golden["greedy_token_ids"]
    greedy = SamplingParams(temperature=0.0)
    pages = [4, 6, 5, 7, 2][: -(-(len(prompt) + len(want)) // PAGE_SIZE)]  # 40 + 8 (or 32) tokens: 3 (5) pages
    got = []
    chunk = ScheduledChunk(prompt, 0, pages)
    for step in range(len(want)):
        result = runner.execute([chunk], [SamplingRow(greedy, 0, step=step)])
        got.append(int(result.token_ids[0]))
        chunk = ScheduledChunk([got[-1]], len(prompt) + step, pages)
    assert got == want


# --- (c) errors --------------------------------------------------------------------------------------------------------


def test_hf_unknown_model_type(tmp_path):
    hf_cfg = json.loads((LLAMA3 / "config.json").read_text())
    hf_cfg["model_type"] = "gpt_neox"
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    shutil.copy(LLAMA3 / "model.safetensors", tmp_path)
    with pytest.raises(ValueError, match="gpt_neox"):
        load_hf_weights(tmp_path)


def test_hf_missing_tensor(llama_src, tmp_path):
    tensors, hf_cfg = llama_src
    name = "model.layers.1.mlp.up_proj.weight"
    _hf_copy(tmp_path, {k: v for k, v in tensors.items() if k != name}, hf_cfg)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_hf_weights(tmp_path)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.o_proj.weight",
                                  "model.layers.0.mlp.down_proj.weight"])
def test_hf_tensor_with_wrong_shape(llama_src, tmp_path, name):
    tensors, hf_cfg = llama_src
    tensors = dict(tensors)
    tensors[name] = np.ascontiguousarray(tensors[name].T)
    if tensors[name].shape == llama_src[0][name].shape:  # square: transposing is not a shape error
        tensors[name] = tensors[name][:-1]
    _hf_copy(tmp_path, tensors, hf_cfg)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_hf_weights(tmp_path)


def test_hf_missing_shard(tmp_path):
    shutil.copytree(QWEN2, tmp_path / "q", ignore=shutil.ignore_patterns("model-00002-of-00003.safetensors"))
    with pytest.raises(ValueError, match="model-00002-of-00003"):
        load_hf_weights(tmp_path / "q")
