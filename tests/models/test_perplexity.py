"""SmolLM2's perplexity through the engine against an independent implementation's figure.

HF transformers scores SmolLM2-135M-Instruct in f32 on the first 2,048 tokens of the GPL-3 licence text
(/usr/share/common-licenses/GPL-3, copied verbatim to tests/data/GPL-3.txt) at perplexity 19.66 (mean NLL 2.9786; issue 9). `scripts/eval_perplexity.py`
computes the same through `ModelRunner.compute_logits` in prefill chunks over the paged cache; the two must agree
within 0.5%, and chunking must not change the result.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "eval_perplexity.py"


def _script():
    spec = importlib.util.spec_from_file_location("eval_perplexity", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_smollm2_perplexity_matches_hf_transformers():
    from jaxinfer.llm import LLM

    ev = _script()
    llm = LLM(warmup=False, enable_prefix_caching=False, max_num_batched_tokens=512, kv_cache_memory_bytes=256 << 20)
    ids = llm.tokenizer.encode(ev.GPL3.read_text(encoding="utf-8"))[:2048]
    assert len(ids) == 2048
    nll = ev.mean_nll(llm, ids, chunk=512)
    assert abs(math.exp(nll) / ev.REFERENCE_PPL - 1) < 0.005, math.exp(nll)
    assert abs(ev.mean_nll(llm, ids[:700], chunk=700) - ev.mean_nll(llm, ids[:700], chunk=96)) < 1e-4
