"""SmolLM2's perplexity through the engine against an independent implementation's figure.

HF transformers scores SmolLM2-135M-Instruct in f32 on the first 2,048 tokens of the GPL-3 licence text
(/usr/share/common-licenses/GPL-3, copied verbatim to tests/data/GPL-3.txt) at perplexity 19.66 (mean NLL 2.9786; issue 9). `jaxinfer bench quality`
computes the same through `ModelRunner.compute_logits` in prefill chunks over the paged cache; the two must agree
within 0.5%, and chunking must not change the result.
"""

from __future__ import annotations

import math

import pytest

from jaxinfer.benchmarks import quality


def _script():
    return quality


@pytest.mark.slow
def test_smollm2_perplexity_matches_hf_transformers():
    from jaxinfer.llm import LLM

    ev = _script()
    llm = LLM(dtype="float32", warmup=False, enable_prefix_caching=False, max_num_batched_tokens=512,
              kv_cache_memory_bytes=256 << 20)
    ids = llm.tokenizer.encode(ev.GPL3.read_text(encoding="utf-8"))[:2048]
    assert len(ids) == 2048
    nll = ev.mean_nll(llm, ids, chunk=512)
    assert abs(math.exp(nll) / ev.REFERENCE_PPL - 1) < 0.005, math.exp(nll)
    assert abs(ev.mean_nll(llm, ids[:700], chunk=700) - ev.mean_nll(llm, ids[:700], chunk=96)) < 1e-4


# ---- quantized weights against the bf16 model (issue 9's quality bar) -------------------------------------------

# Relative perplexity bound against bf16 (2,048 tokens) and the least top-1 agreement with bf16, per format. The issue
# sets 1% for int8 and 2% for fp8: weight-only int8 and fp8 (embedding and LM head bf16, its default) meet them
# (measured +0.5% and +1.5%). int8 with dynamic per-token int8 activations (w8a8) amplifies rounding: every
# activation row is rounded to 127 levels, and a last-bit change upstream moves values across those levels, so its
# figure depends on XLA:CPU's kernels while bf16's barely does. Measured w8a8 (bf16 baseline): +1.58% on an AMD Zen 5;
# +2.95% on an AMD EPYC Zen 3, where the same machine gives +2.16% with XLA's oneDNN dots and +1.94% with YNNPACK
# fusions off (bf16 itself moves 0.3% there). Its bound, 4%, is the largest of those plus their 1-point spread;
# BENCHMARKS.md says why w8a8 loses quality (the activation rounding, not the weights). Top-1 agreement measured:
# 94.9%, 90.9%, 84.4% (83.6% on the Zen 3); the bounds leave ~2 points.
QUALITY = {
    "int8 (weight-only, the default)": ("int8", 0.01, 0.93),
    "fp8": ("fp8", 0.02, 0.89),
    "int8 w8a8": ({"format": "int8", "quantize_activations": True}, 0.04, 0.82),
}


@pytest.fixture(scope="module")
def bf16_reference():
    ev = _script()
    llm = ev.make_llm(None, "bfloat16", 512)
    ids = llm.tokenizer.encode(ev.GPL3.read_text(encoding="utf-8"))[:2048]
    logits = ev.eval_logits(llm, ids, 512)
    return ids, ev.nll_of_logits(logits, ids), logits[:-1].argmax(-1)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(QUALITY))
def test_quantized_perplexity_and_top1_agreement_against_bf16(name, bf16_reference):
    ev = _script()
    quantization, max_rel, min_agree = QUALITY[name]
    ids, base_nll, base_top1 = bf16_reference
    llm = ev.make_llm(None, "bfloat16", 512, quantization)
    logits = ev.eval_logits(llm, ids, 512)
    rel = math.exp(ev.nll_of_logits(logits, ids) - base_nll) - 1
    agree = float((logits[:-1].argmax(-1) == base_top1).mean())
    assert rel < max_rel and agree >= min_agree, (name, rel, agree)
    assert llm.engine.weight_bytes["quantized_share"] > 0.75  # the format really is in use
