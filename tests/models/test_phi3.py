"""Phi-3 (`model_type` phi3): fused q/k/v and gate/up tensors split at load, LongRoPE with its attention factor,
partial rotary (0.75) and a sliding window, each against HF transformers.

Oracles:
  * tests/data/tiny_phi3: golden logits (a 40-token forward, longer than original_max_position_embeddings 32, so
    HF runs the long factors; and a 24-token forward, which HF runs with the short ones) and 32 greedy tokens from
    HF transformers 5.25 (PyTorch, f32; scripts/make_golden.py), independent of this code base. tp=2 is in
    tests/sharding/multi_device_family_checks.py.
  * the fused tensors: sliced here by the rule of transformers' Phi3Attention / Phi3MLP (q rows, then k, then v;
    gate rows, then up), read straight from the safetensors file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxinfer.engine.runner import ModelRunner
from jaxinfer.loading.hf import load_hf_weights
from jaxinfer.scheduler.chunk import ScheduledChunk
from models.config import ModelConfig, RopeType
from models.llama import check_weights
from models.rope import longrope_uses_long_factors

DATA = Path(__file__).resolve().parents[1] / "data"
PHI3 = DATA / "tiny_phi3"
PAGE_SIZE, NUM_PAGES = 16, 8
TOL = dict(rtol=1e-4, atol=1e-4)
GOLDEN = json.loads((PHI3 / "golden.json").read_text())
HF = json.loads((PHI3 / "config.json").read_text())


@pytest.fixture(scope="module")
def phi3():
    cfg, weights = load_hf_weights(PHI3)
    check_weights(weights, cfg)
    return cfg, weights


def _runner(cfg: ModelConfig, weights) -> ModelRunner:
    return ModelRunner(cfg, weights, num_pages=NUM_PAGES, page_size=PAGE_SIZE, kv_dtype=jnp.float32)


def _prefill(cfg: ModelConfig, weights, ids: list[int]) -> np.ndarray:
    return _runner(cfg, weights).compute_logits([ScheduledChunk(ids, 0, [3, 1, 2])])


def test_phi3_config_fields(phi3):
    cfg, weights = phi3
    rope = HF["rope_parameters"]
    assert (cfg.architecture, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads) == ("phi3", 16, 4, 2)
    assert cfg.partial_rotary_factor == 0.75 and cfg.rotary_dim == 12
    assert cfg.sliding_window == HF["sliding_window"] == 24  # Phi-3 masks by sliding_window, no use_sliding_window
    s = cfg.rope_scaling
    assert s.rope_type is RopeType.LONGROPE and s.original_max_position_embeddings == 32
    assert (list(s.short_factor), list(s.long_factor)) == (rope["short_factor"], rope["long_factor"])
    # LongRoPE's default attention factor, from the context ratio 256 / 32 (Phi-3's rule, written out)
    assert s.attention_factor == pytest.approx(math.sqrt(1 + math.log(256 / 32) / math.log(32)), rel=1e-12)
    assert longrope_uses_long_factors(cfg)
    assert not cfg.tie_word_embeddings and weights.lm_head is not None


def test_fused_tensors_are_split_as_transformers_slices_them(phi3):
    cfg, weights = phi3
    tensors = load_file(PHI3 / "model.safetensors")
    N, K, H, D, F = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    for i in range(cfg.num_layers):
        qkv = tensors[f"model.layers.{i}.self_attn.qkv_proj.weight"]  # [(N + 2K) H, D]
        gate_up = tensors[f"model.layers.{i}.mlp.gate_up_proj.weight"]  # [2F, D]
        q, k, v = qkv[:N * H], qkv[N * H:(N + K) * H], qkv[(N + K) * H:]
        for ours, rows, heads in ((weights.layers.wq, q, N), (weights.layers.wk, k, K), (weights.layers.wv, v, K)):
            # ours[d, n, h] multiplies input channel d into output row n * H + h
            np.testing.assert_array_equal(np.asarray(ours[i]).reshape(D, heads * H).T, rows)
        np.testing.assert_array_equal(np.asarray(weights.layers.w_gate[i]).T, gate_up[:F])
        np.testing.assert_array_equal(np.asarray(weights.layers.w_up[i]).T, gate_up[F:])


@pytest.mark.parametrize("drop, match", [
    ("model.layers.1.mlp.gate_up_proj.weight", "missing tensor 'model.layers.1.mlp.gate_up_proj.weight'"),
    ("model.layers.0.self_attn.qkv_proj.weight", r"'model.layers.0.self_attn.qkv_proj.weight' has shape \(96, 64\)"),
])
def test_missing_or_misshapen_fused_tensor_is_named(drop, match, tmp_path):
    tensors = load_file(PHI3 / "model.safetensors")
    if "qkv" in drop:
        tensors[drop] = tensors[drop][:96]  # the v rows missing
    else:
        del tensors[drop]
    shutil.copy(PHI3 / "config.json", tmp_path / "config.json")
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=match):
        load_hf_weights(tmp_path)


def test_chunked_prefill_across_pages_and_the_window_matches_transformers(phi3):
    cfg, weights = phi3
    ids, want = GOLDEN["token_ids"], np.array(GOLDEN["logits"], np.float32)
    runner = _runner(cfg, weights)
    # chunks end inside page 1, inside the first window, and at the end of page 2 + 8
    got = [runner.compute_logits([ScheduledChunk(ids[a:b], a, [3, 1, 2])]) for a, b in ((0, 7), (7, 27), (27, 40))]
    np.testing.assert_allclose(np.concatenate(got), want, **TOL)


def test_short_factors_match_transformers_within_the_original_context(phi3):
    # A model whose context is original_max_position_embeddings runs the short factors (Phi-3 4k): HF runs them on
    # every sequence of up to 32 tokens, with the same attention factor (it depends on the config, not the length).
    cfg, weights = phi3
    four_k = dataclasses.replace(cfg, max_position_embeddings=32)
    assert not longrope_uses_long_factors(four_k)
    got = _prefill(four_k, weights, GOLDEN["short_token_ids"])
    np.testing.assert_allclose(got, np.array(GOLDEN["short_logits"], np.float32), **TOL)


def test_the_attention_factor_and_the_long_factors_each_matter(phi3):
    # Controls: without either, the logits leave the golden (so the equality above can fail).
    cfg, weights = phi3
    want = np.array(GOLDEN["logits"], np.float32)
    for change in (dict(attention_factor=1.0), dict(long_factor=cfg.rope_scaling.short_factor)):
        other = dataclasses.replace(cfg, rope_scaling=dataclasses.replace(cfg.rope_scaling, **change))
        assert np.abs(_prefill(other, weights, GOLDEN["token_ids"]) - want).max() > 1e-2, change


def test_engine_greedy_with_chunked_prefill_and_prefix_cache_matches_transformers(with_tokenizer, tmp_path):
    from jaxinfer.llm import LLM
    from jaxinfer.sampling_params import SamplingParams

    folder = with_tokenizer(PHI3)
    # 16-token steps: the 40-token prompt is prefilled in 3 chunks over paged KV, beside a second request's decode
    llm = LLM(folder, dtype="float32", warmup=False, max_num_seqs=4, max_num_batched_tokens=16,
              kv_cache_memory_bytes=8 << 20)
    ids = GOLDEN["token_ids"]
    params = SamplingParams(temperature=0, max_tokens=len(GOLDEN["greedy_token_ids"]), ignore_eos=True)
    assert len(GOLDEN["greedy_token_ids"]) == 32
    outs = llm.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": ids[:5]}],
                        [params, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == GOLDEN["greedy_token_ids"]
    again = llm.generate([{"prompt_token_ids": ids}], [params], use_tqdm=False)[0]  # the prompt's full pages cached
    assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == GOLDEN["greedy_token_ids"]


def test_phi3_config_round_trips_through_the_checkpoint_codec(phi3):
    from jaxinfer.loading.codec import config_from_dict, config_to_dict

    cfg, _ = phi3
    assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))) == cfg  # factors as tuples again
