"""Tests for models.families and the family branches of the one forward: Qwen3 (per-head q/k RMSNorm), Gemma
(GeGLU, 1 + w RMSNorm, sqrt(D)-scaled embeddings, tied head) and Gemma 2 (Gemma plus attention / final-logit soft
caps, alternating sliding-window / global layers, post-norms, `query_pre_attn_scalar`).

Oracles:
  * tests/data/tiny_qwen3, tiny_gemma and tiny_gemma2: golden logits and greedy tokens from HF transformers 5.25
    (PyTorch, f32; scripts/make_golden.py), independent of this code base. The logits of one prefill and the
    greedy decode of the first two are also checked in tests/jaxinfer/loading/test_hf.py (same fixtures as the
    other dense families); here they go through chunked prefill and the engine (with a prefix-cache hit), and tp=2 is in
    tests/sharding/multi_device_family_checks.py. tiny_gemma2's golden also records that each Gemma 2 feature
    moves the logits (by 0.46 to 14), so a path that dropped one would fail the 1e-4 comparisons.
  * `gate_activation`, `rms_norm`'s offset and the final-logit soft cap: NumPy formulas written here from their
    definitions; Gemma 2's default layer types: `Gemma2Config`'s rule (layers 0, 2, ... sliding).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine.runner import ModelRunner
from jaxinfer.loading.codec import config_from_dict, config_to_dict
from jaxinfer.loading.hf import load_hf_weights
from jaxinfer.scheduler.chunk import ScheduledChunk
from models import quant
from models.config import Activation, ModelConfig
from models.layer import gate_activation, rms_norm, row_sum, soft_cap_logits
from models.llama import check_weights

DATA = Path(__file__).resolve().parents[1] / "data"
QWEN3, GEMMA, GEMMA2 = DATA / "tiny_qwen3", DATA / "tiny_gemma", DATA / "tiny_gemma2"
PAGE_SIZE, NUM_PAGES = 16, 8
TOL = dict(rtol=1e-4, atol=1e-4)


def _golden(folder: Path) -> dict:
    return json.loads((folder / "golden.json").read_text())


def _hf(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.fixture(scope="module", params=["tiny_qwen3", "tiny_gemma", "tiny_gemma2"])
def family(request):
    folder = DATA / request.param
    cfg, weights = load_hf_weights(folder)
    check_weights(weights, cfg)
    return folder, cfg, weights


def _runner(cfg: ModelConfig, weights) -> ModelRunner:
    return ModelRunner(cfg, weights, num_pages=NUM_PAGES, page_size=PAGE_SIZE, kv_dtype=jnp.float32)


def _prefill_logits(runner: ModelRunner, ids: list[int]) -> np.ndarray:
    return runner.compute_logits([ScheduledChunk(ids, 0, [3, 1, 2])])


# --- config --------------------------------------------------------------------------------------------------


def test_family_config_fields(family):
    folder, cfg, weights = family
    hf = _hf(folder)
    L, H = cfg.num_layers, cfg.head_dim
    assert H == hf["head_dim"] == 32 != cfg.hidden_size // cfg.num_heads
    assert cfg.tie_word_embeddings and weights.lm_head is None
    assert not cfg.attention_bias and weights.layers.bq is None
    if folder == QWEN3:
        assert cfg.qk_norm and (cfg.mlp_activation, cfg.norm_weight_offset, cfg.embed_scale) == (
            Activation.SILU, 0.0, 1.0)
        assert weights.layers.q_norm.shape == weights.layers.k_norm.shape == (L, H)
    else:
        assert not cfg.qk_norm and weights.layers.q_norm is None
        assert cfg.mlp_activation is Activation.GELU_TANH and cfg.norm_weight_offset == 1.0
        assert cfg.embed_scale == math.sqrt(hf["hidden_size"])
    if folder == GEMMA:
        assert cfg.num_kv_heads == 1  # MQA
    gemma2 = folder == GEMMA2
    assert cfg.post_norms == gemma2 and (weights.layers.post_attn_norm is not None) == gemma2
    if gemma2:
        assert weights.layers.post_attn_norm.shape == weights.layers.post_mlp_norm.shape == (L, cfg.hidden_size)
        assert cfg.sliding_window is None and cfg.layer_sliding_windows == (8, None, 8, None)
        assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (5.0, 3.0)
        assert cfg.attention_scale == 24**-0.5 != H**-0.5
    else:
        assert cfg.layer_sliding_windows is cfg.attn_logit_softcapping is cfg.final_logit_softcapping is None
        assert cfg.attention_scale == H**-0.5


def test_family_config_round_trips_through_the_checkpoint_codec(family):
    _, cfg, _ = family
    assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))) == cfg


def test_hf_family_defaults_for_omitted_keys():
    base = {k: v for k, v in _hf(GEMMA).items() if k not in ("head_dim", "hidden_act", "tie_word_embeddings")}
    gemma = ModelConfig.from_hf_config(base)
    assert (gemma.head_dim, gemma.mlp_activation, gemma.tie_word_embeddings) == (256, Activation.GELU_TANH, True)
    # the official Gemma releases say "gelu" and mean the tanh approximation (as transformers reads them)
    legacy = ModelConfig.from_hf_config({**base, "hidden_act": "gelu"})
    assert legacy.mlp_activation is Activation.GELU_TANH
    v4 = ModelConfig.from_hf_config({**base, "hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh"})
    assert v4.mlp_activation is Activation.GELU_TANH
    qwen3 = {k: v for k, v in _hf(QWEN3).items() if k not in ("head_dim", "attention_bias", "tie_word_embeddings")}
    cfg = ModelConfig.from_hf_config(qwen3)
    assert (cfg.head_dim, cfg.attention_bias, cfg.tie_word_embeddings, cfg.qk_norm) == (128, False, False, True)
    assert ModelConfig.from_hf_config({**qwen3, "attention_bias": True}).attention_bias


@pytest.mark.parametrize("change, match", [
    ({"hidden_act": "relu"}, "hidden_act='relu'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
])
def test_hf_gemma_config_errors(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config({**_hf(GEMMA), **change})


def test_exact_gelu_is_refused_outside_gemma():
    with pytest.raises(ValueError, match="hidden_act='gelu'.*qwen3"):
        ModelConfig.from_hf_config({**_hf(QWEN3), "hidden_act": "gelu"})


def test_moe_with_geglu_and_new_families_in_gguf_are_refused():
    with pytest.raises(ValueError, match="mlp_activation=Activation.GELU_TANH is not supported with num_experts=8"):
        ModelConfig(architecture="mixtral", vocab_size=32, hidden_size=16, intermediate_size=8, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=8, num_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=8, mlp_activation=Activation.GELU_TANH)
    with pytest.raises(ValueError, match="general.architecture='qwen2moe'"):  # shared experts: not read from GGUF
        ModelConfig.from_gguf_metadata({"general.architecture": "qwen2moe"})


def test_unknown_model_type_is_named():
    with pytest.raises(ValueError, match="model_type='gemma3'"):
        ModelConfig.from_hf_config({**_hf(GEMMA), "model_type": "gemma3"})


def test_gemma2_defaults_for_omitted_keys():
    omitted = ("layer_types", "sliding_window", "attn_logit_softcapping", "final_logit_softcapping",
               "query_pre_attn_scalar", "hidden_activation", "tie_word_embeddings", "head_dim")
    base = {k: v for k, v in _hf(GEMMA2).items() if k not in omitted}
    cfg = ModelConfig.from_hf_config({**base, "num_hidden_layers": 5, "hidden_act": "relu"})  # Gemma2MLP ignores
    assert cfg.layer_sliding_windows == (4096, None, 4096, None, 4096)  # Gemma2Config: even layers slide
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.query_pre_attn_scalar) == (50.0, 30.0, 256)
    assert (cfg.mlp_activation, cfg.tie_word_embeddings, cfg.head_dim) == (Activation.GELU_TANH, True, 256)
    off = ModelConfig.from_hf_config({**_hf(GEMMA2), "attn_logit_softcapping": None, "sliding_window": None,
                                      "final_logit_softcapping": None})
    assert off.layer_sliding_windows == (None,) * 4 and off.uniform_windows
    assert off.attn_logit_softcapping is off.final_logit_softcapping is None
    # config.json's layer_types win over the default alternation
    flipped = ModelConfig.from_hf_config({**_hf(GEMMA2), "layer_types": ["full_attention"] * 3 + ["sliding_attention"]})
    assert flipped.layer_sliding_windows == (None, None, None, 8)


@pytest.mark.parametrize("change, match", [
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types=.*num_hidden_layers=4"),
    ({"layer_types": ["local"] * 4}, "layer_types=.*'sliding_attention' or 'full_attention'"),
    ({"hidden_activation": "relu"}, "hidden_activation='relu'"),
    ({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping=-1.0"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar=0"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
])
def test_hf_gemma2_config_errors(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config({**_hf(GEMMA2), **change})


def test_layer_sliding_windows_must_fit_the_layers():
    cfg = ModelConfig.from_hf_config(_hf(GEMMA2))
    for windows in ((8, None), (8, 0, 8, None), [8, None, 8, None]):
        with pytest.raises(ValueError, match="layer_sliding_windows"):
            dataclasses.replace(cfg, layer_sliding_windows=windows)
    assert [cfg.layer_window(i) for i in range(4)] == [8, None, 8, None] and not cfg.uniform_windows


def test_self_draft_of_gemma2_keeps_its_first_layers_windows():
    from jaxinfer.engine.spec_decode.draft import self_draft

    cfg, weights = load_hf_weights(GEMMA2)
    draft = self_draft(cfg, weights, 3).cfg
    assert (draft.num_layers, draft.layer_sliding_windows) == (3, (8, None, 8))


# --- the layer math against NumPy ------------------------------------------------------------------------------


def test_gate_activations_match_their_formulas():
    x = np.linspace(-6, 6, 97, dtype=np.float32)
    gelu_tanh = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(np.asarray(gate_activation(jnp.asarray(x), Activation.GELU_TANH)), gelu_tanh,
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(gate_activation(jnp.asarray(x), Activation.SILU)), x / (1 + np.exp(-x)),
                               rtol=1e-6, atol=1e-6)


def test_final_logit_soft_cap_matches_its_formula():
    logits = np.linspace(-40, 40, 81, dtype=np.float32)[None]
    cfg = ModelConfig.from_hf_config(_hf(GEMMA2))
    np.testing.assert_allclose(np.asarray(soft_cap_logits(jnp.asarray(logits), cfg)), 3.0 * np.tanh(logits / 3.0),
                               rtol=1e-6, atol=1e-6)
    no_cap = dataclasses.replace(cfg, final_logit_softcapping=None)
    np.testing.assert_array_equal(np.asarray(soft_cap_logits(jnp.asarray(logits), no_cap)), logits)


def test_rms_norm_offset_scales_by_one_plus_w():
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(3, 8)).astype(np.float32), rng.normal(size=8).astype(np.float32)
    normed = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(np.asarray(rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6, 1.0)), normed * (1 + w),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6)), normed * w,
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("width", [576, 64, 7, 1])
def test_rms_norm_gives_a_row_the_same_bits_in_any_batch(width):
    """A token's norm does not depend on how many other rows share the call (XLA:CPU's own row reductions change
    their order from 8 rows, which flipped bf16 greedy tokens beside 7 other requests), and the fixed-order sum is
    the float64 sum to f32 rounding."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, width)).astype(np.float32) * 3
    w = rng.normal(size=width).astype(np.float32)
    norm = jax.jit(lambda x: rms_norm(x, jnp.asarray(w), 1e-6))
    for rows in (2, 3, 5, 8, 16, 64):
        together = np.asarray(norm(jnp.asarray(x[:rows])))
        for r in range(rows):
            alone = np.asarray(norm(jnp.asarray(x[[r, r]])))[0]
            np.testing.assert_array_equal(together[r], alone, err_msg=f"row {r} of {rows}")
    sums = np.asarray(row_sum(jnp.asarray(x)))[:, 0]
    np.testing.assert_allclose(sums, x.astype(np.float64).sum(-1), rtol=2e-6, atol=2e-6 * np.abs(x).sum(-1).max())


# --- the HF goldens through chunked prefill, the engine, and norm folding -------------------------------------


def test_chunked_prefill_over_cached_pages_matches_transformers(family):
    folder, cfg, weights = family
    golden = _golden(folder)
    ids, want = golden["token_ids"], np.array(golden["logits"], np.float32)
    runner = _runner(cfg, weights)
    got = [runner.compute_logits([ScheduledChunk(ids[a:b], a, [3, 1, 2])]) for a, b in ((0, 7), (7, 23), (23, 40))]
    np.testing.assert_allclose(np.concatenate(got), want, **TOL)


def test_gemma2_scanned_layers_and_the_kernels_match_transformers():
    # Layers with differing windows cannot share one scanned body: scan_layers falls back to the unrolled loop.
    # The Pallas kernels (TPU kernels in interpret mode on CPU) apply the soft cap and per-layer windows too: a
    # fresh prompt through flash attention, a continuation with cached context through the paged kernel.
    from pallas_kernels.dispatch import select_attention

    cfg, weights = load_hf_weights(GEMMA2)
    golden = _golden(GEMMA2)
    ids, want = golden["token_ids"], np.array(golden["logits"], np.float32)
    scanned = ModelRunner(cfg, weights, num_pages=NUM_PAGES, page_size=PAGE_SIZE, kv_dtype=jnp.float32,
                          scan_layers=True)
    np.testing.assert_allclose(_prefill_logits(scanned, ids), want, **TOL)
    kernels = ModelRunner(cfg, weights, num_pages=NUM_PAGES, page_size=PAGE_SIZE, kv_dtype=jnp.float32,
                          attention=select_attention("pallas", "cpu"))
    np.testing.assert_allclose(kernels.compute_logits([ScheduledChunk(ids[:17], 0, [3, 1, 2])]), want[:17], **TOL)
    np.testing.assert_allclose(kernels.compute_logits([ScheduledChunk(ids[17:], 17, [3, 1, 2])]), want[17:], **TOL)


def test_folding_norm_gains_keeps_the_golden_logits(family):
    # Activation quantization folds the norm gains into the projections; Gemma's gain is 1 + w, not w.
    folder, cfg, weights = family
    golden = _golden(folder)
    folded = weights.replace(layers=quant.fold_norm_scales(weights.layers, cfg.norm_weight_offset))
    assert np.all(np.asarray(folded.layers.attn_norm) + cfg.norm_weight_offset == 1)
    np.testing.assert_allclose(_prefill_logits(_runner(cfg, folded), golden["token_ids"]),
                               np.array(golden["logits"], np.float32), **TOL)


def test_int8_activation_quantization_keeps_gemma_close():
    cfg, weights = load_hf_weights(GEMMA)
    golden = _golden(GEMMA)
    q = quant.quantize_weights(weights, cfg, quant.QuantizationConfig("int8", quantize_activations=True),
                               jnp.float32)
    want = np.array(golden["logits"], np.float32)
    got = _prefill_logits(_runner(cfg, q), golden["token_ids"])
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


def test_engine_greedy_with_chunked_prefill_and_prefix_cache_matches_transformers(family, with_tokenizer, tmp_path):
    from jaxinfer.llm import LLM
    from jaxinfer.sampling_params import SamplingParams

    folder, _, _ = family
    golden = _golden(folder)
    prompt, want = golden["token_ids"], golden["greedy_token_ids"]
    # 16-token steps: the 40-token prompt is prefilled in 3 chunks over paged KV, beside a second request's decode
    llm = LLM(with_tokenizer(folder), dtype="float32", warmup=False, max_num_seqs=4,
              max_num_batched_tokens=16, kv_cache_memory_bytes=8 << 20, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=len(want), ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt[:5]}],
                        [params, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)], use_tqdm=False)
    first = outs[0].outputs[0]
    assert outs[0].num_cached_tokens == 0 and first.token_ids == want
    # the same prompt again: its 2 full 16-token pages come from the prefix cache, positions 32-39 are computed
    # over them; each step's log-probability equals the uncached run's (the first also HF's last-position logits)
    again = llm.generate([{"prompt_token_ids": prompt}], [params], use_tqdm=False)[0]
    assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == want
    logits = np.array(golden["logits"][-1], np.float64)
    hf_first = logits[want[0]] - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    for run in (first, again.outputs[0]):
        np.testing.assert_allclose([step[t].logprob for step, t in zip(run.logprobs, want)],
                                   [hf_first] + [step[t].logprob for step, t in zip(first.logprobs[1:], want[1:])],
                                   rtol=1e-4, atol=1e-4)


def test_orbax_checkpoint_keeps_the_family(family, with_tokenizer, tmp_path):
    from jaxinfer.loading import convert, load_model

    folder, cfg, weights = family
    ckpt = convert(with_tokenizer(folder), tmp_path / "ckpt")
    got_cfg, got_weights, _ = load_model(ckpt, np.float32)
    assert dataclasses.replace(got_cfg, name="") == dataclasses.replace(cfg, name="")
    if cfg.qk_norm:
        np.testing.assert_array_equal(got_weights.layers.q_norm, weights.layers.q_norm)
    golden = _golden(folder)
    np.testing.assert_allclose(_prefill_logits(_runner(got_cfg, got_weights), golden["token_ids"]),
                               np.array(golden["logits"], np.float32), **TOL)
