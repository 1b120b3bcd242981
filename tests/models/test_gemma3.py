"""Tests for Gemma 3's text model (`gemma3_text`): its config reading in models.families, and the family branches of
the one forward (Gemma-style q / k norms, 5 local : 1 global layers, a RoPE base of their own on the local layers
and scaling on the global ones only, post-norms, `query_pre_attn_scalar`).

Oracles:
  * tests/data/tiny_gemma3: golden logits and 32 greedy tokens from HF transformers 5.25 (`Gemma3ForCausalLM`,
    PyTorch, f32; scripts/make_golden.py), independent of this code base. Its golden also records that each
    Gemma 3 feature moves transformers' logits (by 0.52 to 5.6), so a path that dropped one fails the 1e-4
    comparisons; `test_each_feature_is_needed_to_match` shows the same on our side.
  * RoPE inverse frequencies: the RoFormer formula in NumPy; default layer types: `Gemma3TextConfig`'s rule (every
    `sliding_window_pattern`-th layer global); config defaults: `Gemma3TextConfig`'s class defaults.
  * tp=2: tests/sharding/multi_device_family_checks.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine.runner import ModelRunner
from jaxinfer.loading.codec import config_from_dict, config_to_dict
from jaxinfer.loading.hf import load_hf_weights
from jaxinfer.scheduler.chunk import ScheduledChunk
from models.config import Activation, ModelConfig, RopeType
from models.llama import check_weights
from models.rope import rope_frequencies

GEMMA3 = Path(__file__).resolve().parents[1] / "data" / "tiny_gemma3"
PAGE_SIZE, NUM_PAGES = 16, 8
TOL = dict(rtol=1e-4, atol=1e-4)
WINDOWS = (20, 20, 20, 20, 20, None, 20)  # layer 5 global: (i + 1) % 6 == 0


def _hf() -> dict:
    return json.loads((GEMMA3 / "config.json").read_text())


@pytest.fixture(scope="module")
def model():
    cfg, weights = load_hf_weights(GEMMA3)
    check_weights(weights, cfg)
    return cfg, weights, json.loads((GEMMA3 / "golden.json").read_text())


def _runner(cfg: ModelConfig, weights, **kw) -> ModelRunner:
    return ModelRunner(cfg, weights, num_pages=NUM_PAGES, page_size=PAGE_SIZE, kv_dtype=jnp.float32, **kw)


def _prefill(runner: ModelRunner, ids: list[int]) -> np.ndarray:
    return runner.compute_logits([ScheduledChunk(ids, 0, [3, 1, 2])])


# --- config ------------------------------------------------------------------------------------------------------


def test_config_fields(model):
    cfg, weights, _ = model
    L, H, D = cfg.num_layers, cfg.head_dim, cfg.hidden_size
    assert (cfg.architecture, L, H, cfg.num_heads, cfg.num_kv_heads) == ("gemma3_text", 7, 16, 4, 2)
    assert cfg.qk_norm and cfg.norm_weight_offset == 1.0  # q / k norms scale by 1 + w, as every Gemma norm
    assert weights.layers.q_norm.shape == weights.layers.k_norm.shape == (L, H)
    assert cfg.post_norms and weights.layers.post_attn_norm.shape == weights.layers.post_mlp_norm.shape == (L, D)
    assert cfg.sliding_window is None and cfg.layer_sliding_windows == WINDOWS and not cfg.uniform_windows
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    assert cfg.rope_scaling.rope_type is RopeType.LINEAR and cfg.rope_scaling.factor == 8.0
    assert cfg.attn_logit_softcapping is cfg.final_logit_softcapping is None
    assert cfg.attention_scale == 24**-0.5 != H**-0.5
    assert cfg.mlp_activation is Activation.GELU_TANH and cfg.embed_scale == math.sqrt(D)
    assert cfg.tie_word_embeddings and weights.lm_head is None


def test_local_layers_rotate_by_their_own_base_and_global_ones_are_scaled(model):
    cfg = model[0]
    pairs = np.arange(0, 16, 2) / 16
    local, glob = cfg.layer_rope(20), cfg.layer_rope(None)
    assert glob is cfg and (local.rope_theta, local.rope_scaling) == (1e4, None)
    np.testing.assert_allclose(rope_frequencies(local), 1e4**-pairs, rtol=1e-6)
    np.testing.assert_allclose(rope_frequencies(glob), 1e6**-pairs / 8, rtol=1e-6)
    plain = dataclasses.replace(cfg, rope_local_theta=None)  # without it, every layer uses the global rope
    assert plain.layer_rope(20) is plain


def test_config_round_trips_through_the_checkpoint_codec(model):
    cfg = model[0]
    assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))) == cfg


def test_transformers_v4_keys_read_the_same():
    # Hub configs written by transformers 4.x: top-level rope keys, the pattern as an int, no layer_types
    v4 = {k: v for k, v in _hf().items() if k not in ("rope_parameters", "layer_types", "_sliding_window_pattern")}
    v4.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
              sliding_window_pattern=6)
    assert ModelConfig.from_hf_config(v4) == ModelConfig.from_hf_config(_hf())


def test_defaults_for_omitted_keys():
    omitted = ("rope_parameters", "layer_types", "_sliding_window_pattern", "sliding_window", "head_dim",
               "query_pre_attn_scalar", "hidden_activation", "tie_word_embeddings", "attn_logit_softcapping",
               "final_logit_softcapping")
    base = {k: v for k, v in _hf().items() if k not in omitted}
    cfg = ModelConfig.from_hf_config({**base, "num_hidden_layers": 13, "hidden_act": "relu"})  # Gemma3MLP ignores
    assert cfg.layer_sliding_windows == (4096,) * 5 + (None,) + (4096,) * 5 + (None, 4096)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == (1e6, 1e4, None)
    assert (cfg.query_pre_attn_scalar, cfg.head_dim, cfg.mlp_activation, cfg.tie_word_embeddings) == (
        256, 256, Activation.GELU_TANH, True)
    assert cfg.attn_logit_softcapping is cfg.final_logit_softcapping is None
    every_third = ModelConfig.from_hf_config({**base, "num_hidden_layers": 4, "sliding_window_pattern": 3})
    assert every_third.layer_sliding_windows == (4096, 4096, None, 4096)
    capped = ModelConfig.from_hf_config({**_hf(), "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30})
    assert (capped.attn_logit_softcapping, capped.final_logit_softcapping) == (50.0, 30.0)
    # a v5 rope_parameters without a local entry: the local base from rope_local_base_freq, else 1e4
    one_entry = {**base, "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5e5}}}
    assert (ModelConfig.from_hf_config(one_entry).rope_theta, ModelConfig.from_hf_config(one_entry).rope_local_theta
            ) == (5e5, 1e4)
    assert ModelConfig.from_hf_config({**one_entry, "rope_local_base_freq": 2e4}).rope_local_theta == 2e4


@pytest.mark.parametrize("change, match", [
    ({"layer_types": ["sliding_attention"] * 6}, "layer_types=.*num_hidden_layers=7"),
    ({"layer_types": ["chunked_attention"] * 7}, "layer_types=.*'sliding_attention' or 'full_attention'"),
    ({"sliding_window": None}, "sliding_window=null"),
    ({"sliding_window_pattern": 0, "layer_types": None}, "sliding_window_pattern=0"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "sliding_attention rope_type='linear'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "ntk-by-parts", "rope_theta": 1e6}}}, "ntk-by-parts"),
    ({"hidden_activation": "relu"}, "hidden_activation='relu'.*gemma3_text"),
    ({"query_pre_attn_scalar": -1}, "query_pre_attn_scalar=-1"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"model_type": "gemma3"}, "model_type='gemma3'"),  # the multimodal wrapper: load its text model's config
])
def test_config_errors_name_the_key(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config({**_hf(), **change})


# --- the HF golden through the forward and the engine ------------------------------------------------------------


def test_chunked_prefill_across_page_and_window_boundaries_matches_transformers(model):
    # chunks end at 7 and 23: the last chunk's queries (23..39) see keys from two pages back, its local layers a
    # 20-key window that starts inside a page; the scanned runner falls back to the unrolled loop (mixed windows)
    cfg, weights, golden = model
    ids, want = golden["token_ids"], np.array(golden["logits"], np.float32)
    runner = _runner(cfg, weights)
    got = [runner.compute_logits([ScheduledChunk(ids[a:b], a, [3, 1, 2])]) for a, b in ((0, 7), (7, 23), (23, 40))]
    np.testing.assert_allclose(np.concatenate(got), want, **TOL)
    np.testing.assert_allclose(_prefill(_runner(cfg, weights, scan_layers=True), ids), want, **TOL)


def test_each_feature_is_needed_to_match(model):
    # controls: our forward with one Gemma 3 feature switched off misses the golden by far more than the tolerance
    cfg, weights, golden = model
    want = np.array(golden["logits"], np.float32)
    for change in (dict(rope_local_theta=None), dict(rope_scaling=None), dict(layer_sliding_windows=(None,) * 7),
                   dict(query_pre_attn_scalar=None)):
        off = dataclasses.replace(cfg, **change)
        assert np.abs(_prefill(_runner(off, weights), golden["token_ids"]) - want).max() > 0.1, change


def test_first_layers_scan_with_the_local_rope(model):
    # A self-draft of the first 3 layers: all local, so one window and one RoPE base, which a lax.scan over the
    # layers (traced layer index) must give as the unrolled loop does
    cfg, weights, golden = model
    draft = cfg.first_layers(3)
    assert draft.uniform_windows and draft.layer_window(0) == 20
    scanned = _prefill(_runner(draft, weights, scan_layers=True), golden["token_ids"])
    np.testing.assert_allclose(scanned, _prefill(_runner(draft, weights), golden["token_ids"]), rtol=1e-5, atol=1e-5)
    global_rope = _prefill(_runner(dataclasses.replace(draft, rope_local_theta=None), weights), golden["token_ids"])
    assert np.abs(scanned - global_rope).max() > 0.1


def test_pallas_kernels_match_transformers(model):
    # TPU kernels in interpret mode: a fresh prompt through flash attention, a continuation with cached context
    # through the paged kernel, both with per-layer windows
    from pallas_kernels.dispatch import select_attention

    cfg, weights, golden = model
    ids, want = golden["token_ids"], np.array(golden["logits"], np.float32)
    kernels = _runner(cfg, weights, attention=select_attention("pallas", "cpu"))
    np.testing.assert_allclose(kernels.compute_logits([ScheduledChunk(ids[:25], 0, [3, 1, 2])]), want[:25], **TOL)
    np.testing.assert_allclose(kernels.compute_logits([ScheduledChunk(ids[25:], 25, [3, 1, 2])]), want[25:], **TOL)


def test_engine_greedy_with_chunked_prefill_and_prefix_cache_matches_transformers(with_tokenizer, tmp_path):
    from jaxinfer.llm import LLM
    from jaxinfer.sampling_params import SamplingParams

    golden = json.loads((GEMMA3 / "golden.json").read_text())
    prompt, want = golden["token_ids"], golden["greedy_token_ids"]
    folder = with_tokenizer(GEMMA3)
    # 16-token steps over 16-token pages: the 40-token prompt in 3 chunks beside a second request's decode, then
    # 32 decode steps to position 71, where a local layer's 20-key window covers parts of two pages of five
    llm = LLM(folder, dtype="float32", warmup=False, max_num_seqs=4, max_num_batched_tokens=16,
              kv_cache_memory_bytes=8 << 20, enable_prefix_caching=True)
    greedy = SamplingParams(temperature=0, max_tokens=len(want), ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt[:5]}],
                         [greedy, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)], use_tqdm=False)
    assert len(want) == 32 and first[0].outputs[0].token_ids == want
    again = llm.generate([{"prompt_token_ids": prompt}], [greedy], use_tqdm=False)[0]  # 2 full pages cached
    assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == want
