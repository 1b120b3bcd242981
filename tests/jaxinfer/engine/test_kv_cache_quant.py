"""The engine with an int8 / fp8 KV cache (`kv_cache_dtype`): scales travel with their pages on every path.

1. Runner page operations on a tiny random model (fast): copy-on-write, clears and the host tier move the scales
   with the values, bit for bit, in the target's cache and in a draft model's own cache.
2. The real SmolLM2 (slow): a prefix-cache hit, a page brought back from the host tier and a preempted request
   give exactly the tokens of a cold run on the same quantized engine (a hit whose scales were lost or stale
   would attend over wrong keys), and greedy tokens mostly agree with the f32 cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.scheduler.chunk import ScheduledChunk
from jaxinfer.engine.sampling import SamplingRow
from jaxinfer.engine.spec_decode.draft import DraftModel
from models.llama import KVCache
from tests.jaxinfer.engine.test_prefix_caching import CORPUS, drive, held_pages, prompt, tokens, with_prefix
from tests.models.test_llama_kv_quant import CFG as TINY
from tests.models.test_llama_kv_quant import random_weights

KV_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def _host(cache: KVCache | None) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(cache)]


def test_page_ops_move_scales_with_their_pages():
    # int8 only: the page operations are the same tree maps for fp8's uint8 pages
    weights = random_weights(TINY)
    draft = DraftModel(cfg=TINY, weights=weights, shares_target_cache=False)
    runner = ModelRunner(TINY, weights, num_pages=12, page_size=8, kv_dtype=jnp.int8, draft=draft)
    assert runner.draft_cache.quantized and runner.draft_cache.k.dtype == runner.kv_cache.k.dtype
    ids = np.random.default_rng(0).integers(0, TINY.vocab_size, 20).tolist()
    greedy = SamplingRow(SamplingParams(temperature=0), seed=0)
    runner.execute([ScheduledChunk(ids, 0, [3, 5, 7])], [greedy])  # the target's and the draft's caches
    src, dst = [3, 5, 7], [8, 9, 10]
    for cache in (runner.kv_cache, runner.draft_cache):
        scale = np.asarray(cache.k_scale)[:, src].transpose(0, 2, 1, 3).reshape(2, 2, 24)  # [L, K, S]
        assert (scale[..., :20] > 0).all() and (scale[..., 20:] == 0).all()
    before, draft_before = _host(runner.kv_cache), _host(runner.draft_cache)
    assert len(before) == 4  # k, v, k_scale, v_scale

    runner.kv.copy_pages(src, dst)  # copy-on-write: values and scales, in both caches
    for old, new in zip(before + draft_before, _host(runner.kv_cache) + _host(runner.draft_cache)):
        np.testing.assert_array_equal(new[:, dst], old[:, src])
    decode = lambda pages: runner.compute_logits([ScheduledChunk([11], 20, pages)])  # noqa: E731
    np.testing.assert_array_equal(decode(dst), decode(src))  # the copies mean the same numbers

    offloaded = _host(runner.kv_cache)
    runner.kv.offload_pages(src, [0, 1, 2])  # host tier (target cache only, see ModelRunner)
    runner.kv.clear_pages(src)
    for leaf in _host(runner.kv_cache) + _host(runner.draft_cache):
        assert not leaf[:, src].any()  # cleared: values and scales
    runner.kv.load_pages([0, 1, 2], src)
    for old, new in zip(offloaded, _host(runner.kv_cache)):
        np.testing.assert_array_equal(new[:, 1:], old[:, 1:])  # every leaf back bit for bit (the null page 0
        # takes the padding writes of the power-of-two id list)
    assert not runner.kv.host_pages
    np.testing.assert_array_equal(decode(src), decode(dst))


def test_kv_cache_dtype_is_checked():
    with pytest.raises(ValueError, match="kv_cache_dtype='int4' is not supported; choose one of auto, int8, fp8"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype=None"):
        EngineConfig(kv_cache_dtype=None)
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"


# ---------------------------------------------------------------------------------------------------------------
# SmolLM2

PS = 16
PAGE_BYTES = 30 * 2 * 3 * PS * (64 + 4)  # SmolLM2 int8 / fp8: layers x (K, V) x KV heads x page x (H + scale)
NUM_PAGES, HOST_PAGES = 32, 8
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)  # wrong K/V on a hit shows at once


@pytest.fixture(scope="module", params=sorted(KV_DTYPES))
def quantized(request) -> LLM:
    llm = LLM(dtype="float32", warmup=False, max_num_seqs=4, max_model_len=128, kv_cache_dtype=request.param,
              kv_cache_memory_bytes=NUM_PAGES * PAGE_BYTES, kv_offload_bytes=HOST_PAGES * PAGE_BYTES)
    assert llm.page_allocator.num_usable_pages == NUM_PAGES  # the quantized page size (scales included) is used
    assert llm.runner.kv_cache.quantized and llm.runner.kv_cache.k.dtype == \
        (jnp.int8 if request.param == "int8" else jnp.uint8)
    return llm


@pytest.fixture(scope="module")
def corpus(quantized: LLM) -> list[int]:
    return quantized.tokenizer.encode(CORPUS)


def _cold(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of each prompt alone on an empty prefix cache (no hit)."""
    out = []
    for p in prompts:
        llm.reset_prefix_cache()
        (o,) = llm.generate([prompt(p)], [SHORT])
        assert o.num_cached_tokens == 0
        out.append(o.outputs[0].token_ids)
    llm.reset_prefix_cache()
    return out


def _prompts(corpus: list[int]) -> tuple[list[int], list[int], list[int]]:
    """a; b sharing a's first 3 pages; c of 3 whole pages (a second run hits all and copies the last)."""
    a = corpus[0:60]
    return a, with_prefix(corpus, a, 48, 60, other=400), corpus[100:148]


@pytest.mark.slow
def test_prefix_hits_give_the_cold_tokens(quantized: LLM, corpus: list[int]) -> None:
    llm, cache = quantized, quantized.engine.prefix_cache
    a, b, c = _prompts(corpus)
    cold_b, cold_c = _cold(llm, [b, c])
    cow0 = cache.stats.cow_copies
    llm.generate([prompt(a), prompt(c)], [SHORT] * 2)
    hits = llm.generate([prompt(b), prompt(c)], [SHORT] * 2)
    assert [o.num_cached_tokens for o in hits] == [48, 47] and cache.stats.cow_copies == cow0 + 1
    assert tokens(hits) == [cold_b, cold_c]


@pytest.mark.slow
@pytest.mark.parametrize("quantized", ["int8"], indirect=True)  # fp8 pages move through the same tree maps
def test_host_tier_and_preemption_give_the_cold_tokens(quantized: LLM, corpus: list[int]) -> None:
    llm = quantized
    a, b, _ = _prompts(corpus)
    t1, t2 = corpus[150:250], corpus[260:360]  # no prefix in common with a
    family = [b] + [with_prefix(corpus, b, 32, 60, other=200 + 40 * i) for i in range(2)]
    cold = _cold(llm, family)  # cold[0]: b's

    # host tier: t1 and t2 evict a's pages to the host; b brings them back
    host0 = llm.engine.stats()["prefix_cache_host_hits"]
    with held_pages(llm, keep_free=12):
        for p in (a, t1, t2):
            drive(llm, [prompt(p)], [SHORT])
        (back,) = drive(llm, [prompt(b)], [SHORT])
    assert back.num_cached_tokens == 48 and llm.engine.stats()["prefix_cache_host_hits"] - host0 == 3
    assert back.outputs[0].token_ids == cold[0]

    # preemption: 3 requests sharing b's first 2 pages need 2 + 3 x 3 pages at their longest (76 tokens) but get
    # 8; a preempted one is recomputed (or re-hits its own cached pages) and must continue as it would have
    llm.reset_prefix_cache()
    before = llm.engine.scheduler.num_preemptions
    with held_pages(llm, keep_free=8):
        outs = llm.generate([prompt(p) for p in family],
                            [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 3)
    assert llm.engine.scheduler.num_preemptions > before
    assert [t[:4] for t in tokens(outs)] == cold


WINDOWS = [(s, s + 40) for s in range(0, 400, 50)]  # 8 corpus windows of 40 tokens


@pytest.fixture(scope="module")
def f32_tokens(smollm2_llm) -> list[list[int]]:
    ids = smollm2_llm.tokenizer.encode(CORPUS)
    return tokens(smollm2_llm.generate([prompt(ids[a:b]) for a, b in WINDOWS], [GREEDY] * len(WINDOWS)))


@pytest.mark.slow
def test_greedy_tokens_mostly_agree_with_the_f32_cache(quantized: LLM, corpus: list[int],
                                                       f32_tokens: list[list[int]]) -> None:
    """First 8 greedy tokens of 8 corpus windows, quantized vs f32 cache, compared up to the first difference.

    Measured (this machine, jax 0.12): int8 kept [8, 8, 8, 8, 8, 7, 1, 8] tokens, fp8 [7, 8, 8, 8, 8, 7, 1, 8]:
    87.5% and 86% of the tokens, 6 and 5 windows whole; window 6 sits on a near-tie (f32 top-2 logits 0.3 apart).
    Bounds: 75% of the tokens and half the windows whole.
    """
    quantized.reset_prefix_cache()
    got = tokens(quantized.generate([prompt(corpus[a:b]) for a, b in WINDOWS], [GREEDY] * len(WINDOWS)))
    same = [next((i for i, (x, y) in enumerate(zip(g, w)) if x != y), len(w)) for g, w in zip(got, f32_tokens)]
    assert sum(same) >= 0.75 * 8 * len(WINDOWS), same
    assert sum(s == 8 for s in same) >= len(WINDOWS) // 2, same
